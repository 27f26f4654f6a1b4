"""Scoring on a pipeline of instances (docs/architecture.md §2, "Inference on pipelines of
instances"): a frozen model too large for one generation instance beside what its devices keep
is split into `pp` stages of consecutive layers, each held by one instance.

  stage 0          embedding + layers [0, L/pp)                 tokens -> hidden [mb, P+T, H]
  stage k          layers [k L/pp, (k+1) L/pp)                  hidden -> hidden
  stage pp - 1     its layers + final norm + head, then the     hidden -> the scores of
                   score itself (scoring.py's three kinds)      response_logprobs,
                                                                critic_values or
                                                                reward_model_scores

Each stage is one jitted program on its instance's mesh (the batch split over the data axes,
weights by their logical axes, as the whole model's); the caller copies the hidden states from
one instance to the next. The last stage of a tied LM head holds the embedding table too (its
head is the table). The numbers are the whole model's forward pass run as a scan over each
stage's layers: equal to the unpipelined scorer's to float rounding
(tests/test_inference_stages.py).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlhfuse_jax.models import llama
from rlhfuse_jax.models import sequences
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib

KINDS = ("reference", "critic", "reward")  # scoring.py's response_logprobs, critic_values and
# reward_model_scores, by the inference models' names (generation/fused.INFERENCE_MODELS)


def check_split(cfg: ModelConfig, pp: int, field: str, what: str = "model") -> int:
  """Layers per stage of `cfg` (the `what`: "reference", "critic" ...) split into `pp`
  stages; the error names `field`."""
  if not isinstance(pp, int) or pp < 1:
    raise ValueError(f"{field}={pp!r}: expected an integer >= 1")
  if cfg.num_layers % pp:
    raise ValueError(f"{field}={pp}: must divide the {cfg.num_layers} layers of the {what} "
                     "(every inference model is split into that many stages of whole layers)")
  return cfg.num_layers // pp


def stage_keys(cfg: ModelConfig, pp: int, stage: int) -> tuple:
  """Top-level parameter groups stage `stage` holds besides its layers."""
  keys = []
  if stage == 0 or (stage == pp - 1 and cfg.head == "lm" and cfg.tie_embeddings):
    keys.append("embed")
  if stage == pp - 1:
    keys.append("head")
  return tuple(keys)


def stage_params(cfg: ModelConfig, params: Any, pp: int, stage: int) -> dict:
  """Stage `stage` of the unpipelined `params` (unrolled layers_i or scanned; numpy, jax arrays
  or, under jax.eval_shape, abstract): {"layers": {"block": leaves [L/pp, ...]}} plus
  `stage_keys`. Only this stage's layers are sliced, so a device-held model is copied one
  stage at a time."""
  per = check_split(cfg, pp, "inference pp")
  lo = stage * per
  if "layers_0" in params:
    layers = llama.stack_layers({f"layers_{j}": params[f"layers_{lo + j}"] for j in range(per)},
                                per)["layers"]
  else:
    layers = {"block": jax.tree.map(lambda x: x[lo:lo + per], params["layers"]["block"])}
  out = {k: params[k] for k in stage_keys(cfg, pp, stage)}
  out["layers"] = layers
  return out


def _stacked_cfg(cfg: ModelConfig, pp: int) -> ModelConfig:
  return cfg.replace(scan_layers=True, num_layers=cfg.num_layers // pp)


@functools.lru_cache(maxsize=None)
def _stage_specs(cfg: ModelConfig, pp: int, stage: int) -> dict:
  specs = llama.logical_specs(_stacked_cfg(cfg, pp))
  out = {k: specs[k] for k in stage_keys(cfg, pp, stage)}
  out["layers"] = specs["layers"]
  return out


def stage_shardings(cfg: ModelConfig, params: dict, pp: int, stage: int, mesh: Mesh) -> Any:
  """NamedShardings of `stage_params`' tree on `mesh`, by the parameters' logical axes."""
  return mesh_lib.param_shardings(params, _stage_specs(cfg, pp, stage), mesh)


def stage_nbytes(cfg: ModelConfig, params: Any, pp: int, stage: int) -> int:
  """Bytes of stage `stage`'s weights (what the instance holding it loads)."""
  shapes = jax.eval_shape(lambda p: stage_params(cfg, p, pp, stage), params)
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(shapes)))


# One jitted program per (model, stage role, shapes, mesh); static by name only (scoring.py).
@functools.partial(jax.jit, static_argnames=("cfg", "pp", "first", "mesh"))
def hidden(cfg: ModelConfig, params, x, *, pp: int, first: bool, mesh: Optional[Mesh] = None):
  """A stage before the last: tokens [mb, P+T] (first) or hidden [mb, P+T, H] -> hidden."""
  layer_cfg = _stacked_cfg(cfg, pp)
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES):
    if first:
      x = llama.embed_tokens(cfg, params["embed"], x)
    return llama.run_layers(layer_cfg, params["layers"]["block"], x)


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "pp", "num_response",
                                             "temperature", "mesh"))
def scores(cfg: ModelConfig, params, x, tokens, prompt_lens, response_lens, *, kind: str,
           pp: int, num_response: int, temperature: float = 1.0,
           mesh: Optional[Mesh] = None):
  """The last stage: hidden [mb, P+T, H] -> reference log-probs [mb, T] ('reference'), critic
  values [mb, T] ('critic') or reward-model scores [mb] ('reward'), as scoring.py's
  whole-model functions compute them (the head only where it is read)."""
  if kind not in KINDS:
    raise ValueError(f"inference stage kind {kind!r}: expected one of {KINDS}")
  layer_cfg = _stacked_cfg(cfg, pp)
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES):
    x = llama.run_layers(layer_cfg, params["layers"]["block"], x)
    if kind == "reward":
      at = sequences.score_positions(tokens, prompt_lens, response_lens, cfg.score_pad_id)
      at = at[:, None]  # [mb, 1]
    else:
      at = sequences.response_positions(prompt_lens, num_response)  # [mb, T]
    h = llama.constrain_batch(jnp.take_along_axis(x, at[:, :, None], axis=1))
    out = llama.run_head(cfg, params.get("embed"), params["head"], h)
    if kind == "reward":
      return out[:, 0]
    if kind == "critic":
      return out
    targets = sequences.response_targets(tokens, at)  # [mb, T]
    return sequences.token_logprobs(out, targets, temperature)  # (one copy of the logits)
