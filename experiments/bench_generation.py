r"""Benchmark of inter-stage fusion: generation + inference of one batch, without and with fusion.

  python -m experiments.bench_generation --config=configs/bench_generation.py --workdir=/tmp/bg

Both modes run on the same generation instances (AOT-compiled once at start-up), the same
prompts, lengths and sampling key:
  baseline  every instance decodes until its samples finish; inference (reference log-probs,
            critic values, reward-model scores) starts when the last sample finished;
  fused     long-tail consolidation (Rt: fixed or chosen by simulation over the length
            histogram) with KV migration, and streaming inference on the freed instances.
Long-tailed lengths: each sample's response budget is drawn from `config.lengths` and there is no
EOS token, so a sample stops exactly at its budget; the budget is part of the sample's own stop
condition and moves with it (generation/instances.py), so both modes see the same tail.

Writes into the workdir: config.json; result.json (identical_outputs, baseline / fused with
gen_plus_inf_s, wall_s, instance_busy_frac, ..., ratio, the per-sample prompt and response
lengths, and `timelines`: what the PNGs draw); timeline_baseline.png and timeline_fused.png
(unfinished samples over time and each instance's prefill / decode / migrate / load /
inference activity; white = idle; `redraw(WORKDIR)` draws them again from result.json);
calibration.json (the engine's measured costs in the simulator's calibration format);
outputs.npz (the first baseline run's tokens, log-probs and inference outputs).

Several processes (--distributed; launch/local_multiprocess.sh with BINARY=bench_generation):
every process drives the instances on its devices (generation/multihost.py); process 0 writes
the files, the fused migrations split into same-host and cross-host (count, bytes, seconds).
On CPU devices process 0 then also runs the same command as one process with all the devices
(--single_process_reference, in WORKDIR/single_process) and compares its outputs with the
distributed run's: `identical_outputs` covers both.

With `generation.pipeline_stages` set (`--config=configs/bench_generation.py:pipelined`) it
benchmarks delayed inter-batch pipelined generation instead (`run_pipelined`): result.json has
identical_outputs (tokens, lengths, stop reasons and log-probs bitwise equal to the non-pipelined
Generator), `pipelined` (stage_busy_frac counted from the tick table the program executed, ticks
next to the formula's, timings) and `reference` (the Generator's timings); schedule_pipelined.png
shows the executed tick table.

Docs: docs/results.md ("Inter-stage fusion"), docs/architecture.md §2.
"""
from __future__ import annotations

import os
import subprocess
import sys

from rlhfuse_jax.parallel.host_devices import host_device_env, request_host_devices

request_host_devices(8)  # before the first jax import

import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import config_files  # noqa: E402
from experiments import runner  # noqa: E402
from rlhfuse_jax import workdir as wd  # noqa: E402
from rlhfuse_jax.generation import fused as fused_lib  # noqa: E402
from rlhfuse_jax.generation import measure  # noqa: E402
from rlhfuse_jax.generation import instances as instances_lib  # noqa: E402
from rlhfuse_jax.generation import pipelined as pipelined_lib  # noqa: E402
from rlhfuse_jax.generation import timeline as timeline_lib  # noqa: E402
from rlhfuse_jax.generation.instances import FrozenModels  # noqa: E402
from rlhfuse_jax.generation.sampling import SamplingConfig  # noqa: E402
from rlhfuse_jax.models import llama  # noqa: E402
from rlhfuse_jax.parallel import distributed  # noqa: E402
from rlhfuse_jax.sim import lengths as lengths_lib  # noqa: E402
from rlhfuse_jax.sim import plots  # noqa: E402
from rlhfuse_jax.trainer import config as config_lib  # noqa: E402
from rlhfuse_jax.trainer import rt_auto  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")


def define_start_flags() -> None:
  """--distributed, --coordinator_address, --num_processes, --process_id: train_ppo's names,
  so they are defined only when this file runs as the binary (a process that imports both
  modules, as the tests do, would otherwise define them twice); main reads flags.FLAGS."""
  flags.DEFINE_bool("distributed", False,
                    "Call jax.distributed.initialize (multi-host; see launch/).")
  flags.DEFINE_string("coordinator_address", "",
                      "host:port of process 0; empty: auto-detect (SLURM, TPU).")
  flags.DEFINE_integer("num_processes", 0, "0: auto-detect.")
  flags.DEFINE_integer("process_id", None, "This process's index.")
  distributed.check_start_flags()


