"""Exporting any kept checkpoint of a train_ppo run as a Hugging Face checkpoint, after the run
(experiments/export_hf.py): the step asked for, the latest, or the one whose logged metric is
best (`best:val/reward_mean`, `best:min:critic/vf_loss`).

The run is rebuilt from its own recorded config (config.json, or the config.K.json of the start
that wrote the checkpoint), its checkpoint restored and checked, and the actor (or, with
model="critic", the critic of a run that trains one) written through hf_export.export_hf
(beside the destination, renamed into place whole). Nothing of the run is written: no metrics,
result.json, config record or checkpoint; its lock is held meanwhile, so a run still training in
the workdir is refused rather than raced.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
from typing import Any, Optional

import jax

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.trainer import hf_export, hooks
from rlhfuse_jax.trainer.config import EXPORT_HF_CHOICES, TrainConfig
from rlhfuse_jax.trainer.loop import PPOTrainer

BEST = "best:"


@dataclasses.dataclass(frozen=True)
class Choice:
  """The checkpoint an export takes, and why: `metric` and `value` for best:...; `kept`, the
  workdir's kept steps (oldest first)."""
  step: int
  kept: tuple[int, ...]
  metric: str = ""
  value: Optional[float] = None
  mode: str = ""

  def describe(self) -> str:
    if not self.metric:
      return f"iteration {self.step} (kept: {list(self.kept)})"
    return (f"iteration {self.step} ({self.metric} = {self.value:.6g}, the "
            f"{'lowest' if self.mode == 'min' else 'highest'} logged at a kept checkpoint; "
            f"kept: {list(self.kept)})")


def check_run(workdir: str) -> None:
  """A ValueError unless `workdir` is a train_ppo run with checkpoints."""
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r}: no such directory")
  writer = wd.workdir_writer(workdir)
  if writer is not None and writer != "train_ppo":
    raise ValueError(f"--workdir={workdir!r} holds the outputs of {writer}, not of a train_ppo "
                     "run: expected the workdir of a training run")
  missing = [n for n in ("config.json", "checkpoints")
             if not os.path.exists(os.path.join(workdir, n))]
  if missing:
    raise ValueError(f"--workdir={workdir!r} is not a train_ppo run: it has no "
                     f"{' and no '.join(missing)} (a run writes both at its first start)")


def kept_steps(workdir: str) -> list[int]:
  """The iterations of the finished checkpoints in WORKDIR/checkpoints, oldest first (a save
  killed mid-way leaves a <step>.orbax-checkpoint-tmp-* directory, not a checkpoint)."""
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def _not_kept(step: int, kept: list[int]) -> str:
  return (f"iteration {step} has no kept checkpoint; kept: {kept} (config.checkpoint.keep "
          "decides how many stay, the newest ones, saved every config.checkpoint.every "
          "iterations and at the end)")


def choose_step(workdir: str, spec: str) -> Choice:
  """The kept checkpoint `spec` names: an iteration, 'latest', or 'best:[min:|max:]METRIC', the
  kept iteration whose METRIC in metrics.jsonl is highest (max, the default) or lowest (min);
  ties go to the later iteration. A ValueError names --step and what is there."""
  kept = kept_steps(workdir)
  if not kept:
    raise ValueError(f"--workdir={workdir!r} keeps no checkpoint (checkpoints/ is empty): the "
                     "run saved none yet, nothing to export")
  if spec == "latest":
    return Choice(kept[-1], tuple(kept))
  if not spec.startswith(BEST):
    try:
      step = int(spec)
    except ValueError:
      raise ValueError(f"--step={spec!r}: expected an iteration, 'latest', or 'best:METRIC' "
                       "(best:min:METRIC for the lowest)") from None
    if step not in kept:
      raise ValueError(f"--step={spec}: {_not_kept(step, kept)}")
    return Choice(step, tuple(kept))
  name, mode = spec[len(BEST):], "max"
  for prefix in ("min:", "max:"):
    if name.startswith(prefix):
      name, mode = name[len(prefix):], prefix[:-1]
  if not name:
    raise ValueError(f"--step={spec!r}: expected a metric after 'best:' (best:val/reward_mean)")
  logged: dict[int, Any] = {}  # step: value, the last row of a step winning
  names = set()
  for row in wd.iter_jsonl(os.path.join(workdir, "metrics.jsonl")):  # (not held whole)
    names.update(k for k, v in row.items() if isinstance(v, (int, float)))
    if name in row and isinstance(row.get("step"), int):
      logged[row["step"]] = row[name]
  if not logged:
    close = difflib.get_close_matches(name, sorted(names), n=5, cutoff=0.4)
    raise ValueError(f"--step={spec!r}: {name!r} was never logged in metrics.jsonl" + (
        f"; nearest names: {', '.join(close)}" if close else
        f"; logged: {', '.join(sorted(names)[:20])}" if names else " (no metrics)"))
  values = {s: float(v) for s, v in logged.items() if s in kept and
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
  if not values:
    at = sorted(logged)
    raise ValueError(
        f"--step={spec!r}: {name!r} is logged at iterations {_short(at)} but at no kept "
        f"checkpoint (kept: {kept}), or not as a finite number there: validation runs every "
        "config.eval_every iterations, checkpoints every config.checkpoint.every, and "
        "config.checkpoint.keep decides how many stay; pick an iteration with --step=K")
  sign = 1 if mode == "max" else -1
  step = max(values, key=lambda s: (sign * values[s], s))
  return Choice(step, tuple(kept), name, values[step], mode)


def _short(steps: list[int]) -> str:
  return str(steps) if len(steps) <= 12 else f"[{', '.join(map(str, steps[:10]))}, ...]"


def run_config(workdir: str, step: int) -> tuple[dict, str]:
  """(the config as recorded by the start that wrote checkpoint `step`, its file): the newest
  config.K.json with K below `step` (a start that resumed at K), else config.json. With
  config.plan.file, the plan file's content as it was then stays under "plan_file_content"."""
  record, path = hooks.config_record_of(workdir, step)
  if record is None:
    raise ValueError(f"--workdir={workdir!r}: its config.json does not read as a JSON object")
  return dict(record), path


def export_config(record: dict, family: str, scratch: str = "") -> TrainConfig:
  """The run's TrainConfig with checkpoint.export_hf set to `family` ('': the run's own, or
  'auto' when the run exported nothing). A plan file's recorded content is written to
  `scratch`/plan.json and read from there: the layout the checkpoint was saved in, even if the
  file at config.plan.file changed or is gone since."""
  record = dict(record)
  plan = record.pop("plan_file_content", None)
  if plan is not None and scratch:
    path = os.path.join(scratch, "plan.json")
    wd.write_json(path, plan)
    record["plan"] = {**record.get("plan", {}), "file": path}
  cfg = TrainConfig.from_config_dict(record)
  family = family or cfg.checkpoint.export_hf or "auto"
  if family not in EXPORT_HF_CHOICES or not family:
    raise ValueError(f"--family={family!r}: expected one of "
                     f"{[c for c in EXPORT_HF_CHOICES if c]}")
  return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                 export_hf=family))


