"""Advantage estimators: GAE (with a critic) and critic-free GRPO, Dr. GRPO, RLOO, REINFORCE++ and
REINFORCE++-baseline.

All inputs and outputs are per response token, `[batch, resp_len]`, with `mask` 1.0 on real
response tokens (EOS included) and 0.0 on the padding after the end. Every estimator returns
`(advantages, returns)`, both exactly 0 on padding; `returns` is the critic's regression target
for GAE and equals the advantages for the critic-free estimators (there is no critic to train).

Reverse recursions (GAE, discounted returns) run as a reverse `lax.scan` over time. Padding
positions are transparent: the carried "next" value/advantage passes through them unchanged, and
it starts at 0 beyond the last position. So the value after a sequence's last valid token is 0
(the episode ended), sequences of different lengths in one batch are each handled correctly, and
a mask with holes (e.g. tool-output tokens in a multi-turn response) skips the holes.

The group estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline: those taking `group_size`)
compare the samples of one prompt: the batch is laid out as consecutive groups of `group_size`
samples of the same prompt (`[prompt0 x n, prompt1 x n, ...]`); REINFORCE++ whitens over the
whole batch instead (and REINFORCE++-baseline after centring each group's scores).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp

from rlhfuse_jax.rl import masked

Pair = Tuple[jax.Array, jax.Array]


def token_level_rewards(scores: jax.Array, kl: jax.Array, mask: jax.Array,
                        kl_coef: float) -> jax.Array:
  """Per-token rewards: `-kl_coef * kl` on every valid token plus the sequence score at the last.

  Args:
    scores: `[batch]` sequence-level reward (reward model or reward function).
    kl: `[batch, resp_len]` per-token KL estimate to the reference (see `kl.kl_estimate`).
    mask: `[batch, resp_len]` response mask.
    kl_coef: weight of the KL penalty (0 disables it).
  Returns:
    `[batch, resp_len]` rewards, 0 on padding. A row without any valid token gets no score.
  """
  valid = mask > 0  # [batch, resp_len]
  resp_len = mask.shape[-1]
  # Last valid index = resp_len - 1 - (first valid index from the end).
  last = resp_len - 1 - jnp.argmax(valid[:, ::-1], axis=-1)  # [batch]
  has_any = jnp.any(valid, axis=-1)  # [batch]
  at_last = jax.nn.one_hot(last, resp_len, dtype=jnp.float32) * has_any[:, None]
  rewards = -kl_coef * kl.astype(jnp.float32) + scores.astype(jnp.float32)[:, None] * at_last
  return jnp.where(valid, rewards, 0.0)


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float,
        lam: float) -> Pair:
  """Generalised advantage estimation (Schulman et al., 2016).

  delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
  with t+1 the next VALID token and V, A = 0 after the last valid token.

  Args:
    rewards: `[batch, resp_len]` per-token rewards (e.g. from `token_level_rewards`).
    values: `[batch, resp_len]` critic values V(s_t) of the state before token t.
    mask, gamma, lam: response mask, discount, GAE lambda.
  Returns:
    advantages, returns (= advantages + values): `[batch, resp_len]`, 0 on padding.
  """
  valid = mask > 0
  rewards = jnp.where(valid, rewards.astype(jnp.float32), 0.0)
  values = jnp.where(valid, values.astype(jnp.float32), 0.0)

  def step(carry, xs):
    next_value, next_adv = carry  # [batch] each
    r, v, m = xs
    delta = r + gamma * next_value - v
    adv = delta + gamma * lam * next_adv
    # Padding passes the carry through untouched, so each row's recursion only sees its tokens.
    carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
    return carry, jnp.where(m, adv, 0.0)

  batch = rewards.shape[0]
  init = (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.float32))
  xs = (rewards.T, values.T, valid.T)  # time-major: [resp_len, batch]
  _, adv_t = jax.lax.scan(step, init, xs, reverse=True)
  advantages = adv_t.T  # [batch, resp_len]
  returns = jnp.where(valid, advantages + values, 0.0)
  return advantages, returns


def discounted_returns(rewards: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
  """G_t = r_t + gamma * G_{t+1} over valid tokens (padding transparent), `[batch, resp_len]`."""
  valid = mask > 0
  rewards = jnp.where(valid, rewards.astype(jnp.float32), 0.0)

  def step(next_return, xs):
    r, m = xs
    ret = r + gamma * next_return
    return jnp.where(m, ret, next_return), jnp.where(m, ret, 0.0)

  init = jnp.zeros((rewards.shape[0],), jnp.float32)
  _, ret_t = jax.lax.scan(step, init, (rewards.T, valid.T), reverse=True)
  return ret_t.T


def _check_groups(batch: int, group_size: int, min_group: int) -> None:
  if group_size < min_group:
    raise ValueError(f"group_size={group_size} must be >= {min_group} for group-relative "
                     "advantages (each prompt needs several samples to compare)")
  if batch % group_size:
    raise ValueError(f"batch size {batch} (scores.shape[0]) must be divisible by "
                     f"group_size={group_size}: samples of one prompt are laid out consecutively")


def grpo_advantages(scores: jax.Array, mask: jax.Array, group_size: int, eps: float = 1e-6,
                    normalize_std: bool = True) -> Pair:
  """GRPO (Shao et al., 2024, DeepSeekMath): A_i = (s_i - mean_group) / (std_group + eps).

  The same advantage is given to every valid token of sample i. `normalize_std=False` gives the
  Dr. GRPO variant (mean-centred only; `dr_grpo_advantages`, estimator "dr_grpo"). The std is
  the unbiased one (ddof=1), as in common implementations, so `group_size` must be >= 2.

  Args:
    scores: `[batch]` sequence rewards, batch = num_prompts * group_size.
    mask: `[batch, resp_len]` response mask.
  Returns:
    advantages, returns (identical): `[batch, resp_len]`.
  """
  _check_groups(scores.shape[0], group_size, 2)
  grouped = scores.astype(jnp.float32).reshape(-1, group_size)  # [num_prompts, group_size]
  # Divided by a power of two (exactly) that brings the group's largest score below 4: the
  # squares of the std cannot overflow. Scores beyond ~1.8e19 had an infinite std, and every
  # sample of the group got an advantage of 0.
  scale = masked.power_of_two_scale(jnp.max(jnp.abs(grouped), axis=-1, keepdims=True))
  grouped = grouped / scale
  # Shifted by the group's first score first: a group whose scores tie is then exactly zero.
  # Unshifted, the float32 mean of e.g. eight 0.1s is off by ~1e-8, its std is ~1e-8 too, and
  # eps does not hide it: every sample got the same advantage, up to about +-0.1.
  grouped = grouped - grouped[:, :1]
  centred = grouped - jnp.mean(grouped, axis=-1, keepdims=True)
  if normalize_std:
    std = jnp.std(grouped, axis=-1, keepdims=True, ddof=1)
    centred = centred / (std + masked.scaled_eps(eps, scale))  # 0 / 0 for a tie unfloored
  else:
    centred = centred * scale
  adv = jnp.where(mask > 0, centred.reshape(-1)[:, None], 0.0)  # [batch, resp_len]
  return adv, adv


def dr_grpo_advantages(scores: jax.Array, mask: jax.Array, group_size: int) -> Pair:
  """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective"): A_i = s_i - mean_group, GRPO without the division by the group's std (which
  weights groups of nearly tied scores up). The paper also replaces the per-sequence length
  mean of the loss by a constant: pair it with `algo.loss_agg='seq-mean-token-sum-norm'`."""
  return grpo_advantages(scores, mask, group_size, normalize_std=False)


def rloo_advantages(scores: jax.Array, mask: jax.Array, group_size: int) -> Pair:
  """REINFORCE leave-one-out (Ahmadian et al., 2024): A_i = s_i - mean_{j != i} s_j.

  Equal to group_size / (group_size - 1) * (s_i - mean_group). Broadcast over valid tokens.
  """
  _check_groups(scores.shape[0], group_size, 2)
  grouped = scores.astype(jnp.float32).reshape(-1, group_size)  # [num_prompts, group_size]
  # Shifted by the group's first score, as in grpo_advantages (the estimator is shift-invariant):
  # unshifted, the float32 sum of four scores near 3e5 is rounded to a multiple of 0.125, and
  # the group [3e5 + 0.1, 3e5, 3e5, 3e5 + 0.1] got [0.03, -0.09, -0.09, 0.03] for +-0.0625.
  grouped = grouped - grouped[:, :1]
  others_mean = (jnp.sum(grouped, axis=-1, keepdims=True) - grouped) / (group_size - 1)
  adv = jnp.where(mask > 0, (grouped - others_mean).reshape(-1)[:, None], 0.0)
  return adv, adv


def reinforce_pp_advantages(token_rewards: jax.Array, mask: jax.Array, gamma: float) -> Pair:
  """REINFORCE++ (Hu, 2025): discounted return-to-go per token, whitened over the whole batch.

  `token_rewards` usually carry the KL penalty per token and the score at the last token
  (`token_level_rewards`). Returns (whitened advantages, whitened advantages).
  """
  returns = discounted_returns(token_rewards, mask, gamma)
  adv = masked.masked_whiten(returns, mask)
  return adv, adv


def reinforce_baseline_advantages(scores: jax.Array, token_rewards: jax.Array, mask: jax.Array,
                                  gamma: float, group_size: int) -> Pair:
  """REINFORCE++-baseline (Hu et al., 2025; OpenRLHF's "reinforce_baseline"): each sample's
  score less its group's mean score, then REINFORCE++ on it (`reinforce_pp_advantages`): the
  discounted return-to-go of the token rewards, whitened over the whole batch. Discounted by
  `gamma` as given (OpenRLHF sets its gamma to 1 for this estimator: the same at gamma 1).

  Args:
    scores: `[batch]` bare sequence scores, batch = num_prompts * group_size.
    token_rewards: `[batch, resp_len]` the score at the last valid token plus the KL penalty on
      every token (`token_level_rewards`): only the score is centred, the penalty stays per
      token (as OpenRLHF adds the KL after centring the scores).
    mask, gamma, group_size: response mask, discount, samples per prompt (>= 2).
  Returns:
    (whitened advantages, whitened advantages): `[batch, resp_len]`, 0 on padding.
  """
  _check_groups(scores.shape[0], group_size, 2)
  scores = scores.astype(jnp.float32)
  grouped = scores.reshape(-1, group_size)  # [num_prompts, group_size]
  # Centred as a shift of the group's first score, as in rloo_advantages: a tied group is then
  # exactly 0, and scores far from zero keep their differences (the float32 mean of 3e5 + 0.1,
  # 3e5 and 3e5 + 0.25 is a multiple of 0.03: each sample's advantage was off by up to that).
  shifted = grouped - grouped[:, :1]
  centred = (shifted - jnp.mean(shifted, axis=-1, keepdims=True)).reshape(-1)  # [batch]
  # The score at the last valid token (where token_level_rewards put it) swapped for the centred
  # one, in two steps: the score and its token reward cancel exactly, the penalty is left.
  def at_last(v):  # [batch] -> [batch, resp_len], v at each row's last valid token
    return token_level_rewards(v, jnp.zeros(mask.shape, jnp.float32), mask, 0.0)

  shaped = (token_rewards.astype(jnp.float32) - at_last(scores)) + at_last(centred)
  return reinforce_pp_advantages(shaped, mask, gamma)


def _gae_on_token_rewards(token_rewards: jax.Array, values: jax.Array, mask: jax.Array,
                          gamma: float, lam: float) -> Pair:
  return gae(token_rewards, values, mask, gamma, lam)


# What the trainer passes (trainer/ppo.advantages_and_returns), every iteration.
TRAINER_INPUTS = frozenset(
    {"scores", "token_rewards", "values", "mask", "gamma", "lam", "group_size"})


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """A registered estimator: its function, which named inputs it takes (an input whose
  parameter has a default is optional), if it needs a critic, and if it divides each prompt's
  group by the group's std (then a KL-in-reward penalty is rescaled with the scores).

  `inputs` must match the function's parameters (checked here, when the entry is made): every
  input is a parameter, and every parameter without a default, or named as an input the trainer
  passes, is an input. Unchecked, a misspelled input ('group_sise') built a run that failed at
  its first iteration with a bare TypeError, and a `group_size` parameter with a default left
  out of `inputs` was never passed: the estimator was not treated as a group estimator at all.
  A function taking **kwargs, or whose signature Python cannot read, is not checked."""
  fn: Callable[..., Pair]
  inputs: Tuple[str, ...]
  needs_critic: bool
  description: str
  group_std: bool = False

  def __post_init__(self):
    try:
      params = inspect.signature(self.fn).parameters
    except (TypeError, ValueError):
      return
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
      return
    unknown = [k for k in self.inputs if k not in params]
    unlisted = [k for k, p in params.items()
                if k not in self.inputs and p.kind != inspect.Parameter.VAR_POSITIONAL and
                (p.default is inspect.Parameter.empty or k in TRAINER_INPUTS)]
    if unknown or unlisted:
      fn = getattr(self.fn, "__qualname__", repr(self.fn))
      raise ValueError(
          f"advantage estimator {fn} ({self.description!r}): inputs={list(self.inputs)} must "
          f"name its parameters {list(params)}" +
          (f"; it takes no {unknown}" if unknown else "") +
          (f"; missing {unlisted} (a parameter without a default, or one the trainer passes: "
           f"{sorted(TRAINER_INPUTS)})" if unlisted else ""))


ADVANTAGE_ESTIMATORS: Dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(
        _gae_on_token_rewards,
        ("token_rewards", "values", "mask", "gamma", "lam"), True,
        "GAE over per-token rewards with critic values"),
    "grpo": AdvantageEstimator(
        grpo_advantages, ("scores", "mask", "group_size", "eps", "normalize_std"), False,
        "group-normalised sequence scores", group_std=True),
    "dr_grpo": AdvantageEstimator(
        dr_grpo_advantages, ("scores", "mask", "group_size"), False,
        "group mean-centred sequence scores (no std division)"),
    "rloo": AdvantageEstimator(
        rloo_advantages, ("scores", "mask", "group_size"), False,
        "leave-one-out baseline within each group"),
    "reinforce_pp": AdvantageEstimator(
        reinforce_pp_advantages, ("token_rewards", "mask", "gamma"), False,
        "discounted per-token returns, batch-whitened"),
    "reinforce_baseline": AdvantageEstimator(
        reinforce_baseline_advantages, ("scores", "token_rewards", "mask", "gamma", "group_size"),
        False, "group mean-centred scores, then REINFORCE++"),
}

# Inputs a caller may pass to any estimator; each estimator picks the ones it uses.
KNOWN_INPUTS = frozenset(
    name for est in ADVANTAGE_ESTIMATORS.values() for name in est.inputs) | {"scores"}


def required_inputs(name: str) -> Tuple[str, ...]:
  """The inputs estimator `name` takes whose parameters have no default. What a signature does
  not show is optional: an input a **kwargs parameter takes, any input of a function whose
  signature Python cannot read (a wrapper without functools.wraps, a C function); such an
  estimator reports a missing input itself when called."""
  est = get_estimator(name)
  try:
    params = inspect.signature(est.fn).parameters
  except (TypeError, ValueError):
    return ()
  return tuple(k for k in est.inputs
               if k in params and params[k].default is inspect.Parameter.empty and
               params[k].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                      inspect.Parameter.VAR_KEYWORD))


def get_estimator(name: str) -> AdvantageEstimator:
  if name not in ADVANTAGE_ESTIMATORS:
    raise ValueError(f"Unknown advantage estimator {name!r}; known estimators: "
                     f"{sorted(ADVANTAGE_ESTIMATORS)}")
  return ADVANTAGE_ESTIMATORS[name]


def compares_groups(name: str) -> bool:
  """True if estimator `name` compares one score per sample within each prompt's group (it takes
  `group_size`): the config then needs rollout.samples_per_prompt > 1. Read from the registry,
  so a new group estimator gets the check without a hand-kept list of names. (The KL-in-reward
  penalty in its scores is keyed on `reads_scores`; the unused-gamma warning on the estimator's
  inputs, trainer/validate.py.)"""
  return "group_size" in get_estimator(name).inputs


def reads_scores(name: str) -> bool:
  """True if estimator `name` takes the sequence `scores` and not `token_rewards`: with the KL
  in the reward the trainer then passes each sample's score less its summed KL penalty (the
  sum of its token rewards), as an estimator taking `token_rewards` gets the penalty per token.
  Keyed on `scores`, not on `group_size`: a score estimator without groups (a batch-mean
  baseline) registered alone otherwise trained on the bare scores, its KL penalty in neither
  the reward nor the loss. One taking both gets the bare scores: the penalty is in its token
  rewards already (penalised scores too counted it twice)."""
  inputs = get_estimator(name).inputs
  return "scores" in inputs and "token_rewards" not in inputs


def needs_critic(name: str) -> bool:
  """True if estimator `name` needs critic values (so a critic must be run and trained)."""
  return get_estimator(name).needs_critic


def compute_advantages(name: str, **inputs: Any) -> Pair:
  """Runs estimator `name` on the inputs it needs, out of a common set the trainer can pass.

  Common inputs: `scores` [batch], `token_rewards` [batch, resp_len], `values`
  [batch, resp_len], `mask` [batch, resp_len], `gamma`, `lam`, `group_size`, optional `eps`,
  `normalize_std`. Inputs the estimator does not use are ignored; unknown names raise.
  Returns (advantages, returns), `[batch, resp_len]` each.
  """
  est = get_estimator(name)
  unknown = set(inputs) - KNOWN_INPUTS
  if unknown:
    raise ValueError(f"compute_advantages got unknown inputs {sorted(unknown)}; known inputs: "
                     f"{sorted(KNOWN_INPUTS)}")
  missing = [k for k in required_inputs(name) if inputs.get(k) is None]
  if missing:
    raise ValueError(f"advantage estimator {name!r} needs inputs {missing} "
                     f"(it takes {list(est.inputs)})")
  kwargs = {k: inputs[k] for k in est.inputs if inputs.get(k) is not None}
  return est.fn(**kwargs)