_REFERENCE = flags.DEFINE_bool(
    "single_process_reference", True, "With --distributed on CPU devices: process 0 reruns the "
    "bench as one process with all the devices and compares the outputs.")
flags.mark_flags_as_required(["config", "workdir"])
# The flags the single-process reference run does not get (it is one process, elsewhere).
_DISTRIBUTED_FLAGS = ("--distributed", "--nodistributed", "--coordinator_address",
                      "--num_processes", "--process_id", "--workdir", "--single_process_reference",
                      "--nosingle_process_reference")

# Log-probs of the two modes must agree to this (they are bitwise equal when the instances share
# one shape class, which the engine enforces; the tolerance is the definition).
LOGPROB_ATOL = 1e-6


def random_params(cfg: llama.ModelConfig, seed: int):
  """Random weights drawn on the host (flax's initialisers would cost a compile per model)."""
  return llama.host_random_params(cfg, seed, std=0.05)


def make_batch(c, seed: int):
  """Prompts [B, P], prompt lengths [B] and response budgets [B] (long-tailed)."""
  g = c.generation
  rng = np.random.default_rng([seed, 1])
  b, p = c.batch_size, g.prompt_len
  plens = rng.integers(g.prompt_min_len, p + 1, b).astype(np.int32)  # [B]
  tokens = rng.integers(1, c.model.vocab_size, (b, p)).astype(np.int32)  # [B, P]
  tokens[np.arange(p)[None, :] >= plens[:, None]] = 0  # right padding (pad_id 0)
  spec = length_spec(c)
  budgets = spec.sample(np.random.default_rng([seed, 2]), b).astype(np.int32)  # [B]
  return tokens, plens, budgets, spec


def length_spec(c) -> lengths_lib.LengthSpec:
  """The response budgets' distribution of `config.lengths` (max_len: max_new_tokens)."""
  return lengths_lib.LengthSpec(kind=c.lengths.kind, max_len=c.generation.max_new_tokens,
                                min_len=c.lengths.min_len, median=c.lengths.median,
                                sigma=c.lengths.sigma, alpha=c.lengths.alpha,
                                value=c.lengths.value, path=c.lengths.path)


def check_inputs(c) -> None:
  """What make_batch and the fused generator's config read, checked before the earlier run's
  outputs are moved aside and before anything compiles (a bad prompt length or lengths file
  otherwise failed after the compiles, minutes on a large model, as numpy's "low >= high" or a
  FileNotFoundError traceback)."""
  g = c.generation
  config_files.check_int("generation.prompt_len", g.prompt_len)
  # (before the lengths, whose maximum it is: "config.lengths: ... max_len=0" named neither)
  config_files.check_int("generation.max_new_tokens", g.max_new_tokens)
  if (isinstance(g.prompt_min_len, bool) or not isinstance(g.prompt_min_len, int) or
      not 1 <= g.prompt_min_len <= g.prompt_len):
    raise ValueError(f"config.generation.prompt_min_len={g.prompt_min_len!r}: expected an "
                     f"integer in [1, generation.prompt_len={g.prompt_len}] (prompt lengths are "
                     "drawn uniformly between them)")
  if c.model.vocab_size < 2:
    raise ValueError(f"config.model.vocab_size={c.model.vocab_size}: expected >= 2 (token 0 "
                     "pads the prompts)")
  try:
    length_spec(c).sample(np.random.default_rng(0), 1)  # an empirical file is read here
  except (ValueError, FileNotFoundError) as e:
    raise ValueError(f"config.lengths: {e}") from None
  try:
    model = llama.ModelConfig(**c.model.to_dict())
  except ValueError as e:
    # Its checks say "model.<field>": every field they name, as the command line spells it.
    raise ValueError(config_lib.model_fields_named(str(e), "model")) from None
  need = g.prompt_len + g.max_new_tokens
  if need > model.max_seq_len:
    raise ValueError(f"config.generation.prompt_len + config.generation.max_new_tokens = {need} "
                     f"exceeds config.model.max_seq_len={model.max_seq_len}: a prompt and its "
                     "response must fit the model's context (raise the one or lower the others)")
  if not c.generation.get("pipeline_stages"):
    # e.g. generation.slots=0, or too few slots for the batch, named by its field (the second
    # was found by the generator, after the earlier run's outputs had moved aside)
    fused_lib.check_layout(fused_config(c, jax.device_count()), c.batch_size,
                           jax.device_count())
  # The sampling settings (a temperature of -1 moved the earlier outputs aside, then failed)
  # and the warm-up count (-1 ran none: the first timed batch compiled, its ratio 0.32 vs 0.81).
  try:
    SamplingConfig(temperature=g.temperature, max_new_tokens=g.max_new_tokens, eos_id=-1,
                   pad_id=0, chunk_size=g.chunk_size)
  except ValueError as e:
    raise ValueError(f"config.generation: {e}") from None
  config_files.check_int("warmup", c.warmup, 0)
  config_files.check_int("seed", c.seed, 0)  # (numpy's default_rng refuses a negative one)


