"""config.plan (docs/usage.md "Per-stage plans"): a plan file round trip, each generation mode
against the default single layout, the plans the trainer refuses, and the searched plans
it runs (sim_plan, plan_search.py:train)."""
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from configs import ppo_tiny
from rlhfuse_jax.generation import multihost, pipelined
from rlhfuse_jax.models import hf_loader, llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.sim import iteration_sim, plan_search
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.trainer import build, rollout, sim_plan, validate
from rlhfuse_jax.trainer import plan_file as plan_file_lib
from rlhfuse_jax.trainer.config import PlanConfig, TrainConfig
from rlhfuse_jax.trainer.plan_file import plan_file_summary
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES
from tests.test_trainer import record_rollouts, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan_json(path, generation, inference=None, training=None):
  """A plan.json in the format of experiments.plan_search (sim/plan_search.py _plan_dict)."""
  plan = {"generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 0,
                         **generation},
          "inference": inference or {"tp": 1, "pp": 1},
          "training": training or {"placement": "colocated", "tp": 1, "actor_pp": 1,
                                   "critic_pp": 1},
          "predicted": {"iteration_s": 1.0}, "summary": "test plan"}
  path.write_text(json.dumps(plan))
  return str(path)


def test_a_plan_file_sets_the_micro_batching_it_was_sized_with(tmp_path):
  """plan.json records the micro-batching the search timed and checked memory with, and the
  trainer runs it: without, it kept its own (4 micro-batches of 16 rows for an 8B actor on 16
  GPUs) and a plan the search said fits took 134 GB of 80 under plan_check. A config that
  sets its own micro-batching keeps it (no conflict error)."""
  piped = plan_json(tmp_path / "piped.json", {}, training={
      "placement": "colocated", "tp": 1, "actor_pp": 2, "critic_pp": 1, "micro_batch": 1,
      "actor_microbatches": 4, "critic_microbatches": 2})
  cfg = tiny_config(**{"plan.file": piped, "model.num_layers": 2, "critic_model.num_layers": 2})
  assert (cfg.pipeline.actor_microbatches, cfg.pipeline.critic_microbatches) == (4, 2)
  own = tiny_config(**{"plan.file": piped, "model.num_layers": 2, "critic_model.num_layers": 2,
                       "pipeline.actor_microbatches": 8})
  assert own.pipeline.actor_microbatches == 8
  # The set-up log names what the config kept as not applied (it listed the plan's 4 where the
  # run's 8 ran).
  line = plan_file_summary(piped, own)
  assert ("pipeline.actor_microbatches=4 (not applied: the config's 8), "
          "pipeline.critic_microbatches=2,") in line, line
  assert "not applied" not in plan_file_summary(piped, cfg)
  flat = plan_json(tmp_path / "flat.json", {}, training={
      "placement": "colocated", "tp": 1, "actor_pp": 1, "critic_pp": 1, "micro_batch": 2})
  assert tiny_config(**{"plan.file": flat}).algo.microbatch_size == 2
  # A misspelt key of a stage ("slot") was ignored: the plan ran with the config's value.
  typo = plan_json(tmp_path / "typo.json", {"slot": 8})
  with pytest.raises(ValueError, match=re.escape(
      "generation.slot is no key of a plan's generation; did you mean generation.slots? "
      "(generation takes mode, tp, pp, groups, slots)")):
    tiny_config(**{"plan.file": typo})
  # The keys taken are those plan_search writes (its training dict: the runs of its plans in
  # the tests below).
  import dataclasses as dc
  from rlhfuse_jax.sim import plan_search as ps_lib
  from rlhfuse_jax.trainer import plan_file as plan_file_lib
  keys = plan_file_lib.PLAN_STAGE_KEYS
  assert set(keys["generation"]) == {f.name for f in dc.fields(ps_lib.GenerationPlan)}
  assert set(keys["inference"]) == {f.name for f in dc.fields(ps_lib.InferencePlan)}
  # A pipelined layout without its micro-batches (actor_pp edited by hand) names them, not the
  # config field they would have set ("config.pipeline.actor_microbatches=None").
  edited = plan_json(tmp_path / "edited.json", {}, training={
      "placement": "colocated", "tp": 1, "actor_pp": 2, "critic_pp": 1, "micro_batch": 1})
  with pytest.raises(ValueError, match=re.escape(
      "training.actor_pp=2 without training.actor_microbatches and training.critic_microbatches: "
      "plan_search writes")):
    tiny_config(**{"plan.file": edited, "model.num_layers": 2, "critic_model.num_layers": 2})
  # A plan file from before (no micro_batch) leaves the config's.
  assert tiny_config(**{"plan.file": plan_json(tmp_path / "old.json", {})}).algo.microbatch_size \
      == tiny_config().algo.microbatch_size
  # The search writes them: the plan's dp and its Ma = minibatch / (dp * micro_batch).
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.iteration_sim import Workload
  from rlhfuse_jax.sim.lengths import LengthSpec
  from rlhfuse_jax.sim.shapes import get_shape
  a = get_shape("llama-7b")
  wl = Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=64, minibatch=32,
                max_new_tokens=64, prompt=LengthSpec(kind="constant", value=32, max_len=32),
                response=LengthSpec(kind="constant", value=32, max_len=64))
  assert ps.micro_batching(wl, 2, 4, 2) == {"micro_batch": 1, "actor_microbatches": 16,
                                            "critic_microbatches": 8}  # dp 2: 32 / 2 rows
  assert ps.micro_batching(wl, 2, 1, 1) == {"micro_batch": 1}


def test_plan_file_round_trip(tmp_path):
  path = plan_json(tmp_path / "plan.json", {"mode": "pipeline", "pp": 2, "groups": 4},
                   inference={"tp": 2, "pp": 1},
                   training={"placement": "colocated", "tp": 2, "actor_pp": 2, "critic_pp": 1})
  from_file = tiny_config(**{"plan.file": path})
  by_hand = tiny_config(**{"plan.generation": "pipeline", "plan.generation_pp": 2,
                           "plan.generation_groups": 4, "plan.inference_tp": 2,
                           "mesh.tensor": 2, "mesh.stage": 2, "pipeline.critic_pp": 1,
                           "optim.zero1": True})
  assert from_file == dataclasses.replace(by_hand, plan=dataclasses.replace(by_hand.plan,
                                                                            file=path))
  # The path is not part of the fingerprint (what it sets is).
  assert from_file.fingerprint() == by_hand.fingerprint()
  # An explicit setting the file agrees with is fine; one it contradicts names both.
  assert tiny_config(**{"plan.file": path, "mesh.tensor": 2}) == from_file
  with pytest.raises(ValueError, match=r"config\.mesh\.stage=4 conflicts with config\.plan\."
                     r"file=.*plan\.json', whose training\.actor_pp=2 sets it"):
    tiny_config(**{"plan.file": path, "mesh.stage": 4})


# experiments/train_ppo.check_device_count (a binary: run in a subprocess) on tiny_config with a
# plan file (argv[1]) and config.mesh.fsdp = 8, over 8 and 16 devices.
_FSDP_CHECK = """
import json, sys
from experiments import train_ppo
from tests.test_trainer import tiny_config
cfg = tiny_config(**{"plan.file": sys.argv[1], "mesh.fsdp": 8})
out = {}
for n in (8, 16):
  try:
    train_ppo.check_device_count(cfg, n, "cpu")
    out[n] = "ok"
  except ValueError as e:
    out[n] = str(e)
print(json.dumps(out))
"""


