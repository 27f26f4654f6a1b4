"""The prepared GPU script (experiments/results/h200_2026-12-04/run_gpu.sh) against the current
code: a GPU is lent rarely, for 15 device-minutes, and a step that no longer works there costs
the session its run (tests/test_docs.py checks its commands' binaries, configs and flags).

- The fused schedules the CPU searched for its plan_check steps, which it unpacks into each
  step's WORKDIR/cache/schedules, are the ones the current code looks up for those commands:
  a changed cache key or file format would make the GPU search again, on its clock, and
  compile another schedule than the CPU figures it is compared with were made with.
- Its final grep, the summary the session reads, keeps the lines the binaries print now.
"""
from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
import subprocess

import pytest

from configs import plan_check as plan_config
from experiments import plan_programs
from rlhfuse_jax.pipeline import search
from rlhfuse_jax.trainer import pipelined

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("experiments", "results", "h200_2026-12-04")
SCRIPT = os.path.join(ROOT, RESULTS, "run_gpu.sh")


def _script() -> str:
  with open(SCRIPT, encoding="utf-8") as f:
    return f.read()


def seeded_steps() -> list[tuple[str, str, str, dict]]:
  """(seed folder under schedules/, workdir, plan_check variant, --config.<field> overrides)
  of each step that seeds a schedule cache (`seed_schedules DIR NAME && ... plan_check ...`)."""
  steps = []
  for m in re.finditer(r"seed_schedules (\S+) (\S+) &&(.*?)--workdir=(\S+)", _script(), re.S):
    seed_dir, name, command, workdir = m.groups()
    assert seed_dir == workdir, f"seed_schedules {name} unpacks into {seed_dir}/cache, but " \
                                f"its plan_check's --workdir is {workdir}"
    variant = re.search(r"--config=configs/plan_check\.py:(\S+)", command).group(1)
    overrides = dict(re.findall(r"--config\.(\w+)=(\S+)", command))
    steps.append((name, workdir, variant, overrides))
  return steps


STEPS = seeded_steps()


def test_the_script_seeds_its_fused_plan_steps():
  assert [s[0] for s in STEPS] == ["plan_gpu8", "fused13b"], STEPS


def _plan(variant: str, overrides: dict) -> plan_programs.PlanConfig:
  """The plan as plan_check builds it from the command line (absl parses an override to its
  field's type)."""
  c = plan_config.get_config(variant)
  for field, value in overrides.items():
    if isinstance(c[field], bool):  # (bool("False") is True)
      if value not in ("True", "False", "true", "false"):
        raise ValueError(f"--config.{field}={value!r}: expected True or False")
      c[field] = value.lower() == "true"
    else:
      c[field] = type(c[field])(value)
  return plan_programs.PlanConfig.from_config_dict(c)


@pytest.mark.parametrize("name,workdir,variant,overrides", STEPS, ids=[s[0] for s in STEPS])
def test_seeded_schedules_are_the_ones_the_code_looks_up(name, workdir, variant, overrides,
                                                         tmp_path, monkeypatch, caplog):
  """The seeded file is hit: the key of the current code for the command's plan, its format
  read back, no search (which would have written a schedule there and said so)."""
  cfg = _plan(variant, overrides)
  assert cfg.pp > 1 and cfg.intra_stage, f"{variant}: no searched fused schedule to seed"
  cache = tmp_path / "cache" / "schedules"  # seed_schedules: $1/cache/schedules
  cache.mkdir(parents=True)
  seeded = os.path.join(ROOT, RESULTS, "schedules", name)
  for gz in sorted(os.listdir(seeded)):
    with gzip.open(os.path.join(seeded, gz)) as src, open(cache / gz[:-len(".gz")], "wb") as dst:
      shutil.copyfileobj(src, dst)

  def no_search(*args, **kwargs):
    raise AssertionError(f"{name}: the seeded schedules of {RESULTS}/schedules/{name} are not "
                         "the current code's cache hit: it searches again (re-search them on "
                         f"the CPU with the command's settings, or fix the script)")

  monkeypatch.setattr(search, "search", no_search)
  monkeypatch.setattr(search, "warmup", no_search)
  pipe = plan_programs.pipeline_config(cfg)
  problem = pipelined.pipeline_problem(cfg.pp, pipe)
  with caplog.at_level(logging.INFO):
    schedule, path = pipelined.searched_schedule(problem, pipe, str(tmp_path))
  assert os.path.dirname(path) == str(cache)
  assert schedule.problem == problem
  assert "ignoring the cached schedule" not in caplog.text
  assert "using the cached fused schedule" in caplog.text
  # the summary says it was hit
  assert kept_by_grep(logged([caplog.records[-1].getMessage()])) != []