def summarize(out: fused_lib.FusedOutput, wall_s: float) -> dict:
  m = out.metrics
  cores = os.cpu_count() or 1
  # The stage times of every process, as the trainer's timing_s/* (until 2026-12-07 process 0's
  # timeline's, which ends before a process that scores longer).
  return {"gen_plus_inf_s": m["timing_s/gen_plus_inf"], "wall_s": wall_s,
          "gen_s": m["timing_s/generate"],
          # Process CPU seconds (all threads) and their share of wall x cores: how much of the
          # machine the run kept busy (on fake CPU devices, the one place fusion can win).
          "cpu_s": m["cpu_s"], "cpu_util": m["cpu_s"] / (wall_s * cores),
          "inference_exposed_s": m["timing_s/inference"],
          # Over every process's instances, as the trainer's gen/instance_busy_frac and
          # fusion/inference_overlap_frac (until 2026-12-07 process 0's alone, as the weight
          # loads below); each process's (loaded before generation ended, inference seconds
          # before it ended, all inference seconds) beside it.
          "instance_busy_frac": m["gen/instance_busy_frac"],
          "inference_overlap_frac": m["fusion/inference_overlap_frac"],
          "inference_overlap_by_process": out.overlap_figures,
          "consolidation_step": m["gen/consolidation_step"],
          "migrated_samples": m["gen/migrated_samples"],
          "migrated_kv_bytes": m["gen/migrated_kv_bytes"],
          "migration_copied_bytes": m["gen/migration_copied_bytes"],
          "migration_s": m["gen/migration_s"],
          # Several processes: same-host migrations (gather, device_put, scatter: the span of
          # their copies) and cross-host ones (one collective each: the wait for them).
          "same_host_migrated_samples": (m["gen/migrated_samples"] -
                                         m["gen/migrated_samples_cross_host"]),
          "same_host_migrated_bytes": (m["gen/migration_copied_bytes"] -
                                       m["gen/migration_cross_host_bytes"]),
          "same_host_migration_s": m["gen/migration_same_host_s"],
          "cross_host_migrated_samples": m["gen/migrated_samples_cross_host"],
          "cross_host_migrated_bytes": m["gen/migration_cross_host_bytes"],
          "cross_host_migration_s": m["gen/migration_cross_host_s"],
          "cross_host_compile_s": m["gen/migration_cross_host_compile_s"],
          "weight_load_s": m["fusion/weight_load_s"],
          "weight_load_bytes": m["fusion/weight_load_bytes"],
          "actor_to_instances_s": m["timing_s/actor_to_instances"],
          "decode_rounds": m["gen/decode_rounds"], "instance_chunks": m["gen/instance_chunks"],
          "rt": out.rt,
          "consolidations": out.consolidations,
          "unfinished_curve": m["gen/unfinished_curve"]}


def output_arrays(out: fused_lib.FusedOutput) -> dict:
  """What `compare` compares (and outputs.npz holds): {name: host array}."""
  r = out.rollout
  arrays = {"response_tokens": r.response_tokens, "response_lens": r.response_lens,
            "logprobs": r.logprobs}
  for name in ("ref_logp", "values", "rewards"):
    if getattr(out, name) is not None:
      arrays[name] = getattr(out, name)
  return arrays


def compare(a, b) -> dict:
  """Tokens bitwise; log-probs and inference outputs to LOGPROB_ATOL (max differences kept).
  a, b: FusedOutputs or their `output_arrays`."""
  a, b = (x if isinstance(x, dict) else output_arrays(x) for x in (a, b))
  out = {"tokens_equal": bool(np.array_equal(a["response_tokens"], b["response_tokens"]) and
                              np.array_equal(a["response_lens"], b["response_lens"])),
         "logprobs_max_abs_diff": float(np.max(np.abs(a["logprobs"] - b["logprobs"])))}
  for name in ("ref_logp", "values", "rewards"):
    if name in a:
      out[f"{name}_max_abs_diff"] = float(np.max(np.abs(a[name] - b[name])))
  out["identical"] = out["tokens_equal"] and all(
      v <= LOGPROB_ATOL for k, v in out.items() if k.endswith("max_abs_diff"))
  return out


