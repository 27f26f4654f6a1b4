"""perf/hlo_flops.py's collective counting and its timing (perf/scale_check.collective_seconds,
sim CostModel.group_collective_s): on hand-written HLO and on a compiled shard_map program whose
collectives are known exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlhfuse_jax.perf import hlo_flops, scale_check
from rlhfuse_jax.sim import hardware as hw_lib
from rlhfuse_jax.sim.cost_model import CostModel

# A module in the optimized-HLO text form: a loop of 5 known trips holding an all-gather over
# iota groups and an async all-reduce, a loop without a trip count holding a reduce-scatter and
# an all-reduce over named axes of permuted device ids, and a conditional whose branches move 64
# and 4096 bytes.
_HLO = """HloModule m, is_scheduled=true, num_partitions=8

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %ag = bf16[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true
  %ars = f32[32]{0} all-reduce-start(%x), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %ard = f32[32]{0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[16]{0}) tuple(%x, %x)
}

%body2 (q: (s32[], f32[16])) -> (s32[], f32[16]) {
  %q = (s32[], f32[16]{0}) parameter(0)
  %y = f32[16]{0} get-tuple-element(%q), index=1
  %rs = f32[2]{0} reduce-scatter(%y), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, to_apply=%add
  %ar2 = f32[4]{0} all-reduce(%y), channel_id=6, replica_groups=mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}, to_apply=%add
  ROOT %t2 = (s32[], f32[16]{0}) tuple(%y, %y)
}

%small (a: f32[16]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  ROOT %cp = f32[16]{0} collective-permute(%a), channel_id=4, source_target_pairs={{0,4},{4,0}}
}

%large (b: f32[16]) -> f32[1024] {
  %b = f32[16]{0} parameter(0)
  ROOT %ag2 = f32[1024]{0} all-gather(%b), channel_id=5, replica_groups={}, dimensions={0}
}

