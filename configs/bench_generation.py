r"""Generation + inference with and without inter-stage fusion, on the same prompts and seed.

  python -m experiments.bench_generation --config=configs/bench_generation.py --workdir=/tmp/bg

8 fake CPU devices by default (8 instances of 1 device); on a real machine the same command uses
its devices. Lengths are long-tailed: each sample's response budget is drawn from a clipped
log-normal (or read from `lengths.path`) and, with no EOS token, every sample stops exactly at
its budget (a per-sample stop condition that migrates with the sample). Variant
`--config=configs/bench_generation.py:tiny` is the seconds-long smoke size the tests run.

Delayed inter-batch pipelined generation (docs/architecture.md §4) instead of fusion:

  python -m experiments.bench_generation --config=configs/bench_generation.py:pipelined \
      --workdir=/tmp/bgp

(`configs/bench_generation.py:pipelined_tiny` is its test size.)
"""
import ml_collections


def get_config(arg: str = "default"):
  c = ml_collections.ConfigDict()
  c.seed = 0  # prompts, lengths, weights and the sampling key
  c.batch_size = 64  # samples generated per run
  c.repeats = 5  # timed runs per mode (interleaved baseline, fused); the median is reported
  c.warmup = 1  # untimed runs per mode first (another batch: fills the length histogram)

  c.model = ml_collections.ConfigDict()  # actor and reference shape (LM head)
  c.model.vocab_size = 256
  c.model.hidden_size = 128
  c.model.intermediate_size = 256
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.max_seq_len = 256
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"

  c.critic = True  # score critic values (same backbone, scalar head)
  c.reward_model = True  # score with a reward model (same backbone, scalar head)

  c.generation = ml_collections.ConfigDict()
  c.generation.num_instances = 8  # generation instances G (0: devices / instance_devices)
  c.generation.instance_devices = 1  # devices per instance (tensor parallel inside it)
  c.generation.slots = 8  # batch slots per instance
  c.generation.prompt_len = 16  # prompt bucket; prompt lengths uniform in [prompt_min_len, it]
  c.generation.prompt_min_len = 4
  c.generation.max_new_tokens = 128  # response budget T (KV cache: prompt_len + T per slot)
  c.generation.chunk_size = 8  # decode steps K per jitted call
  c.generation.temperature = 1.0
  c.generation.migration_threshold = "auto"  # Rt in [0, 1] or "auto" (simulated)
  c.generation.max_consolidations = 1  # consolidations per batch
  c.generation.inference_micro_batch = 8  # samples per inference micro-batch
  c.generation.inference_inflight = 0  # cap on micro-batches at once during the tail; 0: none
  # instances one inference micro-batch runs through (> 1: pipelines of freed instances, each
  # holding 1/inference_pp of every inference model's layers; docs/architecture.md §2)
  c.generation.inference_pp = 1
  c.generation.migration_rows = 8  # rows a migration moves at once (more: in parts); 0: slots
  # Several processes (--distributed): where the per-round exchanges run, "host" (one CPU
  # device per process) or "devices" (every device); a collective's timeout (exit 69).
  c.generation.exchange_on = "host"
  c.generation.exchange_timeout_s = 600.0

  c.lengths = ml_collections.ConfigDict()  # per-sample response lengths (sim/lengths.py)
  c.lengths.kind = "lognormal"  # lognormal | pareto | uniform | constant | empirical
  c.lengths.median = 12.0  # lognormal median (tokens)
  c.lengths.sigma = 1.3  # lognormal sigma: the weight of the tail
  c.lengths.min_len = 1
  c.lengths.alpha = 1.5  # pareto tail index
  c.lengths.value = 0  # constant
  c.lengths.path = ""  # empirical: .npy/.txt/.json/.jsonl lengths (e.g. a metrics.jsonl)

  if arg == "tiny":
    c.batch_size = 8
    c.repeats = 1
    c.critic = False
    c.model.vocab_size = 32
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_layers = 1
    c.model.max_seq_len = 64
    c.generation.num_instances = 2
    c.generation.slots = 4
    c.generation.prompt_len = 6
    c.generation.prompt_min_len = 2
    c.generation.max_new_tokens = 16
    c.generation.chunk_size = 2
    c.generation.inference_micro_batch = 4
    c.lengths.median = 3.0
  elif arg in ("pipelined", "pipelined_tiny"):
    _pipelined(c, tiny=arg == "pipelined_tiny")
  elif arg != "default":
    raise ValueError(f"configs/bench_generation.py: unknown variant {arg!r}; expected 'default', "
                     "'tiny', 'pipelined' or 'pipelined_tiny'")
  return c


def _pipelined(c, tiny: bool) -> None:
  """A pp-stage generation pipeline with G delayed groups (generation/pipelined.py), compared
  with the non-pipelined Generator on the same prompts and keys. Every sample runs its whole
  budget (constant lengths, no EOS): the decode steady state the busy fraction is about."""
  c.generation.pipeline_stages = 2 if tiny else 4  # pp: devices on the `stage` axis
  c.generation.pipeline_groups = 4 if tiny else 8  # G >= pp groups of batch_size / G rows
  c.batch_size = 8 if tiny else 32
  c.repeats = 1 if tiny else 3
  c.critic = False  # generation only: no inference models
  c.reward_model = False
  c.model.num_layers = 2 if tiny else 4
  # Scanned layers: the Generator's layers then compile to the stages' per-layer code, so the
  # log-probs are bitwise equal (unrolled: XLA fuses across the boundaries the stages cut).
  c.model.scan_layers = True
  c.generation.max_new_tokens = 8 if tiny else 32
  c.generation.chunk_size = 2 if tiny else 8
  c.lengths.kind = "constant"
  c.lengths.value = c.generation.max_new_tokens
  if tiny:
    c.model.vocab_size = 32
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.max_seq_len = 64
    c.generation.prompt_len = 6
    c.generation.prompt_min_len = 2
