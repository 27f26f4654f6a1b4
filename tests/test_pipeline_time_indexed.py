"""Time-indexed LP relaxation (pipeline/exact/time_indexed.py): a relaxation of every valid schedule
within budget, and certificates that are checked exactly."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlhfuse_jax.pipeline import bounds, search, windows
from rlhfuse_jax.pipeline.exact import time_indexed
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import PipelineProblem
from tests.test_pipeline_experiments import REPO
from tests.test_pipeline_search import SMALL, _random_valid_orders

# LB 42 (device 1: work 36 + 2 + 4); the best schedule within budget takes 43 (search, and the
# LP below proves 42 unreachable).
TIGHT = PipelineProblem(4, 4, 4, 4, 2.0, 1.0)


def _task_starts(model, problem, order):
  """Start of every task of `model.tasks` in the list schedule of `order`."""
  ev = evaluate(problem, order)
  pos = {}
  for d in range(problem.num_devices):
    seen = [0] * 4
    for q, k in enumerate(order[d].tolist()):
      pos[k, d, seen[k]] = ev.starts[d, q]
      seen[k] += 1
  return np.array([pos[tuple(t)] for t in model.tasks.tolist()]), ev


@pytest.mark.parametrize("idx", range(len(SMALL)))
def test_every_valid_schedule_within_budget_is_a_point_of_the_relaxation(idx):
  # Soundness: a schedule that meets the target satisfies every row, so an LP without solution
  # means no schedule exists. Unit 0.5 on SMALL[1] (backward 1.5) and SMALL[2] (latency 0.5).
  p = SMALL[idx]
  rng = np.random.default_rng(idx)
  checked = 0
  for order in _random_valid_orders(p, rng, 80):
    ev = evaluate(p, order)
    if not ev.within_budget:
      continue
    for slack in (0.0, 2.0):
      model = time_indexed.build(p, ev.makespan + slack)
      assert model.infeasible_reason is None
      starts, _ = _task_starts(model, p, order)
      y = model.encode(starts)
      assert np.all(model.A @ y <= model.b + 1e-9)
      checked += 1
  assert checked >= 10  # within-budget schedules among the random ones (7 on SMALL[3])


@pytest.mark.parametrize("idx,devices", [(0, (1, 2)), (1, (0,)), (3, (2, 3)), (0, (0, 3))])
def test_a_device_subset_model_is_a_relaxation_of_every_valid_schedule(idx, devices):
  # Soundness of --devices: the subset's rows hold at every within-budget schedule's starts.
  p = SMALL[idx]
  rng = np.random.default_rng(100 + idx)
  checked = 0
  for order in _random_valid_orders(p, rng, 60):
    ev = evaluate(p, order)
    if not ev.within_budget:
      continue
    model = time_indexed.build(p, ev.makespan, devices=devices)
    assert model.devices == tuple(devices)
    assert set(model.tasks[:, 1].tolist()) == set(devices)
    starts, _ = _task_starts(model, p, order)
    assert np.all(model.A @ model.encode(starts) <= model.b + 1e-9)
    checked += 1
  assert checked >= 5


def test_a_device_subset_certificate_proves_the_whole_bound_unreachable():
  # Devices 1-2 of TIGHT alone cannot meet 42; devices 0-1 can (the subset proves nothing).
  sub = time_indexed.build(TIGHT, 42.0, devices=[2, 1])
  whole = time_indexed.build(TIGHT, 42.0)
  assert sub.A.shape[0] < whole.A.shape[0] and sub.devices == (1, 2)
  res = time_indexed.solve(sub, solver="scipy")
  assert res["status"] == "infeasible" and res["certified"] and res["certificate_bound"] > 0
  assert time_indexed.solve(time_indexed.build(TIGHT, 42.0, devices=[0, 1]),
                            solver="scipy")["status"] == "feasible"
  assert time_indexed.build(TIGHT, 42.0, devices=range(4)).devices is None  # all: the whole


def test_time_unit_is_the_gcd_of_durations_and_latency():
  assert time_indexed.time_unit(PipelineProblem(16, 8, 4, 4, 2.0, 2.0)) == 2.0
  assert time_indexed.time_unit(SMALL[1]) == 0.5
  assert time_indexed.time_unit(SMALL[2]) == 0.5
  with pytest.raises(ValueError, match="multiples of 0.001"):
    time_indexed.time_unit(PipelineProblem(2, 1, 2, 2, 1.0, 1.0 / 3.0))


def test_lp_proves_the_bound_unreachable_on_a_small_instance_with_an_exact_certificate():
  assert bounds.tight_lower_bound(TIGHT) == 42.0
  at_lb = time_indexed.build(TIGHT, 42.0)
  assert at_lb.infeasible_reason is None  # the windows alone do not rule 42 out
  res = time_indexed.solve(at_lb, solver="scipy")
  assert res["status"] == "infeasible" and res["certified"]
  assert res["certificate_bound"] > 0.1
  assert res["certificate_bound"] == pytest.approx(res["elastic_optimum"], rel=1e-3)
  # The multipliers scale freely; a positive bound stays positive.
  assert time_indexed.certificate_bound(at_lb, 7.0 * res["multipliers"]) > 0
  one_more = time_indexed.build(TIGHT, 43.0)
  res43 = time_indexed.solve(one_more, solver="scipy")
  assert res43["status"] == "feasible" and not res43["certified"]


def test_fractional_memory_is_scaled_to_integers_and_decides_the_same():
  """Memory and budget off the integers (TIGHT's at 0.3-fold: 0.6 / 0.3 per micro-batch) are
  the same constraints: the rows are built 10-fold, so the exact check still certifies 42 and
  finds 43 feasible (the certificate check raised after the solver had run)."""
  assert time_indexed.memory_scale(TIGHT) == 1
  frac = dataclasses.replace(TIGHT, actor_mem=0.6, critic_mem=0.3,
                             memory_budget=tuple(0.3 * TIGHT.budget()))
  assert time_indexed.memory_scale(frac) == 10
  res = time_indexed.solve(time_indexed.build(frac, 42.0), solver="scipy")
  assert res["status"] == "infeasible" and res["certified"]
  assert time_indexed.solve(time_indexed.build(frac, 43.0), solver="scipy")["status"] == "feasible"
  assert time_indexed.memory_scale(dataclasses.replace(frac, actor_mem=2.0 / 3.0)) == 30
  with pytest.raises(ValueError, match="must become integers times some k <= 1000"):
    time_indexed.build(dataclasses.replace(frac, actor_mem=0.1 * np.pi), 43.0)  # before any work


def test_a_no_limit_budget_certifies_nothing():
  """A budget of 1e30 (no limit) wrapped to int64's minimum in the exact check, so one multiplier
  on a memory row 'proved' a feasible target (30; serial 1F1B takes 21) unreachable. The rows are
  capped where they cannot bind; right-hand sides past 2^62 are refused."""
  p = PipelineProblem(2, 1, 3, 3, 1.0, 1.0, memory_budget=(1e30,))
  model = time_indexed.build(p, 30.0)
  assert np.abs(model.b).max() < 2 ** 62
  assert time_indexed.solve(model, solver="scipy")["status"] == "feasible"
  for row in np.flatnonzero(model.soft):
    lam = np.zeros(model.b.shape)
    lam[row] = 1.0
    assert time_indexed.certificate_bound(model, lam) <= 0, row
  huge = dataclasses.replace(model, b=np.where(model.soft, 1e30, model.b))
  with pytest.raises(ValueError, match="below 2\\^62"):
    time_indexed.certificate_bound(huge, np.ones(model.b.shape))


def test_a_model_whose_windows_fix_every_start_is_decided_without_a_solver():
  """At its optimum (6, brute force) every window of this instance is one point: no variables
  (scipy raised, HiGHS said 'Empty')."""
  p = PipelineProblem(2, 2, 1, 1, 1.0, 1.0, actor_mem=1.0, critic_mem=0.0,
                      memory_budget_mode="uniform")
  model = time_indexed.build(p, 6.0)
  assert model.A.shape[1] == 0 and model.infeasible_reason is None
  res = time_indexed.solve(model, solver="scipy")
  assert res["status"] == "feasible" and not res["certified"], res


def test_no_multipliers_certify_a_feasible_model():
  # At 43 a schedule within budget exists: a count-based search (no wall clock) finds one, and
  # its starts are a point y of the relaxation (A y <= b). Then for every non-negative lam,
  # certificate_bound (a minimum over [0, 1]^n) <= lam^T (A y - b) <= 0: no multipliers may
  # certify 43, and the exact check must say so for each random lam tried.
  order = search.search(TIGHT, search.SearchConfig(time_budget_s=60, max_evaluations=20000,
                                                   seed=0)).best
  model = time_indexed.build(TIGHT, 43.0)
  starts, ev = _task_starts(model, TIGHT, order)
  assert ev.makespan == 43.0 and ev.within_budget  # reachable
  y = model.encode(starts)
  assert np.all(model.A @ y <= model.b + 1e-9)
  rng = np.random.default_rng(0)
  for _ in range(20):
    lam = rng.exponential(size=model.b.shape) * (rng.random(model.b.shape) < 0.3)
    assert time_indexed.certificate_bound(model, lam) <= float(lam @ (model.A @ y - model.b)) + 1e-6
    assert time_indexed.certificate_bound(model, lam) <= 0
  # The multipliers proving 42 unreachable, applied to the model at 43, prove nothing either.
  with pytest.raises(ValueError, match="multipliers"):
    time_indexed.certificate_bound(model, np.ones(3))


def test_targets_below_the_windows_are_ruled_out_without_a_solver():
  p = SMALL[0]
  low = windows.task_windows(p, memory_lags=True).bound() - 1.0
  model = time_indexed.build(p, low)
  assert model.infeasible_reason is not None and "no start" in model.infeasible_reason
  res = time_indexed.solve(model, solver="scipy")
  assert res["status"] == "infeasible" and res["solver"] == "windows"


def test_bad_arguments_are_named():
  model = time_indexed.build(TIGHT, 43.0)
  with pytest.raises(ValueError, match="solver="):
    time_indexed.solve(model, solver="cplex")
  for devices in ([], [4], [-1, 0]):
    with pytest.raises(ValueError, match="devices="):
      time_indexed.build(TIGHT, 43.0, devices=devices)
  with pytest.raises(ValueError, match="unit=0.75"):
    time_indexed.build(TIGHT, 43.0, unit=0.75)
  fractional = PipelineProblem(4, 4, 2, 2, 2.0, 1.0, actor_mem=1.5)  # rows built 2-fold
  m = time_indexed.build(fractional, 40.0)
  assert np.isfinite(time_indexed.certificate_bound(m, np.ones(m.b.shape)))
  m = dataclasses.replace(m, b=m.b + 0.5)  # a model whose rows are not integral
  with pytest.raises(ValueError, match="integer memory"):
    time_indexed.certificate_bound(m, np.ones(m.b.shape))


def test_lp_check_binary_saves_a_certificate_that_verify_rechecks(tmp_path):
  from tests.test_pipeline_experiments import _env, _run
  # The per-device budget: under the uniform one the bound 42 is LP-feasible (and reached).
  inst = ["--config=configs/schedule_search.py", "--config.memory_budget_mode=per_device",
          "--config.actor_pp=4", "--config.critic_pp=4",
          "--config.actor_microbatches=4", "--config.critic_microbatches=4",
          "--config.actor_fwd=2", "--config.critic_fwd=1"]
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={tmp_path}", "--solver=scipy"])
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["target"] == result["lower_bound"] == 42.0
  assert result["certified"] and result["certificate_bound"] > 0
  assert "unreachable" in result["verdict"]
  # Without highspy (hidden here), a model the windows do not decide is refused before the
  # earlier outputs move aside (they went to previous/1 first, then the solve failed).
  before = sorted(os.listdir(tmp_path))
  hide = ("import runpy, sys; sys.modules['highspy'] = None; sys.argv[0] = 'schedule_lp_check';"
          " runpy.run_module('experiments.schedule_lp_check', run_name='__main__')")
  out = subprocess.run([sys.executable, "-c", hide, *inst, f"--workdir={tmp_path}"], cwd=REPO,
                       env=_env(), capture_output=True, text=True, timeout=240)
  assert out.returncode == 1 and ("--solver=pdlp needs highspy, which is not installed (pip "
                                  "install -e \".[exact]\", or --solver=scipy for small models)"
                                  ": the windows do not decide this model") in out.stderr, \
      out.stderr[-3000:]
  assert sorted(set(os.listdir(tmp_path)) - {"traceback.txt"}) == before  # (the error's)
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={tmp_path}",
              f"--verify={tmp_path / 'certificate.npz'}"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads((tmp_path / "verify.json").read_text())["certified"]
  # A certificate names the devices its model was built for (--verify defaults to them).
  assert time_indexed.certificate_devices(str(tmp_path / "certificate.npz")) is None  # all
  lam = np.zeros(5)
  lam[[1, 3]] = 0.5
  time_indexed.save_certificate(str(tmp_path / "sub.npz"), lam, 42.0, (2, 3))
  assert time_indexed.certificate_devices(str(tmp_path / "sub.npz")) == [2, 3]
  np.testing.assert_array_equal(time_indexed.load_certificate(str(tmp_path / "sub.npz"), 5, 42.0),
                                lam)
  with pytest.raises(ValueError, match=r"5 rows, built for devices \[2, 3\]; this instance.*"
                                       r"memory budget \(config.memory_budget_mode"):
    time_indexed.load_certificate(str(tmp_path / "sub.npz"), 6, 42.0)
  # The memory budget it was made for is kept and compared: a kept per-device certificate
  # checked without --config.memory_budget_mode=per_device (the uniform budget, the default)
  # was refused as "a model of 60370 rows ... other instance, --devices, target or code
  # version?", naming every cause but that one.
  time_indexed.save_certificate(str(tmp_path / "b.npz"), lam, 42.0, None, [10.0, 12.0])
  np.testing.assert_array_equal(
      time_indexed.load_certificate(str(tmp_path / "b.npz"), 5, 42.0, [10.0, 12.0]), lam)
  with pytest.raises(ValueError, match=r"b\.npz: certificate for the memory budget \[10.0, "
                                       r"12.0\] per device; this instance's is \[12.0, 12.0\] "
                                       r"\(config.memory_budget_mode"):
    time_indexed.load_certificate(str(tmp_path / "b.npz"), 5, 42.0, [12.0, 12.0])
  # A file that is not one: numpy's EOFError, BadZipFile, KeyError, IndexError or a
  # ZeroDivisionError in the check, each a traceback naming neither flag nor file.
  good = (tmp_path / "sub.npz").read_bytes()
  (tmp_path / "empty.npz").write_bytes(b"")
  (tmp_path / "cut.npz").write_bytes(good[:len(good) // 2])
  (tmp_path / "text.npz").write_text("not a certificate\n")
  np.savez(tmp_path / "nokey.npz", index=np.array([1]), value=np.array([0.5]))
  np.savez(tmp_path / "range.npz", rows=np.int64(5), index=np.array([7]), value=np.array([.5]))
  np.savez(tmp_path / "inf.npz", rows=np.int64(5), index=np.array([1]), value=np.array([np.inf]))
  for name in ("empty", "cut", "text", "nokey", "range", "inf"):
    with pytest.raises(ValueError, match=rf"{name}\.npz: not a certificate"):
      time_indexed.load_certificate(str(tmp_path / f"{name}.npz"), 5, 42.0)
    with pytest.raises(ValueError, match=rf"{name}\.npz: not a certificate"):
      time_indexed.certificate_devices(str(tmp_path / f"{name}.npz"))
  # A certificate changed by hand no longer proves anything; one for another target is refused.
  with np.load(tmp_path / "certificate.npz") as f:
    fields = dict(f)
  fields["value"] = fields["value"][::-1].copy()
  np.savez(tmp_path / "tampered.npz", **fields)
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={tmp_path}",
              f"--verify={tmp_path / 'tampered.npz'}"])
  assert out.returncode == 0 and not json.loads((tmp_path / "verify.json").read_text())["certified"]
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={tmp_path}", "--target=43",
              f"--verify={tmp_path / 'certificate.npz'}"])
  assert out.returncode != 0 and "certificate for target 42, not 43" in out.stderr
  # Another binary's workdir: verify.json went in beside its outputs.
  other = tmp_path / "ss"
  other.mkdir()
  (other / "result.json").write_text(json.dumps(
      {"provenance": {"command": "python -m experiments.schedule_search --workdir=ss"}}))
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={other}",
              f"--verify={tmp_path / 'certificate.npz'}"])
  assert out.returncode == 1 and "holds the outputs of experiments.schedule_search" in out.stderr
  assert sorted(os.listdir(other)) == ["result.json"]


def test_lp_check_scans_one_device_at_a_time_and_stops_at_the_first_certified(tmp_path):
  from tests.test_pipeline_experiments import _run
  inst = ["--config=configs/schedule_search.py", "--config.memory_budget_mode=per_device",
          "--config.actor_pp=4", "--config.critic_pp=4",
          "--config.actor_microbatches=4", "--config.critic_microbatches=4",
          "--config.actor_fwd=2", "--config.critic_fwd=1", "--solver=scipy", "--devices=each"]
  # At the bound 42 every device alone is LP-feasible: all four tried, nothing certified.
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={tmp_path / 'a'}"])
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads((tmp_path / "a" / "result.json").read_text())
  assert [r["devices"] for r in result["scan"]] == [[0], [1], [2], [3]]
  assert not any(r["certified"] for r in result["scan"]) and not result["certified"]
  assert not (tmp_path / "a" / "certificate.npz").exists()
  # Below it (41) the windows already exclude some task of device 0: the scan stops there
  # instead of trying the other three.
  out = _run(["experiments.schedule_lp_check", *inst, f"--workdir={tmp_path / 'b'}",
              "--target=41"])
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads((tmp_path / "b" / "result.json").read_text())
  assert [(r["devices"], r["certified"]) for r in result["scan"]] == [([0], True)]
  assert result["certified"] and result["solver"] == "windows"
  assert not (tmp_path / "b" / "certificate.npz").exists()  # the windows need no multipliers
  for bad, msg in (("--devices=each", "not 'each'"), ("--devices=1,x", "expected device")):
    out = _run(["experiments.schedule_lp_check", *inst[:-1], bad, f"--workdir={tmp_path / 'c'}",
                f"--verify={tmp_path / 'c' / 'certificate.npz'}"])
    assert out.returncode != 0 and msg in out.stderr
  # schedule_cp_check shares the parser; its flag is checked before ortools is needed.
  out = _run(["experiments.schedule_cp_check", *inst[:-2], "--devices=1,x",
              f"--workdir={tmp_path / 'd'}"])
  assert out.returncode != 0 and "--devices=1,x: expected device indices in 0..3" in out.stderr
  out = _run(["experiments.schedule_cp_check", *inst[:-2], "--target=-5",
              f"--workdir={tmp_path / 'e'}"])
  assert out.returncode != 0 and "--target=-5: expected a makespan >= 0" in out.stderr
  assert not (tmp_path / "e").exists()
  for bad in ("--hint_search_s=0", "--time_limit_s=-1"):
    out = _run(["experiments.schedule_cp_check", *inst[:-2], "--minimize", bad,
                f"--workdir={tmp_path / 'g'}"])
    assert out.returncode != 0 and f"{bad}: expected a finite number of seconds" in out.stderr
  out = _run(["experiments.schedule_lp_check", *inst[:-1], "--target=-5",
              f"--workdir={tmp_path / 'f'}"])
  assert out.returncode != 0 and "--target=-5: expected a makespan >= 0" in out.stderr
  assert not (tmp_path / "f").exists()


def test_cp_check_target_is_rounded_down():
  # Integer durations: "makespan <= 372.6" is "<= 372"; round() asked "<= 373", a weaker
  # question, and its FEASIBLE read as "the target is reachable".
  from experiments.config_files import check_makespan_target as check_target
  assert [check_target(v, 372.0) for v in (-1, 372.6, 372.5, 373, 0)] == [372, 372, 372, 373, 0]
  for bad in (-2, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=f"--target={bad:g}: expected a makespan >= 0"):
      check_target(bad, 372.0)


@pytest.mark.parametrize("name", ["e8", "e9", "e10"])
def test_shipped_certificates_prove_the_bound_unreachable(name):
  # experiments/results/lp_certificates: made once by schedule_lp_check (HiGHS), re-checked here
  # exactly, without a solver. e8 and e10 at their tight bounds (186, 318) on the whole model;
  # e9 (606) on device 13 alone, the subset its result.json names (a subset's rows are rows of
  # the whole model, so its certificate proves the whole bound unreachable).
  from configs.schedule_search import REFERENCE_INSTANCES
  _, pa, pc, ma, mc, fa, fc = [r for r in REFERENCE_INSTANCES if r[0] == name][0]
  p = PipelineProblem(pa, pc, ma, mc, fa, fc)
  lb = bounds.tight_lower_bound(p)
  folder = os.path.join(REPO, "experiments", "results", "lp_certificates", name)
  with open(os.path.join(folder, "result.json")) as f:
    devices = json.load(f).get("devices", "all")
  model = time_indexed.build(p, lb, devices=None if devices == "all" else devices)
  path = os.path.join(folder, "certificate.npz")
  lam = time_indexed.load_certificate(path, model.A.shape[0], lb)
  assert time_indexed.certificate_bound(model, lam) > 0.5
  # A certificate is bound to its target: loading it for another one is refused.
  with pytest.raises(ValueError, match="certificate for target"):
    time_indexed.load_certificate(path, model.A.shape[0], lb + 1)
