"""Pipeline stages of the actor and the critic, and the PPO losses at their last stages.

A model of L layers split into P stages gives stage s the layers s*L/P .. (s+1)*L/P - 1; stage 0
also embeds the tokens, the last stage also runs the head and the loss. `StageLayout.stack` holds
the layers as leaves [P, L/P, *shape], so a pipeline axis shards them by stage and each device
keeps only its own layers; the pipeline executor splits the embedding and the head over all stage
devices and gathers them whole for the step (only their stages use them, with tied embeddings
both ends). The stage-stacked tree is a reshape of the layer stack [L, ...] of `scan_layers`
(layers/block); an unrolled model (layers_0 .. layers_{L-1}) is stacked first, to the same tree.

Losses are split over micro-batches exactly: each micro-batch's loss uses the normalisers of the
whole mini-batch (`num_tokens`, `num_seqs`), so the sum of the micro-batch losses and of their
gradients equals the loss and gradient of the mini-batch. `actor_loss` / `critic_loss` are the
unpipelined reference (the trainer's formulation on the whole mini-batch, through
models/sequences.py), against which the executor is tested.

A batch is a dict of arrays with a leading batch dim (as in the trainer's mini-batch):
  tokens [B, L] int32, prompt_lens [B], mask [B, T], old_logp [B, T], advantages [B, T],
  returns [B, T], old_values [B, T], and ref_logp [B, T] when the KL loss term is on.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from rlhfuse_jax.models import llama, sequences
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.rl import objective

# The objective and its metrics are defined once, in rl/objective.py.
ACTOR_METRICS, CRITIC_METRICS = objective.ACTOR_METRICS, objective.CRITIC_METRICS
LossConfig = objective.LossConfig


def batch_keys(loss_cfg: LossConfig) -> Tuple[str, ...]:
  keys = ("tokens", "prompt_lens", "mask", "old_logp", "advantages", "returns", "old_values")
  return keys + (("ref_logp",) if loss_cfg.kl_coef > 0 else ())


def normalisers(batch: Dict[str, jax.Array]) -> Tuple[jax.Array, jax.Array]:
  """(num_tokens, num_seqs) of a whole mini-batch, float32 scalars."""
  mask = batch["mask"].astype(jnp.float32)
  return jnp.sum(mask), jnp.float32(mask.shape[0])


# Splitting parameters into stages ---------------------------------------------------------------

def check_split(cfg: ModelConfig, num_stages: int, name: str) -> int:
  """Layers per stage; a clear error if the layers do not divide evenly."""
  if num_stages < 1:
    raise ValueError(f"{name} stages={num_stages} must be >= 1")
  if cfg.num_layers % num_stages:
    raise ValueError(f"{name}.num_layers={cfg.num_layers} must be divisible by its pipeline "
                     f"stages={num_stages} (layers are split evenly over stages)")
  return cfg.num_layers // num_stages


class StageLayout:
  """How a model's parameters split into pipeline stages, and the executor's flat gradient
  accumulator of one stage.

  The trainer holds a pipelined model as the stage-stacked tree of `stack` (layer leaves
  [S, L/S, *shape], sharded by stage row). Inside the executor a device accumulates its
  gradients in one flat float32 vector [device_size] = [its stage's layers, leaf by leaf as
  [L/S, *shape] | embed | head]: a switch branch then carries one buffer, not one per leaf, which
  keeps compiles fast; `split_accumulator` turns it back into tree blocks.
  """

  def __init__(self, cfg: ModelConfig, params: Any, num_stages: int, name: str = "model",
               reverse: bool = False):
    """`params`: the model's unpipelined tree (unrolled or scanned) or its stage-stacked tree,
    arrays or ShapeDtypeStructs (only shapes and dtypes are read). `reverse`: the stage-stacked
    tree stores the stages in reverse row order (`row`). `cfg.scan_layers` picks the form of
    the unpipelined trees `stack` takes and `unstack` returns (`scanned`)."""
    self.cfg, self.num_stages, self.reverse = cfg, num_stages, reverse
    self.scanned = cfg.scan_layers
    self.per_stage = check_split(cfg, num_stages, name)

    def one_layer(tree, lead):  # a stacked layer tree without its `lead` leading dims
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[lead:], x.dtype), tree)
    if "layers_0" in params:  # unrolled
      layer = params["layers_0"]
    elif _is_scanned(params):  # scan_layers: leaves [L, ...]
      layer = one_layer(params["layers"]["block"], 1)
    else:  # stage-stacked: leaves [S, L/S, ...]
      layer = one_layer(params["layers"], 2)
    self._layer_leaves, self._layer_def = _shapes(layer)
    self._embed_leaves, self._embed_def = _shapes(params["embed"])
    self._head_leaves, self._head_def = _shapes(params["head"])
    self.layer_size = sum(math.prod(s) for s in self._layer_leaves)
    self.stage_size = self.per_stage * self.layer_size
    self.embed_size = sum(math.prod(s) for s in self._embed_leaves)
    self.head_size = sum(math.prod(s) for s in self._head_leaves)
    self.device_size = self.stage_size + self.embed_size + self.head_size
    dtypes = {x.dtype for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
      raise ValueError(f"{name} parameters mix dtypes {sorted(map(str, dtypes))}")
    self.dtype = dtypes.pop()

  @classmethod
  def for_config(cls, cfg: ModelConfig, num_stages: int, name: str = "model",
                 reverse: bool = False) -> "StageLayout":
    """The layout of `cfg`'s parameters (shapes from jax.eval_shape: nothing is allocated)."""
    return cls(cfg, llama.param_shapes(cfg), num_stages, name, reverse)

  def device_offset(self, key: str) -> int:
    """Offset of "layers" / "embed" / "head" in a device accumulator [device_size]."""
    return {"layers": 0, "embed": self.stage_size,
            "head": self.stage_size + self.embed_size}[key]

  def add(self, acc: jax.Array, key: str, grads: Any) -> jax.Array:
    """acc[segment of key] += ravel(grads) (grads of that part of one stage's tree)."""
    g = jnp.concatenate([x.reshape(-1).astype(acc.dtype) for x in jax.tree.leaves(grads)])
    offset = self.device_offset(key)
    seg = lax.dynamic_slice_in_dim(acc, offset, g.shape[0])
    return lax.dynamic_update_slice_in_dim(acc, seg + g, offset, 0)

  # The stage-stacked tree: how the trainer holds a pipelined model (docs/architecture.md §3).
  # {"embed": ..., "layers": {leaf: [S, L/S, *shape]}, "head": ...}: row s of every layer leaf
  # holds stage s's layers, so a pipeline axis shards the rows and each device keeps only its
  # stage's parameters, gradients and optimizer moments. A `reverse` layout stores the stages in
  # reverse row order (row j = stage S-1-j): the critic, placed in the reverse direction.

  def row(self, stage: int) -> int:
    """The row of the stage-stacked tree that holds `stage` (and the stage row `stage` holds:
    the map is its own inverse)."""
    return self.num_stages - 1 - stage if self.reverse else stage

  def _in_row_order(self, x: Any) -> Any:
    """A leaf [S, ...] in stage order <-> in row order (a flip of a reverse layout's rows)."""
    return x[::-1] if self.reverse else x

  def stack(self, params: Any) -> Dict[str, Any]:
    """Unpipelined params -> the stage-stacked tree: the layer stack [L, ...] of scan_layers
    reshaped to [S, L/S, ...] (row s = layers s*L/S .. (s+1)*L/S - 1), the rows flipped for a
    reverse layout. An unrolled model (layers_0 .. layers_{L-1}) is stacked first
    (llama.stack_layers)."""
    self._check_form(params)
    staged = llama.stage_stack(params, self.cfg.num_layers, self.num_stages)
    leaves = [self._in_row_order(x) for x in jax.tree.leaves(staged["layers"])]
    return {**staged, "layers": jax.tree.unflatten(self._layer_def, leaves)}

  def unstack(self, staged: Dict[str, Any]) -> Dict[str, Any]:
    """The stage-stacked tree -> unpipelined params in the model's form (cfg.scan_layers):
    rows back in stage order and reshaped to the layer stack [L, ...] (layers/block), unrolled
    into layers_0 .. layers_{L-1} (llama.unstack_layers) for an unrolled model."""
    num_layers = self.cfg.num_layers
    block = jax.tree.map(lambda x: self._in_row_order(x).reshape((num_layers,) + x.shape[2:]),
                         staged["layers"])
    params = {"embed": staged["embed"], "layers": {"block": block}, "head": staged["head"]}
    return params if self.scanned else llama.unstack_layers(params)

  def _check_form(self, params: Any) -> None:
    """`stack` takes the model's own form (llama.stack_layers / unstack_layers convert)."""
    if self.scanned != _is_scanned(params):
      form = "scanned (layers/block)" if _is_scanned(params) else "unrolled (layers_i)"
      raise ValueError(f"params are {form}, but the model's cfg.scan_layers={self.scanned}")

  def staged_shapes(self) -> Dict[str, Any]:
    """jax.ShapeDtypeStruct tree of the stage-stacked parameters (no placement)."""
    def structs(shapes, treedef, lead=()):
      return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(lead + s, self.dtype)
                                          for s in shapes])
    return {"embed": structs(self._embed_leaves, self._embed_def),
            "layers": structs(self._layer_leaves, self._layer_def,
                              (self.num_stages, self.per_stage)),
            "head": structs(self._head_leaves, self._head_def)}

  def local_tree(self, local: Dict[str, Any]) -> Dict[str, Any]:
    """Inside the executor: a device's block of the stage-stacked tree (layer leaves
    [1, L/S, ...]) -> its stage's {"layers" (leaves [L/S, ...]), "embed", "head"}."""
    return {"layers": jax.tree.map(lambda x: x[0], local["layers"]), "embed": local["embed"],
            "head": local["head"]}

  def split_accumulator(self, acc: jax.Array) -> Tuple[Any, Any, Any]:
    """A device accumulator [device_size] -> (layers with leaves [1, L/S, ...], embed, head)."""
    layers = _unravel(acc[:self.stage_size], [(1, self.per_stage) + s for s in self._layer_leaves],
                      self._layer_def)
    tail = acc[self.stage_size:]
    return (layers, _unravel(tail[:self.embed_size], self._embed_leaves, self._embed_def),
            _unravel(tail[self.embed_size:], self._head_leaves, self._head_def))


