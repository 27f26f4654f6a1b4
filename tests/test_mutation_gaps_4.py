"""Cheap tests proposed by a fourth mutation audit (checkpointing.py, workdir.py, metrics.py,
policy/, generation/{fused,pipelined,multihost,timeline,measure,sampling}.py,
parallel/distributed.py, trainer/{hooks,pipelined}.py, experiments/{runner,sweep,config_files}.py):
each one fails under a plausible bug that the rest of the suite lets through (see the audit
report for the mutation each kills)."""
import json
import os
import stat

import numpy as np
import pytest

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd


# checkpointing.py --------------------------------------------------------------------------------

def test_a_step_set_aside_three_times_keeps_three_copies_side_by_side(tmp_path):
  """Checkpointer.set_aside looks for a free name for as long as the name is taken: 3, 3.1,
  3.2, each the whole checkpoint (not one moved inside another)."""
  import jax.numpy as jnp
  from rlhfuse_jax import checkpointing
  ck = checkpointing.Checkpointer(str(tmp_path), keep=2)
  try:
    for i in range(3):
      ck.save(3, {"w": jnp.full((2,), float(i))}, {"i": i})
      ck.wait()
      ck.set_aside(3)
  finally:
    ck.close()
  damaged = tmp_path / "damaged_checkpoints"
  assert sorted(os.listdir(damaged)) == ["3", "3.1", "3.2"]
  assert sorted(os.listdir(damaged / "3.1")) == sorted(os.listdir(damaged / "3"))


# workdir.py --------------------------------------------------------------------------------------

def test_atomic_writes_get_a_plain_opens_mode_and_leave_no_temporary_file(tmp_path, monkeypatch):
  """write_json's file has the mode open() would give (mkstemp's 0600 is widened by the umask),
  and a write whose rename fails removes its temporary file and keeps the old content."""
  path = tmp_path / "result.json"
  wd.write_json(str(path), {"a": 1})
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~wd._UMASK

  def refuse(src, dst):
    raise OSError("disk full")
  monkeypatch.setattr(wd.os, "replace", refuse)
  with pytest.raises(OSError, match="disk full"):
    wd.write_json(str(path), {"a": 2})
  assert os.listdir(tmp_path) == ["result.json"]
  assert json.loads(path.read_text()) == {"a": 1}


@pytest.mark.parametrize("uri", ["gs://bucket/run", "s3://bucket/run", "file:///tmp/run"])
def test_every_uri_is_refused_as_a_workdir(uri):
  """check_local_path refuses any scheme://, not one cloud's: each would become a local
  directory named after the scheme on every host."""
  with pytest.raises(ValueError, match="a URI, but workdirs are filesystem paths"):
    wd.check_local_path(uri)


def test_a_fourth_start_at_one_step_gets_its_own_config_file(tmp_path):
  """write_config_history never overwrites: config.2.json, then config.2.1.json, config.2.2.json
  (the loop that looks for a free name runs as long as the name is taken)."""
  names = [os.path.basename(wd.write_config_history(str(tmp_path), {"i": i}, 2))
           for i in range(4)]
  assert names == ["config.json", "config.2.json", "config.2.1.json", "config.2.2.json"]
  assert wd.read_json_object(str(tmp_path / "config.2.1.json")) == {"i": 2}


def test_an_earlier_start_moves_aside_whole(tmp_path):
  """set_aside_earlier_start moves every RUN_OUTPUTS entry (the TensorBoard directory too: a
  fresh start's events would otherwise land beside the old ones) and every config*.json."""
  for name in ("config.json", "config.2.json", "config.2.1.json", "metrics.jsonl"):
    (tmp_path / name).write_text("{}")
  (tmp_path / "tb").mkdir()
  (tmp_path / "notes.md").write_text("mine")
  dest = wd.set_aside_earlier_start(str(tmp_path))
  assert sorted(os.listdir(dest)) == ["config.2.1.json", "config.2.json", "config.json",
                                      "metrics.jsonl", "tb"]
  assert sorted(os.listdir(tmp_path)) == ["notes.md", "previous"]