ENTRY %main (w: f32[16]) -> f32[16] {
  %w = f32[16]{0} parameter(0)
  %l1 = (s32[], f32[16]{0}) while(%w), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %l2 = (s32[], f32[16]{0}) while(%w), condition=%c, body=%body2
  %i = s32[] constant(0)
  ROOT %cond = f32[16]{0} conditional(%i, %w, %w), branch_computations={%small, %large}
}
"""


def test_counts_bytes_groups_and_loops_of_hand_written_hlo():
  costs = hlo_flops.analyze(_HLO)
  assert costs.unknown_trip_loops == 1 and costs.unread_groups == 0
  assert costs.loops == 2  # the two while loops of ENTRY
  kinds = sorted(c.kind for c in costs.collectives)
  # The larger branch's all-gather (4096 bytes), not the smaller's collective-permute.
  assert kinds == ["all-gather", "all-gather", "all-reduce", "all-reduce", "reduce-scatter"], kinds
  by_kind = {c.kind: (c, n) for c, n in costs.collectives.items() if c.nbytes not in (4096, 16)}
  # Named axes over permuted device ids: mesh position p holds device ids[p].
  ids = np.arange(8).reshape(2, 2, 2).transpose(1, 0, 2).reshape(2, 4)
  (ar2, n), = [(c, n) for c, n in costs.collectives.items() if c.nbytes == 16
               and c.kind == "all-reduce"]
  assert n == 1.0 and ar2.groups == tuple(tuple(ids[:, j].tolist()) for j in range(4))
  ag, n = by_kind["all-gather"]
  # The gathered bf16[16,8] (256 bytes) five times, over numpy's reading of the iota groups.
  want = np.arange(8).reshape(4, 2).T.reshape(2, 4)
  assert (ag.nbytes, n) == (256, 5.0) and ag.groups == tuple(map(tuple, want.tolist()))
  assert by_kind["all-reduce"][0].nbytes == 128 and by_kind["all-reduce"][1] == 5.0  # -done: 0
  rs, n = by_kind["reduce-scatter"]
  # The input (output 8 bytes x 4 members); groups: devices differing only along 'b'.
  assert (rs.nbytes, n, rs.groups) == (32, 1.0, ((0, 1, 2, 3), (4, 5, 6, 7)))
  assert costs.collective_bytes()["all-gather"] == 5 * 256 + 4096  # replica_groups={}: all 8
  # A form it does not read (a sub-axis) is counted as unread, not an error.
  assert hlo_flops._groups("replica_groups=mesh['a'=2,'b'=4] {'a':(1)2}", "all-reduce", 8) == ()
  big = [c for c in costs.collectives if c.nbytes == 4096][0]
  assert big.groups == (tuple(range(8)),)


def test_group_timing_follows_the_nodes_the_members_occupy():
  hw = hw_lib.HARDWARE["h100_sxm"]  # 8 devices per node, NVLink 450 GB/s, one 50 GB/s NIC each
  cm = CostModel(hw)
  for g in (2, 8, 16):  # consecutive groups: the simulator's own formulas
    assert cm.group_collective_s("all-gather", 1e9, range(g)) == cm.allgather_s(1e9, g)
    assert cm.group_collective_s("all-reduce", 1e9, range(g)) == cm.allreduce_s(1e9, g)
  inside = cm.group_collective_s("all-gather", 1e9, range(0, 8))
  strided = cm.group_collective_s("all-gather", 1e9, range(0, 32, 4))  # 2 per node, 4 nodes
  spread = cm.group_collective_s("all-gather", 1e9, range(0, 64, 8))  # 1 per node
  assert inside < strided < spread
  # Bandwidth terms: 7/8 GB over NVLink, over two NICs, over one.
  eff = cm.eff.net_eff
  assert strided == pytest.approx(0.875e9 / (2 * hw.inter_node_bw * eff), rel=0.05)
  assert spread == pytest.approx(0.875e9 / (hw.inter_node_bw * eff), rel=0.05)
  assert inside == pytest.approx(0.875e9 / (hw.intra_node_bw * eff), rel=0.1)


def test_a_collective_lasts_as_long_as_its_slowest_group():
  """collective_seconds: a collective runs on all its groups at once, so it lasts as long as
  the slowest (one crossing nodes, 8 devices per node here); a collective-permute's pairs cross
  the slow link when any pair does; each is counted as often as it runs."""
  hw = hw_lib.HARDWARE["h100_sxm"]
  cm = CostModel(hw)
  nbytes = 1 << 24
  near = cm.group_collective_s("all-reduce", nbytes, (0, 1))
  far = cm.group_collective_s("all-reduce", nbytes, (2, 10))
  assert far > 2 * near  # NVLink vs the NIC: the choice of group shows
  ar = hlo_flops.Collective("all-reduce", nbytes, ((0, 1), (2, 10)))
  costs = lambda colls: hlo_flops.HloCosts(flops=0.0, unknown_trip_loops=0, loops=0,
                                           collectives=colls)
  assert scale_check.collective_seconds(costs({ar: 3.0}), cm) == pytest.approx(3 * far)
  inside = hlo_flops.Collective("collective-permute", nbytes, ((0, 1), (1, 0)))
  across = hlo_flops.Collective("collective-permute", nbytes, ((0, 1), (1, 9)))
  p_in, p_out = cm.p2p_s(nbytes, False), cm.p2p_s(nbytes, True)
  assert p_out > 2 * p_in
  assert scale_check.collective_seconds(costs({inside: 1.0}), cm) == pytest.approx(p_in)
  assert scale_check.collective_seconds(costs({across: 2.0}), cm) == pytest.approx(2 * p_out)
  # Groups it could not read: timed as a pair across two nodes (the slow link), not a fast one.
  unread = hlo_flops.Collective("all-reduce", nbytes, ())
  assert scale_check.collective_seconds(costs({unread: 1.0}), cm) == pytest.approx(
      cm.group_collective_s("all-reduce", nbytes, (0, hw.devices_per_node)))
  assert scale_check.collective_seconds(costs({unread: 1.0}), cm) > 2 * near
  unread_p = hlo_flops.Collective("collective-permute", nbytes, ())
  assert scale_check.collective_seconds(costs({unread_p: 1.0}), cm) == pytest.approx(p_out)


def test_counts_a_compiled_shard_map_exactly():
  """Three trips of all_gather + psum in a fori_loop over a (2, 4) mesh: the bytes and groups
  XLA compiled are the ones written."""
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("x", "y"))

  def body(_, v):
    g = jax.lax.all_gather(v, "y", tiled=True)  # [4*16, 32] float32 per device
    return v + jax.lax.psum(g.sum(0, keepdims=True), "x")[:, :32]

  def f(v):
    return jax.lax.fori_loop(0, 3, body, v)
  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("y"), out_specs=P("y")))
  arg = jax.device_put(jnp.ones((64, 32), jnp.float32), NamedSharding(mesh, P("y")))
  costs = hlo_flops.analyze(fn.lower(arg).compile().as_text())
  got = {}
  for c, n in costs.collectives.items():
    got.setdefault(c.kind, []).append((c.nbytes, n, c.groups))
  assert got["all-gather"] == [(64 * 32 * 4, 3.0, ((0, 1, 2, 3), (4, 5, 6, 7)))]
  assert got["all-reduce"] == [(32 * 4, 3.0, ((0, 4), (1, 5), (2, 6), (3, 7)))]
  seconds = scale_check.collective_seconds(costs, CostModel(hw_lib.HARDWARE["h100_sxm"]))
  cm = CostModel(hw_lib.HARDWARE["h100_sxm"])
  assert seconds == pytest.approx(3 * (cm.allgather_s(8192, 4) + cm.allreduce_s(128, 2)))


def test_widened_collectives_count_at_the_width_the_program_asks_for():
  """program_widths: a float32 collective counts at 16 bits only where the partitioned program
  has that kind on that shape in 16 bits alone; float32 there, or both, or another kind on the
  shape: as compiled."""
  early = """HloModule e, num_partitions=8
