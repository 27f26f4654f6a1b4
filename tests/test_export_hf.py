"""experiments/export_hf.py and rlhfuse_jax/trainer/export.py: any kept checkpoint of a finished
run exported as a HF checkpoint after the fact (its weights bit for bit those the checkpoint
holds), best:METRIC picking among the kept iterations, the errors, and that the run's own files
stay as they were."""
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from configs import ppo_hf, ppo_tiny
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.models import hf_loader, llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer import export as export_lib
from rlhfuse_jax.trainer import hf_export, hooks, loop
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_plan import plan_json
from tests.test_trainer import with_overrides
from tests.xla_env import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = "kl/ref_mean"  # ~0 at iteration 1 (the actor is the reference), then grows


def _one_device(cfg):
  return mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished 3-iteration run of configs/ppo_hf.py saving every iteration, keeping 2
  (checkpoints 2 and 3), validating every iteration, without an export of its own; its
  config.json as train_ppo records it."""
  workdir = str(tmp_path_factory.mktemp("export") / "run")
  c = ppo_hf.get_config()
  cwd = os.getcwd()
  os.chdir(REPO)  # the config's paths are relative to the repository, as runs start
  try:
    cfg = with_overrides(c, num_iterations=3, eval_every=1, log_samples=0, **{
        "checkpoint.every": 1, "checkpoint.keep": 2, "checkpoint.export_hf": "",
        "data.val_max_prompts": 8})
    PPOTrainer(cfg, workdir, mesh=_one_device(cfg)).run(
        config_record=config_lib.config_record(c, cfg))
  finally:
    os.chdir(cwd)
  assert export_lib.kept_steps(workdir) == [2, 3]
  return workdir


def _checkpoint_actor(workdir, step):
  """Checkpoint `step`'s actor parameters as orbax reads them back without any template."""
  state = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step),
                                                          "state"))
  return traverse_util.flatten_dict(state["actor"]["params"])


def _exported(out):
  cfg = hf_loader.load_hf_config(out, max_seq_len=128)
  return traverse_util.flatten_dict(hf_loader.load_hf_params(out, cfg))