def test_a_config_fsdp_that_outgrows_the_plans_devices_is_refused_by_name(tmp_path):
  """configs/ppo_hf.py:ppo_gpu's mesh.fsdp=8 with a plan of 16 stages on 32 devices needed 128
  devices a replica: train_ppo asked for 144 fake devices, plan_check named the plan's 64
  micro-batches. Refused naming mesh.fsdp where the run's devices are too few as well; on more
  devices than the plan was searched for it runs (refused as the config was read, it was
  refused there too, where the trainer runs any plan on another count with a warning)."""
  path = plan_json(tmp_path / "plan.json", {}, training={
      "placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 2, "critic_pp": 1})
  assert tiny_config(**{"plan.file": path, "mesh.fsdp": 8}).mesh.fsdp == 8
  assert plan_file_lib.plan_fsdp_error({"fsdp": 4, "tensor": 1, "stage": 2}, path) is None
  why = (r"config\.mesh\.fsdp=8 with config\.plan\.file=.*plan\.json': one model replica then "
         r"spans mesh\.tensor=1 x mesh\.stage=2 x mesh\.fsdp=8 = 16 devices, more than the 8 the "
         r"plan trains on \(its data parallelism is mesh\.data, 4 there\)")
  assert re.fullmatch(why + r"; set config\.mesh\.fsdp=1, or a divisor of that",
                      plan_file_lib.plan_fsdp_error({"fsdp": 8, "tensor": 1, "stage": 2}, path))
  assert plan_file_lib.plan_fsdp_error({"fsdp": 8, "tensor": 1, "stage": 2}, path, 16) is None
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", _FSDP_CHECK, path], cwd=repo,
                        env=dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert re.fullmatch(why + r" and the 8 this run trains on; set config\.mesh\.fsdp=1, or a "
                      r"divisor of that", out["8"]), out
  assert out["16"] == "ok", out
  plan = json.loads(open(path).read())  # an asynchronous split trains on its training group
  plan["async"] = {"generation_devices": 4, "training_devices": 4, "staleness": 1}
  open(path, "w").write(json.dumps(plan))
  assert "more than the 4 the plan trains on" in plan_file_lib.plan_fsdp_error(
      {"fsdp": 4, "tensor": 1, "stage": 2}, path)


@pytest.mark.parametrize("plan, match", [
    ({"training": {"placement": "disjoint", "actor": {}, "critic": {}}},
     r"training\.placement='disjoint'; expected 'colocated'"),
    ({"generation": {"mode": "pipeline", "tp": 2, "pp": 2, "groups": 2}},
     r"config\.plan\.generation_tp=2: expected 1 with plan\.generation='pipeline'.*tensor "
     r"parallelism inside a stage is not implemented.*\(set by config\.plan\.file="),
    # Pipelines of instances score on the generation instances only.
    ({"generation": {"mode": "pipeline", "tp": 1, "pp": 2, "groups": 2},
      "inference": {"tp": 1, "pp": 2}},
     r"config\.plan\.inference_pp=2: expected 1 with plan\.generation='pipeline' \(inference on "
     r"pipelines of instances runs on the generation instances"),
    ({"generation": {"mode": "speculative"}}, r"generation\.mode='speculative'"),
    # A hand-edited layout: a string or null was compared with 1 first (a TypeError).
    ({"training": {"placement": "colocated", "tp": 1, "actor_pp": "2", "critic_pp": 1}},
     r"plan\.json.*: training\.actor_pp='2'; expected an integer >= 1"),
    ({"training": {"placement": "colocated", "tp": 1, "actor_pp": 2, "critic_pp": None}},
     r"training\.critic_pp=None; expected an integer >= 1"),
    ({"training": {"placement": "colocated", "tp": 0, "actor_pp": 1, "critic_pp": 1}},
     r"training\.tp=0; expected an integer >= 1"),
])
def test_plan_file_refusals(tmp_path, plan, match):
  path = plan_json(tmp_path / "plan.json", plan.get("generation", {}), plan.get("inference"),
                   plan.get("training"))
  with pytest.raises(ValueError, match=match):
    tiny_config(**{"plan.file": path})


def test_a_command_line_value_equal_to_the_default_is_not_replaced_by_the_plan(tmp_path):
  """--config.async_ppo.staleness=0 or --config.optim.zero1=False beside a plan file that sets
  1 and True: the file's values replaced them without a word (a value equal to the default was
  taken for unset), and the run went asynchronous. Given on the command line (train_ppo passes
  its --config overrides as `given`), they conflict; a micro-batching given is kept."""
  path = plan_json(tmp_path / "plan.json", {}, training={
      "placement": "colocated", "tp": 1, "actor_pp": 2, "critic_pp": 1, "micro_batch": 1,
      "actor_microbatches": 4, "critic_microbatches": 2})
  plan = json.loads(open(path).read())
  plan["async"] = {"generation_devices": 4, "training_devices": 4, "staleness": 1}
  open(path, "w").write(json.dumps(plan))
  c = ppo_tiny.get_config()
  c.plan.file = path
  c.model.num_layers = c.critic_model.num_layers = 2
  assert TrainConfig.from_config_dict(c).async_ppo.staleness == 1  # (not given: the file's)
  for field, value in (("async_ppo.staleness", 0), ("optim.zero1", False)):
    with pytest.raises(ValueError, match=re.escape(
        f"config.{field}={value!r} conflicts with config.plan.file={path!r}, whose ")):
      TrainConfig.from_config_dict(c, given={field: value})
  assert TrainConfig.from_config_dict(c).pipeline.critic_microbatches == 2  # the file's
  kept = TrainConfig.from_config_dict(c, given={"pipeline.critic_microbatches": 4})
  assert kept.pipeline.critic_microbatches == 4  # (the default, given: the config's)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--config.plan.file={path}",
                        "--config.async_ppo.staleness=0", f"--workdir={tmp_path / 'run'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and (
      f"config.async_ppo.staleness=0 conflicts with config.plan.file={path!r}"
      in out.stderr), out.stderr[-3000:]
  assert not (tmp_path / "run").exists()


def test_a_bad_value_the_plan_file_set_in_async_ppo_names_the_file(tmp_path):
  """Every section the file sets is named (it was only plan, mesh and pipeline): the user never
  wrote async_ppo.generation_devices. A field the file did not set is not blamed on it."""
  path = plan_json(tmp_path / "plan.json", {})
  plan = json.loads(open(path).read())
  plan["async"] = {"generation_devices": 4.5, "staleness": 1}
  open(path, "w").write(json.dumps(plan))
  with pytest.raises(ValueError, match=r"config\.async_ppo\.generation_devices=4\.5: expected "
                     r".*\(set by config\.plan\.file="):
    tiny_config(**{"plan.file": path})
  with pytest.raises(ValueError) as e:
    tiny_config(**{"plan.file": plan_json(tmp_path / "ok.json", {}), "optim.actor_lr": -1.0})
  assert "config.optim.actor_lr=-1.0" in str(e.value) and "set by" not in str(e.value)


def test_a_misspelt_top_level_key_of_a_plan_file_is_refused(tmp_path):
  """"asynch" for "async" was ignored: the run went synchronous without a word. Every top-level
  key is one plan_search writes (a file of its own search, with hardware and workload, loads:
  the plan_search runs of the tests below)."""
  path = plan_json(tmp_path / "plan.json", {})
  plan = json.loads(open(path).read())
  plan["asynch"] = {"generation_devices": 4, "training_devices": 4, "staleness": 1}
  open(path, "w").write(json.dumps(plan))
  with pytest.raises(ValueError, match=re.escape(
      f"config.plan.file={path!r}: asynch is no key of a plan file; did you mean async? (a "
      "plan file takes generation, inference, training, predicted, summary, async, hardware, "
      "workload, predicted_iteration_s)")):
    tiny_config(**{"plan.file": path})
  # result.json's "best" serves as a plan file too (its iteration time repeated as
  # predicted_iteration_s): it loads as plan.json does.
  del plan["asynch"]
  plan["predicted_iteration_s"] = 1.0
  open(path, "w").write(json.dumps(plan))
  assert tiny_config(**{"plan.file": path}).plan.file == path


@pytest.mark.parametrize("entry, match", [
    ([4, 4], r"async=\[4, 4\]; expected an object \{generation_devices, training_devices, "
     r"staleness, colocated\}"),
    ("4/4", r"async='4/4'; expected an object"),
    ({"generation_devices": 0, "training_devices": 8, "staleness": 1, "colocated": False},
     r"async\.generation_devices=0 with async\.colocated=false; expected an integer >= 1"),
    ({"generation_devices": -2, "staleness": 1},
     r"async\.generation_devices=-2 with async\.colocated=false; expected an integer >= 1"),
    ({"generation_devices": 4, "staleness": 1, "colocated": "no"},
     r"async\.colocated='no'; expected true or false"),
    ({"generation_devices": 4, "training_devices": "4", "staleness": 1},
     r"async\.training_devices='4'; expected an integer >= 1"),
    ({"generation_devices": 4, "training_devices": 0, "staleness": 1},
     r"async\.training_devices=0; expected an integer >= 1"),
    ({"generation_devices": "4", "training_devices": 4, "staleness": 1},
     r"async\.generation_devices='4'; expected an integer >= 1"),
], ids=["list", "string", "no_generation_group", "negative", "colocated_not_bool",
        "training_devices_text", "no_training_group", "generation_devices_text"])
def test_a_hand_edited_async_entry_that_is_no_split_is_refused(tmp_path, entry, match):
  """An "async" entry that is not an object was ignored (the run went synchronous), and a split
  with no generation group was accepted: both are refused, naming the file and the field."""
  path = plan_json(tmp_path / "plan.json", {})
  plan = json.loads(open(path).read())
  plan["async"] = entry
  open(path, "w").write(json.dumps(plan))
  with pytest.raises(ValueError, match=r"config\.plan\.file='[^']*plan\.json': " + match):
    tiny_config(**{"plan.file": path})
  # A synchronous plan (no entry, or null) and a split of 4 devices still load.
  for ok, gen in ((None, 0), ({"generation_devices": 4, "training_devices": 4, "staleness": 1,
                               "colocated": False}, 4)):
    plan["async"] = ok
    open(path, "w").write(json.dumps(plan))
    assert tiny_config(**{"plan.file": path}).async_ppo.generation_devices == gen


@pytest.mark.parametrize("overrides, match", [
    ({"plan.generation": "tpu"}, r"config\.plan\.generation='tpu': expected one of"),
    ({"plan.generation_pp": 2}, r"config\.plan\.generation_pp=2: expected its default 1 with "
     r"plan\.generation='mesh'"),
    ({"plan.generation": "pipeline", "plan.generation_pp": 4, "plan.generation_groups": 2},
     r"config\.plan\.generation_groups=2: expected >= plan\.generation_pp=4"),
    ({"plan.inference_tp": -1}, r"config\.plan\.inference_tp=-1: expected an integer >= 0"),
    ({"plan.file": "/nonexistent/plan.json"}, r"config\.plan\.file='/nonexistent/plan\.json': "
     r"cannot read a plan"),
])
def test_bad_plan_fields_name_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    tiny_config(**overrides)


def test_a_plan_file_with_a_key_given_twice_is_refused_naming_it(tmp_path):
  """Python's json kept the last value: a hand-edited plan's first setting was ignored."""
  path = tmp_path / "plan.json"
  path.write_text('{"generation": {"mode": "instances", "tp": 2, "tp": 1}, "inference": {}, '
                  '"training": {}}')
  with pytest.raises(ValueError, match=r"config\.plan\.file='.*': cannot read a plan: the key "
                                       r"'tp' appears twice in one object"):
    tiny_config(**{"plan.file": str(path)})


def test_a_plan_search_workdir_given_as_the_plan_file_names_its_plan_json(tmp_path):
  """It was "cannot read a plan: [Errno 21] Is a directory"."""
  with pytest.raises(ValueError, match=r"config\.plan\.file='.*' is a directory; expected a "
                                       r"plan\.json file$"):
    tiny_config(**{"plan.file": str(tmp_path)})
  (tmp_path / "plan.json").write_text("{}")
  with pytest.raises(ValueError, match=r"is a directory; expected a plan\.json: its "
                                       r"'.*/plan\.json'\?$"):
    tiny_config(**{"plan.file": str(tmp_path)})


@pytest.mark.parametrize("overrides, match", [
    ({"plan.generation": "instances", "plan.generation_tp": 3},
     r"config\.plan\.generation_tp=3: expected a divisor of the 8 devices"),
    ({"plan.generation": "instances", "plan.generation_slots": 1},
     r"config\.plan\.generation_slots=1: expected >= 2"),
    ({"plan.generation": "instances", "plan.inference_tp": 2},
     r"config\.plan\.inference_tp=2: expected 0 or plan\.generation_tp=1"),
    ({"plan.generation": "instances", "fusion.instance_devices": 2},
     r"config\.fusion\.instance_devices=2: expected its default 1 with config\.plan"),
    ({"plan.generation": "pipeline", "plan.generation_pp": 2},
     r"config\.plan\.generation_pp=2: expected a divisor of model\.num_layers=1"),
    ({"plan.generation": "pipeline", "plan.generation_groups": 3},
     r"config\.plan\.generation_groups=3: expected a divisor of the rollout batch 16"),
    ({"plan.generation": "pipeline", "fusion.inter_stage": True},
     r"config\.fusion\.inter_stage=True: expected False with config\.plan\.generation="),
    ({"plan.inference_tp": 3}, r"config\.plan\.inference_tp=3: expected 0 or a divisor"),
])
def test_plans_the_trainer_cannot_run_are_refused_before_any_build(tmp_path, monkeypatch,
                                                                   overrides, match):
  def no_build(*args, **kwargs):
    raise AssertionError("models were built before the plan was checked")
  monkeypatch.setattr(build, "build_models", no_build)
  with pytest.raises(ValueError, match=match):
    PPOTrainer(tiny_config(**overrides), str(tmp_path), mesh=mesh_lib.make_mesh(
        mesh_lib.MeshConfig(data=8)))


def test_a_value_the_plan_file_set_that_the_trainer_refuses_names_the_file(tmp_path,
                                                                         monkeypatch):
  """A plan's generation slots that the run's batch cannot use (a plan searched for another
  layout): the trainer's check named config.plan.generation_slots, a field the user never
  wrote, without a word of the file (only the config's own checks named it)."""
  monkeypatch.setattr(build, "build_models", lambda *a, **k: pytest.fail("models were built"))
  path = plan_json(tmp_path / "plan.json", {"slots": 1}, training={
      "placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 1, "critic_pp": 1})
  with pytest.raises(ValueError, match=(
      r"^config\.plan\.generation_slots=1: expected >= 2.* \(set by config\.plan\.file="
      + re.escape(repr(path)) + r", a plan searched for 8 devices\)$")):
    PPOTrainer(tiny_config(**{"plan.file": path}), str(tmp_path / "run"),
               mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8)))
  with pytest.raises(ValueError,
                     match=r"generation_slots=1: expected >= 2 \(16 samples .*\), or 0$"):
    PPOTrainer(tiny_config(**{"plan.generation": "instances", "plan.generation_slots": 1}),
               str(tmp_path / "run2"), mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8)))


