r"""Shape-only PPO configs for LLaMA-class actor/critic pairs on GPU/TPU meshes
(docs/usage.md "GPU, TPU and many hosts" and "Memory at scale").

For real clusters; nothing here runs them (tests only parse them). 13B actor and critic on
32 to 256 GPUs (one process per host, see launch/):
  python -m experiments.train_ppo --config=configs/ppo_llama.py:13b --workdir=/ckpt/ppo_13b
Variants (critic of the same size): `configs/ppo_llama.py:7b`, `configs/ppo_llama.py:13b`,
`configs/ppo_llama.py:33b`, `configs/ppo_llama.py:65b`; or an 'actor/critic' pair as in the
RLHFuse paper: `configs/ppo_llama.py:33b/13b`, `configs/ppo_llama.py:65b/33b`. Those train
unpipelined (fsdp x tensor, the serial-stage baseline); the paper's pairs on pipelined plans with
intra-stage fusion (actor and critic pipelines fused by the searched schedule), which keep the
large updates off the links: `configs/ppo_llama.py:fused/7b`, `configs/ppo_llama.py:fused/13b`,
`configs/ppo_llama.py:fused/33b/13b`, `configs/ppo_llama.py:fused/65b/33b`. The paper's
generation lengths as a sweep:
  python -m experiments.sweep --config=configs/ppo_llama.py --binary=train_ppo --workdir=/ckpt/sw

Check a preset's memory before renting the GPUs (compiled from shapes on CPU, a few minutes):
  python -m experiments.plan_check --config=configs/plan_check.py:llama/13b --workdir=/tmp/pc13b

Generation and scoring run on instances of `tensor` devices (config.plan.generation), with the
optimizer state in host memory while they run (config.optim.offload_during_rollout): docs/usage.md
"Memory at scale" and "Communication at scale".

Every field of configs/ppo_tiny.py is present (this file starts from it). Real runs also set
init.actor_checkpoint / init.critic_checkpoint (HF LLaMA checkpoints), init.tokenizer and
data.prompts_file; without them the actor is random and prompts come from the synthetic task.
"""
from configs import ppo_tiny

# LLaMA-1 (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", Table 2:
# dimension, heads, layers, and the parameter counts 6.7B / 13.0B / 32.5B / 65.2B; vocabulary
# 32000, §2.1). SwiGLU widths from the released params.json (2/3 * 4d rounded up to a multiple
# of 256). Llama 2 7B/13B (Touvron et al. 2023b) have the same shapes. Full multi-head attention.
# name: (hidden, intermediate, layers, heads, nominal params)
SHAPES = {
    "7b": (4096, 11008, 32, 32, 6.7e9),
    "13b": (5120, 13824, 40, 40, 13.0e9),
    "33b": (6656, 17920, 60, 52, 32.5e9),
    "65b": (8192, 22016, 80, 64, 65.2e9),
}

# Mesh per actor size: fsdp x tensor devices hold one model replica, `data` takes the rest.
# tensor divides every model's heads (52 heads of 33B: 4, not 8), intermediate and vocabulary;
# fsdp divides hidden. The batch is split over data x fsdp, which must divide
# algo.minibatch_size (64), so each size runs on replica .. 64 * tensor devices: 7B on 8..64
# GPUs, 13B and 33B on 32..256, 65B on 64..512 (the paper's pairs all fit its 256 GPUs).
# A pair of two sizes gets the tensor degree both divide and the larger replica (get_config).
MESHES = {
    "7b": {"data": -1, "fsdp": 8, "tensor": 1},
    "13b": {"data": -1, "fsdp": 8, "tensor": 4},
    "33b": {"data": -1, "fsdp": 8, "tensor": 4},
    "65b": {"data": -1, "fsdp": 8, "tensor": 8},
}


# algo.microbatch_size per model size, from plan_check llama/<variant> --config.microbatch_size=k
# on the smallest mesh (train step peak GB per device; collectives, s per step on H100s), with
# the float32 copy and moments of optim.master_weights (2026-11-29 (v); without them, 2 + 4
# bytes a parameter, 7b took 4 and 65b 2):
#   7b   k=2 58.5, 2.2 s;  k=4 77.1 (over 72)
#   13b  k=4 41.9, 3.0 s
#   33b  k=2 68.8, 13.0 s
#   65b  k=1 60.4, 50.1 s; k=2 73.3 (over 72)
# A pair takes the smaller of its two sizes' unless PAIR_MICROBATCH measured it on its own mesh.
MICROBATCH = {"7b": 2, "13b": 4, "33b": 2, "65b": 1}
#   65b/33b (tensor 4, fsdp 16)  k=2 71.9, 10.5 s
PAIR_MICROBATCH = {("65b", "33b"): 2}

