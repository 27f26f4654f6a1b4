"""Validation: the simulator, fed with one machine's measured costs, predicts that machine's
benchmarks (`experiments/bench_generation.py`, `experiments/bench_pipeline.py`).

Prediction side:
  predict_bench_generation(cal, spec): baseline and fused gen_plus_inf_s of a generation bench
      from a calibration file (decode_step, prefill, inference and migration must be measured:
      no datasheet figure describes a CPU), with `devices_share_compute` honoured.
  predict_bench_pipeline(cal, problem, fused_order, serial_order, data_replicas): serial
      (actor 1F1B, barrier, critic 1F1B) and fused step times of the lockstep executor
      (sim/lockstep.py: the orders' ticks, each as long as its tasks on the calibrated machine,
      `parallel_tasks` cores when devices_share_compute, plus the measured tick overhead), and
      the same on dedicated devices (a real mesh; a prediction with nothing to compare to).
      Needs the calibration ops `train_stage` and `pipeline_executor`.

  predict_bench_decode(result, efficiency): decode step times per batch and the PPO update of
      `experiments/bench_decode.py` (one accelerator) from the datasheet preset that matched the
      device and the simulator's *assumed* efficiencies, uncalibrated: this tests the formulas
      and the default Efficiency the paper-scale ablations use against a real GPU. (Its
      calibration.json is not used here: predicting a bench from its own measured step times
      would compare the measurement with itself.)
  bench_decode's steps also get the fitted decode model (sim/decode_fit.py: 3 parameters fitted
      to result.json and the other depths' result files, `decode_extra`), each with its
      leave-one-out prediction.

validate() returns the markdown lines, the rows {bench, quantity, predicted, measured,
error (= predicted / measured - 1), prediction: calibrated | uncalibrated | fitted} (a fitted
decode row adds its source file, leave_one_out and uncalibrated), and the (bench, reason) of each
bench given a workdir that could not be compared.

Calibration: validation_lines uses the given calibration for bench_generation and bench_pipeline,
or, when none is given, each bench's own `<workdir>/calibration.json` (both benches write one).

Reading a bench's workdir: config.json and result.json are searched (recursively) for the keys
below, first alias wins; a missing key is reported by name, never guessed, except the few with
a default stated below (the benches' own defaults: tp 1, inference micro-batch 8,
max_consolidations 1; a vocab_size of 0 reads as 256, the byte tokenizer's).
  generation: instances (num_instances | instances | num_gen_instances), slots (slots |
      slots_per_instance), devices per instance (tp | devices_per_instance | instance_devices,
      default 1), chunk (chunk_size | chunk_steps), Rt (migration_threshold | threshold),
      inference micro-batch (inference_microbatch | inference_micro_batch, default 8),
      max_new_tokens, prompt_lens | prompt_lengths and response_lens | response_lengths
      (per sample, in result.json), the model shape (hidden_size, intermediate_size,
      num_layers, num_heads, num_kv_heads, vocab_size), measured baseline/fused gen_plus_inf_s;
      max_consolidations (default 1), and config.json's top-level `critic` / `reward_model`
      flags (the inference models besides the reference; absent: on), whose weights are loaded
      onto every instance freed for inference as the engine does.
  pipeline: schedules.json (problem, data_replicas, the names of the serial and the fused
      schedule, and each schedule's order and barrier flag, exactly as run) and, per schedule,
      result.json's schedules.<name>.step_s (median wall seconds of one step); the measured
      ratio is result.json's paired_ratio_fused_over_serial when present (rounds of one step
      per schedule), else the ratio of the two medians.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.policy import calibration as cal_lib
from rlhfuse_jax.sim import decode_fit
from rlhfuse_jax.sim import generation_sim as gen_lib
from rlhfuse_jax.sim import lockstep
from rlhfuse_jax.sim import shapes as shapes_lib
from rlhfuse_jax.policy.calibration import Calibration
from rlhfuse_jax.sim.cost_model import CostModel, Efficiency
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.shapes import ModelShape

_GEN_OPS = ("decode_step", "prefill", "inference", "migration", "weight_load")


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
  # The inference models the bench scored with (reference: the actor's shape; critic and reward
  # model: its scalar-head twin), their weights loaded from host memory onto each instance
  # freed for inference, as the engine does (timed by the calibration's weight_load).
  frozen: tuple = ()
  offload_frozen: bool = True
  max_consolidations: int = 1
  # The bench's generation.inference_pp: freed instances scoring on pipelines of that many
  # (GenSetup.inference_pp)
  inference_pp: int = 1


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
        max_consolidations=spec.max_consolidations, offload_frozen=spec.offload_frozen,
        devices_share_compute=cal.devices_share_compute, inference_pp=spec.inference_pp)
    res = gen_lib.simulate_generation(cost, spec.shape, spec.frozen or (spec.shape,), setup,
                                      np.array(spec.prompt_lens), np.array(spec.response_lens))
    out[mode] = {"gen_plus_inf_s": res.gen_plus_inf_s, "gen_s": res.gen_end_s,
                 "instance_busy_frac": res.instance_busy_frac}
  out["ratio_fused_over_baseline"] = (out["fused"]["gen_plus_inf_s"] /
                                      out["baseline"]["gen_plus_inf_s"])
  return out


def stage_times(cal: Calibration, problem: PipelineProblem) -> lockstep.StageTimes:
  """Measured per-stage times of the problem's actor and critic split (calibration train_stage)."""
  if cal.train_stage is None:
    raise ValueError(f"calibration {cal.path or cal.device!r} lacks the measured op "
                     "'train_stage'")
  af, ab = cal.train_stage.stage_times("actor", problem.actor_pp)
  cf, cb = cal.train_stage.stage_times("critic", problem.critic_pp)
  return lockstep.StageTimes(tuple(af), tuple(ab), tuple(cf), tuple(cb))


