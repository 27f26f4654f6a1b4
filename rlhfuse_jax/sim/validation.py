"""Validation: the simulator, fed with one machine's measured costs, predicts that machine's
benchmarks (`experiments/bench_generation.py`, `experiments/bench_pipeline.py`).

Prediction side:
  predict_bench_generation(cal, spec): baseline and fused gen_plus_inf_s of a generation bench
      from a calibration file (decode_step, prefill, inference and migration must be measured:
      no datasheet figure describes a CPU), with `devices_share_compute` honoured.
  predict_bench_pipeline(cal, problem, fused_order): serial (actor 1F1B then critic 1F1B) and
      fused step times from measured stage times (calibration `train_stage`); on a shared
      processor every task runs one after the other, so both predictions are the total work.

Reading a bench's workdir: config.json and result.json are searched (recursively) for the keys
below, first alias wins; a missing key is reported by name, never guessed.
  generation: instances (num_instances | instances | num_gen_instances), slots (slots |
      slots_per_instance), devices per instance (tp | devices_per_instance | instance_devices,
      default 1), chunk (chunk_size | chunk_steps), Rt (migration_threshold | threshold),
      inference micro-batch (inference_microbatch | inference_micro_batch, default 8),
      max_new_tokens, prompt_lens | prompt_lengths and response_lens | response_lengths
      (per sample, in result.json), the model shape (hidden_size, intermediate_size,
      num_layers, num_heads, num_kv_heads, vocab_size), measured baseline/fused gen_plus_inf_s.
  pipeline: actor_pp, critic_pp, actor_microbatches, critic_microbatches, measured serial and
      fused step seconds (serial_step_s | one_f_one_b_s | baseline_s, fused_step_s | fused_s).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import numpy as np

from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.sim import generation_sim as gen_lib
from rlhfuse_jax.sim.calibration import Calibration
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.shapes import ModelShape

_GEN_OPS = ("decode_step", "prefill", "inference", "migration")


@dataclasses.dataclass(frozen=True)
class GenBenchSpec:
  shape: ModelShape
  num_instances: int
  slots: int
  tp: int
  chunk_steps: int
  threshold: float
  inference_microbatch: int
  max_new_tokens: int
  prompt_lens: tuple
  response_lens: tuple


def _calibrated_cost(cal: Calibration, needed: tuple) -> CostModel:
  missing = [op for op in needed if getattr(cal, op) is None]
  if missing:
    raise ValueError(f"calibration {cal.path or cal.device!r} lacks measured ops {missing}; "
                     "predicting a measured machine needs them all (no datasheet applies)")
  # Every op the prediction uses comes from the calibration; the preset is never consulted.
  return CostModel(get_hardware("h100_sxm"), calibration=cal)


def predict_bench_generation(cal: Calibration, spec: GenBenchSpec) -> dict:
  """Predicted baseline and fused gen_plus_inf_s (and their ratio) of a generation bench."""
  cost = _calibrated_cost(cal, _GEN_OPS)
  out = {}
  for mode, fused in (("baseline", False), ("fused", True)):
    setup = gen_lib.GenSetup(
        num_instances=spec.num_instances, slots=spec.slots, tp=spec.tp,
        chunk_steps=spec.chunk_steps, max_new_tokens=spec.max_new_tokens,
        threshold=spec.threshold if fused else None, stream_inference=fused,
        inference_microbatch=spec.inference_microbatch,
        devices_share_compute=cal.devices_share_compute)
    res = gen_lib.simulate_generation(cost, spec.shape, (spec.shape,) * 3, setup,
                                      np.array(spec.prompt_lens), np.array(spec.response_lens))
    out[mode] = {"gen_plus_inf_s": res.gen_plus_inf_s, "gen_s": res.gen_end_s,
                 "instance_busy_frac": res.instance_busy_frac}
  out["ratio_fused_over_baseline"] = (out["fused"]["gen_plus_inf_s"] /
                                      out["baseline"]["gen_plus_inf_s"])
  return out


def predict_bench_pipeline(cal: Calibration, problem: PipelineProblem,
                           fused_order: Optional[np.ndarray] = None) -> dict:
  """Predicted serial and fused step times (s) from measured stage times."""
  if cal.train_stage is None:
    raise ValueError(f"calibration {cal.path or cal.device!r} lacks the measured op "
                     "'train_stage'")
  ts = cal.train_stage
  p = dataclasses.replace(problem, actor_fwd=ts.actor_fwd_s, critic_fwd=ts.critic_fwd_s,
                          actor_bwd=ts.bwd_over_fwd * ts.actor_fwd_s,
                          critic_bwd=ts.bwd_over_fwd * ts.critic_fwd_s)
  if cal.devices_share_compute:
    total = p.num_devices * p.work_per_device()
    return {"serial_s": total, "fused_s": total, "ratio_fused_over_serial": 1.0,
            "note": "shared processor: every schedule runs the same total work in series"}
  serial = evaluate(p, schedules.serial_order(p), schedules.serial_release(p)).makespan
  order = schedules.greedy_order(p) if fused_order is None else fused_order
  fused = evaluate(p, order).makespan
  return {"serial_s": serial, "fused_s": fused, "ratio_fused_over_serial": fused / serial}


def _find(obj: Any, aliases: tuple) -> Any:
  """First value under any alias key, searching nested dicts depth-first."""
  if isinstance(obj, dict):
    for a in aliases:
      if a in obj:
        return obj[a]
    for v in obj.values():
      got = _find(v, aliases)
      if got is not None:
        return got
  return None


def _read(workdir: str, name: str) -> dict:
  path = os.path.join(workdir, name)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist")
  with open(path) as f:
    return json.load(f)


def gen_bench_from_workdir(workdir: str) -> tuple[GenBenchSpec, dict]:
  """(spec, measured {'baseline': s, 'fused': s}) from a bench_generation workdir."""
  cfg, res = _read(workdir, "config.json"), _read(workdir, "result.json")
  # result.json first: it holds resolved values (e.g. the Rt that "auto" chose).
  both = {"result": res, "config": cfg}
  need = {"num_instances": ("num_instances", "instances", "num_gen_instances"),
          "slots": ("slots", "slots_per_instance"),
          "chunk_steps": ("chunk_size", "chunk_steps"),
          "threshold": ("migration_threshold", "threshold"),
          "max_new_tokens": ("max_new_tokens",),
          "prompt_lens": ("prompt_lens", "prompt_lengths"),
          "response_lens": ("response_lens", "response_lengths"),
          "hidden_size": ("hidden_size",), "intermediate_size": ("intermediate_size",),
          "num_layers": ("num_layers",), "num_heads": ("num_heads",),
          "num_kv_heads": ("num_kv_heads",), "vocab_size": ("vocab_size",)}
  got = {k: _find(both, a) for k, a in need.items()}
  missing = [f"{k} (one of {list(need[k])})" for k, v in got.items() if v is None]
  base = _find(res.get("baseline", {}), ("gen_plus_inf_s",))
  fused = _find(res.get("fused", {}), ("gen_plus_inf_s",))
  if base is None or fused is None:
    missing.append("baseline.gen_plus_inf_s / fused.gen_plus_inf_s in result.json")
  if missing:
    raise ValueError(f"{workdir}: cannot rebuild the bench for prediction; missing {missing}")
  shape = ModelShape(name="bench", vocab_size=int(got["vocab_size"]) or 256,
                     hidden_size=int(got["hidden_size"]),
                     intermediate_size=int(got["intermediate_size"]),
                     num_layers=int(got["num_layers"]), num_heads=int(got["num_heads"]),
                     num_kv_heads=int(got["num_kv_heads"]))
  spec = GenBenchSpec(
      shape=shape, num_instances=int(got["num_instances"]), slots=int(got["slots"]),
      tp=int(_find(both, ("tp", "devices_per_instance", "instance_devices")) or 1),
      chunk_steps=int(got["chunk_steps"]), threshold=float(got["threshold"]),
      inference_microbatch=int(_find(both, ("inference_microbatch",
                                            "inference_micro_batch")) or 8),
      max_new_tokens=int(got["max_new_tokens"]),
      prompt_lens=tuple(int(x) for x in got["prompt_lens"]),
      response_lens=tuple(int(x) for x in got["response_lens"]))
  return spec, {"baseline": float(base), "fused": float(fused)}


def pipeline_bench_from_workdir(workdir: str) -> tuple[PipelineProblem, dict]:
  cfg, res = _read(workdir, "config.json"), _read(workdir, "result.json")
  both = {"config": cfg, "result": res}
  keys = {"actor_pp": ("actor_pp",), "critic_pp": ("critic_pp",),
          "actor_microbatches": ("actor_microbatches", "Ma"),
          "critic_microbatches": ("critic_microbatches", "Mc"),
          "serial": ("serial_step_s", "one_f_one_b_s", "baseline_s"),
          "fused": ("fused_step_s", "fused_s")}
  got = {k: _find(both, a) for k, a in keys.items()}
  missing = [f"{k} (one of {list(keys[k])})" for k, v in got.items() if v is None]
  if missing:
    raise ValueError(f"{workdir}: cannot rebuild the pipeline bench; missing {missing}")
  problem = PipelineProblem(actor_pp=int(got["actor_pp"]), critic_pp=int(got["critic_pp"]),
                            actor_microbatches=int(got["actor_microbatches"]),
                            critic_microbatches=int(got["critic_microbatches"]),
                            actor_fwd=1.0, critic_fwd=1.0)
  return problem, {"serial": float(got["serial"]), "fused": float(got["fused"])}


def _err_pct(pred: float, meas: float) -> str:
  return f"{(pred - meas) / meas * 100:+.1f}%"


def validation_lines(calibration: Optional[Calibration], gen_workdir: str,
                     pipe_workdir: str) -> list[str]:
  """Markdown lines: predicted vs measured for each bench, or why there is nothing to compare."""
  lines = []
  for name, wd_path in (("bench_generation", gen_workdir), ("bench_pipeline", pipe_workdir)):
    if not wd_path:
      lines.append(f"- **{name}**: no workdir given (`--config.validate.{name}_workdir`); "
                   "nothing compared.")
      continue
    if not os.path.exists(os.path.join(wd_path, "result.json")):
      lines.append(f"- **{name}**: `{wd_path}/result.json` does not exist; nothing compared.")
      continue
    if calibration is None:
      lines.append(f"- **{name}**: result found but no calibration of the machine it ran on "
                   "(`--config.validate.calibration`); nothing compared.")
      continue
    try:
      if name == "bench_generation":
        spec, meas = gen_bench_from_workdir(wd_path)
        pred = predict_bench_generation(calibration, spec)
        rows = [("baseline gen_plus_inf_s", pred["baseline"]["gen_plus_inf_s"],
                 meas["baseline"]),
                ("fused gen_plus_inf_s", pred["fused"]["gen_plus_inf_s"], meas["fused"]),
                ("ratio fused / baseline", pred["ratio_fused_over_baseline"],
                 meas["fused"] / meas["baseline"])]
      else:
        problem, meas = pipeline_bench_from_workdir(wd_path)
        pred = predict_bench_pipeline(calibration, problem)
        rows = [("serial step s", pred["serial_s"], meas["serial"]),
                ("fused step s", pred["fused_s"], meas["fused"]),
                ("ratio fused / serial", pred["ratio_fused_over_serial"],
                 meas["fused"] / meas["serial"])]
    except (ValueError, FileNotFoundError, KeyError) as e:
      lines.append(f"- **{name}**: could not compare: {e}")
      continue
    lines += [f"- **{name}** (`{wd_path}`, calibration `{calibration.path}`):", "",
              "| quantity | predicted | measured | error |", "|---|---|---|---|"]
    lines += [f"| {q} | {p:.4g} | {m:.4g} | {_err_pct(p, m)} |" for q, p, m in rows]
    lines.append("")
  return lines
