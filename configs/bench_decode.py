r"""Decode throughput / achieved HBM bandwidth at several batch sizes, and PPO training-step MFU.

On CPU (the default: a tiny bf16 model, but 151 s alone on 2 cores, 2026-12-01, and past 5 min
beside another run: its capacity scaling at 4,096 positions and its compiles of 22 and 44
layers, scanned and unrolled, outlast the decode runs):
  python -m experiments.bench_decode --config=configs/bench_decode.py --workdir=/tmp/bench_decode
The tests' shorter form (tests/test_bench_decode.py: no scan compiles, smaller capacities,
fewer runs; 51 s alone with the suite's codegen XLA_FLAGS of tests/xla_env.py) adds
`--config.scan_compile_layers= --config.capacities=256,2048 --config.repeats=3
--config.capacity_live_len=64 --config.capacity_steps=8`.
On an accelerator (a ~1.1B LLaMA-shaped bf16 model):
  python -m experiments.bench_decode --config=configs/bench_decode.py:1b --workdir=/tmp/bench_1b

Writes result.json, calibration.json (simulator calibration file), bench_decode.png, config.json.
"""
import ml_collections


def get_config(arg: str = "tiny"):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict()  # actor shape; critic = same backbone, scalar head
  c.model.vocab_size = 256
  c.model.hidden_size = 64
  c.model.intermediate_size = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 0  # 0: hidden_size // num_heads
  c.model.rope_theta = 10000.0
  c.model.rms_norm_eps = 1e-5
  c.model.tie_embeddings = False
  c.model.max_seq_len = 64
  c.model.param_dtype = "bfloat16"
  c.model.dtype = "bfloat16"  # compute dtype; also the KV cache's
  # "auto": cuDNN attention for training and prefill where it runs; on GPU one-token decode
  # through the Pallas kernel (per device when KV heads split over the instance's tensor
  # devices; else the whole cache with static shapes); blockwise / the live-prefix loop
  # elsewhere (models/attention.py; measured in experiments/results/h100_pallas_decode and
  # h100_decode_variants). Each per_batch row of result.json records what ran.
  c.model.attention = "auto"
  c.model.fused_projections = False  # q/k/v and gate/up as one matmul each (models/llama.py)
  c.batch_sizes = "1,16,128"  # decode batches (comma-separated, increasing)
  c.prompt_len = 8  # prompt tokens per row
  c.max_new_tokens = 16  # generated tokens per row; KV cache length = prompt_len + this
  c.chunk_size = 8  # decode steps per jitted call (the engine checks `done` between calls)
  # Decode steps between the device's "all rows done?" tests (sampling.steps_per_check): each
  # test is a host round trip on GPU. No EOS here: at most steps_per_check - 1 idle steps.
  c.steps_per_check = 1
  c.warmup = 1  # untimed runs per measurement
  c.repeats = 5  # timed runs per measurement (median reported)
  c.train_batch = 8  # samples per PPO update (actor + critic)
  c.train_prompt_len = 8
  c.train_response_len = 16
  c.hardware = "auto"  # peak figures: "auto" (match device_kind), a sim/hardware.py preset, "none"
  # Compile every executable from shapes and report XLA's memory figures; run nothing.
  c.compile_only = False
  # Decode step time at one live length for several cache capacities (largest batch): a decode
  # that reads only the live prefix costs the same whatever the capacity.
  c.capacity_live_len = 128  # live positions per row at the end of the timed chunk
  c.capacities = "512,4096"
  c.capacity_steps = 16  # decode steps timed (from live_len - steps to live_len)
  # Compile time of the decode chunk with model.scan_layers at these depths (and unrolled);
  # "": not measured.
  c.scan_compile_layers = "22,44"
  # HF transformers generation on the same shape, dtype, batch and lengths as a peer baseline:
  # "auto" on a GPU where torch and transformers import, "hf" always, "none" never.
  c.peer = "auto"

  if arg == "1b":
    # TinyLlama-1.1B shape (Zhang et al. 2024, arXiv 2401.02385; config.json of
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T): hidden 2048, intermediate 5632,
    # 22 layers, 32 heads, 4 KV heads, vocabulary 32000, context 2048. 1.10B parameters.
    c.model.vocab_size = 32000
    c.model.hidden_size = 2048
    c.model.intermediate_size = 5632
    c.model.num_layers = 22
    c.model.num_heads = 32
    c.model.num_kv_heads = 4
    c.model.max_seq_len = 2048
    c.prompt_len = 128
    c.max_new_tokens = 512
    c.chunk_size = 128
    c.steps_per_check = 128  # 2.11 vs 2.15 ms per step at batch 1 on one H100 (1: a test a step)
    c.warmup = 2
    c.repeats = 5
    # [32, 512] tokens: with cuDNN attention the update ran at 46.1 % MFU on one H100, inside
    # 80 GB (42.4-44.3 % at 16 sequences, 35.9 % at 8; experiments/results/h100_pallas_decode
    # and h100_decode_variants, train.json).
    c.train_batch = 32
    c.train_prompt_len = 128
    c.train_response_len = 384
  elif arg != "tiny":
    raise ValueError(f"configs/bench_decode.py: unknown variant {arg!r}; expected 'tiny' or '1b'")
  return c