def test_a_one_shot_binary_refuses_a_locked_workdir_and_moves_an_old_traceback(tmp_path):
  """start_outputs: a training run's .lock alone (no checkpoint yet) marks its workdir; an
  earlier failure's traceback.txt moves aside with the earlier outputs."""
  train = tmp_path / "train"
  train.mkdir()
  (train / ".lock").write_text("pid 1 on host\n")
  with pytest.raises(ValueError, match=r"holds a training run or sweep \(\.lock\)"):
    wd.start_outputs(str(train), {}, ("result.json",))
  run = tmp_path / "run"
  run.mkdir()
  (run / "traceback.txt").write_text("Traceback ...")
  dest = wd.start_outputs(str(run), {"a": 1}, ("result.json",))
  assert sorted(os.listdir(dest)) == ["traceback.txt"]
  assert sorted(os.listdir(run)) == ["config.json", "previous"]


def test_read_json_object_refuses_json_that_is_not_an_object(tmp_path):
  """A side-car or config holding a list is named as such, not returned as if it were a dict."""
  path = tmp_path / "x.json"
  path.write_text("[1, 2]")
  with pytest.raises(ValueError, match=r"x\.json: expected a JSON object, got list"):
    wd.read_json_object(str(path))


# metrics.py --------------------------------------------------------------------------------------

def test_a_disabled_writer_never_rewrites_metrics(tmp_path):
  """Processes other than 0 (enabled=False) leave metrics.jsonl alone, truncate_after too:
  process 0 owns the file, and a second writer would race its atomic rewrite."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2}\n')
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False, enabled=False)
  writer.truncate_after(1)
  writer.write(3, {"x": 1.0})
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_resumed_runs_tensorboard_hides_the_steps_after_its_checkpoint(tmp_path, monkeypatch):
  """MetricsLog.begin(start) opens TensorBoard with purge_step=start + 1 (events of a crashed
  trajectory past the checkpoint are hidden), as it truncates metrics.jsonl after `start`."""
  from tensorboardX.proto.event_pb2 import SessionLog
  from rlhfuse_jax.trainer import hooks
  from tests.test_metrics import read_events

  class Cfg:
    num_iterations = 9
  (tmp_path / "metrics.jsonl").write_text('{"step": 4}\n{"step": 5}\n')
  log = hooks.MetricsLog(str(tmp_path), Cfg(), lambda m: "")
  log.begin(4)
  log.end(failing=False)
  # TensorBoard's purge marker: a session START at step 5 (what it hides from).
  starts = [e.step for e in read_events(tmp_path / "tb")
            if e.HasField("session_log") and e.session_log.status == SessionLog.START]
  assert starts == [5]
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 4}\n'


# parallel/distributed.py -------------------------------------------------------------------------

def test_a_process_id_past_the_last_is_refused(monkeypatch):
  """process_id must lie in [0, num_processes): num_processes itself names the flag's range
  before jax.distributed is asked to start."""
  import jax
  from rlhfuse_jax.parallel import distributed
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  with pytest.raises(ValueError, match=r"process_id=2: expected an integer in \[0, 2\)"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  assert not calls


def test_tasks_that_do_not_divide_over_the_nodes_keep_jaxs_own_rule():
  """5 tasks on 4 nodes is not one task per node (some node runs two), nor is an unknown task
  count: slurm_node_gpus gives None (jax's rule) rather than every GPU of the node to each."""
  from rlhfuse_jax.parallel import distributed
  env = {"SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_NUM_NODES": "4",
         "SLURM_GPUS_ON_NODE": "8"}
  assert distributed.slurm_node_gpus(env) is None
  assert distributed.slurm_node_gpus({**env, "SLURM_STEP_NUM_TASKS": "4"}) == list(range(8))
  unknown = {k: v for k, v in env.items() if not k.startswith("SLURM_STEP_")}
  assert distributed.slurm_node_gpus(unknown) is None  # tasks per node unknown


# trainer/hooks.py --------------------------------------------------------------------------------

def _checkpoints(workdir, steps, fallback=True, every=1):
  """hooks.Checkpoints over a tiny state saved at `steps`, with the config fields it reads."""
  import types
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import hooks
  cfg = types.SimpleNamespace(
      seed=0, num_iterations=10, checkpoint=types.SimpleNamespace(
          keep=3, every=every, fallback=fallback, resume_changes_set=frozenset()))
  ckpts = hooks.Checkpoints(str(workdir), cfg, {})
  for step in steps:
    ckpts.checkpointer.save(step, {"w": jnp.full((2,), float(step))},
                            {"iteration": step, "seed": 0, "data": {}})
    ckpts.checkpointer.wait()
  return ckpts


def test_a_side_car_without_the_data_position_is_damage(tmp_path):
  """resume_point: a side-car lacking "data" (or "iteration") is unreadable like a broken one:
  set aside, and the run resumes from the checkpoint before it."""
  import jax.numpy as jnp
  ckpts = _checkpoints(tmp_path, [1])
  try:
    ckpts.checkpointer.save(2, {"w": jnp.zeros((2,))}, {"iteration": 2, "seed": 0})
    ckpts.checkpointer.wait()
    step, meta = ckpts.resume_point()
    assert step == 1 and meta["iteration"] == 1
    assert os.listdir(tmp_path / "damaged_checkpoints") == ["2"]
  finally:
    ckpts.checkpointer.close()


def test_a_checkpoint_put_back_under_another_number_is_refused(tmp_path):
  """resume_point: a checkpoint directory whose side-car is another iteration's (put back from
  damaged_checkpoints/ under a wrong number) is refused naming both numbers; it resumed at the
  directory's number with the other iteration's data position, silently."""
  import shutil
  _checkpoints(tmp_path, [1]).checkpointer.close()
  shutil.copytree(tmp_path / "checkpoints" / "1", tmp_path / "checkpoints" / "3")
  ckpts = _checkpoints(tmp_path, [])  # a new start: it lists the directory put back
  try:
    with pytest.raises(ValueError, match="checkpoint 3 .* holds the side-car of iteration 1"):
      ckpts.resume_point()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "3"]  # nothing moved
  finally:
    ckpts.checkpointer.close()