# fusion.migration_rows (rows a consolidation's migration copies at once, beside the receiving
# instance's whole KV cache, the actor's weights and the training state) where the default 8
# does not fit 80 GB: plan_check llama/<variant>'s migrate + state, 2026-12-06, on the smallest
# mesh: 7b 81.24 GB at 8 rows, 65b/33b (tensor 4) 84.02; the other pairs 33.3-69.4 at 8.
PAIR_MIGRATION_ROWS = {("7b", "7b"): 4, ("65b", "33b"): 4}

# `fused/<pair>`: the pipelined plan sim/training_sim.best_plan picks for the RLHFuse paper's
# pairs on 256 H100s (whole layers per stage, read 2026-11-26 (h); configs/plan_check.py's paper
# variants): (actor stages, critic stages, tensor). The data axis takes the other devices.
FUSED_PLANS = {"7b": (8, 8, 4), "13b": (8, 8, 4), "33b/13b": (4, 4, 4), "65b/33b": (16, 4, 4)}


def _set_shape(section, name: str) -> None:
  hidden, inter, layers, heads, _ = SHAPES[name]
  section.hidden_size = hidden
  section.intermediate_size = inter
  section.num_layers = layers
  section.num_heads = heads
  section.num_kv_heads = heads  # no grouped-query attention in LLaMA-1
  section.max_seq_len = 4096  # Llama 2's context; covers prompt 512 + 2048 new tokens
  section.param_dtype = "bfloat16"
  section.dtype = "bfloat16"
  # GPU: cuDNN fused attention for training and prefill, the Pallas decode kernel on the
  # generation instances; blockwise elsewhere (models/attention.py)
  section.attention = "auto"
  section.remat = "dots"  # keep projections, recompute the rest: long sequences fit in memory
  # Layers stacked and run by one lax.scan: under FSDP each layer's weights are gathered inside
  # the loop, one layer at a time (unrolled, XLA is free to gather every layer up front: the 7B
  # update on 8 devices compiled to 118.8 GB per device, 35.7 GB scanned; plan_check llama/7b),
  # and the compile does not grow with depth (63 s -> 5 s on CPU).
  section.scan_layers = True


def parse_variant(arg: str) -> tuple[str, str]:
  """'13b' -> ('13b', '13b'); '65b/33b' and 'fused/65b/33b' -> ('65b', '33b')."""
  pair = arg[len("fused/"):] if arg.startswith("fused/") else arg
  parts = pair.split("/")
  if len(parts) not in (1, 2) or any(p not in SHAPES for p in parts):
    raise ValueError(f"configs/ppo_llama.py: unknown variant {arg!r}; expected a size in "
                     f"{list(SHAPES)} or 'actor/critic' such as '65b/33b', either with the "
                     f"prefix 'fused/' for the pipelined plans of {list(FUSED_PLANS)}")
  if pair != arg and pair not in FUSED_PLANS:
    raise ValueError(f"configs/ppo_llama.py: unknown variant {arg!r}: the pipelined plans are "
                     f"those of the paper's pairs, {['fused/' + k for k in FUSED_PLANS]}")
  return parts[0], parts[-1]


