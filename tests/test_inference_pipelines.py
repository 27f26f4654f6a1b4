"""The fused engine scoring on pipelines of freed instances (fusion.inference_pp = 2,
generation/fused.InferenceQueue): the same samples as single-instance scoring and the same
scores to float rounding, each instance loading only its stage (the weights loaded are half of
scoring on single instances), every instance of a unit busy, units formed in the order
instances are freed; clear errors for layouts it cannot split."""
import collections
import weakref

import jax
import numpy as np
import pytest

from rlhfuse_jax.generation.fused import FusedGenConfig, FusedGenerator
from rlhfuse_jax.generation.instances import FrozenModels
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import llama

CFG = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_seq_len=64)
SCORE = CFG.replace(head="scalar", num_layers=4)
FROZEN = FrozenModels(reference=CFG, critic=SCORE, reward=SCORE)
P, T, G, S = 6, 16, 4, 4
KEY = jax.random.key(5)


def _params():
  return {"reference": llama.host_random_params(CFG, 0),
          "critic": llama.host_random_params(SCORE, 1),
          "reward": llama.host_random_params(SCORE, 2)}


def _build(pp, **kw):
  params = _params()
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=T, chunk_size=3, eos_id=-1)
  config = FusedGenConfig(num_instances=G, slots=S, migration_threshold=0.5, inference_pp=pp,
                          inference_micro_batch=2, **kw)
  gen = FusedGenerator(CFG, sampling, config, batch_size=G * S, prompt_len=P, frozen=FROZEN,
                       actor_params=params["reference"], frozen_params=params)
  return gen, params


def _batch():
  rng = np.random.default_rng(1)
  lens = rng.integers(1, P + 1, G * S).astype(np.int32)
  tokens = rng.integers(1, CFG.vocab_size, (G * S, P)).astype(np.int32)
  tokens[np.arange(P)[None] >= lens[:, None]] = 0
  budgets = np.clip(np.rint(rng.lognormal(np.log(3), 0.8, G * S)), 1, T).astype(np.int32)
  budgets[[0, 5]] = T  # a tail on two instances: the others are freed while it decodes
  return tokens, lens, budgets


@pytest.fixture(scope="module")
def built():
  """{pp: (generator, params)} for pp 1 and 2."""
  return {pp: _build(pp) for pp in (1, 2)}


@pytest.fixture(scope="module")
def outputs(built):
  tokens, lens, budgets = _batch()
  out = {}
  for pp, (gen, params) in built.items():
    out[pp] = [gen.run(params["reference"], params, tokens, lens, KEY, budgets=budgets,
                       fuse=fuse) for fuse in (True, False)]
  return out, budgets


def test_pipelined_scores_equal_single_instance_scores(outputs):
  out, budgets = outputs
  for one, two in zip(out[1], out[2]):
    for f in ("response_tokens", "response_lens", "logprobs"):
      np.testing.assert_array_equal(getattr(one.rollout, f), getattr(two.rollout, f))
    np.testing.assert_array_equal(two.rollout.response_lens, budgets)
    for name in ("ref_logp", "values", "rewards"):
      np.testing.assert_allclose(getattr(two, name), getattr(one, name), rtol=1e-5, atol=1e-5,
                                 err_msg=name)
      assert np.ptp(getattr(two, name)) > 0


def test_each_instance_loads_its_stage_and_every_stage_runs(outputs):
  out, _ = outputs
  whole = sum(x.nbytes for p in _params().values() for x in jax.tree.leaves(p))
  fused1, fused2 = out[1][0], out[2][0]
  # every instance is freed in the end: 4 single-instance copies against 2 pipelines' copies
  assert fused1.metrics["fusion/weight_load_bytes"] == G * whole
  assert fused2.metrics["fusion/weight_load_bytes"] == G // 2 * whole
  assert fused2.consolidations and fused2.metrics["gen/migrated_samples"] > 0
  for res in (fused2, out[2][1]):
    busy = {i for i, _, _, kind in res.timeline.segments if kind == "inference"}
    assert busy == set(range(G))  # both stages of both units scored