def test_instance_widths_that_span_processes_are_refused_naming_their_field(monkeypatch):
  # 2 processes x 4 devices (jax's process queries patched: the check reads only them): an
  # instance of 8 or 3 devices would span processes, refused by the field that sets its width,
  # before anything is built; the engine's own error names the field it is given.
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  monkeypatch.setattr(jax, "local_device_count", lambda: 4)
  for overrides, field in [({"plan.generation": "instances", "plan.generation_tp": 8},
                            r"plan\.generation_tp=8"),
                           ({"fusion.inter_stage": True, "fusion.instance_devices": 8},
                            r"fusion\.instance_devices=8")]:
    with pytest.raises(ValueError, match=rf"config\.{field}: expected a divisor of each "
                       r"process's 4 devices \(2 processes\)"):
      validate.validate(tiny_config(**overrides), mesh_lib.make_mesh(
          mesh_lib.MeshConfig(data=8)))
  validate.validate(tiny_config(**{"plan.generation": "instances", "plan.generation_tp": 4}),
                    mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8)))
  devices = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
  with pytest.raises(ValueError, match=r"generation instance 0 spans processes \[0, 1\].*"
                     r"choose config\.plan\.generation_tp dividing"):
    multihost.process_of(devices[2:6], "generation instance 0", "config.plan.generation_tp")


def test_the_pipeline_plan_checks_name_the_plan_fields():
  model = tiny_config().model.replace(num_layers=4)
  with pytest.raises(ValueError, match=r"config\.plan\.generation_groups=2 < "
                     r"config\.plan\.generation_pp=4"):
    pipelined.check_pipeline(model, 8, 4, 2, 8,
                             ("config.plan.generation_pp", "config.plan.generation_groups"))


def _run(cfg, workdir, devices=4, slow_moves=None):
  """(the trainer's rollout stage, its recorded rollouts, the metrics) of a run on a data-parallel
  mesh of `devices` devices (4: fewer instances to compile, a fast test). With `slow_moves` (a
  MonkeyPatch) every fetch of a whole model (trainer.model_params) and every reshard onto the
  inference mesh (rollout._reshard) takes 0.5 s more, for test_stage_clocks_leave_out_the_weight_
  fetches (the outputs are unchanged)."""
  if slow_moves is not None:
    real_reshard = rollout._reshard

    def slow_reshard(*args):
      time.sleep(0.5)
      out, seconds = real_reshard(*args)
      return out, seconds + 0.5  # the sleep is part of the reshard
    slow_moves.setattr(rollout, "_reshard", slow_reshard)
  trainer = PPOTrainer(cfg, workdir, mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=devices),
                                                             jax.devices()[:devices]))
  stage = trainer.rollout
  if slow_moves is not None:
    fetch = trainer.model_params

    def slow(model):
      time.sleep(0.5)
      return fetch(model)
    trainer.model_params = slow
  seen = record_rollouts(trainer)
  return stage, seen, trainer.run()


# The runs every trajectory test compares: 2 layers (so that generation_pp=2 divides them) with
# scan_layers (the pipelined engine's bitwise condition), 2 iterations.
BASE = {"num_iterations": 2, "checkpoint.every": 100, "model.num_layers": 2,
        "model.scan_layers": True}


# plan.generation='pipeline': 2 layers over generation_pp=2 stages, G=4 groups of 4 rows.
PIPELINE_PLAN = {"plan.generation": "pipeline", "plan.generation_pp": 2,
                 "plan.generation_groups": 4}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
  """The default plan (generation and inference on the training mesh), run once per module,
  its weight moves made slow (_run)."""
  with pytest.MonkeyPatch.context() as mp:
    return _run(tiny_config(**BASE), str(tmp_path_factory.mktemp("mesh")), slow_moves=mp)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
  """PIPELINE_PLAN's run, its weight moves made slow (_run)."""
  with pytest.MonkeyPatch.context() as mp:
    return _run(tiny_config(**BASE, **PIPELINE_PLAN), str(tmp_path_factory.mktemp("pipeline")),
                slow_moves=mp)


@pytest.fixture(scope="module")
def inference_run(tmp_path_factory):
  """Scoring on a data=2 x tensor=2 mesh of its own (plan.inference_tp), its weight moves made
  slow (_run)."""
  with pytest.MonkeyPatch.context() as mp:
    return _run(tiny_config(**BASE, **{"plan.inference_tp": 2}),
                str(tmp_path_factory.mktemp("inference")), slow_moves=mp)


def _deterministic(rows, keep=None):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES) and
           (keep is None or k in keep)} for r in rows]