@pytest.mark.parametrize("error", [MemoryError("host"),
                                   RuntimeError("RESOURCE_EXHAUSTED: out of memory")])
def test_running_out_of_memory_in_a_restore_sets_nothing_aside(tmp_path, error):
  """An out-of-memory error while a checkpoint is read is not damage: it is raised as it came
  and the checkpoint stays in the rotation (set aside, the run would go back a checkpoint)."""
  ckpts = _checkpoints(tmp_path, [1, 2])
  try:
    with pytest.raises(type(error), match=str(error)):
      ckpts._damaged(2, error)
    assert ckpts.checkpointer.all_steps() == [2, 1]
    assert not (tmp_path / "damaged_checkpoints").exists()
  finally:
    ckpts.checkpointer.close()


def test_setting_aside_the_only_checkpoint_stops_instead_of_starting_over(tmp_path):
  """A run whose only checkpoint cannot be read sets it aside and stops with an error: going on
  would silently restart from iteration 0."""
  ckpts = _checkpoints(tmp_path, [2])
  try:
    (tmp_path / "checkpoints" / "2" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(ValueError, match="it was the only checkpoint"):
      ckpts.resume_point()
    assert os.listdir(tmp_path / "damaged_checkpoints") == ["2"]
  finally:
    ckpts.checkpointer.close()


def test_the_last_iteration_is_saved_whatever_the_period(tmp_path):
  """Checkpoints.after saves every checkpoint.every iterations, at num_iterations (10, not a
  multiple of every=4) and when stopping: a finished run's last iteration is never redone."""
  import jax.numpy as jnp
  ckpts = _checkpoints(tmp_path, [], every=4)
  ckpts.state_fn = lambda: {"w": jnp.zeros((2,))}
  try:
    for step in range(1, 11):
      ckpts.after(step, {}, stopping=step == 6)
      ckpts.wait()
    assert ckpts.checkpointer.all_steps() == [10, 8, 6]
  finally:
    ckpts.checkpointer.close()


def test_an_export_of_another_family_is_pending_again(tmp_path):
  """export_pending: an export at the right step but of another HF family than
  checkpoint.export_hf now asks for is written again; one without a recorded family is kept."""
  import types
  from rlhfuse_jax.trainer import hf_export
  out = tmp_path / hf_export.HF_EXPORT_DIR
  out.mkdir()
  cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(export_hf="mistral"))
  for family, pending in (("mistral", False), ("llama", True), (None, False)):
    (out / hf_export.EXPORT_MARKER).write_text(json.dumps({"step": 5, "family": family}))
    assert hf_export.export_pending(str(tmp_path), cfg, 5) is pending, family
  assert hf_export.export_pending(str(tmp_path), cfg, 6)  # older than the last checkpoint


