"""Calibration files: measured operation costs that replace the cost model's formulas.

A first-principles cost model (cost_model.py) is only as good as its efficiency guesses. Where a
run measured an operation, its figure wins. A calibration file is JSON:

  {
    "format": "rlhfuse_jax.sim.calibration/v1",        # required, exactly this string
    "device": "free text: what was measured on",        # required
    "model_params": 123456,                             # optional: params of the measured actor
    "instance_devices": 1,                              # optional: devices per gen instance
    "byte_unit": "stored",                              # optional (default "bf16"): what the
        # bytes of migration and weight_load count (below)
    "devices_share_compute": false,                     # optional (default false): true when
        # all devices are one shared processor (fake CPU devices): work on different
        # instances then runs one after the other, never at the same time
    "parallel_tasks": 2,                                # optional (default 1), only with
        # devices_share_compute (refused without): how many device tasks truly run at once on the
        # shared processor (its cores). Used by the lockstep pipeline model (sim/lockstep.py);
        # the generation simulator still runs shared work one piece at a time
    "ops": {                                            # every op optional
      "decode_step": {"occupied_slots": [1, 2, 4, 8],   # one decode step of one instance
                      "seconds": [0.010, 0.011, 0.012, 0.015],
                      "per_context_token_s": 0.0},      # optional extra s per KV token read
      "decode_fit":  {"step_s": 0.0, "layer_s": 5e-5,   # a decode step of any model shape:
                      "mfu": 0.04, "bw_eff": 0.7},      # fitted (sim/decode_fit.py)
      "prefill":     {"tokens_per_s": 5000.0, "overhead_s": 0.0},
      "inference":   {"tokens_per_s": 8000.0, "overhead_s": 0.0},  # ref + reward + critic
      "train_stage": {"actor_fwd_s": 0.02, "critic_fwd_s": 0.01, "bwd_over_fwd": 2.0,
                      "tokens": 4096, "seq_len": 512,              # optional (see below)
                      "actor_bwd_s": 0.05, "critic_bwd_s": 0.02,   # optional (see below)
                      "actor_fwd_per_stage_s": [0.02, 0.02],       # optional, one per stage
                      "actor_bwd_per_stage_s": [0.04, 0.06],
                      "critic_fwd_per_stage_s": [0.01], "critic_bwd_per_stage_s": [0.02]},
      "pipeline_executor": {"tick_overhead_s": 0.001, "step_overhead_s": 0.002},
      "migration":   {"bytes_per_s": 1e9, "latency_s": 0.0},       # KV rows between instances
      "weight_load": {"bytes_per_s": 1e9, "latency_s": 0.0}        # host -> device
    }
  }

decode_step is interpolated linearly in the occupied slots (clamped at the measured ends; the
engine's compiled step has a fixed batch shape, so its time may not depend on occupancy at all,
and the measured table says so). It is the measured model's own table, on an instance of
`instance_devices` devices (the cost model refuses it for another width where that is given);
decode_fit instead
predicts any shape: step_s + layers x layer_s + max(FLOPs / (tp x peak x mfu), bytes / (tp x
HBM bw x bw_eff)) + the tensor-parallel all-reduces (per-step host cost, per-layer fixed cost
that every device of an instance pays, and the roofline split over its tp devices), fitted to
measured steps of one device (tp 1) by sim/decode_fit.py. A table, where present, wins.
Rates: seconds = overhead_s + amount / rate.
byte_unit: what the bytes of the migration and weight_load rates count. "stored": the bytes the
timed copy moved, at the models' own dtypes (4 a float32 parameter or KV element), what
generation/measure.py and experiments/calibrate_sim.py write since 2026-12-04. "bf16" (a file
without the key: every earlier one, e.g. experiments/results/bench_generation_cpu/2026-12-01/):
2 bytes a parameter or KV element whatever the dtype that was copied. The cost model converts
the sizes it charges into the file's unit (`Calibration.rate_bytes`), so a file measured on
float32 models times a float32 workload's loads (plan_search:train, the Rt model) at their
measured time; a bf16 file read for float32 shapes charges their parameters at 2 bytes, as the
file counted them.
train_stage: one pipeline stage and one micro-batch. actor_fwd_s / critic_fwd_s are the forward
(mean over stages where per-stage lists exist); actor_bwd_s / critic_bwd_s the measured backward
(the pipeline executor's backward: forward recompute + vjp, and head + loss on the last stage);
absent, a backward is bwd_over_fwd x forward. bwd_over_fwd (default 2.0) is also the single ratio
the paper-scale cost model uses. tokens / seq_len (optional, together): the timed micro-batch's
tokens and tokens per sequence, on a stage of `instance_devices` devices (default 1) and of the
per-stage lists' length (default 1 stage). With them the cost model times another layout of the
measured model (tensor devices, stages, micro-batch) as the measured time x its formulas' ratio
of that layout to the measured one, the backward too; without them (files written before
2026-12-05) the measured times stand for every layout. *_per_stage_s lists (first stage first)
hold the same figures per stage, which differ (embedding on the first, head and loss on the last); a consumer that
needs a stage's time uses the list when present (its length must equal that model's stages) and
the scalar otherwise; the cost model refuses a stage of another split than the lists measured.
pipeline_executor: fixed costs of the lockstep executor (pipeline/executor.py) on the machine
measured: tick_overhead_s per tick with every device idle (switch, two ppermutes, inbox filing;
a tick with tasks lasts this plus its task time) and step_overhead_s per step outside the tick
loop (parameter flattening, the final gradient psum, dispatch), default 0.
Unknown keys are rejected, so a typo never silently falls back to a formula; files written
before a key existed load unchanged (every new key is optional).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

import numpy as np

from rlhfuse_jax import workdir

FORMAT = "rlhfuse_jax.sim.calibration/v1"
_RATE_OPS = {"prefill": ("tokens_per_s", "overhead_s"),
             "inference": ("tokens_per_s", "overhead_s"),
             "migration": ("bytes_per_s", "latency_s"),
             "weight_load": ("bytes_per_s", "latency_s")}
_OPS = ("decode_step", "decode_fit", "train_stage", "pipeline_executor") + tuple(_RATE_OPS)
OPS = _OPS  # every op a file may measure (the reports list which it did)
_FIT_KEYS = ("step_s", "layer_s", "mfu", "bw_eff")
_TOP = ("format", "device", "model_params", "instance_devices", "devices_share_compute",
        "parallel_tasks", "byte_unit", "ops", "notes", "provenance")
# What the bytes of the migration and weight_load rates count (module docstring); the first is
# what a file without the key means.
BYTE_UNITS = ("bf16", "stored")
_BF16_ITEMSIZE = 2
_TRAIN_SCALARS = ("actor_fwd_s", "critic_fwd_s", "bwd_over_fwd", "actor_bwd_s", "critic_bwd_s",
                  "tokens", "seq_len")
_TRAIN_LISTS = ("actor_fwd_per_stage_s", "actor_bwd_per_stage_s", "critic_fwd_per_stage_s",
                "critic_bwd_per_stage_s")


@dataclasses.dataclass(frozen=True)
class Rate:
  """seconds = overhead + amount / per_s."""
  per_s: float
  overhead_s: float = 0.0

  def seconds(self, amount: float) -> float:
    return self.overhead_s + amount / self.per_s


@dataclasses.dataclass(frozen=True)
class DecodeTable:
  occupied_slots: tuple[float, ...]
  seconds: tuple[float, ...]
  per_context_token_s: float = 0.0

  def step_s(self, occupied, context_tokens=0.0):
    """Scalars or equal-shape arrays (one entry per step)."""
    base = np.interp(occupied, self.occupied_slots, self.seconds)
    return base + self.per_context_token_s * np.asarray(context_tokens, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class DecodeFit:
  """A decode step of any model shape (module docstring; fitted by sim/decode_fit.py)."""
  step_s: float   # per-step host cost (dispatch, the host's done check)
  layer_s: float  # per-layer fixed cost (kernel launches and latencies, whatever the batch)
  mfu: float      # achieved fraction of peak FLOP/s where the step is compute-bound
  bw_eff: float   # achieved fraction of HBM bandwidth where it is memory-bound


@dataclasses.dataclass(frozen=True)
class TrainStage:
  """Per-stage, per-micro-batch training times (see the module docstring)."""
  actor_fwd_s: float
  critic_fwd_s: float
  bwd_over_fwd: float = 2.0
  actor_bwd_s: Optional[float] = None
  critic_bwd_s: Optional[float] = None
  actor_fwd_per_stage_s: Optional[tuple[float, ...]] = None
  actor_bwd_per_stage_s: Optional[tuple[float, ...]] = None
  critic_fwd_per_stage_s: Optional[tuple[float, ...]] = None
  critic_bwd_per_stage_s: Optional[tuple[float, ...]] = None
  # The timed micro-batch: its tokens and tokens per sequence (module docstring); None in files
  # written before 2026-12-05.
  tokens: Optional[float] = None
  seq_len: Optional[float] = None

  def stage_times(self, model: str, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward [num_stages], backward [num_stages]) seconds of `model` ('actor' | 'critic')
    split into `num_stages` stages: the per-stage lists where measured, else the scalars."""
    if model not in ("actor", "critic"):
      raise ValueError(f"model={model!r}; expected 'actor' or 'critic'")
    fwd = getattr(self, f"{model}_fwd_s")
    bwd = getattr(self, f"{model}_bwd_s")
    bwd = self.bwd_over_fwd * fwd if bwd is None else bwd
    out = []
    for name, scalar in ((f"{model}_fwd_per_stage_s", fwd), (f"{model}_bwd_per_stage_s", bwd)):
      per = getattr(self, name)
      if per is None:
        out.append(np.full((num_stages,), scalar))
      elif len(per) != num_stages:
        raise ValueError(f"calibration train_stage.{name} has {len(per)} stages; this pipeline "
                         f"has {num_stages} {model} stages (measure it with the same split)")
      else:
        out.append(np.array(per, dtype=np.float64))
    return out[0], out[1]


