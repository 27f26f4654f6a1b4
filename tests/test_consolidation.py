"""The shared consolidation policy: threshold, minimal m, kept work, capacity, no lost sample."""
import itertools

import pytest

from rlhfuse_jax.policy.consolidation import (InstanceState, SampleState, kv_tokens_from_bytes,
                                                  plan_consolidation)


def inst(index, samples, slots=4, cap=1000, slot_cap=None, cls=""):
  return InstanceState(index=index, slots=slots, kv_capacity_tokens=cap,
                       samples=tuple(SampleState(uid=u, slot=s, length=l, remaining=r)
                                     for u, s, l, r in samples),
                       slot_capacity_tokens=slot_cap, shape_class=cls)


def check_invariants(instances, plan):
  """No sample lost or duplicated; every capacity limit holds after the moves."""
  before = sorted(s.uid for i in instances for s in i.samples)
  where = plan.placement(instances)
  assert sorted(where) == before
  assert len(set(where.values())) == len(where), "two samples in one slot"
  by_idx = {i.index: i for i in instances}
  need = {s.uid: s.need for i in instances for s in i.samples}
  for idx, i in by_idx.items():
    here = [u for u, (d, _) in where.items() if d == idx]
    assert len(here) <= i.slots
    assert sum(need[u] for u in here) <= i.kv_capacity_tokens
    if i.slot_capacity_tokens is not None:
      assert all(need[u] <= i.slot_capacity_tokens for u in here)
    assert all(0 <= where[u][1] < i.slots for u in here)
  for m in plan.moves:
    assert m.dst_instance in plan.kept and m.src_instance not in plan.kept
  for r in plan.released:
    assert not any(d == r for d, _ in where.values())


def test_above_threshold_does_nothing():
  insts = [inst(0, [(0, 0, 10, 5)]), inst(1, [(1, 0, 10, 5)])]
  plan = plan_consolidation(insts, threshold=0.2, total_samples=8)
  assert not plan.consolidate and "Rt*total" in plan.reason
  assert plan.kept == (0, 1) and plan.moves == ()


def test_one_sample_nothing_to_move():
  insts = [inst(0, [(7, 2, 10, 5)]), inst(1, [])]
  plan = plan_consolidation(insts, threshold=1.0, total_samples=1)
  assert not plan.consolidate and "fewest" in plan.reason
  assert plan.kept == (0,) and plan.released == (1,)


def test_minimal_m_and_fewest_bytes_moved():
  # 3 instances, 4 slots each; 5 unfinished samples -> 2 instances suffice, not 1.
  insts = [inst(0, [(0, 0, 100, 10), (1, 1, 90, 10)]),
           inst(1, [(2, 0, 20, 10)]),
           inst(2, [(3, 0, 50, 10), (4, 3, 60, 10)])]
  plan = plan_consolidation(insts, threshold=0.5, total_samples=12, bytes_per_token=8)
  assert plan.consolidate
  assert len(plan.kept) == 2
  assert plan.kept == (0, 2)  # most KV tokens held: 190 and 110 (instance 1 holds 20)
  assert [m.uid for m in plan.moves] == [2]
  assert plan.moved_tokens == 20 and plan.moved_bytes == 160
  assert plan.kept_work_tokens == 300
  check_invariants(insts, plan)


def test_kept_set_maximises_kept_work_exhaustively():
  insts = [inst(0, [(0, 0, 30, 5), (1, 1, 31, 5)], slots=3),
           inst(1, [(2, 0, 80, 5)], slots=3),
           inst(2, [(3, 0, 10, 5)], slots=3),
           inst(3, [(4, 2, 45, 5)], slots=3)]
  plan = plan_consolidation(insts, threshold=1.0, total_samples=5)
  assert plan.consolidate and len(plan.kept) == 2  # 5 samples, 3 slots each
  kept_work = sum(i.work_tokens for i in insts if i.index in plan.kept)
  best = 0
  for pair in itertools.combinations(insts, 2):
    if sum(i.slots - len(i.samples) for i in pair) >= 5 - sum(len(i.samples) for i in pair):
      best = max(best, sum(i.work_tokens for i in pair))
  assert kept_work == best == 141  # instances 1 (80) and 0 (61)
  check_invariants(insts, plan)


