"""Pins the survivors of a mutation audit of trainer/rollout.py, trainer/inputs.py and
generation/pipelined.py: each test fails under a plausible bug the rest of the suite let through
(the audit report names the mutation each one kills)."""
import types

import numpy as np

from rlhfuse_jax.generation import pipelined
from rlhfuse_jax.trainer import inputs


# trainer/inputs.py -------------------------------------------------------------------------------

S = inputs.SAMPLE_BYTES


def _shard_digest(path, data: np.ndarray) -> dict:
  path.write_bytes(data.tobytes())
  return inputs.content_fingerprint("init.actor_checkpoint", str(path))


def test_a_sampled_shard_digest_covers_its_size_and_each_samples_edges(tmp_path):
  """A weight shard over 3 MiB is hashed by its size and the 1 MiB samples at 0, (size - S) // 2
  and size - S. A shard that only grows (zeros appended: every sample still zeros) must change
  the digest, and so must a flip of the middle sample's first byte or of the file's last byte
  (a sample placed a little off misses exactly those bytes)."""
  shard = tmp_path / "model.safetensors"
  zeros = _shard_digest(shard, np.zeros(4 * S, np.uint8))
  assert _shard_digest(shard, np.zeros(5 * S, np.uint8)) != zeros  # the size counts
  data = np.random.default_rng(0).integers(0, 256, 5 * S + 7, np.uint8)
  base = _shard_digest(shard, data)
  for at in ((len(data) - S) // 2, len(data) - 1):
    flipped = data.copy()
    flipped[at] ^= 1
    assert _shard_digest(shard, flipped) != base, at
  # A byte outside the three samples is not read: the sampling is what the docstring says.
  outside = data.copy()
  outside[S + 10] ^= 1
  assert _shard_digest(shard, outside) == base


def test_empty_config_paths_fingerprint_nothing_in_the_working_directory(tmp_path, monkeypatch):
  """An empty path field names no input: it must not fingerprint the files of the working
  directory that happen to carry a template's or tokenizer's names (dirname('') is the
  working directory), or every resume from elsewhere would be refused as 'changed'."""
  monkeypatch.chdir(tmp_path)
  for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json", "config.json"):
    (tmp_path / name).write_text("{}")
  cfg = types.SimpleNamespace(
      init=types.SimpleNamespace(actor_checkpoint="", tokenizer="", critic_checkpoint=""),
      reward=types.SimpleNamespace(model_checkpoint="", kind="model"),
      data=types.SimpleNamespace(prompts_file="", chat_template=""))
  assert inputs.fingerprints(cfg) == {}


def test_a_path_change_is_judged_as_a_change_unless_its_content_was_fingerprinted():
  """resume_changes takes a path change off the changes only when the saved fingerprint of that
  field exists and equals this start's. A field neither start fingerprinted (its path held no
  file) stays a config change, even though both sides are 'missing'; and a moved input with
  other content is reported once, as other files at the new path (it was left to the
  config-change check, whose 'no resume may change' contradicted the accepted move of the
  same files), not also as a config change."""
  fp = {"config.json": "a"}
  saved = {"init.actor_checkpoint": fp}
  change = "init.tokenizer: '/a' -> '/b'"
  assert inputs.resume_changes([change], saved, {"init.actor_checkpoint": fp}, 3) == (
      [change], [])
  moved = "init.actor_checkpoint: '/m' -> '/n'"
  assert inputs.resume_changes([moved], saved, {"init.actor_checkpoint": {"config.json": "b"}},
                               3) == ([], [f"{moved} holds other files than the run started "
                                           "with (config.json changed; the KL reference is "
                                           "read from it at every start)"])


def test_a_saved_fingerprint_without_file_names_says_its_files_changed():
  """A saved fingerprint that is no {file: digest} dict (no file names to compare) yields the
  generic 'its files changed' line, not an empty list of names."""
  left, changed = inputs.resume_changes(
      [], {"init.actor_checkpoint": "digest"}, {"init.actor_checkpoint": {"config.json": "b"}}, 3)
  assert left == [] and changed == [
      "init.actor_checkpoint: its files changed since the checkpoints were written (the KL "
      "reference is read from it at every start)"]


# generation/pipelined.py -------------------------------------------------------------------------

def test_the_tick_formula_and_table_of_two_uneven_groups_by_hand():
  """Two groups needing 2 and 1 decode steps on 2 stages (job j = t - s: step j // G of group
  j % G): the last useful tick is max((2-1)*2 + 0, (1-1)*2 + 1) + 2 = 4 ticks, 3 chunk-rounded
  up to 6, 2 stages x 3 steps busy, 1 tick of fill; a batch that ends at prefill needs none."""
  f = pipelined.ticks_formula([2, 1], 2, 6)
  assert f == {"pipeline_ticks": 4, "executed_ticks": 6, "busy_stage_ticks": 6, "fill_ticks": 1,
               "chunk_ticks": 6}
  I = pipelined.IDLE
  np.testing.assert_array_equal(pipelined.expected_tick_table([2, 1], 2, 6), [
      [0, I], [1, 0], [0, 1], [I, 0], [I, I], [I, I]])
  assert pipelined.ticks_formula([0, 0], 2, 4)["pipeline_ticks"] == 0
  assert pipelined.ticks_formula([0, 0], 2, 4)["executed_ticks"] == 0


def test_busy_stats_of_a_hand_made_table():
  """busy_stats on a 7-tick, 2-stage table: stage 0 busy 3 ticks, stage 1 busy 4, one idle
  tick at the end. The steady window runs from the first tick the LAST stage works (1) to the
  last tick the FIRST stage works (3), both included: 4 of its 6 stage-ticks busy."""
  I = pipelined.IDLE
  table = np.array([[0, I], [1, 0], [I, 1], [0, I], [I, 0], [I, 1], [I, I]], np.int32)
  s = pipelined.busy_stats(table)
  assert s["ticks"] == 7 and s["busy_stage_ticks"] == 7 and s["active_ticks"] == 6
  assert s["stage_busy_frac"] == 0.5
  assert s["stage_busy_frac_per_stage"] == [3 / 7, 4 / 7]
  assert s["stage_busy_frac_steady"] == 4 / 6


# trainer/rollout.py ------------------------------------------------------------------------------

def test_automatic_fusion_slots_round_the_batch_up_over_the_instances():
  """fused_config: 0 slots means ceil(batch / instances), so every sample has a slot: 10 samples
  over 8 devices / 2 per instance = 4 instances need 3 slots each (2 would hold only 8)."""
  from rlhfuse_jax.trainer import rollout
  from tests.test_trainer import tiny_config
  fc = rollout.fused_config(tiny_config(**{"fusion.instance_devices": 2}).fusion, 10, 8)
  assert (fc.num_instances, fc.slots, fc.instance_devices) == (4, 3, 2)
  fc = rollout.fused_config(tiny_config(**{"fusion.slots": 5}).fusion, 10, 8)
  assert (fc.num_instances, fc.slots) == (8, 5)


def test_instances_plan_takes_generation_slots_from_the_exact_need_up():
  """plan_instances_config: G = 8 devices / generation_tp 2 = 4 instances; generation_slots
  equal to batch / instances (16 / 4) is enough and kept; a larger value is kept as given (not
  replaced by the need); 0 means the need."""
  from rlhfuse_jax.trainer import rollout
  from tests.test_trainer import tiny_config

  def plan(slots):
    cfg = tiny_config(**{"plan.generation": "instances", "plan.generation_tp": 2,
                         "plan.generation_slots": slots})
    assert cfg.rollout.batch_size == 16
    fc = rollout.plan_instances_config(cfg, 8)
    return fc.num_instances, fc.slots, fc.instance_devices
  assert plan(4) == (4, 4, 2)
  assert plan(6) == (4, 6, 2)
  assert plan(0) == (4, 4, 2)
  # The plan lays out the instances: config.fusion's own layout fields must stay at their
  # defaults, each one refused by name (else silently overridden by the plan's).
  import pytest
  for field, value in (("num_instances", 2), ("slots", 8)):
    with pytest.raises(ValueError, match=rf"config\.fusion\.{field}={value}: expected its "
                       "default 0"):
      rollout.plan_instances_config(tiny_config(**{"plan.generation": "instances",
                                                   f"fusion.{field}": value}), 8)


def test_an_instances_plan_accepts_inference_tp_equal_to_generation_tp():
  """check_plan: with plan.generation='instances' inference runs on the generation instances,
  so plan.inference_tp may be 0 or generation_tp itself (only another width is refused)."""
  import pytest
  from rlhfuse_jax.trainer import rollout
  from tests.test_trainer import tiny_config
  base = {"plan.generation": "instances", "plan.generation_tp": 2}
  rollout.check_plan(tiny_config(**base, **{"plan.inference_tp": 2}), 8)
  rollout.check_plan(tiny_config(**base), 8)
  with pytest.raises(ValueError, match=r"config\.plan\.inference_tp=4: expected 0 or "
                     r"plan\.generation_tp=2"):
    rollout.check_plan(tiny_config(**base, **{"plan.inference_tp": 4}), 8)


def test_a_pipeline_plan_may_use_every_device_as_a_stage():
  """check_plan: plan.generation_pp up to the device count is runnable (one device per stage),
  the layers need only divide by the stages (not by the groups), and one stage more than the
  devices is refused."""
  import pytest
  from rlhfuse_jax.trainer import rollout
  from tests.test_trainer import tiny_config
  cfg = tiny_config(**{"model.num_layers": 8, "plan.generation": "pipeline",
                       "plan.generation_pp": 8})
  rollout.check_plan(cfg, 8)
  # More groups than stages: the layers are split by stages, not groups (2 layers, 4 groups).
  rollout.check_plan(tiny_config(**{"model.num_layers": 2, "plan.generation": "pipeline",
                                    "plan.generation_pp": 2, "plan.generation_groups": 4}), 8)
  with pytest.raises(ValueError, match=r"config\.plan\.generation_pp=8: expected <= the 4 "
                     r"devices"):
    rollout.check_plan(cfg, 4)


def test_stage_kind_follows_the_plan_then_the_fusion_switch():
  """stage_kind: an own inference mesh (plan.inference_tp) alone already needs the planned stage,
  as does pipelined generation; instances win over both; otherwise fusion picks fused/serial."""
  from rlhfuse_jax.trainer import rollout
  from tests.test_trainer import tiny_config
  kind = lambda **o: rollout.stage_kind(tiny_config(**o))  # noqa: E731
  assert kind(**{"plan.inference_tp": 2}) == "planned"
  assert kind(**{"plan.generation": "pipeline"}) == "planned"
  assert kind(**{"plan.generation": "instances"}) == "instances"
  assert kind(**{"fusion.inter_stage": True}) == "fused"
  assert kind() == "serial"


def test_byte_counts_switch_units_at_exactly_a_thousand():
  """metrics.size (the progress line's migrated KV, the set-up log's memory): 1000 bytes is
  '1 kB' and 10^6 '1 MB', not '1e+03 B' / '1e+03 kB'; below a kB the integer count."""
  from rlhfuse_jax import metrics
  assert metrics.size(999) == "999 B"
  assert metrics.size(1000) == "1 kB"
  assert metrics.size(1e6) == "1 MB"
  assert metrics.size(40960) == "41 kB"


def test_only_a_fused_generator_is_offered_as_the_stages_rt_learner():
  """fused_generator: a serial stage also has a `generator` (a plain instances.Generator, with
  no Rt histogram): it must not be taken for the fused one."""
  from rlhfuse_jax.generation import fused as fused_lib
  from rlhfuse_jax.trainer import rollout
  assert rollout.fused_generator(types.SimpleNamespace(generator=object())) is None
  assert rollout.fused_generator(lambda *a: None) is None
  gen = fused_lib.FusedGenerator.__new__(fused_lib.FusedGenerator)
  assert rollout.fused_generator(types.SimpleNamespace(generator=gen)) is gen


def test_the_inference_clock_leaves_out_the_critics_fetch(monkeypatch):
  """score_rollout: timing_s/inference is the scoring time without the critic's fetch and
  placement, timing_s/reward the rewards' part of it. Clock: start 0, fetch from 1 to 6 (5 s),
  rewards from 7 to 8: 3 s of inference, 1 s of rewards."""
  from rlhfuse_jax.trainer import rollout
  clock = iter([0.0, 1.0, 6.0, 7.0, 8.0])
  monkeypatch.setattr(rollout, "time", types.SimpleNamespace(time=lambda: next(clock)))
  b, p, t = 1, 2, 2
  roll = types.SimpleNamespace(
      prompt_tokens=np.ones((b, p), np.int32), prompt_lens=np.full(b, p, np.int32),
      response_tokens=np.ones((b, t), np.int32), response_lens=np.array([2], np.int32),
      logprobs=np.zeros((b, t), np.float32))
  scorer = types.SimpleNamespace(logprobs=lambda *a: np.zeros((b, t), np.float32),
                                 values=lambda *a: np.zeros((b, t), np.float32))
  stage = types.SimpleNamespace(
      actor_cfg=None, critic_cfg=None, use_critic=True, pad_id=0, reference=None,
      sampling=types.SimpleNamespace(logprob_temperature=1.0), scorer=scorer,
      rewards=types.SimpleNamespace(
          scored_terms=lambda batch, records: (np.ones(b, np.float32), {}, {})))
  out = rollout.score_rollout(stage, roll, lambda name: name, types.SimpleNamespace(records=[{}]),
                              {})
  assert out.metrics["timing_s/inference"] == 3.0
  assert out.metrics["timing_s/reward"] == 1.0


def test_a_pipelined_rollout_counts_its_decode_steps_as_the_engine_does():
  """PipelinedRollout.decode_steps is the longest response - 1 (its first token is the
  prefill's), as instances.Generator reports it (perf accounting reads it): a batch that ends
  at prefill made no decode step."""
  from tests.test_pipelined_generation import B, CFG, _pipelined
  _, out = _pipelined(CFG, 2, 2, budgets=np.ones(B, np.int32))
  assert out.decode_steps == int(out.response_lens.max()) - 1 == 0