def test_instances_plan_trajectory_equals_the_default_mesh(tmp_path, default_run):
  # 4 instances of one device and 4 slots: each is one training device's share of the serial
  # batch (16 rows on data=4), the shape under which generation/fused.py is bitwise the serial
  # Generator, so the whole trajectory is bitwise the default's.
  _, seen_a, h_a = default_run
  stage, seen_b, h_b = _run(tiny_config(**BASE, **{"plan.generation": "instances"}),
                              str(tmp_path / "instances"))
  assert isinstance(stage, rollout.InstancesStage)
  assert stage.config.num_instances == 4 and stage.config.slots == 4
  for (_, a), (_, b) in zip(seen_a, seen_b, strict=True):
    for field in ("response_tokens", "response_lens", "logprobs"):
      np.testing.assert_array_equal(getattr(a.rollout, field), getattr(b.rollout, field))
    for field in ("ref_logp", "values", "scores"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert _deterministic(h_a) == _deterministic(h_b, keep=h_a[0])
  for h in h_b:  # the reshard onto the instances is measured every iteration
    assert h["timing_s/reshard_generation"] == h["timing_s/actor_to_instances"] > 0
    assert h["gen/migrated_samples"] == 0  # fusion.inter_stage off: the baseline, no migration


def test_fused_preset_layout_trajectory_equals_the_default_mesh(tmp_path, default_run):
  """configs/ppo_llama.py:fused/<pair>'s combination at toy size: the pipelined update with the
  searched fused schedule and one row per micro-batch (pipeline.*_microbatches = 0), the actor
  resharded from its stage-stacked layout onto one-device generation instances every iteration,
  the AdamW moments in host memory while they run. The same trajectory as the default layout, to
  the pipelined update's float rounding (tests/test_trainer_pipelined.py)."""
  _, seen_a, h_a = default_run
  cfg = tiny_config(**BASE, **{
      "mesh.data": 2, "mesh.stage": 2, "pipeline.critic_pp": 1, "fusion.intra_stage": True,
      "pipeline.actor_microbatches": 0, "pipeline.critic_microbatches": 0,
      "pipeline.search_time_s": 0.3, "plan.generation": "instances",
      "optim.offload_during_rollout": True})
  trainer = PPOTrainer(cfg, str(tmp_path / "fused"),
                       mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4]))
  assert trainer.update.schedule_name == "fused" and isinstance(trainer.rollout,
                                                                rollout.InstancesStage)
  problem = trainer.update.executor.program.problem
  rows = cfg.algo.minibatch_size // 2
  assert (problem.actor_microbatches, problem.critic_microbatches) == (rows, rows // 2)
  seen_b = record_rollouts(trainer)
  h_b = trainer.run()
  for (_, a), (_, b) in zip(seen_a, seen_b, strict=True):
    for field in ("response_tokens", "response_lens"):
      np.testing.assert_array_equal(getattr(a.rollout, field), getattr(b.rollout, field))
  for a, b in zip(_deterministic(h_a), _deterministic(h_b, keep=h_a[0]), strict=True):
    for k in a:
      if not k.startswith(("pipeline/", "perf/")):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert all(h["perf/optimizer_offload_bytes"] > 0 and h["timing_s/reshard_generation"] > 0
             for h in h_b)


def test_pipeline_plan_trajectory_equals_the_default_mesh(default_run, pipeline_run):
  # 2 layers over generation_pp=2 stages, G=4 groups of 4 rows: the serial Generator on data=4
  # also runs 4 rows per device, and scan_layers runs each layer as its own loop body, the
  # conditions under which generation/pipelined.py is bitwise the Generator (its docstring).
  _, seen_a, h_a = default_run
  stage, seen_b, h_b = pipeline_run
  assert isinstance(stage, rollout.PlannedStage)
  assert stage.pipe.stages == 2 and stage.pipe.bg == 4
  for (_, a), (_, b) in zip(seen_a, seen_b, strict=True):
    for field in ("response_tokens", "response_lens", "logprobs"):
      np.testing.assert_array_equal(getattr(a.rollout, field), getattr(b.rollout, field))
  assert _deterministic(h_a) == _deterministic(h_b, keep=h_a[0])
  for h in h_b:
    assert h["timing_s/reshard_generation"] > 0
    assert 0 < h["gen/pipeline_stage_busy_frac"] <= 1


def test_planned_stages_split_the_batch_over_a_pipelined_training_mesh(tmp_path, default_run):
  """On a training mesh with `stage` > 1 a planned stage generates and scores with `stage` folded
  into `data`, as the serial stage does: 4 rows per device on 4 devices, not the 8 of data=2
  run again on both stage devices. The first rollout (same initial weights, same devices) is the
  default's."""
  _, seen_a, _ = default_run
  pipe = {"plan.generation": "pipeline", "plan.generation_pp": 2, "plan.generation_groups": 4}
  over = {**BASE, "num_iterations": 1, "mesh.data": 2, "mesh.stage": 2,
          "pipeline.critic_pp": 1, "pipeline.critic_microbatches": 2}
  cfg = tiny_config(**over, **pipe)
  trainer = PPOTrainer(cfg, str(tmp_path / "pipe"),
                       mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4]))
  assert isinstance(trainer.rollout, rollout.PlannedStage)
  assert dict(trainer.rollout.scorer.mesh.shape) == {"data": 4, "fsdp": 1, "stage": 1,
                                                     "tensor": 1}
  seen_b = record_rollouts(trainer)
  trainer.run()
  (_, a), (_, b) = seen_a[0], seen_b[0]
  for field in ("response_tokens", "response_lens", "logprobs"):
    np.testing.assert_array_equal(getattr(a.rollout, field), getattr(b.rollout, field))
  for field in ("ref_logp", "values", "scores"):
    np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-6, atol=1e-6)
  # Generation on the training mesh (plan.inference_tp alone): the folded mesh too.
  cfg = tiny_config(**over, **{"plan.inference_tp": 2})
  trainer = PPOTrainer(cfg, str(tmp_path / "mesh"),
                       mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4]))
  assert dict(trainer.rollout.generator.mesh.shape) == {"data": 4, "fsdp": 1, "stage": 1,
                                                        "tensor": 1}


def test_inference_on_its_own_mesh(default_run, inference_run):
  # Scoring on data=2 x tensor=2 (the critic resharded there every iteration): the same
  # tokens in the first iteration (generation is untouched), inference numbers to float
  # rounding (the tensor-parallel reductions add in another order), so the trajectory is close,
  # not bitwise.
  _, seen_a, h_a = default_run
  stage, seen_b, h_b = inference_run
  assert dict(stage.inf_mesh.shape) == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 2}
  (_, a), (_, b) = seen_a[0], seen_b[0]
  np.testing.assert_array_equal(a.rollout.response_tokens, b.rollout.response_tokens)
  for field in ("ref_logp", "values", "scores"):
    np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-5, atol=1e-6)
  for x, y in zip(_deterministic(h_a), _deterministic(h_b, keep=h_a[0])):
    for k in x:
      atol = 0.05 if "clipfrac" in k else 1e-4
      np.testing.assert_allclose(x[k], y[k], rtol=1e-3, atol=atol, err_msg=k)
  for h in h_b:
    assert h["timing_s/reshard_inference"] > 0


@pytest.mark.parametrize("run", ["default_run", "inference_run", "pipeline_run"],
                         ids=["serial", "mesh", "pipeline"])
def test_stage_clocks_leave_out_the_weight_fetches(run, request):
  """The serial and planned stages' timing_s/generate, timing_s/inference and
  timing_s/reshard_generation time their work: fetching the whole actor and critic (a
  pipelined state's gather, timed as timing_s/reshard) is outside them, as in the fused stage.
  A fetch made 0.5 s slow shows in the step only; so does a reshard onto the inference mesh
  made 0.5 s slow, which timing_s/reshard_inference times (it was in both). Read from the
  module's runs of the default plan, plan.inference_tp=2 and plan.generation='pipeline' (_run's
  slow_moves)."""
  stage, _, history = request.getfixturevalue(run)
  assert isinstance(stage, rollout.SerialStage if run == "default_run" else rollout.PlannedStage)
  last = history[-1]  # iteration 2: compiled
  for k in ("timing_s/generate", "timing_s/inference", "timing_s/reshard_generation"):
    assert last.get(k, 0.0) < 0.5, (k, last.get(k))
  assert last["timing_s/step"] > 1.0, last
  assert ("timing_s/reshard_inference" in last) == (run == "inference_run"), last
  if "timing_s/reshard_inference" in last:
    assert last["timing_s/reshard_inference"] >= 0.5, last


def test_config_json_records_the_plan_file(tmp_path):
  from rlhfuse_jax.trainer.config import config_record
  path = plan_json(tmp_path / "plan.json", {"mode": "instances", "tp": 2, "slots": 8})
  c = ppo_tiny.get_config()
  c.plan.file = path
  record = config_record(c, TrainConfig.from_config_dict(c))
  assert record["plan"]["file"] == path
  assert record["plan_file_content"] == json.loads(open(path).read())


def test_a_plan_for_more_devices_than_jax_sees_names_the_plan_file(tmp_path):
  """train_ppo on fewer devices than a plan file's layout needs (an asynchronous plan: its
  generation group plus the training mesh) names the plan file and the device hint, before any
  build (it blamed async_ppo.generation_devices, a field the user never wrote)."""
  path = plan_json(tmp_path / "plan.json", {},
                   training={"placement": "colocated", "tp": 2, "actor_pp": 1, "critic_pp": 1})
  plan = json.loads(open(path).read())
  plan["async"] = {"generation_devices": 4, "training_devices": 4, "staleness": 1}
  open(path, "w").write(json.dumps(plan))
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")  # one CPU device
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--config.plan.file={path}",
                        f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert (f"+ config.async_ppo.generation_devices=4 (set by config.plan.file={path!r}, a plan "
          "searched for 8 devices) needs at least 6 devices, but jax sees 1 (cpu); on a CPU "
          "host add fake devices") in out.stderr, out.stderr[-3000:]
  # the plan's own count, not the least that starts (with 6 it trained on 2 devices, not 4)
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in out.stderr, out.stderr[-3000:]


def test_a_plan_mesh_that_cannot_split_the_devices_names_the_plan_file(tmp_path):
  """A plan's training tp=3 on 8 devices: the error names config.mesh, which the user never
  wrote; it now says the plan file set it."""
  path = plan_json(tmp_path / "plan.json", {}, training={
      "placement": "colocated", "devices": 8, "tp": 3, "actor_pp": 1, "critic_pp": 1})
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--config.plan.file={path}",
                        f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("config.mesh: 8 devices cannot be split as {'data': -1, 'fsdp': 1, 'stage': 1, "
          "'tensor': 3}: the fixed axes take 3 devices, which does not divide 8 (its tensor and "
          f"stage set by config.plan.file={path!r}, a plan searched for 8 devices)"
          ) in out.stderr, out.stderr[-3000:]
  assert not (tmp_path / "run").exists()


def _checkpoint_of(workdir: str, cfg) -> None:
  """One checkpoint (iteration 1) in `workdir` written by a start with `cfg` (its fingerprint),
  as a resume reads it."""
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import hooks
  ckpts = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
  try:
    ckpts.checkpointer.save(1, {"w": jnp.zeros((2,))}, {
        "iteration": 1, "seed": cfg.seed, "data": {}, "config": cfg.fingerprint()})
    ckpts.checkpointer.wait()
  finally:
    ckpts.checkpointer.close()


def _resume_refusal(workdir: str, cfg) -> str:
  """The ValueError a start with `cfg` raises resuming `workdir`'s checkpoints, as text."""
  from rlhfuse_jax.trainer import hooks
  c = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
  try:
    with pytest.raises(ValueError) as e:
      c.resume_point()
  finally:
    c.checkpointer.close()
  return str(e.value)


