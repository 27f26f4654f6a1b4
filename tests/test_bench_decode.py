"""experiments/bench_decode on its tiny CPU default, and the byte/FLOP accounting it reports.

The accounting is checked against what the code really allocates (parameter and KV-cache shapes
from jax.eval_shape) and against the simulator's FLOP formula, so a model change that the
formulas miss fails here.
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import bench_decode as bench_config_file
from rlhfuse_jax.models import llama
from rlhfuse_jax.perf import accounting
from rlhfuse_jax.perf.bench_config import BenchDecodeConfig
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import hardware, shapes
from tests.xla_env import CODEGEN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = BenchDecodeConfig.from_config_dict(bench_config_file.get_config())


# The tiny default with smaller capacities, a shorter live length, 3 timed runs instead of 5 and
# without the scan-compile timing: the same measurements in a third of the time (the
# default's 512/4096 positions are for a user's run), and compiled with the suite's codegen
# flags (tests/xla_env.py; LLVM at -O0: half the compile time, slower machine code, which the
# assertions on times allow for). 151 s -> 51 s alone on 2 cores (2026-12-01).
# The scan-compile times are only checked for their bookkeeping, which the compile-only run
# (test_compile_only_reports_memory_without_running) reports through the same
# measure_scan_compile, at 1 and 2 layers: at that size a compile's fixed cost hides the growth
# with depth, which test_scanned_decode_program_does_not_grow_with_depth checks on the programs
# themselves instead of on (load-dependent) seconds.
# The capacity scaling times 8 decode steps per run instead of the default's 16: the whole-cache
# reference attention at batch 128 and 2048 positions is the slowest thing the bench runs, and
# the median of 3 runs of 8 steps still shows its contrast (CAPACITY_STEPS).
REPEATS, LIVE_LEN, CAPACITY_STEPS = 3, 64, 8
FAST = ["--config.scan_compile_layers=", "--config.capacities=256,2048",
        f"--config.repeats={REPEATS}", f"--config.capacity_live_len={LIVE_LEN}",
        f"--config.capacity_steps={CAPACITY_STEPS}"]


def _nbytes(tree):
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


# ------------------------------------------------------------------------------ the binary
def _bench_env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
  # It times compilation: no persistent cache (tests/conftest.py sets one for the suite).
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("bench_decode"))
  env = _bench_env()
  env["XLA_FLAGS"] = CODEGEN_FLAGS
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_decode", "--config=configs/bench_decode.py",
       *FAST, f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "result.json")) as f:
    result = json.load(f)
  return workdir, result, proc.stderr


def test_writes_result_calibration_config_and_png(bench):
  workdir, result, log = bench
  for name in ("result.json", "calibration.json", "config.json"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  with open(os.path.join(workdir, "bench_decode.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert "decode batch 128" in log and "ppo update" in log  # progress lines
  assert result["jax_version"] == jax.__version__
  assert result["device"]["platform"] == "cpu"


def test_cpu_reports_unknown_peak(bench):
  _, result, log = bench
  dev = result["device"]
  assert dev["peak"] == "unknown peak" and dev["hardware_preset"] is None
  assert dev["peak_hbm_bw_bytes_per_s"] is None and dev["peak_bf16_flops"] is None
  assert all(r["bw_fraction"] is None for r in result["decode"]["per_batch"])
  assert result["train"]["mfu"] is None and result["train"]["mfu_6nd"] is None
  assert "unknown peak" in log


def test_decode_rows_are_consistent(bench):
  _, result, _ = bench
  m = result["model"]
  assert m["num_params"] == TINY.model.num_params()
  dec = result["decode"]
  assert dec["cache_len"] == TINY.prompt_len + TINY.max_new_tokens
  rows = dec["per_batch"]
  assert [r["batch"] for r in rows] == [1, 16, 128]
  head_dim = m["hidden_size"] // m["num_heads"]
  for r in rows:
    b, steps = r["batch"], r["decode_steps"]
    assert steps == TINY.max_new_tokens - 1  # no EOS: every row decodes to the end
    assert len(r["decode_s_runs"]) == REPEATS and min(r["decode_s_runs"]) > 0
    assert r["decode_s"] == pytest.approx(np.median(r["decode_s_runs"]), rel=1e-12)
    assert r["tokens_per_s"] == pytest.approx(b * steps / r["decode_s"], rel=1e-9)
    assert r["step_s"] == pytest.approx(r["decode_s"] / steps, rel=1e-9)
    # How "auto" decoded here (CPU: the live-prefix loop); the row said only "auto".
    assert (r["attention"], r["decode_attention_path"]) == ("auto", "loop"), r
    # Roofline: the live prefix a step attends over, averaged over the run (bf16).
    assert r["mean_live_len"] == TINY.prompt_len + (steps + 1) / 2
    kv = 2 * m["num_layers"] * b * r["mean_live_len"] * m["num_kv_heads"] * head_dim * 2
    weights = (m["num_params"] - m["vocab_size"] * m["hidden_size"] + b * m["hidden_size"]) * 2
    assert r["kv_bytes"] == kv and r["weight_bytes"] == weights
    assert r["bytes_per_step"] == kv + weights
    assert r["achieved_bw_bytes_per_s"] == pytest.approx(r["bytes_per_step"] / r["step_s"],
                                                         rel=1e-9)
    assert r["prefill_s"] > 0
  # Bigger batches move more KV bytes per step, so the KV share grows with the batch.
  shares = [r["kv_bytes"] / r["bytes_per_step"] for r in rows]
  assert shares == sorted(shares) and shares[0] < shares[-1]


def test_decode_rows_carry_the_compiled_memory(bench):
  _, result, _ = bench
  m = result["model"]
  for r in result["decode"]["per_batch"]:
    cache = llama.KVCache.zeros(TINY.model, r["batch"], TINY.cache_len)
    assert r["cache_bytes"] == 2 * cache.k.size * 2  # bf16 bits
    assert r["decode_temp_bytes"] > 0
    assert r["decode_temp_over_cache"] == pytest.approx(r["decode_temp_bytes"] / r["cache_bytes"])
    assert r["prefill_flops"] == accounting.forward_flops(TINY.model, r["batch"],
                                                          TINY.prompt_len, 1)
    assert r["prefill_mfu"] is None  # unknown peak on CPU
  assert m["scan_layers"] is False


def test_capacity_scaling_reads_the_live_prefix_only(bench):
  # One decode chunk ending at 64 live positions, caches of 256 and 2048. Whole-cache
  # (reference) attention reads 8x more at 2048; how much slower that makes a step is a property
  # of the machine (its caches, what else it runs): 6.7x on the 2-core development machine, but
  # the CI machine once measured only 1.58x at 256/1024 where this machine measures 3.7x. So the
  # test asks for a visible contrast and for the live-prefix decode to grow by less than half of
  # what whole-cache attention grows (at 256/2048 measured 0.99 vs 6.7 here, 2026-11-29; with
  # the suite's codegen flags and 64 live positions 1.05 vs 5.25, 2026-12-01).
  _, result, log = bench
  cs = result["capacity_scaling"]
  assert cs["live_len"] == LIVE_LEN and cs["capacities"] == [256, 2048]
  assert cs["batch"] == 128 and cs["steps"] == CAPACITY_STEPS
  assert cs["ratio"] == pytest.approx(cs["step_s"][-1] / cs["step_s"][0])
  assert cs["reference_ratio"] == pytest.approx(
      cs["reference_step_s"][-1] / cs["reference_step_s"][0])
  assert cs["reference_ratio"] > 1.25, cs
  assert cs["ratio"] - 1 < (cs["reference_ratio"] - 1) / 2, cs
  assert f"capacity 2048, live {LIVE_LEN}" in log


def test_no_scan_compile_when_not_asked_and_peer_skip(bench):
  _, result, log = bench
  assert result["scan_compile"] is None and "scan over layers" not in log  # FAST's ""
  assert "on platform 'cpu'" in result["peer"]["skipped"]


def _check_scan_compile(sc):
  assert sc["layers"] == [1, 2] and sc["persistent_cache_dir"] is None
  for key in ("compile_s", "unrolled_compile_s"):
    assert len(sc[key]) == 2 and min(sc[key]) > 0
  assert sc["ratio"] == pytest.approx(sc["compile_s"][1] / sc["compile_s"][0])
  assert sc["unrolled_ratio"] == pytest.approx(
      sc["unrolled_compile_s"][1] / sc["unrolled_compile_s"][0])


def test_scanned_decode_program_does_not_grow_with_depth():
  # What the bench's compile times show at depth (at 8 -> 32 layers on the development machine:
  # unrolled 2.85x, scanned 0.90x), on the lowered programs, which do not depend on the load:
  # the scanned decode chunk is one loop body whatever the depth, the unrolled one a copy per
  # layer.
  from rlhfuse_jax.generation import instances
  from rlhfuse_jax.generation.sampling import SamplingConfig
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.perf import scale_check

  def decode_lines(layers, scan):
    model = TINY.model.replace(num_layers=layers, scan_layers=scan)
    gen = instances.Generator(model, SamplingConfig(max_new_tokens=8, chunk_size=4, eos_id=-1),
                              batch_size=4, prompt_len=8)
    params = scale_check.abstract_params(model, mesh_lib.replicated(gen.mesh))
    (_, low), = gen.lower_all(params, {}, only=("decode",))
    return len(low.as_text().splitlines())
  scanned, unrolled = [decode_lines(n, True) for n in (2, 8)], [decode_lines(n, False)
                                                                for n in (2, 8)]
  assert scanned[1] == scanned[0], scanned
  assert unrolled[1] > 2 * unrolled[0] and unrolled[1] > 2 * scanned[1], (unrolled, scanned)


def test_compile_only_reports_memory_without_running(tmp_path):
  # Nothing here is timed, so the suite's codegen flags apply (tests/xla_env.py: LLVM at -O0
  # changes machine code only, not the memory analysis read here; 13.4 -> 9.4 s on 2 cores).
  env = _bench_env()
  env["XLA_FLAGS"] = CODEGEN_FLAGS
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_decode", "--config=configs/bench_decode.py",
       "--config.compile_only=True", "--config.scan_compile_layers=1,2",
       "--config.batch_sizes=1,16",
       f"--workdir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(tmp_path, "result.json")) as f:
    result = json.load(f)
  assert result["compile_only"] is True and "train" not in result
  rows, f32 = result["decode"]["per_batch"], result["decode"]["float32_per_batch"]
  assert [r["batch"] for r in rows] == [r["batch"] for r in f32] == [1, 16]
  for r, r32 in zip(rows, f32):
    assert r32["cache_bytes"] == 2 * r["cache_bytes"]  # float32 vs bfloat16 bits
    assert "decode_temp_bytes" in r and "prefill_temp_bytes" in r
    assert r["decode_temp_bytes"] > 0 and r32["decode_temp_bytes"] > 0
  _check_scan_compile(result["scan_compile"])  # timed without the suite's persistent cache


def test_an_hf_peer_without_torch_is_refused_before_the_outputs_start(tmp_path):
  """config.peer='hf' runs the peer on any platform: without torch the run compiled and
  measured everything, then ended on the ImportError without writing result.json, the earlier
  run's moved aside. (torch blocked in the subprocess: the same on a machine that has it.)"""
  (tmp_path / "result.json").write_text('{"earlier": true}')
  argv = ["bench_decode", "--config=configs/bench_decode.py", "--config.peer=hf", *FAST,
          "--config.batch_sizes=1", f"--workdir={tmp_path}"]
  code = f"""
import sys
sys.modules["torch"] = None  # import torch: ImportError
sys.argv = {argv!r}
from absl import flags
from experiments import bench_decode
flags.FLAGS(sys.argv)
try:
  bench_decode.main([])
except ValueError as e:
  print(e)
"""
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_bench_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.startswith("config.peer='hf': import of torch halted"), proc.stdout
  assert "expected torch and transformers importable" in proc.stdout, proc.stdout
  assert sorted(os.listdir(tmp_path)) == ["result.json"], os.listdir(tmp_path)


