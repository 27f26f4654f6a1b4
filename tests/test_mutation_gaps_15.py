"""Pins the survivors of a mutation audit of sim/ablations, plots, lockstep, decode_fit, rt_model
and perf/accounting.

Each test asserts against an independent reference (hand-computed values or a formula written
out here from the module's docstring), so that a plausible slip in the code (a dropped factor,
a swapped operand, a wrong index) fails it.
"""
import dataclasses
import json
import types

import matplotlib.axes
import matplotlib.figure
import numpy as np
import pytest

from rlhfuse_jax.models import llama
from rlhfuse_jax.perf import accounting
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import ablations, decode_fit, hardware, lockstep, plots, rt_model, shapes
from rlhfuse_jax.sim import cost_model as cost_model_lib
from rlhfuse_jax.sim import generation_sim as gen_sim


# ------------------------------------------------------------------------------ plots

@pytest.fixture
def drawn(monkeypatch):
  """Records what the figures plot (the data handed to bar / broken_barh / step and the axes'
  limits), not pixels: savefig is skipped, so each test costs no rendering."""
  calls = {"bar": [], "barh": [], "step": [], "ylim": [], "xlim": [], "text": [], "vline": [],
           "axis_off": 0}
  bar, barh = matplotlib.axes.Axes.bar, matplotlib.axes.Axes.broken_barh
  text, vline = matplotlib.axes.Axes.text, matplotlib.axes.Axes.axvline
  step, ylim = matplotlib.axes.Axes.step, matplotlib.axes.Axes.set_ylim
  xlim, axis = matplotlib.axes.Axes.set_xlim, matplotlib.axes.Axes.axis

  def rec_bar(ax, x, height, *a, **kw):
    calls["bar"].append((ax, x, height, kw.get("bottom", 0.0), kw.get("width"),
                         kw.get("color")))
    return bar(ax, x, height, *a, **kw)

  def rec_barh(ax, xranges, yrange, *a, **kw):
    calls["barh"].append((ax, list(xranges), tuple(yrange), kw.get("facecolors")))
    return barh(ax, xranges, yrange, *a, **kw)

  def rec_step(ax, x, y, *a, **kw):
    calls["step"].append((ax, list(x), list(y)))
    return step(ax, x, y, *a, **kw)

  def rec_text(ax, x, y, s, *a, **kw):
    calls["text"].append((ax, x, y, s))
    return text(ax, x, y, s, *a, **kw)

  def rec_vline(ax, x, *a, **kw):
    calls["vline"].append((ax, x, kw.get("color")))
    return vline(ax, x, *a, **kw)

  # The module's own (bottom, top) calls only: autoscaling passes one sequence, and a shared
  # axis propagates its limits with emit=False.
  def rec_ylim(ax, *a, **kw):
    if len(a) == 2 and "emit" not in kw:
      calls["ylim"].append((ax,) + a)
    return ylim(ax, *a, **kw)

  def rec_xlim(ax, *a, **kw):
    if len(a) == 2 and "emit" not in kw:
      calls["xlim"].append((ax,) + a)
    return xlim(ax, *a, **kw)

  def rec_axis(ax, *a, **kw):
    if a == ("off",):
      calls["axis_off"] += 1
    return axis(ax, *a, **kw)

  monkeypatch.setattr(matplotlib.axes.Axes, "bar", rec_bar)
  monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh", rec_barh)
  monkeypatch.setattr(matplotlib.axes.Axes, "step", rec_step)
  monkeypatch.setattr(matplotlib.axes.Axes, "text", rec_text)
  monkeypatch.setattr(matplotlib.axes.Axes, "axvline", rec_vline)
  monkeypatch.setattr(matplotlib.axes.Axes, "set_ylim", rec_ylim)
  monkeypatch.setattr(matplotlib.axes.Axes, "set_xlim", rec_xlim)
  monkeypatch.setattr(matplotlib.axes.Axes, "axis", rec_axis)
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **kw: None)
  return calls


def _row(label, system, reshard, gen, inf, train, iteration=None):
  total = reshard + gen + inf + train if iteration is None else iteration
  return {"setting": {"label": label}, "system": system, "reshard_s": reshard, "gen_s": gen,
          "inf_s": inf, "train_s": train, "iteration_s": total}


def _titled(calls):
  """The recorded calls with each axes replaced by its title (set after the data is drawn)."""
  return [(ax.get_title(),) + tuple(rest) for ax, *rest in calls]


_RESHARD, _GEN, _INF, _TRAIN = "#bbbbbb", "#2a5fa8", "#2ca02c", "#c55a11"


