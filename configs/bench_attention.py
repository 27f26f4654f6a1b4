r"""Causal tile skipping in blockwise attention: a model's gradient step with the default
positions (the token indices: key tiles above the diagonal skipped) against the same positions
passed explicitly (every tile read), per sequence length.

  python -m experiments.bench_attention --config=configs/bench_attention.py --workdir=/tmp/ba
  python -m experiments.bench_attention --config=configs/bench_attention.py:cpu --workdir=/tmp/ba

The default is the test's tiny shape (seconds); `cpu` is docs/results.md's (4 layers, 256
wide, 1,024-4,096 tokens: a few minutes on 2 cores).
"""
import ml_collections


def get_config(arg: str = "tiny"):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 64
  c.model.hidden_size = 32
  c.model.intermediate_size = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.dtype = "float32"
  # Tokens per sequence (comma-separated); attention runs in blocks of 512, so a length of
  # n * 512 reads n (n + 1) / 2 of n^2 tiles with the default positions.
  c.lengths = "1024,1536"
  c.batch = 1  # sequences per step
  c.warmup = 1  # untimed steps of each program (after the compile)
  # timed steps of each program, the two taking turns; the medians and the median of the
  # paired ratios are reported (3 gave 0.62-2.41x on a shared 2-core machine: noise)
  c.repeats = 7
  if arg == "cpu":
    c.model.vocab_size = 512
    c.model.hidden_size = 256
    c.model.intermediate_size = 688
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.lengths = "1024,2048,4096"
  elif arg != "tiny":
    raise ValueError(f"configs/bench_attention.py: unknown variant {arg!r}; expected tiny or cpu")
  return c
