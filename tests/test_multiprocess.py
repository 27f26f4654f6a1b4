"""Multi-host code path: 2 processes x 4 CPU devices on 127.0.0.1 (jax.distributed) give the same
run as one process with 8 devices."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import jax
import numpy as np
import pytest

from rlhfuse_jax import workdir as wdlib
from rlhfuse_jax.generation import multihost
from rlhfuse_jax.parallel import distributed
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_train_ppo_binary import REPO, SMALL
from tests.test_trainer import tiny_config
from tests.test_workdir import _hold_as
from tests.xla_env import free_port, subprocess_env


def _pid_of(workdir: str, process_id: int) -> int:
  """The pid of the launcher's process `process_id` for `workdir` (read from /proc)."""
  want = [f"--workdir={workdir}", f"--process_id={process_id}"]
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode(errors="replace").split("\0")
    except OSError:
      continue
    if all(w in args for w in want) and "experiments.train_ppo" in args:
      return int(pid)
  raise AssertionError(f"no process {process_id} for {workdir}")


# The pipelined update with the fused schedule, stage 2 x data 4 (each process: both stages of
# two data shards).
PIPELINED = {"mesh.stage": 2, "mesh.data": 4, "fusion.intra_stage": True,
             "model.num_layers": 2, "critic_model.num_layers": 2,
             "pipeline.actor_microbatches": 2, "pipeline.critic_microbatches": 2,
             "pipeline.search_time_s": 0.3, "pipeline.xla_opt_level": 0}