def check_model(cfg: TrainConfig, model: str) -> None:
  """A ValueError naming --model unless the run (its config `cfg`) has `model` to export: the
  actor, or the critic of a run whose advantage estimator trains one."""
  hf_export.check_model_name(model, "--model")
  if model == "critic" and not adv_lib.needs_critic(cfg.algo.estimator):
    raise ValueError(f"--model=critic: the run trained no critic (its config.algo.estimator="
                     f"{cfg.algo.estimator!r} estimates advantages without one), so its "
                     "checkpoints hold none; export its actor (--model=actor, the default)")


def check_out_dir(out_dir: str, workdir: str, model: str = "actor") -> None:
  """A ValueError when `out_dir` exists and is not an earlier export of this run's `model` (its
  marker): an export replaces the whole directory, and would delete whatever else is there,
  another run's export or this run's other model's included; or when it is one of the run's
  own directories."""
  real, run = os.path.realpath(out_dir), os.path.realpath(workdir)
  own = [run, os.path.join(run, "checkpoints"), os.path.join(run, hf_export.HF_EXPORT_DIR)]
  if real in own or real.startswith(own[1] + os.sep):
    raise ValueError(f"--out={out_dir!r} is the run's own directory (the workdir, its "
                     f"checkpoints, or the {hf_export.HF_EXPORT_DIR}/ that checkpoint.export_hf "
                     "writes and result.json names): expected a directory of its own (default "
                     "WORKDIR/hf_export_K, WORKDIR/hf_export_critic_K for the critic)")
  if os.path.lexists(out_dir) and hf_export.exported_step(out_dir) is None:
    raise ValueError(f"--out={out_dir!r} exists and is not an export (no "
                     f"{hf_export.EXPORT_MARKER}): an export replaces the whole directory; give a "
                     "new path or remove it")
  # (one inside the run's own workdir is its own: the workdir moved or copied since, its path
  # in the marker with it)
  other = hf_export.exported_run(out_dir)
  if other is not None and other != run and not real.startswith(run + os.sep):
    raise ValueError(f"--out={out_dir!r} holds an export of another run, {other} (iteration "
                     f"{hf_export.exported_step(out_dir)}): an export replaces the whole "
                     "directory; give a new path, or remove that export first")
  held = hf_export.exported_model(out_dir)
  if held is not None and held != model:
    raise ValueError(f"--out={out_dir!r} holds an export of the run's {held} (iteration "
                     f"{hf_export.exported_step(out_dir)}), not of its {model} "
                     f"(--model={model}): an export replaces the whole directory; give a new "
                     f"path (default {os.path.basename(default_out(workdir, 'K', model))}), or "
                     "remove that export first")


def default_out(workdir: str, step: Any, model: str = "actor") -> str:
  """WORKDIR/hf_export_<step> for the actor, WORKDIR/hf_export_critic_<step> for the critic."""
  name = hf_export.HF_EXPORT_DIR + ("_critic" if model == "critic" else "")
  return os.path.join(workdir, f"{name}_{step}")