def predict_schedule_s(cal: Calibration, problem: PipelineProblem, order: np.ndarray,
                       barrier: bool = False, data_replicas: int = 1,
                       dedicated: bool = False) -> dict:
  """One executor step of `order` on the calibrated machine (sim/lockstep.py): its shared
  processor (devices_share_compute, parallel_tasks cores) unless `dedicated`."""
  if cal.pipeline_executor is None:
    raise ValueError(f"calibration {cal.path or cal.device!r} lacks the measured op "
                     "'pipeline_executor' (the executor's per-tick cost)")
  shared = cal.devices_share_compute and not dedicated
  ex = cal.pipeline_executor
  return lockstep.step_seconds(problem, order, stage_times(cal, problem), barrier=barrier,
                               tick_overhead_s=ex.tick_overhead_s,
                               step_overhead_s=ex.step_overhead_s,
                               parallel_tasks=(cal.parallel_tasks or 1) if shared else None,
                               data_replicas=data_replicas)


def predict_bench_pipeline(cal: Calibration, problem: PipelineProblem, fused_order: np.ndarray,
                           serial_order: Optional[np.ndarray] = None,
                           data_replicas: int = 1) -> dict:
  """Predicted serial (actor 1F1B, barrier, critic 1F1B) and fused step times (s) of the
  lockstep executor from measured stage and tick costs, on the calibrated machine and, under
  'dedicated', on one device per stage (what a real mesh would run; no measurement there)."""
  serial_order = schedules.serial_order(problem) if serial_order is None else serial_order
  out = {}
  for key, dedicated in (("shared", False), ("dedicated", True)):
    s = predict_schedule_s(cal, problem, serial_order, True, data_replicas, dedicated)
    f = predict_schedule_s(cal, problem, fused_order, False, data_replicas, dedicated)
    out[key] = {"serial_s": s["step_s"], "fused_s": f["step_s"],
                "ratio_fused_over_serial": f["step_s"] / s["step_s"],
                "serial_ticks": s["ticks"], "fused_ticks": f["ticks"]}
  out.update(out.pop("shared"))
  out["parallel_tasks"] = (cal.parallel_tasks or 1) if cal.devices_share_compute else None
  return out


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