def test_two_processes_match_one_process(tmp_path):
  """The pipelined update with the fused schedule (PIPELINED) on 2 processes x 4 devices equals
  one process on the same mesh, with the optimizer states split over data (optim.zero1: each
  process builds, saves, restores and steps its own slices) and moved to host memory during the
  2-process run's rollouts
  (optim.offload_during_rollout: each process moves its own shards), and a SIGTERM that reaches
  only process 1 mid-run: both processes stop after the same iteration, save, exit 75 (before
  they agreed, process 0 went on and both hung in their next collective); the same command
  then resumes to the end. Two iterations: the signal comes during iteration 1 (process 0 has
  logged its rollout; process 1 is past the set-up's agreement points, in the same iteration),
  so both stop after iteration 1 and the resume restores and steps once. The resume also finds
  one checkpoint more than checkpoint.keep (as a kill between orbax's commit of a save and its
  delete of the oldest leaves): every process takes part in the start's trim (orbax's delete
  waits for all), which removes it and goes on."""
  wd = str(tmp_path / "mp")
  env = subprocess_env(PYTHON=sys.executable)  # this interpreter, whatever `python` on PATH is
  cmd = ["bash", "launch/local_multiprocess.sh", "2", "4", wd, "--config.num_iterations=2",
         "--config.checkpoint.keep=1",
         "--config.optim.offload_during_rollout=True", "--config.optim.zero1=True", *SMALL,
         *(f"--config.{k}={v}" for k, v in PIPELINED.items())]
  logs = lambda: "".join(open(f"{wd}.proc{i}.log").read()[-2000:] for i in range(2))
  metrics = os.path.join(wd, "metrics.jsonl")
  log0 = f"{wd}.proc0.log"
  with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL) as launcher:
    try:
      deadline = time.time() + 300
      while not (os.path.exists(log0) and  # iteration 1's rollout is done, its update not
                 "iteration 1: generation + inference took" in open(log0).read()):
        assert launcher.poll() is None and time.time() < deadline, logs()
        time.sleep(0.2)
      os.kill(_pid_of(wd, 1), signal.SIGTERM)
      assert launcher.wait(timeout=240) == 75, logs()  # EXIT_STOPPED_BY_SIGNAL on both
    finally:
      if launcher.poll() is None:
        for i in range(2):  # hung: do not leave them running
          try:
            os.kill(_pid_of(wd, i), signal.SIGKILL)
          except (AssertionError, ProcessLookupError):
            pass
        launcher.kill()
  stopped = len(wdlib.read_jsonl(metrics))
  assert stopped == 1, logs()
  text = logs()
  assert "signal 15 reached another process" in text, text
  checkpoints = os.path.join(wd, "checkpoints")
  shutil.copytree(os.path.join(checkpoints, "1"), os.path.join(checkpoints, "0"))
  # The resume runs while this process computes the one-process reference (the launched
  # processes wait on each other's collectives much of the time: the two overlap).
  with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL) as resume:
    try:
      single = PPOTrainer(tiny_config(num_iterations=2, **PIPELINED), str(tmp_path / "sp"),
                          mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4, stage=2)))
      history = single.run()
      assert resume.wait(timeout=600) == 0, logs()
    finally:
      if resume.poll() is None:
        resume.kill()
  assert f"resumed from checkpoint at iteration {stopped}" in open(f"{wd}.proc0.log").read()
  assert "held 2 checkpoints, more than checkpoint.keep=1" in open(f"{wd}.proc0.log").read()
  assert os.listdir(checkpoints) == ["2"]  # (0 trimmed at the start, 1 by orbax's save of 2)
  multi = wdlib.read_jsonl(metrics)

  # Only process 0 searched the fused schedule and wrote the cache (the one all ran), and the
  # resume loaded it.
  proc0, proc1 = (open(f"{wd}.proc{i}.log").read() for i in range(2))
  assert proc0.count("pipeline: searched a fused schedule") == 1, proc0[-3000:]
  assert "pipeline: using the cached fused schedule" in proc0, proc0[-3000:]
  assert "fused schedule" in proc1 and "schedule (budget" not in proc1, proc1[-3000:]
  assert "pipeline: searched" not in proc1 and "cached at" not in proc1, proc1[-3000:]

  assert [r["step"] for r in multi] == [1, 2] and len(history) == 2
  assert all(r["perf/optimizer_offload_bytes"] > 0 for r in multi)
  # zero1 split the state over data = 4: a device moves well under half of what a device of
  # the one-process run (no zero1) holds.
  device = single.mesh.devices.flat[0]
  held = sum(sh.data.nbytes for m in (single.actor, single.critic)
             for x in jax.tree.leaves(m.opt_state) for sh in x.addressable_shards
             if sh.device == device)
  assert all(r["perf/optimizer_offload_bytes"] < held / 2 for r in multi), held
  assert not any("perf/optimizer_offload_bytes" in r for r in history)
  for a, b in zip(multi, history):
    assert a["gen/response_lengths"] == b["gen/response_lengths"]
    for k in ("reward/mean", "kl/ref_mean", "actor/pg_loss", "critic/vf_loss"):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_a_locked_workdir_stops_every_process_at_once(tmp_path):
  """Only process 0 takes the workdir lock; the others learn its refusal instead of waiting in
  the run's first collective. The local launcher refuses such a workdir itself, before it
  appends anything to the running job's logs. A stop signal during process 0's wait for a
  holder on another host stops every process at once."""
  wd = str(tmp_path / "mp")
  holder = wdlib.WorkdirLock(wd)  # another run holds the workdir
  t0 = time.time()
  try:
    outs = _two_processes([wd, wd])
    launched = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "2", wd, *SMALL],
                              cwd=REPO, env=subprocess_env(PYTHON=sys.executable),
                              capture_output=True, text=True, timeout=300)
  finally:
    holder.release()
  logs = [log for log, _ in outs]
  assert [code for _, code in outs] == [1, 1], logs
  assert time.time() - t0 < 120, "a process waited for a run that was refused"
  assert f"workdir {wd} is in use by another run (pid {os.getpid()}" in logs[0], logs[0][-2000:]
  assert f"workdir {wd} could not be locked by process 0" in logs[1], logs[1][-2000:]
  assert launched.returncode == 1, launched.stderr
  assert f"workdir {wd} is in use by another run (pid {os.getpid()}" in launched.stderr
  assert not os.path.exists(f"{wd}.proc0.log")

  # A holder on another host (a crashed node's lock on a shared filesystem): process 0 waits
  # for it (config.lock_wait_s, 240 s). A scheduler's SIGTERM to every process stops them all
  # within a poll or two, with the stopped status (requeue): the first signal of a
  # multi-process set-up is only recorded, and the wait went on for all of its 240 s.
  other = _hold_as(wd, "pid 7 on node-that-crashed (start 11)")
  logs = [tmp_path / f"wait{i}.log" for i in range(2)]
  files = [open(log, "w") for log in logs]
  try:
    procs = _start_two([wd, wd], outs=files)
    deadline = time.time() + 120
    while "waiting up to" not in logs[0].read_text():
      assert all(p.poll() is None for p in procs) and time.time() < deadline, (
          logs[0].read_text()[-3000:])
      time.sleep(0.2)
    t0 = time.time()
    for p in procs:
      p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=60) for p in procs]
    took = time.time() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for f in files:
      f.close()
    other.close()
  text = logs[0].read_text()
  assert codes == [75, 75], text[-3000:]
  assert took < 20, took
  assert "stopped after waiting" in text and "came before training began" in text, text[-3000:]
  assert sorted(os.listdir(wd)) == [".lock"]  # nothing of a run written