def fused_config(c, num_devices: int) -> fused_lib.FusedGenConfig:
  """The fused generator's config of `c` on `num_devices` devices (its fields checked, named
  under config.generation)."""
  g = c.generation
  num_instances = g.num_instances
  if not num_instances:  # automatic: devices / instance_devices
    # Checked here: 0 divided by zero, and one wider than the devices was reported as
    # "config.generation.num_instances=0: expected an integer >= 1", its automatic value.
    w = g.instance_devices
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
      raise ValueError(f"config.generation.instance_devices={w!r}: expected an integer >= 1")
    num_instances = num_devices // w
    if num_instances < 1:
      raise ValueError(f"config.generation.instance_devices={w} exceeds the {num_devices} "
                       "devices")
  # The fields train_ppo's config.fusion shares (FusionFields), read by name: a field added
  # there reaches the bench without a list to extend here (a config without it: its default).
  shared = {f.name: g.get(f.name, f.default) for f in dataclasses.fields(fused_lib.FusionFields)}
  return fused_lib.FusedGenConfig(**{**shared, "num_instances": num_instances},
                                  inference_inflight=g.inference_inflight, section="generation")


def run(c, workdir: str) -> dict:
  g = c.generation
  cfg = llama.ModelConfig(**c.model.to_dict())
  score_cfg = cfg.replace(head="scalar")
  frozen = FrozenModels(reference=cfg, critic=score_cfg if c.critic else None,
                        reward=score_cfg if c.reward_model else None, temperature=g.temperature)
  actor = random_params(cfg, c.seed)
  host = {"reference": actor}  # the reference is the initial actor; frozen: host memory
  if c.critic:
    host["critic"] = random_params(score_cfg, c.seed + 1)
  if c.reward_model:
    host["reward"] = random_params(score_cfg, c.seed + 2)
  devices = jax.devices()
  config = fused_config(c, len(devices))
  num_instances = config.num_instances
  sampling = SamplingConfig(temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                            eos_id=-1, pad_id=0, chunk_size=g.chunk_size)
  t0 = time.perf_counter()
  gen = fused_lib.FusedGenerator(cfg, sampling, config, batch_size=c.batch_size,
                                 prompt_len=g.prompt_len, frozen=frozen, actor_params=actor,
                                 frozen_params=host, devices=devices,
                                 rt_model=rt_auto.simulated_rt_model)
  compile_s = time.perf_counter() - t0
  n_exe = sum(i.num_executables for i in gen.instances)
  logging.info("%d instances x %d device(s), %d slots each: %d executables compiled in %.1fs",
               num_instances, g.instance_devices, g.slots, n_exe, compile_s)
  # The actor lives on the first instance's devices, as a trainer's would on its mesh (several
  # processes: this process's first instance).
  actor = gen.instances[gen.local[0]].place(cfg, actor)
  key = jax.random.key(c.seed)

  for w in range(c.warmup):  # another batch: warms every path, fills the length histogram
    wt, wp, wb, _ = make_batch(c, c.seed + 1000 + w)
    for fuse in (False, True):  # (the same responses twice: their lengths observed once)
      gen.run(actor, host, wt, wp, jax.random.fold_in(key, 1000 + w), budgets=wb, fuse=fuse,
              observe=fuse)
  tokens, plens, budgets, spec = make_batch(c, c.seed)
  if gen.calibration is None:
    gen.calibration = measure.measure_costs(gen, actor, host)
  main_process = distributed.is_main_process()
  if main_process:
    runner.write_result(workdir, gen.calibration, "calibration.json")
  rt, choice = gen.choose_rt(plens)  # once for all timed runs: the histogram of the warm-up
  logging.info("Rt = %.3g (%s)", rt, choice.reason if choice else "fixed in the config")

  runs = {"baseline": [], "fused": []}
  # The order alternates (baseline first in even repeats), so the one that runs second in a
  # repeat, on a machine its partner has just warmed or loaded, is not always the same mode.
  orders = [("baseline", "fused") if r % 2 == 0 else ("fused", "baseline")
            for r in range(c.repeats)]
  for r, order in enumerate(orders):
    for mode in order:
      t0, cpu0 = time.perf_counter(), time.process_time()
      out = gen.run(actor, host, tokens, plens, key, budgets=budgets, fuse=mode == "fused",
                    rt=rt)
      wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
      out.metrics["cpu_s"] = cpu  # this process's CPU time, every thread
      runs[mode].append((out, wall))
      logging.info("repeat %d %-8s gen+inf %.3fs (generation %.3fs), migrated %d samples",
                   r, mode, out.metrics["timing_s/gen_plus_inf"],
                   out.metrics["timing_s/generate"],
                   out.metrics["gen/migrated_samples"])
  # Every run of both modes against the first baseline run; the worst differences are kept.
  checks = [compare(runs["baseline"][0][0], o) for m in runs for o, _ in runs[m]]
  worst = {k: max(ch[k] for ch in checks) for k in checks[0] if k.endswith("max_abs_diff")}
  result = {"identical_outputs": all(ch["identical"] for ch in checks),
            "identity": {"tokens_equal": all(ch["tokens_equal"] for ch in checks),
                         "logprob_atol": LOGPROB_ATOL, **worst}}
  medians = {mode: _median_run(rs, key=lambda run: run[0].metrics["timing_s/gen_plus_inf"])
             for mode, rs in runs.items()}
  # The two figures on one time axis (they are compared side by side; each ended at its own run)
  t_max = max(out.timeline.gen_plus_inf_s for out, _ in medians.values())
  # Several processes: each process's timeline holds its own instances; the curve of unfinished
  # samples and the generation's end are the whole batch's.
  note = (f"process 0's instances only (of {jax.process_count()} processes); the unfinished "
          "samples: all processes'" if jax.process_count() > 1 else "")
  # What the timeline PNGs draw, kept in result.json (redraw: plot_timelines)
  result["timelines"] = {"t_max_s": t_max, "note": note, "panels": {}}
  for mode, rs in runs.items():
    times = [o.metrics["timing_s/gen_plus_inf"] for o, _ in rs]
    out, wall = medians[mode]
    result[mode] = summarize(out, wall)
    result[mode]["runs_gen_plus_inf_s"] = times
    result["timelines"]["panels"][mode] = {"title": f"{mode} (median of {len(times)} runs)",
                                           "timeline": out.timeline.to_json()}
  if main_process:
    plot_timelines(result, workdir)
  result["ratio"] = result["fused"]["gen_plus_inf_s"] / result["baseline"]["gen_plus_inf_s"]
  # Each repeat ran the two modes back to back: their ratio cancels slow drifts of the machine.
  paired = [f.metrics["timing_s/gen_plus_inf"] / b.metrics["timing_s/gen_plus_inf"]
            for (b, _), (f, _) in zip(runs["baseline"], runs["fused"])]
  result["ratio_paired"] = {"median": float(np.median(paired)), "runs": paired}
  result["order"] = [list(o) for o in orders]
  result["migration_threshold"] = rt
  result["rt_choice"] = ({"reason": choice.reason, "simulated_gen_plus_inf_s": choice.simulated_s}
                         if choice else {"reason": "fixed in the config"})
  result.update({
      "num_instances": num_instances, "slots": g.slots, "instance_devices": g.instance_devices,
      "device": f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind})",
      "processes": jax.process_count(),
      "startup": {"compile_s": compile_s, "executables": n_exe},
      "lengths": {"spec": spec.describe(), **lengths_lib.summarize(budgets, g.max_new_tokens)},
      "prompt_lens": plens, "response_lens": runs["fused"][0][0].rollout.response_lens,
  })
  if main_process:
    np.savez(os.path.join(workdir, "outputs.npz"), **output_arrays(runs["baseline"][0][0]))
  return result