def test_iteration_bars_stack_each_stage_on_the_ones_below_in_the_systems_columns(drawn):
  rows = [_row("A", "s1", 1.0, 2.0, 0.5, 3.0),
          # Overlapped (iteration below the stages' sum, as pipe_rlhf_async): generation and
          # inference beside training, both on top of the reshard.
          _row("A", "s2", 1.0, 4.0, 1.0, 5.0, iteration=7.0),
          _row("A", "s3", 0.0, 10.0, 2.0, 30.0),  # far above the others: clipped
          _row("B", "s1", 0.5, 1.0, 0.0, 1.0),
          _row("B", "s3", 0.0, 3.0, 1.0, 4.0)]  # (s2 has no row in B: its column stays empty)
  plots.plot_iteration_times(rows, ["s1", "s2", "s3"], "unused.png")
  want = [("A", 0, 1.0, 0.0, 0.75, _RESHARD), ("A", 0, 2.0, 1.0, 0.75, _GEN),
          ("A", 0, 0.5, 3.0, 0.75, _INF), ("A", 0, 3.0, 3.5, 0.75, _TRAIN),
          ("A", 1, 1.0, 0.0, 0.75, _RESHARD), ("A", 1 - 0.19, 4.0, 1.0, 0.37, _GEN),
          ("A", 1 - 0.19, 1.0, 5.0, 0.37, _INF), ("A", 1 + 0.19, 5.0, 1.0, 0.37, _TRAIN),
          ("A", 2, 0.0, 0.0, 0.75, _RESHARD), ("A", 2, 10.0, 0.0, 0.75, _GEN),
          ("A", 2, 2.0, 10.0, 0.75, _INF), ("A", 2, 30.0, 12.0, 0.75, _TRAIN),
          ("B", 0, 0.5, 0.0, 0.75, _RESHARD), ("B", 0, 1.0, 0.5, 0.75, _GEN),
          ("B", 0, 0.0, 1.5, 0.75, _INF), ("B", 0, 1.0, 1.5, 0.75, _TRAIN),
          ("B", 2, 0.0, 0.0, 0.75, _RESHARD), ("B", 2, 3.0, 0.0, 0.75, _GEN),
          ("B", 2, 1.0, 3.0, 0.75, _INF), ("B", 2, 4.0, 4.0, 0.75, _TRAIN)]
  got = _titled(drawn["bar"])
  assert [(t, c) for t, *_, c in got] == [(t, c) for t, *_, c in want]
  assert [x[1:5] for x in got] == [pytest.approx(x[1:5]) for x in want]
  # The axis stops at 1.15 x the smaller of the tallest bar and twice the median bar (A: median
  # 7, so 14 and not 42; B: the upper median of two, 8): one slow system does not flatten the
  # others. The clipped bar's label sits just below the top and still says its full value.
  assert _titled(drawn["ylim"]) == [("A", 0, pytest.approx(14 * 1.15)),
                                    ("B", 0, pytest.approx(8 * 1.15))]
  assert _titled(drawn["text"]) == [
      ("A", 0, pytest.approx(6.5), "6.5"), ("A", 1, pytest.approx(7.0), "7.0"),
      ("A", 2, pytest.approx(14 * 1.15 * 0.97), "42.0"),
      ("B", 0, pytest.approx(2.5), "2.5"), ("B", 2, pytest.approx(8.0), "8.0")]
  assert drawn["axis_off"] == 0  # two settings: two panels side by side, none blank


def test_settings_get_one_panel_each_in_first_seen_order_and_spare_panels_are_blank(drawn):
  rows = [_row(lab, "s", 0.0, 1.0, 0.0, 1.0) for lab in ("C", "A", "C", "B", "D")]
  rows[2]["system"] = "t"  # a second system of C: C keeps its first place
  plots.plot_iteration_times(rows, ["s", "t"], "unused.png")
  assert [t for t, *_ in _titled(drawn["ylim"])] == ["C", "A", "B", "D"]
  assert drawn["axis_off"] == 2  # 4 settings on a 2 x 3 grid