def test_an_instance_compiles_a_program_two_models_share_once(built):
  """The critic's and the reward model's first stage (one architecture, SCORE) are one program:
  compiled once per instance and run by both (they were compiled twice at once, racing on one
  entry of jax's persistent cache); their last stages (value vs reward head) stay apart, and
  no executable is shared across instances (each runs on its own devices)."""
  gen, _ = built[2]
  seen = set()
  for inst in gen.instances:
    assert inst._exe[("critic", 0)] is inst._exe[("reward", 0)]
    assert inst._exe[("critic", 1)] is not inst._exe[("reward", 1)]
    assert inst._exe[("reference", 0)] is not inst._exe[("critic", 0)]  # 2 layers, not 4
    own = {id(e) for e in inst._exe.values()}
    assert not own & seen
    seen |= own


def test_programs_that_print_alike_but_read_other_arguments_are_kept_apart():
  """jax drops unused arguments before the text: `a * 2` and `b * 2` of (a, b) print alike and
  would have run each other's executable; the kept arguments are part of the key. The same
  program on another instance (other devices) is another key too."""
  from rlhfuse_jax.generation.instances import _program_key
  x = jax.numpy.ones(2)
  first, second = (jax.jit(f).lower(x, x) for f in (lambda a, b: a * 2, lambda a, b: b * 2))
  assert first.as_text() == second.as_text()
  one, two = object(), object()
  assert _program_key(one, first) != _program_key(one, second)
  assert _program_key(one, first) == _program_key(one, jax.jit(lambda a, b: a * 2).lower(x, x))
  assert _program_key(one, first) != _program_key(two, first)


def test_units_are_formed_in_the_order_instances_are_freed(built):
  from rlhfuse_jax.generation import fused as fused_lib
  gen, params = built[2]
  q = fused_lib.InferenceQueue(gen, params, table=None, prompts=None, prompt_lens=None,
                               log=None)
  q.gen = type("G", (), {"is_local": staticmethod(lambda i: False), "config": gen.config,
                         "owner": gen.owner})()
  for i in (3, 0, 2):
    q.free(i)
  assert q.units == [(3, 0)] and [q.stage(i) for i in (3, 0, 2)] == [0, 1, 0]
  q.free(1)
  assert q.units == [(3, 0), (2, 1)] and q.stage(1) == 1
  q.close()


@pytest.mark.parametrize("kw, match", [
    (dict(pp=3), r"fusion.inference_pp=3: must divide num_instances=4"),
    (dict(pp=4, critic=8), r"inference_pp=4: must divide the 2 layers of the reference"),
    (dict(pp=0), r"fusion.inference_pp=0: expected an integer >= 1"),
])
def test_layouts_the_pipelines_cannot_split_are_refused(kw, match):
  pp = kw["pp"]
  with pytest.raises(ValueError, match=match):
    config = FusedGenConfig(num_instances=G, slots=S, migration_threshold=0.5, inference_pp=pp)
    FusedGenerator(CFG, SamplingConfig(max_new_tokens=T), config, batch_size=G * S,
                   prompt_len=P, frozen=FROZEN, actor_params=_params()["reference"],
                   frozen_params=_params())


def test_the_trainer_scores_on_pipelines_of_instances(tmp_path):
  """train_ppo with fusion.inference_pp=2 on 4 instances: the first iteration's samples are
  the serial stage's and its reference log-probs, values and rewards equal them to float
  rounding; the run trains on (finite losses). The same field through a plan file is checked
  in tests/test_plan.py."""
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import rollout
  from rlhfuse_jax.trainer.loop import PPOTrainer
  from tests.test_fused_trainer import tiny
  from tests.test_trainer import record_rollouts

  two = {"model.num_layers": 2, "critic_model.num_layers": 2, "num_iterations": 2}
  mesh = lambda: mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4])  # noqa
  serial = PPOTrainer(tiny(**two), str(tmp_path / "serial"), mesh=mesh())
  want = record_rollouts(serial)
  serial.run()
  piped = PPOTrainer(tiny(**two, **{"fusion.inter_stage": True, "fusion.inference_pp": 2,
                                    "fusion.migration_threshold": "1.0"}),
                     str(tmp_path / "piped"), mesh=mesh())
  assert isinstance(piped.rollout, rollout.FusedStage)
  got = record_rollouts(piped)
  hist = piped.run()
  a, b = want[0][1], got[0][1]
  for field in ("response_tokens", "response_lens", "logprobs"):
    np.testing.assert_array_equal(getattr(a.rollout, field), getattr(b.rollout, field))
  for field in ("ref_logp", "values", "scores"):
    np.testing.assert_allclose(getattr(b, field), getattr(a, field), rtol=1e-5, atol=1e-6)
  assert all(np.isfinite(h["actor/pg_loss"]) and np.isfinite(h["critic/vf_loss"]) for h in hist)
  assert hist[0]["fusion/weight_load_bytes"] > 0


