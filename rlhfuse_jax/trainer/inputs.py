"""What the files a run reads by path held, for the resume check (docs/usage.md, faults).

The checkpoints' config fingerprint holds the paths of the files a run reads (the actor's HF
checkpoint, the tokenizer, a reward model, the prompts): a path alone let a resume read other
weights at the same path, silently (the KL reference is re-read from init.actor_checkpoint at
every start: a run whose source directory was re-exported went on against another reference,
its KL jumping from 3e-6 to 0.9), and refused the same weights at another path (a trailing
slash; a job that copies the model to node-local scratch gets a new path every time). Each
checkpoint now also stores a content fingerprint of each such input, taken as the run starts,
and a resume compares contents: another path to the same content is accepted, other content
at any path refused.

A fingerprint reads, of every file (a directory: its files, not its subdirectories), its name,
its size and three 1 MiB samples (start, middle, end), so a 130 GB checkpoint costs ~100 MB of
reads: any re-export, re-download of another revision or edit of a JSON file changes it (a
change that keeps every sampled byte and the size would pass; none of those do).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, Optional

from absl import logging

# The config fields that name files the run reads, and what each one's content decides.
PATH_FIELDS = {
    "init.actor_checkpoint": "the KL reference is read from it at every start",
    "init.tokenizer": "every prompt and response is tokenised with it",
    "reward.model_checkpoint": "it scores every response",
    "data.prompts_file": "the prompts are drawn from it",
    # Read once, by the first start: the critic's weights are in the checkpoints since.
    "init.critic_checkpoint": "",
}
SAMPLE_BYTES = 1 << 20


def _file_digest(path: str, h: Any) -> None:
  size = os.path.getsize(path)
  h.update(f"{size}\0".encode())
  with open(path, "rb") as f:
    if size <= 3 * SAMPLE_BYTES:
      h.update(f.read())
      return
    for start in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
      f.seek(start)
      h.update(f.read(SAMPLE_BYTES))


def content_fingerprint(path: str) -> Optional[str]:
  """The sampled digest of the file or directory at `path` (see the module docstring); None
  when there is nothing there (the run's own checks name a missing input)."""
  h = hashlib.sha256()
  if os.path.isfile(path):
    _file_digest(path, h)
  elif os.path.isdir(path):
    for name in sorted(os.listdir(path)):
      full = os.path.join(path, name)
      if not name.startswith(".") and os.path.isfile(full):
        h.update(f"{name}\0".encode())
        _file_digest(full, h)
  else:
    return None
  return h.hexdigest()


def fingerprints(cfg: Any) -> dict[str, str]:
  """{field: content fingerprint} of the PATH_FIELDS that the config `cfg` (a TrainConfig)
  sets to an existing path."""
  out = {}
  for field in PATH_FIELDS:
    section, name = field.split(".")
    path = getattr(getattr(cfg, section, None), name, "")
    if isinstance(path, str) and path:
      digest = content_fingerprint(path)
      if digest is not None:
        out[field] = digest
  return out


def resume_changes(changes: list[str], saved: Optional[Mapping[str, str]],
                   now: Mapping[str, str], iteration: Any) -> tuple[list[str], list[str]]:
  """(the config changes left to judge, the inputs whose content changed) on resuming
  checkpoints whose inputs' fingerprints are `saved` (None: written before they existed, when
  paths alone are compared) with this start's `now`. A path change to the same content is
  taken off `changes` (logged); other content at an input read on every start is returned as a
  line naming the field and why it matters (the critic's checkpoint, read only by the first
  start, is logged)."""
  if not saved:
    return changes, []
  left, changed = [], []
  moved = {c.split(":")[0]: c for c in changes}
  for c in changes:
    field = c.split(":")[0]
    if field in PATH_FIELDS and saved.get(field) and saved.get(field) == now.get(field):
      logging.info("resuming iteration %s with %s: the same content at the new path", iteration,
                   c)
      continue
    left.append(c)
  for field, why in PATH_FIELDS.items():
    if field in moved or not saved.get(field) or saved.get(field) == now.get(field):
      continue
    if not why:
      logging.info("config.%s holds other files than when the run started: unused on resume "
                   "(the critic's weights are in the checkpoints)", field)
      continue
    changed.append(f"{field}: its files changed since the checkpoints were written ({why})"
                   if field in now else f"{field}: no longer there ({why})")
  return left, changed
