"""Atomic, resumable checkpoints of a training run (orbax-checkpoint).

A checkpoint holds the array state (actor/critic params and optimizer states, anything the caller
puts in the pytree) and a small JSON side-car (iteration, data position, RNG seed, config
fingerprint). Orbax writes each step into a temporary directory and renames it when complete, so a
run killed mid-save keeps its previous checkpoint; `latest_step()` only sees finished ones.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
  """Saves/restores (state pytree, metadata dict) under workdir/checkpoints/<step>."""

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Starts an (asynchronous) save; `wait()` blocks until it is durable."""
    if step in self._mngr.all_steps():
      return
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(meta)))
    logging.info("checkpoint %d: saving to %s", step, self.directory)

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def restore(self, step: int, like: Any) -> tuple[Any, dict]:
    """Restores into the structure, shapes, dtypes and shardings of `like`."""
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def restore_meta(self, step: int) -> dict:
    """The JSON side-car of checkpoint `step` alone: no array is read, nothing is built."""
    out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return out["meta"]

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()