def _int_or(value: Any, default: int) -> int:
  return default if value is None else int(value)


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
  # At the dtypes the bench ran (ModelConfig's float32 where config.json names none): the bytes
  # its migrations and loads copied, which a calibration's "stored" byte_unit counts (a bf16
  # one's, converted by the cost model, whatever the itemsize: Calibration.rate_bytes).
  model = cfg.get("model", cfg)
  sizes = shapes_lib.dtype_itemsizes({k: _find(model, (k,)) or "float32"
                                      for k in shapes_lib.ITEMSIZE_DTYPES.values()},
                                     f"{workdir}/config.json: ")
  shape = ModelShape(name="bench", vocab_size=int(got["vocab_size"]) or 256,
                     hidden_size=int(got["hidden_size"]),
                     intermediate_size=int(got["intermediate_size"]),
                     num_layers=int(got["num_layers"]), num_heads=int(got["num_heads"]),
                     num_kv_heads=int(got["num_kv_heads"]), **sizes)
  spec = GenBenchSpec(
      shape=shape, num_instances=int(got["num_instances"]), slots=int(got["slots"]),
      tp=int(_find(both, ("tp", "devices_per_instance", "instance_devices")) or 1),
      chunk_steps=int(got["chunk_steps"]), threshold=float(got["threshold"]),
      inference_microbatch=int(_find(both, ("inference_microbatch",
                                            "inference_micro_batch")) or 8),
      max_new_tokens=int(got["max_new_tokens"]),
      prompt_lens=tuple(int(x) for x in got["prompt_lens"]),
      response_lens=tuple(int(x) for x in got["response_lens"]),
      frozen=(shape,) + tuple(shape.as_critic() for key in ("critic", "reward_model")
                              if cfg.get(key, True) is not False),
      # 0 is a setting (no consolidation: the tail decodes where it is), not a missing key.
      max_consolidations=_int_or(_find(both, ("max_consolidations",)), 1),
      inference_pp=_int_or(_find(both, ("inference_pp",)), 1))
  return spec, {"baseline": float(base), "fused": float(fused)}


@dataclasses.dataclass(frozen=True)
class PipeBench:
  """What a bench_pipeline workdir says it ran, and its measured step times."""
  problem: PipelineProblem
  data_replicas: int  # copies of the stage axis over the mesh's data axes
  orders: dict        # schedule name -> (order int8 [N, T], barrier)
  serial: str         # name of the serial 1F1B schedule
  fused: str          # name of the schedule whose time is the bench's fused_step_s
  measured: dict      # schedule name -> median step seconds
  paired_ratio: Optional[float] = None  # median of per-round fused / serial, when recorded
  tick_check: Optional[dict] = None  # result.json's tick_model_check (all-busy table), if any


def pipeline_bench_from_workdir(workdir: str) -> PipeBench:
  """Rebuilds the schedules a bench_pipeline run executed (schedules.json) and its times."""
  res = _read(workdir, "result.json")
  path = os.path.join(workdir, "schedules.json")
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} does not exist: the bench did not record the schedule orders it ran (written "
        "by experiments/bench_pipeline.py since the lockstep validation), so the predicted "
        "ticks cannot be rebuilt; re-run the bench")
  sch = _read(workdir, "schedules.json")
  missing = [k for k in ("problem", "data_replicas", "serial", "fused", "schedules")
             if k not in sch]
  if missing:
    raise ValueError(f"{path}: missing keys {missing}")
  problem = PipelineProblem.from_dict(sch["problem"])
  orders = {name: (np.array(s["order"], np.int8), bool(s["barrier"]))
            for name, s in sch["schedules"].items()}
  measured = {name: _find(res.get("schedules", {}).get(name, {}), ("step_s",))
              for name in orders}
  gone = [n for n, v in measured.items() if v is None]
  if gone or sch["serial"] not in orders or sch["fused"] not in orders:
    raise ValueError(f"{workdir}: result.json lacks schedules.<name>.step_s for {gone}, or "
                     f"schedules.json names serial={sch['serial']!r} / fused={sch['fused']!r} "
                     f"outside its schedules {list(orders)}")
  return PipeBench(problem=problem, data_replicas=int(sch["data_replicas"]), orders=orders,
                   serial=sch["serial"], fused=sch["fused"],
                   measured={n: float(v) for n, v in measured.items()},
                   paired_ratio=res.get("paired_ratio_fused_over_serial"),
                   tick_check=res.get("tick_model_check"))


