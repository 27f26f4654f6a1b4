"""Inter-stage fusion over 2 processes x 2 CPU devices on 127.0.0.1 (jax.distributed): the same
tokens, log-probs, reference log-probs, values and rewards, bitwise, as 1 process with the 4
devices, with consolidations that migrate KV rows between the processes (and within one); a
process that dies or hangs stops the other with a clear error."""
import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rlhfuse_jax.generation import timeline as timeline_lib
from rlhfuse_jax.generation.multihost import EXIT_PEER_LOST
from rlhfuse_jax.models import llama
from tests import fused_mp_worker as worker
from tests.test_train_ppo_binary import REPO
from tests.xla_env import free_port, subprocess_env

TIMEOUT_S = 300


def launch(n: int, devices: int, out_dir: str, **env_vars) -> list:
  """The worker as n processes with `devices` CPU devices each; returns the Popen objects."""
  env = subprocess_env(devices, **env_vars)
  port = free_port()  # the coordinator's
  return [subprocess.Popen([sys.executable, "-m", "tests.fused_mp_worker", str(i), str(n), port,
                            out_dir], cwd=REPO, env=env, stdout=open(f"{out_dir}/log{i}", "w"),
                           stderr=subprocess.STDOUT) for i in range(n)]


def wait(procs, out_dir: str) -> None:
  try:
    codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  logs = "".join(open(f"{out_dir}/log{i}").read()[-3000:] for i in range(len(procs)))
  assert codes == [0] * len(procs), logs


# 4 instances, 2 per process (half the compiles of 8), on the batch whose consolidations cross
# the processes both ways asserted below.
INSTANCES, SEED = 4, 23


