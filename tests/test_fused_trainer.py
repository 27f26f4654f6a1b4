"""train_ppo with inter-stage fusion on and off: the same trajectory (timings aside)."""
import threading
import time

import jax
import numpy as np
import pytest

from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.data import tasks
from rlhfuse_jax.generation import instances
from rlhfuse_jax.trainer import build, rollout
from rlhfuse_jax.trainer import validate as validate_lib
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES
from tests.test_docs import undocumented_metrics
from tests.test_mesh import _read_through_host
from tests.test_trainer import _params, record_rollouts, tiny_config

# Fusion metrics that measure time (the others are decided from tokens and are deterministic).
TIMED = ("gen/unfinished_curve", "gen/instance_busy_frac", "fusion/inference_overlap_frac",
         "fusion/loaded_before_gen_end", "fusion/weight_load_s", "gen/migration_s")


def tiny(**overrides):
  """tests/test_trainer.tiny_config with a long-tailed task and 12-token responses."""
  base = {"num_iterations": 3, "rollout.max_new_tokens": 12, "rollout.chunk_size": 2,
          "data.length_dist": "lognormal",  # long-tailed targets: a tail to consolidate
          "data.length_max": 8, "checkpoint.every": 100}
  return tiny_config(**{**base, **overrides})


SLOW_REWARD_S = 0.02  # per sample: tests.test_fused_trainer:slow_reward


def slow_reward(response, answer, record):
  """A user reward by import path that takes SLOW_REWARD_S a sample (a slow verifier's)."""
  time.sleep(SLOW_REWARD_S)
  return len(response) / 100.0


@pytest.fixture(scope="module")
def serial_and_fused(tmp_path_factory):
  """{False: the serial run, True: the fused one} of the same config, each (trainer, recorded
  rollouts, history). The reward function is slow_reward (which the timing tests need; one pair
  of runs for the file: two more trainers took a fifth of its time), with a format term beside
  it: both stages hand its per-sample values on (the validation pass's val/<term>_mean).
  4 devices: 4 instances of 4 slots; a random policy ends ~4 % of its samples per step (EOS),
  so by the tail 3 instances can hold the rest and Rt = 1 consolidates at once."""
  over = {"reward.function": "tests.test_fused_trainer:slow_reward",
          "reward.format": "length_match", "reward.format_weight": 0.5}
  runs = {}
  for fuse in (False, True):
    if fuse:
      over.update({"fusion.inter_stage": True, "fusion.migration_threshold": "1.0"})
    trainer = PPOTrainer(tiny(**over), str(tmp_path_factory.mktemp("fused" if fuse else "serial")),
                         mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4]))
    assert isinstance(trainer.rollout, rollout.FusedStage if fuse else rollout.SerialStage)
    seen = record_rollouts(trainer)
    runs[fuse] = (trainer, seen, trainer.run())
  return runs


def test_fused_trajectory_equals_serial(serial_and_fused):
  (serial, serial_out, h_serial), (fused, fused_out, h_fused) = (serial_and_fused[False],
                                                                 serial_and_fused[True])
  for (_, a), (_, b) in zip(serial_out, fused_out, strict=True):
    for field in ("response_tokens", "response_lens", "logprobs"):
      np.testing.assert_array_equal(getattr(a.rollout, field), getattr(b.rollout, field))
    for field in ("ref_logp", "values", "scores"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert set(a.reward_terms) == set(b.reward_terms) == {"function", "format"}
    for label, values in a.reward_terms.items():
      np.testing.assert_array_equal(values, b.reward_terms[label])
    np.testing.assert_allclose(a.scores, a.reward_terms["function"] +
                               0.5 * a.reward_terms["format"], rtol=1e-6)
  for a, b in zip(h_serial, h_fused):
    det_a = {k: v for k, v in a.items() if not k.startswith(TIMING_PREFIXES)}
    det_b = {k: v for k, v in b.items() if not k.startswith(TIMING_PREFIXES) and k in det_a}
    assert det_a == det_b  # bitwise: same tokens, same inference numbers, same updates
    extra = set(b) - set(a)
    assert {"gen/consolidation_step", "gen/migrated_samples", "gen/migrated_kv_bytes",
            "gen/instance_busy_frac", "fusion/inference_overlap_frac",
            "gen/unfinished_curve"} <= extra
  assert any(h["gen/migrated_samples"] > 0 for h in h_fused), "no consolidation exercised"
  for h in h_fused:  # the progress line's phrase says what each iteration's fusion did
    line = rollout.progress_summary(h)
    if h["gen/migrated_samples"] > 0:
      assert 0 < h["gen/consolidated_to"] < h["gen/consolidated_from"] <= 4
      assert line.startswith(f"gen: consolidated {h['gen/consolidated_from']}->"
                             f"{h['gen/consolidated_to']} instances at decode step "
                             f"{h['gen/consolidation_step']} (Rt=1), migrated "
                             f"{h['gen/migrated_samples']} samples ("), line
    else:
      assert line.startswith("gen: no consolidation (Rt=1), inference overlap "), line
  assert rollout.progress_summary(h_serial[0]) == ""
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(serial.actor.params),
                         jax.device_get(fused.actor.params))