def test_drain_completes_the_units_it_needs_in_freeing_order():
  """After generation with pp = 2: instance 3, freed alone while the tail decoded, pairs with
  the least dispatched instance; a second micro-batch needs a second unit, so every instance
  is freed; the units keep the freeing order (the instance freed first holds stage 0) and only
  units get micro-batches, least dispatched first."""
  import types
  from rlhfuse_jax.generation import fused as fused_lib
  for chunks, want_freed, want in (
      (1, [3, 1], [(3, [0, 1])]),
      (3, [3, 1, 2, 0], [(3, [0, 1]), (2, [2, 3]), (3, [4, 5])])):
    gen = types.SimpleNamespace(
        config=types.SimpleNamespace(num_instances=4, micro_batch=2, inference_pp=2),
        exchange=types.SimpleNamespace(multi=False), inflight=0, is_local=lambda i: False,
        owner=np.zeros(4, np.int64))
    q = fused_lib.InferenceQueue(gen, {}, None, None, None, None)
    try:
      q.free(3)
      q.dispatched[:] = [2, 0, 1, 0]
      q.pump = lambda block: None
      q.add(list(range(2 * chunks)))
      q.drain()
      assert q.freed == want_freed and q.units == [tuple(want_freed[k:k + 2]) for k in
                                                   range(0, len(want_freed) - 1, 2)]
      assert [(i, list(take)) for i, take, _ in q.batches] == want
    finally:
      q.close()
  # Two processes (0-1, 2-3): instance 2 freed alone pairs with 3, its own process's, not with
  # the least dispatched 0 (which would free 0 and 1 as well: two loads more).
  gen = types.SimpleNamespace(
      config=types.SimpleNamespace(num_instances=4, micro_batch=2, inference_pp=2),
      exchange=types.SimpleNamespace(multi=True), inflight=0, is_local=lambda i: False,
      owner=np.array([0, 0, 1, 1]))
  q = fused_lib.InferenceQueue(gen, {}, None, None, None, None)
  try:
    q.free(2)
    q.dispatched[:] = [0, 0, 1, 1]
    q.pump = lambda block: None
    q.add([0, 1])
    q.drain()
    assert q.freed == [2, 3] and [(i, list(take)) for i, take, _ in q.batches] == [(2, [0, 1])]
  finally:
    q.close()


def test_a_unit_runs_at_most_its_stages_and_one_more_micro_batches():
  """Each micro-batch in flight holds hidden states on the unit's instances: a unit that
  already runs pp + 1 waits for its oldest before it takes another (drain dispatches all the
  rest at once)."""
  import concurrent.futures
  import types
  from rlhfuse_jax.generation import fused as fused_lib

  class Out:
    def __init__(self, name):
      self.name, self.waited = name, False

    def is_ready(self):
      return self.waited

    def block_until_ready(self):
      self.waited = True
      return self

  class Inst:
    def score_stage(self, n, s, placed, x, seq, plens, rlens, inputs=None):
      return Out(f"{n}{s}")

  gen = types.SimpleNamespace(
      config=types.SimpleNamespace(num_instances=2, micro_batch=1, inference_pp=2),
      exchange=types.SimpleNamespace(multi=False), inflight=0, is_local=lambda i: True,
      owner=np.zeros(2, np.int64), instances=[Inst(), Inst()], models={"reference": CFG})
  log = types.SimpleNamespace(record=lambda *a, **k: None)

  def queue():
    """Unit (0, 1) loaded and running 3 micro-batches."""
    q = fused_lib.InferenceQueue(gen, {}, None, None, None, log)
    q.freed = [0, 1]
    for i in (0, 1):
      f = concurrent.futures.Future()
      f.set_result({"reference": None})
      q.loads[i] = f
    old = [{"reference": Out(f"old{k}")} for k in range(3)]
    q.batches = [[0, [k], outs] for k, outs in enumerate(old)]
    return q, old

  q, old = queue()
  try:
    q._score_stages(0, None, None, None)
    assert [o["reference"].waited for o in old] == [True, False, False]  # the oldest only
    q.batches = [[0, [k], outs] for k, outs in enumerate(old[1:])]
    q._score_stages(0, None, None, None)  # 2 running: room for a third
    assert not old[1]["reference"].waited
  finally:
    q.close()
  # Several processes: `stream` assigns a micro-batch to every unit each round, and a full
  # unit's waits in `pending` for a later round instead of blocking the decode loop.
  gen.exchange.multi = True
  q, old = queue()
  try:
    q.dispatched[0] = 3
    q._score = lambda i, take: q._score_stages(i, None, None, None)  # (no samples to build)
    q.add([7])
    q.stream()
    assert q.batches[-1][:2] == [0, [7]] and q.batches[-1][2] is None and q.pending == [3]
    assert not any(o["reference"].waited for o in old)
    old[0]["reference"].waited = True  # the oldest completes: the next round dispatches it
    q.stream()
    assert q.pending == [] and q.batches[-1][2] is not None
  finally:
    q.close()