def test_train_step_is_consistent(bench):
  _, result, _ = bench
  tr = result["train"]
  s = TINY.train_prompt_len + TINY.train_response_len
  assert tr["tokens"] == TINY.train_batch * s
  assert tr["step_s"] == pytest.approx(np.median(tr["step_s_runs"]), rel=1e-12)
  assert tr["tokens_per_s"] == pytest.approx(tr["tokens"] / tr["step_s"], rel=1e-9)
  assert tr["flops"] == pytest.approx(accounting.ppo_update_flops(
      TINY.model, TINY.critic_model, TINY.train_batch, TINY.train_prompt_len,
      TINY.train_response_len), rel=1e-12)
  assert tr["achieved_flops_per_s"] == pytest.approx(tr["flops"] / tr["step_s"], rel=1e-9)
  n = TINY.model.num_params() + TINY.critic_model.num_params()
  assert tr["flops_6nd"] == pytest.approx(6 * n * tr["tokens"], rel=1e-12)
  assert tr["actor_fwd_s"] > 0 and tr["critic_fwd_s"] > 0
  # The attention the update ran: "auto" said nothing of it (on this CPU, blockwise; on a GPU
  # "cudnn" where cuDNN's fused attention is in the program).
  assert TINY.model.attention == "auto" and tr["attention"] == "blockwise", tr["attention"]