def staged_decay_mask(staged: Dict[str, Any]) -> Dict[str, Any]:
  """The weight-decay mask of rl/optim.py (matrices only) for a stage-stacked tree: a layer
  leaf [S, L/S, *shape] is a matrix when its own shape is."""
  mask = jax.tree.map(lambda x: x.ndim >= 2, staged)
  mask["layers"] = jax.tree.map(lambda x: x.ndim - 2 >= 2, staged["layers"])
  return mask


def _is_scanned(params: Any) -> bool:
  """Whether an unpipelined tree is in the scan_layers form (llama.stack_layers): its layers one
  subtree layers/block of leaves [L, ...]. (A stage-stacked tree's "layers" is a layer's tree,
  which has no "block".)"""
  layers = params.get("layers")
  return hasattr(layers, "keys") and set(layers.keys()) == {"block"}


def _shapes(tree: Any) -> Tuple[list, Any]:
  leaves, treedef = jax.tree.flatten(tree)
  return [tuple(x.shape) for x in leaves], treedef


def _unravel(vec: jax.Array, shapes: list, treedef: Any) -> Any:
  leaves, offset = [], 0
  for shape in shapes:
    size = math.prod(shape)
    leaves.append(vec[offset:offset + size].reshape(shape))
    offset += size
  return jax.tree.unflatten(treedef, leaves)