def _same(a, b):
  return sorted(a) == sorted(b) and all(
      np.asarray(a[k]).dtype == np.asarray(b[k]).dtype and
      np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _digests(workdir, skip=()):
  """{path: sha256} of every file of the run but its lock and the given directories."""
  out = {}
  for root, dirs, files in os.walk(workdir):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    for name in files:
      path = os.path.join(root, name)
      if name != ".lock":
        with open(path, "rb") as f:
          out[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _logged(workdir, name):
  return {r["step"]: r[name] for r in wd.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if name in r}


def test_an_earlier_kept_step_exports_its_own_weights_and_leaves_the_run_alone(
    run, tmp_path, monkeypatch):
  """Checkpoint 2 of a run that ended at 3: the export reloads to checkpoint 2's actor bit for
  bit (not 3's), is marked 2, and nothing of the run changed; it builds neither a rollout stage
  nor the prompt datasets, nor reads the weights of the run's HF checkpoints. A second export
  that fails midway leaves the first one whole at its path."""
  monkeypatch.chdir(REPO)
  before = _digests(run)
  out = str(tmp_path / "step2")
  # Nothing generates: no rollout stage (a fused run's compiles its instances for a minute),
  # and no prompt is read or tokenised (a large prompts_file took its time for nothing).
  def no_rollout(*args, **kwargs):
    raise AssertionError("the export built a rollout stage")
  monkeypatch.setattr(loop.rollout_lib, "make_rollout_stage", no_rollout)

  def no_prompts(*args, **kwargs):
    raise AssertionError("the export built the prompt datasets")
  monkeypatch.setattr(loop.build, "build_datasets_and_pool", no_prompts)
  cfg = export_lib.export_config(export_lib.run_config(run, 2)[0], "")
  # Nor are the HF checkpoints' weights read (actor, critic): the checkpoint overwrites them.
  with monkeypatch.context() as m:
    def no_weights(*args, **kwargs):
      raise AssertionError("the export read a HF checkpoint's weights")
    m.setattr(hf_loader, "load_hf_params", no_weights)
    result = export_lib.export(run, "2", out, mesh=_one_device(cfg))
  assert result["step"] == 2 and result["family"] == "llama" and result["out"] == out
  assert hf_export.exported_step(out) == 2 and hf_export.exported_run(out) == os.path.realpath(run)
  params = _exported(out)
  assert _same(params, _checkpoint_actor(run, 2))
  assert not _same(params, _checkpoint_actor(run, 3))  # the iterations differ: 2 is 2
  assert _digests(run) == before

  # The next export there fails while writing (its tokenizer): the one before stays whole, and
  # the failed one leaves no working directory beside it; the error names the export (export_hf:
  # exit 3, as a failed write of train_ppo's).
  def broken(*args):
    raise OSError("disk full")
  monkeypatch.setattr(hf_export, "_copy_tokenizer", broken)
  with pytest.raises(hooks.LogWriteError, match=f"writing {out} failed: OSError: disk full"):
    export_lib.export(run, "3", out, mesh=_one_device(cfg))
  assert hf_export.exported_step(out) == 2 and _same(_exported(out), params)
  assert not os.path.exists(hf_export.export_work_dirs(out)[0])
  assert _digests(run) == before


def test_an_export_opens_no_safetensors_of_the_run_s_hf_checkpoints(run, tmp_path, monkeypatch):
  """The run's HF checkpoints' weights may be gone since training (moved away, only config.json
  and the tokenizer's files kept): an export opens none of their safetensors, of the actor, the
  critic (init.critic_checkpoint, the actor's directory here: the set-up log's "value head"
  note read its tensor names, and the export failed with FileNotFoundError) or a reward model
  (validate's reward_model_config read its names for the head check)."""
  monkeypatch.chdir(REPO)
  cfg = export_lib.export_config(export_lib.run_config(run, 3)[0], "")

  def no_safetensors(ckpt_dir):
    raise FileNotFoundError(f"{ckpt_dir}: neither model.safetensors nor ... found")
  monkeypatch.setattr(hf_loader, "_Checkpoint", no_safetensors)
  for model in ("actor", "critic"):
    result = export_lib.export(run, "3", str(tmp_path / model), mesh=_one_device(cfg),
                               model=model)
    assert (result["model"], result["step"]) == (model, 3)
  # A reward model's directory with its config.json alone: its shape is read, nothing else.
  rm = tmp_path / "rm"
  rm.mkdir()
  hf = json.loads(open(os.path.join(ppo_hf.MODEL_DIR, "config.json")).read())
  hf["architectures"] = ["LlamaForSequenceClassification"]
  (rm / "config.json").write_text(json.dumps(hf))
  scored = dataclasses.replace(cfg, reward=dataclasses.replace(
      cfg.reward, kind="model", model_checkpoint=str(rm)))
  assert loop.build.reward_model_config(scored, weights=False).head == "scalar"
  with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
    loop.build.reward_model_config(scored)
  scored = loop.build.resolve_config(scored, HFTokenizer.from_file(cfg.init.tokenizer),
                                     weights=False)
  loop.validate(scored, _one_device(scored), weights=False)


def test_a_family_the_actor_has_no_equivalent_in_names_the_flag(run, tmp_path, monkeypatch):
  """--family=qwen3 for a LLaMA-shaped actor: the error named config.checkpoint.export_hf, a
  field the user never set (the run's is 'auto'), not the flag given."""
  monkeypatch.chdir(REPO)
  cfg = export_lib.export_config(export_lib.run_config(run, 2)[0], "")
  with pytest.raises(ValueError, match=r"^--family='qwen3': model .* has no HF qwen3 equivalent"):
    export_lib.export(run, "2", str(tmp_path / "q"), family="qwen3", mesh=_one_device(cfg))
  assert not os.path.exists(tmp_path / "q")
  # The critic's family is checked against the critic (not put into the run's config, where
  # the trainer checks it against the actor), before its checkpoint is read.
  with pytest.raises(ValueError, match=r"^--family='qwen3': model .* has no HF qwen3 equivalent"):
    export_lib.export(run, "2", str(tmp_path / "q"), family="qwen3", mesh=_one_device(cfg),
                      model="critic")
  assert not os.path.exists(tmp_path / "q")


def test_a_run_still_training_there_is_not_raced(run, tmp_path):
  """The workdir's lock held (a run training): refused before anything is built or written,
  with advice for an export."""
  lock = wd.WorkdirLock(run)
  try:
    with pytest.raises(wd.WorkdirInUseError, match=r"is in use by another run \(pid .*\); "
                       r"export once it has finished or stopped"):
      export_lib.export(run, "3", str(tmp_path / "out"))
  finally:
    lock.release()
  assert not os.path.exists(tmp_path / "out")


def test_a_damaged_checkpoint_is_an_error_and_stays(run, tmp_path, monkeypatch):
  """A flipped bit in checkpoint 3's arrays (a copy of the run): an error naming it, no
  export, and the checkpoint neither set aside nor replaced by an older one, as a resume's
  fallback would."""
  monkeypatch.chdir(REPO)
  copy = str(tmp_path / "run")
  shutil.copytree(run, copy)
  data = os.path.join(copy, "checkpoints", "3", "state", "ocdbt.process_0", "d")
  biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.seek(os.path.getsize(biggest) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))
  before = _digests(copy)
  cfg = export_lib.export_config(export_lib.run_config(copy, 3)[0], "")
  with pytest.raises(ValueError, match=r"checkpoint 3 in .* cannot be read \(damaged\?\)"):
    export_lib.export(copy, "3", str(tmp_path / "out"), mesh=_one_device(cfg))
  assert not os.path.exists(tmp_path / "out")
  assert _digests(copy) == before and export_lib.kept_steps(copy) == [2, 3]
  assert not os.path.exists(os.path.join(copy, "damaged_checkpoints"))
  # Without its side-car (meta/, a partial copy): the same line, not orbax's KeyError traceback.
  shutil.rmtree(os.path.join(copy, "checkpoints", "3", "meta"))
  with pytest.raises(ValueError, match=r"checkpoint 3 in .* cannot be read \(damaged\?\): "
                                       r"KeyError: .*meta.*; export another kept step"):
    export_lib.export(copy, "3", str(tmp_path / "out"), mesh=_one_device(cfg))
  assert export_lib.kept_steps(copy) == [2, 3] and not os.path.exists(tmp_path / "out")


def test_a_checkpoint_under_another_number_is_refused(run, tmp_path, monkeypatch):
  """Checkpoint 3 renamed 5 (put back by hand): the export of '5' would hold iteration 3's
  actor and be marked 5; refused, naming the iteration it holds."""
  monkeypatch.chdir(REPO)
  copy = tmp_path / "run"
  shutil.copytree(run, copy)
  os.rename(copy / "checkpoints" / "3", copy / "checkpoints" / "5")
  with pytest.raises(ValueError, match=r"checkpoint 5 in .* holds iteration 3 \(put back"):
    export_lib.export(str(copy), "5", str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def test_an_export_after_the_run_s_files_changed_is_refused(run, tmp_path, monkeypatch):
  """The export copies the run's tokenizer files, chat template and generation config beside
  the weights: after they changed (a template edited in place) it shipped them with weights
  trained under the old ones, where a resume refuses the change. The same files at another
  path export; other content is refused, naming the field and the file."""
  monkeypatch.chdir(REPO)
  copy, model = tmp_path / "run", tmp_path / "model"
  shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".lock"))
  shutil.copytree(os.path.join(REPO, "configs", "data", "tiny_llama3_chat"), model)
  text = (copy / "config.json").read_text()
  assert "configs/data/tiny_llama3_chat" in text
  (copy / "config.json").write_text(text.replace("configs/data/tiny_llama3_chat", str(model)))
  export_lib.export(str(copy), "3", str(tmp_path / "same"))  # the same files, elsewhere
  config = json.loads((model / "tokenizer_config.json").read_text())
  config["chat_template"] = "CHANGED " + config["chat_template"]
  (model / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"checkpoint 3 in .* was trained with other files than "
                     r"the run's inputs hold now \(config.init.tokenizer: tokenizer_config.json "
                     r"changed.*Put the files the run read back"):
    export_lib.export(str(copy), "3", str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def test_relative_paths_are_the_run_s_own(run, tmp_path, monkeypatch):
  """Started elsewhere than the run was, its config's relative paths are missing: the error
  says they are read from the current directory, and where to start instead."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"config.init.tokenizer=.*not found.*read from "
                     r"the run's config .*config.json: its relative paths are taken from the "
                     r"current directory"):
    export_lib.export(run, "3", str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")
  # An absolute path that is gone: starting elsewhere cannot help (the error said to).
  moved = str(tmp_path / "moved")
  shutil.copytree(run, moved, ignore=shutil.ignore_patterns(".lock"))
  record = json.loads(open(os.path.join(moved, "config.json")).read())
  record["init"]["tokenizer"] = str(tmp_path / "gone" / "tokenizer.json")
  wd.write_json(os.path.join(moved, "config.json"), record)
  with pytest.raises(FileNotFoundError, match=r"gone/tokenizer.json.*not found.*read from the "
                     r"run's config .*config.json: the export builds the model from the files "
                     r"the run started from, which must still be there") as e:
    export_lib.export(moved, "3", str(tmp_path / "out"))
  assert "run export_hf from there" not in str(e.value)


def test_the_binary_exports_the_best_kept_step(run):
  """`--step=best:min:kl/ref_mean`: the kept iteration with the lowest KL (iteration 1's is
  lower still, but its checkpoint is gone), in WORKDIR/hf_export_<step>, said on stdout; the
  run's files unchanged but for that directory."""
  logged = _logged(run, METRIC)
  kept = {s: v for s, v in logged.items() if s in (2, 3)}
  lowest = min(kept, key=kept.get)
  assert min(logged, key=logged.get) == 1 != lowest  # the filter to kept steps matters
  before = _digests(run)
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.export_hf", f"--workdir={run}",
       f"--step=best:min:{METRIC}"], cwd=REPO, env=subprocess_env(), capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  out = os.path.join(run, f"hf_export_{lowest}")
  assert result["step"] == lowest and result["out"] == out
  assert result["metric"] == METRIC and result["value"] == kept[lowest]
  assert f"iteration {lowest} ({METRIC} = " in proc.stderr and "the lowest" in proc.stderr
  assert hf_export.exported_step(out) == lowest
  assert _same(_exported(out), _checkpoint_actor(run, lowest))
  assert _digests(run, skip=(out,)) == before

  # A step not kept: the kept ones and the field that decides, exit status 1, nothing written.
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.export_hf", f"--workdir={run}", "--step=1"],
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert "--step=1: iteration 1 has no kept checkpoint; kept: [2, 3]" in proc.stderr
  assert "config.checkpoint.keep" in proc.stderr
  assert not os.path.exists(os.path.join(run, "hf_export_1"))


