"""The ablation binary end to end on its quick variant (one setting, all six systems)."""
import dataclasses
import json
import os
import shlex
import subprocess
import sys

import pytest

from rlhfuse_jax.sim import ablations, iteration_sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_binary_writes_rows_report_and_figures(tmp_path):
  # Prepend, keep the rest: packages installed with --target are found through PYTHONPATH.
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  # A bench workdir whose result cannot be compared: the run goes on and warns about it.
  (tmp_path / "gen").mkdir()
  (tmp_path / "gen" / "result.json").write_text("{}")
  # A workdir with a space: the report's command must quote it to be re-runnable.
  cmd = [sys.executable, "-m", "experiments.reproduce_ablations",
         "--config=configs/ablations.py:quick", f"--workdir={tmp_path / 'w d'}",
         "--config.sim.search_time_s=0.3",
         f"--config.validate.bench_generation_workdir={tmp_path / 'gen'}"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "setting 1/1" in proc.stderr  # progress output
  warnings = [line for line in proc.stderr.splitlines() if "validation: " in line]
  assert len(warnings) == 1 and warnings[0].startswith("W") and \
      "validation: bench_generation: result found but no calibration" in warnings[0], warnings
  tmp_path = tmp_path / "w d"
  result = json.loads((tmp_path / "result.json").read_text())
  rows = result["rows"]
  assert {r["system"] for r in rows} == set(iteration_sim.SYSTEMS)
  for r in rows:
    assert set(r["setting"]) >= {"actor", "critic", "max_new_tokens"}
    for f in ("iteration_s", "gen_s", "inf_s", "gen_plus_inf_s", "train_s", "samples_per_s"):
      assert r[f] > 0 or f == "inf_s"
  # The headline figures as scalars, which a sweep's summary keeps (it drops the rows' list):
  # {label: {system: iteration_s}}.
  assert result["iteration_s"] == {rows[0]["setting"]["label"]: {
      r["system"]: r["iteration_s"] for r in rows}}
  assert all(isinstance(v, float) for d in result["iteration_s"].values() for v in d.values())
  md = (tmp_path / "ablations.md").read_text()
  for needle in ("## Iteration time", "Speedup of the row system", "## Inputs",
                 "peak_flops", "train_mfu", "llama-13b", "Response lengths",
                 "## Validation against measured runs"):
    assert needle in md, needle
  command = result["provenance"]["command"]
  made = result["provenance"]
  # The code and machine beside the command: the fused searches are limited by wall-clock time.
  assert (f"Produced by `{command}` (at commit {made['git_commit']}, {made['started'][:10]}, "
          f"on {made['host_cpu']}) in ") in md
  assert shlex.split(command)[3:] == cmd[3:], command  # after `python -m experiments...`
  for png in ("iteration_time.png", "generation_timeline.png", "fused_gantt.png"):
    assert (tmp_path / png).stat().st_size > 10000
  assert json.loads((tmp_path / "config.json").read_text())["sim"]["search_time_s"] == 0.3


def test_config_errors_name_the_field():
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config()
  c.pairs = "llama-13b"
  with pytest.raises(ValueError, match=r"^config\.pairs: 'llama-13b' must be 'actor/critic'"):
    ablations.AblationConfig.from_config_dict(c)
  c = cfg_mod.get_config()
  c.systems = "rlhfuse,verl"
  with pytest.raises(ValueError, match="^config\\.systems: unknown \\['verl'\\]"):
    ablations.AblationConfig.from_config_dict(c)
  c = cfg_mod.get_config()
  c.minibatch = 60
  with pytest.raises(ValueError, match=r"^config\.global_batch=512 must be divisible by "
                                       r"config\.minibatch=60"):
    ablations.AblationConfig.from_config_dict(c)
  c = cfg_mod.get_config()
  c.pairs = "llama-99b/llama-13b"  # the message named the shape, not the field that gave it
  with pytest.raises(ValueError, match=r"^config\.pairs: unknown model shape 'llama-99b'"):
    ablations.AblationConfig.from_config_dict(c)
  # Rt candidates outside [0, 1] failed inside the simulation, named as an internal field.
  for value in ("0.1,2", "0.1,x"):
    c = cfg_mod.get_config()
    c.sim.threshold_candidates = value
    with pytest.raises(ValueError, match=rf"config\.sim\.threshold_candidates='{value}': "
                                         r"expected comma-separated Rt values in \[0, 1\]"):
      ablations.AblationConfig.from_config_dict(c)
  cfg = ablations.AblationConfig.from_config_dict(cfg_mod.get_config())
  assert len(cfg.settings()) == 12 and cfg.systems == iteration_sim.SYSTEMS


def test_sequences_longer_than_a_models_context_are_warned_of():
  """Nothing read a shape's max_seq_len: the papers' L=2048 settings size rows at 1024 + 2048
  positions, past LLaMA-1's 2048, and a model of 256 positions (calibrate_sim's, an HF
  config's max_position_embeddings) was simulated at L=512, both without a word."""
  from configs import ablations as cfg_mod
  from rlhfuse_jax.sim import shapes
  cfg = ablations.AblationConfig.from_config_dict(cfg_mod.get_config())
  lines = ablations.context_warnings(cfg)
  assert [line.split(":")[0] for line in lines] == [
      "13B/13B L=2048", "33B/13B L=2048", "33B/13B L=2048", "65B/33B L=2048",
      "65B/33B L=2048", "65B/65B L=2048"], lines
  assert "llama-13b holds 2048 positions" in lines[0] and "sized at 3072" in lines[0]
  mine = shapes.from_hf_config(os.path.join(ROOT, "tests", "fixtures", "tiny_llama"), "mine")
  cfg = dataclasses.replace(cfg, pairs=(("mine", "mine"),), max_new_tokens=(512,),
                            shapes=(("mine", mine),), figure_setting=0)
  lines = ablations.context_warnings(cfg)
  assert len(lines) == 1 and lines[0].startswith("mine/mine L=512: mine holds 256 positions")
  assert "sized at 1536" in lines[0] and "489 of the 512 sampled" in lines[0], lines
  cfg = ablations.AblationConfig.from_config_dict(cfg_mod.get_config("quick"))
  assert ablations.context_warnings(cfg) == []  # 13B/13B L=512: 1024 + 512 positions


@pytest.mark.parametrize("field", ["num_devices", "global_batch", "minibatch", "epochs",
                                   "micro_batch"])
def test_a_count_below_one_is_refused_by_name(field):
  """minibatch=0 was a ZeroDivisionError traceback, and num_devices=0 in plan_search's train
  variant a jax backend error (it asked for 0 fake CPU devices) naming no field."""
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config()
  c[field] = 0
  with pytest.raises(ValueError, match=rf"^config\.{field}=0: expected an integer >= 1$"):
    ablations.AblationConfig.from_config_dict(c)


@pytest.mark.parametrize("section,field,value,expected", [
    ("efficiency", "train_mfu", "0.4", "a number"), ("efficiency", "net_eff", True, "a number"),
    ("", "hardware", 5, "a preset name or the path of a hardware JSON file")])
def test_a_config_file_field_of_the_wrong_type_is_refused_by_name(section, field, value,
                                                                    expected):
  """Reachable by editing a config file (the command line's ConfigDict checks types): "0.4"
  failed as a TypeError of '<', a hardware of 5 as an AttributeError of str.endswith."""
  import ml_collections
  from configs import ablations as cfg_mod
  d = cfg_mod.get_config().to_dict()
  (d[section] if section else d)[field] = value
  name = f"{section}.{field}" if section else field
  with pytest.raises(ValueError, match=rf"^config\.{name}={value!r}: expected {expected}$"):
    ablations.AblationConfig.from_config_dict(ml_collections.ConfigDict(d))
  # numpy numbers are numbers (np.float64 subclasses float; these do not)
  import numpy as np
  from rlhfuse_jax.sim.cost_model import Efficiency
  assert Efficiency(net_eff=np.float32(0.5), train_mfu=np.float16(0.25)).net_eff == 0.5


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_search_budget_that_is_not_a_positive_time_is_refused_by_name(value):
  """sim.search_time_s=0 was accepted and failed in the first fused search, after
  reproduce_ablations had moved the earlier outputs aside and compiled its kernels, as
  "time_budget_s=0.0 must be > 0" (no field named)."""
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.sim.search_time_s = value
  with pytest.raises(ValueError, match=rf"^config\.sim\.search_time_s={value!r} must be a "
                                       r"finite number of seconds > 0$"):
    ablations.AblationConfig.from_config_dict(c)


def test_responses_that_no_max_new_tokens_admits_are_refused_by_name():
  """response.min_len (or a constant length) above a max_new_tokens, which clips the responses,
  was accepted and failed where the lengths were drawn, after the binaries had moved the
  earlier outputs aside, as "lengths: need 1 <= min_len=600 <= max_len=512"."""
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.response.min_len = 600
  with pytest.raises(ValueError, match=r"^config\.response with max_len = config\."
                                       r"max_new_tokens=512: lengths: need 1 <= min_len=600"):
    ablations.AblationConfig.from_config_dict(c)
  c = cfg_mod.get_config("quick")
  c.response.kind, c.response.value = "constant", 600
  with pytest.raises(ValueError, match=r"max_new_tokens=512: lengths: constant value=600"):
    ablations.AblationConfig.from_config_dict(c)
  c.max_new_tokens = "1024"
  ablations.AblationConfig.from_config_dict(c)


def test_an_empirical_lengths_file_is_read_with_the_config(tmp_path):
  """A lengths file without lengths was accepted (only its existence was checked) and failed
  where the lengths were drawn, after the binaries had moved the earlier outputs aside."""
  from configs import ablations as cfg_mod
  (tmp_path / "l.json").write_text("[]")
  c = cfg_mod.get_config("quick")
  c.response.kind, c.response.path = "empirical", str(tmp_path / "l.json")
  with pytest.raises(ValueError, match=r"^config\.response\.path: lengths file .* holds no "
                                       r"lengths"):
    ablations.AblationConfig.from_config_dict(c)
  (tmp_path / "l.json").write_text("[300, 700]")
  ablations.AblationConfig.from_config_dict(c)


def test_offloading_frozen_models_needs_a_host_link():
  """A TPU preset (no host_to_device_bw) with sim.offload_frozen=True, the default, was accepted
  and failed in the first simulated inference, after the outputs had moved aside."""
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.hardware = "tpu_v5p"
  with pytest.raises(ValueError, match=r"^config\.sim\.offload_frozen=True: config\.hardware="
                                       r"'tpu_v5p' has no host_to_device_bw"):
    ablations.AblationConfig.from_config_dict(c)
  c.sim.offload_frozen = False
  ablations.AblationConfig.from_config_dict(c)


def test_a_negative_seed_is_refused_by_name():
  """seed=-1 was accepted and failed where the lengths were sampled, after the binary had
  moved the earlier outputs aside, as numpy's "expected non-negative integer"."""
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.seed = -1
  with pytest.raises(ValueError, match=r"^config\.seed=-1: expected an integer >= 0$"):
    ablations.AblationConfig.from_config_dict(c)
  c.seed = 0
  ablations.AblationConfig.from_config_dict(c)


def test_a_calibration_of_another_model_or_machine_is_refused(tmp_path):
  """config.calibration: calibrate_sim's file (a 0.1M-parameter model on 8 fake CPU devices)
  timed a 13B/13B iteration on 64 H100s as 15.2 s instead of 6.2 s and reordered the systems,
  silently. Ops measured on one model time that model only; fake CPU devices no accelerator."""
  from configs import ablations as cfg_mod

  def cost(cal):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "rlhfuse_jax.sim.calibration/v1", "device": "test",
                                **cal}))
    c = cfg_mod.get_config()
    c.pairs = "llama-13b/llama-13b"
    c.calibration = str(path)
    return ablations.cost_model(ablations.AblationConfig.from_config_dict(c))
  step = {"decode_step": {"occupied_slots": [1, 4], "seconds": [0.01, 0.02]}}
  with pytest.raises(ValueError, match=r"measured on devices that share one processor"):
    cost({"devices_share_compute": True, "ops": step, "model_params": 106816})
  with pytest.raises(ValueError, match=r"measured \['decode_step'\] on a model of 106,816 "
                     r"parameters, and the simulated actors have 13,0"):
    cost({"ops": step, "model_params": 106816})
  with pytest.raises(ValueError, match=r"has measured \['decode_step'\] but no model_params"):
    cost({"ops": step})
  size = ablations.AblationConfig.from_config_dict(cfg_mod.get_config()).shape(
      "llama-13b").num_params()
  assert cost({"ops": step, "model_params": size}).cal.decode_step is not None
  # Rates of bytes time any model.
  assert cost({"ops": {"migration": {"bytes_per_s": 1e9}}}).cal.migration is not None