# Stage computations -----------------------------------------------------------------------------

# The stage computations are the model's own (models/llama.py: also the pipelined scoring's,
# inference/stages.py); named here as the executor and the tests call them.
embed = llama.embed_tokens
blocks = llama.run_layers
head = llama.run_head


VocabAxis = Optional[Tuple[str, int]]  # (mesh axis, its size) the LM head's vocabulary splits over


def vocab_parallel(cfg: ModelConfig, tensor: int) -> VocabAxis:
  """("tensor", size) when the actor's LM head and loss split their vocabulary over `tensor`
  (Megatron's vocabulary-parallel head: each device computes V/tp logits); None where they run
  whole: no tensor axis, a scalar head, a tied head (the embedding table's lookup gradient is
  whole on every device, so its two halves could not be summed alike) or V not divisible."""
  if tensor > 1 and cfg.head == "lm" and not cfg.tie_embeddings and cfg.vocab_size % tensor == 0:
    return ("tensor", tensor)
  return None


def vocab_parallel_logprobs(cfg: ModelConfig, head_params: Any, x: jax.Array,
                            targets: jax.Array, temperature: float, vocab: Tuple[str, int]
                            ) -> Tuple[jax.Array, jax.Array]:
  """sequences.token_logprobs_and_entropy of the untied LM head on hidden x [..., H], with this
  device's V/tp columns of the head (inside a shard_map whose manual axes include vocab[0]).

  The head's input gradient is summed over the axis on the way back (llama.tp_enter); the
  softmax's sums, the target's logit and the entropy's sum are summed over it on the way out
  (llama.tp_exit, identity backward), so every device ends with the same log-probs and each
  back-propagates into its own columns only (the rest of its head gradient is zero: the
  executor sums the head's gradients over the axis)."""
  axis, size = vocab
  local = cfg.vocab_size // size
  start = lax.axis_index(axis) * local
  h = llama.RMSNorm(cfg).apply({"params": head_params["final_norm"]}, x)
  w = lax.dynamic_slice_in_dim(head_params["lm_head"], start, local, axis=1)  # [H, V/tp]
  with llama.tensor_parallel(axis):
    h = llama.tp_enter(h)
    logits = (h.astype(jnp.float32) @ w.astype(jnp.float32)) / temperature  # [..., V/tp]
    top = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), axis)  # a shift: no gradient
    e = jnp.exp(logits - top[..., None])
    # Only sums over this device's columns are summed over the axis: no value the devices share
    # flows back into a per-device term, so each device's gradient is its columns' own.
    total = llama.tp_exit(jnp.sum(e, axis=-1))  # sum_v exp(l_v - top)
    lse = top + jnp.log(total)
    mine = (targets >= start) & (targets < start + local)
    idx = jnp.clip(targets - start, 0, local - 1).astype(jnp.int32)
    hit = jnp.take_along_axis(logits, idx[..., None], axis=-1)[..., 0]
    logp = llama.tp_exit(jnp.where(mine, hit, 0.0)) - lse
    # entropy = log(total) - sum_v p_v (l_v - top), on the shifted logits: as lse - sum_v p_v l_v
    # it was a difference of two numbers of the logits' size (1e-5..1e-4 off at |l| ~ 100-1000,
    # where the whole head's log_softmax is exact to 1e-7); a -inf entry adds 0, not nan
    shifted = e * jnp.where(e > 0, logits - top[..., None], 0.0)  # (no nan gradient either)
    mean_shifted = llama.tp_exit(jnp.sum(shifted, axis=-1)) / total
  return logp, jnp.log(total) - mean_shifted