def test_generation_timelines_draw_each_instances_spans_and_the_unfinished_count(drawn):
  first = types.SimpleNamespace(
      gen_end_s=3.0, gen_plus_inf_s=4.0, instance_busy_frac=0.5,
      segments=[(0, 0.0, 1.0, "prefill"), (0, 1.0, 3.0, "decode"), (1, 0.0, 1.0, "prefill"),
                (1, 1.0, 2.0, "decode"), (0, 3.0, 3.5, "inference"), (0, 3.5, 4.0, "inference"),
                (2, 0.5, 0.8, "load")],  # instance 2: past max_instances, not drawn
      unfinished_curve=[(0.0, 4), (2.0, 2), (3.0, 0)],
      consolidations=[{"time_s": 2.0}])
  second = types.SimpleNamespace(
      gen_end_s=1.0, gen_plus_inf_s=1.5, instance_busy_frac=1.0,
      segments=[(0, 0.0, 0.5, "prefill"), (0, 0.5, 1.0, "decode"), (0, 1.0, 1.5, "migrate")],
      unfinished_curve=[(0.0, 2), (1.0, 0)], consolidations=[])
  plots.plot_generation_timelines([("one", first), ("two", second)], "unused.png",
                                  max_instances=2)
  colors = plots._KIND_COLORS
  # One artist per (instance, kind), with (start, width) spans in the row of its instance.
  want = [([(0.0, 1.0)], 0, "prefill"), ([(1.0, 2.0)], 0, "decode"),
          ([(0.0, 1.0)], 1, "prefill"), ([(1.0, 1.0)], 1, "decode"),
          ([(3.0, 0.5), (3.5, 0.5)], 0, "inference"),
          ([(0.0, 0.5)], 0, "prefill"), ([(0.5, 0.5)], 0, "decode"), ([(1.0, 0.5)], 0, "migrate")]
  assert [(spans, y, c) for _, spans, y, c in drawn["barh"]] == [
      (spans, (pytest.approx(i - 0.42), 0.84), colors[k]) for spans, i, k in want]
  assert [(x, y) for _, x, y in drawn["step"]] == [([0.0, 2.0, 3.0], [4, 2, 0]),
                                                   ([0.0, 1.0], [2, 0])]
  # Both panels share the time axis of the longest run; rows: the drawn instances, top down.
  assert [a[1:] for a in drawn["xlim"]] == [(0, pytest.approx(4.0 * 1.02))] * 2
  assert [a[1:] for a in drawn["ylim"]] == [(1.5, -0.5), (0, pytest.approx(4 * 1.05)),
                                            (0.5, -0.5), (0, pytest.approx(2 * 1.05))]
  # The end of generation (dashed) and each consolidation (in the migration colour).
  assert [(x, c) for _, x, c in drawn["vline"]] == [(3.0, "black"), (2.0, colors["migrate"]),
                                                   (1.0, "black")]


def test_schedule_gantts_draw_each_task_from_its_start_for_its_duration(drawn):
  task = lambda model, kind, start, end: types.SimpleNamespace(model=model, kind=kind,
                                                               start=start, end=end)
  fused = types.SimpleNamespace(makespan=9.0, devices=[
      [task("actor", "F", 0.0, 1.0), task("critic", "F", 1.0, 2.0),
       task("actor", "F", 2.0, 3.0), task("actor", "B", 3.0, 5.0)],
      [task("critic", "B", 1.0, 4.0), task("critic", "F", 4.0, 9.0)]])
  serial = types.SimpleNamespace(makespan=12.0, devices=[[task("actor", "B", 2.0, 12.0)]])
  plots.plot_schedules([("fused", fused), ("serial", serial)], "unused.png")
  colors = plots._TASK_COLORS
  want = [([(0.0, 1.0), (2.0, 1.0)], 0, ("actor", "F")), ([(1.0, 1.0)], 0, ("critic", "F")),
          ([(3.0, 2.0)], 0, ("actor", "B")), ([(1.0, 3.0)], 1, ("critic", "B")),
          ([(4.0, 5.0)], 1, ("critic", "F")), ([(2.0, 10.0)], 0, ("actor", "B"))]
  assert [(spans, y, c) for _, spans, y, c in drawn["barh"]] == [
      (spans, (pytest.approx(d - 0.4), 0.8), colors[k]) for spans, d, k in want]
  # A common time axis: the longer schedule's (the second here).
  assert [a[1:] for a in drawn["xlim"]] == [(0, pytest.approx(12.0 * 1.01))] * 2
  assert [a[1:] for a in drawn["ylim"]] == [(1.5, -0.5), (0.5, -0.5)]


# ------------------------------------------------------------------------------ lockstep

def _one_device_problem():
  return PipelineProblem(actor_pp=1, critic_pp=1, actor_microbatches=1, critic_microbatches=1,
                         actor_fwd=1.0, critic_fwd=3.0, actor_bwd=2.0, critic_bwd=4.0)


def test_a_lockstep_step_reports_its_task_time_and_its_overheads_apart():
  # Four ticks of one task each (1 + 2 + 3 + 4 = 10 s of tasks); 0.5 s per tick and 0.25 s per
  # step of executor overhead: 2.25 s, which the validation report shows beside the tasks.
  p = _one_device_problem()
  order = np.array([[AF, AB, CF, CB]], np.int8)
  got = lockstep.step_seconds(p, order, lockstep.StageTimes.uniform(p), tick_overhead_s=0.5,
                              step_overhead_s=0.25)
  assert got == {"step_s": pytest.approx(12.25), "ticks": 4, "task_s": pytest.approx(10.0),
                 "overhead_s": pytest.approx(2.25)}