def _drawn_figure(monkeypatch) -> list:
  """The figures the plots save (savefig skipped), read before they are closed."""
  import matplotlib.figure
  figs = []
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: figs.append(
      (fig, [ax.get_title() for ax in fig.axes if ax.get_title()],
       [ax for ax in fig.axes if ax.get_legend() is not None], len(fig.legends))))
  return figs


def test_the_generation_timeline_names_the_setting_it_shows(monkeypatch, tmp_path):
  # A run simulates 12 settings and draws one (config.figure_setting): each panel's title says
  # which, as fused_gantt.png's does. Its legend sits under the panels, not on the first
  # panel's bars (it hid the last instances' inference).
  import types
  from rlhfuse_jax.sim import plots
  figs = _drawn_figure(monkeypatch)
  res = types.SimpleNamespace(
      gen_end_s=1.0, gen_plus_inf_s=1.5, instance_busy_frac=1.0, consolidations=[],
      segments=[(0, 0.0, 0.5, "prefill"), (0, 0.5, 1.0, "decode")],
      unfinished_curve=[(0.0, 2), (1.0, 0)])
  plots.plot_generation_timelines([("without consolidation", res), ("streaming", res)],
                                  str(tmp_path / "t.png"), setting="65B/65B L=2048")
  (_, titles, axes_with_legend, fig_legends), = figs
  assert [t.split(":")[0] for t in titles] == [
      "65B/65B L=2048, without consolidation", "65B/65B L=2048, streaming"]
  assert (axes_with_legend, fig_legends) == ([], 1)


