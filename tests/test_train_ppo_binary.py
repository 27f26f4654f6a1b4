"""experiments/train_ppo end to end: files written, continuing a finished run, SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Same shapes as tests/test_trainer.tiny_config (test_multiprocess compares the two).
SMALL = ["--config.model.num_layers=1", "--config.critic_model.num_layers=1",
         "--config.model.hidden_size=32", "--config.critic_model.hidden_size=32",
         "--config.model.intermediate_size=64", "--config.critic_model.intermediate_size=64",
         "--config.rollout.chunk_size=3",
         "--config.rollout.prompts_per_iteration=16", "--config.algo.minibatch_size=8",
         "--config.rollout.max_new_tokens=6", "--config.data.num_prompts=64",
         "--config.checkpoint.every=2"]


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "experiments.train_ppo", "--config=configs/ppo_tiny.py",
          f"--workdir={workdir}", *SMALL, *extra]


def _env(**extra):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the binary runs on the one real CPU device, as a user's would
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


COMPILE_LOG = "Compiling "  # what jax logs for every XLA compile with JAX_LOG_COMPILES=1


def _steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f if line.strip()]


def test_run_then_continue_to_more_iterations(tmp_path):
  wd = str(tmp_path / "run")
  subprocess.run(_cmd(wd, "--config.num_iterations=3"), cwd=REPO, env=_env(), check=True,
                 capture_output=True, timeout=600)
  for name in ("config.json", "metrics.jsonl", "result.json"):
    assert os.path.exists(os.path.join(wd, name)), name
  assert os.listdir(os.path.join(wd, "tb")), "no TensorBoard events"
  assert _steps(wd) == [1, 2, 3]
  row = json.load(open(os.path.join(wd, "result.json")))
  assert row["iterations"] == 3
  # The docs/architecture.md §1 metric names are all there.
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
              "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac",
              "critic/vf_explained_var", "reward/mean", "kl/ref_mean", "response_length/mean",
              "response_length/max", "response_length/clip_ratio", "timing_s/generate",
              "timing_s/inference", "timing_s/train", "timing_s/step", "perf/tokens_per_s"):
    assert key in first, key

  out = subprocess.run(_cmd(wd, "--config.num_iterations=5"), cwd=REPO,
                       env=_env(JAX_LOG_COMPILES="1"), check=True, capture_output=True, text=True,
                       timeout=600)
  assert _steps(wd) == [1, 2, 3, 4, 5]  # continued: no step repeated
  assert "resumed from checkpoint at iteration 3" in out.stderr
  assert COMPILE_LOG in out.stderr  # (the log this test reads below does show compiles)

  # The same command again: the run is finished, so it says so without compiling anything.
  out = subprocess.run(_cmd(wd, "--config.num_iterations=5"), cwd=REPO,
                       env=_env(JAX_LOG_COMPILES="1"), check=True, capture_output=True, text=True,
                       timeout=600)
  assert "workdir already has 5 iterations (num_iterations=5): nothing to do" in out.stderr
  assert COMPILE_LOG not in out.stderr, out.stderr[-3000:]
  assert _steps(wd) == [1, 2, 3, 4, 5]
  assert json.load(open(os.path.join(wd, "result.json")))["iterations"] == 5


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_and_exits_with_the_stopped_status(tmp_path, sig):
  wd = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(wd, "--config.num_iterations=10000",
                               "--config.checkpoint.every=10000"),
                          cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  metrics = os.path.join(wd, "metrics.jsonl")
  deadline = time.time() + 500
  while not (os.path.exists(metrics) and len(_steps(wd)) >= 2):
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    assert time.time() < deadline, "no iterations within the deadline"
    time.sleep(0.5)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=300)
  # 75: stopped after saving, re-run to resume (a scheduler tells it from completion, 0).
  assert proc.returncode == 75, err.decode()[-3000:]
  last = _steps(wd)[-1]
  ckpts = [int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()]
  assert ckpts == [last], (ckpts, last)  # saved exactly where it stopped