def test_two_processes_match_one_process_with_cross_host_migration(tmp_path):
  out_dir = str(tmp_path)
  procs = launch(2, INSTANCES // 2, out_dir, FUSED_MP_INSTANCES=str(INSTANCES),
                 FUSED_MP_SEED=str(SEED))
  try:
    single = worker.run_case(INSTANCES, SEED)  # this process: its first 4 of 8 devices
  finally:
    wait(procs, out_dir)
  multi = [np.load(os.path.join(out_dir, f"proc{i}.npz")) for i in range(2)]
  for name, _, _ in worker.RUNS:
    for f in worker.FIELDS + worker.MODELS:
      k = f"{name}/{f}"
      for i in range(2):  # every process holds every sample's outputs, in sample order
        np.testing.assert_array_equal(multi[i][k], single[k], err_msg=f"process {i}: {k}")
      # ... and the fused runs are the baseline's (consolidation changes nothing).
      np.testing.assert_array_equal(single[k], single[f"baseline/{f}"], err_msg=k)
  for k in ("rewards_only/rewards", "rewards_only/response_tokens"):  # a validation pass's
    for i in range(2):
      np.testing.assert_array_equal(multi[i][k], single[k], err_msg=f"process {i}: {k}")
  np.testing.assert_array_equal(single["rewards_only/rewards"], single["late/rewards"])
  # Pipelines of 2 instances (fusion.inference_pp=2), each process's own: the same samples and
  # scores as one process, whose units may pair instances the processes could not.
  for f in worker.FIELDS + worker.MODELS:
    for i in range(2):
      np.testing.assert_allclose(multi[i][f"piped/{f}"], single[f"piped/{f}"], rtol=1e-5,
                                 atol=1e-6, err_msg=f"process {i}: piped/{f}")
  cfg2 = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, max_seq_len=64)
  whole = sum(x.nbytes for c in (cfg2, cfg2.replace(head="scalar"), cfg2.replace(head="scalar"))
              for x in jax.tree.leaves(llama.host_random_params(c, 0)))
  # each process's 2 instances form one unit: at most one copy of the models between them
  # (scoring on single instances, each freed instance loads all of them); the metric counts
  # both processes' loads
  for m in multi:
    assert 0 < m["piped/own_load_bytes"] <= whole
    assert m["piped/load_bytes"] == sum(n["piped/own_load_bytes"] for n in multi)
  for name, _, _ in worker.RUNS:
    one = json.loads(str(single[f"{name}/metrics"]))
    both = [json.loads(str(m[f"{name}/metrics"])) for m in multi]
    for m in both:  # the same decisions: plans, rounds, chunks, bytes
      for k in ("gen/migrated_samples", "gen/migrated_kv_bytes", "gen/migration_copied_bytes",
                "gen/consolidation_step", "gen/decode_rounds", "gen/instance_chunks",
                "gen/instance_chunks_unfused"):
        assert m[k] == one[k], (name, k)
      for c, d in zip(m["consolidations"], one["consolidations"], strict=True):
        for k in ("step", "kept", "released", "moves", "copied_bytes"):
          assert c[k] == d[k], (name, k)
      assert [u for _, u in m["gen/unfinished_curve"]] == [
          u for _, u in one["gen/unfinished_curve"]]
    # The overlap metrics cover every process's instances, as freed_before_gen_end (set by the
    # tokens) does: each process watched only its own, and process 0's figures alone said
    # "none loaded" where the other's instances had loaded and scored during the tail.
    # [process][loaded, before_s, total_s, load_s, busy_s, instance_s]
    local = [m["local_figures"] for m in both]
    before, total, load_s, busy_s, instance_s = (sum(f[k] for f in local) for k in range(1, 6))
    for m in both:
      assert m["fusion/freed_before_gen_end"] == one["fusion/freed_before_gen_end"], name
      assert m["fusion/loaded_before_gen_end"] == sum(f[0] for f in local), (name, local)
      assert m["fusion/loaded_before_gen_end"] <= m["fusion/freed_before_gen_end"], name
      assert m["fusion/inference_overlap_frac"] == pytest.approx(
          before / total if total else 0.0, rel=1e-12), (name, local)
      # So do the weight loads and busy time (process 0's alone logged about half the bytes).
      # (Not the one-process run's bytes: one process frees instances for the samples still
      # waiting at the end, which depends on how fast the loads went: InferenceQueue.stream.)
      assert m["fusion/weight_load_bytes"] == sum(n["own_load_bytes"] for n in both) > 0, name
      assert m["fusion/weight_load_s"] == pytest.approx(load_s, rel=1e-12), (name, local)
      assert m["gen/instance_busy_frac"] == pytest.approx(busy_s / instance_s, rel=1e-12), (
          name, local)
    # The migrations' spans and waits, the stage times and the curve's read-outs: each process
    # timed its own instances by its own clock, and process 0's alone understated the others'
    # (in the late batch no same-process copies and 0.034 s of cross-process waiting logged
    # where process 1 copied for 0.025 s and waited 0.123 s). The slowest process's, on a
    # clock from the earliest process's start (timeline.combined_figures).
    own = [m["own_clock"] for m in both]
    slowest = {k: max(o[k] for o in own) for k in own[0] if k != "curve_s"}
    generate = slowest["gen_end_s"]
    for m in both:
      for k, o in (("gen/migration_s", "migration_s"), ("gen/migration_same_host_s", "same_host_s"),
                   ("gen/migration_cross_host_s", "cross_host_s"),
                   ("gen/migration_cross_host_compile_s", "compile_s"),
                   ("timing_s/generate", "gen_end_s"), ("timing_s/actor_to_instances", "place_s")):
        assert {**m, **m["timing"]}[k] == slowest[o], (name, k, own)
      gen_plus_inf = max(o["gen_plus_inf_s"] + generate - o["gen_end_s"] for o in own)
      assert m["timing"]["timing_s/gen_plus_inf"] == pytest.approx(gen_plus_inf, rel=1e-12), own
      assert m["timing"]["timing_s/inference"] == pytest.approx(gen_plus_inf - generate,
                                                                 rel=1e-12), own
      assert [t for t, _ in m["gen/unfinished_curve"]] == [
          round(max(ts), 5) for ts in zip(*[o["curve_s"] for o in own], strict=True)], own
    assert one["gen/migrated_samples_cross_host"] == 0  # one process: nothing crosses
    assert both[0]["gen/migrated_samples_cross_host"] == both[1][
        "gen/migrated_samples_cross_host"]
  early = [json.loads(str(m["early/metrics"])) for m in multi]
  late = [json.loads(str(m["late/metrics"])) for m in multi]
  # Rt = 1: consolidation right after prefill keeps instances 2-3 (process 1) and moves every
  # unfinished sample of instances 0-1 (process 0) across; Rt = 0.5, mid-decode, moves some
  # samples across and some within a process.
  c = early[0]["consolidations"][0]
  assert c["step"] == 0 and c["kept"] == [2, 3] and c["cross_host_moves"] == c["moves"] > 0
  c = late[0]["consolidations"][0]
  assert c["step"] > 0 and 0 < c["cross_host_moves"] < c["moves"], c
  for m in early + late:
    assert m["gen/migration_cross_host_bytes"] > 0 and m["gen/migration_cross_host_s"] > 0


