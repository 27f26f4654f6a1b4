"""The prepared GPU script (experiments/results/h200_2026-12-04/run_gpu.sh) against the current
code: a GPU is lent rarely, for 15 device-minutes, and a step that no longer works there costs
the session its run (tests/test_docs.py checks its commands' binaries, configs and flags).

- The fused schedules the CPU searched for its plan_check steps, which it unpacks into each
  step's WORKDIR/cache/schedules, are the ones the current code looks up for those commands:
  a changed cache key or file format would make the GPU search again, on its clock, and
  compile another schedule than the CPU figures it is compared with were made with.
"""
from __future__ import annotations

import gzip
import logging
import os
import re
import shutil

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