def test_every_end_hook_runs_when_one_fails_and_the_first_error_is_raised():
  """run_hooks(..., "end"): in reverse order, every hook's end runs even when one raises (a
  failed metrics close must not skip the wait for the last save); the first error is raised."""
  from rlhfuse_jax.trainer import hooks
  ended = []

  class Ends(hooks.Hook):
    def __init__(self, name, error=None):
      self.name, self.error = name, error

    def end(self, failing):
      ended.append(self.name)
      if self.error is not None:
        raise self.error
  with pytest.raises(OSError, match="tb close"):
    hooks.run_hooks([Ends("stop"), Ends("save", KeyError("second")),
                     Ends("metrics", OSError("tb close"))], "end", False)
  assert ended == ["metrics", "save", "stop"]


# generation/fused.py -----------------------------------------------------------------------------

def test_a_batch_that_does_not_divide_over_the_instances_needs_the_rounded_up_slots():
  """check_layout: 10 samples dealt over 4 instances put 3 in the first ones, so 2 slots are
  refused before anything compiles and 3 are enough."""
  from rlhfuse_jax.generation import fused
  with pytest.raises(ValueError, match=r"put 3 in one instance; expected slots >= 3"):
    fused.check_layout(fused.FusedGenConfig(num_instances=4, slots=2), 10, 8)
  fused.check_layout(fused.FusedGenConfig(num_instances=4, slots=3), 10, 8)


# generation/multihost.py, policy/ ----------------------------------------------------------------

def test_finished_row_exchanges_pad_to_a_power_of_two():
  """pad_rows rounds a row count up to a power of two (so the all-gather compiles a handful of
  shapes, not one per count); no rows pad to one (it gave 2)."""
  from rlhfuse_jax.generation import multihost
  assert [multihost.pad_rows(n) for n in range(10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]


def test_a_length_histogram_refuses_negative_counts():
  """LengthHistogram.load_dict validates what a checkpoint's side-car holds: a negative count
  (or bin) is an error, not a histogram that sample() later fails on; add() takes lengths in
  [1, max_len] only."""
  from rlhfuse_jax.policy.lengths import LengthHistogram
  hist = LengthHistogram(8)
  with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]; got \[0, 3\]"):
    hist.add([3, 0])
  for bad in ({"bins": [2, 3], "counts": [1, -1]}, {"bins": [-1], "counts": [1]}):
    with pytest.raises(ValueError, match="a length histogram needs bins and counts"):
      hist.load_dict(bad)
  assert hist.load_dict({"bins": [2, 9], "counts": [3, 4]}) == 4
  assert hist.to_dict() == {"bins": [2], "counts": [3]}


def test_consolidation_inputs_are_checked_at_their_exact_limits():
  """The policy's validation at each boundary: slot == slots is outside the instance, one token
  over kv_capacity_tokens is over it, and more unfinished samples than the batch is an error;
  exactly at the limits is fine."""
  from rlhfuse_jax.policy import consolidation as policy
  s = policy.SampleState
  policy.InstanceState(0, slots=2, kv_capacity_tokens=10, samples=(s(0, 1, 5, 5),))
  with pytest.raises(ValueError, match="in slot 2, but the instance has slots=2"):
    policy.InstanceState(0, slots=2, kv_capacity_tokens=20, samples=(s(0, 2, 5, 5),))
  with pytest.raises(ValueError, match="need 11 tokens > kv_capacity_tokens=10"):
    policy.InstanceState(0, slots=2, kv_capacity_tokens=10, samples=(s(0, 1, 5, 6),))
  two = [policy.InstanceState(0, slots=2, kv_capacity_tokens=20,
                              samples=(s(0, 0, 5, 5), s(1, 1, 5, 5)))]
  assert not policy.plan_consolidation(two, 1.0, 2).consolidate
  with pytest.raises(ValueError, match="2 unfinished samples > total_samples=1"):
    policy.plan_consolidation(two, 1.0, 1)