def test_the_gantt_legend_sits_under_the_panels(monkeypatch, tmp_path):
  import types
  from rlhfuse_jax.sim import plots
  figs = _drawn_figure(monkeypatch)
  task = types.SimpleNamespace(model="actor", kind="F", start=0.0, end=1.0)
  sched = types.SimpleNamespace(makespan=1.0, devices=[[task], [task]])
  plots.plot_schedules([("fused", sched), ("serial", sched)], str(tmp_path / "g.png"))
  (_, titles, axes_with_legend, fig_legends), = figs
  assert (titles, axes_with_legend, fig_legends) == (["fused", "serial"], [], 1)


def test_the_report_names_where_each_model_shape_comes_from(tmp_path, monkeypatch):
  # ablations.md credited every shape to LLaMA-1's paper, also a model of the user's own
  # (config.shapes, read from its HF config.json).
  from rlhfuse_jax.sim import report, shapes
  mine = shapes.from_hf_config(os.path.join(ROOT, "tests", "fixtures", "tiny_llama"), "mine")
  monkeypatch.setattr(ablations.it, "simulate_iteration", lambda cost, wl, opt, systems, cache,
                      log=None: ({s: {**{f: 1.0 for f in ablations.ROW_FIELDS}, "details": {}}
                                  for s in systems}, {}))
  cfg = ablations.AblationConfig(num_devices=16, global_batch=64, minibatch=16, micro_batch=2,
                                 pairs=(("mine", "llama-7b"),), max_new_tokens=(64,),
                                 systems=("rlhfuse_base",), shapes=(("mine", mine),))
  inputs = ablations.run_ablations(cfg, str(tmp_path), log=lambda m: None)["inputs"]
  rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1][:-2]
          for line in report.inputs_section(inputs) if line.startswith(("| mine ", "| llama-"))}
  assert rows == {"mine": "config.shapes (HF config.json)",
                  "llama-7b": "LLaMA-1, Touvron et al. 2023, Table 2"}