def test_the_plan_file_as_the_run_read_it(tmp_path):
  """A run with config.plan.file: the export's config takes the plan file's content recorded
  in config.json (the layout the checkpoints were saved in), not the file as it is now."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  c = ppo_tiny.get_config()
  c.plan.file = plan_json(tmp_path / "plan.json", {"mode": "instances", "tp": 2, "slots": 8},
                          training={"placement": "colocated", "tp": 2, "actor_pp": 1,
                                    "critic_pp": 1})
  then = config_lib.TrainConfig.from_config_dict(c)
  wd.write_json(str(workdir / "config.json"), config_lib.config_record(c, then))
  plan_json(tmp_path / "plan.json", {"mode": "instances", "tp": 1, "slots": 4})  # edited since
  assert config_lib.TrainConfig.from_config_dict(c).mesh.tensor == 1
  record, path = export_lib.run_config(str(workdir), 3)
  assert path == str(workdir / "config.json")
  cfg = export_lib.export_config(record, "", str(tmp_path))
  assert (cfg.mesh, cfg.plan.generation_tp, cfg.plan.generation_slots) == (then.mesh, 2, 8)
  assert cfg.mesh.tensor == 2 and cfg.checkpoint.export_hf == "auto"


def _fake_run(tmp_path, kept, rows):
  """A workdir with checkpoints/<k> directories and metrics.jsonl rows, as choose_step reads."""
  workdir = tmp_path / "fake"
  for k in kept:
    (workdir / "checkpoints" / str(k)).mkdir(parents=True)
  (workdir / "checkpoints" / "7.orbax-checkpoint-tmp-1").mkdir(parents=True)  # killed save
  (workdir / "config.json").write_text("{}")
  with open(workdir / "metrics.jsonl", "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return str(workdir)


def test_choose_step(tmp_path):
  """best: max by default, min: for the lowest, max: spelled out; only kept iterations, only
  finite numbers; a tie goes to the later iteration; latest and plain iterations."""
  rows = [{"step": 1, "val/reward_mean": 0.9, "loss": 0.1},
          {"step": 2, "val/reward_mean": 0.5, "loss": 0.4},
          {"step": 4, "val/reward_mean": 0.7, "loss": math.nan},
          {"step": 6, "val/reward_mean": 0.7, "loss": 0.3},
          {"step": 7, "val/reward_mean": 0.99, "loss": 0.0}]
  workdir = _fake_run(tmp_path, [2, 4, 6], rows)
  pick = lambda spec: export_lib.choose_step(workdir, spec)
  assert pick("best:val/reward_mean").step == 6  # 4 and 6 tie at 0.7; 1 and 7 are not kept
  assert pick("best:max:val/reward_mean").step == 6
  best = pick("best:min:val/reward_mean")
  assert (best.step, best.value, best.mode, best.kept) == (2, 0.5, "min", (2, 4, 6))
  assert pick("best:min:loss").step == 6  # 4's NaN is no candidate
  assert pick("best:loss").step == 2
  assert pick("latest").step == 6 and pick("4").step == 4
  assert "val/reward_mean = 0.5, the lowest logged at a kept checkpoint" in best.describe()


def test_choose_step_errors(tmp_path):
  rows = [{"step": 1, "val/reward_mean": 0.9, "reward/mean": 0.1},
          {"step": 2, "reward/mean": 0.2}, {"step": 3, "reward/mean": 0.3}]
  workdir = _fake_run(tmp_path, [2, 3], rows)
  with pytest.raises(ValueError, match=r"--step=5: iteration 5 has no kept checkpoint; kept: "
                     r"\[2, 3\] \(config.checkpoint.keep decides how many stay"):
    export_lib.choose_step(workdir, "5")
  with pytest.raises(ValueError, match=r"'val/reward_man' was never logged in metrics.jsonl; "
                     r"nearest names: val/reward_mean, reward/mean"):
    export_lib.choose_step(workdir, "best:val/reward_man")
  with pytest.raises(ValueError, match=r"'val/reward_mean' is logged at iterations \[1\] but at "
                     r"no kept checkpoint \(kept: \[2, 3\]\).*config.eval_every"):
    export_lib.choose_step(workdir, "best:val/reward_mean")
  with pytest.raises(ValueError, match=r"--step='best:min:': expected a metric after"):
    export_lib.choose_step(workdir, "best:min:")
  with pytest.raises(ValueError, match=r"--step='last': expected an iteration, 'latest', or "):
    export_lib.choose_step(workdir, "last")
  empty = _fake_run(tmp_path / "none", [], [])
  with pytest.raises(ValueError, match="keeps no checkpoint"):
    export_lib.choose_step(empty, "latest")


def test_not_a_run_and_out_dirs(tmp_path):
  """A workdir that is not a train_ppo run, one of another binary, a destination that is the
  run's own or a directory that is not an export: refused, naming the flag."""
  with pytest.raises(ValueError, match="no such directory"):
    export_lib.check_run(str(tmp_path / "missing"))
  (tmp_path / "plain").mkdir()
  with pytest.raises(ValueError, match=r"is not a train_ppo run: it has no config.json and no "
                     r"checkpoints"):
    export_lib.check_run(str(tmp_path / "plain"))
  other = tmp_path / "other"
  other.mkdir()
  (other / "result.json").write_text(json.dumps(
      {"provenance": {"command": "python -m experiments.plan_search --workdir=x"}}))
  with pytest.raises(ValueError, match="holds the outputs of plan_search, not of a train_ppo"):
    export_lib.check_run(str(other))
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  for own in (run, run / "checkpoints", run / "checkpoints" / "3", run / "hf_export"):
    with pytest.raises(ValueError, match="is the run's own directory"):
      export_lib.check_out_dir(str(own), str(run))
  (tmp_path / "mine").mkdir()
  with pytest.raises(ValueError, match=r"exists and is not an export \(no rlhfuse_export.json\)"):
    export_lib.check_out_dir(str(tmp_path / "mine"), str(run))
  export_lib.check_out_dir(str(tmp_path / "new"), str(run))  # a new path is fine
  # An earlier export of this run is replaced (also one written before markers named the run);
  # another run's is refused, not deleted.
  for name, marked in (("ours", str(run)), ("older", None), ("theirs", str(other))):
    (tmp_path / name).mkdir()
    (tmp_path / name / hf_export.EXPORT_MARKER).write_text(json.dumps(
        {"step": 4, "family": "llama", **({"run": marked} if marked else {})}))
  export_lib.check_out_dir(str(tmp_path / "ours"), str(run))
  export_lib.check_out_dir(str(tmp_path / "older"), str(run))
  with pytest.raises(ValueError,
                     match=r"holds an export of another run, .*other \(iteration 4\)"):
    export_lib.check_out_dir(str(tmp_path / "theirs"), str(run))
  # The run's own WORKDIR/hf_export_K after the workdir was moved: its marker names the old path.
  (run / "hf_export_4").mkdir()
  (run / "hf_export_4" / hf_export.EXPORT_MARKER).write_text(json.dumps(
      {"step": 4, "family": "llama", "run": str(tmp_path / "before_the_move")}))
  export_lib.check_out_dir(str(run / "hf_export_4"), str(run))