def test_rt_choice_averages_every_draw_and_gives_each_candidate_the_same_draws():
  """choose_rt simulates each candidate on all `draws` batches of lengths (the same batches
  for every candidate) and keeps the smallest mean."""
  from rlhfuse_jax.policy import rt as rt_lib
  from rlhfuse_jax.policy.lengths import LengthHistogram
  hist = LengthHistogram(16)
  hist.add([1, 2, 3, 5, 8, 13, 16])
  seen = {}

  def simulate(rt, prompt_lens, lens):
    seen.setdefault(rt, []).append(lens.tolist())
    return float(lens.sum()) * (1.0 + abs(rt - 0.3))
  choice = rt_lib.choose_rt(hist, simulate, np.full(6, 4), 16, candidates=(0.1, 0.3, 0.5),
                            draws=3, seed=7)
  assert [len(v) for v in seen.values()] == [3, 3, 3]
  assert seen[0.1] == seen[0.3] == seen[0.5]
  assert choice.rt == 0.3
  want = np.mean([sum(b) for b in seen[0.3]])
  assert choice.simulated_s[0.3] == pytest.approx(want)
  # The candidates are fractions in [0, 1], both ends included; none is not a choice (refusing
  # 0 or 1, or taking an empty tuple, passed the tests of choose_rt).
  ends = rt_lib.choose_rt(hist, simulate, np.full(6, 4), 16, candidates=(0.0, 1.0), draws=1)
  assert set(ends.simulated_s) == {0.0, 1.0}
  for bad, match in (((0.2, 1.5), r"rt candidate 1\.5 must be in \[0, 1\]"),
                     ((-0.1,), r"rt candidate -0\.1 must be in \[0, 1\]"),
                     ((), "rt candidates must not be empty")):
    with pytest.raises(ValueError, match=match):
      rt_lib.choose_rt(hist, simulate, np.full(6, 4), 16, candidates=bad)


def test_consolidation_packs_the_largest_samples_first():
  """Moved samples are packed in decreasing need: the 6-token sample takes the 6 free tokens of
  instance 1, the two 5-token ones the 10 of instance 0. (Smallest first, neither fit tried
  fits them, and the plan settled for keeping instance 2, which holds less work.)"""
  from rlhfuse_jax.policy import consolidation as policy
  s = policy.SampleState
  insts = [policy.InstanceState(0, slots=4, kv_capacity_tokens=20, samples=(s(10, 0, 9, 1),)),
           policy.InstanceState(1, slots=4, kv_capacity_tokens=14, samples=(s(11, 0, 7, 1),)),
           policy.InstanceState(2, slots=4, kv_capacity_tokens=30, samples=(
               s(0, 0, 1, 5), s(1, 1, 1, 4), s(2, 2, 1, 4)))]
  plan = policy.plan_consolidation(insts, 1.0, 5)
  assert plan.consolidate and plan.kept == (0, 1) and plan.released == (2,)
  assert {m.uid: m.dst_instance for m in plan.moves} == {0: 1, 1: 0, 2: 0}


def test_a_decode_table_round_trips_and_refuses_a_repeated_occupancy():
  """calibration.to_dict keeps the decode table's per_context_token_s (from_dict(to_dict(c))
  == c up to path), and from_dict refuses occupied_slots that repeat a value (np.interp needs
  strictly increasing points)."""
  from rlhfuse_jax.policy import calibration as cal_lib
  obj = {"format": cal_lib.FORMAT, "device": "cpu", "ops": {"decode_step": {
      "occupied_slots": [1, 4], "seconds": [0.01, 0.02], "per_context_token_s": 1e-6}}}
  cal = cal_lib.from_dict(obj, "a.json")
  assert cal_lib.from_dict(cal_lib.to_dict(cal), "a.json") == cal
  assert cal.decode_step.step_s(4, 1000) == pytest.approx(0.021)
  obj["ops"]["decode_step"]["occupied_slots"] = [4, 4]
  with pytest.raises(ValueError, match=r"occupied_slots=\[4.0, 4.0\] must be strictly increasing"):
    cal_lib.from_dict(obj, "a.json")


def test_train_stage_times_use_the_measured_backward_and_exact_stage_lists():
  """TrainStage.stage_times: a measured backward wins over bwd_over_fwd x forward, per-stage
  lists are used as given, and a list of another length than the stages (longer too) is an
  error naming the field."""
  from rlhfuse_jax.policy.calibration import TrainStage
  ts = TrainStage(actor_fwd_s=1.0, critic_fwd_s=2.0, actor_bwd_s=5.0,
                  critic_fwd_per_stage_s=(1.5, 2.5))
  fwd, bwd = ts.stage_times("actor", 2)
  np.testing.assert_array_equal(fwd, [1.0, 1.0])
  np.testing.assert_array_equal(bwd, [5.0, 5.0])
  fwd, bwd = ts.stage_times("critic", 2)
  np.testing.assert_array_equal(fwd, [1.5, 2.5])
  np.testing.assert_array_equal(bwd, [4.0, 4.0])  # no measured critic backward: 2 x forward
  for stages in (1, 3):
    with pytest.raises(ValueError, match=f"critic_fwd_per_stage_s has 2 stages; this pipeline "
                                         f"has {stages} critic stages"):
      ts.stage_times("critic", stages)


