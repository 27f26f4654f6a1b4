"""rl/objective.py's contract with the updates that split a mini-batch (gradient accumulation,
the pipeline executor): under the mini-batch's normalisers each micro-batch's loss and every
metric are shares that add up to the whole mini-batch's. A metric added to the objective
without its share (a fraction summed over 4 micro-batches reads up to 4) fails here in seconds,
and reaches the run's log by itself (trainer/ppo.actor_metrics)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.rl import losses
from rlhfuse_jax.rl import objective
from rlhfuse_jax.rl.objective import LossConfig
from rlhfuse_jax.trainer import ppo

B, T = 8, 7
LENGTHS = np.array([7, 2, 5, 1, 6, 3, 4, 7])


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  mask = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)
  old_logp = -rng.exponential(size=(B, T)).astype(np.float32)
  f = lambda scale: rng.normal(scale=scale, size=(B, T)).astype(np.float32)
  batch = {"mask": mask, "old_logp": old_logp, "advantages": f(1.0),
           "ref_logp": old_logp + f(0.2), "old_values": f(1.0), "returns": f(1.0)}
  return old_logp + f(0.4), rng.uniform(0.5, 3.0, (B, T)).astype(np.float32), batch


# Every registered aggregation: one added to rl/losses alone must split into shares too.
@pytest.mark.parametrize("loss_agg", sorted(losses.LOSS_AGGREGATIONS))
def test_micro_batch_shares_add_up_to_the_mini_batch(loss_agg):
  cfg = LossConfig(loss_agg=loss_agg, entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3",
                   clip_ratio_c=3.0, value_clip_eps=0.1)
  logp, entropy, batch = _batch()
  whole_a = objective.actor_objective(cfg, logp, entropy, batch)[1]
  whole_c = objective.critic_objective(cfg, batch["old_values"] + 0.3, batch)[1]
  num_tokens, num_seqs = jnp.sum(batch["mask"]), jnp.float32(B)
  sums_a = dict.fromkeys(objective.ACTOR_METRICS, 0.0)
  sums_c = dict.fromkeys(objective.CRITIC_METRICS, 0.0)
  for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):  # uneven micro-batches
    part = {k: v[rows] for k, v in batch.items()}
    _, ma = objective.actor_objective(cfg, logp[rows], entropy[rows], part, num_tokens, num_seqs)
    _, mc = objective.critic_objective(cfg, part["old_values"] + 0.3, part, num_tokens)
    for k in sums_a:
      sums_a[k] += float(ma[k])
    for k in sums_c:
      sums_c[k] += float(mc[k])
  assert set(whole_a) == set(objective.ACTOR_METRICS)
  assert set(whole_c) == set(objective.CRITIC_METRICS)
  share = ("the micro-batches' values must add up to the mini-batch's: return a mean or "
           "fraction times `share` (rl/objective.py, as pg_clipfrac)")
  for k in objective.ACTOR_METRICS:
    assert sums_a[k] == pytest.approx(float(whole_a[k]), rel=1e-5, abs=1e-7), f"{k}: {share}"
  for k in objective.CRITIC_METRICS:
    assert sums_c[k] == pytest.approx(float(whole_c[k]), rel=1e-5, abs=1e-7), f"{k}: {share}"
  # the clips bind somewhere, so the fractions' shares are tested, not zeros
  assert 0 < float(whole_a["pg_clipfrac"]) < 1 and 0 < float(whole_c["vf_clipfrac"]) < 1
  # every metric of the objective is logged (the totals are not: they are sums of the rest)
  assert set(ppo.actor_metrics(cfg, whole_a)) == {
      f"actor/{k}" for k in objective.ACTOR_METRICS if k != "actor_loss"}
  assert "actor/kl_loss" not in ppo.actor_metrics(LossConfig(), whole_a)
  assert set(ppo.critic_metrics(whole_c)) == {"critic/vf_loss", "critic/vf_clipfrac"}


def test_a_value_clip_that_is_not_positive_is_refused():
  """bench_pipeline passed a negative config.value_clip_eps through (only 0 means unclipped
  there): the clip's bounds crossed and the value loss came out wrong, silently."""
  for eps in (-0.2, 0.0, float("nan")):
    with pytest.raises(ValueError, match=r"loss.value_clip_eps=.* must be > 0 \(None: "):
      LossConfig(value_clip_eps=eps)
  assert LossConfig(value_clip_eps=None).value_clip_eps is None


@pytest.mark.parametrize("field", ["kl_coef", "entropy_coef", "vf_coef", "temperature"])
def test_a_coefficient_that_is_nan_or_infinite_is_refused(field):
  """bench_pipeline builds a LossConfig from its config's vf_coef and entropy_coef: NaN passed
  the "< 0" test, and every loss and gradient came out NaN (inf: inf or NaN), silently."""
  for value in (float("nan"), float("inf"), -1.0):
    with pytest.raises(ValueError, match=rf"loss.{field}={value} must be finite and "):
      LossConfig(**{field: value})
  assert getattr(LossConfig(**{field: 0.5}), field) == 0.5


@pytest.mark.parametrize("kl_loss_agg", ["token-mean", "seq-mean-token-sum"])
def test_the_kl_term_is_aggregated_by_its_own_mode(kl_loss_agg):
  """The KL-to-reference term is reduced by cfg.kl_loss_agg, whatever the policy loss's
  loss_agg is (the trainer keeps it a token mean while the policy loss may be a per-sequence
  sum): its k3 estimate against numpy, and the total loss as pg - entropy + kl_coef * kl. A KL
  aggregated with the policy's mode weighed the penalty up by the response lengths, silently."""
  cfg = LossConfig(loss_agg="seq-mean-token-sum-norm", kl_coef=0.1, kl_estimator="k3",
                   kl_loss_agg=kl_loss_agg, entropy_coef=0.01)
  logp, entropy, batch = _batch(seed=3)
  loss, m = objective.actor_objective(cfg, logp, entropy, batch)
  mask = batch["mask"].astype(np.float64)
  r = batch["ref_logp"].astype(np.float64) - logp.astype(np.float64)
  k3 = (np.exp(r) - r - 1) * mask
  want = (k3.sum() / mask.sum() if kl_loss_agg == "token-mean" else k3.sum(-1).mean())
  assert float(m["kl_loss"]) == pytest.approx(want, rel=1e-5)
  ent = float(np.sum(entropy * mask) / mask.sum())
  assert float(m["entropy"]) == pytest.approx(ent, rel=1e-5)
  assert float(loss) == pytest.approx(float(m["pg_loss"]) - 0.01 * ent + 0.1 * want, rel=1e-5)


def test_a_mini_batch_without_a_valid_token_gives_zeros_not_nan():
  """Under normalisers of a mini-batch with no valid token (num_tokens = 0) the objective's
  loss, its gradient and every metric are 0, as the token-mean of nothing is in rl/losses: a
  share of 0 / 0 made them NaN, and a NaN loss stops the run (or skips its update)."""
  cfg = LossConfig(loss_agg="token-mean", entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3")
  logp, entropy, batch = _batch(seed=5)
  batch = {**batch, "mask": np.zeros_like(batch["mask"])}
  zero, seqs = jnp.float32(0.0), jnp.float32(B)
  grad, ma = jax.grad(lambda lp: objective.actor_objective(cfg, lp, entropy, batch, zero, seqs),
                      has_aux=True)(jnp.asarray(logp))
  _, mc = objective.critic_objective(cfg, batch["old_values"] + 0.3, batch, zero)
  np.testing.assert_array_equal(grad, 0.0)
  for k, v in {**ma, **mc}.items():
    assert float(v) == 0.0, k