def test_calibration_file_loads_with_the_measured_step_times(bench):
  workdir, result, _ = bench
  cal = calibration.load(os.path.join(workdir, "calibration.json"))
  rows = result["decode"]["per_batch"]
  assert cal.decode_step.occupied_slots == tuple(float(r["batch"]) for r in rows)
  assert cal.decode_step.seconds == pytest.approx([r["step_s"] for r in rows], rel=1e-12)
  assert cal.model_params == result["model"]["num_params"]
  big = rows[-1]
  assert cal.prefill.per_s == pytest.approx(
      big["batch"] * result["decode"]["prompt_len"] / big["prefill_s"], rel=1e-9)
  tr = result["train"]
  fwd = tr["actor_fwd_s"] + tr["critic_fwd_s"]
  # present whenever the update outlasts the two forwards (a load that dropped it passed here)
  assert (cal.train_stage is not None) == (tr["step_s"] > fwd), (tr, cal.train_stage)
  if cal.train_stage is not None:
    assert cal.train_stage.actor_fwd_s == pytest.approx(tr["actor_fwd_s"])
    assert cal.train_stage.critic_fwd_s == pytest.approx(tr["critic_fwd_s"])
    assert cal.train_stage.bwd_over_fwd == pytest.approx((tr["step_s"] - fwd) / fwd)
    # The timed micro-batch, which scales the times to other layouts (cost_model).
    seq = tr["prompt_len"] + tr["response_len"]
    assert (cal.train_stage.tokens, cal.train_stage.seq_len) == (tr["batch"] * seq, seq)