@pytest.mark.parametrize("top,ops,match", [
    ({}, {"prefill": {"tokens_per_s": 0}}, "tokens_per_s=0 must be a positive finite number"),
    ({}, {"decode_step": {"occupied_slots": [1], "seconds": [0.0]}}, r"seconds\[\]=0.0 must be"),
    ({"devices_share_compute": "false"}, {}, "devices_share_compute='false' must be true or false"),
])
def test_calibration_values_that_must_be_positive_or_boolean(top, ops, match):
  """from_dict: a rate or a measured time of 0 is refused (a division by it, or a free step),
  and devices_share_compute must be a JSON boolean (the string "false" is truthy)."""
  from rlhfuse_jax.policy import calibration as cal_lib
  with pytest.raises(ValueError, match=match):
    cal_lib.from_dict({"format": cal_lib.FORMAT, "device": "cpu", "ops": ops, **top})


# generation/sampling.py, generation/timeline.py --------------------------------------------------

def test_a_stop_token_must_be_inside_the_vocabulary():
  """check_vocab: eos_id == vocab_size is outside a vocabulary of ids 0..vocab_size-1 (it would
  never be sampled: responses would silently never stop); top_k may be the whole vocabulary."""
  from rlhfuse_jax.generation.sampling import SamplingConfig
  with pytest.raises(ValueError, match=r"sampling.eos_id=32 is outside the vocabulary"):
    SamplingConfig(eos_id=32).check_vocab(32)
  with pytest.raises(ValueError, match=r"sampling.extra_eos_ids=\(3, 32\) is outside"):
    SamplingConfig(eos_id=1, extra_eos_ids=(3, 32)).check_vocab(32)
  SamplingConfig(eos_id=31, pad_id=31).check_vocab(32)
  SamplingConfig(top_k=32).check_vocab(32)  # all of them: the same as no top-k
  with pytest.raises(ValueError, match="sampling.top_k=33 exceeds model.vocab_size=32"):
    SamplingConfig(top_k=33).check_vocab(32)


@pytest.mark.parametrize("kw,match", [({"top_p": 0.0}, r"top_p=0.0; expected in \(0, 1\]"),
                                      ({"eos_id": -2}, "eos_id=-2; expected a token id >= 0")])
def test_sampling_refuses_an_empty_nucleus_and_a_negative_eos(kw, match):
  """top_p = 0 keeps no token at all (every logit -inf); eos_id below -1 is no token id and not
  the 'no EOS' marker -1."""
  from rlhfuse_jax.generation.sampling import SamplingConfig
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kw)


def test_an_instances_segments_follow_each_other_and_busy_time_is_their_union():
  """ActivityLog: work dispatched behind earlier work on one instance starts when that ends
  (max(dispatch, previous end)); Timeline.busy_s is the union of spans, a span inside another
  adding nothing; span_s(kind) runs from that kind's first start to its last end."""
  import jax.numpy as jnp
  from rlhfuse_jax.generation.timeline import ActivityLog, Timeline
  log = ActivityLog(1)
  log.record(0, "decode", jnp.zeros(2), since=0.0)
  log.record(0, "inference", jnp.ones(2), since=0.0)
  (_, s0, e0, k0), (_, s1, e1, k1) = log.close()
  assert (k0, k1) == ("decode", "inference") and s0 == 0.0 and e0 <= s1 <= e1
  tl = Timeline(num_instances=1, segments=[(0, 0.0, 10.0, "decode"), (0, 2.0, 3.0, "load"),
                                           (0, 12.0, 13.0, "decode")],
                unfinished_curve=[], consolidations=[], gen_end_s=13.0, gen_plus_inf_s=13.0)
  assert tl.busy_s(0) == 11.0
  assert tl.instance_busy_frac == pytest.approx(11.0 / 13.0)
  assert tl.span_s("decode") == 13.0 and tl.span_s("load") == 1.0 and tl.span_s("migrate") == 0


