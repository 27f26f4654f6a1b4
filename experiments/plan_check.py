r"""Compile a training plan's real programs from shapes and check that they fit in HBM.

  python -m experiments.plan_check --config=configs/plan_check.py:tiny --workdir=/tmp/pc_tiny
  python -m experiments.plan_check --config=configs/plan_check.py:7b_host8 --workdir=/tmp/pc_7b8
  python -m experiments.plan_check --config=configs/plan_check.py:llama/13b --workdir=/tmp/pc_13b
  python -m experiments.plan_check --config=configs/plan_check.py \
      --run_config=configs/ppo_hf.py:ppo_gpu --run_config.init.actor_checkpoint=/models/x \
      --run_config.init.critic_checkpoint=/models/x --workdir=/tmp/pc_run

For an actor/critic pair and a plan (pp, critic_pp, tp, dp, fsdp, micro-batch, sequence length,
remat, attention, generation tp and slots) this lowers and compiles, on fake CPU devices and from
jax.ShapeDtypeStructs with shardings (no parameter is allocated), the programs this codebase runs
(experiments/plan_programs.py says which and how they are measured):

  train_step  the PPO update the trainer jits: trainer/pipelined.py (the fused executor + AdamW)
              when pp > 1, trainer/ppo.make_update_fn (micro-batched) when pp == 1 (the
              actor's alone with config.trains_critic False, pp == 1 only, as the trainer)
  decode      a generation instance's decode chunk (generation/instances.py) on gen_tp devices,
              or with generation="mesh" the Generator's on the training mesh
  inference   the instance's reference log-prob forward (inference/scoring.py; "mesh": the
              Scorer's, on the whole rollout batch); with config.reference False (a run's
              algo.kl_coef=0: no reference) the critic's value forward; none without a
              critic either (config.trains_critic False: a critic-free algo.estimator)
  reward      with config.reward_model (a run's reward.kind='model': its checkpoint's
              architecture), the reward model's scalar forward on the same devices and rows
  actor_logp  where the run makes it, the actor's log-prob forward on the training devices
              before the update, beside the training state: algo.old_logp's recomputation
              (config.old_logp "recompute", or "auto" with a 16-bit actor and pp == 1, in the
              update's micro-batches) or asynchronous PPO's proximal log-probs (config.staleness
              > 0, a mini-batch a piece); the trainer's Scorer and jitted forward
  critic_values  with config.staleness > 0 (asynchronous PPO) and a critic, the current
              critic's value forward on the training devices before the advantages, beside
              the training state, a mini-batch a piece; the trainer's Scorer and jitted forward

With config.staleness > 0 and no generation group the trainer's copy of the actor for the next
batch (kept through the update and that generation) counts beside the train step and the
generation's programs (actor_copy_bytes; plan_programs.beside_train_state says which).
(--run_config: a training config, with train_ppo's overrides, checked as its trainer runs it)
and writes result.json (per program: argument/output/temp/peak bytes and FLOPs per device from
the compiled program, the analytic breakdown, replication, fits, compile_s) and config.json.
Its exit status is 0 when every program fits, EXIT_DOES_NOT_FIT (4) when one does not (the
table's verdict line says which and what would shrink it; result.json is written either way),
and 1 for bad input, so a script or a CI job can gate a launch on it.

XLA reads the device count once, when jax initialises, so this binary imports nothing of jax at
module level: main() sets `--xla_force_host_platform_device_count` to the plan's device count
first (parallel/host_devices.py; a count already in XLA_FLAGS or JAX_NUM_CPU_DEVICES is
replaced, the other flags kept), then imports the programs module.

Docs: docs/results.md ("Plan check"), docs/usage.md ("Memory at scale", "GPU, TPU and many
hosts").
"""
from __future__ import annotations

import dataclasses
import os
import sys

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.parallel.host_devices import host_device_env

_CONFIG = config_flags.DEFINE_config_file("config", None, "Plan config.", lock_config=True)
_RUN_CONFIG = config_flags.DEFINE_config_file(
    "run_config", None, "Optional: a training config (train_ppo's --config, its overrides as "
    "--run_config.<field>=...) to check as its trainer runs it; it sets the plan's models, "
    "mesh, batches, lengths and generation (configs/plan_check.apply_run), --config the rest.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")

EXIT_DOES_NOT_FIT = 4  # a program's peak exceeds the hardware's HBM (1 is bad input)

flags.mark_flags_as_required(["config", "workdir"])