@pytest.mark.parametrize("fuse", [False, True], ids=["serial", "fused"])
def test_a_slow_reward_function_shows_in_timing_s_reward(serial_and_fused, fuse):
  """timing_s/reward: the seconds the rewards took (the reward function here; a reward
  model's forward too in the serial stage). A slow reward function showed only inside
  timing_s/inference (serial) or nowhere but the loop's timing_s/gen_plus_inf (fused: the
  function runs after the engine's clocks stop)."""
  trainer, _, history = serial_and_fused[fuse]
  slept = SLOW_REWARD_S * trainer.cfg.rollout.batch_size
  for m in history:
    assert slept <= m["timing_s/reward"] <= m["timing_s/gen_plus_inf"], m
    if not fuse:  # the serial stage's inference includes the rewards
      assert m["timing_s/reward"] <= m["timing_s/inference"], m
    # Every metric of the row, timing_s/reward too, is documented (docs/architecture.md §1).
    assert not undocumented_metrics(m), undocumented_metrics(m)


def test_auto_rt_resumes_with_the_lengths_it_had_seen(tmp_path):
  """migration_threshold='auto': a checkpoint keeps the length histogram Rt is chosen from, so
  the run resumed after 2 of 3 iterations holds the same histogram as the straight one at the
  end (it was empty after a resume, and the first batch fell back to the prior Rt), and ends
  with the straight run's weights, bit for bit: a resume of the fused stage continues the
  trajectory (the samples do not depend on where Rt consolidates)."""
  mesh = lambda: mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4])
  cfg = lambda: tiny(**{"fusion.inter_stage": True, "fusion.migration_threshold": "auto"})
  straight = PPOTrainer(cfg(), str(tmp_path / "straight"), mesh=mesh())
  straight.run()
  want = rollout.fused_generator(straight.rollout).lengths.counts
  assert want.sum() == 3 * straight.cfg.rollout.batch_size
  first = PPOTrainer(cfg(), str(tmp_path / "run"), mesh=mesh())
  first.run(stop_after=2)
  resumed = PPOTrainer(cfg(), str(tmp_path / "run"), mesh=mesh())
  seen = []
  generator = rollout.fused_generator(resumed.rollout)
  run = generator.run
  generator.run = lambda *a, **k: seen.append(run(*a, **k)) or seen[-1]
  resumed.run()
  np.testing.assert_array_equal(generator.lengths.counts, want)
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), _params(straight))
  # Its one batch chose Rt by simulation over the 2 batches' lengths, not the prior.
  assert len(seen) == 1 and seen[0].rt_choice.simulated_s, seen[0].rt_choice


def test_progress_summary_is_one_phrase():
  m = {"gen/migrated_samples": 5, "gen/migrated_kv_bytes": 40960, "gen/consolidation_step": 12,
       "gen/consolidated_from": 8, "gen/consolidated_to": 2, "fusion/rt": 0.3,
       "fusion/inference_overlap_frac": 0.634}
  assert rollout.progress_summary(m) == (
      "gen: consolidated 8->2 instances at decode step 12 (Rt=0.3), migrated 5 samples (41 kB "
      "KV), inference overlap 63%")
  m.update({"gen/migrated_samples": 0, "gen/migrated_kv_bytes": 0, "fusion/rt": 0.0,
            "fusion/inference_overlap_frac": 0.0})
  assert rollout.progress_summary(m) == "gen: no consolidation (Rt=0), inference overlap 0%"


def test_progress_summary_says_why_inference_overlapped_nothing():
  """A 0 % overlap says why it could not be more (a loaded 2-core run showed 0 % in most
  iterations and nothing said whether fusion was broken): no instance freed before the tail
  ended, or none whose weights came in by then. A positive overlap, or a 0 % that has neither
  reason, keeps the plain phrase."""
  m = {"gen/migrated_samples": 0, "gen/migrated_kv_bytes": 0, "fusion/rt": 0.3,
       "fusion/inference_overlap_frac": 0.0, "fusion/freed_before_gen_end": 0,
       "fusion/loaded_before_gen_end": 0}
  assert rollout.progress_summary(m) == (
      "gen: no consolidation (Rt=0.3), inference overlap 0% (no instance freed before "
      "generation ended)")
  m.update({"gen/migrated_samples": 9, "gen/migrated_kv_bytes": 120000,
            "gen/consolidation_step": 10, "gen/consolidated_from": 8, "gen/consolidated_to": 3,
            "fusion/freed_before_gen_end": 5})
  assert rollout.progress_summary(m) == (
      "gen: consolidated 8->3 instances at decode step 10 (Rt=0.3), migrated 9 samples (120 kB "
      "KV), inference overlap 0% (5 freed, none loaded its weights before generation ended)")
  m["fusion/loaded_before_gen_end"] = 1  # in time, but nothing dispatched before the end
  assert rollout.progress_summary(m).endswith("), inference overlap 0%")
  m["fusion/inference_overlap_frac"] = 0.25
  assert rollout.progress_summary(m).endswith("), inference overlap 25%")