def _pipeline_rows(cal: Calibration, bench: PipeBench) -> tuple[list, list[str]]:
  """(rows (quantity, predicted, measured or None), notes) for one bench_pipeline workdir."""
  p, r = bench.problem, bench.data_replicas
  pred = predict_bench_pipeline(cal, p, bench.orders[bench.fused][0],
                                bench.orders[bench.serial][0], r)
  meas = bench.measured
  rows = [(f"serial step s ({bench.serial}, {pred['serial_ticks']} ticks)", pred["serial_s"],
           meas[bench.serial]),
          (f"fused step s ({bench.fused}, {pred['fused_ticks']} ticks)", pred["fused_s"],
           meas[bench.fused]),
          ("ratio fused / serial" + (" (measured: median of paired rounds)"
                                     if bench.paired_ratio is not None else ""),
           pred["ratio_fused_over_serial"],
           bench.paired_ratio if bench.paired_ratio is not None else
           meas[bench.fused] / meas[bench.serial])]
  for name, (order, barrier) in bench.orders.items():
    if name not in (bench.serial, bench.fused):
      got = predict_schedule_s(cal, p, order, barrier, r)
      rows.append((f"{name} step s ({got['ticks']} ticks)", got["step_s"], meas[name]))
  ded = pred["dedicated"]
  rows.append(("ratio fused / serial on dedicated devices (prediction only, no measurement)",
               ded["ratio_fused_over_serial"], None))
  ts, ex = stage_times(cal, p), cal.pipeline_executor
  ms = lambda xs: "/".join(f"{1e3 * x:.3g}" for x in xs)  # noqa: E731
  where = (f"one shared processor running {pred['parallel_tasks']} tasks at a time"
           if pred["parallel_tasks"] else "dedicated devices")
  notes = [f"Model (sim/lockstep.py): lockstep ticks of the orders the bench ran, each tick "
           f"= max(longest task, sum of its tasks / C) + tick overhead on {where} "
           f"({p.num_devices} stage devices x {r} data copies); measured inputs: tick overhead "
           f"{1e3 * ex.tick_overhead_s:.3g} ms, step overhead {1e3 * ex.step_overhead_s:.3g} ms, "
           f"per-stage ms actor F {ms(ts.actor_fwd)} B {ms(ts.actor_bwd)}, critic F "
           f"{ms(ts.critic_fwd)} B {ms(ts.critic_bwd)}. Dedicated devices: serial "
           f"{ded['serial_s']:.4g} s, fused {ded['fused_s']:.4g} s (same measured task and tick "
           "costs, one device per stage)."]
  chk = bench.tick_check
  if chk and chk.get("effective_parallel_tasks"):
    notes += [
        "", f"Check of the tick model in the bench (every device runs its actor backward at every "
        f"tick): {1e3 * chk['added_per_tick_s']:.3g} ms added per tick, the model predicts "
        f"{1e3 * chk['predicted_added_per_tick_s']:.3g} ms; "
        f"{chk['effective_parallel_tasks']:.2f} tasks effectively ran at once where the model "
        f"assumes {chk['host_cores']} (the host's cores)."]
  return rows, notes


def _default_calibration(workdir: str) -> Optional[Calibration]:
  """A bench's own calibration.json (written by bench_generation and bench_pipeline)."""
  path = os.path.join(workdir, "calibration.json")
  return cal_lib.load(path) if os.path.exists(path) else None


def _err_pct(pred: float, meas: float) -> str:
  return f"{(pred - meas) / meas * 100:+.1f}%"


def predict_bench_decode(result: dict, efficiency: Efficiency = Efficiency()) -> dict:
  """The uncalibrated simulator's decode step time per batch and PPO update time for a
  bench_decode result.json (None when no hardware preset matched its device)."""
  preset = result["device"].get("hardware_preset")
  if not preset:
    return None
  cost = CostModel(get_hardware(preset), efficiency)
  actor = decode_fit.bench_shape(result)
  critic = actor.as_critic()
  # KV tokens a step reads: the live prefix (decode_fit.points_from_results).
  decode = {p.batch: float(cost.decode_step_s(actor, 1, p.batch, p.context_tokens))
            for p in decode_fit.points_from_results([("result.json", result)])}
  tr = result["train"]
  seq = tr["prompt_len"] + tr["response_len"]
  tokens, ctx = tr["batch"] * seq, (seq + 1) / 2.0
  fwd = {name: float(cost.train_stage_fwd_s(shape, 1, 1, tokens, ctx, name))
         for name, shape in (("actor", actor), ("critic", critic))}
  update = sum((1.0 + cost.bwd_over_fwd()) * f for f in fwd.values()) + sum(
      cost.optimizer_step_s(shape, 1) for shape in (actor, critic))
  return {"hardware": preset, "decode_step_s": decode, "actor_fwd_s": fwd["actor"],
          "critic_fwd_s": fwd["critic"], "update_s": update}