@pytest.mark.parametrize("preset", ["h100_sxm", "tpu_v5e"])
def test_the_report_gives_the_collective_latencies_the_run_priced_with(tmp_path, monkeypatch,
                                                                       preset):
  # The NVIDIA presets' α are NCCL's per-protocol constants, printed as a raw tuple of dicts
  # without their source; the cost model's collective_latency_s, listed beside them, is
  # unused there (it prices the TPU presets' collectives).
  from rlhfuse_jax.sim import report
  monkeypatch.setattr(ablations.it, "simulate_iteration", lambda cost, wl, opt, systems, cache,
                      log=None: ({s: {**{f: 1.0 for f in ablations.ROW_FIELDS}, "details": {}}
                                  for s in systems}, {}))
  sim = dataclasses.replace(ablations.AblationConfig().sim, offload_frozen=preset != "tpu_v5e")
  cfg = ablations.AblationConfig(hardware=preset, num_devices=16, global_batch=64, minibatch=16,
                                 micro_batch=2, pairs=(("llama-7b", "llama-7b"),),
                                 max_new_tokens=(64,), systems=("rlhfuse_base",), sim=sim)
  inputs = ablations.run_ablations(cfg, str(tmp_path), log=lambda m: None)["inputs"]
  rows = {line.split(" | ")[0][2:]: line.split(" | ")[1].removesuffix(" |")
          for line in report.inputs_section(inputs) if line.startswith("| collective")}
  if preset == "tpu_v5e":
    assert rows == {"collective_protocols": "none: efficiency.collective_latency_s per call",
                    "collective_latency_s": "1e-05"}
    return
  assert rows == {
      "collective_protocols (NCCL's Ring constants, `src/graph/tuning.cc`; each collective "
      "takes the cheaper)":
      "LL: 6.6 µs a call + 0.6 µs a ring step on NVLink, 2.7 µs across nodes; bandwidth × 0.25 "
      "(× 0.333 for other collectives in a node); Simple: 8.4 µs a call + 3.4 µs a ring step on "
      "NVLink, 14 µs across nodes; bandwidth × 1",
      "collective_latency_s": "1e-05 (unused: this hardware's collective_protocols give the α)"}