def test_kv_capacity_forces_more_instances():
  # Slots would allow one instance, the KV pool (counting tokens still to come) does not.
  insts = [inst(i, [(i, 0, 100, 300)], slots=8, cap=900) for i in range(4)]
  plan = plan_consolidation(insts, threshold=1.0, total_samples=4)
  assert plan.consolidate and len(plan.kept) == 2  # 4 x 400 = 1600 > 900 per instance
  check_invariants(insts, plan)


def test_slot_capacity_respected():
  # Instance 1 has short slots: the long sample of instance 0 cannot go there.
  insts = [inst(0, [(0, 0, 50, 400)], slots=2, cap=2000, slot_cap=512),
           inst(1, [(1, 0, 60, 10)], slots=2, cap=2000, slot_cap=100)]
  plan = plan_consolidation(insts, threshold=1.0, total_samples=2)
  assert plan.consolidate and plan.kept == (0,)
  assert plan.moves[0].uid == 1 and plan.moves[0].dst_instance == 0
  assert plan.moves[0].dst_slot == 1
  check_invariants(insts, plan)


def test_nothing_fits_gives_reason_not_error():
  insts = [inst(0, [(0, 0, 10, 10), (1, 1, 10, 10)], slots=2),
           inst(1, [(2, 0, 10, 10), (3, 1, 10, 10)], slots=2)]
  plan = plan_consolidation(insts, threshold=1.0, total_samples=4)
  assert not plan.consolidate and "no migration" in plan.reason
  assert plan.moves == () and plan.kept == (0, 1)


def test_shape_classes_never_mix():
  insts = [inst(0, [(0, 0, 10, 5)], cls="tp1"), inst(1, [(1, 0, 10, 5)], cls="tp2"),
           inst(2, [(2, 0, 20, 5)], cls="tp1"), inst(3, [], cls="tp2")]
  plan = plan_consolidation(insts, threshold=1.0, total_samples=3)
  assert plan.consolidate and plan.kept == (1, 2)
  assert [(m.uid, m.dst_instance) for m in plan.moves] == [(0, 2)]
  check_invariants(insts, plan)


def test_many_random_states_keep_invariants():
  import numpy as np
  rng = np.random.default_rng(0)
  for trial in range(60):
    g = int(rng.integers(2, 9))
    insts, uid = [], 0
    for i in range(g):
      slots = int(rng.integers(1, 6))
      samples = []
      used = 0
      for slot in rng.permutation(slots)[:int(rng.integers(0, slots + 1))]:
        l, r = int(rng.integers(1, 50)), int(rng.integers(0, 50))
        if used + l + r > 300:
          continue
        used += l + r
        samples.append((uid, int(slot), l, r))
        uid += 1
      insts.append(inst(i, samples, slots=slots, cap=300))
    if uid == 0:
      continue
    plan = plan_consolidation(insts, threshold=1.0, total_samples=uid, bytes_per_token=2)
    check_invariants(insts, plan)
    busy = sum(1 for i in insts if i.samples)
    if plan.consolidate:
      assert len(plan.kept) < busy
      assert plan.moved_bytes == 2 * plan.moved_tokens


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match="threshold"):
    plan_consolidation([], threshold=1.5, total_samples=1)
  with pytest.raises(ValueError, match="more than once"):
    plan_consolidation([inst(0, [(1, 0, 5, 5)]), inst(1, [(1, 0, 5, 5)])], 1.0, 4)
  with pytest.raises(ValueError, match="slots=2"):
    inst(0, [(0, 3, 5, 5)], slots=2)
  with pytest.raises(ValueError, match="kv_capacity_tokens"):
    inst(0, [(0, 0, 600, 500)], cap=1000)
  with pytest.raises(ValueError, match="slot_capacity_tokens"):
    inst(0, [(0, 0, 60, 50)], slot_cap=100)
  assert kv_tokens_from_bytes(1000, 64) == 15