ENTRY %main (w: bf16[4,8]) -> bf16[16,8] {
  %w = bf16[4,8]{1,0} parameter(0)
  %ag = bf16[16,8]{1,0} all-gather(%w), channel_id=1, replica_groups={}, dimensions={0}
  %ar = f32[32]{0} all-reduce(%x), channel_id=2, replica_groups={}, to_apply=%add
  %ar2 = bf16[64]{0} all-reduce(%y), channel_id=3, replica_groups={}, to_apply=%add
  %ar3 = f32[64]{0} all-reduce(%z), channel_id=4, replica_groups={}, to_apply=%add
  ROOT %r = bf16[16,8]{1,0} copy(%ag)
}
"""
  widths = hlo_flops.program_widths(early)
  assert widths[("all-gather", (16, 8))] == {"bf16"}
  assert widths[("all-reduce", (64,))] == {"bf16", "f32"}
  optimized = """HloModule o, num_partitions=8
ENTRY %main (w: f32[4,8]) -> f32[16,8] {
  %w = f32[4,8]{1,0} parameter(0)
  %ag = f32[16,8]{1,0} all-gather(%w), channel_id=1, replica_groups={}, dimensions={0}
  %ar = (f32[32]{0}, f32[64]{0}) all-reduce(%x, %y), channel_id=2, replica_groups={}, to_apply=%add
  %cp = f32[16,8]{1,0} collective-permute(%ag), channel_id=5, source_target_pairs={{0,1}}
  ROOT %r = f32[16,8]{1,0} copy(%ag)
}
"""
  plain = hlo_flops.analyze(optimized).collective_bytes()
  narrow = hlo_flops.analyze(optimized, widths).collective_bytes()
  assert plain["all-gather"] == 16 * 8 * 4 and narrow["all-gather"] == 16 * 8 * 2
  assert narrow["all-reduce"] == plain["all-reduce"] == (32 + 64) * 4
  assert narrow["collective-permute"] == plain["collective-permute"] == 16 * 8 * 4


def test_a_combined_collective_permute_counts_every_operand():
  """A collective-permute of several operands (a tuple; its -start: inputs, outputs, contexts)
  moves all of them; the in-place form (input, output, start indices, `slice_sizes`) still counts
  its first array alone. The lines are XLA's printed forms (its hlo_parser_test)."""
  two = "(f32[128,32]{0,1}, bf16[64]{0})"  # a combined permute's operands (and its outputs)
  one = "f32[128,32]{0,1}"
  hlo = "\n".join([
      "HloModule m, num_partitions=4",
      "ENTRY %main (a: f32[128,32], b: bf16[64]) -> f32[128,32] {",
      "  %a = f32[128,32]{0,1} parameter(0)",
      "  %b = bf16[64]{0} parameter(1)",
      f"  %s1 = ({two}, {two}, u32[], u32[]) collective-permute-start(%a, %b), channel_id=1, "
      + "source_target_pairs={{0,1},{1,2}}",
      f"  %d1 = {two} collective-permute-done(%s1)",
      f"  %s2 = ({two}, {two}) collective-permute-start(%a, %b), channel_id=2, "
      + "source_target_pairs={{1,2}}",
      f"  %d2 = {two} collective-permute-done(%s2)",
      f"  %cp = {two} collective-permute(%a, %b), channel_id=3, source_target_pairs={{{{2,3}}}}",
      f"  %s4 = ({one}, {one}, u32[], u32[]) collective-permute-start(%a), channel_id=5, "
      + "source_target_pairs={{0,2}}",
      f"  %s5 = ({one}, f32[128,128]{{0,1}}, u32[], u32[]) collective-permute-start(%a, %o, %t1, "
      + "%t2), channel_id=6, source_target_pairs={{0,3}}, slice_sizes={{64,32}}",
      "  ROOT %r = f32[128,32]{0,1} copy(%a)",
      "}", ""])
  costs = hlo_flops.analyze(hlo)
  got = {c.groups: c.nbytes for c in costs.collectives}
  both = 128 * 32 * 4 + 64 * 2
  assert got[((0, 1), (1, 2))] == got[((1, 2),)] == got[((2, 3),)] == both
  assert got[((0, 2),)] == 128 * 32 * 4  # one operand: (input, output, contexts)
  assert got[((0, 3),)] == 128 * 32 * 4  # in-place: the input, not the output as well
  assert hlo_flops._tuple_elements("((f32[2]{0}, s8[3]), f32[2]{0}, u32[])") == [
      "(f32[2]{0}, s8[3])", "f32[2]{0}", "u32[]"]
  assert hlo_flops._tuple_elements("f32[2]{0}") == []