def plot_timelines(result: dict, workdir: str) -> list[str]:
  """timeline_<mode>.png of each mode, drawn from `result`'s own data (result.json's
  `timelines`: each panel's title and measured Timeline, the shared time axis's end and the
  note), so a kept result is drawn again, restyled or compared without running the bench.
  Returns the paths written."""
  spec = result["timelines"]
  paths = []
  for mode, panel in spec["panels"].items():
    path = os.path.join(workdir, f"timeline_{mode}.png")
    plots.plot_generation_timelines(
        [(panel["title"], timeline_lib.Timeline.from_json(panel["timeline"]))], path,
        t_max=spec["t_max_s"], note=spec["note"])
    paths.append(path)
  return paths


def redraw(workdir: str) -> list[str]:
  """The PNGs of a finished run in `workdir`, drawn again from its result.json alone (the
  timelines; a pipelined run's schedule_pipelined.png). Returns the paths written."""
  path = os.path.join(workdir, "result.json")
  result = wd.read_result(workdir, "bench_generation")
  if "pipelined" in result:
    return [plot_schedule(result, workdir)]
  if "timelines" not in result:
    raise ValueError(f"{path}: no `timelines` (a bench_generation result written before "
                     "2026-12-07 does not keep what its PNGs draw)")
  return plot_timelines(result, workdir)