def test_the_trainer_refuses_pipelines_it_cannot_form_before_building_anything(monkeypatch):
  """Checked by trainer/validate.py (rollout.check_fusion, check_plan,
  check_instances_within_processes) before the models are built: pp must divide the
  instances, each process's instances and the reference's and critic's layers."""
  from rlhfuse_jax.trainer import rollout
  from tests.test_fused_trainer import tiny
  two = {"model.num_layers": 2, "critic_model.num_layers": 2}
  cases = [
      ({"fusion.inter_stage": True, "fusion.inference_pp": 2},  # 1-layer models
       r"config\.fusion\.inference_pp=2: must divide the 1 layers of the reference"),
      ({**two, "critic_model.num_layers": 3, "fusion.inter_stage": True,
        "fusion.inference_pp": 2},
       r"config\.fusion\.inference_pp=2: must divide the 3 layers of the critic"),
      ({**two, "fusion.inter_stage": True, "fusion.inference_pp": 3},
       r"config\.fusion\.inference_pp=3: must divide num_instances=4"),
      ({**two, "plan.generation": "instances", "plan.inference_pp": 3},
       r"config\.plan\.inference_pp=3: expected a divisor of the 4 instances"),
      ({"plan.generation": "instances", "plan.inference_pp": 2},
       r"config\.plan\.inference_pp=2: must divide the 1 layers of the reference"),
  ]
  for overrides, match in cases:
    cfg = tiny(**overrides)
    with pytest.raises(ValueError, match=match):
      rollout.check_fusion(cfg, 4)
      rollout.check_plan(cfg, 4)
  cfg = tiny(**two, **{"fusion.inter_stage": True, "fusion.inference_pp": 2})
  assert rollout.check_fusion(cfg, 4).inference_pp == 2
  monkeypatch.setattr(rollout.jax, "process_count", lambda: 2)
  monkeypatch.setattr(rollout.jax, "device_count", lambda: 6)
  monkeypatch.setattr(rollout.jax, "local_device_count", lambda: 3)
  with pytest.raises(ValueError, match=r"config\.fusion\.inference_pp=2: expected a divisor of "
                                       r"each process's 3 generation instances \(2 processes\)"):
    rollout.check_instances_within_processes("fusion.instance_devices", 1, 6, 2,
                                             "fusion.inference_pp")
  rollout.check_instances_within_processes("fusion.instance_devices", 1, 6, 3,
                                           "fusion.inference_pp")


def test_validation_checks_the_reward_models_layers_and_skips_a_critic_never_scored(tmp_path):
  """A reward model's shape is its checkpoint's: validate checks its layers against
  inference_pp before anything is built. Asynchronous PPO scores no critic on the instances
  (trainer/loop.py stage_critic), so its layers do not matter there."""
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import rollout
  from rlhfuse_jax.trainer import validate as validate_lib
  from tests.test_fused_trainer import tiny
  from tests.test_trainer_paths import REWARD_CFG, write_reward_checkpoint
  write_reward_checkpoint(tmp_path / "rm", REWARD_CFG.replace(num_layers=3))
  cfg = tiny(**{"model.num_layers": 2, "critic_model.num_layers": 2, "reward.kind": "model",
                "reward.model_checkpoint": str(tmp_path / "rm"), "fusion.inter_stage": True,
                "fusion.inference_pp": 2})
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4])
  with pytest.raises(ValueError, match=r"config\.fusion\.inference_pp=2: must divide the 3 "
                                       r"layers of the reward model"):
    validate_lib.validate(cfg, mesh)
  staleness = tiny(**{"model.num_layers": 2, "critic_model.num_layers": 3,
                      "fusion.inter_stage": True, "fusion.inference_pp": 2,
                      "async_ppo.staleness": 1})
  assert rollout.check_fusion(staleness, 4).inference_pp == 2
  with pytest.raises(ValueError, match=r"must divide the 3 layers of the critic"):
    rollout.check_fusion(tiny(**{"model.num_layers": 2, "critic_model.num_layers": 3,
                                 "fusion.inter_stage": True, "fusion.inference_pp": 2}), 4)