def test_uniform_stage_times_give_each_model_its_own_number_of_stages():
  p = PipelineProblem(actor_pp=4, critic_pp=2, actor_microbatches=1, critic_microbatches=1,
                      actor_fwd=1.0, critic_fwd=3.0, actor_bwd=2.0, critic_bwd=5.0)
  t = lockstep.StageTimes.uniform(p)
  assert (t.actor_fwd, t.actor_bwd) == ((1.0,) * 4, (2.0,) * 4)
  assert (t.critic_fwd, t.critic_bwd) == ((3.0,) * 2, (5.0,) * 2)
  t.check(p)


def test_stage_times_of_another_critic_depth_or_not_finite_are_refused():
  p = PipelineProblem(actor_pp=2, critic_pp=1, actor_microbatches=1, critic_microbatches=1,
                      actor_fwd=1.0, critic_fwd=1.0)
  with pytest.raises(ValueError, match="critic_pp=1"):
    lockstep.StageTimes((1, 1), (2, 2), (1, 1), (2, 2)).check(p)
  for bad in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match="StageTimes.critic_bwd"):
      lockstep.StageTimes((1,), (2,), (1,), (bad,))


def test_each_device_is_timed_on_its_own_order_of_tasks():
  # Devices run different orders (a fused schedule): device 1's first task is a critic forward
  # (critic stage 0 under the reversed placement, 10 s), not device 0's actor forward.
  p = PipelineProblem(actor_pp=2, critic_pp=2, actor_microbatches=1, critic_microbatches=1,
                      actor_fwd=1.0, critic_fwd=1.0)
  times = lockstep.StageTimes((1.0, 1.5), (2.0, 2.5), (10.0, 20.0), (30.0, 40.0))
  order = np.array([[AF, CF, CB, AB], [CF, AF, AB, CB]], np.int8)
  np.testing.assert_array_equal(lockstep.task_seconds(p, order, times),
                                [[1.0, 20.0, 40.0, 2.0], [10.0, 1.5, 2.5, 30.0]])


def test_tick_seconds_refuse_no_data_copies_and_a_negative_overhead():
  tasks = np.array([[1.0, 2.0], [3.0, 0.0]])
  np.testing.assert_allclose(lockstep.tick_seconds(tasks, 0.0, 2, data_replicas=1), [2.0, 3.0])
  with pytest.raises(ValueError, match="data_replicas=0 must be >= 1"):
    lockstep.tick_seconds(tasks, 0.0, 2, data_replicas=0)
  with pytest.raises(ValueError, match="tick_overhead_s=-0.5 must be >= 0"):
    lockstep.tick_seconds(tasks, -0.5)


# ------------------------------------------------------------------------------ accounting

def test_a_decode_step_attends_over_at_least_one_position():
  # A step reads at least the key of its own position: kv_len=0 (an empty prefix, e.g. a
  # mean_live_len computed from the wrong counts) is refused, not priced as weights alone.
  cfg = llama.ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2,
                          num_heads=2, num_kv_heads=1)
  got = accounting.decode_step_bytes(cfg, 1, 1)
  assert got["kv_bytes"] == 2 * 2 * 1 * 1 * 1 * 4 * 4  # K and V, 2 layers, 1 row, 4-dim, f32
  for batch, kv_len in ((1, 0), (0, 1), (1, 0.5)):
    with pytest.raises(ValueError, match="must be >= 1"):
      accounting.decode_step_bytes(cfg, batch, kv_len)


# ------------------------------------------------------------------------------ ablations

def _grid(**kw):
  """Two pairs (the second with the models swapped) x two generation lengths."""
  base = dict(num_devices=16, global_batch=64, minibatch=16, epochs=2, micro_batch=2, seed=3,
              pairs=(("llama-7b", "llama-13b"), ("llama-13b", "llama-7b")),
              max_new_tokens=(64, 128), systems=("rlhfuse_base", "rlhfuse"))
  return ablations.AblationConfig(**{**base, **kw})


def test_settings_are_every_pair_with_every_length_pair_first():
  got = [(s["actor"], s["critic"], s["max_new_tokens"], s["label"], s["global_batch"],
          s["minibatch"], s["num_devices"]) for s in _grid().settings()]
  assert got == [("llama-7b", "llama-13b", 64, "7B/13B L=64", 64, 16, 16),
                 ("llama-7b", "llama-13b", 128, "7B/13B L=128", 64, 16, 16),
                 ("llama-13b", "llama-7b", 64, "13B/7B L=64", 64, 16, 16),
                 ("llama-13b", "llama-7b", 128, "13B/7B L=128", 64, 16, 16)]


def test_a_settings_workload_has_its_models_and_length_and_the_configs_counts():
  cfg = _grid()
  wl = ablations.workload(cfg, cfg.settings()[3])
  assert (wl.actor.name, wl.actor.head, wl.critic.name, wl.critic.head) == (
      "llama-13b", "lm", "llama-7b-critic", "scalar")
  assert (wl.max_new_tokens, wl.num_devices, wl.global_batch, wl.minibatch, wl.epochs,
          wl.micro_batch, wl.seed) == (128, 16, 64, 16, 2, 2, 3)