def _decode_fit_rows(workdir: str, result: dict, efficiency: Efficiency,
                     extra: Sequence[str], fit_out: str = "") -> tuple[list[dict], list[str]]:
  """The fitted decode model (sim/decode_fit.py) on result.json and the `extra` result files of
  the same workdir (other depths): per point fitted, leave-one-out and uncalibrated. `fit_out`:
  also write the fit there as a calibration file (the simulator then models this engine)."""
  results = [("result.json", result)]
  for name in extra:
    path = os.path.join(workdir, name)
    if os.path.exists(path):
      results.append((name, _read(workdir, name)))
  points = decode_fit.points_from_results(results)
  hw = get_hardware(result["device"]["hardware_preset"])
  fitted = decode_fit.fit(points, hw, efficiency)
  loo = decode_fit.leave_one_out(points, hw, efficiency)
  cost = CostModel(hw, efficiency)
  rows = []
  for p, lo in zip(points, loo):
    pred = decode_fit.predict(fitted, hw, p)
    rows.append({"bench": "bench_decode", "quantity": p.label, "prediction": "fitted",
                 "source": p.source, "predicted": pred, "measured": p.measured_s,
                 "error": pred / p.measured_s - 1.0, "leave_one_out": lo,
                 "uncalibrated": float(cost.decode_step_s(p.shape, 1, p.batch,
                                                          p.context_tokens))})
  if fit_out:
    device = result["device"].get("device_kind") or result["device"]["hardware_preset"]
    wd.write_json(fit_out, cal_lib.to_dict(Calibration(device=str(device), decode_fit=fitted)))
  notes = [f"Fitted decode model ({len(points)} steps of {len(results)} result file(s): "
           f"{', '.join(n for n, _ in results)}): step_s {fitted.step_s:.3g} s, layer_s "
           f"{fitted.layer_s:.3g} s per layer, mfu {fitted.mfu:.3g}, bw_eff {fitted.bw_eff} "
           "(the cost model's, not fitted). Leave-one-out: each step predicted by a fit to "
           "the others; a step that alone decides a parameter shows the assumption it falls "
           "back to" + ("." if all(lo is not None for lo in loo) else
                        " ('-' where the others would be fewer than 3 steps, or all of one "
                        "depth).")]
  return rows, notes


def _fit_row_line(r: dict) -> str:
  """A fitted decode row in the markdown table ("-" where there is no leave-one-out)."""
  lo = r["leave_one_out"]
  return (f"| {r['quantity']} | {r['predicted']:.4g} | {'-' if lo is None else f'{lo:.4g}'} | "
          f"{r['uncalibrated']:.4g} | {r['measured']:.4g} | "
          f"{_err_pct(r['predicted'], r['measured'])} | "
          f"{'-' if lo is None else _err_pct(lo, r['measured'])} |")


def _decode_rows(result: dict, efficiency: Efficiency) -> tuple[list, list[str]]:
  pred = predict_bench_decode(result, efficiency)
  if pred is None:
    raise ValueError(f"device {result['device'].get('device_kind')!r} matched no hardware "
                     "preset (sim/hardware.py), so there is no datasheet peak to predict from")
  rows = [(f"decode step, batch {r['batch']} (s)", pred["decode_step_s"][int(r["batch"])],
           r["step_s"]) for r in result["decode"]["per_batch"]]
  tr = result["train"]
  rows += [("actor forward (s)", pred["actor_fwd_s"], tr["actor_fwd_s"]),
           ("critic forward (s)", pred["critic_fwd_s"], tr["critic_fwd_s"]),
           ("PPO update, actor + critic (s)", pred["update_s"], tr["step_s"])]
  bw = [r.get("bw_fraction") for r in result["decode"]["per_batch"]]
  notes = [f"Uncalibrated: datasheet preset `{pred['hardware']}` with the assumed efficiencies "
           f"(decode_bw_eff {efficiency.decode_bw_eff}, train_mfu {efficiency.train_mfu}, "
           f"bwd_over_fwd {efficiency.bwd_over_fwd}). Measured on "
           f"{result['device'].get('device_kind')}: decode reached "
           + ", ".join(f"{100 * f:.0f}%" for f in bw if f is not None)
           + f" of peak HBM bandwidth, the update {100 * (tr.get('mfu') or 0):.0f}% MFU."]
  return rows, notes


def _row(bench: str, quantity: str, predicted: float, measured: Optional[float],
         prediction: str) -> dict:
  return {"bench": bench, "quantity": quantity, "prediction": prediction,
          "predicted": float(predicted), "measured": None if measured is None else float(measured),
          "error": None if measured is None else float(predicted) / float(measured) - 1.0}


def validation_lines(calibration: Optional[Calibration], gen_workdir: str,
                     pipe_workdir: str, decode_workdir: str = "",
                     efficiency: Efficiency = Efficiency()) -> list[str]:
  """Markdown lines of validate()."""
  return validate(calibration, gen_workdir, pipe_workdir, decode_workdir, efficiency)[0]


