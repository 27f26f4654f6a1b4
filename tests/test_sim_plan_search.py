"""sim/plan_search.py: pipelined generation by hand, the search against brute force, the binary."""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlhfuse_jax.sim import iteration_sim as it
from rlhfuse_jax.sim import plan_search as ps
from rlhfuse_jax.sim import training_sim as train_lib
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.lengths import LengthSpec
from rlhfuse_jax.sim.shapes import get_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COST = CostModel(get_hardware("h100_sxm"))
ACTOR = get_shape("llama-13b")


def test_pipelined_generation_by_hand():
  """Equal lengths: G >= pp keeps every stage busy; G = 1 leaves pp - 1 of pp stages idle. The
  time is the cost model's stage ticks summed as the module docstring says."""
  pp, tp, n = 4, 2, 8  # one replica
  prompts = np.full(8, 100)
  resp = np.full(8, 5)
  full = ps.pipelined_generation(COST, ACTOR, n, tp, pp, 4, prompts, resp, 16)
  plain = ps.pipelined_generation(COST, ACTOR, n, tp, pp, 1, prompts, resp, 16)
  assert full["replicas"] == plain["replicas"] == 1
  assert full["stage_busy_frac"] == pytest.approx(1.0)
  assert plain["stage_busy_frac"] == pytest.approx(1 / pp)
  # 4 decode steps (tokens 1..4), each max(G, pp) ticks.
  assert full["ticks"] == 4 * 4 and plain["ticks"] == 4 * pp
  st = ps.stage_shape(ACTOR, pp)
  act = lambda rows: COST.p2p_s(rows * ACTOR.hidden_size * 2.0 / tp, False)
  tick = lambda rows, k: float(COST.decode_step_s(st, tp, rows, rows * (100 + k))) + act(rows)
  pre_g = COST.prefill_s(st, tp, [100, 100])
  want = 4 * pre_g + 3 * pre_g + sum(4 * tick(2, k) for k in range(1, 5)) + 3 * tick(2, 1)
  assert full["gen_s"] == pytest.approx(want, rel=1e-9)
  pre_1 = COST.prefill_s(st, tp, [100] * 8)
  want = pre_1 + 3 * pre_1 + sum(pp * tick(8, k) for k in range(1, 5)) + 3 * tick(8, 1)
  assert plain["gen_s"] == pytest.approx(want, rel=1e-9)
  # Ragged lengths: finished groups leave the pipeline, so the busy fraction drops below 1.
  ragged = ps.pipelined_generation(COST, ACTOR, n, tp, pp, 4, prompts,
                                   np.array([2, 9, 3, 9, 4, 9, 5, 9]), 16)
  assert 0.25 < ragged["stage_busy_frac"] < 1.0


def test_pipelined_generation_errors_name_the_layout():
  with pytest.raises(ValueError, match="pp=3 must divide llama-13b's 40 layers"):
    ps.pipelined_generation(COST, ACTOR, 12, 1, 3, 3, np.full(4, 10), np.full(4, 2), 4)
  with pytest.raises(ValueError, match=r"tp\*pp=4\*4 must divide 8 devices"):
    ps.pipelined_generation(COST, ACTOR, 8, 4, 4, 4, np.full(4, 10), np.full(4, 2), 4)


def _small():
  return it.Workload(actor=ACTOR, critic=get_shape("llama-13b", "scalar"), num_devices=16,
                     global_batch=32, minibatch=16, max_new_tokens=64,
                     prompt=LengthSpec(kind="uniform", min_len=8, max_len=64),
                     response=LengthSpec(kind="uniform", min_len=1, max_len=64))


def test_search_finds_the_brute_force_optimum_on_a_small_cluster():
  """Every combination of generation layout (instances or pipeline), inference tp and training
  layout (colocated pipelines or a disjoint split), evaluated directly: the search's best plan
  is the cheapest of them."""
  wl, opt = _small(), it.SimOptions(gen_tps=(1, 2, 4, 8))
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(float)
  frozen = (wl.actor, wl.critic, wl.critic)
  gens = []
  for tp in (1, 2, 4, 8):
    try:
      gens.append(ps.instance_generation(COST, wl, opt, tp, prompts, resp)["gen_s"] +
                  ps.reshard_s(COST, wl, tp))
    except ValueError:
      pass
    for pp, groups in itertools.product((2, 4, 8), (1, 2, 4, 8, 16)):
      if groups not in (pp, 2 * pp) or 40 % pp or 16 % (tp * pp):
        continue
      try:
        gens.append(ps.pipelined_generation(COST, ACTOR, 16, tp, pp, groups, prompts, resp,
                                            64)["gen_s"] + ps.reshard_s(COST, wl, tp * pp))
      except ValueError:
        pass
  infs = []
  for tp in (1, 2, 4, 8):
    try:
      it.check_inference_memory(COST, wl, tp, opt.inference_microbatch, prompts)
      infs.append(ps.inference_stage_s(COST, frozen, 16, tp, 1, seq, opt.inference_microbatch,
                                       opt.offload_frozen))
    except ValueError:
      pass
  trains = []
  for tp, pa, pc in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
    try:
      plan = train_lib.TrainPlan(16, 16, tp, pa, pc, 1)
      costs = train_lib.step_costs(COST, wl.actor, wl.critic, plan, float(seq.mean()))
    except ValueError:
      continue
    if pc <= pa <= 40:
      trains.append(train_lib.pipeline_train_s(costs, wl.num_minibatches, False)["train_s"])
  trains += [s * wl.num_minibatches for s, _ in train_lib.disjoint_splits(
      COST, wl.actor, wl.critic, 16, 16, 1, float(seq.mean()))]
  brute = min(gens) + min(infs) + min(trains)
  assert len(gens) * len(infs) * len(trains) > 20
  res = ps.search(COST, wl, opt)
  assert res["best"]["predicted"]["iteration_s"] == pytest.approx(brute, rel=1e-12)
  assert [p["predicted"]["iteration_s"] for p in res["top"]] == sorted(
      p["predicted"]["iteration_s"] for p in res["top"])
  assert res["uniform"]["predicted"]["reshard_s"] == 0.0


def test_binary_writes_plan_result_and_report(tmp_path):
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:13b/13b",
       f"--workdir={tmp_path}", "--config.num_devices=32", "--config.global_batch=64",
       "--config.minibatch=16", "--config.max_new_tokens=128", "--config.sim.search_time_s=0.2",
       "--config.systems=rlhfuse,pipe_rlhf,rlhfuse_planned"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((tmp_path / "result.json").read_text())
  plan = json.loads((tmp_path / "plan.json").read_text())
  assert plan["predicted"]["iteration_s"] == res["best"]["predicted_iteration_s"]
  u = res["uniform"]["layout"]
  assert u["tp"] * u["pp"] * u["dp"] == 32 and res["uniform"]["predicted"]["reshard_s"] == 0
  assert res["search_s"] < 60
  sys_rows = res["systems"]
  assert sys_rows["pipe_rlhf"]["iteration_s"] == pytest.approx(res["best"]["predicted_iteration_s"])
  assert sys_rows["rlhfuse_planned"]["iteration_s"] <= sys_rows["pipe_rlhf"]["iteration_s"]
  md = (tmp_path / "plan_search.md").read_text()
  assert "| uniform | one layout" in md and "| rlhfuse_planned |" in md