def test_plan_check_reads_the_widths_from_the_partitioned_program():
  """plan_programs' compile: XLA:CPU gathers a bfloat16 weight as float32 (a convert, the
  gather, a convert back); the dump before its widening passes gives the 2 bytes an element a
  GPU moves."""
  from experiments import plan_programs
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
  w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(("data", "fsdp"))))
  lowered = jax.jit(lambda w, x: x @ w).lower(w, x)
  # Twice: the suite's persistent cache (tests/conftest.py) holds the program after the first
  # compile, and a program loaded from it is not dumped: the second must compile again.
  for _ in range(2):
    compiled, program = plan_programs._compile(lowered, None)
    costs = scale_check.compiled_costs(compiled, CostModel(hw_lib.HARDWARE["h100_sxm"]),
                                       hlo_flops.program_widths(program))
    assert costs["collective_bytes"]["all-gather"] == 256 * 512 * 4  # as XLA:CPU compiled it
    assert costs["program_collective_bytes"]["all-gather"] == 256 * 512 * 2
    assert costs["program_collective_s"] < costs["collective_s"]
  # The cache is on again afterwards, for the programs that are not dumped.
  assert jax.config.jax_enable_compilation_cache
  # A bf16 gradient summed over the data shards: XLA:CPU's all-reduce-promotion makes it f32.
  replicated = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  grad = jax.jit(jax.grad(lambda w, x: jnp.sum((x @ w).astype(jnp.float32))),
                 out_shardings=NamedSharding(mesh, P()))
  compiled, program = plan_programs._compile(grad.lower(replicated, x), None)
  costs = scale_check.compiled_costs(compiled, None, hlo_flops.program_widths(program))
  assert costs["collective_bytes"]["all-reduce"] == 256 * 512 * 4
  assert costs["program_collective_bytes"]["all-reduce"] == 256 * 512 * 2