def _at_response(x: jax.Array, prompt_lens: jax.Array, num_response: int) -> jax.Array:
  """Hidden states at the positions that predict (or value) the response tokens: [mb, T, H]."""
  pos = sequences.response_positions(prompt_lens, num_response)  # [mb, T]
  return jnp.take_along_axis(x, pos[:, :, None], axis=1)


def actor_head_loss(cfg: ModelConfig, loss_cfg: LossConfig, embed_params: Any, head_params: Any,
                    x: jax.Array, mb: Dict[str, jax.Array], num_tokens: jax.Array,
                    num_seqs: jax.Array, vocab: VocabAxis = None
                    ) -> Tuple[jax.Array, jax.Array]:
  """One micro-batch's share of the actor loss from the last stage's hidden [mb, L, H].

  Returns (loss, metrics [len(ACTOR_METRICS)]): summing both over the micro-batches of a
  mini-batch gives the mini-batch's loss and metrics (rl/objective.py). vocab: the axis the
  head's vocabulary splits over (vocab_parallel), or None: the head runs whole.
  """
  t = mb["mask"].shape[1]
  h = _at_response(x, mb["prompt_lens"], t)
  pos = sequences.response_positions(mb["prompt_lens"], t)
  targets = sequences.response_targets(mb["tokens"], pos)  # [mb, T]
  if vocab is not None:
    logp, entropy = vocab_parallel_logprobs(cfg, head_params, h, targets, loss_cfg.temperature,
                                            vocab)
  else:
    logits = head(cfg, embed_params, head_params, h)
    logp, entropy = sequences.token_logprobs_and_entropy(logits, targets, loss_cfg.temperature)
  loss, m = objective.actor_objective(loss_cfg, logp, entropy, mb, num_tokens, num_seqs)
  return loss, jnp.stack([m[k] for k in ACTOR_METRICS])