def test_the_cost_model_prices_with_the_configs_efficiencies():
  eff = cost_model_lib.Efficiency(train_mfu=0.3, decode_bw_eff=0.5)
  assert ablations.cost_model(_grid(efficiency=eff)).eff == eff


def test_run_ablations_keeps_one_row_per_setting_and_system_and_the_figure_settings_raw(
    tmp_path, monkeypatch):
  # The simulation itself is replaced by hand-made rows (its own tests cover it): what is
  # pinned is how the grid is walked and what is kept of each setting.
  seen = []

  def fake_simulate(cost, wl, opt, systems, cache, log=None):
    seen.append((wl.actor.name, wl.critic.name, wl.max_new_tokens))
    k = len(seen)
    res = {s: {**{f: 100.0 * k + 10.0 * j + i for i, f in enumerate(ablations.ROW_FIELDS)},
               "details": {"n": k}} for j, s in enumerate(systems)}
    return res, {"gen": k}
  monkeypatch.setattr(ablations.it, "simulate_iteration", fake_simulate)
  cfg = _grid(figure_setting=-2,  # the third of four settings
              pairs=(("llama-7b", "llama-13b"), ("llama-13b", "llama-33b")))
  out = ablations.run_ablations(cfg, str(tmp_path), log=lambda m: None)
  assert seen == [("llama-7b", "llama-13b-critic", 64), ("llama-7b", "llama-13b-critic", 128),
                  ("llama-13b", "llama-33b-critic", 64), ("llama-13b", "llama-33b-critic", 128)]
  assert out["settings"] == cfg.settings()
  assert [(r["setting"]["label"], r["system"]) for r in out["rows"]] == [
      (st["label"], s) for st in cfg.settings() for s in ("rlhfuse_base", "rlhfuse")]
  for n, r in enumerate(out["rows"]):
    k, j = n // 2 + 1, n % 2
    assert [r[f] for f in ("iteration_s", "gen_s", "inf_s", "gen_plus_inf_s", "train_s",
                           "samples_per_s", "reshard_s")] == [
                               100.0 * k + 10.0 * j + i for i in range(7)]
    assert r["details"] == {"n": k}
  assert out["raw"] == {"setting": cfg.settings()[2], "gen": 3}
  inputs = out["inputs"]
  # Every model of the grid is described, a critic-only one (33B) included, and the seed that
  # drew the lengths.
  assert sorted(inputs["shapes"]) == ["llama-13b", "llama-33b", "llama-7b"]
  assert inputs["workload"] == {"num_devices": 16, "global_batch": 64, "minibatch": 16,
                                "epochs": 2, "micro_batch": 2, "seed": 3}
  # The response lengths are summarised against their setting's limit (the clipped fraction).
  for st in cfg.settings():
    info = inputs["lengths_sampled"][st["label"]]
    assert "clip_frac" not in info["prompt"] and 0 < info["response"]["clip_frac"] < 1
    assert info["response"]["max"] == st["max_new_tokens"]


# ------------------------------------------------------------------------------ decode_fit

_BENCH_MODEL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4,
                "num_heads": 4, "num_kv_heads": 2, "head_dim": 0, "tie_embeddings": True,
                "rope_theta": 10000.0, "dtype": "bfloat16"}  # (the last two: not a shape's)


def test_decode_points_read_each_rows_live_prefix_times_its_batch():
  new = {"model": _BENCH_MODEL,
         "decode": {"cache_len": 100, "per_batch": [
             {"batch": 4, "step_s": 0.01, "mean_live_len": 20.5},
             {"batch": 2, "step_s": 0.02}]}}  # an older result: the whole cache was read
  pts = decode_fit.points_from_results([("a.json", new)])
  assert [(p.source, p.batch, p.context_tokens, p.measured_s, p.layers) for p in pts] == [
      ("a.json", 4, 82.0, 0.01, 4), ("a.json", 2, 200.0, 0.02, 4)]
  # The bench decodes with the actor: an LM head over the vocabulary, tied as configured.
  shape = pts[0].shape
  assert (shape.head, shape.tie_embeddings, shape.num_kv_heads, shape.vocab_size) == (
      "lm", True, 2, 256)