def validate(calibration: Optional[Calibration], gen_workdir: str, pipe_workdir: str,
             decode_workdir: str = "", efficiency: Efficiency = Efficiency(),
             decode_extra: Sequence[str] = (), decode_fit_out: str = ""
             ) -> tuple[list[str], list[dict], list[tuple[str, str]]]:
  """(markdown lines, rows, skipped): predicted vs measured for each bench, or why there is
  nothing to compare (module docstring); skipped: (bench, reason) of each bench given a workdir
  that was not compared. `decode_fit_out`: where to write the fitted decode model as a
  calibration file (`--config.calibration=` it to simulate the measured engine).

  `calibration` None: each bench is predicted with its own `<workdir>/calibration.json` (the
  costs measured on the machine and in the run it is compared with)."""
  lines, table, skipped = [], [], []

  def skip(name: str, reason: str) -> None:
    lines.append(f"- **{name}**: {reason}")
    skipped.append((name, reason.replace("`", "")))

  for name, wd_path in (("bench_generation", gen_workdir), ("bench_pipeline", pipe_workdir),
                        ("bench_decode", decode_workdir)):
    if not wd_path:
      lines.append(f"- **{name}**: no workdir given (`--config.validate.{name}_workdir`); "
                   "nothing compared.")
      continue
    if not os.path.exists(os.path.join(wd_path, "result.json")):
      skip(name, f"`{wd_path}/result.json` does not exist; nothing compared.")
      continue
    notes: list[str] = []
    if name == "bench_decode":
      try:
        result = _read(wd_path, "result.json")
        rows, notes = _decode_rows(result, efficiency)
      except (ValueError, FileNotFoundError, KeyError) as e:
        skip(name, f"could not compare: {e}")
        continue
      try:
        fit_rows, fit_notes = _decode_fit_rows(wd_path, result, efficiency, decode_extra,
                                               decode_fit_out)
      except (ValueError, KeyError) as e:
        fit_rows, fit_notes = [], [f"No fitted decode model: {e}."]
      lines += [f"- **{name}** (`{wd_path}`, no calibration: datasheet and assumed efficiencies):",
                "", "| quantity | predicted | measured | error |", "|---|---|---|---|"]
      lines += [f"| {q} | {p:.4g} | {m:.4g} | {_err_pct(p, m)} |" for q, p, m in rows]
      lines += [""] + notes + [""]
      if fit_rows:
        lines += [f"- **{name}**, fitted decode model (sim/decode_fit.py):", "",
                  "| quantity | fitted | leave-one-out | uncalibrated | measured | "
                  "error (fitted) | error (leave-one-out) |", "|---|---|---|---|---|---|---|"]
      lines += [_fit_row_line(r) for r in fit_rows]
      lines += [""] + fit_notes + [""]
      table += [_row(name, q, p, m, "uncalibrated") for q, p, m in rows] + fit_rows
      continue
    try:
      cal = calibration if calibration is not None else _default_calibration(wd_path)
      if cal is None:
        skip(name, "result found but no calibration of the machine it ran on "
             f"(`--config.validate.calibration`, or `{wd_path}/calibration.json`); "
             "nothing compared.")
        continue
      if name == "bench_generation":
        spec, meas = gen_bench_from_workdir(wd_path)
        pred = predict_bench_generation(cal, spec)
        rows = [("baseline gen_plus_inf_s", pred["baseline"]["gen_plus_inf_s"],
                 meas["baseline"]),
                ("fused gen_plus_inf_s", pred["fused"]["gen_plus_inf_s"], meas["fused"]),
                ("ratio fused / baseline", pred["ratio_fused_over_baseline"],
                 meas["fused"] / meas["baseline"])]
      else:
        rows, notes = _pipeline_rows(cal, pipeline_bench_from_workdir(wd_path))
    except (ValueError, FileNotFoundError, KeyError) as e:
      skip(name, f"could not compare: {e}")
      continue
    lines += [f"- **{name}** (`{wd_path}`, calibration `{cal.path}`):", "",
              "| quantity | predicted | measured | error |", "|---|---|---|---|"]
    lines += [f"| {q} | {p:.4g} | {m:.4g} | {_err_pct(p, m)} |" if m is not None else
              f"| {q} | {p:.4g} | - | - |" for q, p, m in rows]
    lines += [""] + notes + ([""] if notes else [])
    table += [_row(name, q, p, m, "calibrated") for q, p, m in rows]
  return lines, table, skipped