def get_config(arg: str = "13b"):
  actor, critic = parse_variant(arg)
  if arg.startswith("fused/"):
    return _fused(get_config(arg[len("fused/"):]), arg[len("fused/"):])
  c = ppo_tiny.get_config()
  c.num_iterations = 100  # PPO iterations
  c.log_every = 1

  c.model.vocab_size = 32000  # LLaMA SentencePiece vocabulary
  c.model.head_dim = 0  # 0: hidden_size // num_heads = 128
  c.model.rope_theta = 10000.0
  _set_shape(c.model, actor)
  _set_shape(c.critic_model, critic)  # critic backbone; the trainer gives it a scalar head

  # One mesh holds both models: the tensor size must divide both models' heads (the smaller of
  # the two sizes' tensor degrees), with the devices of the larger model's replica.
  tensor = min(MESHES[actor]["tensor"], MESHES[critic]["tensor"])
  replica = max(MESHES[m]["fsdp"] * MESHES[m]["tensor"] for m in (actor, critic))
  c.mesh.data = -1  # the rest of the devices
  c.mesh.fsdp = replica // tensor
  c.mesh.tensor = tensor
  c.mesh.stage = 1  # no pipeline in the serial-stage baseline
  # Generation and scoring on instances of `tensor` devices (the actor resharded onto them once
  # per iteration), not on the training mesh, where every decode step all-gathers the fsdp-split
  # weights: for 13B on 32 H100s plan_check llama/13b counts 9.6 GB of collectives per device
  # and step there (>= 130 ms on the links vs 6 ms of HBM reads) and 0.11 GB on instances.
  c.plan.generation = "instances"
  c.plan.generation_tp = tensor
  # Scoring on a freed instance in micro-batches of 8 samples (0 would take all its slots).
  c.fusion.inference_micro_batch = 8
  c.fusion.migration_rows = PAIR_MIGRATION_ROWS.get((actor, critic), c.fusion.migration_rows)
  # The optimizer state waits in host memory while the instances generate: their KV caches (64
  # slots each at the smallest device counts) fill what that state held. On the smallest
  # meshes decode + training state is 89.8 GB per device for 7B and 87.3 GB for 65B/33B with
  # the optimizer state (float32 copy and moments) on the devices, 69.8 and 69.0 GB without
  # (plan_check llama/<variant>, 2026-11-29 (v)).
  c.optim.offload_during_rollout = True

  c.data.max_prompt_len = 512  # prompt bucket (right-padded)
  c.rollout.prompts_per_iteration = 512  # global batch of the RLHFuse setting
  c.rollout.samples_per_prompt = 1
  c.rollout.max_new_tokens = 1024  # the paper sweeps 512 / 1024 / 2048 (get_sweep)
  c.rollout.chunk_size = 64  # decode steps per jitted call
  # The device tests "all rows done?" every 8 steps: 8x fewer host round trips on GPU (1.8 % per
  # step on an H100 with one test per 128 steps, experiments/results/h100_decode_variants), at
  # most 7 idle steps after the last row stops; the tokens do not change.
  c.rollout.steps_per_check = 8
  c.algo.minibatch_size = 64  # samples per optimizer step
  # Samples per device through forward + backward at a time, the gradients accumulated
  # (MICROBATCH: the most that leave 10 % of 80 GB free at the smallest device counts, where a
  # data shard holds 8 of the 64, or 4 for 65B/33B). Each micro-batch gathers the fsdp-split
  # weights and reduces the gradients again, so fewer, larger ones spend less time on the links.
  c.algo.microbatch_size = PAIR_MICROBATCH.get((actor, critic),
                                               min(MICROBATCH[actor], MICROBATCH[critic]))
  c.algo.epochs = 1  # one PPO epoch over the rollout per iteration
  # The KL weight, stated here rather than left to ppo_tiny's toy run (same value). Published
  # scripts use 1e-3 to 0.1 (OpenRLHF's examples 1e-3, ReaLHF's quickstart kl_ctl 0.1).
  c.algo.kl_coef = 0.01
  c.optim.actor_lr = 1e-6  # small learning rates: fine-tuning a pretrained model
  c.optim.critic_lr = 5e-6
  # AdamW steps a float32 copy of the bfloat16 weights with float32 moments (at lr 1e-6 steps
  # on the weights themselves mostly round away: docs/usage.md "GPU, TPU and many hosts").
  # fsdp x tensor already split that state; optim.zero1 (also over data) is the fused presets'.
  c.optim.master_weights = True
  c.optim.warmup_steps = 10
  c.checkpoint.every = 10
  c.checkpoint.keep = 2
  return c


def _fused(c, pair: str):
  """The preset `c` on its pipelined plan (FUSED_PLANS): actor and critic layers split over
  `stage` (the critic over fewer stages, replicated over the rest), Megatron splits over
  `tensor`, no fsdp, the searched fused schedule (config.fusion.intra_stage), one sample per
  micro-batch at any data-parallel size that leaves each critic replica a sample. For 13B and
  up its update spends 1.9-3.0x less time on the links than the fsdp preset's on the same GPUs;
  for 7B the fsdp preset is faster (docs/results.md "Fused presets"). fused/33b/13b needs 32
  GPUs or more for its generation instances' KV caches."""
  stages, critic_stages, tensor = FUSED_PLANS[pair]
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.stage = stages
  c.mesh.tensor = tensor
  c.pipeline.critic_pp = critic_stages
  c.pipeline.actor_microbatches = 0  # one row each: fits every data-parallel size
  c.pipeline.critic_microbatches = 0
  c.fusion.intra_stage = True
  # The optimizer state (float32 copy and moments) split over data and the critic's replicas
  # (ZeRO-1, as the simulator's plans assume): without it 65b/33b's critic state, whole on each
  # of its 4 replicas, would not fit beside the actor's (plan_check llama/fused/65b/33b).
  c.optim.zero1 = True
  return c


def get_sweep():
  """The paper's maximum generation lengths, on the default 13B/13B pair."""
  return [{"name": f"gen{n}", "rollout.max_new_tokens": n} for n in (512, 1024, 2048)]