def test_bench_generation_through_the_launcher(tmp_path):
  """BINARY=bench_generation on 2 processes x 2 devices: one result.json (process 0's) whose
  outputs are identical to the single-process reference it also runs, with migrations split
  into same-host and cross-host."""
  wd = str(tmp_path / "bg")
  env = subprocess_env(PYTHON=sys.executable, BINARY="bench_generation",
                       CONFIG="configs/bench_generation.py:tiny")
  # 4 one-device instances of 8 slots, 2 samples each: at Rt = 0.75 the tail packs into one
  # instance of process 1, which takes one sample from its other instance and three from
  # process 0's.
  out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "2", wd,
                        "--config.generation.num_instances=4", "--config.batch_size=8",
                        "--config.generation.slots=8", "--config.lengths.median=8",
                        "--config.generation.migration_threshold=0.75"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
  logs = "".join(open(f"{wd}.proc{i}.log").read()[-3000:] for i in range(2))
  assert out.returncode == 0, logs
  with open(os.path.join(wd, "result.json")) as f:
    result = json.load(f)
  assert result["processes"] == 2
  assert result["identical_outputs"] is True
  ref = result["single_process_reference"]
  assert ref["identical"] and ref["tokens_equal"] and ref["logprobs_max_abs_diff"] == 0.0, ref
  assert os.path.exists(os.path.join(wd, "single_process", "outputs.npz"))
  f = result["fused"]
  assert f["cross_host_migrated_samples"] > 0 and f["cross_host_migrated_bytes"] > 0
  assert f["same_host_migrated_samples"] > 0 and f["same_host_migrated_bytes"] > 0
  assert f["cross_host_migration_s"] > 0
  assert (f["cross_host_migrated_samples"] + f["same_host_migrated_samples"] ==
          f["migrated_samples"])
  assert (f["cross_host_migrated_bytes"] + f["same_host_migrated_bytes"] ==
          f["migration_copied_bytes"])
  assert result["baseline"]["migrated_samples"] == 0
  # The inference overlap over both processes' instances (as the trainer's
  # fusion/inference_overlap_frac), not process 0's own (its timeline panel's) alone.
  rows = f["inference_overlap_by_process"]
  assert len(rows) == 2 and sum(r[2] for r in rows) > 0, rows
  own = timeline_lib.Timeline.from_json(result["timelines"]["panels"]["fused"]["timeline"])
  np.testing.assert_allclose(rows[0], own.overlap_figures, rtol=1e-6)
  assert f["inference_overlap_frac"] == pytest.approx(
      timeline_lib.combined_overlap(rows)[1], rel=1e-12)