def test_the_config_of_the_newest_start_at_a_resume_point(tmp_path):
  """Two starts resumed at the same iteration write config.K.json, then config.K.1.json, ...:
  a checkpoint after K was written by the newest of them (the earlier ones saved none). It read
  config.K.json (by name, 'config.K.json' sorted after 'config.K.1.json'), and config.K.9.json
  before config.K.10.json."""
  workdir = str(tmp_path)
  for start in range(13):  # the first start at 0, then twelve resumed at 2
    wd.write_config_history(workdir, {"start": start}, 0 if start == 0 else 2)
  record, path = export_lib.run_config(workdir, 4)
  assert (record, os.path.basename(path)) == ({"start": 12}, "config.2.11.json")
  assert export_lib.run_config(workdir, 2)[0] == {"start": 0}  # written by the first start


def test_too_few_devices_are_named_with_the_flag_that_gives_them():
  """Exporting the README's main job (mesh.stage=4) in a plain `python` (1 CPU device) failed
  with the mesh's bare 'does not divide 1'; train_ppo names the XLA_FLAGS that gives them."""
  from configs import ppo_tiny
  cfg = config_lib.TrainConfig.from_config_dict(ppo_tiny.get_config("fused"))
  with pytest.raises(ValueError, match=r"the run's config.mesh=.*'stage': 4.* needs at least 4 "
                     r"devices, but jax sees 1 \(cpu\): on a CPU host add fake devices before "
                     r"jax starts, as the run had: XLA_FLAGS=--xla_force_host_platform_device_"
                     r"count=4"):
    export_lib.check_devices(cfg, 1, "cpu")
  with pytest.raises(ValueError, match=r"export on a host with 4 or more"):
    export_lib.check_devices(cfg, 2, "gpu")
  export_lib.check_devices(cfg, 8, "cpu")
  # An asynchronous run's generation group comes on top of its training mesh.
  split = dataclasses.replace(cfg, async_ppo=dataclasses.replace(
      cfg.async_ppo, staleness=1, generation_devices=2))
  with pytest.raises(ValueError, match=r"\+ config.async_ppo.generation_devices=2 needs at "
                                       r"least 6 devices"):
    export_lib.check_devices(split, 4, "cpu")


