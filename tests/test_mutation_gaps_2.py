"""Cheap tests proposed by a second mutation audit (pipeline/, generation engine and instances,
sim/, parallel/): each one fails under a plausible refactoring bug that the rest of the suite
lets through (see the audit report for the mutation each kills)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import fused
from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import host_devices
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import evaluate as pipe_eval
from rlhfuse_jax.pipeline import feasible_anneal
from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline import search as pipe_search
from rlhfuse_jax.pipeline import stages
from rlhfuse_jax.pipeline import windows
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.rl import optim
from rlhfuse_jax.sim import generation_sim
from rlhfuse_jax.sim import lockstep
from rlhfuse_jax.sim import decode_fit
from rlhfuse_jax.sim import plan_search
from rlhfuse_jax.sim import validation
from rlhfuse_jax.sim.cost_model import CostModel, Efficiency, decode_step_work
from rlhfuse_jax.sim.hardware import Hardware, get_hardware
from rlhfuse_jax.sim.shapes import get_shape
from tests.test_sim_cost import EFF, TOY, TOY_HW


# pipeline/ ---------------------------------------------------------------------------------------

# Latency, unequal models and two critic replicas; here fixing the critic beats fixing the actor.
_GAP_FILL = dict(actor_pp=4, critic_pp=4, actor_microbatches=3, critic_microbatches=6,
                 actor_fwd=1.0, critic_fwd=2.0, transfer_latency=0.3)


@pytest.mark.parametrize("fixed", ["actor", "critic"])
def test_gap_fill_keeps_the_fixed_models_1f1b_timing(fixed):
  # Module docstring: the fixed model keeps its 1F1B timing; the other only fills its gaps.
  p = PipelineProblem(**_GAP_FILL)
  alone = pipe_eval.Evaluator(p)
  alone.timing(schedules.one_f_one_b_order(p, fixed),
               (0.0, np.inf) if fixed == "actor" else (np.inf, 0.0))
  nf = 2 * (p.actor_microbatches if fixed == "actor" else p.critic_microbatches)
  order = schedules._gap_fill(p, fixed)  # pylint: disable=protected-access
  ev = pipe_eval.evaluate(p, order)
  model = 0 if fixed == "actor" else 1
  for d in range(p.num_devices):
    got = np.sort(ev.ends[d][order[d] // 2 == model])
    np.testing.assert_allclose(got, np.sort(alone.ends[d, :nf]), atol=1e-9)


def test_greedy_is_the_better_of_the_two_gap_fills():
  p = PipelineProblem(**_GAP_FILL)
  keys = [pipe_eval.evaluate(p, schedules._gap_fill(p, m)).objective()  # pylint: disable=W0212
          for m in ("actor", "critic")]
  assert keys[1] < keys[0]  # the instance is chosen so that the critic-fixed one wins
  assert pipe_eval.evaluate(p, schedules.greedy_order(p)).objective() == min(keys)


@pytest.mark.parametrize("lat", [0.0, 0.3])
def test_critical_path_is_a_gapless_chain_from_time_zero_to_the_makespan(lat):
  # The chain's durations (plus one latency per device hop) add up to the makespan, each task
  # starting exactly when its chain predecessor ends: that is what makes it critical.
  p = PipelineProblem(**dict(_GAP_FILL, transfer_latency=lat))
  order = schedules.greedy_order(p)
  ev = pipe_eval.Evaluator(p)
  ok, makespan, _ = ev.timing(order)
  assert ok
  n, t = order.shape
  crit_d = np.zeros(n * t, np.int64)
  crit_p = np.zeros(n * t, np.int64)
  cnt = pipe_search.critical_path(order, p.params(), ev.ends, ev.work_p, crit_d, crit_p)
  durs = p.durations()[order.astype(np.int64)]
  starts = ev.ends - durs
  chain = list(zip(crit_d[:cnt], crit_p[:cnt]))
  assert ev.ends[chain[0]] == pytest.approx(makespan)
  assert starts[chain[-1]] == pytest.approx(0.0, abs=1e-9)
  for (d1, p1), (d0, p0) in zip(chain, chain[1:]):  # (d0, p0) comes before (d1, p1)
    gap = lat if d0 != d1 else 0.0
    assert starts[d1, p1] == pytest.approx(ev.ends[d0, p0] + gap, abs=1e-9)
  hops = sum(a[0] != b[0] for a, b in zip(chain, chain[1:]))
  assert sum(durs[c] for c in chain) + lat * hops == pytest.approx(makespan)


def test_staged_decay_mask_decays_what_the_unpipelined_optimizer_decays():
  # Weight decay on matrices only (rl/optim.py): a stage-stacked layer leaf [S, L/S, *shape] is
  # a matrix when its own shape is; norm gains and biases stay undecayed in the pipeline too.
  cfg = llama.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=2,
                          num_heads=2, num_kv_heads=1, qkv_bias=True)
  params = llama.host_random_params(cfg, 0)
  staged = stages.StageLayout(cfg, params, 2).stack(params)
  got = stages.staged_decay_mask(staged)
  want = optim._matrices_only(params)  # pylint: disable=protected-access
  assert jax.tree.leaves(got["layers"]) == jax.tree.leaves(want["layers_0"])
  assert not all(jax.tree.leaves(got["layers"]))  # the norms and biases are there
  for key in ("embed", "head"):
    assert got[key] == want[key]


def test_reinsert_moves_one_task_and_shifts_the_rest_either_way():
  base = list(range(8))
  for i in range(8):
    for j in range(8):
      row = np.array(base, np.int8)
      feasible_anneal.reinsert(row, i, j)
      want = list(base)
      want.insert(j, want.pop(i))
      assert row.tolist() == want, (i, j)


def test_lateness_measures_start_plus_tail_against_the_target():
  # Each task's tail (windows.per_task_tails) is a lower bound on the time from its start to the
  # end, so a valid schedule has no lateness at its own makespan; below it, the sum over tasks
  # of max(0, start + tail - target).
  p = PipelineProblem(**_GAP_FILL)
  order = schedules.greedy_order(p)
  ev = pipe_eval.evaluate(p, order)
  tails = windows.per_task_tails(p)
  dur = p.durations()
  n, t = order.shape
  scratch = np.zeros(n * t, np.int64)

  lateness = feasible_anneal._lateness  # pylint: disable=protected-access

  def kernel(target):
    return lateness(order, ev.ends, dur, tails, float(target), scratch, scratch.copy(), False)[0]
  assert kernel(ev.makespan) == pytest.approx(0.0, abs=1e-9)  # rounding of the 0.3 latency
  target = ev.makespan - 2.0
  want = 0.0
  for d in range(n):
    seen = [0] * 4
    for q in range(t):
      k = int(order[d, q])
      want += max(0.0, ev.starts[d, q] + tails[k, d, seen[k]] - target)
      seen[k] += 1
  assert want > 0 and kernel(target) == pytest.approx(want)


# generation/ engine, instances, fused slot table -----------------------------------------------

def _state(done, stop_reason, num_generated, budget, t_max=4):
  s = len(done)
  tokens = np.zeros((s, t_max), np.int32)
  for i, n in enumerate(num_generated):
    tokens[i, :n] = 7
  return engine.DecodeState(
      cache=None, last_token=jnp.full((s,), 7, jnp.int32), position=jnp.full((s,), 5, jnp.int32),
      prompt_len=jnp.full((s,), 3, jnp.int32), num_generated=jnp.asarray(num_generated, jnp.int32),
      done=jnp.asarray(done), stop_reason=jnp.asarray(stop_reason, jnp.int32),
      uid=jnp.arange(s, dtype=jnp.int32), budget=jnp.asarray(budget, jnp.int32),
      tokens=jnp.asarray(tokens), logprobs=jnp.zeros((s, t_max), jnp.float32))


def test_record_leaves_a_finished_row_exactly_as_it_was():
  # Row 0 stopped at its budget, row 1 on EOS; both now draw EOS (5) again: nothing may change,
  # above all not row 0's stop reason. Row 2 is live and stops on this EOS.
  sampling = SamplingConfig(max_new_tokens=4, eos_id=5)
  st = _state([True, True, False], [engine.STOP_MAX_TOKENS, engine.STOP_EOS, 0], [2, 3, 1],
              [2, 4, 4])
  out = engine._record(st, jnp.array([5, 5, 5], jnp.int32),  # pylint: disable=protected-access
                       jnp.array([-1.0, -2.0, -3.0], jnp.float32), sampling)
  np.testing.assert_array_equal(out.stop_reason, [engine.STOP_MAX_TOKENS, engine.STOP_EOS,
                                                  engine.STOP_EOS])
  np.testing.assert_array_equal(out.last_token, [7, 7, 5])
  np.testing.assert_array_equal(out.num_generated, [2, 3, 2])
  np.testing.assert_array_equal(out.tokens[:2], st.tokens[:2])
  np.testing.assert_array_equal(out.tokens[2], [7, 5, 0, 0])
  np.testing.assert_array_equal(out.logprobs[2], [0, -3.0, 0, 0])
  np.testing.assert_array_equal(out.done, True)


_TINY = llama.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, max_seq_len=32, dtype="float32",
                          param_dtype="float32")


def test_decode_keeps_the_position_invariant_and_clips_the_budget():
  # DecodeState: position = prompt_len + num_generated - 1 for every row, done rows included;
  # prefill clips a budget above max_new_tokens to it (the row then stops at T, not later).
  sampling = SamplingConfig(max_new_tokens=4, chunk_size=8, greedy=True)
  params = llama.host_random_params(_TINY, 0)
  tokens = jnp.array([[3, 4, 5], [6, 7, 0], [8, 0, 0]], jnp.int32)
  lens = jnp.array([3, 2, 1], jnp.int32)

  @jax.jit
  def run(params):
    st = engine.prefill(_TINY, params, tokens, lens, jnp.arange(3), jax.random.key(0), sampling,
                        max_len=8, budget=jnp.array([1, 2, 99], jnp.int32))
    return engine.decode_chunk(_TINY, params, st, jax.random.key(0), sampling)
  st = jax.device_get(run(params))
  np.testing.assert_array_equal(st.num_generated, [1, 2, 4])
  np.testing.assert_array_equal(st.stop_reason, engine.STOP_MAX_TOKENS)
  np.testing.assert_array_equal(st.position, np.asarray(lens) + st.num_generated - 1)


def test_check_prompts_refuses_a_zero_budget():
  # Budget 0 marks an empty slot (engine docstring); a real sample's budget is in [1, T].
  sampling = SamplingConfig(max_new_tokens=4)
  ok = instances.check_prompts(2, 3, sampling, [[1, 2, 3], [4, 5, 6]], [3, 2], budgets=[1, 4])
  np.testing.assert_array_equal(ok[3], [1, 4])
  with pytest.raises(ValueError, match="budgets"):
    instances.check_prompts(2, 3, sampling, [[1, 2, 3], [4, 5, 6]], [3, 2], budgets=[0, 4])


def test_slot_table_reports_a_finished_sample_once():
  table = fused.SlotTable(num_instances=1, slots=3, batch_size=2, max_new_tokens=2, pad_id=0)
  table.deal(0, np.array([0, 1]))
  done, n = np.array([1, 0, 1]), np.array([2, 1, 0])  # slot 2 is empty (never dealt)
  newly = table.observe(0, done, n)
  assert newly == [(0, 0)]
  stop = np.array([engine.STOP_MAX_TOKENS, 0, 0])
  toks = np.array([[3, 4], [5, 0], [0, 0]])
  assert table.finish(newly, stop, toks, np.zeros((3, 2), np.float32)) == [0]
  # The next chunk's summary still says done for slot 0: it must not be queued again.
  assert table.observe(0, np.array([1, 1, 1]), np.array([2, 2, 0])) == [(1, 1)]
  assert table.unfinished_in(0) == [1] and table.unfinished == 1


# sim/cost_model.py -------------------------------------------------------------------------------

# test_sim_cost.py's toy hardware (1 PFLOP/s, 1 GB/s HBM, 4 devices a node), model and efficiencies
_TOY_HW, _TOY, _EFF = TOY_HW, TOY, EFF


def test_decode_step_flops_count_4_per_head_dim_per_kv_token():
  # q.k and p.v: 2 multiply-adds per head dimension per key, per layer and head; one decode row
  # costs what forwarding one token over the same keys costs.
  for ctx in (0.0, 7.0, 100.0):
    flops, _ = decode_step_work(_TOY, 1, ctx)
    assert flops - decode_step_work(_TOY, 1, 0.0)[0] == pytest.approx(4 * 2 * 2 * 8 * ctx)
    assert flops == pytest.approx(_TOY.forward_flops(1, ctx))


def test_prefill_costs_the_flops_of_one_decode_step_per_position():
  # A causal prefill of L tokens does the work of L decode steps over 1..L keys. Compute-bound
  # hardware, one device (no all-reduce): the time is FLOPs / (peak x prefill_mfu).
  hw = Hardware(name="slow", peak_flops=1e9, hbm_bw=1e18, hbm_bytes=1e10, intra_node_bw=1e8,
                inter_node_bw=1e7, devices_per_node=4)
  cm = CostModel(hw, _EFF)
  lengths = [5, 64]
  flops = sum(decode_step_work(_TOY, 1, float(i))[0] for n in lengths for i in range(1, n + 1))
  assert cm.prefill_s(_TOY, 1, lengths) == pytest.approx(flops / (1e9 * _EFF.prefill_mfu))


def test_a_collective_across_unevenly_filled_nodes_runs_at_the_fewest_members_nics():
  cm = CostModel(_TOY_HW, _EFF)
  nb = 1e6
  # 3 + 1 members: the lone member's one NIC (1e7 B/s) carries the node's traffic.
  uneven = cm.group_collective_s("all-gather", nb, [0, 1, 2, 4])
  even = cm.group_collective_s("all-gather", nb, [0, 1, 4, 5])  # 2 + 2: two NICs each
  assert uneven == pytest.approx(3 / 4 * nb / (1e7 * 0.5))
  assert even == pytest.approx(3 / 4 * nb / (2e7 * 0.5))


def test_train_memory_shards_the_optimizer_states_only_under_zero1():
  # bf16 weights + grads (4 B/param) stay whole; fp32 master, m and v (12 B/param) are split
  # over dp only with ZeRO-1.
  cm = CostModel(_TOY_HW, _EFF)
  shard = _TOY.num_params() / (2 * 1)
  plain = cm.train_memory_bytes(_TOY, 2, 1, 4, False, mb_tokens=8, inflight=0)
  zero1 = cm.train_memory_bytes(_TOY, 2, 1, 4, True, mb_tokens=8, inflight=0)
  assert plain == pytest.approx(16 * shard)
  assert zero1 == pytest.approx((4 + 12 / 4) * shard)


# sim/ generation_sim, lockstep, plan_search ------------------------------------------------------

_7B = get_shape("llama-7b")


def _sim(cost, prompts, resp, **kw):
  setup = generation_sim.GenSetup(**{"max_new_tokens": int(max(resp)), "chunk_steps": 4, **kw})
  return generation_sim.simulate_generation(cost, _7B, [_7B], setup, np.array(prompts),
                                            np.array(resp))


def test_a_decode_chunk_charges_each_step_for_its_live_rows_only():
  # One instance, rows of 10 and 20 prompt tokens needing 1 and 4 more tokens after prefill:
  # step 0 runs both rows (11 + 21 KV tokens), steps 1..3 only the long one (21 + k).
  cost = CostModel(get_hardware("h100_sxm"))
  res = _sim(cost, [10, 20], [2, 5], num_instances=1, slots=2)
  steps = float(cost.decode_step_s(_7B, 1, 2, 11 + 21))
  steps += sum(float(cost.decode_step_s(_7B, 1, 1, 21 + k)) for k in range(1, 4))
  assert res.gen_end_s == pytest.approx(cost.prefill_s(_7B, 1, [10, 20]) + steps)


def test_simulated_migration_moves_the_kv_of_prompt_and_response():
  # Round measured costs; sample 0 finishes at prefill and sample 1 in the first 4-step chunk,
  # 2 and 3 sit on instances 0 and 1, so the consolidation after that chunk (not after the
  # prefill: 3 unfinished > 0.5 * 4) moves one sample holding 100 prompt tokens and 5
  # response tokens (the engine's KV holds all but the newest: 104 positions).
  cal = calibration.from_dict({
      "format": calibration.FORMAT, "device": "test", "devices_share_compute": False,
      "ops": {"decode_step": {"occupied_slots": [1, 64], "seconds": [0.01, 0.01]},
              "prefill": {"tokens_per_s": 1000.0}, "inference": {"tokens_per_s": 500.0},
              "migration": {"bytes_per_s": 1e12}}})
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal)
  res = _sim(cost, [100] * 4, [1, 5, 30, 30], num_instances=2, slots=2, threshold=0.5,
             stream_inference=True)
  (c,) = res.consolidations
  assert c["moves"] == 1 and c["time_s"] == pytest.approx(0.2 + 4 * 0.01)
  assert c["moved_bytes"] == 104 * _7B.kv_bytes_per_token()


def test_lockstep_critic_stage_times_follow_the_reversed_placement():
  # Device d runs critic stage Pc-1-(d mod Pc): with distinct per-stage times, device 0 (critic
  # stage 1) pays stage 1's forward.
  p = PipelineProblem(actor_pp=2, critic_pp=2, actor_microbatches=1, critic_microbatches=1,
                      actor_fwd=1.0, critic_fwd=1.0)
  times = lockstep.StageTimes((1.0, 1.5), (2.0, 2.5), (10.0, 20.0), (30.0, 40.0))
  order = np.array([[0, 1, 2, 3], [0, 1, 2, 3]], np.int8)
  got = lockstep.task_seconds(p, order, times)
  np.testing.assert_array_equal(got, [[1.0, 2.0, 20.0, 40.0], [1.5, 2.5, 10.0, 30.0]])


class _Plan:  # the fields _pair_reshard_s reads of a generation plan
  def __init__(self, tp):
    self.mode, self.tp = "instances", tp


@pytest.mark.parametrize("actor_pp, want", [(1, 0.0), (2, 1.5)])
def test_generation_on_the_training_layout_skips_the_reshard_only_without_an_actor_pipeline(
    actor_pp, want):
  # With an actor pipeline each device holds only its stage's layers, not a whole tp shard of
  # the model: the instances need the weights resharded.
  gen = plan_search.Candidate(plan=_Plan(2), seconds=1.0, info={"reshard_s": 1.5})
  train = plan_search.Candidate(plan={"placement": "colocated", "tp": 2, "actor_pp": actor_pp},
                                seconds=1.0)
  assert plan_search._pair_reshard_s(gen, train) == want  # pylint: disable=protected-access


def test_decode_bench_training_forward_counts_causal_attention():
  # A compute-bound training forward (batch 64 of 2048-token sequences): FLOPs of a causal
  # sequence (mean context (L+1)/2) at the cost model's train_mfu on the preset's peak.
  result = {
      "device": {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3",
                 "hardware_preset": "h100_sxm"},
      "model": {"vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1024,
                "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 0,
                "tie_embeddings": False, "qkv_bias": False, "max_seq_len": 4096},
      "decode": {"cache_len": 2, "per_batch": [{"batch": 1, "step_s": 2e-6}]},
      "train": {"batch": 64, "prompt_len": 1024, "response_len": 1024, "step_s": 1.0}}
  pred = validation.predict_bench_decode(result)
  actor = decode_fit.bench_shape(result)
  flops = 64 * actor.forward_flops(2048, 2049 / 2.0)
  eff = Efficiency()
  assert flops / (989.4e12 * eff.train_mfu) > 2 * actor.num_params() / (3.35e12 * 0.7)
  assert pred["actor_fwd_s"] == pytest.approx(flops / (989.4e12 * eff.train_mfu), rel=1e-9)


# parallel/ ---------------------------------------------------------------------------------------

def test_param_shardings_replicate_a_dimension_the_mesh_does_not_divide():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, fsdp=2, tensor=4), jax.devices()[:8])
  params = {"odd": np.zeros((6, 8), np.float32), "even": np.zeros((8, 8), np.float32)}
  specs = {"odd": P("mlp", "embed"), "even": P("mlp", "embed")}
  got = mesh_lib.param_shardings(params, specs, mesh)
  assert got["odd"].spec == P(None, "fsdp")  # 6 rows over tensor=4: replicated, not an error
  assert got["even"].spec == P("tensor", "fsdp")
  placed = mesh_lib.put(params, got)
  assert {s.data.shape for s in placed["odd"].addressable_shards} == {(6, 4)}


def test_request_host_devices_keeps_a_count_the_caller_set(monkeypatch):
  flag = "--xla_force_host_platform_device_count"
  monkeypatch.setenv("XLA_FLAGS", f"--xla_foo=1 {flag}=4")
  host_devices.request_host_devices(8)
  assert host_devices.os.environ["XLA_FLAGS"] == f"--xla_foo=1 {flag}=4"
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
  host_devices.request_host_devices(8)
  assert host_devices.os.environ["XLA_FLAGS"] == f"--xla_foo=1 {flag}=8"