def test_progress_summary_says_what_async_ppo_and_pipelined_generation_did():
  """The progress line of an asynchronous or pipelined-generation run says so (it said nothing:
  the staleness and the overlap were in metrics.jsonl alone)."""
  m = {"async/staleness": 1, "async/policy_version": 2, "perf/async_overlap_frac": 0.614}
  assert rollout.progress_summary(m) == "async: staleness 1 (policy 2), overlap 61%"
  del m["perf/async_overlap_frac"]  # the last iteration generates nothing ahead
  assert rollout.progress_summary(m) == "async: staleness 1 (policy 2)"
  m = {"gen/pipeline_stage_busy_frac": 0.8333, "async/staleness": 0, "async/policy_version": 0}
  assert rollout.progress_summary(m) == (
      "gen pipeline: stages busy 83%; async: staleness 0 (policy 0)")
  assert rollout.progress_summary({"reward/mean": 0.5}) == ""


@pytest.mark.parametrize("overrides, match", [
    ({"fusion.instance_devices": 0}, r"config\.fusion\.instance_devices=0"),
    ({"fusion.slots": -1}, r"config\.fusion\.slots=-1"),
    ({"fusion.migration_threshold": "1.5"}, r"config\.fusion\.migration_threshold"),
])
def test_bad_fusion_fields_name_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    tiny(**overrides)


def test_instances_that_leave_devices_idle_are_warned_of(monkeypatch):
  """fusion.instance_devices=3 on 8 devices lays out 2 instances on 6 of them: legal, but the
  other 2 would stay idle while the instances generate, so validation says so, naming the
  counts; a layout that uses every device says nothing."""
  seen = []
  monkeypatch.setattr(rollout.logging, "warning", lambda msg, *a: seen.append(msg % a))
  tokenizer = tasks.make_task("repeat").tokenizer
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8), jax.devices()[:8])
  for width in (3, 2):
    cfg = build.resolve_config(tiny(**{"fusion.inter_stage": True,
                                       "fusion.instance_devices": width}), tokenizer)
    validate_lib.validate(cfg, mesh)
  assert seen == ["config.fusion: 2 instances of 3 device(s) use 6 of the 8 devices; the other 2 "
                  "stay idle while they generate (instance_devices does not divide the devices, "
                  "or num_instances is set lower)"]


def test_inter_stage_fusion_with_one_instance_is_warned_of(monkeypatch):
  """One instance (1 device, or instance_devices = all of them) has nothing to consolidate onto
  and frees no instance for inference: the fusion changes nothing, which validation says; two
  instances say nothing."""
  seen = []
  monkeypatch.setattr(rollout.logging, "warning", lambda msg, *a: seen.append(msg % a))
  tokenizer = tasks.make_task("repeat").tokenizer
  for devices, over in ((1, {}), (2, {"fusion.instance_devices": 2}), (2, {})):
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=devices), jax.devices()[:devices])
    cfg = build.resolve_config(tiny(**{"fusion.inter_stage": True, **over}), tokenizer)
    validate_lib.validate(cfg, mesh)
  assert seen == [
      f"config.fusion.inter_stage=True with one generation instance ({n} device(s), "
      f"fusion.instance_devices={n}, num_instances=1): nothing to consolidate onto and no "
      "instance freed for inference while the tail decodes, so the fusion changes nothing; it "
      "needs several instances (more devices, a smaller fusion.instance_devices, "
      "fusion.num_instances > 1 or 0: devices / instance_devices)" for n in (1, 2)]