def _start_two(workdirs, per_process_args=((), ()), cwds=(REPO, REPO), outs=(None, None)):
  """train_ppo started on 2 processes x 2 CPU devices (--distributed on 127.0.0.1), each in its
  `cwds` entry, writing to its `outs` file (None: a pipe): the two Popens."""
  env = subprocess_env(2, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  port = free_port()
  return [subprocess.Popen([sys.executable, "-m", "experiments.train_ppo",
                            f"--config={REPO}/configs/ppo_tiny.py", f"--workdir={workdirs[i]}",
                            "--distributed", f"--coordinator_address=127.0.0.1:{port}",
                            "--num_processes=2", f"--process_id={i}", *SMALL,
                            *per_process_args[i]], cwd=cwds[i], env=env,
                           stdout=outs[i] or subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
          for i in range(2)]


def _two_processes(workdirs, per_process_args=((), ()), cwds=(REPO, REPO)):
  """train_ppo on 2 processes x 2 CPU devices (--distributed on 127.0.0.1), each started in its
  `cwds` entry: their outputs."""
  return _runs_of_two((workdirs, per_process_args, cwds))[0]


def _runs_of_two(*runs):
  """_two_processes of each (workdirs, per_process_args, cwds) in `runs`, all started at once
  (each its own coordinator): their outputs, run by run. Runs that stop at set-up spend much of
  their time waiting (process 0 for the others' reports, RLHFUSE_PEER_GRACE_S): side by side,
  those waits overlap."""
  procs, files = [], [[tempfile.TemporaryFile("w+") for _ in range(2)] for _ in runs]
  try:  # (into files, not pipes: no process waits on a full pipe while another one is read)
    for run, outs in zip(runs, files):
      procs.append(_start_two(*run, outs=outs))
    codes = [[p.wait(timeout=300) for p in pair] for pair in procs]
    for f in (f for outs in files for f in outs):
      f.seek(0)
    return [[(f.read(), code) for f, code in zip(outs, pair)] for outs, pair in zip(files, codes)]
  finally:
    for p in (p for pair in procs for p in pair):
      if p.poll() is None:
        p.kill()
    for f in (f for outs in files for f in outs):
      f.close()


def test_processes_on_different_workdirs_or_runs_stop_at_once(tmp_path):
  """A workdir that is not one directory on every host (each process its own, as a node-local
  path) stops every process at set-up: it trained, then hung for ever at the first checkpoint
  save. Processes that run different configs (here another seed) stop too: they trained side
  by side on different batches, each logging its own rewards."""
  # The same path naming another directory on each "host" (here: relative, from two
  # directories): the token process 0 wrote to the workdir's .lock is not seen by process 1.
  for d in ("host0", "host1"):
    (tmp_path / d).mkdir()
  shared = str(tmp_path / "shared")
  apart, relative, seeds = _runs_of_two(
      ([str(tmp_path / "a"), str(tmp_path / "b")], ((), ()), (REPO, REPO)),
      (["run", "run"], ((), ()), (tmp_path / "host0", tmp_path / "host1")),
      ([shared, shared], (("--config.seed=0",), ("--config.seed=1",)), (REPO, REPO)))
  for i, (log, code) in enumerate(apart):
    assert code == 1, log[-3000:]
    assert (f"the processes disagree on the --workdir path (a checksum; this process's: "
            f"{tmp_path / 'ab'[i]})") in log, log[-3000:]
    assert "every process must be given the same workdir" in log, log[-3000:]
  for log, code in relative:
    assert code == 1, log[-3000:]
    assert "the processes disagree on the workdir run (the start token" in log, log[-3000:]
    assert "process 1: (-1,)" in log and "every host sees, at the same path" in log, log[-3000:]
  for i, (log, code) in enumerate(seeds):
    assert code == 1, log[-3000:]
    assert "the processes disagree on the run (a checksum of the config as given" in log, (
        log[-3000:])
    assert "this process ran python -m experiments.train_ppo" in log and (
        f"--config.seed={i} at commit" in log), log[-3000:]
    assert f"the config fields that differ, as this process has them: config.seed={i}" in log, (
        log[-3000:])
  assert not os.path.exists(shared)  # stopped before anything was written


def test_too_few_devices_names_the_count_each_process_needs(tmp_path):
  """The launcher sets each process's device count: the hint names that, not a flag the
  launcher replaces."""
  wd = str(tmp_path / "mp")
  out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "2", wd,
                        "--config.mesh.data=8", *SMALL], cwd=REPO,
                       env=subprocess_env(PYTHON=sys.executable), capture_output=True, text=True,
                       timeout=300)
  log = open(f"{wd}.proc0.log").read()
  assert out.returncode != 0, log[-2000:]
  assert ("needs at least 8 devices, but jax sees 4 (cpu); 2 processes need at least 4 CPU "
          "devices each (launch/local_multiprocess.sh N D: D)") in log, log[-2000:]