def test_auto_rt_simulates_units_within_the_processes(built):
  """trainer/rt_auto describes the engine's units to the simulator: with several processes
  each instance's process (GenSetup.instance_groups), in one process none."""
  import types
  from rlhfuse_jax.trainer.rt_auto import sim_setup
  gen, _ = built[2]
  _, _, setup = sim_setup(gen)
  assert (setup.inference_pp, setup.instance_groups) == (2, ())
  assert setup.prompt_len == P  # the width of the hidden states it hands on: [mb, P + T]
  multi = types.SimpleNamespace(**{**vars(gen), "exchange": types.SimpleNamespace(multi=True),
                                   "owner": np.array([0, 0, 1, 1])})
  _, _, setup = sim_setup(multi)
  assert (setup.inference_pp, setup.instance_groups) == (2, (0, 0, 1, 1))


def test_the_rt_calibration_times_every_stage_on_one_instance(built, monkeypatch):
  """measure_costs with pp 2 (fusion.migration_threshold='auto', run by the engine's first
  run(rt='auto')): each stage loaded and run in turn on one instance, one stage's weights at a
  time, each fed the previous stage's output; the calibration loads (policy/calibration.py).
  The instance's actor copy is gone before the first stage loads, as in a run (_Run's
  params.pop): it was measured after place_actor, beside every instance's copy, so a model
  that fits a run could fail the measurement out of memory."""
  from rlhfuse_jax.generation import measure
  gen, params = built[2]
  inst = gen.instances[gen.local[0]]
  placed, scored, actor, cals = [], [], [], []
  real_place, real_score = inst.place_stage, inst.score_stage
  real_whole, real_measure = inst.place, measure.measure_costs

  def measure_costs(*args, **kw):  # the calls below watched only while it runs
    cals.append(None)
    cals[-1] = real_measure(*args, **kw)
    return cals[-1]

  def measuring():
    return cals and cals[-1] is None

  def place_whole(c, p):  # the actor's copy (the only whole model placed at pp 2)
    out = real_whole(c, p)
    if measuring():
      actor.extend(weakref.ref(a) for a in jax.tree.leaves(out))
    return out

  def place_stage(c, p, s):
    if measuring():
      assert actor and all(r() is None for r in actor), "the actor copy is still held"
      placed.append(s)
    return real_place(c, p, s)

  def score_stage(n, s, p, x, *a):
    if measuring():
      scored.append((n, s, x is None))
    return real_score(n, s, p, x, *a)
  monkeypatch.setattr(measure, "measure_costs", measure_costs)
  monkeypatch.setattr(inst, "place", place_whole)
  monkeypatch.setattr(inst, "place_stage", place_stage)
  monkeypatch.setattr(inst, "score_stage", score_stage)
  monkeypatch.setattr(gen, "calibration", None)
  monkeypatch.setattr(gen, "rt_model", lambda *a: None)  # (a model; choose_rt's below)
  monkeypatch.setattr(gen, "choose_rt", lambda plens, auto: (0.5, None))
  tokens, lens, budgets = _batch()
  gen.run(params["reference"], params, tokens, lens, KEY, budgets=budgets, rt="auto")
  (cal,) = cals
  assert cal["ops"]["inference"]["overhead_s"] > 0 and cal["ops"]["weight_load"]["bytes_per_s"] > 0
  assert sorted(set(placed)) == [0, 1] and placed == sorted(placed)  # stage 0's loads first
  assert all(first == (s == 0) for _, s, first in scored)  # stage 1 fed stage 0's output
  # One warm-up and 3 timed calls a stage and model; the next stage's input is the last timed
  # call's output (it ran every stage a fifth time to get it).
  assert collections.Counter(scored) == {k: 4 for k in scored}, scored