def test_gemms_xla_gpu_hands_to_cublas_count_as_their_dots():
  """XLA:GPU rewrites most dots into cuBLAS custom-calls (`__cublas$gemm`, cuBLASLt's
  `__cublas$lt$matmul`), whose FLOPs were not counted: a GPU compile's `flops` (plan_check,
  bench_attention) read near zero. They count as the dot they replace, from the backend
  config's contracting dims and the first array of their (result, workspace) tuple, as the CPU's
  own dot of the same shapes; any other custom-call (a cuDNN attention, a Pallas kernel) is
  named in uncounted_calls, as often as it runs."""
  def gemm(name, lhs, target, contracting):
    return (f'  %{name} = (f32[16,32]{{1,0}}, s8[1028]{{0}}) custom-call({lhs}, %w), '
            f'custom_call_target="{target}", backend_config={{"gemm_backend_config":'
            '{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":'
            f'[{contracting}],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
            '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}')
  hlo = "\n".join([
      "HloModule m, is_scheduled=true",
      "",
      "%body (p: (s32[], f32[16,64])) -> (s32[], f32[16,64]) {",
      "  %p = (s32[], f32[16,64]{1,0}) parameter(0)",
      "  %x = f32[16,64]{1,0} get-tuple-element(%p), index=1",
      "  %w = f32[64,32]{1,0} constant({...})",
      gemm("g1", "%x", "__cublas$gemm", '"1"'),
      gemm("g2", "%x", "__cublas$lt$matmul", "1"),
      '  %fa = (f32[16,64]{1,0}, u8[0]{0}) custom-call(%x), custom_call_target="__cudnn$fmha"',
      "  ROOT %t = (s32[], f32[16,64]{1,0}) tuple(%x, %x)",
      "}",
      "",
      "ENTRY %main (a: f32[16,64]) -> f32[16,64] {",
      "  %a = f32[16,64]{1,0} parameter(0)",
      "  %init = (s32[], f32[16,64]{1,0}) tuple(%a, %a)",
      '  %loop = (s32[], f32[16,64]{1,0}) while(%init), condition=%c, body=%body, '
      'backend_config={"known_trip_count":{"n":"3"}}',
      "  ROOT %out = f32[16,64]{1,0} get-tuple-element(%loop), index=1",
      "}",
  ])
  costs = hlo_flops.analyze(hlo)
  one = 2.0 * 16 * 32 * 64  # [16, 64] @ [64, 32]
  assert costs.flops == 3 * 2 * one
  assert costs.uncounted_calls == {"__cudnn$fmha": 3.0}
  compiled = jax.jit(lambda x, w: x @ w).lower(jnp.ones((16, 64)), jnp.ones((64, 32))).compile()
  cpu = hlo_flops.analyze(compiled.as_text())
  assert cpu.flops == one and cpu.uncounted_calls == {}


def test_a_conditionals_custom_calls_count_as_its_busiest_branch():
  """A conditional runs one branch: a custom-call both branches hold counts once (as often as
  the branch calling it most), not once per branch, like its FLOPs (the costliest branch)."""
  def call(name, arg, target, root=""):
    return f'  {root}%{name} = f32[8]{{0}} custom-call(%{arg}), custom_call_target="{target}"'
  hlo = "\n".join([
      "HloModule m, is_scheduled=true",
      "",
      "%one (a: f32[8]) -> f32[8] {",
      "  %a = f32[8]{0} parameter(0)",
      call("k1", "a", "kernel"),
      call("f1", "k1", "flash", root="ROOT "),
      "}",
      "",
      "%two (b: f32[8]) -> f32[8] {",
      "  %b = f32[8]{0} parameter(0)",
      call("k2", "b", "kernel"),
      call("k3", "k2", "kernel", root="ROOT "),
      "}",
      "",
      "ENTRY %main (x: f32[8]) -> f32[8] {",
      "  %x = f32[8]{0} parameter(0)",
      "  %i = s32[] constant(0)",
      "  ROOT %c = f32[8]{0} conditional(%i, %x, %x), branch_computations={%one, %two}",
      "}",
  ])
  # Branch one: kernel once, flash once; branch two: kernel twice.
  assert hlo_flops.analyze(hlo).uncounted_calls == {"kernel": 2.0, "flash": 1.0}