def test_fused_async_two_processes_match_one_process(tmp_path):
  """config.fusion.inter_stage with asynchronous PPO (staleness 1) on 2 processes x 4 devices:
  generation on 2 devices of each process (4 instances, 2 per process, a tail consolidated
  across the processes), training on the other 2 of each, the updated actor moved between the
  groups; the trajectory of the same run in one process of 8 devices."""
  fused = {"fusion.inter_stage": True, "fusion.migration_threshold": "1.0",
           "async_ppo.staleness": 1, "async_ppo.generation_devices": 4}
  wd = str(tmp_path / "mp")
  env = subprocess_env(PYTHON=sys.executable)
  # The launched processes run while this process computes the one-process reference (they
  # wait on each other's collectives much of the time: the two overlap).
  with subprocess.Popen(["bash", "launch/local_multiprocess.sh", "2", "4", wd,
                         "--config.num_iterations=3", *SMALL,
                         *[f"--config.{k}={v}" for k, v in fused.items()]], cwd=REPO, env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as launcher:
    try:
      single = PPOTrainer(tiny_config(num_iterations=3, **fused), str(tmp_path / "sp"))
      assert [d.id for d in single.gen_mesh.devices.flat] == [0, 1, 2, 3]
      history = single.run()
      code = launcher.wait(timeout=600)
    finally:
      if launcher.poll() is None:  # the reference failed: the launcher stops both processes
        launcher.terminate()
        launcher.wait(timeout=120)
  logs = "".join(open(f"{wd}.proc{i}.log").read()[-2000:] for i in range(2))
  assert code == 0, logs
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    multi = [json.loads(line) for line in f]
  assert [r["step"] for r in multi] == [1, 2, 3]
  # Iteration 3's batch came from the policy after update 1: updated weights crossed over.
  assert [r["async/policy_version"] for r in multi] == [0, 0, 1]
  for a, b in zip(multi, history):
    # Decided from tokens: the same samples, plans and migrations (those crossing processes
    # are counted apart: none in one process).
    for k in ("gen/response_lengths", "gen/consolidation_step", "gen/consolidated_from",
              "gen/consolidated_to", "gen/migrated_samples", "gen/migrated_kv_bytes",
              "gen/migration_copied_bytes", "gen/instance_chunks", "gen/decode_rounds",
              "fusion/freed_before_gen_end", "async/policy_version"):
      assert a[k] == b[k], k
    # (of every process's instances, as the freed ones:
    # generation/fused.figures_over_processes)
    assert a["fusion/loaded_before_gen_end"] <= a["fusion/freed_before_gen_end"]
    assert b["gen/migrated_samples_cross_host"] == 0
    for k in ("reward/mean", "kl/ref_mean", "actor/pg_loss", "critic/vf_loss",
              "async/behaviour_weight_mean"):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert sum(r["gen/migrated_samples_cross_host"] for r in multi) > 0


def test_put_between_device_groups_stays_on_devices(tmp_path):
  """mesh.put from the training group to the generation group and back on 2 processes x 4 devices
  (each process half in each): every shard where its sharding says, with to_host made to fail
  in the workers, so nothing went through host memory (tests/put_mp_worker.py). Then the frozen
  models' move to host memory of arrays split over both processes (a fused multi-host run of
  the 13B-65B presets stopped at set-up on jax's refusal to read them)."""
  env = subprocess_env(4)
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "tests.put_mp_worker", str(i), "2", port,
                             str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "".join(log[-3000:] for log in logs)
  assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]


def test_process_grid_needs_even_groups():
  """The device-to-device path needs every process to hold as many source devices, and a source
  device on every process that receives; otherwise mesh.put goes through host memory."""
  @dataclasses.dataclass(frozen=True)
  class dev:  # what _process_grid reads of a jax.Device
    id: int
    process_index: int

  src = {dev(2, 0), dev(3, 0), dev(6, 1), dev(7, 1)}
  grid = mesh_lib._process_grid(src, {dev(0, 0), dev(4, 1)})
  assert [[d.id for d in row] for row in grid] == [[2, 3], [6, 7]]
  assert mesh_lib._process_grid(src - {dev(7, 1)}, {dev(0, 0)}) is None  # 2 and 1 devices
  assert mesh_lib._process_grid(src, {dev(8, 2)}) is None  # process 2 holds none of src