def test_a_resume_refused_for_a_changed_plan_file_names_the_file(tmp_path):
  """Resuming after the plan file changed listed async_ppo.generation_devices, async_ppo.
  staleness and plan.generation_slots, fields the user never set, without a word of the file:
  the refusal says they come from config.plan.file, that its content differs from the one the
  checkpoints were written with, and where the original is saved. A field the config itself
  changed is not blamed on the file."""
  path = plan_json(tmp_path / "plan.json", {"slots": 8})
  plan = json.loads(open(path).read())
  plan["async"] = {"generation_devices": 4, "training_devices": 4, "staleness": 1,
                   "colocated": False}
  original = json.dumps(plan)
  open(path, "w").write(original)
  workdir = str(tmp_path / "run")
  _checkpoint_of(workdir, tiny_config(**{"plan.file": path}))
  resume = functools.partial(_resume_refusal, workdir)

  plan["generation"]["slots"] = 4
  plan["async"].update(generation_devices=2, training_devices=6, staleness=2)
  open(path, "w").write(json.dumps(plan))
  msg = resume(tiny_config(**{"plan.file": path}))
  assert ("async_ppo.generation_devices: 4 -> 2; async_ppo.staleness: 1 -> 2; "
          "plan.generation_slots: 8 -> 4. async_ppo.generation_devices, async_ppo.staleness, "
          f"plan.generation_slots are set by config.plan.file={path!r}, whose content differs "
          "from the plan file the checkpoints were written with: that one is saved in "
          f"{os.path.join(workdir, 'config.json')} under \"plan_file_content\"") in msg, msg
  # The workdir's config.json says which plan the checkpoints' start ran: none at all ...
  record = os.path.join(workdir, "config.json")
  open(record, "w").write(json.dumps({"seed": 0}))
  msg = resume(tiny_config(**{"plan.file": path}))
  assert (f"plan.generation_slots are set by config.plan.file={path!r}, and the checkpoints were "
          f"written without a plan file ({record}): resume without it.") in msg, msg
  # ... or a plan that set the same values as the file now: the file is not blamed (a flag of
  # the first start's command line changed; config.3.json: a later start's record, read for
  # checkpoints after iteration 3 only).
  open(record, "w").write(json.dumps({"plan_file_content": plan}))
  open(os.path.join(workdir, "config.3.json"), "w").write(json.dumps({"seed": 0}))
  msg = resume(tiny_config(**{"plan.file": path}))
  assert "plan.generation_slots: 8 -> 4" in msg and "config.plan.file" not in msg, msg
  open(path, "w").write(original)
  msg = resume(tiny_config(**{"plan.file": path, "optim.actor_lr": 1e-4}))
  assert "optim.actor_lr: " in msg and "config.plan.file" not in msg, msg
  # The checkpoints' plan file not given now: its fields were listed without a word of it.
  os.remove(os.path.join(workdir, "config.3.json"))
  open(record, "w").write(json.dumps({"plan": {"file": path},
                                      "plan_file_content": json.loads(original)}))
  msg = resume(tiny_config())
  assert ("async_ppo.generation_devices: 4 -> 0; async_ppo.staleness: 1 -> 0" in msg and
          "async_ppo.generation_devices, async_ppo.staleness, " in msg and
          f"plan.inference_tp are set by the plan file the checkpoints were written with "
          f"(config.plan.file={path!r}), which this start does not give: its content is saved "
          f"in {record} under \"plan_file_content\"; to resume, set config.plan.file to it"
          ) in msg, msg
  # A re-searched plan without the "async" entry: the fields only the old one set are named.
  synced = json.loads(original)
  del synced["async"]
  open(path, "w").write(json.dumps(synced))
  msg = resume(tiny_config(**{"plan.file": path}))
  assert (f"async_ppo.generation_devices, async_ppo.staleness are set by config.plan.file="
          f"{path!r} or by the plan file the checkpoints were written with: that one is saved "
          f"in {record}") in msg, msg


def test_a_resume_refusal_blames_no_plan_file_for_the_configs_own_micro_batching(tmp_path):
  """The checkpoints' start kept its own algo.microbatch_size=4 over its plan file's 2; resumed
  without the file, the refusal said the file set it (setting config.plan.file back gives 2,
  not the checkpoints' 4). The fields the file did set are still named."""
  path = plan_json(tmp_path / "plan.json", {"slots": 8}, training={
      "placement": "colocated", "tp": 1, "actor_pp": 1, "critic_pp": 1, "micro_batch": 2})
  workdir = str(tmp_path / "run")
  _checkpoint_of(workdir, tiny_config(**{"plan.file": path, "algo.microbatch_size": 4}))
  open(os.path.join(workdir, "config.json"), "w").write(json.dumps(  # (the start's record)
      {"plan": {"file": path}, "plan_file_content": json.loads(open(path).read())}))
  msg = _resume_refusal(workdir, tiny_config())
  assert "algo.microbatch_size: 4 -> 0" in msg, msg
  assert ("plan.inference_tp: 1 -> 0. plan.generation, plan.generation_slots, plan.inference_tp "
          "are set by the plan file the checkpoints were written with") in msg, msg


def test_a_plan_searched_for_other_devices_says_so(tmp_path):
  """A plan file searched for another device count: a field it set that the config refuses is
  named with the plan's device count (a 256-device plan run on 8 failed on plan.generation_tp
  alone), and one that runs on this run's devices is warned of: its times and memory check
  were for the others."""
  bad = plan_json(tmp_path / "big.json", {"mode": "pipeline", "tp": 8, "pp": 1, "groups": 1},
                  training={"placement": "colocated", "devices": 64, "tp": 8, "actor_pp": 1,
                            "critic_pp": 1})
  plan = json.loads(open(bad).read())
  plan["async"] = {"generation_devices": 192, "training_devices": 64, "staleness": 1}
  open(bad, "w").write(json.dumps(plan))
  with pytest.raises(ValueError, match=r"config\.plan\.generation_tp=8: .*\(set by config\.plan"
                     r"\.file='[^']*', a plan searched for 256 devices\)"):
    tiny_config(**{"plan.file": bad})
  # a hand-edited count that is not a number names no device count (it raised a TypeError)
  odd = json.loads(open(bad).read())
  odd["async"]["training_devices"] = "64"
  from rlhfuse_jax.trainer.plan_file import plan_devices
  assert plan_devices(odd) is None and plan_devices(plan) == 256
  small = plan_json(tmp_path / "small.json", {},
                    training={"placement": "colocated", "devices": 16, "tp": 1, "actor_pp": 1,
                              "critic_pp": 1})
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")  # one CPU device
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--config.plan.file={small}",
                        "--workdir=gs://stop/here"], cwd=ROOT, env=env,  # refused next
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "a URI" in out.stderr, out.stderr[-3000:]
  assert (f"config.plan.file={small!r} was searched for 16 devices and this run has 1: its "
          "predicted times and memory check are for 16") in out.stderr, out.stderr[-3000:]


def test_a_plan_searched_for_another_workload_is_warned_of(tmp_path):
  """plan.json records the workload it was searched for ("workload"), and train_ppo warns,
  naming each field, of a run whose models or batch differ: a plan for an 8-layer, hidden-512
  model at batch 128 ran ppo_tiny's 2-layer model at 64 without a word. The warning comes
  before the trainer's checks (here a top_k refused by validate stops the run in seconds)."""
  (tmp_path / "big.py").write_text(
      "from configs import ppo_tiny\n\n\ndef get_config():\n"
      "  c = ppo_tiny.get_config()\n"
      "  c.model.num_layers, c.model.hidden_size = 8, 512\n"
      "  c.rollout.prompts_per_iteration = 128\n  return c\n")
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
       f"--config.train_config={tmp_path / 'big.py'}", f"--workdir={tmp_path / 'ps'}",
       "--config.systems=pipe_rlhf"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  path = str(tmp_path / "ps" / "plan.json")
  w = json.loads(open(path).read())["workload"]
  assert (w["actor"]["num_layers"], w["actor"]["hidden_size"], w["critic"]["num_layers"],
          w["global_batch"], w["minibatch"], w["epochs"], w["max_prompt_len"],
          w["max_new_tokens"], w["num_devices"]) == (8, 512, 2, 128, 32, 2, 8, 12, 8), w
  assert w["train_config"] == str(tmp_path / "big.py")
  # The constants every predicted time rests on, in the result and the report.
  assert json.loads((tmp_path / "ps" / "result.json").read_text())["efficiency"]["train_mfu"] \
      == 0.45
  assert "| train_mfu | 0.45 |" in (tmp_path / "ps" / "plan_search.md").read_text()
  # The report names the models it planned: the run's (ppo_tiny's 2 × 64 critic)
  assert (f"| actor | big actor | 7.9M | 8 | 512 | 128 | 4 / 2 x 128 | 22 | 4 / 4 | "
          f"{tmp_path / 'big.py'}: model |") in (tmp_path / "ps" / "plan_search.md").read_text()
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--config.plan.file={path}",
                        f"--workdir={tmp_path / 'run'}", "--config.rollout.top_k=100000"],
                       cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu",
                                      # the plan's devices (it may pipeline: stage 2 since
                                      # the models' float32 bytes are counted)
                                      "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "config.rollout.top_k=100000" in out.stderr, out.stderr[-3000:]
  assert (f"config.plan.file={path!r} was searched for actor num_layers=8 (this run has 2); "
          "actor hidden_size=512 (this run has 64); actor head_dim=128 (this run has 16); "
          "global_batch=128 (this run's "
          f"rollout.batch_size is 64) (plan_search's train_config={str(tmp_path / 'big.py')!r})"
          ": its predicted times and memory check are for that workload") in out.stderr, \
      out.stderr[-3000:]
  # A plan file from before the entry loads, with a note; an unchanged workload says nothing.
  from rlhfuse_jax.trainer.plan_file import plan_workload_note
  cfg = tiny_config(**{"plan.file": plan_json(tmp_path / "old.json", {})})
  assert plan_workload_note(cfg.plan.file, cfg) == (False, (
      f"config.plan.file={cfg.plan.file!r} records no workload (a plan.json written before "
      "plan_search recorded one): not compared with this run's"))


