"""The plan search of a run without a critic (GRPO, RLOO, ...: Workload.trains_critic=False):
the actor's training alone, no critic in the inference, the memory rows or plan.json. Until
2026-12-08 such a run was timed and sized as PPO's."""
import dataclasses

import numpy as np
import pytest

from rlhfuse_jax.sim import iteration_sim as it
from rlhfuse_jax.sim import plan_search as ps
from rlhfuse_jax.sim import training_sim as train_lib
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.lengths import LengthSpec
from rlhfuse_jax.sim.shapes import get_shape

COST = CostModel(get_hardware("h100_sxm"))
A7 = get_shape("llama-7b")


def _workloads(**kw):
  """(PPO's, the same run without a critic): 7B/7B on 16 H100s."""
  ppo = it.Workload(actor=A7, critic=A7.as_critic(), num_devices=16, global_batch=32,
                    minibatch=16, max_new_tokens=256,
                    prompt=LengthSpec(kind="constant", value=64, max_len=128),
                    response=LengthSpec(kind="constant", value=100), **kw)
  return ppo, dataclasses.replace(ppo, trains_critic=False)


def test_a_critic_free_run_trains_the_actor_alone():
  """Each colocated layout of a run without a critic takes the actor's own 1F1B, gradient
  all-reduce and optimizer step (from the cost model's stage times, by hand), below PPO's on
  the same layout; its plans record no critic_pp or critic micro-batches, and no disjoint
  placement is tried (there is no second model to place apart)."""
  ppo, free = _workloads()
  mean = 164.0
  cands = ps.training_candidates(COST, free, mean, {}, idle=True)
  ppo_cands = ps.training_candidates(COST, ppo, mean, {}, idle=True)
  assert cands and all(c.plan["placement"] == "colocated" for c in cands)
  assert any(c.plan["placement"] == "disjoint" for c in ppo_cands)
  ppo_s = {(c.plan["tp"], c.plan["actor_pp"]): c.seconds for c in ppo_cands
           if c.plan["placement"] == "colocated" and c.plan["critic_pp"] == c.plan["actor_pp"]}
  for c in cands:
    p = c.plan
    assert "critic_pp" not in p and "critic_microbatches" not in p, p
    tp, pa = p["tp"], p["actor_pp"]
    dp = 16 // (tp * pa)
    m = 16 // dp
    tokens = mean
    f = float(COST.train_stage_fwd_s(A7, tp, pa, tokens, (mean + 1) / 2, "actor"))
    b = COST.train_stage_bwd_s(f, "actor", COST.train_stage_comm_s(A7, tp, pa, tokens))
    lat = train_lib.stage_hop_s(COST, tokens * A7.hidden_size * A7.act_itemsize / tp, tp * dp,
                                pa)
    step = (train_lib.one_f_one_b_s(pa, m, f, b, lat) + COST.grad_sync_s(A7, tp, pa, dp) +
            COST.optimizer_step_s(A7, tp * pa * dp))
    assert c.seconds == pytest.approx(free.num_minibatches * step, rel=1e-9), p
    if (tp, pa) in ppo_s:
      assert c.seconds < ppo_s[tp, pa], p
  # pipeline_train_s of the actor alone: its 1F1B whichever schedule is asked for
  plan = train_lib.TrainPlan(16, 16, 2, 2, 2)
  costs = train_lib.step_costs(COST, A7, None, plan, mean)
  assert costs.problem is None
  serial, fused = (train_lib.pipeline_train_s(costs, 2, f) for f in (False, True))
  assert serial == fused and serial["schedule"] == "actor_1f1b"