# trainer/pipelined.py ----------------------------------------------------------------------------

def test_fewer_kv_heads_than_tensor_devices_pipeline():
  """check_config: num_kv_heads must divide mesh.tensor or be divisible by it; a single KV head
  on 2 tensor devices (each keeps it whole) is accepted, 3 heads on 2 devices are not."""
  import jax
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import pipelined
  from tests.test_trainer import tiny_config
  base = {"model.num_layers": 4, "critic_model.num_layers": 2, "pipeline.critic_pp": 2,
          "mesh.stage": 4, "mesh.data": 1, "mesh.tensor": 2, "algo.minibatch_size": 8}
  for kv, ok in ((1, True), (2, True), (3, False)):
    cfg = tiny_config(**base, **{"model.num_heads": 6, "model.num_kv_heads": kv,
                                 "model.hidden_size": 48})
    mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices())
    if ok:
      pipelined.check_config(cfg, mesh)
    else:
      with pytest.raises(ValueError, match="config.model.num_kv_heads=3 must be divisible"):
        pipelined.check_config(cfg, mesh)


# experiments/runner.py, sweep.py, config_files.py ------------------------------------------------

def test_a_one_element_tuple_override_stays_a_tuple():
  """format_value writes values as ml_collections parses them: a one-element tuple keeps its
  trailing comma ("(4)" would parse as the int 4), bools are lower-case."""
  from experiments import runner
  assert runner.format_value((4,)) == "(4,)"
  assert runner.format_value([1, 2]) == "(1,2)"
  assert runner.format_value(True) == "true" and runner.format_value(0.5) == "0.5"


def test_a_sweeps_tuple_override_reaches_the_run_as_the_sweep_wrote_it():
  """Each override as ml_collections parses the command line a sweep starts a run with:
  tuples of strings (a comma or a quote inside one) and of bools, numbers, a field's own string
  and bool. Unquoted, ('configs/ppo_tiny.py', 'configs/grpo_tiny.py') reached bench_async as
  the one string '(configs/ppo_tiny.py,configs/grpo_tiny.py)', and summary.md showed the tuple
  meant (found by a review)."""
  import ml_collections
  from absl import flags
  from ml_collections import config_flags
  from experiments import runner
  values = {"runs": ("configs/ppo_tiny.py", "x,y", "it's"), "one": ("a.py",),
            "bools": (True, False), "ints": (3, 4), "floats": (1e-3, 2.5), "name": "a b",
            "flag": False, "lr": 1e-5, "nested": ((1, "b"),)}
  defaults = {"runs": ("",), "one": ("",), "bools": (False,), "ints": (0,), "floats": (0.0,),
              "name": "", "flag": True, "lr": 0.0, "nested": ((0, ""),)}
  argv = ["prog", *(f"--config.{k}={runner.format_value(v)}" for k, v in values.items())]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_dict("config", ml_collections.ConfigDict(defaults),
                                  flag_values=fv, sys_argv=argv)
  fv(argv)
  assert fv.config.to_dict() == values


def test_a_result_records_the_commit_the_run_started_from(monkeypatch):
  """provenance() takes the git commit that note_start read at the start of the run, not the
  checkout's commit when the result is written (a long run's tree may change under it)."""
  from experiments import runner
  monkeypatch.setattr(runner, "_START", {})
  monkeypatch.setattr(runner, "git_commit", lambda: "aaaaaaaaaaaa")
  runner.note_start()
  monkeypatch.setattr(runner, "git_commit", lambda: "bbbbbbbbbbbb-dirty")
  made = runner.provenance()
  assert made["git_commit"] == "aaaaaaaaaaaa" and "started" in made