@pytest.mark.parametrize("setting, message", [
    ("c.algo.minibatch_size = 48",
     "config.algo.minibatch_size=48: expected a divisor of the rollout batch"),
    # a prompts file with a bad row: read with the workload, after the outputs had started
    ("c.data.prompts_file = PROMPTS", "bad.jsonl:2: invalid JSON"),
    # a reward model's checkpoint that is not there: read with the workload (its shape) too
    ("c.reward.kind = 'model'\n  c.reward.model_checkpoint = MISSING",
     "no_rm/config.json not found"),
])
def test_plan_search_refuses_a_train_config_before_moving_the_earlier_plan(tmp_path, setting,
                                                                             message):
  """A train_config the trainer refuses (a mini-batch that does not divide the batch, a prompts
  file with a bad row) is refused before the outputs start: it moved the earlier search's
  plan.json, the file a train_ppo run's config.plan.file names, to previous/1 and wrote a
  config.json of a search that never ran. (A subprocess: the binary defines absl flags.)"""
  (tmp_path / "bad.jsonl").write_text('{"prompt": "#3 =", "target": "#2"}\n{"prompt": \n')
  setting = setting.replace("PROMPTS", repr(str(tmp_path / "bad.jsonl"))).replace(
      "MISSING", repr(str(tmp_path / "no_rm")))
  (tmp_path / "bad.py").write_text(
      "from configs import ppo_tiny\n\n\ndef get_config():\n"
      f"  c = ppo_tiny.get_config()\n  {setting}\n  return c\n")
  run = tmp_path / "ps"
  run.mkdir()
  (run / "plan.json").write_text('{"earlier": true}')
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
       f"--config.train_config={tmp_path / 'bad.py'}", f"--workdir={run}"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and message in out.stderr, out.stderr[-3000:]
  # (traceback.txt: where the error was raised, as after any failed start)
  assert not {"previous", "config.json"} & set(os.listdir(run)), os.listdir(run)
  assert json.loads((run / "plan.json").read_text()) == {"earlier": True}