def _checkpoint_critic(workdir, step):
  """Checkpoint `step`'s critic parameters as orbax reads them back without any template."""
  state = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step),
                                                          "state"))
  return traverse_util.flatten_dict(state["critic"]["params"])


def _exported_critic(out):
  cfg = hf_loader.load_hf_config(out, max_seq_len=128, head="scalar")
  return traverse_util.flatten_dict(hf_loader.load_hf_params(out, cfg, head="scalar"))


def test_the_binary_exports_the_critic(run):
  """`--model=critic`: the run's critic of the kept step, in WORKDIR/hf_export_critic_<step>, a
  LlamaForSequenceClassification that reloads to the checkpoint's critic bit for bit (its
  trained value bias as score.bias), marked critic, with a pad_token_id in config.json (else
  transformers refuses batches > 1) and the run's tokenizer; stdout's JSON line and the log say
  which model, and a warning says transformers ignores the bias. The run's other files (an
  actor's export among them) are left alone."""
  before = _digests(run)
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.export_hf", f"--workdir={run}", "--step=2",
       "--model=critic"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  out = os.path.join(run, "hf_export_critic_2")
  assert (result["model"], result["step"], result["out"]) == ("critic", 2, out)
  assert "exported the critic of iteration 2 " in proc.stderr
  assert _digests(run, skip=(out,)) == before  # (an actor's hf_export_2 included)
  assert hf_export.exported_model(out) == "critic" and hf_export.exported_step(out) == 2
  assert hf_export.exported_run(out) == os.path.realpath(run)
  params = _exported_critic(out)
  assert _same(params, _checkpoint_critic(run, 2))
  assert not _same(params, _checkpoint_critic(run, 3))
  bias = float(params[("head", "value_bias")][0])
  assert bias != 0 and result["value_bias"] == bias == hf_export.exported_value_bias(out)
  assert "transformers' *ForSequenceClassification has no bias" in proc.stderr
  config = json.loads(open(os.path.join(out, "config.json")).read())
  assert config["architectures"] == ["LlamaForSequenceClassification"]
  assert config["num_labels"] == 1 and isinstance(config["pad_token_id"], int)
  assert os.path.isfile(os.path.join(out, "tokenizer.json"))
  # An actor's export is not replaced by the critic's (nor the other way): refused, naming
  # --model; the same model's earlier export is.
  with pytest.raises(ValueError, match=r"holds an export of the run's critic \(iteration 2\), "
                     r"not of its actor \(--model=actor\).*default hf_export_K"):
    export_lib.export(run, "3", out)
  with pytest.raises(ValueError, match=r"--model='value': expected one of \['actor', 'critic'\]"):
    export_lib.export(run, "3", str(os.path.dirname(run)) + "/v", model="value")
  assert hf_export.exported_step(out) == 2