def run_and_write(c, workdir: str, reference=None) -> dict:
  """Runs the benchmark and writes config.json, result.json, the PNGs and calibration.json
  (process 0). `reference(workdir)`: {name: array} of a reference run to compare with (and
  fold into identical_outputs), run on process 0 after the processes have shut down."""
  config_files.check_ints(c, ("repeats", "batch_size"))
  check_inputs(c)
  main_process = distributed.is_main_process()
  pipelined = bool(c.generation.get("pipeline_stages"))
  if pipelined and jax.process_count() > 1:
    # (launch/local_multiprocess.sh passes --distributed itself: "drop --distributed" was no
    # way out there)
    raise ValueError(f"config.generation.pipeline_stages={c.generation.pipeline_stages}: "
                     f"expected 0 with {jax.process_count()} processes (the pipelined variant "
                     "runs in one process): run it as one process, python -m experiments."
                     "bench_generation without --distributed, not through "
                     "launch/local_multiprocess.sh")
  # Process 0 alone moves the earlier outputs aside; if that fails (another run's workdir, a
  # full disk) every process stops here, not process 0 alone while the others compile on.
  distributed.run_on_main_process(lambda: wd.start_outputs(workdir, c, (
      "result.json", "calibration.json", "outputs.npz", "timeline_*.png",
      "schedule_pipelined.png", "single_process", "single_process.log")),
      f"process 0 could not prepare the workdir {workdir} (its log says why)")
  result = run_pipelined(c, workdir) if pipelined else run(c, workdir)
  if jax.process_count() > 1:
    jax.distributed.shutdown()  # the other processes are done: they exit now
  if main_process and reference is not None:
    ref = compare(reference(workdir), dict(np.load(os.path.join(workdir, "outputs.npz"))))
    result["single_process_reference"] = ref
    result["identical_outputs"] = result["identical_outputs"] and ref["identical"]
  if main_process:
    runner.write_result(workdir, result)
  return result


# Delayed inter-batch pipelined generation (docs/architecture.md §4) ------------------------------