def test_a_fitted_step_is_the_fixed_costs_plus_the_slower_of_compute_and_memory():
  # The module docstring's model, written out: t = step_s + L x layer_s + max(FLOPs / (peak x
  # mfu), bytes / (hbm_bw x bw_eff)), the step reading every weight and each row's live KV.
  fit = calibration.DecodeFit(step_s=1e-4, layer_s=2e-5, mfu=0.3, bw_eff=0.6)
  hw = hardware.get_hardware("h100_sxm")
  s = shapes.get_shape("llama-7b")
  for batch, live in ((1, 500.0), (4096, 8.0)):  # memory-bound, then compute-bound
    p = decode_fit.DecodePoint("x", s, batch, batch * live, 1.0)
    nbytes = s.weight_bytes() + batch * live * s.kv_bytes_per_token()
    flops = (2.0 * s.matmul_params() * batch
             + 4.0 * s.num_layers * s.num_heads * s.head_dim_ * batch * live)
    want = 1e-4 + 32 * 2e-5 + max(flops / (hw.peak_flops * 0.3), nbytes / (hw.hbm_bw * 0.6))
    assert decode_fit.predict(fit, hw, p) == pytest.approx(want, rel=1e-12)


def _synthetic_points(mfu, hw, full_batches, half_batches, live):
  """Decode points of llama-7b at `full_batches` and of its 16-layer half at `half_batches`,
  each row reading `live` positions, timed by a known fit (step 1e-4 s, layer 5e-5 s, the
  given mfu, bw_eff 0.7)."""
  truth = calibration.DecodeFit(step_s=1e-4, layer_s=5e-5, mfu=mfu, bw_eff=0.7)
  big = shapes.get_shape("llama-7b")
  half = dataclasses.replace(big, num_layers=16)
  pts = []
  for shape, batch in [(big, b) for b in full_batches] + [(half, b) for b in half_batches]:
    p = decode_fit.DecodePoint("synthetic", shape, batch, batch * live, 1.0)
    pts.append(dataclasses.replace(p, measured_s=decode_fit.predict(truth, hw, p)))
  return pts


def test_a_fit_may_find_any_mfu_up_to_one():
  # A step that is compute-bound at a high utilisation (mfu 0.8, large batches): the bounds let
  # the fit reach it rather than stop at some lower cap and misprice the batch.
  hw = hardware.get_hardware("h100_sxm")
  pts = _synthetic_points(0.8, hw, (1, 2048, 4096), (1, 4096), 8.0)  # short contexts
  assert pts[2].work[0] / (hw.peak_flops * 0.8) > pts[2].work[1] / (hw.hbm_bw * 0.7)
  assert decode_fit.fit(pts, hw).mfu == pytest.approx(0.8, rel=1e-3)


def test_a_fit_that_no_step_binds_on_compute_keeps_the_assumed_mfu():
  # Batches 1-4 of a 7B model are far from compute-bound, so every mfu start fits them equally
  # well: the cost model's own assumption (tried first; a later start must be strictly better)
  # is kept, not the first of the lower starts.
  hw = hardware.get_hardware("h100_sxm")
  pts = _synthetic_points(0.05, hw, (1, 2, 4), (1, 4), 300.0)
  for assumed in (0.45, 0.3):
    got = decode_fit.fit(pts, hw, cost_model_lib.Efficiency(decode_mfu=assumed))
    assert got.mfu == pytest.approx(assumed, abs=1e-6)


# ------------------------------------------------------------------------------ rt_model

_RT_CAL = {"format": "rlhfuse_jax.sim.calibration/v1", "device": "test",
           "ops": {"decode_step": {"occupied_slots": [1, 4], "seconds": [0.01, 0.012]},
                   "prefill": {"tokens_per_s": 1e5}, "inference": {"tokens_per_s": 2e3},
                   "migration": {"bytes_per_s": 1e12, "latency_s": 0.001},
                   "weight_load": {"bytes_per_s": 1e6}}}
_TINY = shapes.ModelShape(name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_layers=2, num_heads=4, num_kv_heads=2)
_TINY_CRITIC = dataclasses.replace(_TINY, name="tiny-critic", head="scalar")


def test_the_rt_model_is_the_streamed_gen_plus_inf_of_each_candidate_with_the_frozen_models():
  """The Rt choice compares candidates by this number: it must be the simulated batch with
  the candidate's threshold, streaming on, every frozen model loaded (from the host here) and
  scored, up to the last inference (not the end of generation)."""
  setup = gen_sim.GenSetup(num_instances=4, slots=2, chunk_steps=2, max_new_tokens=64,
                           offload_frozen=True)
  frozen = (_TINY, _TINY_CRITIC, _TINY_CRITIC)
  model = rt_model.gen_plus_inf_model(_RT_CAL, _TINY, frozen, setup)
  # Four short samples, four long ones: at Rt 0.5 two instances are freed early, load the
  # frozen models (slowly: 1 MB/s) and score the finished samples while the tail decodes.
  prompts, resp = np.full(8, 6), np.array([1, 2, 3, 4, 20, 40, 50, 60])
  cost = cost_model_lib.CostModel(hardware.get_hardware("h100_sxm"),
                                  calibration=calibration.from_dict(_RT_CAL, "measured"))

  def sim(rt, frozen=frozen, stream=True):
    s = dataclasses.replace(setup, threshold=rt, stream_inference=stream)
    return gen_sim.simulate_generation(cost, _TINY, frozen, s, prompts, resp)
  got = {rt: model(rt, prompts, resp) for rt in (0.0, 0.5)}
  assert got == {rt: pytest.approx(sim(rt).gen_plus_inf_s, rel=1e-12) for rt in got}
  # (each alternative gives another number on this batch)
  assert got[0.5] < 0.9 * got[0.0]
  assert got[0.5] < 0.9 * sim(0.5, stream=False).gen_plus_inf_s
  assert got[0.5] > 1.1 * sim(0.5, frozen=()).gen_plus_inf_s
  assert got[0.5] > 1.1 * sim(0.5).gen_end_s


