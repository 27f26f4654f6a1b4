"""Pins the survivors of a mutation audit of data/rewards.py, policy/consolidation.py,
policy/rt.py, rl/minibatch.py, rl/masked.py, trainer/async_ppo.py and checkpointing.py: each test
fails under a plausible bug the rest of the suite let through (2026-12-06)."""
import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax import checkpointing
from rlhfuse_jax.data import rewards
from rlhfuse_jax.policy import consolidation, rt
from rlhfuse_jax.policy.lengths import LengthHistogram
from rlhfuse_jax.rl import masked, minibatch
from rlhfuse_jax.trainer import async_ppo

# A character-level tokenizer: id = ord(c), EOS = 0.
CHARS = types.SimpleNamespace(eos_id=0, stop_ids=[0], vocab_size=256, special_ids=set(),
                              decode=lambda ids, skip_special_tokens=False: "".join(map(chr, ids)))


# data/rewards.py ---------------------------------------------------------------------------------

def test_exact_match_strips_the_response_too():
  """"42\\n" then EOS against the target "42" matches: a newline the model ends with is no
  other answer (the response side was left unstripped)."""
  resp = np.array([[ord(c) for c in "42\n"] + [0]])
  assert rewards.exact_match([{"target": "42"}], resp, np.array([4]), CHARS).tolist() == [1.0]


def test_a_batched_reward_returning_a_column_is_refused():
  """One list per response ([[1.0], [0.0]]) is not one number per response: a [B, 1] reward
  array went on to the update, where a size check alone let it through."""
  ids, lengths = np.array([[ord("a"), 0], [ord("b"), 0]]), np.array([2, 2])
  fn = rewards.per_batch(lambda resps, answers, recs: [[1.0], [0.0]], "col")
  with pytest.raises(ValueError, match="col"):
    fn(None, ids, lengths, CHARS)


def test_a_response_length_one_past_the_buffer_is_refused():
  with pytest.raises(ValueError):
    rewards.response_extent(np.array([[5, 6, 7]]), np.array([4]), 99)
  assert np.asarray(rewards.response_extent(np.array([[5, 6, 7]]), np.array([3]), 99)).size


# policy/consolidation.py, policy/rt.py -----------------------------------------------------------

def test_consolidation_places_the_longest_remaining_tail_first():
  """The packing orders samples by what they still need (need: length + remaining), not by
  the length decoded so far: uid 2 (need 4) lands on instance 0, as the spread of the tail
  the docstring describes; ordered by length it went to instance 1."""
  S, I = consolidation.SampleState, consolidation.InstanceState
  insts = [I(0, 2, 16, (S(0, 1, 8, 3),)), I(1, 3, 19, (S(1, 2, 3, 5),)),
           I(2, 2, 14, (S(2, 0, 3, 1), S(3, 1, 1, 6)))]
  plan = consolidation.plan_consolidation(insts, 1.0, 8)
  assert sorted((mv.uid, mv.dst_instance) for mv in plan.moves) == [(2, 0), (3, 1)], plan


def test_a_sample_of_length_zero_is_refused():
  with pytest.raises(ValueError):
    consolidation.SampleState(uid=0, slot=0, length=0, remaining=4)


def test_one_observed_length_is_enough_to_simulate_rt():
  """With one response length seen, choose_rt simulates (here: consolidating later is faster,
  so 1.0); it fell back to the prior only without any."""
  h = LengthHistogram(8)
  h.add([8])
  choice = rt.choose_rt(h, lambda r, p, l: 10.0 - r, [4, 4], 8)
  assert choice.rt == 1.0, choice


# rl/minibatch.py, rl/masked.py -------------------------------------------------------------------

def test_balanced_partition_swaps_from_the_lightest_part():
  """The swap pass takes the lightest part first: on these counts it reaches part sums 109,
  110, 109, 110; from the heaviest it stopped at 109, 111, 110, 108."""
  counts = np.array([31, 27, 28, 46, 14, 40, 33, 1, 20, 43, 28, 2, 38, 36, 42, 9])
  parts = minibatch.balanced_partition(counts, 4)
  assert sorted(int(counts[p].sum()) for p in parts) == [109, 109, 110, 110]


def test_masked_mean_of_fractional_weights_below_one():
  """Weights summing to 0.5 divide by 0.5 (a floor of 1 on the count halved the mean)."""
  assert float(masked.masked_mean(jnp.array([2.0, 4.0]), jnp.array([0.25, 0.25]))) == 3.0


# trainer/async_ppo.py ----------------------------------------------------------------------------

OLD_SIDE_CAR = {"iteration": 1, "version": 0, "metrics": {}, "targets": None}  # no "ref_logp"


def test_a_side_car_from_before_ref_logp_existed_holds_reference_log_probs():
  """Side-cars saved before the "ref_logp" key carried the reference log-probs: a resume of
  one with kl_coef > 0 was refused as lacking them, and its restore dropped them."""
  assert async_ppo.lacking_reference([OLD_SIDE_CAR]) == []
  arrays = {k: np.zeros((2, 3), np.float32) for k in async_ppo.ARRAYS}
  assert async_ppo.Generated.restore(arrays, OLD_SIDE_CAR).ref_logp is not None


def test_the_generation_group_is_the_lowest_device_ids_whatever_their_order():
  devices = [types.SimpleNamespace(id=i, process_index=0) for i in (3, 2, 1, 0)]
  cfg = types.SimpleNamespace(async_ppo=types.SimpleNamespace(generation_devices=2))
  gen, train = async_ppo.split_devices(cfg, devices)
  assert [d.id for d in gen] == [0, 1] and sorted(d.id for d in train) == [2, 3]


def test_a_weight_at_the_cap_is_kept():
  """The cap drops tokens whose weight exceeds it, not one equal to it."""
  prox, behav = np.array([[np.log(2.0), 0.0]]), np.zeros((1, 2))
  weights = async_ppo.behaviour_weights(prox, behav, np.ones((1, 2)), 2.0)[0]
  assert np.allclose(np.asarray(weights), [[2.0, 1.0]]), weights


# checkpointing.py --------------------------------------------------------------------------------

def test_a_side_car_with_integer_keys_verifies_after_reading_back():
  """The checksum is of the side-car as JSON reads it back (integer keys become strings): one
  taken of the dict itself failed every read as a damaged checkpoint."""
  meta = {"iteration": 3, "by_step": {2: "a", 10: "b"}}
  meta[checkpointing.META_CHECKSUM] = checkpointing.meta_checksum(meta)
  checkpointing.verify_meta(3, json.loads(json.dumps(meta)))