def test_an_async_generation_group_checks_its_own_share_of_each_process(monkeypatch):
  """2 processes x 4 devices, async_ppo.generation_devices=4: each process gives 2 devices to
  generation, so an instance of 4 would span both processes. Only all devices were checked
  (4 divides 4): the engine then refused it once the models were built, telling the user to
  divide each process's 4 devices."""
  monkeypatch.setattr(rollout.jax, "process_count", lambda: 2)
  monkeypatch.setattr(rollout.jax, "device_count", lambda: 8)
  monkeypatch.setattr(rollout.jax, "local_device_count", lambda: 4)
  with pytest.raises(ValueError, match=r"config\.fusion\.instance_devices=4: expected a divisor "
                                       r"of each process's 2 generation devices \(2 processes\)"):
    rollout.check_instances_within_processes("fusion.instance_devices", 4, 4)
  rollout.check_instances_within_processes("fusion.instance_devices", 2, 4)
  rollout.check_instances_within_processes("fusion.instance_devices", 4, 8)  # all devices
  with pytest.raises(ValueError, match=r"divisor of each process's 4 devices \(2 processes\)"):
    rollout.check_instances_within_processes("fusion.instance_devices", 3, 8)


def test_both_fusions_train_and_hand_the_instances_no_gathered_copy(tmp_path, monkeypatch):
  """Inter-stage fusion beside a pipelined update (the README's main job, ppo_tiny:fused, on a
  smaller model with scanned layers, as the large presets): it trains, and the rollout stage
  hands the generator the actor as a callable (its copy freed once placed) whose layer stacks
  stay split over the stages (Update.whole's `moving`: before, a gathered whole actor on
  every training device), placed onto the 2-device instances device to device (before,
  through host memory: test_mesh.py), and the critic as a host copy (not a second critic on
  every training device through the generation)."""
  seen, split, read = [], [], _read_through_host(monkeypatch)
  real = rollout.fused_lib.FusedGenerator.run

  def run(self, actor_params, frozen_params, *args, **kwargs):
    seen.append((callable(actor_params), {n: type(jax.tree.leaves(p)[0]).__module__
                                          for n, p in frozen_params.items()}))

    def actor():
      whole = actor_params()
      split.append({x.sharding.spec[0] for x in jax.tree.leaves(whole["layers"]["block"])})
      return whole
    return real(self, actor, frozen_params, *args, **kwargs)

  def device_to_device(place):  # (also on the instances' loader thread: its own reads only)
    def placing(*args):
      before = len(read)
      placed = place(*args)
      here = [shape for thread, shape in read[before:] if thread == threading.get_ident()]
      assert not here, here  # nothing placed went through host memory
      return placed
    return placing
  monkeypatch.setattr(rollout.fused_lib.FusedGenerator, "run", run)
  # The actor onto all instances at once (place_actor), the scoring models onto a freed one.
  monkeypatch.setattr(rollout.fused_lib.FusedGenerator, "place_actor",
                      device_to_device(rollout.fused_lib.FusedGenerator.place_actor))
  monkeypatch.setattr(instances.GenerationInstance, "place",
                      device_to_device(instances.GenerationInstance.place))
  cfg = tiny(**{"num_iterations": 2, "mesh.stage": 2, "mesh.data": 4,
                "fusion.inter_stage": True, "fusion.intra_stage": True,
                "fusion.instance_devices": 2,
                "model.num_layers": 2, "critic_model.num_layers": 2,
                "model.scan_layers": True, "critic_model.scan_layers": True,
                "pipeline.actor_microbatches": 2, "pipeline.critic_microbatches": 2,
                "pipeline.search_time_s": 0.3, "pipeline.xla_opt_level": 0})
  trainer = PPOTrainer(cfg, str(tmp_path), mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()))
  assert isinstance(trainer.rollout, rollout.FusedStage) and trainer.rollout.pipelined
  history = trainer.run()
  assert [h["step"] for h in history] == [1, 2]
  assert all(np.isfinite(h["actor/pg_loss"]) and np.isfinite(h["critic/vf_loss"]) and
             h["pipeline/schedule"] == "fused" for h in history)
  assert len(seen) == 2 and all(actor for actor, _ in seen), seen
  assert split == [{"stage"}, {"stage"}], split
  for _, frozen in seen:  # host copies: the reference (frozen) and now the critic
    assert frozen == {"reference": "numpy", "critic": "numpy"}, frozen


def test_a_pipelined_runs_critic_waits_in_host_memory_for_the_instances():
  """A pipelined update's params("critic") is a gathered copy of the whole critic on every
  training device, which FusedStage kept there from before the generation to its end, beside
  the instances: it now hands the instances a host copy, as the frozen models wait (an instance
  freed for inference copies it onto its devices). A plain update's are the training state's
  own arrays, handed on as they are (no copy)."""
  x = {"w": jax.device_put(np.arange(4, dtype=np.float32))}
  host = rollout.FusedStage._instance_ready(x, pipelined=True)
  assert isinstance(host["w"], np.ndarray) and host["w"].tolist() == [0, 1, 2, 3]
  assert rollout.FusedStage._instance_ready(x, pipelined=False)["w"] is x["w"]
