r"""Proves a makespan unreachable within the memory budget with the time-indexed LP relaxation.

The relaxation (rlhfuse_jax/pipeline/exact/time_indexed.py) holds every valid schedule within
budget; when even its fractional version has no solution, the target is unreachable, and the
multipliers saved in certificate.npz prove it: `--verify` rebuilds the model and re-checks them in
exact integer arithmetic, with no solver. A feasible LP proves nothing (use schedule_cp_check).

Needs highspy for the large models (an optional analysis dependency, like ortools for
schedule_cp_check: `pip install -e ".[exact]"`); `--solver=scipy` uses the HiGHS bundled with scipy
(small models only).
  python -m experiments.schedule_lp_check --config=configs/schedule_search.py \
      --config.memory_budget_mode=per_device \
      --config.actor_pp=16 --config.critic_pp=16 --config.actor_microbatches=32 \
      --config.critic_microbatches=32 --config.actor_fwd=2 --config.critic_fwd=1 \
      --workdir=/tmp/lp_e10
  python -m experiments.schedule_lp_check --config=configs/schedule_search.py ... \
      --config.memory_budget_mode=per_device \
      --workdir=/tmp/lp_e10 --verify=/tmp/lp_e10/certificate.npz

--devices=each scans the one-device models (device 0, 1, ...) and stops at the first one that is
certified infeasible: a quick first try on a large instance, since the device that breaks need
not be the one the tight bound comes from (e9: the bound comes from device 5, which alone is
LP-feasible; device 13 alone is certified in 39 s, where the whole model does not converge in an
hour). The certificate is saved with that device in result.json, so `--verify` with
`--devices=D` re-checks it.

Docs: docs/schedules.md ("How the proofs work").
"""
from __future__ import annotations

import importlib.util
import os
import time

from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import bounds
from rlhfuse_jax.pipeline.exact import time_indexed
from rlhfuse_jax.pipeline.graph import PipelineProblem, parse_devices

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory", required=True)
flags.mark_flags_as_required(["config"])  # without it: an AttributeError on None in main
_TARGET = flags.DEFINE_float("target", -1.0, "makespan to check; -1: the tight lower bound")
_SOLVER = flags.DEFINE_enum("solver", "pdlp", ["pdlp", "ipm", "simplex", "scipy"],
                            "LP solver: HiGHS via highspy (pdlp: first-order, for the million-"
                            "variable models), or scipy's bundled HiGHS for small models")
_TIME = flags.DEFINE_float("time_limit_s", 3600.0, "solver time limit")
_THREADS = flags.DEFINE_integer("threads", 2, "solver threads")
_VERIFY = flags.DEFINE_string("verify", None, "re-check this certificate.npz instead of solving")
_DEVICES = flags.DEFINE_list("devices", [], "model only these devices (e.g. 4,5,6): its rows "
                             "are a subset of the whole model's, so its certificate proves the "
                             "whole target unreachable too; --verify needs the same list. 'each': "
                             "one device at a time, stopping at the first certified")


def _build(problem, target, lb, devices):
  t0 = time.time()
  model = time_indexed.build(problem, target, devices=devices)
  result = {"target": target, "lower_bound": lb, "devices": devices or "all",
            "unit": model.unit, "vars": model.num_vars,
            "rows": int(model.A.shape[0]), "nonzeros": int(model.A.nnz),
            "build_s": time.time() - t0}
  logging.info("time-indexed model at %g (LB %g), devices %s: %d variables, %d rows, %d "
               "non-zeros, unit %g (%.1fs)", target, lb, result["devices"], result["vars"],
               result["rows"], result["nonzeros"], model.unit, result["build_s"])
  return model, result