# ------------------------------------------------------------------------------ accounting
@pytest.mark.parametrize("tied", [False, True])
def test_decode_bytes_match_the_real_params_and_cache(tied):
  cfg = TINY.model.replace(tie_embeddings=tied)
  b, cache_len = 16, 24
  params = llama.param_shapes(cfg)
  cache = jax.eval_shape(lambda: llama.KVCache.zeros(cfg, b, cache_len))
  got = accounting.decode_step_bytes(cfg, b, cache_len)
  table = params["embed"]["embedding"]
  assert _nbytes(params) == cfg.num_params() * 2
  if tied:  # the table is read whole as the LM head
    assert got["weight_bytes"] == _nbytes(params)
  else:  # only b rows of the input embedding are read
    assert got["weight_bytes"] == _nbytes(params) - _nbytes(table) + b * cfg.hidden_size * 2
  assert got["kv_bytes"] == _nbytes(cache)
  assert got["total_bytes"] == got["weight_bytes"] + got["kv_bytes"]


def test_a_scalar_head_model_reads_only_its_looked_up_embedding_rows():
  # tie_embeddings only makes the table the LM head of an "lm" model; a scalar-head (critic)
  # model with the flag set has no head over the vocabulary, so its step reads b rows of it.
  cfg = TINY.model.replace(tie_embeddings=True, head="scalar")
  b = 16
  params = llama.param_shapes(cfg)
  got = accounting.decode_step_bytes(cfg, b, 24)
  table = params["embed"]["embedding"]
  assert got["weight_bytes"] == _nbytes(params) - _nbytes(table) + b * cfg.hidden_size * 2