def test_collectives_inside_called_computations_count_as_often_as_their_caller_runs():
  """XLA:GPU wraps collectives in async computations (`async-start(...), calls=%wrapped`) and
  fusions / calls hold others: they move their bytes each time the caller runs (here a loop of
  3 trips), as if they were written in place."""
  hlo = "\n".join([
      "HloModule m, is_scheduled=true, num_partitions=4",
      "",
      "%wrapped (a: f32[64]) -> f32[16] {",
      "  %a = f32[64]{0} parameter(0)",
      "  ROOT %rs = f32[16]{0} reduce-scatter(%a), channel_id=1, "
      "replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add",
      "}",
      "",
      "%inner (b: f32[32]) -> f32[32] {",
      "  %b = f32[32]{0} parameter(0)",
      "  ROOT %ar = f32[32]{0} all-reduce(%b), channel_id=2, replica_groups={{0,1},{2,3}}, "
      "to_apply=%add",
      "}",
      "",
      "%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {",
      "  %p = (s32[], f32[64]{0}) parameter(0)",
      "  %x = f32[64]{0} get-tuple-element(%p), index=1",
      "  %as = ((f32[64]{0}), f32[16]{0}) async-start(%x), calls=%wrapped",
      "  %ad = f32[16]{0} async-done(%as), calls=%wrapped",
      "  %y = f32[32]{0} slice(%x), slice={[0:32]}",
      "  %c = f32[32]{0} call(%y), to_apply=%inner",
      "  ROOT %t = (s32[], f32[64]{0}) tuple(%x, %x)",
      "}",
      "",
      "ENTRY %main (w: f32[64]) -> f32[64] {",
      "  %w = f32[64]{0} parameter(0)",
      "  %init = (s32[], f32[64]{0}) tuple(%w, %w)",
      '  %l = (s32[], f32[64]{0}) while(%init), condition=%c, body=%body, '
      'backend_config={"known_trip_count":{"n":"3"}}',
      "  ROOT %o = f32[64]{0} get-tuple-element(%l), index=1",
      "}",
  ])
  costs = hlo_flops.analyze(hlo)
  assert costs.collective_bytes() == {
      "all-gather": 0.0, "all-reduce": 3 * 32 * 4.0,
      "reduce-scatter": 3 * 16 * 4 * 4.0,  # the input: output x the group of 4
      "all-to-all": 0.0, "collective-permute": 0.0}


def test_a_donated_argument_is_counted_once_in_the_peak():
  """compiled_costs' memory figures: a donated argument the output reuses shows as alias bytes
  (subtracted once from arguments + outputs in plan_check's peak), one that is not donated does
  not: 256 x 256 float32 = 262144 bytes in and out."""
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  donated = scale_check.compiled_costs(
      jax.jit(lambda a: a + 1, donate_argnums=0).lower(x).compile())
  kept = scale_check.compiled_costs(jax.jit(lambda a: a + 1).lower(x).compile())
  for costs in (donated, kept):
    assert (costs["argument_bytes"], costs["output_bytes"]) == (262144, 262144)
  assert (donated["alias_bytes"], kept["alias_bytes"]) == (262144, 0)


def test_a_collective_without_replica_groups_spans_every_partition():
  """No replica_groups attribute at all (as `{}`): one group of all num_partitions devices."""
  hlo = "\n".join([
      "HloModule m, is_scheduled=true, num_partitions=4",
      "",
      "ENTRY %main (w: f32[8]) -> f32[8] {",
      "  %w = f32[8]{0} parameter(0)",
      "  ROOT %ar = f32[8]{0} all-reduce(%w), channel_id=1, use_global_device_ids=true, "
      "to_apply=%add",
      "}",
  ])
  (c, n), = hlo_flops.analyze(hlo).collectives.items()
  assert (c.kind, c.nbytes, c.groups, n) == ("all-reduce", 32, ((0, 1, 2, 3),), 1.0)