def _median_run(runs, key=lambda run: run[1]):
  """The (rollout, wall seconds) of the median run (upper median) by `key` of each run: its
  wall time by default."""
  return runs[int(np.argsort([key(run) for run in runs], kind="stable")[len(runs) // 2])]


def plot_tick_table(table: np.ndarray, groups: int, path: str) -> None:
  """The executed decode tick table: one row per stage, a colour per group, white = idle."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  ticks, stages = table.shape
  img = np.ma.masked_equal(table.T.astype(float), pipelined_lib.IDLE)
  # at least 8 in wide: the title (4.7 in at 32 ticks cut it off)
  fig, ax = plt.subplots(figsize=(max(8.0, min(20, 2 + ticks / 12)), 1.2 + 0.5 * stages))
  # tab20's 20 colours, a continuous map for more groups (tab20 resampled to 24 gave groups 0
  # and 1, 7 and 8, ... one colour, drawn as one block twice as wide)
  cmap = plt.get_cmap("tab20" if groups <= 20 else "turbo",
                      max(groups, 2)).with_extremes(bad="white")
  image = ax.imshow(img, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5,
                    vmax=max(groups, 2) - 0.5)
  # the colour key; whole groups, as many labels as fit (24 overlapped into one stack)
  bar = fig.colorbar(image, ax=ax, label="group", pad=0.01)
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  bar.locator = MaxNLocator(integer=True, nbins=max(2, int(2 + 2 * stages)))
  bar.update_ticks()
  ax.set_xlabel("decode tick")
  ax.set_ylabel("stage")
  ax.set_yticks(range(stages))
  ax.set_title(f"executed decode ticks: {stages} stages, {groups} groups (colour = group)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run_pipelined(c, workdir: str) -> dict:
  """Pipelined generation against the non-pipelined Generator: same prompts, budgets, uids and
  key. The Generator runs on a data-parallel mesh of G devices, B/G rows each: the per-device
  shapes of a pipeline stage, so log-probs can be compared bitwise (pipelined.reference_mesh)."""
  g = c.generation
  cfg = llama.ModelConfig(**c.model.to_dict())
  sampling = SamplingConfig(temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                            eos_id=-1, pad_id=0, chunk_size=g.chunk_size)
  stages, groups, b = g.pipeline_stages, g.pipeline_groups, c.batch_size
  params = random_params(cfg, c.seed)
  devices = jax.devices()
  t0 = time.perf_counter()
  gen = pipelined_lib.PipelinedGenerator(cfg, sampling, batch_size=b, prompt_len=g.prompt_len,
                                         stages=stages, groups=groups, devices=devices)
  staged = gen.place(params)
  gen.compile(staged)
  compile_s = time.perf_counter() - t0
  mesh = pipelined_lib.reference_mesh(devices, b, groups)
  ref_params = jax.device_put(params, jax.sharding.NamedSharding(mesh,
                                                                 jax.sharding.PartitionSpec()))
  t0 = time.perf_counter()
  ref = instances_lib.Generator(cfg, sampling, batch_size=b, prompt_len=g.prompt_len, mesh=mesh,
                                params=ref_params)
  ref_compile_s = time.perf_counter() - t0
  logging.info("pipeline: %d stages x %d groups of %d rows; compiled in %.1fs (reference "
               "Generator on %d devices: %.1fs)", stages, groups, gen.bg, compile_s, groups,
               ref_compile_s)
  key = jax.random.key(c.seed)
  for w in range(c.warmup):
    wt, wp, wb, _ = make_batch(c, c.seed + 1000 + w)
    gen.generate(staged, wt, wp, jax.random.fold_in(key, 1000 + w), budgets=wb)
    ref.generate(ref_params, wt, wp, jax.random.fold_in(key, 1000 + w), budgets=wb)
  tokens, plens, budgets, spec = make_batch(c, c.seed)
  runs = {"pipelined": [], "reference": []}
  for r in range(c.repeats):  # interleaved, so slow drifts of the machine hit both alike
    for mode, fn, prm in (("pipelined", gen.generate, staged),
                          ("reference", ref.generate, ref_params)):
      t0 = time.perf_counter()
      out = fn(prm, tokens, plens, key, budgets=budgets)
      runs[mode].append((out, time.perf_counter() - t0))
      logging.info("repeat %d %-9s %.3fs (prefill %.3fs, decode %.3fs)", r, mode,
                   runs[mode][-1][1], out.prefill_s, out.decode_s)
  base = runs["reference"][0][0]
  fields = ("response_tokens", "response_lens", "stop_reason", "logprobs")
  checks = [{f: bool(np.array_equal(getattr(o, f), getattr(base, f))) for f in fields}
            for m in runs for o, _ in runs[m]]
  diff = max(float(np.max(np.abs(o.logprobs - base.logprobs))) for m in runs for o, _ in runs[m])
  result = {"identical_outputs": all(all(ch.values()) for ch in checks),
            "identity": {"criterion": "bitwise (tokens, lengths, stop reasons, log-probs)",
                         **{f: all(ch[f] for ch in checks) for f in fields},
                         "logprobs_max_abs_diff": diff}}
  for mode, rs in runs.items():
    out, wall = _median_run(rs)
    result[mode] = {"wall_s": wall, "prefill_s": out.prefill_s, "decode_s": out.decode_s,
                    "generate_s": out.generate_s, "decode_steps": out.decode_steps,
                    "decode_chunks": out.decode_chunks,
                    "decode_tokens_per_s": float(np.sum(out.response_lens - 1)) / out.decode_s,
                    "runs_wall_s": [w for _, w in rs]}
  out = _median_run(runs["pipelined"])[0]
  report = pipelined_lib.schedule_report(gen, out)
  result["pipelined"].update(report)
  result["pipelined"]["compile_s"] = compile_s
  result["pipelined"]["prefill_ticks"] = int(len(out.prefill_table))
  result["reference"].update({"compile_s": ref_compile_s,
                              "mesh": f"data={groups} ({gen.bg} rows per device)"})
  # Plain pipelining of one batch: every tick one stage of pp works (a formula, not measured).
  result["plain_pipeline_busy_frac"] = 1.0 / stages
  result.update({
      "stages": stages, "groups": groups, "rows_per_group": gen.bg,
      "device": f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind})",
      "lengths": {"spec": spec.describe(), **lengths_lib.summarize(budgets, g.max_new_tokens)},
      "prompt_lens": plens, "response_lens": out.response_lens,
      "decode_table": out.decode_table.T})
  plot_schedule(result, workdir)
  return result


def plot_schedule(result: dict, workdir: str) -> str:
  """A pipelined run's schedule_pipelined.png, drawn from `result`'s own decode_table and
  groups (as `redraw` draws it again from result.json); returns its path."""
  path = os.path.join(workdir, "schedule_pipelined.png")
  # result keeps the table as [stages][ticks]; the plot takes [ticks, stages]
  plot_tick_table(np.asarray(result["decode_table"]).T, result["groups"], path)
  return path


def log_pipelined(result: dict, workdir: str) -> None:
  p, r = result["pipelined"], result["reference"]
  logging.info("identical outputs: %s; %d stages x %d groups: stage_busy_frac %.3f (steady "
               "%.3f; plain pipeline %.3f), %d ticks (formula %d, busy %d = %d); generate "
               "%.3fs pipelined, %.3fs reference", result["identical_outputs"], result["stages"],
               result["groups"], p["stage_busy_frac"], p["stage_busy_frac_steady"],
               result["plain_pipeline_busy_frac"], p["ticks"], p["formula"]["executed_ticks"],
               p["busy_stage_ticks"], p["formula"]["busy_stage_ticks"], p["generate_s"],
               r["generate_s"])
  logging.info("wrote %s", os.path.join(workdir, "result.json"))


def single_process_reference(workdir: str) -> dict:
  """This command as one process with every device of the distributed run (fake CPU
  devices), in workdir/single_process; returns its outputs.npz."""
  ref_dir = os.path.join(workdir, "single_process")
  args = [a for a in sys.argv[1:] if not a.split("=")[0] in _DISTRIBUTED_FLAGS]
  env = dict(os.environ, JAX_PLATFORMS="cpu", **host_device_env(jax.device_count()))
  logging.info("single-process reference: %d devices, in %s ...", jax.device_count(), ref_dir)
  with open(os.path.join(workdir, "single_process.log"), "w") as log:
    subprocess.run([sys.executable, "-m", "experiments.bench_generation", *args,
                    f"--workdir={ref_dir}"], env=env, stdout=log, stderr=subprocess.STDOUT,
                   check=True)
  return dict(np.load(os.path.join(ref_dir, "outputs.npz")))


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  workdir = _WORKDIR.value
  reference = None
  f = flags.FLAGS
  if f.distributed:
    distributed.initialize(f.coordinator_address, f.num_processes, f.process_id)
    if _REFERENCE.value and jax.process_count() > 1 and jax.default_backend() == "cpu":
      reference = single_process_reference
  result = run_and_write(_CONFIG.value, workdir, reference)
  if not distributed.is_main_process():
    return
  if "pipelined" in result:
    return log_pipelined(result, workdir)
  b, f = result["baseline"], result["fused"]
  paired = result["ratio_paired"]["runs"]
  logging.info("identical outputs: %s; gen+inf baseline %.3fs, fused %.3fs (medians of %d "
               "runs): ratio %.3f (paired median %.3f, runs %.3f-%.3f); fused migrated %d "
               "samples (%d KV bytes held, %d bytes copied; %d across hosts: %d bytes, %.4fs) "
               "%s",
               result["identical_outputs"], b["gen_plus_inf_s"], f["gen_plus_inf_s"],
               len(paired), result["ratio"], result["ratio_paired"]["median"], min(paired),
               max(paired), f["migrated_samples"],
               f["migrated_kv_bytes"], f["migration_copied_bytes"],
               f["cross_host_migrated_samples"], f["cross_host_migrated_bytes"],
               f["cross_host_migration_s"],
               f"at step {f['consolidation_step']}" if f["consolidation_step"] >= 0 else
               "(no consolidation: the tail never fell below Rt)")
  logging.info("wrote %s (+ calibration.json, outputs.npz, timeline PNGs)",
               os.path.join(workdir, "result.json"))


if __name__ == "__main__":
  define_start_flags()
  config_files.run(main)