def export(workdir: str, spec: str = "latest", out_dir: str = "", family: str = "",
           mesh: Optional[jax.sharding.Mesh] = None, model: str = "actor") -> dict:
  """Exports the `model` ("actor", or "critic": check_model) of the kept checkpoint `spec` names
  (choose_step) of the run in `workdir` to `out_dir` (default WORKDIR/hf_export_<step>, or
  WORKDIR/hf_export_critic_<step>), in the HF `family` ('': the run's checkpoint.export_hf for
  the actor, else auto; auto for the critic). Returns {model, step, out, family, config, kept,
  chosen, value_bias for the critic (its score.bias, which transformers ignores), and metric,
  mode and value for best:...}."""
  check_run(workdir)
  hf_export.check_model_name(model, "--model")
  choice = choose_step(workdir, spec)
  out_dir = out_dir or default_out(workdir, choice.step, model)
  check_out_dir(out_dir, workdir, model)
  record, config_path = run_config(workdir, choice.step)
  # The actor's family goes into the run's config (the trainer checks it against the actor); the
  # critic's is passed on to the export alone.
  actor_family = family if model == "actor" else ""
  with tempfile.TemporaryDirectory(prefix="rlhfuse_export_") as scratch:
    try:
      cfg = export_config(record, actor_family, scratch)
      check_model(cfg, model)
      return _export(workdir, choice, out_dir, cfg, config_path, mesh, model, family)
    except ValueError as e:  # the trainer's checks name the field --family was put into
      for field in (f"config.checkpoint.export_hf={actor_family!r}",
                    f"critic_family={family or 'auto'!r}"):
        if family and str(e).startswith(field):
          raise ValueError(f"--family={family!r}{str(e)[len(field):]}") from None
      raise


def _strings(tree: Any) -> list[str]:
  """The text values of a nested dict/list (a config's paths among them)."""
  if isinstance(tree, str):
    return [tree]
  if isinstance(tree, dict):
    tree = list(tree.values())
  return [s for x in tree for s in _strings(x)] if isinstance(tree, (list, tuple)) else []


def check_devices(cfg: TrainConfig, num_devices: int, platform: str) -> None:
  """A clear error when the run's mesh needs more devices than jax sees: exporting the main
  job's run (mesh.stage=4) in a plain `python` (1 CPU device) failed with the mesh's bare
  "does not divide 1", where train_ppo names the XLA_FLAGS that gives them."""
  sizes = dataclasses.asdict(cfg.mesh)
  gen = cfg.async_ppo.generation_devices  # (an asynchronous run's generation group, apart)
  need = cfg.min_devices
  if need <= num_devices:
    return
  raise ValueError(
      f"the run's config.mesh={sizes}" + (f" + config.async_ppo.generation_devices={gen}"
                                          if gen else "") +
      f" needs at least {need} devices, but jax sees {num_devices} "
      f"({platform}): " + (f"on a CPU host add fake devices before jax starts, as the run had: "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={need} (or the "
                           "run's own count)" if platform == "cpu" else
                           f"export on a host with {need} or more"))


def _export(workdir: str, choice: Choice, out_dir: str, cfg: TrainConfig, config_path: str,
            mesh: Optional[jax.sharding.Mesh], model: str = "actor", family: str = "") -> dict:
  if mesh is None:
    check_devices(cfg, jax.device_count(), jax.default_backend())
  try:
    trainer = PPOTrainer(cfg, workdir, mesh=mesh, export_step=choice.step)
  except FileNotFoundError as e:  # a path of the run's config, relative to where it started
    # (only for a relative path the error names: an absolute one is gone from anywhere)
    relative = [v for v in _strings(dataclasses.asdict(cfg))
                if v and not os.path.isabs(v) and repr(v) in str(e)]
    raise FileNotFoundError(
        f"{e} (read from the run's config {config_path}: " +
        (f"its relative paths are taken from the current directory, {os.getcwd()}, as the "
         "run took them from where it started; run export_hf from there)" if relative else
         "the export builds the model from the files the run started from, which must still "
         "be there; put it back where the config names it)")) from None
  except wd.WorkdirInUseError as e:  # its advice was a training run's (another --workdir)
    raise wd.WorkdirInUseError(
        f"{str(e).split(';')[0]}; export once it has finished or stopped (SIGTERM saves a "
        "checkpoint first): while it trains, its checkpoint rotation could delete the one the "
        "export reads") from None
  try:
    written = trainer.export_checkpoint(out_dir, model, family or "auto")
  finally:
    trainer.checkpoints.checkpointer.close()
    trainer.release_lock()
  out = {"model": model, "step": choice.step, "out": out_dir, "family": written,
         "config": config_path, "kept": list(choice.kept), "chosen": choice.describe()}
  if model == "critic":
    out["value_bias"] = hf_export.exported_value_bias(out_dir)
  if choice.metric:
    out.update(metric=choice.metric, mode=choice.mode, value=choice.value)
  return out