def test_a_critic_without_a_source_pad_id_gets_the_run_s(tmp_path, monkeypatch):
  """A critic built from config.critic_model (no init.critic_checkpoint, so no source
  config.json gives special ids): its config.json takes pad_token_id from the run's tokenizer,
  as an actor's does, and the export reloads to the same parameters, its value bias read back
  from score.bias."""
  monkeypatch.chdir(REPO)
  c = ppo_hf.get_config()
  c.init.critic_checkpoint = ""
  cfg = config_lib.TrainConfig.from_config_dict(c)
  critic = hf_loader.load_hf_config(ppo_hf.MODEL_DIR, head="scalar", max_seq_len=128)
  critic = critic.replace(score_pad_id=-1)  # nothing names a pad id
  cfg = dataclasses.replace(cfg, critic_model=critic)
  params = traverse_util.flatten_dict(jax.device_get(
      llama.init_params(critic, jax.random.key(0))[0]))
  params[("head", "value_bias")] = np.full((1,), 0.25, np.float32)
  params = traverse_util.unflatten_dict(params)
  base = HFTokenizer.from_file(c.init.tokenizer)
  tokenizer = HFTokenizer.from_file(c.init.tokenizer, pad_token=base.id_to_token(5))
  assert tokenizer.pad_id == 5
  out = str(tmp_path / "critic")
  assert hf_export.export_hf(params, cfg, out, 7, tokenizer, str(tmp_path),
                             model="critic") == "llama"
  config = json.loads(open(os.path.join(out, "config.json")).read())
  assert config["pad_token_id"] == 5
  assert hf_export.exported_model(out) == "critic" and hf_export.exported_value_bias(out) == 0.25
  assert _same(_exported_critic(out), traverse_util.flatten_dict(params))