def test_kv_bytes_are_in_the_compute_dtype_not_the_parameter_dtype():
  # float32 weights with a bfloat16 cache (the usual mixed-precision setting): the cache is
  # what the compute dtype stores, so its bytes must follow cfg.dtype; with both dtypes equal
  # (the tiny default) reading the parameter width instead went unseen.
  cfg = TINY.model.replace(param_dtype="float32", dtype="bfloat16")
  b, cache_len = 4, 24
  cache = jax.eval_shape(lambda: llama.KVCache.zeros(cfg, b, cache_len))
  got = accounting.decode_step_bytes(cfg, b, cache_len)
  assert got["kv_bytes"] == _nbytes(cache)
  per_row = cfg.num_layers * cache_len * cfg.num_kv_heads * cfg.head_dim_
  assert got["kv_bytes"] == 2 * b * per_row * 2  # K and V, 2 bytes each


@pytest.mark.parametrize("prompt_len,steps", [(0, 1), (5, 1), (7, 10), (3, 64)])
def test_mean_live_len_is_the_mean_over_the_decode_steps(prompt_len, steps):
  # Brute force: decode step i (1-based) after a p-token prompt attends over p + i positions.
  assert accounting.mean_live_len(prompt_len, steps) == pytest.approx(
      np.mean([prompt_len + i for i in range(1, steps + 1)]))


def test_six_nd_counts_six_flops_per_parameter_of_each_model_per_token():
  a, c = TINY.model, TINY.critic_model
  count = lambda cfg: sum(int(np.prod(x.shape))
                         for x in jax.tree_util.tree_leaves(llama.param_shapes(cfg)))
  n_actor, n_critic = count(a), count(c)
  assert n_actor != n_critic  # (the critic's scalar head: a swapped model would show)
  assert accounting.six_nd_flops(a, c, 1000) == pytest.approx(6 * (n_actor + n_critic) * 1000)
  assert accounting.six_nd_flops(a, None, 1000) == pytest.approx(6 * n_actor * 1000)


def test_layer_matmul_params_are_the_layer_kernels():
  cfg = TINY.model
  layer = llama.param_shapes(cfg)["layers_0"]
  kernels = [x for x in jax.tree_util.tree_leaves(layer) if len(x.shape) == 2]
  assert accounting.layer_matmul_params(cfg) == sum(int(np.prod(k.shape)) for k in kernels)


@pytest.mark.parametrize("head", ["lm", "scalar"])
def test_forward_flops_agree_with_the_simulator(head):
  cfg = TINY.model.replace(head=head)
  b, s = 3, 20
  sim = shapes.from_model_config(cfg).forward_flops(b * s, (s + 1) / 2)
  assert accounting.forward_flops(cfg, b, s, head_positions=s) == pytest.approx(sim, rel=1e-12)
  # The PPO losses apply the head only at the response positions.
  t = 12
  head_width = cfg.vocab_size if head == "lm" else 1
  assert (accounting.forward_flops(cfg, b, s, s) - accounting.forward_flops(cfg, b, s, t)
          == pytest.approx(b * (s - t) * 2 * cfg.hidden_size * head_width))


def test_ppo_update_flops_is_three_forwards_per_model():
  a, c = TINY.model, TINY.critic_model
  f = 3 * (accounting.forward_flops(a, 4, 24, 16) + accounting.forward_flops(c, 4, 24, 16))
  assert accounting.ppo_update_flops(a, c, 4, 8, 16) == pytest.approx(f)
  assert accounting.ppo_update_flops(a, None, 4, 8, 16) == pytest.approx(
      3 * accounting.forward_flops(a, 4, 24, 16))


def test_fraction():
  assert accounting.fraction(1.5e12, 3e12) == pytest.approx(0.5)
  assert accounting.fraction(1.5e12, None) is None


# ------------------------------------------------------------------------------ peaks, config
@pytest.mark.parametrize("kind,preset", [
    ("NVIDIA H100 80GB HBM3", "h100_sxm"), ("NVIDIA H200", "h200_sxm"),
    ("NVIDIA H800", "h800_sxm"), ("NVIDIA A100-SXM4-80GB", "a100_80g_sxm"),
    ("TPU v5 lite", "tpu_v5e"), ("TPU v5", "tpu_v5p"), ("TPU v5p", "tpu_v5p"),
    # Different bandwidth or clocks than any preset: no match rather than a wrong peak.
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-40GB", None), ("NVIDIA A100 80GB PCIe", None), ("TPU v4", None),
    ("cpu", None),
])
def test_hardware_for_device_kind(kind, preset):
  hw = hardware.hardware_for_device_kind(kind)
  assert (hw.name if hw else None) == preset


