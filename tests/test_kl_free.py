"""algo.kl_coef=0 (DAPO's setting): no reference is built or run, no kl/* metric is logged, and the
trajectory is the one a run that scores the reference for nothing takes."""
import logging

import jax
import numpy as np
import pytest

from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer import rollout
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES
from tests.test_trainer import record_rollouts, tiny_config

GRPO = {"num_iterations": 2, "algo.estimator": "grpo", "rollout.samples_per_prompt": 2,
        "rollout.prompts_per_iteration": 8, "algo.kl_coef": 0.0}


def _mesh():
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4])


def _deterministic(history):
  return [{k: v for k, v in h.items() if not k.startswith(TIMING_PREFIXES) and
           not k.startswith(("gen/", "fusion/"))} for h in history]


def _actor(trainer):
  return jax.device_get(trainer.actor.params)


def test_kl_coef_0_runs_no_reference_and_trains_as_if_it_had(tmp_path, monkeypatch, caplog):
  with caplog.at_level(logging.INFO):
    serial = PPOTrainer(tiny_config(**GRPO), str(tmp_path / "serial"), mesh=_mesh())
  assert ("algo.kl_coef=0: no reference model is kept or run (no KL term reads its log-probs), "
          "so no kl/* metric is logged") in caplog.text
  assert isinstance(serial.rollout, rollout.SerialStage) and serial.rollout.reference is None
  seen_serial = record_rollouts(serial)
  h_serial = serial.run()
  fused = PPOTrainer(tiny_config(**GRPO, **{"fusion.inter_stage": True,
                                            "fusion.migration_threshold": "1.0"}),
                     str(tmp_path / "fused"), mesh=_mesh())
  generator = rollout.fused_generator(fused.rollout)
  # No instance loads, compiles or runs a reference (nor anything else: no critic, no RM).
  assert "reference" not in fused.rollout.host and generator.models == {}
  seen_fused = record_rollouts(fused)
  h_fused = fused.run()
  for (_, a), (_, b) in zip(seen_serial, seen_fused, strict=True):
    assert a.ref_logp is None and b.ref_logp is None
    np.testing.assert_array_equal(a.rollout.response_tokens, b.rollout.response_tokens)
    np.testing.assert_array_equal(a.scores, b.scores)
  for h in h_serial + h_fused:
    assert not [k for k in h if k.startswith("kl/")], sorted(h)
    assert "actor/kl_loss" not in h
  for h in h_fused:  # nothing loaded onto the freed instances
    assert h["fusion/weight_load_bytes"] == 0
    # ... nor any freed for inference, by design: no reason given for its 0 % overlap (it said
    # "no instance freed before generation ended" of consolidations that had released some)
    assert rollout.progress_summary(h).endswith(", inference overlap 0%"), h
  assert _deterministic(h_serial) == _deterministic(h_fused)
  jax.tree.map(np.testing.assert_array_equal, _actor(serial), _actor(fused))
  # The reference scored for nothing (the behaviour before): the same updates, plus kl/*.
  monkeypatch.setattr(config_lib.AlgoConfig, "uses_reference", property(lambda self: True))
  wasted = PPOTrainer(tiny_config(**GRPO), str(tmp_path / "wasted"), mesh=_mesh())
  assert wasted.rollout.reference is not None
  h_wasted = wasted.run()
  assert all("kl/ref_mean" in h for h in h_wasted)
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("kl/")} for r in rows]
  assert strip(_deterministic(h_wasted)) == _deterministic(h_serial)
  jax.tree.map(np.testing.assert_array_equal, _actor(serial), _actor(wasted))


def test_async_resume_with_kl_needs_batches_that_hold_reference_log_probs(tmp_path,
                                                                         monkeypatch):
  """Batches in flight generated with kl_coef=0 hold no reference log-probs: a resume that turns
  the KL on is refused naming the field, before anything is built and without first logging
  the change as applied; one that keeps kl_coef=0 goes on without kl/*."""
  from rlhfuse_jax.trainer import hooks
  run = dict(GRPO, num_iterations=3, **{"async_ppo.staleness": 1, "checkpoint.every": 1})
  PPOTrainer(tiny_config(**run), str(tmp_path)).run(stop_after=1)
  warned = []
  monkeypatch.setattr(hooks.logging, "warning", lambda msg, *a: warned.append(msg % a))
  with pytest.raises(ValueError, match=r"config\.algo\.kl_coef=0\.1: its batch\(es\) in flight "
                     r"for iteration\(s\) \[2\] .* generated with algo\.kl_coef=0"):
    PPOTrainer(tiny_config(**{**run, "algo.kl_coef": 0.1,
                              "checkpoint.resume_changes": "algo.kl_coef"}), str(tmp_path))
  assert not [w for w in warned if "with a changed algo.kl_coef" in w], warned
  monkeypatch.undo()
  history = PPOTrainer(tiny_config(**run), str(tmp_path)).run()
  assert [h["step"] for h in history] == [2, 3]
  assert not [k for h in history for k in h if k.startswith("kl/")]


def test_a_resume_that_changes_kl_coef_keeps_the_initial_policy_as_its_reference(tmp_path):
  """Either direction of checkpoint.resume_changes=algo.kl_coef. Turned on: the reference
  built at the resume is the initial policy (the seed's), not the restored actor. Turned off
  (async PPO): the batch in flight restored with its reference log-probs drops them, so the
  resumed iterations log no kl/* (and its checkpoints then hold none: a KL is refused after)."""
  allow = {"checkpoint.resume_changes": "algo.kl_coef"}
  run = dict(GRPO, num_iterations=3, **{"checkpoint.every": 1})
  PPOTrainer(tiny_config(**run), str(tmp_path / "on")).run(stop_after=1)
  resumed = PPOTrainer(tiny_config(**{**run, **allow, "algo.kl_coef": 0.1}),
                       str(tmp_path / "on"))
  resumed.run(stop_after=2)
  initial = PPOTrainer(tiny_config(**{**run, "algo.kl_coef": 0.1}), str(tmp_path / "fresh"))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.rollout.reference),
               jax.device_get(initial.rollout.reference))
  trained = zip(jax.tree.leaves(jax.device_get(resumed.rollout.reference)),
                jax.tree.leaves(_actor(resumed)), strict=True)
  assert not all(np.array_equal(a, b) for a, b in trained)  # (the restored actor moved on)
  run = dict(run, **{"async_ppo.staleness": 1, "algo.kl_coef": 0.1})
  PPOTrainer(tiny_config(**run), str(tmp_path / "off")).run(stop_after=1)
  off = PPOTrainer(tiny_config(**{**run, **allow, "algo.kl_coef": 0.0}), str(tmp_path / "off"))
  restored = []
  match = off._match_reference
  off._match_reference = lambda start: (restored.extend(
      g.ref_logp is not None for g in off.in_flight.values()), match(start))
  history = off.run()
  assert restored == [True]  # the batch in flight came back with reference log-probs
  assert [h["step"] for h in history] == [2, 3]
  assert not [k for h in history for k in h if k.startswith("kl/")], history