def test_the_rt_model_needs_the_measured_inference_and_prefill():
  setup = gen_sim.GenSetup(num_instances=2, slots=4, max_new_tokens=64)
  for op in ("inference", "prefill", "decode_step"):
    cal = {**_RT_CAL, "ops": {k: v for k, v in _RT_CAL["ops"].items() if k != op}}
    with pytest.raises(ValueError, match=rf"lacks the measured ops \['{op}'\]"):
      rt_model.gen_plus_inf_model(cal, _TINY, (_TINY,), setup)


# ------------------------------------------------------------------------------ ablation config

def _cal(**fields):
  return calibration.from_dict({"format": calibration.FORMAT, "device": "test", **fields},
                               "cal.json")


_STEP = {"decode_step": {"occupied_slots": [1, 4], "seconds": [0.01, 0.02]}}


def test_a_calibration_fits_an_actor_within_ten_percent_of_its_size():
  cfg = _grid()  # actors 7B and 13B; the 13B is also a critic
  n7 = cfg.shape("llama-7b").num_params()
  for params in (int(n7 * 1.09), int(n7 * 0.91)):
    ablations.check_calibration_fits(_cal(ops=_STEP, model_params=params), cfg)
  for params in (int(n7 * 1.2), int(n7 * 0.8)):
    with pytest.raises(ValueError, match="on a model of"):
      ablations.check_calibration_fits(_cal(ops=_STEP, model_params=params), cfg)
  # Only actors count: a calibration of the 13B critic of a 7B actor times no actor.
  only_7b_actor = _grid(pairs=(("llama-7b", "llama-13b"),))
  n13 = cfg.shape("llama-13b").num_params()
  with pytest.raises(ValueError, match="simulated actors have 6,"):
    ablations.check_calibration_fits(_cal(ops=_STEP, model_params=n13), only_7b_actor)


def test_a_calibration_of_rates_and_fits_only_needs_no_model_size():
  fit = {"decode_fit": {"step_s": 0.0, "layer_s": 5e-5, "mfu": 0.04, "bw_eff": 0.7},
         "migration": {"bytes_per_s": 1e9}}
  ablations.check_calibration_fits(_cal(ops=fit), _grid())


def test_a_shared_processor_calibration_is_refused_for_a_preset_only(tmp_path):
  # A hardware file may describe the very host the calibration was measured on.
  host = tmp_path / "host.json"
  host.write_text(json.dumps({"base": "h100_sxm"}))
  shared = _cal(devices_share_compute=True, ops={"migration": {"bytes_per_s": 1e9}})
  ablations.check_calibration_fits(shared, _grid(hardware=str(host)))
  with pytest.raises(ValueError, match="share one processor"):
    ablations.check_calibration_fits(shared, _grid())
  # Measured on a CPU, devices_share_compute set false (calibrate_sim's flag): refused too, by
  # its provenance or its device line; a GPU's file is not.
  for fields in ({"provenance": {"platform": "cpu"}}, {"device": "cpu x8 (cpu), 1 device(s)"}):
    cpu = _cal(ops={"migration": {"bytes_per_s": 1e9}}, **fields)
    ablations.check_calibration_fits(cpu, _grid(hardware=str(host)))
    with pytest.raises(ValueError, match="measured on a CPU: it cannot time"):
      ablations.check_calibration_fits(cpu, _grid())
  ablations.check_calibration_fits(_cal(ops={"migration": {"bytes_per_s": 1e9}}, provenance={
      "platform": "gpu"}, device="gpu (NVIDIA H100 80GB HBM3)"), _grid())


def test_the_figure_setting_indexes_the_settings_from_either_end():
  assert _grid(figure_setting=-4).figure_setting == 0
  assert _grid(figure_setting=3).figure_setting == 3
  for bad in (4, -5):
    with pytest.raises(ValueError, match=rf"figure_setting={bad} must index one of the 4"):
      _grid(figure_setting=bad)