def test_a_run_configs_unreadable_reward_model_is_named_as_the_user_typed_it(tmp_path):
  """--run_config.reward.model_checkpoint that cannot be read: plan_search (which sizes the
  reward model at its checkpoint's shape) and plan_check with a plan file (which compares the
  plan's reward model with the run's) said config.reward.model_checkpoint, a flag the user did
  not type; every other refusal of the run names --run_config.<field>."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  run = ["--run_config=configs/ppo_tiny.py", "--run_config.reward.kind=model",
         f"--run_config.reward.model_checkpoint={tmp_path / 'no_rm'}"]
  want = ("--run_config (config.<field> is --run_config.<field> here): "
          f"config.reward.model_checkpoint={str(tmp_path / 'no_rm')!r}")
  for binary, config, extra in (
      ("plan_search", "plan_search.py:train", []),
      ("plan_check", "plan_check.py",
       [f"--run_config.plan.file={plan_json(tmp_path / 'plan.json', {})}"])):
    out = subprocess.run([sys.executable, "-m", f"experiments.{binary}",
                          f"--config=configs/{config}", *run, *extra,
                          f"--workdir={tmp_path / binary}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and want in out.stderr, (binary, out.stderr[-3000:])


def test_plan_search_checks_a_calibration_against_the_runs_actor(tmp_path):
  """plan_search:train simulates the run's actor, but config.calibration's measured decode step
  was compared with the preset pairs' actors (65B): a calibration of the run's very model was
  refused, and after the outputs had started. Now the run's actor is the one compared, and a
  calibration of another model is refused before anything moves."""
  from rlhfuse_jax.policy import calibration
  from rlhfuse_jax.sim import shapes
  cfg = TrainConfig.from_config_dict(ppo_tiny.get_config())
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  n = shapes.from_model_config(build.resolve_config(cfg, tokenizer, log=False).model,
                               "actor").num_params()
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  for params, ok in ((n, True), (3 * n, False)):
    cal = tmp_path / f"cal_{params}.json"
    cal.write_text(json.dumps({
        "format": calibration.FORMAT, "device": "test", "model_params": params,
        "ops": {"decode_step": {"occupied_slots": [1, 8], "seconds": [1e-3, 2e-3]}}}))
    run = tmp_path / f"ps_{params}"
    out = subprocess.run(
        [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
         "--config.systems=", f"--config.calibration={cal}", f"--workdir={run}"], cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=300)
    if ok:
      assert out.returncode == 0, out.stderr[-3000:]
      assert json.loads((run / "result.json").read_text())["best"], out.stderr[-2000:]
    else:
      assert out.returncode == 1 and (f"on a model of {3 * n:,} parameters, and the simulated "
                                      f"actors have {n:,}: those times are that model's own: "
                                      "measure the run's own actor") in out.stderr, \
          out.stderr[-3000:]
      assert "--config.pairs" not in out.stderr  # (the paper pairs' advice: no pairs here)
      assert not run.exists() or not {"config.json", "result.json"} & set(os.listdir(run))


def _ppo_tiny_at_a_path_with_a_space(tmp_path) -> str:
  """configs/ppo_tiny.py copied to TMP/my runs/long_run.py: its path."""
  (tmp_path / "my runs").mkdir()
  path = str(tmp_path / "my runs" / "long_run.py")
  shutil.copy(os.path.join(ROOT, "configs", "ppo_tiny.py"), path)
  return path


def test_plan_search_takes_a_run_config_with_train_ppos_overrides(tmp_path):
  """plan_search:train searched a train_ppo config file as written: a run with overrides
  (--config.rollout.max_new_tokens=...) needed a config file of its own. --run_config takes
  the file and its overrides as plan_check's does; the workload, plan.json's record and the
  report are the overridden run's, the trainer's refusals name --run_config.<field>, and a
  search of a paper pair (no run) refuses it.

  The file is at a path with a space: plan_search joined --run_config's PATH and its overrides
  into one string and cut it at its first space for the workload's name (a config at
  'my runs/long_run.py' was searched as 'my'). The path travels beside the overrides: the
  models are named after the file, and plan.json and the report record the whole path followed
  by the overrides."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  path = _ppo_tiny_at_a_path_with_a_space(tmp_path)
  cmd = [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
         f"--run_config={path}", "--config.systems=realhf_like",
         f"--workdir={tmp_path / 'ps'}"]
  out = subprocess.run(cmd + ["--run_config.rollout.max_new_tokens=16",
                              "--run_config.model.num_layers=4"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  w = json.loads((tmp_path / "ps" / "plan.json").read_text())["workload"]
  spec = f"{path} --run_config.model.num_layers=4 --run_config.rollout.max_new_tokens=16"
  assert (w["actor"]["num_layers"], w["critic"]["num_layers"], w["max_new_tokens"],
          w["train_config"], w["actor"]["name"], w["critic"]["name"]) == (
              4, 2, 16, spec, "long_run actor", "long_run critic"), w
  md = (tmp_path / "ps" / "plan_search.md").read_text()
  assert f"# Plan search: {spec} on 8 x h100_sxm" in md
  # A system faster than the plans the trainer runs is explained, not left beside them bare.
  res = json.loads((tmp_path / "ps" / "result.json").read_text())
  assert res["systems"]["realhf_like"]["iteration_s"] < min(
      res["best"]["predicted_iteration_s"], res["async"]["predicted_iteration_s"])
  assert "Faster than the plans above: realhf_like. The systems are simulated as their papers " \
      "run them, not only as the trainer runs (realhf_like's actor and critic" in md, md
  out = subprocess.run(cmd + ["--run_config.algo.minibatch_size=48"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and ("--run_config (config.<field> is --run_config.<field> here): "
                                  "config.algo.minibatch_size=48: expected a divisor") \
      in out.stderr, out.stderr[-3000:]
  out = subprocess.run([sys.executable, "-m", "experiments.plan_search",
                        "--config=configs/plan_search.py:13b/13b",
                        "--run_config=configs/ppo_tiny.py", f"--workdir={tmp_path / 'pair'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "--run_config: searches a training run's workload with " \
      "--config=configs/plan_search.py:train" in out.stderr, out.stderr[-3000:]
  assert not (tmp_path / "pair").exists()


def test_plan_search_refuses_a_float16_run_before_its_outputs_start(tmp_path):
  """--run_config.model.dtype=float16, a run train_ppo refuses, started the outputs (an
  earlier plan.json moved to previous/) and was refused only after the search, plan by plan,
  named config.model.dtype among the search's own refusals."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  (tmp_path / "ps").mkdir()
  (tmp_path / "ps" / "plan.json").write_text("{}")
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
       "--run_config=configs/ppo_tiny.py", "--config.systems=realhf_like",
       "--run_config.model.dtype=float16", f"--workdir={tmp_path / 'ps'}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and ("--run_config (config.<field> is --run_config.<field> here): "
                                  "config.model.dtype='float16': a trained model in float16 "
                                  "needs loss scaling") in out.stderr, out.stderr[-3000:]
  left = set(os.listdir(tmp_path / "ps"))  # (traceback.txt: where the error was raised)
  assert "plan.json" in left and not left & {"previous", "config.json"}, left


def test_the_set_up_log_names_what_the_plan_file_set(tmp_path):
  """A plan file's settings are applied under fields the user may not have written (zero1 among
  them, with no way back), so the trainer's set-up log names each one (the trainer logs
  plan_file_lib.plan_file_summary)."""
  path = plan_json(tmp_path / "plan.json", {"mode": "instances", "tp": 2, "slots": 8},
                   inference={"tp": 2, "pp": 1},
                   training={"placement": "colocated", "tp": 2, "actor_pp": 1, "critic_pp": 1})
  line = plan_file_summary(path)
  assert line.startswith(f"config.plan.file={path!r} sets "), line
  for setting in ("plan.generation='instances'", "plan.generation_tp=2", "mesh.tensor=2",
                  "mesh.stage=1", "optim.zero1=True"):
    assert setting in line, (setting, line)


# ------------------------------------------------------------- searched plans the trainer runs
H100 = CostModel(get_hardware("h100_sxm"))


def _search(tmp_path, config_dict, runnable=True, accept=False, top_k=1000):
  """(the resolved config, its workload on 8 H100s, the workload's lengths, the trainer's plan
  check, the plan search's result): every combination kept (top_k), asynchronous splits in
  steps of one device; restricted to plans the trainer runs with `runnable`, and by the
  trainer's check with `accept`."""
  cfg = TrainConfig.from_config_dict(config_dict)
  task, tokenizer = build.build_task_and_tokenizer(cfg)
  cfg = build.resolve_config(cfg, tokenizer)
  wl, info = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))
  check = sim_plan.PlanCheck(config_dict, jax.devices(), tokenizer, str(tmp_path))
  opt = iteration_sim.SimOptions(trainer_runnable=runnable)
  res = plan_search.search(H100, wl, opt, top_k=top_k, staleness=1, split_unit=1,
                           accept=check if accept else None)
  return cfg, wl, info, check, res


def test_searched_plans_for_ppo_tiny_pass_the_trainer_checks(tmp_path):
  """Every plan the restricted search lets through for ppo_tiny on 8 devices (all synchronous
  combinations, and each asynchronous split's best), written as plan.json, passes
  TrainConfig.from_config_dict + validate on the 8 fake devices, without training; unrestricted,
  the search emits plans the trainer refuses."""
  cfg, wl, info, check, res = _search(tmp_path, ppo_tiny.get_config())
  # The workload is the run's.
  assert (wl.global_batch, wl.minibatch, wl.epochs, wl.max_new_tokens) == (64, 32, 2, 12)
  assert wl.actor.num_params() == cfg.model.num_params()
  assert wl.critic.num_params() == cfg.critic_model.num_params() and wl.critic.head == "scalar"
  prompts, resp = wl.sample_lengths()
  assert set(prompts) == {4}  # <bos> d #n =, within data.max_prompt_len
  assert set(resp) == set(range(2, 10))  # 'repeat': n in 1..8, + EOS
  assert "targets + EOS" in info["response_lengths_from"]
  assert len(res["top"]) >= 5 and res["refused"]
  assert any(not p["async"]["colocated"] for p in res["async"]["top"])
  for p in res["top"] + res["async"]["top"]:
    assert plan_search.trainer_refusal(wl, p) is None
    assert check(p) is None, p["summary"]
  fit = [sp["generation_devices"] for sp in res["async"]["splits"] if "iteration_s" in sp]
  assert fit and all(64 % g == 0 for g in fit)
  # Unrestricted, the best plan trains actor and critic on disjoint devices, and the async
  # search splits 6 / 2: the trainer refuses both.
  free = _search(tmp_path, ppo_tiny.get_config(), runnable=False, top_k=5)[-1]
  assert "disjoint" in check(free["best"])
  assert any(check(p) for p in free["async"]["top"])


def test_a_run_whose_reward_is_a_function_is_searched_without_a_reward_model(tmp_path):
  """reward.kind='function' (ppo_tiny's): the trainer builds and runs no reward model
  (build.reward_model_config), yet the search charged a critic-shaped one's weights and
  forwards. The run's workload says it has none (RewardConfig.uses_model), plan.json's record
  carries it (a run with a reward model is warned of), and the search's inference times and
  memory drop its forwards and weights."""
  raw = TrainConfig.from_config_dict(ppo_tiny.get_config())
  task, tokenizer = build.build_task_and_tokenizer(raw)
  cfg = build.resolve_config(raw, tokenizer)
  assert cfg.reward.kind == "function"
  wl = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))[0]
  assert wl.reward_model is False
  rm = dataclasses.replace(wl, reward_model=True)
  assert wl.frozen_models()[0] == ("reference", "critic")
  assert rm.frozen_models()[0] == ("reference", "critic", "reward")
  record = plan_search.workload_record(wl)
  assert record["reward_model"] is False and plan_search.workload_record(rm)["reward_model"]
  with_rm = dataclasses.replace(cfg, reward=dataclasses.replace(
      cfg.reward, kind="model", model_checkpoint="/ckpt"))
  assert plan_file_lib.plan_workload_differences({"workload": record}, with_rm) == [
      "reward_model=False (this run's reward.kind='model': a reward model)"]
  assert plan_file_lib.plan_workload_differences({"workload": record}, cfg) == []
  plan, mem = _searched_without_and_with(wl, rm)
  critic = wl.critic.weight_bytes() / plan["inference"]["tp"]
  assert mem["with"]["inference"]["weights"] - mem["without"]["inference"]["weights"] == (
      pytest.approx(critic))
  assert mem["with"]["generation"]["frozen weights kept"] - (
      mem["without"]["generation"]["frozen weights kept"]) == pytest.approx(critic)


def test_a_run_with_a_reward_model_is_searched_at_its_shape(tmp_path):
  """reward.kind='model': the trainer loads the reward model at its checkpoint's shape
  (build.reward_model_config), which need not be the critic's; the search sized and timed it
  as the critic. The run's workload carries the checkpoint's shape at the run's dtypes
  (Workload.reward), plan.json's record names it (and the trainer compares it with its own),
  and the search's inference memory holds its weights, not a critic's."""
  raw = TrainConfig.from_config_dict(ppo_tiny.get_config())
  task, tokenizer = build.build_task_and_tokenizer(raw)
  rm_cfg = raw.model.replace(vocab_size=tokenizer.vocab_size, head="scalar", hidden_size=128,
                             intermediate_size=256, num_layers=4)
  hf_loader.save_hf_checkpoint(llama.host_random_params(rm_cfg, 0), rm_cfg,
                               str(tmp_path / "rm"))
  cfg = build.resolve_config(dataclasses.replace(raw, reward=dataclasses.replace(
      raw.reward, kind="model", model_checkpoint=str(tmp_path / "rm"))), tokenizer)
  wl = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))[0]
  assert (wl.reward.num_layers, wl.reward.hidden_size) == (4, 128) != (
      wl.critic.num_layers, wl.critic.hidden_size)
  assert wl.reward.weight_itemsize == wl.reward.kv_itemsize == 4  # ppo_tiny's float32
  assert wl.frozen_models() == (("reference", "critic", "reward"),
                                (wl.actor, wl.critic, wl.reward))
  record = plan_search.workload_record(wl)
  assert record["reward"]["num_layers"] == 4
  # The trainer warns of a plan searched for another reward model (plan_workload_note).
  rm = build.reward_model_config(cfg)
  assert plan_file_lib.plan_workload_differences({"workload": record}, cfg, rm) == []
  assert plan_file_lib.plan_workload_differences({"workload": record}, cfg, rm.replace(
      num_layers=2, dtype="bfloat16")) == [
          "reward num_layers=4 (this run has 2)",
          "reward kv_itemsize=4 bytes (this run's model.dtype='bfloat16': 2)"]
  with pytest.raises(ValueError, match=r"workload\.reward .* must have head='scalar'"):
    dataclasses.replace(wl, reward=wl.actor)
  plan, mem = _searched_without_and_with(dataclasses.replace(wl, reward_model=False), wl)
  # The reward model's weights over the inference tp: its own, 4x the critic's here.
  assert mem["with"]["inference"]["weights"] - mem["without"]["inference"]["weights"] == (
      pytest.approx(wl.reward.weight_bytes() / plan["inference"]["tp"]))
  assert wl.reward.weight_bytes() > 3 * wl.critic.weight_bytes()


def _searched_without_and_with(wl, other):
  """Searches of the run's workload `wl` and of `other`, the same with one more frozen model:
  each stage's inference time is lower without it (asserted here); (`other`'s best plan, each
  workload's per-stage memory parts under that plan: {"without": ..., "with": ...})."""
  opt = iteration_sim.SimOptions(trainer_runnable=True, offload_frozen=False)
  pair = {"without": wl, "with": other}
  got = {k: plan_search.search(H100, w, opt, top_k=1) for k, w in pair.items()}
  inf = {k: dict(r["stages"]["inference"]) for k, r in got.items()}
  assert inf["without"].keys() == inf["with"].keys()
  assert all(inf["without"][k] < inf["with"][k] for k in inf["with"])
  plan = got["with"]["best"]
  return plan, {k: {r["stage"]: r["parts"] for r in plan_search.plan_memory(H100, w, opt, plan)}
                for k, w in pair.items()}


def test_a_run_without_a_reference_is_searched_without_one(tmp_path):
  """algo.kl_coef=0: the trainer builds and runs no reference model (AlgoConfig.uses_reference).
  The run's workload says so, plan.json's workload record carries it (a run with a reference is
  warned of), and the search charges neither the reference's forwards nor its weights, which it
  did: the same inference times and memory as with one."""
  c = ppo_tiny.get_config()
  c.algo.kl_coef = 0.0
  raw = TrainConfig.from_config_dict(c)
  task, tokenizer = build.build_task_and_tokenizer(raw)
  cfg = build.resolve_config(raw, tokenizer)
  wl = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))[0]
  assert wl.reference is False
  ref = dataclasses.replace(wl, reference=True)
  record = plan_search.workload_record(wl)
  assert record["reference"] is False
  with_ref = build.resolve_config(TrainConfig.from_config_dict(ppo_tiny.get_config()), tokenizer)
  assert plan_file_lib.plan_workload_differences({"workload": record}, with_ref) == [
      "reference=False (this run's algo.kl_coef=0.01: a reference model)"]
  assert plan_file_lib.plan_workload_differences({"workload": record}, cfg) == []
  plan, mem = _searched_without_and_with(wl, ref)
  tp = plan["inference"]["tp"]
  actor = wl.actor.weight_bytes() / tp
  assert mem["with"]["inference"]["weights"] - mem["without"]["inference"]["weights"] == (
      pytest.approx(actor))
  # (none kept without a reference: ppo_tiny's reward is a function, no reward model either)
  assert mem["with"]["generation"]["frozen weights kept"] - (
      mem["without"]["generation"].get("frozen weights kept", 0.0)) == pytest.approx(actor)


