"""bench_generation end to end on its tiny config: identical outputs, result.json fields, one
timeline per mode, a calibration file the simulator loads and predicts the bench with."""
import json
import os
import subprocess
import sys

import jax
import pytest

from configs import bench_generation as bench_config
from experiments import bench_generation
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import validation
from tests.xla_env import subprocess_env


def test_tiny_bench(tmp_path):
  c = bench_config.get_config("tiny")
  c.generation.migration_threshold = "0.75"  # fixed (as --config... would), so the simulator
  # can rebuild the bench from config.json
  c.lengths.median = 8.0  # a tail long enough that live samples sit on both instances at Rt
  c.repeats = 3  # the reported run of each mode is the median of three
  workdir = str(tmp_path)
  result = bench_generation.run_and_write(c, workdir)
  # The fused run really migrated a sample's KV cache, and its outputs are still identical.
  assert result["fused"]["migrated_samples"] > 0 and result["fused"]["consolidation_step"] > 0
  assert result["identical_outputs"] is True and result["identity"]["tokens_equal"]
  with open(os.path.join(workdir, "result.json")) as f:
    stored = json.load(f)
  for mode in ("baseline", "fused"):
    for key in ("gen_plus_inf_s", "wall_s", "instance_busy_frac"):
      assert stored[mode][key] > 0, (mode, key)
    assert os.path.getsize(os.path.join(workdir, f"timeline_{mode}.png")) > 10_000
  for key in ("consolidation_step", "migrated_samples", "migrated_kv_bytes"):
    assert key in stored["fused"]
  assert stored["ratio"] == stored["fused"]["gen_plus_inf_s"] / stored["baseline"][
      "gen_plus_inf_s"]
  # Each mode reports its median run by gen+inf time; the paired ratios are fused over
  # baseline of the same repeat.
  times = {mode: stored[mode]["runs_gen_plus_inf_s"] for mode in ("baseline", "fused")}
  for mode, runs in times.items():
    assert len(runs) == 3 and stored[mode]["gen_plus_inf_s"] == sorted(runs)[1], (mode, runs)
  paired = [f / b for b, f in zip(times["baseline"], times["fused"])]
  assert stored["ratio_paired"] == {"median": sorted(paired)[1], "runs": paired}
  # (baseline always ran first: the mode that runs second on a warmed machine alternates)
  assert stored["order"] == [["baseline", "fused"], ["fused", "baseline"], ["baseline", "fused"]]
  assert stored["migration_threshold"] == 0.75 and len(stored["response_lens"]) == 8
  cal = calibration.load(os.path.join(workdir, "calibration.json"))
  assert cal.devices_share_compute and cal.migration is not None
  # The decode step measured at one live row and at a full instance (the table's two ends).
  assert tuple(cal.decode_step.occupied_slots) == (1, 4)
  spec, measured = validation.gen_bench_from_workdir(workdir)
  assert spec.num_instances == 2 and spec.slots == 4
  predicted = validation.predict_bench_generation(cal, spec)
  assert predicted["fused"]["gen_plus_inf_s"] > 0 and measured["fused"] > 0


def test_auto_rt_is_simulated_over_the_lengths_the_warm_up_observed(tmp_path):
  """The warm-up runs each batch unfused and fused, the same responses twice: their lengths
  are observed once (the reason read "over 16 observed lengths" for 8 responses)."""
  c = bench_config.get_config("tiny")
  c.repeats = 1
  assert c.generation.migration_threshold == "auto" and c.warmup >= 1
  result = bench_generation.run_and_write(c, str(tmp_path))
  assert result["rt_choice"]["reason"].startswith(
      f"simulated over {c.batch_size * c.warmup} observed lengths, "), result["rt_choice"]


def test_bad_batch_inputs_fail_before_the_earlier_results_move_or_anything_compiles(tmp_path):
  """A prompt length range that is empty, a lengths file that is missing or malformed, or a bad
  fused-generator field is a one-line error naming the field, raised before start_outputs moves
  the earlier run's result.json aside and before the instances compile (it was numpy's "low >=
  high", or a FileNotFoundError traceback, after the compiles)."""
  (tmp_path / "result.json").write_text('{"earlier": 1}')
  (tmp_path / "bad.jsonl").write_text('{"response_lengths": [3]}\n{"x": \n{"y": 1}\n')
  cases = [({"generation.prompt_min_len": 40}, "config.generation.prompt_min_len=40: expected "
            "an integer in [1, generation.prompt_len=6]"),
           ({"lengths.kind": "empirical", "lengths.path": str(tmp_path / "nope.jsonl")},
            f"config.lengths: lengths file '{tmp_path / 'nope.jsonl'}' does not exist"),
           ({"lengths.kind": "empirical", "lengths.path": str(tmp_path / "bad.jsonl")},
            f"config.lengths: {tmp_path / 'bad.jsonl'}:2: malformed JSON line"),
           ({"generation.slots": 0}, "config.generation.slots=0: expected an integer >= 1"),
           # (blamed the automatic num_instances=0, a documented value; 0: ZeroDivisionError)
           ({"generation.num_instances": 0, "generation.instance_devices": 16},
            "config.generation.instance_devices=16 exceeds the 8 devices"),
           ({"generation.num_instances": 0, "generation.instance_devices": 0},
            "config.generation.instance_devices=0: expected an integer >= 1"),
           # (these moved the earlier outputs aside, or ran no warm-up and timed the compiles)
           ({"generation.temperature": -1.0}, "config.generation: sampling.temperature=-1.0"),
           ({"warmup": -1}, "config.warmup=-1: expected an integer >= 0"),
           ({"seed": -1}, "config.seed=-1: expected an integer >= 0"),
           # (found by the generator once the earlier outputs had moved aside)
           ({"generation.slots": 3}, "config.generation.slots=3: 8 samples dealt to "
            "num_instances=2 put 4 in one instance; expected slots >= 4"),
           ({"model.max_seq_len": 20}, "config.generation.prompt_len + config.generation."
            "max_new_tokens = 22 exceeds config.model.max_seq_len=20"),
           ({"model.num_heads": 3}, "config.model.num_heads=3 must be a multiple of "
            "config.model.num_kv_heads=2")]
  for overrides, message in cases:
    c = bench_config.get_config("tiny")
    for key, value in overrides.items():
      *section, field = key.split(".")
      (c[section[0]] if section else c)[field] = value
    try:
      bench_generation.run_and_write(c, str(tmp_path))
      raise AssertionError(f"{overrides}: no error")
    except ValueError as e:
      assert str(e).startswith(message), (overrides, str(e))
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "result.json"]