def test_a_process_that_dies_or_hangs_fails_the_other_with_a_clear_error(tmp_path):
  """Process 1 dies (or hangs) at its third round: process 0 stops with an error naming the
  exchange instead of waiting forever: at once when the runtime reports the lost connection,
  after fusion's exchange_timeout_s (here 8 s) when the peer hangs. The dying run's timeout is
  120 s: with 20 s, a loaded CI machine once fired it while process 1 was still compiling on
  its way to round 3, so process 0 stopped for the right reason's twin (a slow peer) and took
  process 1 down with the coordination service before it could die (exit -6, not 7). The two
  runs go one after the other: side by side (4 processes on a loaded 2-core CI machine) process
  1 of the dying run once came to a collective more than 30 s late, past gloo's own context
  deadline, so process 0 stopped before process 1 could die (EXIT_PEER_LOST, not 7). The dying
  run exchanges over the host mesh (exchange_on="host", the default: gloo's failure comes as
  a ValueError there), the other over every device. Both: 2 processes x 2 devices, INSTANCES
  one-device instances (as above; 8 on 2 x 4 devices compiled twice as much)."""
  # The hanging run's watchdog may fire while process 1 is still on its way to round 3: that
  # ends it for the same reason (a peer that does not come), so 8 s is enough.
  for how, timeout in (("die", "120"), ("hang", "8")):
    out_dir = str(tmp_path / how)
    os.makedirs(out_dir)
    t0 = time.time()
    procs = launch(2, INSTANCES // 2, out_dir, FUSED_MP_INSTANCES=str(INSTANCES),
                   FUSED_MP_FAIL=f"1:3:{how}", FUSED_MP_TIMEOUT_S=timeout,
                   FUSED_MP_EXCHANGE="host" if how == "die" else "devices")
    try:
      code = procs[0].wait(timeout=TIMEOUT_S)
      elapsed = time.time() - t0
      log = open(f"{out_dir}/log0").read()
      assert code != 0, log[-3000:]
      # (With the hang run's 8 s, a slow compile on a loaded machine can fire it already at
      # the start's barrier, Exchange.warm_up: the same reason, a peer that does not come.)
      whats = ["the instances' summaries"] + (
          ["the start of fused generation"] if how == "hang" else [])
      assert any(f"fused generation, process 0 of 2: the collective exchanging {w}" in log
                 for w in whats), log[-3000:]
      assert re.search(r"did not complete( within 8s)?: another process died, hung or left the "
                       r"run", log), log[-3000:]
      if how == "die":
        assert procs[1].wait(timeout=10) == 7, open(f"{out_dir}/log1").read()[-3000:]
        # Raised from the runtime's own error (gloo: the connection closed or reset), or, when
        # the runtime notices nothing, by the watchdog.
        assert "PeerLostError" in log or f"exiting ({EXIT_PEER_LOST})" in log, log[-3000:]
      else:
        # The watchdog, not the hung peer, ended it (the peer may go down with the coordination
        # service that process 0 hosted, so its state is not checked).
        assert code == EXIT_PEER_LOST == 69, log[-3000:]
        assert "did not complete within 8s: another process" in log, log[-3000:]
        assert f"other processes' logs); exiting ({EXIT_PEER_LOST})" in log, log[-3000:]
      assert elapsed < 200, (how, elapsed)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()


class _Device:
  def __init__(self, id_, process, platform="cpu"):
    self.id, self.process_index, self.platform = id_, process, platform