def test_the_trainer_check_restricts_what_the_config_pins(tmp_path):
  """ppo_tiny:fused sets mesh.stage=4 and pipeline.critic_pp=2 and fuses generation with
  inference on instances: the search's own rules let other plans through, which the trainer's
  check (accept) refuses; with it, every plan left keeps the config's layout."""
  c = ppo_tiny.get_config("fused")
  res = _search(tmp_path, c, top_k=5)[-1]
  assert any(p["training"]["actor_pp"] != 4 for p in res["top"])
  _, _, _, check, res = _search(tmp_path, c, accept=True)
  assert any("conflicts with config.plan.file=<the searched plan>, whose " in why
             for why in res["refused"])
  # (it named the check's own temporary file, plan_check.json, which the user never wrote)
  assert not any("plan_check.json" in why for why in res["refused"])
  for p in res["top"] + res["async"]["top"]:
    assert (p["training"]["actor_pp"], p["training"]["critic_pp"]) == (4, 2)
    assert p["generation"]["mode"] == "instances" and check(p) is None


def test_plan_search_binary_for_a_train_config(tmp_path):
  """configs/plan_search.py:train: ppo_tiny's plan, which train_ppo's config accepts as
  config.plan.file."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
       f"--workdir={tmp_path}", "--config.systems=pipe_rlhf"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((tmp_path / "result.json").read_text())
  plan = json.loads((tmp_path / "plan.json").read_text())
  assert res["setting"]["train_config"] == "configs/ppo_tiny.py" and res["refused"]
  assert (tmp_path / "lengths" / "response_lengths.txt").exists()
  assert not (tmp_path / "plan_check.json").exists()
  # the hardware's values, not only its name (a file of one's own may change after)
  assert plan["hardware"] == res["hardware"] == json.loads(json.dumps(
      get_hardware("h100_sxm").to_dict()))
  c = ppo_tiny.get_config()
  c.plan.file = str(tmp_path / "plan.json")
  cfg = TrainConfig.from_config_dict(c)
  assert cfg.plan.generation == plan["generation"]["mode"]
  # The workload it records is the run's: no warning.
  from rlhfuse_jax.trainer.plan_file import plan_workload_note
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  assert plan["workload"]["train_config"] == "configs/ppo_tiny.py"
  assert plan_workload_note(c.plan.file, build.resolve_config(cfg, tokenizer)) is None
  if res["plan_json"] == "asynchronous":
    assert cfg.async_ppo.generation_devices == plan["async"]["generation_devices"]
  assert "restricted to plans the trainer runs" in (tmp_path / "plan_search.md").read_text()
  assert "critic_note" not in res["setting"]


def test_plan_search_searches_a_critic_free_run_without_a_critic(tmp_path):
  """A GRPO run's search timed and sized a critic the run does not train, exactly PPO's
  figures (until 2026-12-08, with a warning). It now searches the actor's training alone: the
  plan records no critic (its workload trains_critic false, no critic_pp), the report and
  result.json say so, the run takes its plan without a workload warning, and a PPO-searched
  plan (an older file, which records no trains_critic) is warned of to a GRPO run. (The run's
  config.train_config is at a path with a space: named after its file, recorded whole, as
  --run_config's path is in the overrides test above.)"""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  spec = f"{_ppo_tiny_at_a_path_with_a_space(tmp_path)}:grpo"
  work = tmp_path / "ps"
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
       f"--config.train_config={spec}", f"--workdir={work}",
       "--config.systems=pipe_rlhf"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  plan = json.loads((work / "plan.json").read_text())
  w = plan["workload"]
  assert (w["actor"]["name"], w["trains_critic"], w["train_config"]) == (
      "long_run actor", False, spec), w
  assert "critic" not in w and "critic_pp" not in plan["training"], plan
  assert plan["training"]["actor_pp"] == 1  # (the trainer's update pipelines PPO's pair only)
  md = (work / "plan_search.md").read_text()
  note = ("algo.estimator='grpo' trains no critic: the search times and sizes the actor's "
          "training alone")
  assert f"# Plan search: {spec} on 8 x h100_sxm" in md and f"; {note}; " in md
  res = json.loads((work / "result.json").read_text())
  assert res["setting"]["critic_note"] == note and "critic" not in res["setting"]["models"]
  assert f"plan search: {note}" in out.stderr, out.stderr[-3000:]
  assert not any("critic" in r["stage"] for r in res["plan_memory"])
  # The papers' systems compared beside it are PPO's, with a critic: said under their table.
  assert res["systems"]["pipe_rlhf"]["train_s"] > res["best"]["predicted"]["train_s"]
  assert "(the papers' systems are PPO's: each trains and scores a critic" in md
  c = ppo_tiny.get_config("grpo")
  c.plan.file = str(work / "plan.json")
  cfg = TrainConfig.from_config_dict(c)
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  resolved = build.resolve_config(cfg, tokenizer)
  assert plan_file_lib.plan_workload_note(c.plan.file, resolved) is None
  # The same file as plan_search wrote it before 2026-12-08: searched with a critic.
  old = {**plan, "workload": {k: v for k, v in w.items() if k != "trains_critic"}}
  (work / "old.json").write_text(json.dumps(old))
  warn, line = plan_file_lib.plan_workload_note(str(work / "old.json"), resolved)
  assert warn and ("trains_critic=True (this run's algo.estimator='grpo': no critic)" in line
                   ), line


def test_the_planned_layout_is_said_at_set_up():
  """A plan set by its fields (no plan.file) ran a generation pipeline without a word in the
  log; PlannedStage logs this phrase when it is built."""
  plan = PlanConfig(generation="pipeline", generation_pp=4, generation_groups=8)
  assert rollout.planned_layout(plan, 8) == (
      "generation: one delayed inter-batch pipeline of 4 stages x 8 groups "
      "(config.plan.generation_pp, generation_groups) on the first 4 of its 8 devices (the other "
      "4 idle while it generates); inference on the mesh of all of them")
  plan = PlanConfig(generation="pipeline", generation_pp=4)  # groups 0: pp; all 4 devices
  assert rollout.planned_layout(plan, 4) == (
      "generation: one delayed inter-batch pipeline of 4 stages x 4 groups "
      "(config.plan.generation_pp, generation_groups) on the first 4 of its 4 devices; "
      "inference on the mesh of all of them")
  assert rollout.planned_layout(PlanConfig(inference_tp=2), 8) == (
      "generation: on the mesh of its 8 devices; inference on a data=4 x tensor=2 mesh of them "
      "(config.plan.inference_tp)")


def test_a_plan_sized_at_other_dtypes_is_warned_of(tmp_path):
  """The simulator sizes a run's weights and KV cache at its models' param_dtype and dtype
  (sim/shapes.from_model_config): a plan searched for bfloat16 models and run with float32
  ones (twice the weights and cache its memory check counted) was not warned of, the dtypes
  not being in the workload plan.json records."""
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim import shapes
  from rlhfuse_jax.trainer.plan_file import plan_workload_differences
  cfg = tiny_config()
  assert (cfg.model.param_dtype, cfg.model.dtype) == ("float32", "float32")
  plan = {"workload": {
      role: {"name": role, **{f: getattr(shapes.from_model_config(
          model, role, dtypes=True), f) for f in ps.WORKLOAD_MODEL_FIELDS}}
      for role, model in (("actor", cfg.model), ("critic", cfg.critic_model))}}
  assert plan_workload_differences(plan, cfg) == []
  plan["workload"]["actor"].update(weight_itemsize=2, kv_itemsize=2)
  assert plan_workload_differences(plan, cfg) == [
      "actor weight_itemsize=2 bytes (this run's model.param_dtype='float32': 4)",
      "actor kv_itemsize=2 bytes (this run's model.dtype='float32': 4)"]


def test_a_runs_offloaded_optimizer_state_is_not_kept_beside_generation():
  """A run with optim.offload_during_rollout keeps its AdamW state in host memory while the
  instances generate and score: the search of its plan (experiments/plan_search with a
  train_config) keeps only the weights beside them (sim.offload_optimizer), the run's value
  replacing the config's either way."""
  c = ppo_tiny.get_config()
  on = iteration_sim.SimOptions(offload_optimizer=True)
  assert not sim_plan.sim_options(on, TrainConfig.from_config_dict(c)).offload_optimizer
  c.optim.offload_during_rollout = True
  got = sim_plan.sim_options(iteration_sim.SimOptions(), TrainConfig.from_config_dict(c))
  assert got.offload_optimizer and got == dataclasses.replace(iteration_sim.SimOptions(),
                                                             offload_optimizer=True)


def test_an_asynchronous_runs_plan_is_searched_at_its_staleness():
  """plan_search --run_config of an async run (async_ppo.staleness=2) searched its splits at
  sim.staleness's default 1: the trainer check refused every one (the plan's staleness
  conflicts with the run's), and the search failed blaming pipelines. The run's k replaces the
  config's; a synchronous run keeps sim.staleness (a plan may make it asynchronous)."""
  c = ppo_tiny.get_config()
  opt = iteration_sim.SimOptions(staleness=3)
  assert sim_plan.sim_options(opt, TrainConfig.from_config_dict(c)).staleness == 3
  c.async_ppo.staleness = 2
  assert sim_plan.sim_options(opt, TrainConfig.from_config_dict(c)).staleness == 2
