"""The optimizer for actor and critic: AdamW, linear warm-up + cosine decay, global-norm clipping.

Weight decay applies only to matrices by default: decaying norm scales and biases towards 0
hurts and is not what the usual LLM recipes do. A leaf is a matrix when its own shape has two
dimensions or more: a scan_layers tree (models/llama.py: layers/block, every leaf stacked on a
leading layer axis) counts that axis out, so its stacked norm gains [L, H] and biases [L, D] are
not decayed either (pipeline/stages.py's staged_decay_mask does the same for the stage-stacked
tree, two leading axes).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import jax
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
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=learning_rate * min_lr_ratio)


def _matrices_only(params: Any) -> Any:
  mask = jax.tree_util.tree_map(lambda p: getattr(p, "ndim", 0) >= 2, params)
  layers = params.get("layers") if hasattr(params, "get") else None
  if hasattr(layers, "keys") and set(layers.keys()) == {"block"}:  # scan_layers: [L, *shape]
    mask["layers"] = jax.tree_util.tree_map(lambda p: p.ndim - 1 >= 2, layers)
  return mask


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
    parts.append(optax.clip_by_global_norm(grad_clip))
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                           mask=weight_decay_mask))
  tx = optax.chain(*parts)
  return (tx, schedule) if return_schedule else tx