def grep_pattern() -> str:
  """The final summary's `grep -E` pattern: S="..." and S+="..." lines, then grep -E "$S"."""
  script = _script()
  assert re.search(r'^grep -E "\$S" ', script, re.M), "the summary's grep is not grep -E \"$S\""
  return "".join(re.findall(r'^S\+?="([^"]*)"$', script, re.M))


def kept_by_grep(lines: list[str]) -> list[str]:
  """The `lines` of a log that the script's final grep keeps."""
  out = subprocess.run(["grep", "-E", grep_pattern()], capture_output=True, text=True,
                       input="".join(f"{line}\n" for line in lines), check=False)
  return out.stdout.splitlines()


def logged(lines: list[str]) -> list[str]:
  """`lines` as absl logs them."""
  return [f"I1206 23:46:21.955296 140237921553280 plan_check.py:151] {line}" for line in lines]


def _result(fits: bool) -> dict:
  def program(name):
    return {"argument_bytes": 6.36e9, "output_bytes": 6.35e9, "temp_bytes": 10.12e9,
            "peak_bytes": 16.47e9 if fits or name != "prefill" else 90e9,
            "hbm_bytes": 80e9, "fits": fits or name != "prefill",
            "analytic": {"total_bytes": 10.69e9}, "flops_per_device": 7.3e14,
            "replication": 2.89, "compile_s": 21.9, "collective_bytes": {"all-gather": 1e9},
            "collective_s": 0.05, "compute_s": 0.7}
  names = plan_programs.PROGRAMS + plan_programs.OPTIONAL_PROGRAMS
  return {"plan": {"hardware": "h100_sxm", "generation": "instances", "pp": 8},
          "programs": {name: program(name) for name in names}}


@pytest.mark.parametrize("fits", [True, False])
def test_the_final_grep_keeps_every_programs_row_and_the_verdict(fits):
  """It kept train_step, decode and inference only and looked for "FITS", which no line says:
  prefill, migrate, placement, actor_logp and critic_values, and the verdict, were dropped."""
  lines = plan_programs.table(_result(fits))
  rows = [line for line in lines if re.search(r" (True|False) ", line)]
  assert len(rows) == len(plan_programs.PROGRAMS + plan_programs.OPTIONAL_PROGRAMS)
  assert kept_by_grep(logged(lines)) == logged(rows + [lines[-1]])
  assert lines[-1].startswith("verdict: " + ("every program fits" if fits else "DOES NOT FIT"))


def test_the_final_grep_keeps_the_decode_diagnostics_and_the_bench_summary():
  """diag.py's DECODE lines (steps 2-4) were dropped; the bench's summary is kept and its
  per-run timings, which crowded the summary's 40 lines, are not."""
  with open(os.path.join(ROOT, "experiments/results/h100_decode_variants/diag.py"),
            encoding="utf-8") as f:
    assert 'print(f"DECODE {tag} ' in f.read()
  kept = ["DECODE small auto:c b=2: 1.790 ms/step, 1117 tok/s, 24.3% of HBM peak, compile 9.0 s"
          ] + logged(["batch    1:      561.0 tokens/s  1170.000 GB/s  24.3 % of peak",
                      "ppo update: 0.4230 s, 38735.6 tokens/s, MFU 47.7 %"])
  dropped = logged(["decode batch 1: run 3/5 0.0016 s", "ppo update: run 1/5 0.0316 s"])
  assert kept_by_grep(kept + dropped) == kept


def test_a_plan_check_stopped_after_the_train_step_has_logged_its_figures(monkeypatch, caplog):
  """A GPU step cut at its timeout while the programs after the train step compile (prefill,
  migrate, placement, actor_logp, added since the timeouts were set) wrote no result.json, and
  its log said only "train_step: compiled in N s": the figures the step is run for were lost.
  The line now carries them, and the summary keeps it."""
  cfg = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("tiny"))

  def stopped(*args, **kwargs):
    raise KeyboardInterrupt("timeout")

  monkeypatch.setattr(plan_programs, "instance_programs", stopped)
  with caplog.at_level(logging.INFO), pytest.raises(KeyboardInterrupt):
    plan_programs.run(cfg, "")
  line = [r.getMessage() for r in caplog.records
          if r.getMessage().startswith("train_step: compiled")]
  assert len(line) == 1 and re.fullmatch(
      r"train_step: compiled in [0-9.]+s; per device: argument [0-9.e-]+, output [0-9.e-]+, "
      r"temp [0-9.e-]+, peak [0-9.e-]+ GB \(HBM 80\.00 GB\)", line[0]), line
  assert kept_by_grep(logged(line)) == logged(line)
