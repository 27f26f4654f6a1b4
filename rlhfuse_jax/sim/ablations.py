"""The ablation grid: settings x systems through the iteration simulator, with every input kept.

`AblationConfig` is the typed form of `configs/ablations.py` (converted once, validated with
field names); `run_ablations` simulates every setting (actor/critic pair x max generation length)
for every system and returns the result rows plus everything the report and figures need.
Fused-schedule searches are cached per pipeline problem, so a shape is searched once.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional, Sequence

from rlhfuse_jax.models.hf_config import scalar_actor_error
from rlhfuse_jax.policy import calibration as cal_lib
from rlhfuse_jax.sim import iteration_sim as it
from rlhfuse_jax.sim import lengths as len_lib
from rlhfuse_jax.sim import training_sim as train_lib
from rlhfuse_jax.sim.cost_model import CostModel, Efficiency
from rlhfuse_jax.sim.hardware import HARDWARE, get_hardware
from rlhfuse_jax.sim.shapes import PRESET_SOURCE, ModelShape, from_hf_config, get_shape


def _csv(value: Any, field: str) -> tuple[str, ...]:
  items = tuple(x.strip() for x in str(value).split(",") if x.strip())
  if not items:
    raise ValueError(f"config.{field}={value!r} must list at least one item")
  return items


def _csv_ints(value: Any, field: str) -> tuple[int, ...]:
  """A comma-separated list of positive integers; the error names the field."""
  items = _csv(value, field)
  if not all(x.isdigit() and int(x) > 0 for x in items):
    raise ValueError(f"config.{field}={value!r}: expected comma-separated positive integers, "
                     "e.g. '512,1024'")
  return tuple(int(x) for x in items)


@dataclasses.dataclass(frozen=True)
class AblationConfig:
  """Typed ablation config (field meanings in configs/ablations.py)."""
  hardware: str = "h100_sxm"
  num_devices: int = 256
  global_batch: int = 512
  minibatch: int = 64
  epochs: int = 1
  micro_batch: int = 1
  pairs: tuple[tuple[str, str], ...] = (("llama-13b", "llama-13b"),)
  # Shapes of one's own, by name, for `pairs`: (name, ModelShape) from HF config.json files.
  shapes: tuple = ()
  # (name, path) of each of `shapes` read from a file (config.shapes), for the reports' sources
  shape_files: tuple = ()
  max_new_tokens: tuple[int, ...] = (1024,)
  systems: tuple[str, ...] = it.SYSTEMS
  seed: int = 0
  prompt: len_lib.LengthSpec = it.Workload.__dataclass_fields__["prompt"].default
  response: len_lib.LengthSpec = it.Workload.__dataclass_fields__["response"].default
  efficiency: Efficiency = Efficiency()
  sim: it.SimOptions = it.SimOptions()
  calibration: str = ""
  figure_setting: int = 0
  bench_generation_workdir: str = ""
  bench_pipeline_workdir: str = ""
  bench_decode_workdir: str = ""
  bench_decode_extra: tuple[str, ...] = ()
  validation_calibration: str = ""

  def __post_init__(self):
    # The counts first: minibatch=0 was a ZeroDivisionError below, and plan_search's train
    # variant asked jax for num_devices=0 fake CPU devices (a backend error naming no field).
    for name in ("num_devices", "global_batch", "minibatch", "epochs", "micro_batch"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"config.{name}={v!r}: expected an integer >= 1")
    # (-1, "any seed", failed in numpy's default_rng after the outputs had moved aside, as
    # "expected non-negative integer")
    if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
      raise ValueError(f"config.seed={self.seed!r}: expected an integer >= 0")
    if not isinstance(self.hardware, str):  # (an AttributeError of str.endswith)
      raise ValueError(f"config.hardware={self.hardware!r}: expected a preset name or the path "
                       "of a hardware JSON file")
    try:  # (a bad hardware file's field was named without the flag that gave the file)
      hw = get_hardware(self.hardware)
    except ValueError as e:
      raise ValueError(f"config.hardware={self.hardware!r}: {e}") from None
    # (refused in the first simulated inference, after the binaries had moved the earlier
    # outputs aside; a calibration may time the loads instead: its weight_load)
    if self.sim.offload_frozen and hw.host_to_device_bw is None and not self.calibration:
      raise ValueError(f"config.sim.offload_frozen=True: config.hardware={self.hardware!r} has "
                       "no host_to_device_bw to load the frozen models from host memory; set "
                       "config.sim.offload_frozen=False (they stay on the devices)")
    for a, c in self.pairs:
      try:
        actor = self.shape(a)
        self.shape(c, "scalar")
      except ValueError as e:
        raise ValueError(f"config.pairs: {e}") from None
      if actor.head != "lm":  # a HF config.json of config.shapes: refused as the trainer does
        path = dict(self.shape_files).get(a, "")
        raise ValueError("config.pairs: the actor of " + f"{a}/{c}: " + scalar_actor_error(
            f"config.shapes' {a}={path!r}"))
    unknown = [s for s in self.systems if s not in it.SYSTEMS]
    if unknown:
      raise ValueError(f"config.systems: unknown {unknown}; known: {list(it.SYSTEMS)}")
    if self.sim.staleness < 0 or self.sim.async_split_unit < 0:
      raise ValueError(f"config.sim.staleness={self.sim.staleness} and config.sim."
                       f"async_split_unit={self.sim.async_split_unit} must be >= 0")
    if "pipe_rlhf_async" in self.systems and self.sim.staleness < 1:
      raise ValueError(f"config.sim.staleness={self.sim.staleness}: pipe_rlhf_async (in "
                       "config.systems) needs a staleness >= 1 (updates the generating policy "
                       "lags behind); for a synchronous-only search leave it out of "
                       "config.systems (e.g. --config.systems=pipe_rlhf; plan_search also "
                       "takes --config.systems= for no systems' comparison)")
    if any(m < 1 for m in self.max_new_tokens):
      raise ValueError(f"config.max_new_tokens={self.max_new_tokens} must all be >= 1")
    # A setting given twice is simulated twice under one label: the second replaced the first
    # in the tables and iteration_s, without a word.
    for field, values in (("pairs", self.pairs), ("max_new_tokens", self.max_new_tokens)):
      twice = sorted({v for v in values if values.count(v) > 1}, key=str)
      if twice:
        shown = ["/".join(v) if isinstance(v, tuple) else str(v) for v in twice]
        raise ValueError(f"config.{field} names {', '.join(shown)} more than once: each setting "
                         "once, expected")
    for m in self.max_new_tokens:  # (each clips the responses: refused where they were drawn,
      try:                         # after the earlier outputs had moved aside, naming no field)
        self.response.with_max_len(m)
      except ValueError as e:
        raise ValueError(f"config.response with max_len = config.max_new_tokens={m}: {e}"
                         ) from None
    if self.global_batch % self.minibatch:
      raise ValueError(f"config.global_batch={self.global_batch} must be divisible by "
                       f"config.minibatch={self.minibatch}")
    n = len(self.pairs) * len(self.max_new_tokens)
    if not -n <= self.figure_setting < n:
      raise ValueError(f"config.figure_setting={self.figure_setting} must index one of the {n} "
                       "settings")
    object.__setattr__(self, "figure_setting", self.figure_setting % n)

  def shape(self, name: str, head: str = "lm") -> ModelShape:
    return get_shape(name, head, self.shapes)

  def shape_source(self, name: str) -> str:
    """Where shape `name` comes from: a preset's paper, or the user's HF config.json (its path
    where config.shapes named one)."""
    if name not in dict(self.shapes):
      return PRESET_SOURCE
    path = dict(self.shape_files).get(name)
    return f"config.shapes: {path} (HF config.json)" if path else "config.shapes (HF config.json)"

  @classmethod
  def from_config_dict(cls, c, systems_optional: bool = False) -> "AblationConfig":
    """The typed config of ConfigDict `c`; with `systems_optional` (plan_search, whose systems
    are a comparison beside the search) `systems` may be "" for none."""
    def pair(p: str) -> tuple[str, str]:
      parts = p.split("/")
      if len(parts) != 2:
        raise ValueError(f"config.pairs: {p!r} must be 'actor/critic', e.g. "
                         "'llama-13b/llama-13b'")
      return parts[0].strip(), parts[1].strip()

    def own_shape(s: str) -> tuple:
      name, sep, path = s.partition("=")
      if not sep or not name.strip() or not path.strip():
        raise ValueError(f"config.shapes: {s!r} must be 'NAME=path/to/config.json' (or its "
                         "model directory)")
      try:
        return name.strip(), from_hf_config(path.strip(), name.strip())
      except ValueError as e:
        raise ValueError(f"config.shapes: {e}") from None

    def spec(d, field: str) -> len_lib.LengthSpec:
      # The section is named: prompt and response lengths share LengthSpec's messages.
      kw = dict(d.to_dict() if hasattr(d, "to_dict") else d)
      try:
        out = len_lib.LengthSpec(**kw)
      except (TypeError, ValueError) as e:
        raise ValueError(f"config.{field}: {e}") from None
      if out.kind == "empirical" and not os.path.isfile(out.path):
        raise ValueError(f"config.{field}.path={out.path!r}: no such file (kind 'empirical' "
                         "replays the per-sample lengths in it)")
      if out.kind == "empirical":  # read now: a bad file failed where the lengths were drawn
        try:
          len_lib.load_lengths(out.path)
        except ValueError as e:
          raise ValueError(f"config.{field}.path: {e}") from None
      return out

    sim = dict(c.sim.to_dict())
    items = _csv(sim["threshold_candidates"], "sim.threshold_candidates")
    try:  # (checked now: a bad one failed inside the simulation, named as an internal field)
      sim["threshold_candidates"] = tuple(float(x) for x in items)
      ok = all(0 <= x <= 1 for x in sim["threshold_candidates"])
    except ValueError:
      ok = False
    if not ok:
      raise ValueError(f"config.sim.threshold_candidates={c.sim.threshold_candidates!r}: "
                       "expected comma-separated Rt values in [0, 1] (0: stream, never "
                       "migrate)")
    sim["gen_tps"] = _csv_ints(sim["gen_tps"], "sim.gen_tps")
    own = [s.strip() for s in str(c.get("shapes", "")).split(",") if s.strip()]
    return cls(
        hardware=c.hardware, num_devices=c.num_devices, global_batch=c.global_batch,
        minibatch=c.minibatch, epochs=c.epochs, micro_batch=c.micro_batch,
        pairs=tuple(pair(p) for p in _csv(c.pairs, "pairs")),
        shapes=tuple(own_shape(s.strip()) for s in own),
        shape_files=tuple((n.strip(), p.strip()) for n, _, p in (s.partition("=") for s in own)),
        max_new_tokens=_csv_ints(c.max_new_tokens, "max_new_tokens"),
        systems=(() if systems_optional and not str(c.systems).strip() else
                 _csv(c.systems, "systems")), seed=c.seed,
        prompt=spec(c.prompt, "prompt"), response=spec(c.response, "response"),
        efficiency=Efficiency(**c.efficiency.to_dict()), sim=it.SimOptions(**sim),
        calibration=c.calibration, figure_setting=c.figure_setting,
        bench_generation_workdir=c.validate.bench_generation_workdir,
        bench_pipeline_workdir=c.validate.bench_pipeline_workdir,
        bench_decode_workdir=c.validate.bench_decode_workdir,
        bench_decode_extra=tuple(x.strip() for x in c.validate.get("bench_decode_extra", "")
                                 .split(",") if x.strip()),
        validation_calibration=c.validate.calibration)

  def settings(self) -> list[dict]:
    out = []
    for a, c in self.pairs:
      for m in self.max_new_tokens:
        # the LLaMA-1 presets as the paper names them (13B); a shape of the user's own
        # (config.shapes) as they named it (it read "Q14" for "q14", "LLAMA3-8B")
        short = lambda s: s[len("llama-"):].upper() if s.startswith("llama-") else s
        out.append({"actor": a, "critic": c, "max_new_tokens": m,
                    "label": f"{short(a)}/{short(c)} L={m}", "hardware": self.hardware,
                    "num_devices": self.num_devices, "global_batch": self.global_batch,
                    "minibatch": self.minibatch})
    return out


# Calibration ops measured on one model's executables: they time that model only. (decode_fit
# is per layer and per FLOP, for any shape; migration and weight_load are rates of bytes.)
MODEL_OPS = ("decode_step", "prefill", "inference", "train_stage")


def check_calibration_fits(cal: cal_lib.Calibration, cfg: AblationConfig,
                           actor_params: Optional[Sequence[int]] = None) -> None:
  """A ValueError when config.calibration cannot time this simulation: it was measured on a CPU
  (or devices that share one processor: fake CPU devices) while config.hardware is an
  accelerator preset,
  or its model-specific ops (MODEL_OPS) come from a model of another size than every actor
  simulated (more than 10 % apart). calibrate_sim's file (a 0.1M-parameter model on 8 fake CPU
  devices) turned a 13B/13B iteration on 64 H100s from 6.2 s into 15.2 s and reordered the
  systems, without a word. `actor_params`: the simulated actors' sizes when they are not
  cfg.pairs' (plan_search of a train_config simulates the run's actor: compared with the preset
  pairs, a calibration of that very model was refused)."""
  where = f"config.calibration={cfg.calibration!r} ({cal.device})"
  # Measured on a CPU: said by the file's provenance (its writer's jax platform) or its device
  # line, whatever devices_share_compute says (calibrate_sim takes it as a flag: set false, a
  # CPU's times timed an H100 without a word). A hardware file may describe that very host.
  on_cpu = ((cal.provenance or {}).get("platform") == "cpu" or
            str(cal.device).lower().startswith("cpu"))
  if (cal.devices_share_compute or on_cpu) and cfg.hardware in HARDWARE:
    raise ValueError(f"{where} was measured on "
                     + ("devices that share one processor (fake CPU devices)"
                        if cal.devices_share_compute else "a CPU") +
                     f": it cannot time config.hardware={cfg.hardware!r}'s devices; "
                     "to simulate the machine it measured, describe that machine in a hardware "
                     "file (--config.hardware=FILE.json, docs/simulator.md), or leave "
                     "config.calibration empty")
  ops = [op for op in MODEL_OPS if getattr(cal, op) is not None]
  if not ops:
    return
  sizes = sorted(set(actor_params) if actor_params is not None else
                 {cfg.shape(a).num_params() for a, _ in cfg.pairs})
  if cal.model_params is None:
    raise ValueError(f"{where} has measured {ops} but no model_params: those times are one "
                     "model's; give the measured model's parameter count (model_params) so "
                     "that it is compared with the simulated ones")
  if not any(abs(cal.model_params / n - 1) <= 0.1 for n in sizes):
    simulate = ("measure the run's own actor (a calibration of a model within 10 % of its "
                "size)" if actor_params is not None else
                "simulate that model (calibrate_sim writes its config.json to <its workdir>/"
                "model: --config.shapes=NAME=<its workdir>/model --config.pairs=NAME/NAME)")
    raise ValueError(
        f"{where} measured {ops} on a model of {cal.model_params:,} parameters, and the "
        f"simulated actors have {', '.join(f'{n:,}' for n in sizes)}: those times are that "
        f"model's own: {simulate}, or use a decode_fit, per layer and per FLOP, which times "
        "any shape (reproduce_ablations --config.validate.bench_decode_workdir=... writes one)")


def cost_model(cfg: AblationConfig, actor_params: Optional[Sequence[int]] = None) -> CostModel:
  """The cost model of config.hardware, .efficiency and .calibration (checked against the
  simulated actors: check_calibration_fits, `actor_params` as there)."""
  cal = cal_lib.load(cfg.calibration, "config.calibration") if cfg.calibration else None
  if cal is not None:
    check_calibration_fits(cal, cfg, actor_params)
  return CostModel(get_hardware(cfg.hardware), cfg.efficiency, cal)


def workload(cfg: AblationConfig, setting: dict) -> it.Workload:
  return it.Workload(actor=cfg.shape(setting["actor"]),
                     critic=cfg.shape(setting["critic"], "scalar"),
                     num_devices=cfg.num_devices, global_batch=cfg.global_batch,
                     minibatch=cfg.minibatch, epochs=cfg.epochs, micro_batch=cfg.micro_batch,
                     max_new_tokens=setting["max_new_tokens"], prompt=cfg.prompt,
                     response=cfg.response, seed=cfg.seed)


def context_warnings(cfg: AblationConfig) -> list[str]:
  """A line per setting and simulated model whose context (max_seq_len: a preset's, or its HF
  config's max_position_embeddings) is shorter than the setting's sequences: training rows are
  sized at config.prompt.max_len + max_new_tokens (Workload.padded_len) and a sampled prompt
  with its response may pass it too. Nothing in the simulator reads max_seq_len: it times and
  sizes them as a model that takes them would (train_ppo refuses such a run), so the
  calibrate_sim model's 256 positions were simulated at L=512 without a word. Warned, not
  refused: the papers' L=2048 settings pass LLaMA-1's 2048 positions (prompts up to 1024)."""
  out = []
  for st in cfg.settings():
    wl = workload(cfg, st)
    prompts, resp = wl.sample_lengths()
    longest = prompts + resp
    for name in dict.fromkeys((st["actor"], st["critic"])):
      ctx = cfg.shape(name).max_seq_len
      over = int((longest > ctx).sum())
      if wl.padded_len > ctx or over:
        out.append(f"{st['label']}: {name} holds {ctx} positions (max_seq_len), and rows are "
                   f"sized at {wl.padded_len} (config.prompt.max_len + max_new_tokens); "
                   f"{over} of the {len(longest)} sampled prompts + responses are longer "
                   f"(the longest {int(longest.max())}); simulated as a model that takes them")
  return out


ROW_FIELDS = ("iteration_s", "gen_s", "inf_s", "gen_plus_inf_s", "train_s", "samples_per_s",
              "reshard_s")


def run_ablations(cfg: AblationConfig, workdir: str,
                  log: Callable[[str], None] = print) -> dict:
  """Simulates the grid; returns {'rows', 'raw', 'inputs', 'settings'} (raw: figure material
  of the figure setting)."""
  cost = cost_model(cfg)
  cache = train_lib.ScheduleCache(path=os.path.join(workdir, "schedule_cache.json"),
                                  time_budget_s=cfg.sim.search_time_s, seed=cfg.seed, log=log)
  settings = cfg.settings()
  rows, raw, t0 = [], None, time.time()
  lengths_info = {}
  for i, st in enumerate(settings):
    wl = workload(cfg, st)
    prompts, resp = wl.sample_lengths()
    lengths_info[st["label"]] = {"prompt": len_lib.summarize(prompts),
                                 "response": len_lib.summarize(resp, st["max_new_tokens"])}
    log(f"setting {i + 1}/{len(settings)}: {st['label']} ...")
    ts = time.time()
    res, extra = it.simulate_iteration(cost, wl, cfg.sim, cfg.systems, cache,
                                       log=lambda m: log("  " + m))
    for name in cfg.systems:
      r = res[name]
      rows.append({"setting": st, "system": name, **{k: float(r[k]) for k in ROW_FIELDS},
                   "details": r["details"]})
    if i == cfg.figure_setting:
      raw = {"setting": st, **extra}
    elapsed = time.time() - t0
    eta = elapsed / (i + 1) * (len(settings) - i - 1)
    best = min(cfg.systems, key=lambda s: res[s]["iteration_s"])
    log(f"setting {i + 1}/{len(settings)} done in {time.time() - ts:.1f}s (elapsed "
        f"{elapsed:.0f}s, eta {eta:.0f}s); fastest {best} {res[best]['iteration_s']:.2f}s")
  inputs = {
      "hardware": get_hardware(cfg.hardware).to_dict(),
      "efficiency": dataclasses.asdict(cfg.efficiency),
      "shapes": {name: cfg.shape(name).to_dict() for name in
                 sorted({p for pair in cfg.pairs for p in pair})},
      # Where each shape comes from: a preset's paper, or the user's HF config.json.
      "shape_sources": {name: cfg.shape_source(name)
                        for name in sorted({p for pair in cfg.pairs for p in pair})},
      "prompt_lengths": cfg.prompt.describe(),
      "response_lengths": cfg.response.describe(),
      "lengths_sampled": lengths_info,
      "sim_options": dataclasses.asdict(cfg.sim),
      "calibration": cost.cal.describe() if cost.cal is not None else None,
      "workload": {"num_devices": cfg.num_devices, "global_batch": cfg.global_batch,
                   "minibatch": cfg.minibatch, "epochs": cfg.epochs,
                   "micro_batch": cfg.micro_batch, "seed": cfg.seed},
  }
  return {"rows": rows, "raw": raw, "inputs": inputs, "settings": settings}