@dataclasses.dataclass(frozen=True)
class ExecutorCost:
  """Fixed costs of the lockstep pipeline executor (seconds)."""
  tick_overhead_s: float
  step_overhead_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A loaded calibration file (see module docstring); None fields fall back to formulas."""
  device: str
  path: str = ""
  model_params: Optional[int] = None
  instance_devices: Optional[int] = None
  devices_share_compute: bool = False
  parallel_tasks: Optional[int] = None  # None: 1 task at a time when devices_share_compute
  decode_step: Optional[DecodeTable] = None
  decode_fit: Optional[DecodeFit] = None
  train_stage: Optional[TrainStage] = None
  pipeline_executor: Optional[ExecutorCost] = None
  prefill: Optional[Rate] = None
  inference: Optional[Rate] = None
  migration: Optional[Rate] = None
  weight_load: Optional[Rate] = None
  byte_unit: str = "bf16"  # BYTE_UNITS: what the migration and weight_load rates' bytes count
  # Where and when it was measured (the writing binary's result provenance: date, commit,
  # command, host processor, jax and its devices); None in a hand-written or older file.
  provenance: Optional[dict] = None

  def rate_bytes(self, nbytes: float, itemsize: int) -> float:
    """`nbytes` of elements of `itemsize` bytes each (a shape's weight_itemsize or kv_itemsize)
    in the unit this file's migration and weight_load rates count (byte_unit)."""
    return nbytes if self.byte_unit == "stored" else nbytes * _BF16_ITEMSIZE / itemsize

  def describe(self) -> dict:
    out = {"path": self.path, "device": self.device,
           "devices_share_compute": self.devices_share_compute, "byte_unit": self.byte_unit}
    if self.provenance:
      out["measured"] = {k: self.provenance.get(k) for k in (
          "date", "git_commit", "host_cpu", "jax") if self.provenance.get(k)}
    if self.parallel_tasks is not None:
      out["parallel_tasks"] = self.parallel_tasks
    for name in _OPS:
      v = getattr(self, name)
      if v is not None:
        out[name] = dataclasses.asdict(v)
    return out


def _err(where: str, msg: str) -> ValueError:
  return ValueError(f"calibration {where}: {msg}")


def _pos(where: str, key: str, v: Any, allow_zero: bool = False) -> float:
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
      v >= 0 if allow_zero else v > 0)
  if not ok:
    raise _err(where, f"{key}={v!r} must be a {'non-negative' if allow_zero else 'positive'} "
               "finite number")
  return float(v)