def critic_head_loss(cfg: ModelConfig, loss_cfg: LossConfig, embed_params: Any, head_params: Any,
                     x: jax.Array, mb: Dict[str, jax.Array], num_tokens: jax.Array,
                     num_seqs: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """One micro-batch's share of the critic loss; metrics [len(CRITIC_METRICS)]."""
  del num_seqs  # the value loss is a token mean
  t = mb["mask"].shape[1]
  values = head(cfg, embed_params, head_params, _at_response(x, mb["prompt_lens"], t))  # [mb, T]
  loss, m = objective.critic_objective(loss_cfg, values, mb, num_tokens)
  return loss, jnp.stack([m[k] for k in CRITIC_METRICS])


# Unpipelined reference losses -------------------------------------------------------------------

def actor_loss(cfg: ModelConfig, loss_cfg: LossConfig, params: Any,
               batch: Dict[str, jax.Array], num_tokens: Optional[jax.Array] = None,
               num_seqs: Optional[jax.Array] = None
               ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """The actor loss of a whole mini-batch without a pipeline: the plain update's
  (trainer/ppo.py), and the reference the executor is tested against. With the mini-batch's
  `normalisers`, `batch` is one of its micro-batches and the loss and metrics are its shares
  (the plain update's gradient accumulation)."""
  logp, entropy = sequences.response_logprobs_and_entropy(
      cfg, params, batch["tokens"], batch["prompt_lens"], batch["mask"].shape[1],
      loss_cfg.temperature)
  return objective.actor_objective(loss_cfg, logp, entropy, batch, num_tokens, num_seqs)


def critic_loss(cfg: ModelConfig, loss_cfg: LossConfig, params: Any,
                batch: Dict[str, jax.Array], num_tokens: Optional[jax.Array] = None,
                num_seqs: Optional[jax.Array] = None
                ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """The critic loss of a whole mini-batch without a pipeline (or a micro-batch's share, as
  actor_loss)."""
  del num_seqs  # the value loss is a token mean
  values = sequences.response_values(cfg, params, batch["tokens"], batch["prompt_lens"],
                                     batch["mask"].shape[1])
  return objective.critic_objective(loss_cfg, values, batch, num_tokens)


def reference_grads(actor_cfg: ModelConfig, critic_cfg: ModelConfig, loss_cfg: LossConfig,
                    actor_params: Any, critic_params: Any, batch: Dict[str, jax.Array]):
  """jax.grad of the unpipelined losses: (actor grads, critic grads, metrics)."""
  (_, am), ag = jax.value_and_grad(actor_loss, argnums=2, has_aux=True)(
      actor_cfg, loss_cfg, actor_params, batch)
  (_, cm), cg = jax.value_and_grad(critic_loss, argnums=2, has_aux=True)(
      critic_cfg, loss_cfg, critic_params, batch)
  return ag, cg, {**am, **cm}