def device_count(c) -> int:
  """Devices the plan needs (training mesh, one generation instance or asynchronous PPO's
  generation group, whichever is largest); plain Python, so it runs before jax is imported.
  Errors name the field."""
  names = ("pp", "tp", "dp", "fsdp", "gen_tp")
  config_files.check_ints(c, names)
  sizes = {name: c[name] for name in names}
  group = c.get("generation_devices", 0) or 0
  config_files.check_int("generation_devices", group, minimum=0)
  return max(sizes["pp"] * sizes["tp"] * sizes["dp"] * sizes["fsdp"], sizes["gen_tp"], group)


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  config = _CONFIG.value
  from configs import plan_check as plan_config  # plain Python until a model is loaded
  plan_config.check_one_training_config(config_flags.get_config_filename(flags.FLAGS["config"]),
                                        _RUN_CONFIG.value is not None)
  if _RUN_CONFIG.value is not None:
    fields = config.to_dict()
    # replaced by the run's (sections or presets; its reward model's architecture or none)
    fields.pop("actor"), fields.pop("critic"), fields.pop("reward_model", None)
    config = ml_collections.ConfigDict(fields)
    try:
      run = plan_config.apply_run(config, _RUN_CONFIG.value,
                                  config_flags.get_override_values(flags.FLAGS["run_config"]))
    except (ValueError, FileNotFoundError) as e:  # they say config.<field>: the user typed
      # --run_config (a checkpoint directory not there is a FileNotFoundError)
      kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
      raise kind(f"--run_config (config.<field> is --run_config.<field> here): {e}") from None
    if run.plan.file:  # a plan searched for another workload: its memory check is not this
      # run's, which train_ppo warns of at set-up (checked here with the checkpoints' shapes)
      # pylint: disable=import-outside-toplevel
      from rlhfuse_jax.trainer import plan_file as plan_file_lib
      # checked on the plan's devices (train_ppo checks it on the run's own)
      why = plan_file_lib.plan_fsdp_error(dataclasses.asdict(run.mesh), run.plan.file)
      if why:
        raise ValueError(f"--run_config (config.<field> is --run_config.<field> here): {why}")
      from rlhfuse_jax.trainer import build
      try:  # the reward model the plan was searched for, against the run's
        reward = build.reward_model_config(run)
      except (ValueError, FileNotFoundError) as e:  # as apply_run's: config.<field> in it
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
        raise kind(f"--run_config (config.<field> is --run_config.<field> here): {e}") from None
      note = plan_file_lib.plan_workload_note(run.plan.file, run, reward)
      if note:
        (logging.warning if note[0] else logging.info)("--run_config: %s", note[1])
  n = device_count(config)
  # The plan's count, not one the caller's XLA_FLAGS set (e.g. 8, exported for train_ppo as the
  # docs' commands do): with fewer the run stopped in plan_programs.run, telling the user to run
  # plan_check, which they were doing.
  os.environ.update(host_device_env(n))  # JAX_NUM_CPU_DEVICES too: jax's overrides the flag
  if "JAX_NUM_CPU_DEVICES" in os.environ and "jax" in sys.modules:
    # jax imported already (--run_config's model code): its config read the variable then
    sys.modules["jax"].config.update("jax_num_cpu_devices", n)
  mock = os.environ.get("JAX_MOCK_GPU_TOPOLOGY")
  if mock:
    # jax 0.11.2 with its CUDA 13 plugin on an H200 (2026-12-04) gave 1 device with the variable
    # alone and the mocked N with the config set before the backend starts: set it here.
    import jax
    jax.config.update("jax_mock_gpu_topology", mock)
  from experiments import plan_programs  # imports jax: after the device count is set
  try:
    cfg = plan_programs.PlanConfig.from_config_dict(config)
  except ValueError as e:
    if _RUN_CONFIG.value is None:
      raise
    # The plan's fields are the run's here: named alone, config.gen_slots=64 was a field the
    # user never set (--run_config.mesh.data=3 had made the rollout batch not split).
    raise ValueError(f"--run_config: the plan of the run as its trainer runs it is refused: "
                     f"{e} (here config.gen_slots is the run's rollout batch, or an instance's "
                     "slots with plan.generation='instances'; config.dp, fsdp, tp and pp its "
                     "mesh.data, fsdp, tensor and stage)") from None
  wd.start_outputs(_WORKDIR.value, config, ("result.json",))
  result = plan_programs.run_and_write(cfg, _WORKDIR.value)
  for line in plan_programs.table(result):
    logging.info("%s", line)
  logging.info("wrote %s", os.path.join(_WORKDIR.value, "result.json"))
  over = [name for name, p in result["programs"].items() if not p["fits"]]
  if over:  # (it exited 0 beside "verdict: DOES NOT FIT": a script could not tell)
    logging.error("exit status %d: %s not fitting (the verdict above says what would shrink "
                  "it)", EXIT_DOES_NOT_FIT, ", ".join(over))
    sys.exit(EXIT_DOES_NOT_FIT)


if __name__ == "__main__":
  config_files.run(main)