def test_the_async_system_needs_a_staleness_of_one_or_more():
  sim = dataclasses.replace(ablations.AblationConfig().sim, staleness=0)
  with pytest.raises(ValueError, match="needs a staleness >= 1"):
    _grid(systems=("pipe_rlhf_async",), sim=sim)
  _grid(systems=("pipe_rlhf",), sim=sim)


def test_a_zero_generation_length_is_refused_by_name():
  with pytest.raises(ValueError, match=r"max_new_tokens=\(64, 0\) must all be >= 1"):
    _grid(max_new_tokens=(64, 0))


def test_offloading_on_hardware_without_a_host_link_is_allowed_with_a_calibration():
  # A calibration may time the loads (its weight_load): the preset's missing link is then moot.
  _grid(hardware="tpu_v5p", calibration="measured.json")
  with pytest.raises(ValueError, match="no host_to_device_bw"):
    _grid(hardware="tpu_v5p")


def test_config_dict_parsing_keeps_rt_zero_extra_decode_results_and_optional_systems():
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.sim.threshold_candidates = "0,0.2,1"  # 0: stream, never migrate
  c.validate.bench_decode_extra = " a/result.json, ,b/result.json"
  cfg = ablations.AblationConfig.from_config_dict(c)
  assert cfg.sim.threshold_candidates == (0.0, 0.2, 1.0)
  assert cfg.bench_decode_extra == ("a/result.json", "b/result.json")
  c.systems = ""
  assert ablations.AblationConfig.from_config_dict(c, systems_optional=True).systems == ()
  with pytest.raises(ValueError, match=r"^config\.systems='' must list at least one item"):
    ablations.AblationConfig.from_config_dict(c)


def test_a_zero_in_a_list_of_counts_is_refused_where_the_list_is_read():
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.max_new_tokens = "512,0"
  with pytest.raises(ValueError, match=r"^config\.max_new_tokens='512,0': expected "
                                       r"comma-separated positive integers"):
    ablations.AblationConfig.from_config_dict(c)


def test_a_measured_training_stage_is_one_models_time_too():
  # train_stage is measured on one model's executables, like the decode step: without the
  # model's size it cannot be checked against the simulated actors.
  stage = {"train_stage": {"actor_fwd_s": 0.001, "critic_fwd_s": 0.001}}
  with pytest.raises(ValueError, match=r"has measured \['train_stage'\] but no model_params"):
    ablations.check_calibration_fits(_cal(ops=stage), _grid())


@pytest.mark.parametrize("field, value, match", [
    ("seed", True, r"config\.seed=True: expected an integer >= 0"),
    ("num_devices", True, r"config\.num_devices=True: expected an integer >= 1"),
    ("sim", dataclasses.replace(ablations.AblationConfig().sim, async_split_unit=-1),
     r"config\.sim\.async_split_unit=-1 must be >= 0"),
])
def test_a_bool_count_or_a_negative_split_unit_is_refused_by_name(field, value, match):
  with pytest.raises(ValueError, match=match):
    _grid(**{field: value})


def test_config_lists_are_read_with_the_spaces_around_their_items_dropped():
  from configs import ablations as cfg_mod
  c = cfg_mod.get_config("quick")
  c.pairs = " llama-7b / llama-13b , llama-13b/llama-13b"
  c.systems = "rlhfuse, pipe_rlhf"
  cfg = ablations.AblationConfig.from_config_dict(c)
  assert cfg.pairs == (("llama-7b", "llama-13b"), ("llama-13b", "llama-13b"))
  assert cfg.systems == ("rlhfuse", "pipe_rlhf")


def test_run_ablations_describes_the_calibration_it_priced_with(tmp_path, monkeypatch):
  path = tmp_path / "cal.json"
  path.write_text(json.dumps({"format": calibration.FORMAT, "device": "my-host",
                              "ops": {"migration": {"bytes_per_s": 1e9}}}))
  monkeypatch.setattr(ablations.it, "simulate_iteration", lambda cost, wl, opt, systems, cache,
                      log=None: ({s: {**{f: 1.0 for f in ablations.ROW_FIELDS}, "details": {}}
                                  for s in systems}, {}))
  cfg = _grid(pairs=(("llama-7b", "llama-7b"),), max_new_tokens=(64,),
              calibration=str(path))
  got = ablations.run_ablations(cfg, str(tmp_path), log=lambda m: None)["inputs"]
  assert (got["calibration"]["path"], got["calibration"]["device"]) == (str(path), "my-host")
  assert got["calibration"]["migration"]["per_s"] == 1e9
  assert ablations.run_ablations(_grid(pairs=(("llama-7b", "llama-7b"),), max_new_tokens=(64,)),
                                 str(tmp_path), log=lambda m: None)["inputs"]["calibration"] is None