SLURM_ONE_TASK_PER_NODE = {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "0", "SLURM_PROCID": "1",
                           "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4",
                           "SLURM_GPUS_ON_NODE": "8"}


def test_slurm_one_task_per_node_sees_every_gpu_of_its_node(monkeypatch):
  """launch/slurm_gpu.sbatch runs one process per node; jax's SLURM detection alone makes only
  GPU SLURM_LOCALID visible to it (1 of 8). The node's GPUs come from SLURM's variables."""
  env = dict(SLURM_ONE_TASK_PER_NODE)
  assert distributed.slurm_node_gpus(env) == list(range(8))
  assert distributed.slurm_node_gpus({**env, "SLURM_NTASKS_PER_NODE": "1"}) == list(range(8))
  typed = {k: v for k, v in env.items() if k != "SLURM_GPUS_ON_NODE"}
  assert distributed.slurm_node_gpus({**typed, "SLURM_GPUS_PER_NODE": "h100:4"}) == [0, 1, 2, 3]
  assert distributed.slurm_node_gpus(  # two GPU types on a node: 2 + 1 (it read the last, 1)
      {**typed, "SLURM_GPUS_PER_NODE": "gpu:a100:2,gpu:v100:1"}) == [0, 1, 2]
  assert distributed.slurm_node_gpus({**typed, "CUDA_VISIBLE_DEVICES": "3,5"}) == [0, 1]
  # jax's own rule where it is right or where we cannot tell: one GPU per task, several tasks
  # per node, the user's JAX_LOCAL_DEVICE_IDS, no SLURM, an unknown GPU count.
  assert distributed.slurm_node_gpus({**env, "SLURM_STEP_NUM_TASKS": "32"}) is None
  assert distributed.slurm_node_gpus({**env, "SLURM_NTASKS_PER_NODE": "8"}) is None
  assert distributed.slurm_node_gpus({**env, "JAX_LOCAL_DEVICE_IDS": "0,1"}) is None
  assert distributed.slurm_node_gpus({"SLURM_GPUS_ON_NODE": "8"}) is None
  assert distributed.slurm_node_gpus(typed) is None
  # initialize passes them to jax.distributed (recorded here instead of starting a cluster).
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS", raising=False)
  distributed.initialize()
  assert calls[-1]["local_device_ids"] == list(range(8))
  monkeypatch.delenv("SLURM_LOCALID")
  distributed.initialize()
  assert "local_device_ids" not in calls[-1]
  # Half a manual setup names the missing flag (jax's own error named none, and a process_id
  # alone was dropped).
  n = len(calls)
  for args, message in (
      (("127.0.0.1:1234",), "coordinator_address given without num_processes and process_id"),
      (("", 0, 1), "process_id given without coordinator_address and num_processes"),
      (("", 2, 0), "num_processes and process_id given without coordinator_address")):
    with pytest.raises(ValueError, match=f"{message}: pass all three"):
      distributed.initialize(*args)
  assert len(calls) == n
  # jax reads the address from JAX_COORDINATOR_ADDRESS too: the count and index suffice then.
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  distributed.initialize("", 2, 0)
  assert calls[-1]["num_processes"] == 2 and len(calls) == n + 1
  # ... and alone it leaves the count and index to jax's cluster detection (it was refused as
  # "coordinator_address given without num_processes and process_id").
  distributed.initialize()
  assert "num_processes" not in calls[-1] and len(calls) == n + 2
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  # No flags and no cluster jax can detect: jax's bare "coordinator_address should be defined."
  # becomes what to do.
  def no_cluster(**kw):
    raise ValueError("coordinator_address should be defined.")
  monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
  with pytest.raises(ValueError, match=r"--distributed: jax found no cluster to join \("
                     r"coordinator_address should be defined\.\): .* give every process "
                     r"--coordinator_address=HOST:PORT --num_processes=N --process_id=i"):
    distributed.initialize()
  # Process 0 on a port in use: jax's bare "Failed to start RPC server" names no port.
  def busy(**kw):
    raise jax.errors.JaxRuntimeError("UNKNOWN: Failed to start RPC server")
  monkeypatch.setattr(jax.distributed, "initialize", busy)
  with pytest.raises(ValueError, match=r"could not start jax's coordination service at "
                     r"127\.0\.0\.1:29999 .*the port is most likely in use.*PORT="):
    distributed.initialize("127.0.0.1:29999", 2, 0)