def test_the_generation_timeline_says_what_it_leaves_out_and_takes_a_shared_time_axis(
    monkeypatch, tmp_path):
  """Instances past max_instances were left out without a word (a 128-instance plan drew 0-63,
  its busy fraction and curve counting all); times read "0.00s" for a CPU run's 0.0046 s; a
  figure drawn apart (bench_generation's baseline and fused) ended its axis at its own run,
  so the two were not comparable by eye. Now: the title says which instances are drawn, 3
  significant digits, `t_max` sets the axis, `note` adds a line."""
  import types
  from rlhfuse_jax.sim import plots
  figs = _drawn_figure(monkeypatch)
  res = types.SimpleNamespace(
      gen_end_s=0.0046, gen_plus_inf_s=0.0098, instance_busy_frac=0.5, consolidations=[],
      segments=[(i, 0.0, 0.004, "decode") for i in range(3)],
      unfinished_curve=[(0.0, 3), (0.004, 0)])
  plots.plot_generation_timelines([("fused", res)], str(tmp_path / "t.png"), max_instances=2,
                                  t_max=0.02, note="process 0's instances only")
  plots.plot_generation_timelines([("fused", res)], str(tmp_path / "u.png"))
  (fig, (title,), _, _), (fig2, (title2,), _, _) = figs
  assert title == ("fused: generation ends 0.0046s (dashed), gen+inf 0.0098s, busy 50%; "
                   "instances 0-1 of 3 drawn\nprocess 0's instances only"), title
  assert fig.axes[0].get_xlim() == pytest.approx((0, 0.02 * 1.02))
  assert title2 == "fused: generation ends 0.0046s (dashed), gen+inf 0.0098s, busy 50%"
  assert fig2.axes[0].get_xlim() == pytest.approx((0, 0.0098 * 1.02))
