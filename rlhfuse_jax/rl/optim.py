"""The optimizer for actor and critic: AdamW, linear warm-up + cosine decay, global-norm clipping.

Weight decay applies only to matrices by default: decaying norm scales and biases towards 0
hurts and is not what the usual LLM recipes do. A leaf is a matrix when its own shape has two
dimensions or more: a scan_layers tree (models/llama.py: layers/block, every leaf stacked on a
leading layer axis) counts that axis out, so its stacked norm gains [L, H] and biases [L, D] are
not decayed either (pipeline/stages.py's staged_decay_mask does the same for the stage-stacked
tree, two leading axes).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import optax


def lr_schedule(learning_rate: float, warmup_steps: int, total_steps: int,
                min_lr_ratio: float = 0.1) -> optax.Schedule:
  """0 -> learning_rate linearly over `warmup_steps`, then cosine to learning_rate * min_lr_ratio
  at `total_steps` (constant after)."""
  if learning_rate < 0:
    raise ValueError(f"learning_rate={learning_rate} must be >= 0")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
  if total_steps <= warmup_steps:
    raise ValueError(f"total_steps={total_steps} must be > warmup_steps={warmup_steps}")
  if not 0.0 <= min_lr_ratio <= 1.0:
    raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
  if warmup_steps == 0:
    # The same schedule; optax's warmup one logs, at INFO, that its (empty) warmup is "a
    # constant schedule", a line about nothing the user set.
    return optax.cosine_decay_schedule(init_value=learning_rate, decay_steps=total_steps,
                                       alpha=min_lr_ratio)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=learning_rate * min_lr_ratio)


def _matrices_only(params: Any) -> Any:
  mask = jax.tree_util.tree_map(lambda p: getattr(p, "ndim", 0) >= 2, params)
  layers = params.get("layers") if hasattr(params, "get") else None
  if hasattr(layers, "keys") and set(layers.keys()) == {"block"}:  # scan_layers: [L, *shape]
    mask["layers"] = jax.tree_util.tree_map(lambda p: p.ndim - 1 >= 2, layers)
  return mask


def global_norm(tree) -> jax.Array:
  """The global norm of `tree`, squared and summed in float32: optax.tree.norm does it in the
  leaves' dtype, ~1 % off for bfloat16 gradients of a real model, 10 % with many leaves. The
  logged actor/grad_norm and critic/grad_norm and the clip below all use it."""
  return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), tree))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm with `global_norm`'s float32 norm. optax's own takes the norm in
  the gradients' dtype: with bfloat16 gradients (16-bit weights without optim.master_weights)
  the clip compared a norm 1-2 % off the logged one, either way (3.547 or 3.641 for 3.620 over
  200 leaves): it let an update over the limit through, or scaled it below the limit. On float32
  gradients it runs optax's operations (same state, EmptyState: checkpoints are unchanged)."""

  def clipped(t, g_norm):
    if jnp.dtype(t.dtype).itemsize >= 4:  # float32 (or 64): optax's operations, bit for bit
      return (t / g_norm.astype(t.dtype)) * max_norm
    # 16-bit: scaled in float32 and rounded once. optax's divides by the norm rounded to the
    # leaf's dtype (8 bits for bfloat16): the clipped norm was up to 0.4 % off the limit.
    return (t.astype(jnp.float32) / g_norm * max_norm).astype(t.dtype)

  def update_fn(updates, state, params=None):
    del params
    g_norm = global_norm(updates)
    trigger = g_norm < max_norm
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, clipped(t, g_norm)), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def make_optimizer(
    learning_rate: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1,
    weight_decay: float = 0.0, grad_clip: Optional[float] = 1.0, b1: float = 0.9,
    b2: float = 0.95, eps: float = 1e-8,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = _matrices_only,
    return_schedule: bool = False,
) -> Union[optax.GradientTransformation, Tuple[optax.GradientTransformation, optax.Schedule]]:
  """AdamW with `lr_schedule(...)` and clip_by_global_norm(grad_clip) applied first.

  Args:
    grad_clip: max global gradient norm; None or 0 disables clipping.
    weight_decay_mask: optax mask (pytree or fn of params) of leaves to decay; None decays all.
    return_schedule: also return the schedule fn (step -> lr) for logging the learning rate.
  Returns:
    the transformation, or (transformation, schedule) if `return_schedule`.
  """
  if grad_clip is not None and grad_clip < 0:
    raise ValueError(f"grad_clip={grad_clip} must be >= 0 (or None to disable)")
  if weight_decay < 0:
    raise ValueError(f"weight_decay={weight_decay} must be >= 0")
  schedule = lr_schedule(learning_rate, warmup_steps, total_steps, min_lr_ratio)
  parts = []
  if grad_clip:
    parts.append(clip_by_global_norm(grad_clip))
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                           mask=weight_decay_mask))
  tx = optax.chain(*parts)
  return (tx, schedule) if return_schedule else tx


class MasterState(NamedTuple):
  """float32_master's state: the float32 weights and the wrapped optimizer's state of them."""
  master: Any
  inner: Any


def float32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Mixed precision for 16-bit weights: `inner` (clipping + AdamW) runs on a float32 copy of
  the weights kept in the optimizer state, with float32 gradients and moments, and the weights
  become that copy rounded to their own dtype after each step. Without it, AdamW's steps of
  about the learning rate round away on bfloat16 weights (1e-6 against a spacing of ~1e-4 at
  0.02). The simulator's memory model assumes this layout (sim/cost_model.py: bf16 weights,
  fp32 master and moments).

  The returned updates are float32 (new master - weights), so optax.apply_updates, which adds
  in the wider type and rounds to the weights' dtype, gives the rounded master (exactly where
  weight and master are within a factor of 2 of each other: Sterbenz's lemma)."""

  def init(params):
    # A copy even of float32 weights (jnp.asarray would return the same buffer, which the
    # update, donating both, would then donate twice).
    master = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("float32_master needs the weights: call update(grads, state, params)")
    grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
    steps, inner_state = inner.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, steps)
    updates = jax.tree.map(lambda m, p: m - jnp.asarray(p, jnp.float32), master, params)
    return updates, MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)