def test_a_process_that_cannot_join_says_which_coordinator_it_waits_for(monkeypatch, caplog):
  """A process given another --coordinator_address waited silently in jax.distributed.initialize
  for jax's initialization timeout (5 minutes); then every process aborted (134) with jax's
  "another task died ... DEADLINE_EXCEEDED", naming no address. While the join lasts, each
  process now warns which coordinator it waits for and, on a process > 0, that nothing
  listens there."""
  import socket
  import threading
  port = free_port()  # nothing listens: refused at once
  assert "ConnectionRefusedError" in distributed.coordinator_unreachable(f"127.0.0.1:{port}")
  with socket.socket() as listening:
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    assert distributed.coordinator_unreachable(
        f"127.0.0.1:{listening.getsockname()[1]}") is None
  released = threading.Event()
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: released.wait(0.35))
  monkeypatch.setattr(distributed, "JOIN_WARN_S", 0.1)
  monkeypatch.setattr(distributed, "reclaim_sigterm", lambda: None)
  monkeypatch.setattr(distributed, "check_same_local_devices", lambda *a: None)
  with caplog.at_level("WARNING"):
    distributed.initialize(f"127.0.0.1:{port}", 2, 1)
    warned = [r.getMessage() for r in caplog.records if "still joining" in r.getMessage()]
    assert 1 <= len(warned) <= 2, warned  # after 0.1 and 0.3 s (the waits double)
    assert warned[0].startswith(f"process 1 of 2: still joining the run at the coordinator "
                                f"127.0.0.1:{port} after 0 s")
    assert "nothing accepts connections there (ConnectionRefusedError" in warned[0]
    assert "check --coordinator_address" in warned[0]
    caplog.clear()
    distributed.initialize(f"127.0.0.1:{port}", 2, 0)  # process 0 is the one listening
    warned = [r.getMessage() for r in caplog.records if "still joining" in r.getMessage()]
    assert warned and "a process has not started yet" in warned[0], warned
    caplog.clear()
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: None)
    distributed.initialize(f"127.0.0.1:{port}", 2, 1)  # joined at once: nothing said
    time.sleep(0.2)
    assert "still joining" not in caplog.text


_PEER_LOST_IN_SETUP = """
import sys
from absl import flags
from experiments import config_files, runner, train_ppo
from rlhfuse_jax.generation import multihost
flags.FLAGS(["train_ppo", "--config=configs/ppo_tiny.py", "--workdir=" + sys.argv[1]])
def lost(*args, **kwargs):  # what Exchange.warm_up raises in FusedGenerator's set-up
  raise multihost.PeerLostError("fused generation, process 0 of 2: the collective exchanging "
                                "the start of fused generation did not complete")
def exit_now(status):
  print("exit_now", status, flush=True)
  sys.exit(0)
train_ppo.PPOTrainer = lost
config_files.exit_now = exit_now
train_ppo._start_and_train(runner.RunLog())
"""


def test_a_peer_lost_during_set_up_exits_as_one_lost_mid_run(tmp_path):
  """A process killed while the others compiled their fused generation instances: the others'
  first exchange (Exchange.warm_up, in PPOTrainer's set-up) raised PeerLostError outside the
  try that maps it to exit 69, so it went out as an ordinary error (a traceback, exit 1; process
  0 waits 10 s first, and jax's abort, 134, came in those seconds: 2 x 4 devices, the fused
  main job, a kill -9 of process 1 at its second instance's compile). It now exits 69, as the
  same loss does mid-run."""
  out = subprocess.run([sys.executable, "-c", _PEER_LOST_IN_SETUP, str(tmp_path / "wd")],
                       cwd=REPO, env=subprocess_env(1), capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"exit_now {multihost.EXIT_PEER_LOST}" in out.stdout, out.stderr[-3000:]
  assert "the start of fused generation did not complete" in out.stderr, out.stderr[-3000:]


def test_processes_that_read_different_checkpoints_stop_naming_each(monkeypatch):
  """What each process reads of the workdir alone (the checkpoint to resume) is compared: a
  host with another view of the shared filesystem stops the run on every process, naming each
  one's values, instead of training on from a mix of states (trainer/loop.py calls it)."""
  import jax
  from jax.experimental import multihost_utils
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  # As every process sees it: process 0 resumes step 40, process 1 (a stale listing) step 30.
  views = np.array([[40, 0], [30, 0]], np.int32)
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: views)
  with pytest.raises(ValueError, match=r"the processes disagree on where to start \(process 0: "
                                       r"\(40, 0\); process 1: \(30, 0\)\): see why"):
    distributed.check_same_over_processes((40, False), "where to start", ": see why")
  views[1, 0] = 40
  distributed.check_same_over_processes((40, False), "where to start")  # agreed: nothing
  # A process whose own read failed joins the comparison first, then raises its error; the
  # others, with its marker (-2) among the views, stop naming it.
  damaged = OSError("side-car of checkpoint 40 truncated")
  with pytest.raises(OSError, match="truncated"):
    distributed.check_same_over_processes((-2, 0), "where to start", failed=damaged)
  views[1] = (-2, 0)
  with pytest.raises(ValueError, match=r"process 1: \(-2, 0\)"):
    distributed.check_same_over_processes((40, 0), "where to start")