def test_a_critic_free_runs_memory_and_inference_hold_no_critic():
  """plan_memory's training row of a run without a critic is the actor's training memory
  alone, and exactly what the search's check lets fit (a byte less refuses it); the training
  state kept beside generation and asynchronous PPO's rescoring hold the actor's alone; the
  inference scores the reference and the reward model, not a critic."""
  ppo, free = _workloads()
  opt = it.SimOptions(trainer_runnable=True)
  assert free.frozen_models()[0] == ("reference", "reward")
  assert ppo.frozen_models()[0] == ("reference", "critic", "reward")
  plan = ps.search(COST, free, opt, top_k=1)["best"]
  train = plan["training"]
  assert "critic_pp" not in train and "Pa=1 (actor alone)" in plan["summary"]
  rows = {r["stage"]: r for r in ps.plan_memory(COST, free, opt, plan)}
  tplan = train_lib.TrainPlan(16, 16, train["tp"], 1, 1)
  want = COST.train_memory_parts(A7, train["tp"], 1, tplan.dp, True, free.padded_len,
                                 1, tplan.accumulates, 1, free.max_new_tokens)
  assert rows["training"]["parts"] == want
  state = want["weights"] + want["optimizer"]
  assert rows["generation"]["parts"]["training state kept"] == pytest.approx(state)
  # asynchronous PPO's rescoring on the training devices: the actor's pass alone, beside the
  # actor's state
  rescore = ps.rescore_rows(COST, free, opt, train, {})
  assert [r["stage"] for r in rescore] == ["rescore (actor log-probs)"]
  assert rescore[0]["parts"]["training state"] == pytest.approx(state)
  need = rows["training"]["total"]
  for scale, fits in ((1 + 1e-9, True), (1 - 1e-9, False)):
    cost = CostModel(dataclasses.replace(COST.hw, hbm_bytes=need * scale /
                                         COST.eff.memory_headroom))
    check = lambda: train_lib.step_costs(cost, A7, None, tplan, 164.0,
                                         padded_len=free.padded_len,
                                         head_positions=free.max_new_tokens)
    if fits:
      check()
    else:
      with pytest.raises(ValueError, match="training llama-7b does not fit in memory"):
        check()
  # The same plan's rows for PPO hold the critic too.
  ppo_plan = {**plan, "training": {**train, "critic_pp": 1}}
  ppo_rows = {r["stage"]: r for r in ps.plan_memory(COST, ppo, opt, ppo_plan)}
  assert ppo_rows["training"]["total"] > need
  # The inference's forwards: PPO's scores a critic more
  seq = np.full(32, 164.0)
  inf = lambda wl: ps.inference_stage_s(COST, wl.frozen_models()[1], 16, 2, 1, seq, 8, True)
  assert inf(free) < inf(ppo)


def test_a_critic_free_plan_records_no_critic_and_the_trainer_runs_it_unpipelined():
  """plan.json's workload of a run without a critic records trains_critic false and no
  critic's shape; trainer_refusal refuses an actor pipeline for it (the trainer's pipelined
  update trains actor and critic together) and lets the unpipelined plan through; the
  papers' systems (PPO's) refuse such a workload by name."""
  ppo, free = _workloads()
  record = ps.workload_record(free)
  assert record["trains_critic"] is False and "critic" not in record
  assert ps.workload_record(ppo)["trains_critic"] is True and "critic" in ps.workload_record(ppo)
  inst = {"mode": "instances", "tp": 2, "pp": 1, "groups": 1, "slots": 4}
  ok = {"generation": inst, "inference": {"tp": 2, "pp": 1},
        "training": ps.colocated_train_dict(free, 2, 1, 1)}
  assert ps.trainer_refusal(free, ok) is None
  piped = {**ok, "training": ps.colocated_train_dict(free, 2, 2, 2)}
  assert "critic_pp" not in piped["training"]
  assert "Pa=2 without a critic" in ps.trainer_refusal(free, piped)
  assert ps.trainer_refusal(ppo, {**piped, "training": ps.colocated_train_dict(ppo, 2, 2, 2)}
                            ) is None
  res = ps.search(COST, free, it.SimOptions(trainer_runnable=True), top_k=3)
  assert all(p["training"]["actor_pp"] == 1 for p in res["top"])
  with pytest.raises(ValueError, match="the simulated systems are PPO's"):
    it.simulate_iteration(COST, free, it.SimOptions(), ("rlhfuse",))


def test_a_pipelined_plan_without_a_critic_reads_without_critic_fields():
  """train_ppo reads a plan without a critic (no critic_pp, no critic micro-batches) where it
  pipelines the actor: it asked for training.critic_microbatches, a field such a plan never
  has, instead of leaving the run's own check to say that a critic-free run takes
  mesh.stage=1."""
  from rlhfuse_jax.trainer import plan_file  # pylint: disable=import-outside-toplevel
  free = _workloads()[1]
  plan = {"generation": {"mode": "instances", "tp": 1, "slots": 4},
          "inference": {"tp": 1, "pp": 1}, "training": ps.colocated_train_dict(free, 1, 2, 2)}
  settings = plan_file.plan_file_settings(plan, "plan.json")
  assert settings["mesh", "stage"] == (2, "training.actor_pp")
  assert settings["pipeline", "actor_microbatches"][0] == plan["training"]["actor_microbatches"]
  assert ("pipeline", "critic_microbatches") not in settings
  assert ("pipeline", "critic_pp") not in settings  # (it set 1, a field the file lacks)