def test_host_cpu_tells_apart_two_hosts_of_one_model_name(tmp_path):
  """Two hosts both named "AMD EPYC" trained the same tiny PPO run to different rewards (XLA:CPU
  emits other code for other instruction sets): the processor in a result's provenance names
  family/model/stepping and the codegen-relevant instruction sets, so they differ; without a
  model name it falls back to `platform`."""
  from experiments import runner

  def cpuinfo(name, family, model, flags):
    block = (f"processor\t: 0\nmodel name\t: {name}\ncpu family\t: {family}\n"
             f"model\t\t: {model}\nstepping\t: 1\nflags\t\t: {flags}\n")
    path = tmp_path / f"cpuinfo_{family}_{model}"
    path.write_text(block + "\n" + block.replace(": 0", ": 1"))
    return runner.host_cpu(str(path))
  zen3 = cpuinfo("AMD EPYC", 25, 1, "fpu sse2 avx avx2 fma")
  zen4 = cpuinfo("AMD EPYC", 25, 17, "fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16")
  assert zen3 == "AMD EPYC (family 25 model 1 stepping 1; avx avx2 fma)"
  assert zen4.startswith("AMD EPYC (family 25 model 17 stepping 1; avx avx2 fma avx512f")
  assert "avx512_bf16" in zen4 and zen3 != zen4
  (tmp_path / "none").write_text("processor\t: 0\n")
  assert runner.host_cpu(str(tmp_path / "none")) == (
      runner.platform.processor() or runner.platform.machine())
  assert runner.host_cpu(str(tmp_path / "missing")) == (
      runner.platform.processor() or runner.platform.machine())


_SWEEP_SCRIPT = """
import json, os, sys
from experiments import sweep
codes = {"a": 0, "b": 0, "c": 75, "d": 0}

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  os.makedirs(run_dir, exist_ok=True)
  if name == "a":
    with open(os.path.join(run_dir, "result.json"), "w") as f:
      json.dump({"status": "done", "loss": 0.5, "provenance": {"host": "x"}}, f)
  if name == "b":
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
      f.write('{"step": 1, "loss": 0.9}\\n{"step": 2, "loss": 0.7}\\n')
  return codes[name]
sweep.run_streamed = fake_run
out = [sweep.run_sweep(sys.argv[1], "schedule_search", sys.argv[2], [])]
codes["c"] = 0
out.append(sweep.run_sweep(sys.argv[1], "schedule_search", sys.argv[2], [], only=["c"]))
try:
  sweep.load_sweep(sys.argv[3])
  out.append("accepted")
except ValueError as e:
  out.append(str(e))
print(json.dumps(out))
"""


def test_a_sweep_stops_after_a_stopped_run_and_a_subset_keeps_the_other_rows(tmp_path):
  """run_sweep (its runs faked): a result's own "status" goes under result/ (the sweep's status
  stays), a run without result.json reports its last metrics row, a run stopped with exit 75
  ends the sweep (no further run starts), and --only re-runs keep the other runs' rows. A run
  named '..' (its directory would be the sweep's parent) is refused."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = tmp_path / "s.py"
  cfg.write_text("def get_sweep():\n  return [{'name': n, 'x': i} for i, n in enumerate('abcd')]\n")
  up = tmp_path / "up.py"
  up.write_text("def get_sweep():\n  return [{'name': '..'}]\n")
  env = dict(os.environ, PYTHONPATH=repo)
  proc = subprocess.run([sys.executable, "-c", _SWEEP_SCRIPT, str(cfg), str(tmp_path / "sw"),
                         str(up)], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (rows, complete), (again, again_complete), refused = json.loads(proc.stdout.splitlines()[-1])
  assert refused.startswith("get_sweep()[0]['name']='..': expected a directory name (no '/' "
                            "or ',', not starting with '.', not starting or ending with a "
                            "space)")
  assert [r["run"] for r in rows] == ["a", "b", "c"] and not complete
  assert rows[0]["status"] == "ok" and rows[0]["result/status"] == "done"
  assert rows[0]["loss"] == 0.5 and "provenance/host" not in rows[0]
  assert rows[1]["step"] == 2 and rows[1]["loss"] == 0.7
  assert rows[2]["status"] == "stopped (exit 75; re-run to resume)"
  assert [r["run"] for r in again] == ["c"] and again_complete
  summary = json.loads((tmp_path / "sw" / "summary.json").read_text())
  assert [(r["run"], r["status"][:2]) for r in summary] == [("a", "ok"), ("b", "ok"), ("c", "ok")]


def test_a_misspelled_field_in_a_negated_boolean_flag_is_named(tmp_path):
  """config_files.diagnose reads --noconfig.FIELD (absl's negated boolean) as it reads
  --config.FIELD: the misspelled field is named with the closest one."""
  from tests.test_config_files import _fatal_line, _run
  proc = _run(tmp_path, "--config=cfg.py", "--noconfig.model.widht")
  assert _fatal_line(proc) == ("--config.model.widht: cfg.py has no field 'model.widht'; did "
                               "you mean 'model.width'?")