def _keys(where: str, obj: Any, allowed: tuple, required: tuple) -> dict:
  if not isinstance(obj, dict):
    raise _err(where, f"expected an object, got {type(obj).__name__}")
  extra = sorted(set(obj) - set(allowed))
  if extra:
    raise _err(where, f"unknown keys {extra}; allowed: {list(allowed)}")
  missing = [k for k in required if k not in obj]
  if missing:
    raise _err(where, f"missing keys {missing}")
  return obj


def from_dict(obj: dict, path: str = "<dict>") -> Calibration:
  """Validates a parsed calibration object; errors name the file, the key and the rule."""
  top = _keys(path, obj, _TOP, ("format", "device", "ops"))
  if top["format"] != FORMAT:
    raise _err(path, f"format={top['format']!r}; expected {FORMAT!r}")
  ops = _keys(f"{path} ops", top["ops"], _OPS, ())
  kw: dict[str, Any] = {}
  if "decode_step" in ops:
    w = f"{path} ops.decode_step"
    d = _keys(w, ops["decode_step"], ("occupied_slots", "seconds", "per_context_token_s"),
              ("occupied_slots", "seconds"))
    xs, ys = d["occupied_slots"], d["seconds"]
    if not (isinstance(xs, list) and isinstance(ys, list) and len(xs) == len(ys) >= 1):
      raise _err(w, "occupied_slots and seconds must be lists of equal, non-zero length")
    xs = [_pos(w, "occupied_slots[]", x) for x in xs]
    ys = [_pos(w, "seconds[]", y) for y in ys]
    if any(b <= a for a, b in zip(xs, xs[1:])):
      raise _err(w, f"occupied_slots={xs} must be strictly increasing")
    kw["decode_step"] = DecodeTable(tuple(xs), tuple(ys), _pos(
        w, "per_context_token_s", d.get("per_context_token_s", 0.0), allow_zero=True))
  if "decode_fit" in ops:
    w = f"{path} ops.decode_fit"
    d = _keys(w, ops["decode_fit"], _FIT_KEYS, _FIT_KEYS)
    fit = {k: _pos(w, k, d[k], allow_zero=k in ("step_s", "layer_s")) for k in _FIT_KEYS}
    for k in ("mfu", "bw_eff"):
      if fit[k] > 1:
        raise _err(w, f"{k}={fit[k]} must be a fraction in (0, 1]")
    kw["decode_fit"] = DecodeFit(**fit)
  if "train_stage" in ops:
    w = f"{path} ops.train_stage"
    d = _keys(w, ops["train_stage"], _TRAIN_SCALARS + _TRAIN_LISTS,
              ("actor_fwd_s", "critic_fwd_s"))
    ts = {k: _pos(w, k, d[k]) for k in _TRAIN_SCALARS if k in d}
    for k in _TRAIN_LISTS:
      if k in d:
        if not (isinstance(d[k], list) and d[k]):
          raise _err(w, f"{k}={d[k]!r} must be a non-empty list (one entry per stage)")
        ts[k] = tuple(_pos(w, f"{k}[]", x) for x in d[k])
    if ("tokens" in ts) != ("seq_len" in ts):
      raise _err(w, "tokens and seq_len come together (the timed micro-batch's tokens and "
                    "tokens per sequence): give both or neither")
    kw["train_stage"] = TrainStage(**ts)
  if "pipeline_executor" in ops:
    w = f"{path} ops.pipeline_executor"
    d = _keys(w, ops["pipeline_executor"], ("tick_overhead_s", "step_overhead_s"),
              ("tick_overhead_s",))
    kw["pipeline_executor"] = ExecutorCost(
        _pos(w, "tick_overhead_s", d["tick_overhead_s"], allow_zero=True),
        _pos(w, "step_overhead_s", d.get("step_overhead_s", 0.0), allow_zero=True))
  for name, (rate_key, over_key) in _RATE_OPS.items():
    if name in ops:
      w = f"{path} ops.{name}"
      d = _keys(w, ops[name], (rate_key, over_key), (rate_key,))
      kw[name] = Rate(_pos(w, rate_key, d[rate_key]),
                      _pos(w, over_key, d.get(over_key, 0.0), allow_zero=True))
  unit = top.get("byte_unit", BYTE_UNITS[0])
  if unit not in BYTE_UNITS:
    raise _err(path, f"byte_unit={unit!r}: expected one of {list(BYTE_UNITS)} (what the "
               "migration and weight_load bytes count; absent: 'bf16')")
  share = top.get("devices_share_compute", False)
  if not isinstance(share, bool):
    raise _err(path, f"devices_share_compute={share!r} must be true or false")
  mp = top.get("model_params")
  if mp is not None and not (isinstance(mp, int) and not isinstance(mp, bool) and mp > 0):
    raise _err(path, f"model_params={mp!r} must be a positive int")
  par = top.get("parallel_tasks")
  if par is not None and not (isinstance(par, int) and not isinstance(par, bool) and par > 0):
    raise _err(path, f"parallel_tasks={par!r} must be a positive int")
  if par is not None and not share:
    # (read only for a shared processor: the simulators took the devices as dedicated, every
    # instance and stage at once, and the cores given were ignored, silently)
    raise _err(path, f"parallel_tasks={par} is read only with devices_share_compute: true (the "
               "cores of one shared processor); set that, or remove parallel_tasks")
  idev = top.get("instance_devices")
  if idev is not None and not (isinstance(idev, int) and not isinstance(idev, bool) and idev > 0):
    raise _err(path, f"instance_devices={idev!r} must be a positive int")
  prov = top.get("provenance")
  if prov is not None and not isinstance(prov, dict):
    raise _err(path, f"provenance={prov!r} must be an object")
  return Calibration(device=str(top["device"]), path=path, model_params=mp,
                     instance_devices=idev, devices_share_compute=share,
                     parallel_tasks=par, provenance=prov, byte_unit=unit, **kw)