def test_resolve_hardware():
  assert TINY.hardware == "auto"
  assert TINY.resolve_hardware("cpu") is None
  assert TINY.resolve_hardware("NVIDIA H100 80GB HBM3").hbm_bw == hardware.HARDWARE[
      "h100_sxm"].hbm_bw
  forced = BenchDecodeConfig.from_config_dict(_cd(hardware="h200_sxm"))
  assert forced.resolve_hardware("cpu").name == "h200_sxm"
  assert BenchDecodeConfig.from_config_dict(_cd(hardware="none")).resolve_hardware(
      "NVIDIA H100 80GB HBM3") is None


def _cd(**overrides):
  c = bench_config_file.get_config()
  for k, v in overrides.items():
    if "." in k:
      sec, f = k.split(".")
      c[sec][f] = v
    else:
      c[k] = v
  return c


@pytest.mark.parametrize("overrides,match", [
    ({"batch_sizes": "1,x"}, "batch_sizes"),
    ({"batch_sizes": "16,1"}, "increasing"),
    ({"batch_sizes": "0,4"}, "positive"),
    ({"hardware": "h100"}, "hardware"),
    ({"max_new_tokens": 60}, "max_seq_len"),
    ({"scan_compile_layers": "8"}, r"scan_compile_layers=\(8,\): expected at least two"),
    ({"repeats": 0}, "repeats"),
    # numpy's default_rng refused it once the earlier outputs had moved aside
    ({"seed": -1}, r"^config\.seed=-1: expected >= 0$"),
    ({"steps_per_check": 3}, r"config\.steps_per_check=3: expected a positive divisor of "
                             r"chunk_size=8"),
])
def test_bad_configs_name_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    BenchDecodeConfig.from_config_dict(_cd(**overrides))


def test_the_limits_bench_configs_accept_and_the_ones_just_past_them():
  ok = lambda **kw: BenchDecodeConfig.from_config_dict(_cd(**kw))
  assert ok(warmup=0).warmup == 0  # no untimed run: compilation is ahead of time
  full = ok(prompt_len=48, max_new_tokens=16)  # 48 + 16 = model.max_seq_len = 64
  assert full.cache_len == 64  # the cache holds the prompt and every generated token
  assert ok(max_new_tokens=2).cache_len == 8 + 2
  assert ok(capacities="128,256").capacities == (128, 256)  # the first at capacity_live_len
  for kw, match in (({"prompt_len": 49, "max_new_tokens": 16}, "max_seq_len=64"),
                    ({"max_new_tokens": 1}, "max_new_tokens"),
                    ({"warmup": -1}, "warmup"),
                    ({"batch_sizes": "1,16,16"}, "strictly increasing"),
                    ({"capacities": "127,256"}, "capacities"),
                    ({"chunk_size": 8, "steps_per_check": 16}, "steps_per_check")):
    with pytest.raises(ValueError, match=match):
      ok(**kw)


def test_unknown_and_missing_fields_are_rejected():
  c = bench_config_file.get_config().to_dict()
  c["batchsizes"] = "1"
  with pytest.raises(ValueError, match="unknown fields.*batchsizes"):
    BenchDecodeConfig.from_config_dict(c)
  c = bench_config_file.get_config().to_dict()
  c["model"]["hidden"] = 3
  with pytest.raises(ValueError, match="config.model: unknown fields.*hidden"):
    BenchDecodeConfig.from_config_dict(c)
  c = bench_config_file.get_config().to_dict()
  del c["model"]["num_layers"]  # (was ModelConfig's TypeError, naming no section)
  with pytest.raises(ValueError, match=r"^config\.model: missing fields \['num_layers'\]"):
    BenchDecodeConfig.from_config_dict(c)


def test_1b_variant_is_about_a_billion_params():
  cfg = BenchDecodeConfig.from_config_dict(bench_config_file.get_config("1b"))
  assert cfg.model.param_dtype == cfg.model.dtype == "bfloat16"
  assert 1.0e9 < cfg.model.num_params() < 1.2e9
  assert cfg.batch_sizes == (1, 16, 128)