def test_a_run_without_a_critic_refuses_to_export_one(tmp_path):
  """A GRPO run trains no critic: --model=critic is refused before anything is built, naming
  the flag and the estimator; nothing is written."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "3").mkdir(parents=True)
  c = ppo_hf.get_config("grpo")
  wd.write_json(str(workdir / "config.json"),
                config_lib.config_record(c, config_lib.TrainConfig.from_config_dict(c)))
  with pytest.raises(ValueError, match=r"^--model=critic: the run trained no critic \(its "
                     r"config.algo.estimator='grpo' estimates advantages without one\)"):
    export_lib.export(str(workdir), "3", model="critic")
  assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json"]
  cfg = config_lib.TrainConfig.from_config_dict(c)
  export_lib.check_model(cfg, "actor")
  with pytest.raises(ValueError, match="--model=critic: the run trained no critic"):
    export_lib.check_model(cfg, "critic")
  export_lib.check_model(config_lib.TrainConfig.from_config_dict(ppo_hf.get_config()), "critic")


def test_out_dirs_of_the_other_model(tmp_path):
  """An export's marker names its model: the critic's at --out is refused for the actor and the
  other way round (an export replaces the whole directory), an older marker without one is an
  actor's; the critic's default path is its own; an in-training export_hf's WORKDIR/hf_export
  that holds no actor is written again."""
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  for name, model in (("critic", "critic"), ("actor", "actor"), ("older", None)):
    (tmp_path / name).mkdir()
    (tmp_path / name / hf_export.EXPORT_MARKER).write_text(json.dumps(
        {"step": 4, "family": "llama", "run": str(run), **({"model": model} if model else {})}))
  export_lib.check_out_dir(str(tmp_path / "critic"), str(run), "critic")
  export_lib.check_out_dir(str(tmp_path / "actor"), str(run))
  export_lib.check_out_dir(str(tmp_path / "older"), str(run), "actor")
  for name, model in (("critic", "actor"), ("actor", "critic"), ("older", "critic")):
    held = "critic" if name == "critic" else "actor"
    with pytest.raises(ValueError, match=rf"holds an export of the run's {held} \(iteration 4\), "
                       rf"not of its {model} \(--model={model}\)"):
      export_lib.check_out_dir(str(tmp_path / name), str(run), model)
  assert export_lib.default_out(str(run), 3, "critic") == str(run / "hf_export_critic_3")
  assert export_lib.default_out(str(run), 3) == str(run / "hf_export_3")
  cfg = config_lib.TrainConfig.from_config_dict(ppo_hf.get_config())
  shutil.copytree(tmp_path / "critic", run / hf_export.HF_EXPORT_DIR)
  assert hf_export.export_pending(str(run), cfg, 4)
  shutil.rmtree(run / hf_export.HF_EXPORT_DIR)
  shutil.copytree(tmp_path / "older", run / hf_export.HF_EXPORT_DIR)
  assert not hf_export.export_pending(str(run), cfg, 4)


def _export_refused(tmp_path, cfg, params, tok, read, gone: str, what: str,
                    error: str = "FileNotFoundError: [Errno 2] No such file or directory") -> str:
  """The run's HF export, `gone` (a file the run read, in `read`) removed since (or failing to
  read with `error`): an ExportInputError naming it and `what` it is, and nothing of the export
  left. Returns the run's workdir."""
  run = str(tmp_path / "run")
  os.makedirs(run, exist_ok=True)
  with pytest.raises(hf_export.ExportInputError) as e:
    hf_export.HFExport(run, cfg, lambda: params, tok, read).export(2)
  fix = "make it readable" if error.startswith("PermissionError") else "put it back"
  assert str(e.value) == (
      f"reading {gone} failed: {error}; it is {what}, which the run read and its HF export "
      f"copies: {fix} (nothing of the export is left)")
  assert os.listdir(run) == []
  return run


def test_a_tokenizer_file_the_run_read_gone_at_the_export_is_named(tmp_path):
  """A file beside init.tokenizer that the run read as it started (special_tokens_map.json:
  the special tokens; tokenizer_config.json, the chat template, generation_config.json's EOS
  ids) and that is gone at the export was left out of it, silently: a model whose tokenizer
  is not the run's. Now an ExportInputError naming it, as for tokenizer.json, and nothing of
  the export is left; a file the run did not read (not there as it started) is no input."""
  from rlhfuse_jax.trainer import inputs as inputs_lib
  from tests.test_faults import _hf_export_inputs
  cfg, tok, params = _hf_export_inputs(tmp_path)
  gone = os.path.join(os.path.dirname(cfg.init.tokenizer), "special_tokens_map.json")
  with open(gone, "w") as f:
    json.dump({"eos_token": "<|im_end|>"}, f)
  read = inputs_lib.fingerprints(cfg)  # what the run's start records (hooks.Checkpoints)
  assert "special_tokens_map.json" in read["init.tokenizer"]
  os.remove(gone)
  run = _export_refused(tmp_path, cfg, params, tok, read, gone,
                        "a file beside the tokenizer config.init.tokenizer names")
  hf_export.HFExport(run, cfg, lambda: params, tok, inputs_lib.fingerprints(cfg)).export(2)
  out = os.path.join(run, hf_export.HF_EXPORT_DIR)
  assert "special_tokens_map.json" not in os.listdir(out)
  assert "tokenizer_config.json" in os.listdir(out)


@pytest.mark.parametrize("family,name", [("auto", "config.json"), ("llama", "config.json"),
                                         ("llama", "generation_config.json")])