def test_a_tensor_axis_across_hosts_is_warned_of(monkeypatch):
  """The training mesh's tensor groups should stay inside a host (two all-reduces a layer):
  one that spans processes on GPU or CPU is warned of, once; within hosts, or on a TPU slice
  (its hosts share the ICI torus), nothing is said."""
  @dataclasses.dataclass(frozen=True)
  class dev:
    id: int
    process_index: int
    platform: str = "gpu"
  warned = []
  monkeypatch.setattr(mesh_lib.logging, "warning", lambda *a: warned.append(a[0] % a[1:]))
  monkeypatch.setattr(mesh_lib, "_warned", set())
  gpus = [dev(i, i // 4) for i in range(8)]  # 2 hosts of 4
  grid = lambda devices, shape: np.asarray(devices, dtype=object).reshape(shape)
  assert not mesh_lib.warn_tensor_across_hosts(grid(gpus, (2, 1, 1, 4)))  # tensor 4 per host
  assert not mesh_lib.warn_tensor_across_hosts(grid(gpus, (1, 2, 2, 2)))
  assert mesh_lib.warn_tensor_across_hosts(grid(gpus, (1, 1, 1, 8)))
  assert mesh_lib.warn_tensor_across_hosts(grid(gpus, (1, 1, 1, 8)))  # logged once
  assert len(warned) == 1 and ("mesh.tensor=8: 1 of its 1 tensor groups span processes "
                                "(hosts; up to 2 each)") in warned[0], warned
  six = [dev(i, i // 6) for i in range(12)]  # 2 hosts of 6: tensor 4 does not divide 6
  assert mesh_lib.warn_tensor_across_hosts(grid(six, (3, 1, 1, 4)))
  assert "mesh.tensor=4: 1 of its 3 tensor groups span processes" in warned[-1], warned
  tpus = [dev(i, i // 4, "tpu") for i in range(8)]
  assert not mesh_lib.warn_tensor_across_hosts(grid(tpus, (1, 1, 1, 8)))


# Joins a cluster of int(argv[2]) processes on 127.0.0.1:argv[1] as process argv[3] through
# distributed.initialize (as train_ppo --distributed does), inside config_files.run.
_JOIN = """
import os, signal, sys, time
from absl import flags
from experiments import config_files
from rlhfuse_jax.parallel import distributed
flags.DEFINE_string("what", "", "")
def main(argv):
  port, n, i = argv[1], int(argv[2]), int(argv[3])
  got = []
  if flags.FLAGS.what == "sigterm":
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
  distributed.initialize(f"127.0.0.1:{port}", n, i)
  if flags.FLAGS.what == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    print("handled", got, flush=True)
  elif flags.FLAGS.what == "both":  # the same error, process 1 3 s later
    time.sleep(3 * i)
    raise ValueError(f"the same error, on process {i}")
  elif flags.FLAGS.what == "fail" and i == 1:
    raise ValueError("only on process 1")
  elif flags.FLAGS.what == "fail":
    time.sleep(120)  # as in a collective waiting for process 1
config_files.run(main)
"""


def _join(*args, what: str):
  return [sys.executable, "-c", _JOIN, f"--what={what}", *map(str, args)]


def test_a_sigterm_after_joining_the_cluster_reaches_the_python_handler():
  """jax.distributed.initialize starts jax's preemption notifier, which takes SIGTERM below
  Python: a SIGTERM during a multi-host run's set-up was swallowed (the run trained to the end,
  exit 0, instead of stopping with the stopped status 75). distributed.initialize gives it
  back. (One process: the notifier starts all the same.)"""
  out = subprocess.run(_join(free_port(), 1, 0, what="sigterm"), cwd=REPO,
                       env=subprocess_env(1), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and "handled [15]" in out.stdout, out.stderr[-3000:]
  assert "SIGTERM caught" not in out.stderr, out.stderr[-3000:]  # jax's notifier's line


def test_an_error_on_one_process_ends_it_at_once():
  """An error raised on one process only (a reward function failing on its own samples) ends
  that process at once with status 1. Through Python's exit, jax's atexit shutdown waited in a
  barrier for the other processes, which waited for it in a collective: the run hung 5 minutes
  and every process aborted (134), the error's line buried under the abort's."""
  port = free_port()
  env = subprocess_env(1)
  procs = [subprocess.Popen(_join(port, 2, i, what="fail"), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    _, err = procs[1].communicate(timeout=60)  # process 0 sleeps 120 s
    assert procs[1].returncode == 1, err[-3000:]
    assert "ValueError: only on process 1" in err, err[-3000:]
    assert procs[0].poll() is None  # it ended on its own, not when process 0 did
  finally:
    for p in procs:
      p.kill()
      p.communicate()


def test_the_same_error_on_every_process_is_reported_by_each():
  """Process 0 hosts jax's coordination service: exiting at once, it aborted a process that
  failed on the same input 3 s later (134) before it had logged why. It waits
  config_files.PEER_GRACE_S first."""
  port = free_port()
  env = subprocess_env(1)
  del env["RLHFUSE_PEER_GRACE_S"]  # the default's 10 s, not the suite's shorter one
  procs = [subprocess.Popen(_join(port, 2, i, what="both"), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    for i, p in enumerate(procs):
      _, err = p.communicate(timeout=120)
      assert p.returncode == 1, err[-3000:]
      assert f"ValueError: the same error, on process {i}" in err, err[-3000:]
  finally:
    for p in procs:
      p.kill()


def test_processes_with_different_configs_are_told_which_fields_differ(monkeypatch):
  """train_ppo's refusal of processes that run different configs named only checksums and this
  process's command line: under SLURM or on a TPU pod every process runs the same command, and
  a config file that differs between the nodes' checkouts left nothing to compare.
  differing_fields names each differing field with this process's value (the all-gather faked:
  the other process's values given); fields of another config file are said to differ as a
  set; agreeing values (the commits differ) add nothing."""
  from jax.experimental import multihost_utils
  other = {}
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: np.stack([np.asarray(x), np.asarray(other["f"](x), np.int32)]))
  mine = {"seed": 0, "algo.lr": 1e-3, "mesh.data": -1, "data.names": ["a", "b"]}
  theirs = dict(mine, seed=1, **{"data.names": ["a"]})

  def as_process_1(x):  # what process 1 contributes to the same gather
    if len(x) == 2:  # the fields' count and names
      keys = sorted(theirs)
      return (len(keys), distributed.checksum(json.dumps(keys)))
    return [distributed.checksum(json.dumps(theirs[k], sort_keys=True, default=str))
            for k in sorted(theirs)]
  other["f"] = as_process_1
  assert distributed.differing_fields(mine) == (
      "; the config fields that differ, as this process has them: config.data.names=['a', 'b'], "
      "config.seed=0")
  assert distributed.differing_fields(mine, most=1).endswith("config.data.names=['a', 'b'] "
                                                             "and 1 more")
  theirs = dict(mine)
  assert distributed.differing_fields(mine) == ""
  theirs = dict(mine, extra=1)
  assert "their configs have different fields" in distributed.differing_fields(mine)


def test_processes_with_different_device_counts_are_refused_when_they_join():
  """Every process needs as many devices (meshes and jax's multi-host utilities lay them out
  process by process): a host with a GPU missing or hidden, or another XLA_FLAGS device count,
  failed at the first all-gather with numpy's "cannot reshape array of size 6 into shape
  (2,2)". distributed.initialize refuses it on every process, naming each one's count (1 and 2
  CPU devices here; process 1 is read, process 0 waits out its grace before exiting)."""
  port = free_port()
  procs = [subprocess.Popen(_join(port, 2, i, what="join"), cwd=REPO, env=subprocess_env(1 + i),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    _, err = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 1, err[-3000:]
    assert ("ValueError: the processes have different numbers of devices (process 0: 1, "
            "process 1: 2; this is process 1): every process must have as many") in err, (
                err[-3000:])
  finally:
    for p in procs:
      p.kill()
      p.communicate()
  fake = lambda *owners: [types.SimpleNamespace(process_index=p) for p in owners]
  distributed.check_same_local_devices(fake(0, 0, 1, 1), 0)  # 2 and 2: nothing
  with pytest.raises(ValueError, match=r"\(process 0: 2, process 1: 2, process 2: 1; this is "
                                       r"process 2\)"):
    distributed.check_same_local_devices(fake(0, 0, 1, 1, 2), 2)
