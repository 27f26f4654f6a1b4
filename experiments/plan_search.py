r"""Pipe-RLHF's hierarchical plan search: a parallel plan per RLHF stage for one setting.

  python -m experiments.plan_search --config=configs/plan_search.py:65b/33b --workdir=/tmp/plan
  python -m experiments.plan_search --config=configs/plan_search.py:train --workdir=/tmp/plan

Searches generation (instances, or delayed inter-batch pipelines), inference and training
(colocated pipelines or disjoint groups) layouts on the simulator's cost model
(rlhfuse_jax/sim/plan_search.py, docs/architecture.md §4), with `sim.staleness` k >= 1 also
asynchronous PPO's splits of the devices into a generation and a training group, and writes
into the workdir:
  plan.json       the fastest plan: generation / inference / training layouts, predicted stage
                  times; the asynchronous plan where it beats the synchronous one (for a
                  train_config run asynchronously on its training devices, the synchronous
                  one run so: plan_search.plan_json_choice), then with
                  "async": {generation_devices, training_devices, staleness, colocated} (the
                  generation and inference layouts on the generation group, training on the
                  other devices), the hardware's values ("hardware") and the workload
                  searched for ("workload": actor and critic shapes, global_batch, minibatch,
                  epochs, max_prompt_len, max_new_tokens, num_devices, reference,
                  reward_model, lengths: the prompt and response lengths searched with and
                  a run's data fields they came from; actor_copy: whether its memory check
                  counted asynchronous PPO's copy of the actor on the training devices;
                  train_config and its fusion.inference_micro_batch,
                  fusion.migration_rows, optim.master_weights and
                  optim.offload_during_rollout (offload_optimizer) when given;
                  train_ppo warns of a run whose workload differs)
  result.json     {"best", "top", "uniform", "async", "plan_json", "stages", "systems",
                  "search_s", "setting", "hardware", "efficiency", "plan_memory"};
                  best.predicted_iteration_s (synchronous; best is null where only
                  asynchronous splits fit: 24 devices, no layout of all 24 divides the
                  mini-batch), uniform.predicted_iteration_s
                  and async.predicted_iteration_s (with async.generation_devices,
                  training_devices, staleness, colocated; colocated_refused: why the
                  colocated option does not fit with the trainer's copy of the actor
                  beside its stages, or null) are the figures; plan_json says
                  which plan plan.json holds ("synchronous" or "asynchronous");
                  "async_error": why no asynchronous split fits, where a synchronous plan
                  does (async then null; also in plan_search.md); "refused":
                  {why: synchronous combinations} tried and skipped: a generation or
                  inference that does not fit beside its training plan's state,
                  or one the trainer would not run (with sim.trainer_runnable or
                  train_config); "systems_error": why the systems' comparison failed (a
                  calibration that cannot time their layouts), its rows then left out
  plan_search.md  the models searched for (result.json setting.models: each one's shape,
                  parameter count and source, a preset's paper, its config.json or the run's
                  config), sequences longer than a model's context (setting.context_warnings,
                  also logged: as reproduce_ablations warns of them), the top plans with
                  predicted stage times, the best uniform layout, the
                  memory per device of each stage of plan.json's plan (weights, gradients,
                  optimizer state, activations or KV cache, frozen weights kept, the
                  training state kept beside generation and inference, against the
                  usable HBM; result.json "plan_memory"), the
                  asynchronous plans and splits, the simulator's other systems on the same
                  setting, and the hardware's figures and assumed efficiencies (result.json's
                  hardware and efficiency)
  config.json

With `train_config` (a train_ppo config, PATH[:VARIANT]; the `train` variant: configs/
ppo_tiny.py) the workload is that run's (rlhfuse_jax/trainer/sim_plan.py: its models, rollout
batch, mini-batch, epochs, max_new_tokens; prompt lengths of its prompts, response lengths of
its task's targets) on `num_devices` devices of `hardware`, and only plans the trainer runs are
searched: sim.trainer_runnable (plan_search.trainer_refusal) and the trainer's own checks of the
run's config with each plan as config.plan.file, on num_devices fake CPU devices (this binary
asks jax for them; nothing is compiled). The systems' rows (`systems`) run the search with
sim.trainer_runnable but without the trainer's checks; `systems` "" (--config.systems=) runs
none, the plan search alone. plan.json is then
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train_ppo \
    --config=configs/ppo_tiny.py --config.plan.file=DIR/plan.json --workdir=/tmp/ppo_plan
and the workdir also holds lengths/ (prompt_lengths.txt, response_lengths.txt: what the
workload samples). A run with overrides is searched as train_ppo would run it with --run_config
(the config file) and --run_config.<field>=... (train_ppo's --config.<field> overrides), as
plan_check takes them; plan.json's workload records both:
  python -m experiments.plan_search --config=configs/plan_search.py:train \
    --run_config=configs/ppo_tiny.py --run_config.rollout.max_new_tokens=16 --workdir=DIR
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from experiments.runner import fixed_or_sci
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import search as search_lib
from rlhfuse_jax.sim import ablations, iteration_sim, plan_search, training_sim
from rlhfuse_jax.sim import report as sim_report
from rlhfuse_jax.sim import shapes
from rlhfuse_jax.sim.cost_model import CostModel

_DEVICE_FLAG = "--xla_force_host_platform_device_count"

_CONFIG = config_flags.DEFINE_config_file("config", None, "Plan search config.",
                                          lock_config=True)
_RUN_CONFIG = config_flags.DEFINE_config_file(
    "run_config", None, "Optional, with a search for a training run (config.train_config set: the "
    "`train` variant): the train_ppo config whose workload is searched, in place of "
    "config.train_config, with train_ppo's overrides as --run_config.<field>=... (as "
    "plan_check's --run_config).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])


def _s(seconds: float, decimals: int = 2) -> str:
  """Seconds for the report: `decimals` decimals, or 3 significant digits where those would
  show 0 (a tiny model's stages take microseconds)."""
  return fixed_or_sci(seconds, decimals)


# What each stage's listed seconds cover (plan_search.search's "stages").
STAGE_TIMES = {"generation": "seconds, the actor's resharding into the layout included",
               "inference": "seconds", "training": "seconds",
               "uniform": "seconds of the whole iteration: one layout for every stage, "
                          "no resharding"}


def memory_lines(memory: list[dict], which: str, hbm_bytes: float) -> list[str]:
  """plan_search.md's memory per device of plan.json's plan (`which`: synchronous or
  asynchronous), each stage's parts (plan_search.plan_memory) against the usable HBM."""
  gib = lambda x: _s(x / training_sim.GIB)
  usable = memory[0]["usable"]
  lines = ["", f"Memory per device of plan.json's ({which}) plan, GiB, by the formulas of the "
           f"search's memory checks (training at the trainer's padded rows), against "
           f"{gib(usable)} GiB usable of the device's {gib(hbm_bytes)} GiB HBM:", "",
           "| stage | layout | per device | total | of usable |", "|---|---|---|---|---|"]
  for r in memory:
    parts = " + ".join(f"{k} {gib(v)}" for k, v in r["parts"].items())
    share = 100.0 * r["total"] / r["usable"]
    lines.append(f"| {r['stage']} | {r['layout']} | {parts} | {gib(r['total'])} | "
                 f"{share:.0f} %{' (does not fit)' if share > 100 else ''} |"
                 if share >= 1 else
                 f"| {r['stage']} | {r['layout']} | {parts} | {gib(r['total'])} | "
                 f"{share:.2g} % |")
  return lines


def model_lines(models: dict) -> list[str]:
  """plan_search.md's table of the models searched for (setting["models"]: {role: a shape's
  to_dict() with its "source"}), so that the report says which model it planned."""
  lines = ["Models searched for:", "",
           "| role | model | parameters | layers | hidden | ffn | heads / KV heads x head_dim | "
           "vocabulary | bytes per weight / KV element | source |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for role, m in models.items():
    head_dim = m["head_dim"] or m["hidden_size"] // m["num_heads"]
    n = m["num_params"]
    params = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    lines.append(f"| {role} | {m['name']} | {params} | {m['num_layers']} | "
                 f"{m['hidden_size']} | {m['intermediate_size']} | {m['num_heads']} / "
                 f"{m['num_kv_heads']} x {head_dim} | {m['vocab_size']}"
                 f"{' (tied)' if m['tie_embeddings'] and m['head'] == 'lm' else ''} | "
                 f"{m['weight_itemsize']} / {m['kv_itemsize']} | {m['source']} |")
  return lines + [""]


def report(res: dict, systems: dict, setting: dict,
           constants: Optional[tuple[dict, dict]] = None,
           memory: Optional[tuple[list, str, float]] = None) -> list[str]:
  """plan_search.md: the top plans, the uniform layout, the other systems, (`memory`:
  memory_lines' arguments) plan.json's plan's memory per device of each stage, and
  (`constants`: the hardware's and the efficiencies' dicts, and the calibration's describe() or
  None) what the simulated times rest on."""
  # `evaluated` counts the distinct plans that fit, `rejected_plans` the others (each once,
  # however many inference plans' frozen weights it was tried beside; a result.json from before
  # has only the `rejected` dict); the synchronous time is the one the search logs ("plan
  # search done in"), the asynchronous search's follows it.
  rejected = res.get("rejected_plans", len(res["rejected"]))
  plans = (f"{res['evaluated']} feasible stage plans, {rejected} rejected for "
           "memory or divisibility")
  a = res.get("async")
  searched = (f"Searched in {res['synchronous_search_s']:.1f} s: {plans}." if a is None else
              f"Searched in {res['search_s']:.1f} s in all: the synchronous plans in "
              f"{res['synchronous_search_s']:.1f} s ({plans}), the asynchronous splits in "
              f"{a['search_s']:.1f} s.")
  lines = [f"# Plan search: {setting['label']} on {setting['num_devices']} x "
           f"{setting['hardware']}", "",
           f"{searched} Times are simulated seconds of one iteration (rlhfuse_jax/sim/).", ""]
  if "models" in setting:  # (a result.json from before it named them has none)
    lines += model_lines(setting["models"])
  for line in setting.get("context_warnings", ()):
    lines += [f"Warning: {line}.", ""]
  if "train_config" in setting:
    refused = res["refused"]
    lines += [f"The workload of `{setting['train_config']}` (batch {setting['global_batch']}, "
              f"mini-batch {setting['minibatch']}, {setting['epochs']} epochs, "
              f"max_new_tokens {setting['max_new_tokens']}"
              + ("" if setting.get("reference", True) else
                 "; no reference model (algo.kl_coef=0): none of its weights or forwards")
              + ("" if setting.get("reward_model", True) else
                 "; no reward model (reward.kind='function'): none of its weights or forwards")
              + ("" if setting.get("trains_critic", True) else
                 f"; {setting['critic_note']}")
              + ("" if "reward" not in setting else
                 f"; the reward model at its checkpoint's shape "
                 f"({setting['reward']['num_params'] / 1e6:.3g}M parameters)")
              + "; response lengths: "
              f"{setting['lengths']['response_lengths_from']}), restricted to plans the "
              f"trainer runs.", ""]
  if res["refused"]:
    refused = res["refused"]
    lines += [f"{sum(refused.values())} synchronous combinations skipped (the trainer would "
              "not run them, or a stage does not fit beside the training state), the most "
              "often for:", ""]
    lines += [f"- {n} x {why}" for why, n in sorted(refused.items(), key=lambda x: -x[1])[:5]]
    lines += [""]
  if res["best"] is None:  # only asynchronous splits fit (plan_search.search)
    lines += [f"No synchronous plan: {res['synchronous_error']}", ""]
  lines += ["| rank | plan | reshard s | gen s | inference s | train s | iteration s |",
            "|---|---|---|---|---|---|---|"]
  for i, p in enumerate(res["top"]):
    q = p["predicted"]
    lines.append(f"| {i + 1} | {p['summary']} | {_s(q['reshard_s'])} | {_s(q['gen_s'])} | "
                 f"{_s(q['inf_s'])} | {_s(q['train_s'])} | {_s(q['iteration_s'])} |")
  u = res["uniform"]
  if u is not None:
    q = u["predicted"]
    lines.append(f"| uniform | one layout tp{u['layout']['tp']} pp{u['layout']['pp']} "
                 f"dp{u['layout']['dp']} for every stage | 0 | {_s(q['gen_s'])} | "
                 f"{_s(q['inf_s'])} | {_s(q['train_s'])} | {_s(q['iteration_s'])} |")
    if res["best"] is not None and q["iteration_s"] < res["best"]["predicted"]["iteration_s"]:
      lines += ["", f"The uniform layout is predicted faster than every per-stage combination "
                f"({q['iteration_s'] / res['best']['predicted']['iteration_s']:.3f}x the best's "
                "time): no per-stage combination expresses its generation and inference on the "
                "training layout. plan.json holds the best combination; the simulated systems' "
                "pipe_rlhf row takes the uniform layout."]
  if memory is not None:
    lines += memory_lines(*memory)
  if res.get("async_error"):  # a synchronous plan fits, no split does (plan_search.search)
    lines += ["", f"No asynchronous plan: {res['async_error']}"]
  if a is not None:
    lines += ["", f"Asynchronous PPO (staleness k={a['staleness']}: the generation group "
              "generates and scores the batch k iterations ahead while the training group "
              "trains; iteration = max(gen + inference, train) + reshard of the actor, "
              "or the serial sum with both groups on all devices; searched in "
              f"{a['search_s']:.1f} s):", "",
              "| rank | plan | generation / training devices | reshard s | gen s | inference s "
              "| train s | iteration s |", "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(a["top"]):
      q, sp = p["predicted"], p["async"]
      where = ("all / all (colocated, serial)" if sp["colocated"] else
               f"{sp['generation_devices']} / {sp['training_devices']}")
      lines.append(f"| {i + 1} | {p['summary']} | {where} | {_s(q['reshard_s'])} | "
                   f"{_s(q['gen_s'])} | {_s(q['inf_s'])} | {_s(q['train_s'])} | "
                   f"{_s(q['iteration_s'])} |")
    fit = [sp for sp in a["splits"] if "iteration_s" in sp]
    lines += ["", f"Splits tried: {len(a['splits'])}, {len(fit)} fit (the others: no training "
              "plan divides the mini-batch over the group, or a stage does not fit in memory"
              + (", or the trainer would not run the plan; result.json's async.splits say why"
                 if "train_config" in setting else "")
              + "); best per split (generation / training devices: iteration s, the slower "
              "group):", ""]
    lines += [f"- {sp['generation_devices']} / {sp['training_devices']}: "
              f"{_s(sp['iteration_s'])} ({sp['bound']})" for sp in fit]
  if systems:
    lines += ["", "The simulator's systems on the same setting:", "",
              "| system | gen+inf s | train s | reshard s | iteration s |",
              "|---|---|---|---|---|"]
    lines += [f"| {k} | {_s(r['gen_plus_inf_s'])} | {_s(r['train_s'])} | "
              f"{_s(r['reshard_s'])} | {_s(r['iteration_s'])} |" for k, r in systems.items()]
    if not setting.get("trains_critic", True):
      lines += ["", "(the papers' systems are PPO's: each trains and scores a critic, which "
                "this run's plans do not)"]
    if "pipe_rlhf_async" in systems:
      lines += ["", "(iteration = gen+inf + train + reshard; pipe_rlhf_async on two groups: "
                "max(gen+inf, train) + reshard)"]
    ours = min(res["best"]["predicted"]["iteration_s"] if res["best"] else float("inf"),
               a["best"]["predicted"]["iteration_s"] if a else float("inf"))
    faster = [k for k, r in systems.items() if r["iteration_s"] < ours]
    if faster and "train_config" in setting:
      # A user read realhf_like at 1.00e-04 s beside plan.json's 1.59e-04 s with no word why.
      lines += ["", f"Faster than the plans above: {', '.join(faster)}. The systems are "
                "simulated as their papers run them, not only as the trainer runs"
                + (" (realhf_like's actor and critic trained at once on disjoint devices, "
                   "which train_ppo does not do)" if "realhf_like" in faster else "") + "."]
  for stage, opts in res["stages"].items():
    lines += ["", f"Best {stage} plans ({STAGE_TIMES.get(stage, 'seconds')}):", ""]
    lines += [f"- {name}: {_s(s, 3)}" for name, s in opts[:8]]
  if res["rejected"]:  # what did not fit, and the nearest miss: how far each stage is from
    # a larger layout or smaller devices (result.json "rejected" holds every one and why)
    lines += ["", f"Rejected stage plans ({len(res['rejected'])}; every one with why: "
              "result.json `rejected`), the nearest to fitting in memory per stage:", ""]
    for stage in ("gen", "inference", "training", "uniform"):
      mine, closest = plan_search.closest_rejection(res["rejected"], stage)
      if mine:
        lines.append(f"- {'generation' if stage == 'gen' else stage}: {len(mine)} rejected"
                     + (f"; nearest: {closest}: {mine[closest]}" if closest else
                        f" (none for memory; e.g. {next(iter(mine))}: "
                        f"{next(iter(mine.values()))})"))
  if constants is not None:
    lines += ["", "## Inputs (every time above follows from these and the workload)", ""]
    lines += sim_report.constants_section(*constants)
  return lines + [""]


def load_train_config(spec: str):
  """The ConfigDict of a train_ppo config `spec`, PATH[:VARIANT] (PATH relative to the working
  directory, as --config takes it)."""
  return config_files.get_config(spec, "config.train_config")


def cpu_devices(n: int) -> list:
  """n CPU devices for the trainer's checks: fake ones (XLA_FLAGS) unless the flag is set."""
  if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax starts its CPU backend
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={n}".strip()
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices("cpu")
  if len(devices) < n:
    raise ValueError(f"the trainer's checks need {n} CPU devices; XLA_FLAGS gives "
                     f"{len(devices)}: set {_DEVICE_FLAG}={n}")
  return devices[:n]


def train_run(cfg: ablations.AblationConfig, config_dict) -> tuple:
  """(devices, the resolved TrainConfig, task, tokenizer, its prompts: build.build_dataset) of
  the train_ppo config `config_dict` on cfg.num_devices fake CPU devices. main calls it before
  the outputs start: a config the trainer refuses (a mini-batch that does not divide the batch,
  a prompts file with a bad row, a reward model's checkpoint it cannot read) moved the earlier
  run's plan.json, the file a train_ppo run's config.plan.file names, to previous/<n>."""
  devices = cpu_devices(cfg.num_devices)
  # The trainer imports jax: only here, so that the paper variants never start it.
  from rlhfuse_jax.trainer import build  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer import validate  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer.config import TrainConfig  # pylint: disable=import-outside-toplevel
  train = TrainConfig.from_config_dict(config_dict)
  task, tokenizer = build.build_task_and_tokenizer(train)
  train = build.resolve_config(train, tokenizer)
  # A float16 trained model: every plan refused for it after the outputs had started (the
  # earlier plan.json moved), named config.<field> among the search's own refusals.
  validate.check_trained_dtypes(train)
  # The reward model's checkpoint (reward.kind='model'), whose shape the workload takes
  # (trainer/sim_plan.workload): read there, after the outputs had started, a missing one moved
  # the earlier plan.json and named config.<field> where the user typed --run_config.<field>.
  build.reward_model_config(train)
  return devices, train, task, tokenizer, build.build_dataset(train, task, tokenizer)


def trainer_setting(cfg: ablations.AblationConfig, path: str, overrides: str, config_dict,
                    workdir: str, run: tuple):
  """(setting, workload, accept) of the train_ppo config `path` (PATH[:VARIANT]) with
  `overrides` (run_config_spec's, "" without) (loaded once by main, before the outputs start:
  `config_dict`, and `run`, train_run's) on cfg.num_devices devices: the run's workload
  (trainer/sim_plan.workload, named after PATH's file) and the trainer's check of a plan
  against the run's config (trainer/sim_plan.PlanCheck on fake CPU devices)."""
  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer import sim_plan
  devices, train, task, tokenizer, dataset = run
  spec = path + overrides
  # PATH itself, not the spec cut at its first space: a path may hold one.
  name = os.path.splitext(os.path.basename(path.partition(":")[0]))[0]
  wl, lengths = sim_plan.workload(train, task, tokenizer, cfg.num_devices,
                                  os.path.join(workdir, "lengths"), micro_batch=cfg.micro_batch,
                                  seed=cfg.seed, name=name, dataset=dataset)
  setting = {"label": spec, "train_config": spec, "hardware": cfg.hardware,
             "num_devices": cfg.num_devices, "global_batch": wl.global_batch,
             "minibatch": wl.minibatch, "epochs": wl.epochs, "max_new_tokens": wl.max_new_tokens,
             "reference": wl.reference, "reward_model": wl.reward_model,
             "trains_critic": wl.trains_critic, "actor": wl.actor.to_dict(),
             **({"critic": wl.critic.to_dict()} if wl.trains_critic else {}), "lengths": lengths,
             **({} if wl.reward is None else {"reward": wl.reward.to_dict()})}
  # The models it planned, for the report: the run's, from its checkpoints where it loads them
  checkpoints = {"actor": train.init.actor_checkpoint, "critic": train.init.critic_checkpoint,
                 "reward": train.reward.model_checkpoint if wl.reward is not None else ""}
  sections = {"actor": "model", "critic": "critic_model", "reward": "reward.model_checkpoint"}
  setting["models"] = {
      role: {**setting[role], "source": f"{spec}: " + (
          f"{checkpoints[role]} (config.json)" if checkpoints[role] else sections[role])}
      for role in ("actor", "critic", "reward") if role in setting}
  if not wl.trains_critic:
    # (searched as PPO's, an overestimate, until 2026-12-08)
    setting["critic_note"] = (f"algo.estimator={train.algo.estimator!r} trains no critic: the "
                              "search times and sizes the actor's training alone")
    logging.info("plan search: %s", setting["critic_note"])
  return setting, wl, sim_plan.PlanCheck(config_dict, devices, tokenizer, workdir)


# The workload fields a train_ppo config (config.train_config) replaces with its run's own.
TRAIN_CONFIG_REPLACES = ("pairs", "max_new_tokens", "global_batch", "minibatch", "epochs",
                         "prompt", "response")


def run_config_spec(train_config: str) -> tuple[str, str]:
  """What --run_config names: its PATH[:VARIANT] and its overrides as typed, each
  " --run_config.<field>=value" (the reports and plan.json's workload record PATH followed by
  them). A ValueError without a search for a training run (config.train_config empty: the pair
  variants)."""
  if not train_config:
    raise ValueError("--run_config: searches a training run's workload with "
                     "--config=configs/plan_search.py:train (config.train_config is empty here: "
                     "the paper pairs' variants take no run)")
  overrides = config_flags.get_override_values(flags.FLAGS["run_config"])
  return config_flags.get_config_filename(flags.FLAGS["run_config"]), "".join(
      f" --run_config.{k}={v}" for k, v in sorted(overrides.items()))


def check_unread_overrides(train_config: str, overrides: dict) -> None:
  """A ValueError when the command line overrides a workload field that config.train_config
  replaces: --config.response.median=512 was silently ignored, and an 8B run was predicted on
  the toy task's 1-8-token responses."""
  unread = sorted(k for k in overrides if k.split(".")[0] in TRAIN_CONFIG_REPLACES)
  if train_config and unread:
    raise ValueError(
        f"--config.{unread[0]}: not read with config.train_config={train_config!r}, whose "
        "run sets the models, batches and lengths (set them in that config: its data.length_* "
        f"and rollout fields); {len(unread)} such override(s): {unread}")


def check_devices_per_host(value, num_devices: int) -> None:
  """A ValueError naming config.devices_per_host unless it is 0 (the hardware's host) or an
  integer >= 1 that divides config.num_devices (the run's processes of as many devices each)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
      value and num_devices % value):
    raise ValueError(
        f"config.devices_per_host={value!r}: expected the devices of each of the run's "
        f"processes, an integer >= 1 dividing config.num_devices={num_devices} (2 processes x "
        "4 devices: 4), or 0 for the hardware's host (config.hardware's devices_per_host)")


def with_host(cost: CostModel, devices_per_host: int) -> CostModel:
  """`cost` on hosts of `devices_per_host` devices (one process each; 0: as it is): what
  trainer_refusal keeps a generation instance, an inference pipeline and pipelined generation
  within. Only the plans allowed change: no simulated time reads the host's size."""
  if not devices_per_host:
    return cost
  return CostModel(dataclasses.replace(cost.hw, devices_per_host=devices_per_host), cost.eff,
                   cost.cal)


def smaller_hosts_refusing(wl, plan: dict, host_devices: int) -> dict:
  """{devices a process: trainer_refusal's reason} for the processes of fewer devices than
  `host_devices` (dividing the workload's devices) on which the trainer refuses `plan`, the
  largest first: a run of 2 processes x 4 devices refused a tp8 instance searched for hosts of
  8, and plan_search had not said so."""
  n = wl.num_devices
  out = {}
  for h in range(min(host_devices, n) - 1, 0, -1):
    why = plan_search.trainer_refusal(wl, plan, h) if n % h == 0 else None
    if why:
      out[h] = why
  return out


def _train_inputs(cfg: ablations.AblationConfig) -> tuple:
  """(spec, path, overrides, train_dict, run) of the run planned for (config.train_config or
  --run_config; all empty or None without one), its config checked as the trainer would."""
  spec = path = _CONFIG.value.get("train_config", "")
  overrides = ""
  if _RUN_CONFIG.value is not None:
    (path, overrides), train_dict = run_config_spec(spec), _RUN_CONFIG.value
    spec = path + overrides
  else:
    train_dict = load_train_config(spec) if spec else None  # a missing file or variant, named
  if not spec and len(cfg.settings()) != 1:
    raise ValueError(f"plan search takes one setting; the config has {len(cfg.settings())} "
                     "(one pair in `pairs`, one length in `max_new_tokens`)")
  try:
    run = train_run(cfg, train_dict) if spec else None  # the trainer's config checks
  except (ValueError, FileNotFoundError) as e:
    if _RUN_CONFIG.value is None:
      raise
    # they name config.<field>: the user typed --run_config.<field>
    kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
    raise kind(f"--run_config (config.<field> is --run_config.<field> here): {e}") from None
  return spec, path, overrides, train_dict, run


def _with_run_sim_options(cfg: ablations.AblationConfig, run) -> ablations.AblationConfig:
  """`cfg` with the run's staleness and optimizer offload as its sim options (the run is what
  the plan is for), each change from the config's own value logged."""
  from rlhfuse_jax.trainer import sim_plan  # pylint: disable=import-outside-toplevel
  given, given_k = cfg.sim.offload_optimizer, cfg.sim.staleness
  cfg = dataclasses.replace(cfg, sim=sim_plan.sim_options(cfg.sim, run[1]))
  if cfg.sim.staleness != given_k:
    logging.info("sim.staleness=%d, the run's async_ppo.staleness (the config said %d): its "
                 "asynchronous splits are searched at the run's k", cfg.sim.staleness, given_k)
  if cfg.sim.offload_optimizer != given or cfg.sim.offload_optimizer:
    logging.info("sim.offload_optimizer=%s, the run's optim.offload_during_rollout%s: "
                 "generation and inference are searched beside the trained models' weights%s",
                 cfg.sim.offload_optimizer,
                 "" if cfg.sim.offload_optimizer == given else f" (the config said {given})",
                 "" if cfg.sim.offload_optimizer else " and AdamW state")
  return cfg


def _preset_setting(cfg: ablations.AblationConfig) -> tuple:
  """(setting, workload) of the config's one preset setting, the setting naming the models
  planned and the sequences longer than a model's context (each also logged)."""
  setting = cfg.settings()[0]
  wl = ablations.workload(cfg, setting)
  # Which models it planned, and sequences longer than a model's context (as
  # reproduce_ablations warns of them): neither output said either, but for the names.
  setting["models"] = {role: {**shape.to_dict(), "source": cfg.shape_source(setting[role])}
                       for role, shape in (("actor", wl.actor), ("critic", wl.critic))}
  setting["context_warnings"] = ablations.context_warnings(cfg)
  for line in setting["context_warnings"]:
    logging.warning("sequences longer than a model's context: %s", line)
  return setting, wl


def _compare_systems(cfg: ablations.AblationConfig, cost: CostModel, wl, res: dict) -> tuple:
  """(systems, error): config.systems simulated on the workload for the report's comparison
  ({name: its times}), and why that failed (None if it did not): an extra the search's results
  are written without."""
  systems = {}
  compared = list(cfg.systems)
  if res["best"] is None and compared:
    # Only asynchronous splits fit: every other system is a synchronous or colocated plan on
    # all the devices, which fails the same way (the comparison raised, nothing was written).
    skipped = [k for k in compared if k != "pipe_rlhf_async"]
    compared = [k for k in compared if k == "pipe_rlhf_async"]
    if skipped:
      logging.warning("no synchronous plan fits, so the systems %s (each a plan on all %d "
                      "devices) are not simulated%s", ", ".join(skipped), wl.num_devices,
                      "" if compared else "; pipe_rlhf_async (config.systems) would be")
  if "async_error" in res and "pipe_rlhf_async" in compared:
    # A synchronous plan fits, no split does: pipe_rlhf_async's row is the search's best split.
    compared.remove("pipe_rlhf_async")
    logging.warning("no asynchronous split fits, so the system pipe_rlhf_async is not "
                    "simulated (result.json async_error)")
  systems_error = None  # why the systems' comparison failed, if it did
  if compared:
    t0 = time.time()
    # Silent for minutes before on a first run (configs/plan_search.py:train, a fresh checkout:
    # 150 s, the kernels' compile): say what runs, and log each search as reproduce_ablations.
    logging.info("simulating %s for comparison (fused-schedule searches of sim.search_time_s="
                 "%gs per distinct pipeline shape, %s; --config.systems= skips them) ...",
                 ", ".join(compared), cfg.sim.search_time_s, search_lib.KERNELS_NOTE)
    cache = training_sim.ScheduleCache(time_budget_s=cfg.sim.search_time_s, seed=cfg.seed,
                                       log=logging.info)
    # The papers' systems run a reference and a reward model whatever the run's algo.kl_coef
    # and reward.kind, and train a critic whatever its algo.estimator (PPO's systems).
    if not wl.trains_critic:
      logging.info("the systems compared are the papers' PPO systems: they train a critic, "
                   "which this run's plan does not")
    try:
      rows, _ = iteration_sim.simulate_iteration(
          cost, dataclasses.replace(wl, reference=True, reward_model=True, trains_critic=True),
          cfg.sim, compared, cache)
    except ValueError as e:
      # The comparison is an extra: a system the inputs cannot time (a calibration measured on
      # 1-device instances timing another system's tp=2) lost the searched plan with it.
      logging.warning("the systems' comparison failed, so the report has none (the plan "
                      "search's results are written; --config.systems= skips it): %s", e)
      rows, systems_error = {}, str(e)
    else:
      logging.info("simulated %s in %.1fs", ", ".join(compared), time.time() - t0)
    systems = {k: {f: float(r[f]) for f in ("gen_plus_inf_s", "train_s", "reshard_s",
                                             "iteration_s")}
               for k, r in rows.items()}
  return systems, systems_error


def _with_predicted_s(entry: Optional[dict]) -> Optional[dict]:
  """A searched plan as result.json records it: its predicted iteration seconds on top."""
  return None if entry is None else {
      **entry, "predicted_iteration_s": entry["predicted"]["iteration_s"]}


def _plan_json_choice(wl, res: dict) -> tuple:
  """(plan, which, asynchronous): the plan plan.json holds, whether it is the "synchronous" or
  the "asynchronous" one, and the asynchronous split's result.json entry (None without one)."""
  plan, which, asynchronous = res["best"], "synchronous", None
  if "async" in res:
    a = res["async"]
    ab = a["best"]
    asynchronous = {**ab["async"], "predicted_iteration_s": ab["predicted"]["iteration_s"],
                    "plan": ab, "top": a["top"], "splits": a["splits"], "search_s": a["search_s"],
                    "colocated_refused": a["colocated_refused"]}
    # (an asynchronous run on the training devices: the split, wherever it beat the
    # synchronous plan run so, plan_json_choice)
    if plan_search.plan_json_choice(wl, res["best"], ab) == "asynchronous":
      plan, which = ab, "asynchronous"
  return plan, which, asynchronous


def _warn_if_trainer_refuses(cfg: ablations.AblationConfig, cost: CostModel, wl, plan: dict,
                             for_trainer: bool) -> None:
  """Logs why train_ppo would refuse plan.json: on any process (a warning) or, `for_trainer`
  (a run's plan), on processes driving fewer devices than the hardware's host (info)."""
  refusal = plan_search.trainer_refusal(wl, plan, cost.hw.host_devices)
  if refusal:
    logging.warning("plan.json (%s) is not one train_ppo runs: %s; "
                    "--config.sim.trainer_runnable=True keeps the search to plans it runs",
                    plan["summary"], refusal)
  elif for_trainer:
    # The run's processes may drive fewer devices than the hardware's host (a local run of
    # launch/local_multiprocess.sh 2 4): train_ppo then refuses the plan at set-up.
    smaller = smaller_hosts_refusing(wl, plan, cost.hw.host_devices)
    if smaller:  # (info, not a warning: most runs drive a whole host a process, and
      # train_ppo's own refusal on smaller processes names the field and the plan file)
      h = next(iter(smaller))
      logging.info(
          "plan.json (%s) was searched for processes of %d devices (the host of "
          "config.hardware=%r), as one process on them all runs it; a multi-process run whose "
          "processes drive %s refuses it (on %d: %s): for such a run "
          "(launch/local_multiprocess.sh N D: D devices a process) search with "
          "--config.devices_per_host=D", plan["summary"], cost.hw.host_devices, cfg.hardware,
          " or ".join(map(str, smaller)) + (" device" if list(smaller) == [1] else " devices"),
          h, smaller[h])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  check_unread_overrides(_CONFIG.value.get("train_config", ""),
                         config_flags.get_override_values(flags.FLAGS["config"]))
  # `systems` "" (none): the plan search alone, without the systems' comparison.
  cfg = ablations.AblationConfig.from_config_dict(_CONFIG.value, systems_optional=True)
  # The checks that need no search come before start_outputs: a refused value left the earlier
  # run's outputs moved to previous/<n> and a config.json of a run that never ran.
  top_k = _CONFIG.value.top_k
  if not isinstance(top_k, int) or top_k < 1:
    raise ValueError(f"config.top_k={top_k!r}: expected an integer >= 1 (plans to report)")
  devices_per_host = _CONFIG.value.get("devices_per_host", 0)
  check_devices_per_host(devices_per_host, cfg.num_devices)
  spec, path, overrides, train_dict, run = _train_inputs(cfg)
  # config.calibration checked before the outputs start, against the actor simulated: the run's
  # (train_run's resolved config: a checkpoint's shape) or the preset pairs'
  actor_params = None if run is None else [shapes.from_model_config(run[1].model,
                                                                    "actor").num_params()]
  cost, accept = with_host(ablations.cost_model(cfg, actor_params), devices_per_host), None
  workdir = _WORKDIR.value
  wd.start_outputs(workdir, _CONFIG.value,
                   ("result.json", "plan.json", "plan_search.md", "lengths"))
  if spec:
    setting, wl, accept = trainer_setting(cfg, path, overrides, train_dict, workdir, run)
    cfg = _with_run_sim_options(cfg, run)
  else:
    setting, wl = _preset_setting(cfg)
  res = plan_search.search(cost, wl, cfg.sim, top_k=top_k, log=logging.info,
                           staleness=cfg.sim.staleness, split_unit=cfg.sim.async_split_unit,
                           accept=accept)
  systems, systems_error = _compare_systems(cfg, cost, wl, res)
  # best None: no synchronous plan fits, only asynchronous splits (plan_search.search)
  best, uniform = _with_predicted_s(res["best"]), _with_predicted_s(res["uniform"])
  plan, which, asynchronous = _plan_json_choice(wl, res)
  if uniform is not None and uniform["predicted_iteration_s"] < plan["predicted"]["iteration_s"]:
    logging.warning("the uniform layout %s (%ss) is predicted faster than plan.json's %s plan "
                    "(%ss), which is the best per-stage combination (plan_search.md)",
                    uniform["layout"], _s(uniform["predicted_iteration_s"]), which,
                    _s(plan["predicted"]["iteration_s"]))
  _warn_if_trainer_refuses(cfg, cost, wl, plan,
                           bool(spec or cfg.sim.trainer_runnable) and not devices_per_host)
  # The hardware's values, not only its name: a file of one's own (--config.hardware=FILE.json)
  # may change after the search.
  hardware = cost.hw.to_dict()
  efficiency = dataclasses.asdict(cost.eff)  # the assumed MFUs and bandwidth fractions
  # what a calibration file measured (its ops replace the formulas), None without one
  calibration = cost.cal.describe() if cost.cal is not None else None
  # The workload it was searched for: train_ppo warns when a run's differs.
  record = plan_search.workload_record(wl, spec, cfg.sim, plan)
  # A run's plan: its KV cache as the trainer allocates it (as the search sized it: accept).
  memory = plan_search.plan_memory(cost, plan_search.trainer_workload(wl) if spec else wl,
                                   cfg.sim, plan)
  wd.write_json(os.path.join(workdir, "plan.json"),
                {**plan, "hardware": hardware, "workload": record})
  runner.write_result(workdir, {
      "setting": setting, "hardware": hardware, "best": best, "top": res["top"], "uniform": uniform,
      "async": asynchronous, "plan_json": which, "stages": res["stages"],
      "rejected": res["rejected"], "refused": res["refused"], "systems": systems,
      **({"systems_error": systems_error} if systems_error else {}),
      **({"async_error": res["async_error"]} if "async_error" in res else {}),
      "search_s": res["search_s"], "efficiency": efficiency, "calibration": calibration,
      "plan_memory": memory})
  wd.atomic_write_text(os.path.join(workdir, "plan_search.md"), "\n".join(
      report(res, systems, setting, (hardware, efficiency, calibration),
             (memory, which, cost.hw.hbm_bytes))))
  logging.info("best %s (%s); uniform %s; async %s; plan.json %s; searched in %.1fs in all "
               "-> %s",
               f"{_s(best['predicted_iteration_s'])}s" if best else "none",
               res["best"]["summary"] if best else "no synchronous plan fits",
               f"{_s(uniform['predicted_iteration_s'])}s" if uniform else "none",
               f"{_s(asynchronous['predicted_iteration_s'])}s ({asynchronous['plan']['summary']})"
               if asynchronous else "none (no split fits)" if "async_error" in res else "off",
               which, res["search_s"],
               os.path.join(workdir, "plan_search.md"))


if __name__ == "__main__":
  config_files.run(main)