def test_host_exchanges_gather_over_one_cpu_device_per_process(monkeypatch):
  """exchange_on="host": the lowest-numbered CPU device of each process, where the CPU backend
  spans the processes (a GPU or TPU run's hosts); else the lowest-numbered device of each."""
  import jax
  from rlhfuse_jax.generation import multihost
  cpus = [_Device(i, int(i >= 4)) for i in (5, 4, 1, 0, 7, 2)]
  gpus = [_Device(10 + i, i // 2, "gpu") for i in (3, 2, 1, 0)]
  ex = multihost.Exchange(60)
  ex.count = 2
  monkeypatch.setattr(jax, "devices", lambda kind=None: cpus if kind == "cpu" else gpus)
  assert [d.id for d in ex.host_devices()] == [0, 4]
  cpus[:] = [d for d in cpus if d.process_index == 0]  # a CPU backend of this process only
  assert [d.id for d in ex.host_devices()] == [10, 12]

  def no_cpu(kind=None):
    if kind == "cpu":
      raise RuntimeError("Unknown backend cpu")
    return gpus
  monkeypatch.setattr(jax, "devices", no_cpu)
  assert [d.id for d in ex.host_devices()] == [10, 12]
  import pytest
  with pytest.raises(ValueError, match=r"exchange_on='disk': expected one of \('host', "):
    multihost.Exchange(60, "disk")


def test_the_first_exchange_waits_at_a_barrier_and_names_the_transport_when_it_fails(
    monkeypatch):
  """Exchange.warm_up: a coordination-service barrier bounded by exchange_timeout_s (gloo's own
  first rendezvous gives up after ~30 s), each with its own id; then a first exchange, whose
  failure with every process there is the transport's: a RuntimeError naming exchange_on, not
  PeerLostError (exit 69, retried by a requeue rule). 64-bit data is refused, not narrowed."""
  import jax
  import pytest
  from jax._src import distributed as jax_distributed
  from rlhfuse_jax.generation import multihost
  barriers = []

  class Client:
    def wait_at_barrier(self, name, timeout_ms):
      barriers.append((name, timeout_ms))
  monkeypatch.setattr(jax_distributed.global_state, "client", Client())
  ex = multihost.Exchange(timeout_s=90)
  ex.count = 2

  def broken(x, what="host data"):
    with ex.guard(what):
      raise jax.errors.JaxRuntimeError("UNAVAILABLE: Gloo connectFullMesh failed")
  monkeypatch.setattr(ex, "allgather", broken)
  with pytest.raises(RuntimeError, match=r"every process reached the start, but the first "
                                         r"exchange over one CPU device per process .*exchange_"
                                         r"on=devices.*connectFullMesh"):
    ex.warm_up()
  gathered = []
  monkeypatch.setattr(ex, "allgather", lambda x, what="": gathered.append(x))
  ex.warm_up()
  assert [t for _, t in barriers] == [90000, 90000] and barriers[0][0] != barriers[1][0]
  assert len(gathered) == 1
  with pytest.raises(ValueError, match=r"dtype int64 would be narrowed to 32 bits"):
    multihost.Exchange(60).allgather(np.arange(3, dtype=np.int64), "ids")


def test_only_the_runtimes_errors_are_blamed_on_another_process():
  """Exchange.guard turns the runtime's error in a collective (gloo: connection reset by the
  peer) into PeerLostError (exit 69); an error of this process's own (a shape error, a compile
  error, an out-of-memory) goes through unchanged: blamed on a peer, a scheduler that retries
  exit 69 would retry it for ever."""
  import jax
  import pytest
  from rlhfuse_jax.generation import multihost
  ex = multihost.Exchange(timeout_s=60)
  ex.count = 2  # as on 2 processes: the guard is a no-op on one
  with pytest.raises(multihost.PeerLostError, match=r"process 0 of 2: the collective exchanging "
                                                     r"x did not complete.*Connection reset"):
    with ex.guard("x"):
      raise jax.errors.JaxRuntimeError("UNAVAILABLE: Gloo: Connection reset by peer")
  # jax 0.10 raises gloo's failure inside a jitted call as a ValueError (the default host
  # exchange's path): it went through as this process's own error, and the process waited
  # ~100 s for the coordination service to end it with 134.
  with pytest.raises(multihost.PeerLostError, match="Gloo AllGather failed"):
    with ex.guard("x"):
      raise ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/"
                       "pair.cc:538] Read error [127.0.0.1]:9954: Connection reset by peer")
  for own in (ValueError("shapes (2,) and (3,) differ"),
              jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 GiB")):
    with pytest.raises(type(own)) as raised:
      with ex.guard("x"):
        raise own
    assert raised.value is own


def test_a_training_collectives_lost_peer_ends_the_process_with_69_at_once(monkeypatch):
  """train_ppo outside fused generation's exchanges (the training step's collectives): the
  transport's report of a dead peer ends the process with EXIT_PEER_LOST at once, naming the
  cause (it waited ~100 s for jax's coordination service and ended with 134, which the
  launcher blamed on this process); another error, or one process, is left to the caller."""
  import jax
  import pytest
  from rlhfuse_jax.generation import multihost
  exits = []

  def fake_exit(code):
    exits.append(code)
    raise SystemExit(code)
  monkeypatch.setattr(multihost.os, "_exit", fake_exit)
  lost = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection reset by peer")
  multihost.exit_if_peer_lost(lost)  # one process: nothing to blame
  monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
  multihost.exit_if_peer_lost(ValueError("shapes (2,) and (3,) differ"))  # its own
  multihost.exit_if_peer_lost(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Gloo OOM"))
  # Our own errors quote what they saw (a reward function's, the model's response): not a
  # runtime status, so not a lost peer.
  multihost.exit_if_peer_lost(ValueError("reward function 'f' failed on sample 0 (response "
                                         "'UNKNOWN: Gloo Connection reset by peer'): KeyError"))
  assert exits == []
  with pytest.raises(SystemExit):
    multihost.exit_if_peer_lost(lost)
  assert exits == [EXIT_PEER_LOST]