@pytest.mark.parametrize("me", [0, 1])
def test_a_workdir_process_0_cannot_prepare_stops_every_process(tmp_path, monkeypatch, me):
  """Process 0 alone moves the earlier outputs aside; when that failed (another run's workdir,
  a full disk) the other processes went on compiling and running until process 0's exit ended
  the run. As process 0 and as process 1 of 2 (its verdict from process 0 faked)."""
  def full(*args):
    raise OSError(28, "No space left on device")

  def ran(*args):
    raise AssertionError("the benchmark ran")
  monkeypatch.setattr(bench_generation.wd, "start_outputs", full)
  monkeypatch.setattr(bench_generation, "run", ran)
  if me:
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(bench_generation.distributed, "main_process_verdict", lambda ok: False)
  with pytest.raises(OSError if me == 0 else RuntimeError,
                     match="No space left" if me == 0 else "process 0 could not prepare"):
    bench_generation.run_and_write(bench_config.get_config("tiny"), str(tmp_path))


def test_the_pipelined_variant_on_several_processes_says_how_to_run_it(tmp_path, monkeypatch):
  """BINARY=bench_generation CONFIG=configs/bench_generation.py:pipelined_tiny bash launch/
  local_multiprocess.sh 2 4 WD was refused with "drop --distributed", which the launcher
  passes itself: the error says to run one process without the launcher (2 processes faked),
  before anything is written."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"^config\.generation\.pipeline_stages=2: expected 0 "
                     r"with 2 processes \(the pipelined variant runs in one process\): run it "
                     r"as one process, python -m experiments\.bench_generation without "
                     r"--distributed, not through launch/local_multiprocess\.sh$"):
    bench_generation.run_and_write(bench_config.get_config("pipelined_tiny"), str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_multi_host_flags_without_distributed_are_refused(tmp_path):
  """--coordinator_address / --num_processes / --process_id are read only with --distributed
  (train_ppo's check, shared): without it every process of a launch benched alone, silently."""
  wd = str(tmp_path / "run")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-m", "experiments.bench_generation",
                        "--config=configs/bench_generation.py:tiny", f"--workdir={wd}",
                        "--num_processes=2", "--process_id=1"],
                       cwd=repo, env=subprocess_env(2), capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("--coordinator_address, --num_processes and --process_id join the processes of one "
          "multi-host run only with --distributed") in out.stderr, out.stderr[-3000:]
  assert not os.path.exists(wd)


def test_the_tick_table_gives_every_group_its_own_colour_and_a_readable_key(monkeypatch,
                                                                            tmp_path):
  """schedule_pipelined.png of 24 groups: tab20 resampled to 24 colours has 20, so groups 0
  and 1 (and 7 and 8, ...) were one colour, drawn as one block twice as wide; the key's 24
  labels overlapped into one stack. More than 20 groups take a continuous map, and the key as
  many whole-group labels as its height fits."""
  import matplotlib.figure
  import numpy as np
  seen = []
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                      lambda fig, *a, **kw: seen.append(fig))
  for groups in (4, 24):
    table = np.tile(np.arange(groups), (2, 1)).T  # [ticks, stages]: group g at tick g
    bench_generation.plot_tick_table(table, groups, str(tmp_path / "t.png"))
  for fig, groups in zip(seen, (4, 24)):
    image = fig.axes[0].get_images()[0]
    colours = {tuple(image.cmap(image.norm(g))) for g in range(groups)}
    assert len(colours) == groups, groups
    fig.canvas.draw()
    key = [t for t in fig.axes[1].get_yticks() if -0.5 <= t <= groups - 0.5]
    assert all(float(t).is_integer() for t in key) and len(key) <= 7, key
  assert len([t for t in seen[0].axes[1].get_yticks() if 0 <= t <= 3]) == 4
