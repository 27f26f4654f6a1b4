"""`ablations.md`: per-setting tables, speedups, every input of the numbers, and validation."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import cost_model, hardware, shapes

EXISTING = ("deepspeed_chat_like", "realhf_like")  # stand-ins for "existing systems"


def _f(x: Optional[float], nd: int = 2) -> str:
  return "n/a" if x is None else f"{x:.{nd}f}"


def _by_setting(rows: Sequence[dict]) -> dict:
  out: dict = {}
  for r in rows:
    out.setdefault(r["setting"]["label"], {})[r["system"]] = r
  return out


def summary_table(rows: Sequence[dict], systems: Sequence[str]) -> list[str]:
  grid = _by_setting(rows)
  lines = ["| setting | " + " | ".join(systems) + " | rlhfuse vs base | rlhfuse vs best existing |",
           "|---|" + "---|" * (len(systems) + 2)]
  for label, by in grid.items():
    cells = [_f(by[s]["iteration_s"]) if s in by else "-" for s in systems]
    vs_base = vs_ex = "-"
    if "rlhfuse" in by and "rlhfuse_base" in by:
      vs_base = f"{by['rlhfuse_base']['iteration_s'] / by['rlhfuse']['iteration_s']:.2f}x"
    ex = [s for s in EXISTING if s in by]
    if "rlhfuse" in by and ex:
      best = min(ex, key=lambda s: by[s]["iteration_s"])
      vs_ex = (f"{by[best]['iteration_s'] / by['rlhfuse']['iteration_s']:.2f}x "
               f"({best})")
    lines.append(f"| {label} | " + " | ".join(cells) + f" | {vs_base} | {vs_ex} |")
  return lines


def mechanism_table(rows: Sequence[dict]) -> list[str]:
  """Per setting: what each fusion did (Rt chosen, migration, schedule makespans)."""
  lines = ["| setting | gen tp x instances | Rt chosen | migration | gen+inf base -> fused (s) | "
           "pipeline ms/mini-batch serial -> fused (LB) |", "|---|---|---|---|---|---|"]
  for label, by in _by_setting(rows).items():
    inter, intra, base = by.get("inter_stage"), by.get("intra_stage"), by.get("rlhfuse_base")
    gp = (inter or base or {}).get("details", {}).get("gen_plan")
    cells = [f"{gp['tp']} x {gp['num_instances']}" if gp else "-", "-", "-", "-", "-"]
    if inter:
      d = inter["details"]
      cells[1] = f"{d['threshold']:g}"
      cons = d["gen"]["consolidations"]
      cells[2] = (f"{cons[0]['moves']} samples, {cons[0]['moved_bytes'] / 1e9:.1f} GB, kept "
                  f"{cons[0]['kept']}" if cons else "none")
      if base:
        cells[3] = f"{base['gen_plus_inf_s']:.2f} -> {inter['gen_plus_inf_s']:.2f}"
    if intra and "search" in intra["details"]["train"]:
      sr = intra["details"]["train"]["search"]
      cells[4] = f"{sr['serial']:.0f} -> {sr['makespan']:.0f} ({sr['lower_bound']:.0f})"
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return lines


def setting_section(label: str, by: dict, systems: Sequence[str]) -> list[str]:
  sys_here = [s for s in systems if s in by]
  lines = [f"### {label}", "",
           "| system | iteration_s | gen_s | inf_s (exposed) | gen_plus_inf_s | train_s | "
           "reshard_s | samples/s |", "|---|---|---|---|---|---|---|---|"]
  for s in sys_here:
    r = by[s]
    lines.append(f"| {s} | {_f(r['iteration_s'])} | {_f(r['gen_s'])} | {_f(r['inf_s'])} | "
                 f"{_f(r['gen_plus_inf_s'])} | {_f(r['train_s'])} | {_f(r['reshard_s'])} | "
                 f"{_f(r['samples_per_s'], 1)} |")
  lines += ["", "Speedup of the row system over the column system (column iteration time / row "
            "iteration time):", "",
            "| | " + " | ".join(sys_here) + " |", "|---|" + "---|" * len(sys_here)]
  for a in sys_here:
    lines.append(f"| {a} | " + " | ".join(
        f"{by[b]['iteration_s'] / by[a]['iteration_s']:.2f}" for b in sys_here) + " |")
  lines += ["", "Plans and mechanisms:", ""]
  for s in sys_here:
    d = by[s]["details"]
    bits = []
    if "gen_plan" in d:
      gp = d["gen_plan"]
      bits.append(f"generation tp={gp['tp']} x {gp['num_instances']} instances, "
                  f"{gp['slots']} slots")
      if gp.get("inference_pp", 1) > 1:
        bits.append(f"inference on pipelines of {gp['inference_pp']} instances (the frozen "
                    "models do not fit on one beside the training state)")
    if d.get("gen_tp"):
      bits.append(f"generation tp={d['gen_tp']} (smallest that fits)")
    if d.get("threshold") is not None:
      bits.append(f"Rt={d['threshold']:g}")
      for c in d.get("gen", {}).get("consolidations", []):
        bits.append(f"consolidated at {c['time_s']:.2f}s: {c['unfinished']} unfinished, "
                    f"kept {c['kept']} instances, {c['moves']} moves, "
                    f"{c['moved_bytes'] / 1e9:.2f} GB in {c['migration_s'] * 1e3:.1f} ms")
      if d.get("gen"):
        bits.append(f"inference overlap {d['gen']['inference_overlap_frac']:.0%}")
    tr = d.get("train")
    if isinstance(tr, dict):
      if "plan" in tr and isinstance(tr["plan"], dict) and "tp" in tr["plan"]:
        p = tr["plan"]
        bits.append(f"train plan tp={p['tp']} Pa/Pc={p['actor_pp']}/{p['critic_pp']} "
                    f"dp={p['dp']} Ma/Mc={p['Ma']}/{p['Mc']}")
      if "schedule" in tr:
        bits.append(f"{tr['schedule']} pipeline {tr['pipeline_ms']:.1f} ms/mini-batch")
      if "search" in tr:
        sr = tr["search"]
        bits.append(f"(serial {sr['serial']:.1f}, greedy {sr['greedy']:.1f}, lower bound "
                    f"{sr['lower_bound']:.1f} ms; search {sr['search_s']:.1f}s)")
      if tr.get("mode") == "disjoint_concurrent":
        bits.append(f"actor on {tr['actor']} and critic on {tr['critic']} concurrently")
      if tr.get("mode") == "colocated_serial_1f1b":
        bits.append("colocated serial 1F1B (faster than a disjoint split here)")
    if d.get("train") == "zero3":
      bits.append("ZeRO-3 inference and training over all devices")
    if "plan" in d and "summary" in d["plan"]:  # pipe_rlhf, rlhfuse_planned, pipe_rlhf_async
      bits.append(f"searched plan: {d['plan']['summary']} (search {d['search_s']:.1f}s)")
      a = d.get("async")
      if a and a["colocated"]:
        bits.append(f"async (k={a['staleness']}): no split of the devices beats the "
                    "synchronous plan, so both groups stay on all devices and run serially")
      elif a:
        fit = sum("iteration_s" in sp for sp in a["splits"])
        bits.append(f"async (k={a['staleness']}): generation + inference on "
                    f"{a['generation_devices']} devices overlap training on "
                    f"{a['training_devices']} ({a['bound']} is the slower group; serial on the "
                    f"same groups {a['serial_s']:.2f}s; {fit} of {len(a['splits'])} splits fit)")
      if d.get("uniform"):
        u = d["uniform"]
        bits.append(f"best uniform layout tp{u['layout']['tp']} pp{u['layout']['pp']}: "
                    f"{u['predicted']['iteration_s']:.2f}s")
      if isinstance(d.get("gen"), dict) and d["gen"].get("mode") == "inter_stage_fusion":
        bits.append(f"inter-stage fusion on tp{d['gen']['tp']} instances instead "
                    f"(Rt={d['gen']['threshold']:g})")
      if isinstance(tr, dict) and tr.get("mode") == "fused":
        p = tr["plan"]
        bits.append(f"fused schedule on tp{p['tp']} Pa/Pc={p['actor_pp']}/{p['critic_pp']} "
                    "instead")
    lines.append(f"- **{s}**: " + "; ".join(bits))
  return lines + [""]


def _protocol(p: dict, link: str = "on NVLink") -> str:
  """One collective protocol of sim/hardware.py in words (microseconds)."""
  in_node = p.get("bw_fraction_in_node") or 0.0
  return (f"{p['name']}: {p['base_s'] * 1e6:g} µs a call + {p['intra_step_s'] * 1e6:g} µs a "
          f"ring step {link}, {p['inter_step_s'] * 1e6:g} µs across nodes; bandwidth × "
          f"{p['bw_fraction']:g}" + (f" (× {in_node:.3g} for other collectives in a node)"
                                     if in_node else ""))


def constants_section(hw: dict, eff: dict, cal=False) -> list[str]:
  """The hardware's figures (each preset's cited in sim/hardware.py) and the cost model's
  efficiencies, each with its default's source and whether the config set it: what every
  simulated time rests on (ablations.md, plan_search.md); with `cal` (a Calibration.describe()
  or None: none given) which costs a calibration measured (calibration_line)."""
  lines = [f"**Hardware preset `{hw['name']}`** ({hw['source']}; per device, per direction):", "",
           "| field | value |", "|---|---|"]
  units = {"peak_flops": ("TFLOP/s", 1e12), "hbm_bw": ("GB/s", 1e9), "hbm_bytes": ("GB", 1e9),
           "intra_node_bw": ("GB/s", 1e9), "inter_node_bw": ("GB/s", 1e9),
           "host_to_device_bw": ("GB/s", 1e9)}
  protocols = hw.get("collective_protocols")
  for k, v in hw.items():
    if k in units and v is not None:
      lines.append(f"| {k} | {v / units[k][1]:g} {units[k][0]} |")
    elif k == "collective_protocols" and v:
      # The α of every collective (docs/simulator.md, Cost model), readable and cited (a
      # hardware file's own are its, not NCCL's).
      nccl = list(v) == [dataclasses.asdict(p) for p in hardware.NCCL_RING]
      lines.append(f"| {k} (" + ("NCCL's Ring constants, `src/graph/tuning.cc`" if nccl else
                                 "the hardware file's") + "; each collective takes the cheaper) | "
                   + "; ".join(_protocol(p, "on NVLink" if nccl else "inside a node")
                               for p in v) + " |")
    elif k == "collective_protocols":
      lines.append(f"| {k} | none: efficiency.collective_latency_s per call |")
    elif k not in ("name", "source"):
      lines.append(f"| {k} | {v} |")
  defaults = dataclasses.asdict(cost_model.Efficiency())
  lines += ["", "**Efficiency and other non-datasheet constants** (details in "
            "`rlhfuse_jax/sim/cost_model.py`, `Efficiency`; `config`: set away from the "
            "default):", "", "| field | value | set by | source of the default |",
            "|---|---|---|---|"]
  lines += [f"| {k} | {v}" + (" (unused: this hardware's collective_protocols give the α)"
                              if k == "collective_latency_s" and protocols else "")
            + f" | {'default' if v == defaults.get(k) else 'config'} | "
            f"{cost_model.EFFICIENCY_SOURCES.get(k, '')} |" for k, v in eff.items()]
  if cal is not False:
    lines += ["", calibration_line(cal)]
  return lines


def calibration_line(cal: Optional[dict]) -> str:
  """Which costs a calibration file measured (Calibration.describe()) and which come from the
  formulas with the constants above."""
  if cal is None:
    return ("**Calibration**: none: every time from the formulas of "
            "`rlhfuse_jax/sim/cost_model.py` with the figures and efficiencies above.")
  measured = [op for op in calibration.OPS if op in cal]
  # a decode_step table or a decode_fit times decode: the other is not missed
  ops = [op for op in calibration.OPS if op in measured or not (
      op in ("decode_step", "decode_fit") and {"decode_step", "decode_fit"} & set(measured))]
  when = ", ".join(f"{k} {v}" for k, v in (cal.get("measured") or {}).items())
  return (f"**Calibration** `{cal['path']}` ({cal['device']}" + (f"; {when}" if when else "")
          + f"): measured, in place of the formulas: {', '.join(measured) or 'nothing'}; not "
          f"measured, from the formulas with the figures and efficiencies above: "
          f"{', '.join(op for op in ops if op not in measured) or 'nothing'} "
          "(rlhfuse_jax/policy/calibration.py says what each op times).")


def inputs_section(inputs: dict) -> list[str]:
  lines = ["## Inputs (every number above follows from these)", ""]
  lines += constants_section(inputs["hardware"], inputs["efficiency"])
  # A result.json written before shape_sources existed held only the presets.
  sources = inputs.get("shape_sources", {})
  lines += ["", "**Model shapes** (critic and reward model = same backbone with a scalar "
            "head):", "",
            "| shape | layers | hidden | ffn | heads | params (lm head) | source |",
            "|---|---|---|---|---|---|---|"]
  for name, s in inputs["shapes"].items():
    lines.append(f"| {name} | {s['num_layers']} | {s['hidden_size']} | "
                 f"{s['intermediate_size']} | {s['num_heads']} | {s['num_params'] / 1e9:.2f}B | "
                 f"{sources.get(name, shapes.PRESET_SOURCE)} |")
  w = inputs["workload"]
  lines += ["", f"**Workload**: {w['num_devices']} devices, global batch {w['global_batch']} "
            f"prompts (1 sample each), mini-batch {w['minibatch']}, {w['epochs']} PPO epoch(s), "
            f"micro-batch {w['micro_batch']} sample(s), seed {w['seed']}.", "",
            f"**Prompt lengths**: {inputs['prompt_lengths']}. "
            f"**Response lengths**: {inputs['response_lengths']}, clipped at each setting's max "
            "generation length. Sampled (same draw for every system of a setting):", "",
            "| setting | prompt mean / p50 / max | response mean / p50 / p90 / p99 / max | "
            "at limit |", "|---|---|---|---|"]
  for label, li in inputs["lengths_sampled"].items():
    p, r = li["prompt"], li["response"]
    lines.append(f"| {label} | {p['mean']:.0f} / {p['p50']:.0f} / {p['max']} | "
                 f"{r['mean']:.0f} / {r['p50']:.0f} / {r['p90']:.0f} / {r['p99']:.0f} / "
                 f"{r['max']} | {r['clip_frac']:.1%} |")
  lines += ["", "**Simulator options**: `" + json.dumps(inputs["sim_options"]) + "`", "",
            "**Calibration**: " + ("none (all costs from the formulas of cost_model.py)"
                                   if inputs["calibration"] is None else
                                   "`" + json.dumps(inputs["calibration"]) + "`"), ""]
  return lines


def write_markdown(path: str, rows: Sequence[dict], systems: Sequence[str], inputs: dict,
                   validation: list[str], command: str, figures: Sequence[str],
                   wall_s: float, made: str = "") -> None:
  """ablations.md; `made`: the code and machine that ran it (the fused schedule searches are
  limited by wall-clock time, so their results depend on the CPU)."""
  lines = ["# Simulated RLHF ablations", "",
           f"Produced by `{command}`{f' ({made})' if made else ''} in {wall_s:.0f} s. All "
           "times are simulated seconds for one PPO iteration (generation, inference, "
           "training) from `rlhfuse_jax/sim/`; nothing here was measured on the simulated "
           "hardware. Systems are defined in `rlhfuse_jax/sim/iteration_sim.py`.", "",
           "Figures: " + ", ".join(f"`{f}`" for f in figures), "",
           "## Iteration time (s) per setting and system", ""]
  lines += summary_table(rows, systems)
  lines += ["", "The RLHFuse paper reports up to 3.7x training throughput over existing "
            "systems; here 'existing' are the DeepSpeed-Chat-like and ReaLHF-like models of "
            "those systems, whose gaps come entirely from the inputs listed below.", "",
            "## What each fusion did", ""]
  lines += mechanism_table(rows)
  lines += ["", "## Per setting", ""]
  for label, by in _by_setting(rows).items():
    lines += setting_section(label, by, systems)
  lines += inputs_section(inputs)
  lines += ["## Validation against measured runs", ""] + list(validation) + [""]
  from rlhfuse_jax import workdir as wd
  wd.atomic_write_text(path, "\n".join(lines) + "\n")