def test_a_source_checkpoint_file_the_run_read_gone_at_the_export_is_named(tmp_path, family,
                                                                           name):
  """The actor's source checkpoint's config.json (the run read the model from it) gone at the
  export: with checkpoint.export_hf='auto' (which reads the family there) the export said
  "writing WORKDIR/hf_export failed: FileNotFoundError" (exit 3, a full disk's words); with a
  family given it wrote the export without the source's special ids and context, silently, as
  it left out a generation_config.json the run read (its stop ids). Now an ExportInputError
  naming the file, and nothing of the export is left."""
  from rlhfuse_jax.trainer import inputs as inputs_lib
  from tests.test_faults import FIXTURES, _hf_export_inputs
  cfg, tok, params = _hf_export_inputs(tmp_path)
  source = str(tmp_path / "source")
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), source)
  cfg = dataclasses.replace(
      cfg, init=dataclasses.replace(cfg.init, actor_checkpoint=source),
      checkpoint=dataclasses.replace(cfg.checkpoint, export_hf=family))
  read = inputs_lib.fingerprints(cfg)
  assert name in read["init.actor_checkpoint"]
  gone = os.path.join(source, name)
  os.remove(gone)
  _export_refused(tmp_path, cfg, params, tok, read, gone,
                  "a file of the checkpoint config.init.actor_checkpoint names")


def _unreadable_refused(tmp_path, monkeypatch, cfg, params, tok, read, template: str,
                        what: str) -> None:
  """_export_refused with `template` refused by its permissions, with the run's fingerprints
  `read` and without them (a file is there: checked all the same)."""
  from tests.test_faults import _unreadable
  for inputs in (read, None):
    with monkeypatch.context() as m:
      _unreadable(m, template)
      _export_refused(tmp_path, cfg, params, tok, inputs, template, what,
                      "PermissionError: [Errno 13] Permission denied")


def test_a_chat_template_file_that_does_not_read_at_the_export_is_the_run_s_input(
    tmp_path, monkeypatch):
  """data.chat_template's file (every prompt was rendered with it; the export writes it as its
  chat_template.jinja) unreadable at the export (no permission: chmod 000 stops no root, so
  open() is refused here) was "...: cannot read the chat template (...)", a ChatTemplateError
  naming no field, and a directory in its place "the directory holds no chat_template.jinja",
  a template error, and one gone "config.data.chat_template=...: no such file or directory";
  none had the run's end say that nothing of it was lost. Now each is an ExportInputError
  naming the file and config.data.chat_template, as a tokenizer file gone is, and nothing of
  the export is left; the unreadable one also without the run's fingerprints (a file is
  there). Once it reads, the export is written."""
  from rlhfuse_jax.trainer import inputs as inputs_lib
  from tests.test_faults import _hf_export_inputs
  cfg, tok, params = _hf_export_inputs(tmp_path)
  template = cfg.data.chat_template
  read = inputs_lib.fingerprints(cfg)  # what the run's start records (hooks.Checkpoints)
  assert list(read["data.chat_template"]) == [os.path.basename(template)]
  what = "the chat template config.data.chat_template names"
  _unreadable_refused(tmp_path, monkeypatch, cfg, params, tok, read, template, what)
  os.rename(template, template + ".aside")
  os.makedirs(template)
  run = _export_refused(tmp_path, cfg, params, tok, read, template, what,
                        "IsADirectoryError: [Errno 21] Is a directory")
  os.rmdir(template)  # gone: ChatTemplateError's "no such file or directory" before, as above
  _export_refused(tmp_path, cfg, params, tok, read, template, what)
  os.rename(template + ".aside", template)
  hf_export.HFExport(run, cfg, lambda: params, tok, read).export(2)
  assert hf_export.exported_step(os.path.join(run, hf_export.HF_EXPORT_DIR)) == 2


def test_a_chat_template_directory_s_file_that_does_not_read_at_the_export_is_the_run_s_input(
    tmp_path, monkeypatch):
  """data.chat_template given as a directory (chat.py renders with its chat_template.jinja,
  else its tokenizer_config.json's entry): its chat_template.jinja, which the run read (its
  fingerprints name it), gone at the export was passed over, and the export shipped the
  tokenizer_config.json's template, one the run never rendered a prompt with, silently
  (2026-12-08); unreadable, a ChatTemplateError naming no field. Now each is an
  ExportInputError naming the file and config.data.chat_template, as a template file's is, and
  nothing of the export is left; the unreadable one also without the run's fingerprints."""
  from rlhfuse_jax.trainer import inputs as inputs_lib
  from tests.test_faults import _hf_export_inputs
  cfg, tok, params = _hf_export_inputs(tmp_path)
  directory = tmp_path / "template"
  directory.mkdir()
  (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
  (directory / "tokenizer_config.json").write_text(
      json.dumps({"chat_template": "other {{ messages[0]['content'] }}"}))
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                          chat_template=str(directory)))
  read = inputs_lib.fingerprints(cfg)
  assert sorted(read["data.chat_template"]) == ["chat_template.jinja", "tokenizer_config.json"]
  template = str(directory / "chat_template.jinja")
  what = "a file of the chat template directory config.data.chat_template names"
  _unreadable_refused(tmp_path, monkeypatch, cfg, params, tok, read, template, what)
  os.rename(template, template + ".aside")
  run = _export_refused(tmp_path, cfg, params, tok, read, template, what)
  os.rename(template + ".aside", template)
  hf_export.HFExport(run, cfg, lambda: params, tok, read).export(2)
  with open(os.path.join(run, hf_export.HF_EXPORT_DIR, "chat_template.jinja")) as f:
    assert f.read() == "{{ messages[0]['content'] }}"