def to_dict(cal: Calibration) -> dict:
  """The file form of a Calibration (from_dict(to_dict(c)) == c up to `path`)."""
  top: dict[str, Any] = {"format": FORMAT, "device": cal.device,
                         "devices_share_compute": cal.devices_share_compute,
                         "byte_unit": cal.byte_unit}
  for k in ("model_params", "instance_devices", "parallel_tasks", "provenance"):
    if getattr(cal, k) is not None:
      top[k] = getattr(cal, k)
  ops: dict[str, Any] = {}
  if cal.decode_step is not None:
    ops["decode_step"] = {"occupied_slots": list(cal.decode_step.occupied_slots),
                          "seconds": list(cal.decode_step.seconds),
                          "per_context_token_s": cal.decode_step.per_context_token_s}
  for name in ("decode_fit", "train_stage", "pipeline_executor"):
    v = getattr(cal, name)
    if v is not None:
      ops[name] = {k: list(x) if isinstance(x, tuple) else x
                   for k, x in dataclasses.asdict(v).items() if x is not None}
  for name, (rate_key, over_key) in _RATE_OPS.items():
    v = getattr(cal, name)
    if v is not None:
      ops[name] = {rate_key: v.per_s, over_key: v.overhead_s}
  top["ops"] = ops
  return top


def load(path: str, field: str = "") -> Calibration:
  """Reads and validates a calibration JSON file; `field`: the config field that named it, for
  the errors."""
  named = f"{field}={path!r}: " if field else ""
  if not os.path.exists(path):
    raise FileNotFoundError(f"{named}calibration file {path!r} does not exist")
  if os.path.isdir(path):  # calibrate_sim's workdir given for its calibration.json
    inside = os.path.join(path, "calibration.json")
    raise ValueError(f"{named}calibration file {path!r} is a directory; expected a JSON file "
                     "(calibrate_sim writes WORKDIR/calibration.json" +
                     (f": {inside}" if os.path.isfile(inside) else "") + ")")
  with open(path) as f:
    try:
      obj = workdir.load_json(f)  # a key given twice is refused, not the last one kept
    except json.JSONDecodeError as e:
      raise _err(path, f"not valid JSON ({e.msg} at line {e.lineno})") from None
    except ValueError as e:  # workdir.load_json's key given twice
      raise _err(path, str(e)) from None
  return from_dict(obj, path)