def _solve(model, result, workdir):
  """Solves one model; saves its certificate in workdir when it is certified infeasible."""
  target = result["target"]
  logging.info("solving the elastic LP with %s (time limit %gs)...", _SOLVER.value, _TIME.value)
  try:
    res = time_indexed.solve(model, _SOLVER.value, _TIME.value, _THREADS.value)
  except ImportError as e:  # the LP needs the solver: one line, not two chained tracebacks
    raise ValueError(str(e)) from None
  lam = res.pop("multipliers")
  result.update(res)
  if res["certified"] and lam is not None:
    path = os.path.join(workdir, "certificate.npz")
    time_indexed.save_certificate(path, lam, target, model.devices, model.problem.budget())
    result["certificate"] = "certificate.npz"
  verdict = ("unreachable within budget (certified)" if res["certified"] else
             "LP feasible: the relaxation proves nothing" if res["status"] == "feasible" else
             f"{res['status']} (not certified)")
  logging.info("target %g, devices %s: %s; elastic optimum %s, certificate bound %s, %.1fs",
               target, result["devices"], verdict, res["elastic_optimum"],
               res["certificate_bound"], res["solve_s"])
  result["verdict"] = verdict
  return result


def main(argv):
  del argv
  problem = PipelineProblem.from_config(_CONFIG.value)
  lb = bounds.tight_lower_bound(problem)
  # schedule_cp_check's check (a negative target silently meant the tight bound); the LP's
  # horizon rounds the target down itself, so it is passed as given.
  config_files.check_makespan_target(_TARGET.value, lb)
  target = lb if _TARGET.value == -1 else _TARGET.value
  devices = parse_devices(_DEVICES.value, problem.num_devices, allow_each=True)
  if devices == "each" and _VERIFY.value:
    raise ValueError("--verify needs the device list the certificate was made for, not 'each'")
  if _VERIFY.value and not os.path.isfile(_VERIFY.value):
    raise ValueError(f"--verify={_VERIFY.value!r}: no such file")
  if _VERIFY.value and not devices:  # the certificate names the devices it was made for
    devices = time_indexed.certificate_devices(_VERIFY.value)
  no_solver = (f"--solver={_SOLVER.value} needs highspy, which is not installed (pip install "
               "-e \".[exact]\", or --solver=scipy for small models)"
               if not _VERIFY.value and _SOLVER.value != "scipy" and
               importlib.util.find_spec("highspy") is None else None)
  single = None
  if devices != "each":
    single = _build(problem, target, lb, devices)
    if no_solver and single[0].infeasible_reason is None and single[0].num_vars > 0:
      # Before the earlier run's outputs move aside (they went to previous/ first).
      raise ValueError(f"{no_solver}: the windows do not decide this model")
  elif no_solver:  # the windows may decide some devices' models without a solver
    logging.warning("%s: only a model the windows decide can be answered", no_solver)
  if not _VERIFY.value:  # a check of a certificate writes verify.json beside the solve's files
    wd.start_outputs(_WORKDIR.value, _CONFIG.value, ("result.json", "certificate.npz"))
  else:  # (it wrote verify.json into any workdir, another binary's or a training run's)
    wd.refuse_others_workdir(_WORKDIR.value)
  if devices == "each":
    scan = []
    for d in range(problem.num_devices):
      result = _solve(*_build(problem, target, lb, [d]), _WORKDIR.value)
      scan.append({k: result[k] for k in ("devices", "status", "certified", "elastic_optimum",
                                          "solve_s")})
      # The last device's result with every device tried so far, rewritten after each one so
      # that a scan stopped early keeps what it learned.
      runner.write_result(_WORKDIR.value, dict(result, scan=scan))
      if result["certified"]:
        break
    return
  model, result = single
  if _VERIFY.value:
    lam = time_indexed.load_certificate(_VERIFY.value, model.A.shape[0], target,
                                        model.problem.budget())
    bound = time_indexed.certificate_bound(model, lam)
    result.update(verified=_VERIFY.value, certificate_bound=bound, certified=bound > 0)
    logging.info("certificate %s: exact bound %.6g -> %s", _VERIFY.value, bound,
                 "target unreachable (proof)" if bound > 0 else "NOT a proof")
    wd.write_json(os.path.join(_WORKDIR.value, "verify.json"), result)
    logging.info("wrote %s", os.path.join(_WORKDIR.value, "verify.json"))
    return
  result = _solve(model, result, _WORKDIR.value)
  path = runner.write_result(_WORKDIR.value, result)
  logging.info("wrote %s%s", path, " (+ certificate.npz)" if result.get("certificate") else "")


if __name__ == "__main__":
  config_files.run(main)
