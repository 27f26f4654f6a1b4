r"""Tiny PPO runs on CPU. The default: a 2-layer decoder learns the synthetic 'repeat' task from
scratch; `fused` (below) is the README's main job, both fusions on 8 fake devices.

  python -m experiments.train_ppo --config=configs/ppo_tiny.py --workdir=/tmp/ppo_tiny

Variants: `--config=configs/ppo_tiny.py:grpo` (critic-free GRPO), `configs/ppo_tiny.py:dr_grpo`
(Dr. GRPO: mean-centred group scores and a constant-horizon loss). Sweep:
  python -m experiments.sweep --config=configs/ppo_tiny.py --binary=train_ppo --workdir=/tmp/sw

`fused`: intra-stage fusion (docs/architecture.md §3) on a data=2 x stage=4 mesh: a 4-layer actor
(4 stages) and a 2-layer critic (2 stages, 2 replicas) train through the pipeline executor with the
searched fused schedule, and generation runs as sample-level instances with long-tail consolidation
and streaming inference (inter-stage fusion, docs/architecture.md §2). Its task is 'countdown' with
log-normal target lengths, so that responses are long-tailed and most iterations consolidate the
tail (KV migration) and stream inference on the freed instances; the progress line says what fusion
did in each iteration. It needs 8 devices; on a CPU host give jax 8 fake ones:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train_ppo \
    --config=configs/ppo_tiny.py:fused --workdir=/tmp/ppo_tiny_fused
Add --config.fusion.intra_stage=False for serial 1F1B through the same executor, and
--config.fusion.inter_stage=False for serial generation then inference; the fusion ablation
(all four, throughput side by side in summary.md) is its sweep:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.sweep \
    --config=configs/ppo_tiny.py:fused --binary=train_ppo --workdir=/tmp/fusion_ablation \
    --config.num_iterations=40
"""
import ml_collections

from rlhfuse_jax.trainer import config as config_lib


def get_config(arg: str = "ppo"):
  # Every field at its default (rlhfuse_jax/trainer/config.py: the one source of defaults, each
  # field documented there); this run sets what it changes.
  c = ml_collections.ConfigDict(config_lib.defaults())
  c.seed = 0
  c.num_iterations = 400  # PPO iterations (re-run with a larger value to continue)

  # A 2-layer decoder small enough to learn 'repeat' from scratch on a CPU in minutes.
  c.model.vocab_size = 0  # 0: the tokenizer's vocabulary
  c.model.hidden_size = 64
  c.model.intermediate_size = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.max_seq_len = 64  # prompt bucket 8 + 12 new tokens, with room
  c.critic_model.hidden_size = 64  # critic / reward backbone (scalar head)
  c.critic_model.intermediate_size = 128
  c.critic_model.num_layers = 2
  c.critic_model.num_heads = 4
  c.critic_model.num_kv_heads = 2
  c.critic_model.max_seq_len = 64

  # 'repeat' targets are at most 8 tokens: 12 new tokens leave room to overrun and be charged.
  c.rollout.prompts_per_iteration = 64
  c.rollout.max_new_tokens = 12
  c.rollout.chunk_size = 4  # 3 decode chunks per batch: the host sees `done` between them
  # The tiny run's learning rates, warmup and KL weight, as measured in docs/results.md.
  c.algo.kl_coef = 0.01
  c.optim.actor_lr = 3e-3
  c.optim.critic_lr = 3e-3
  c.optim.warmup_steps = 5

  if arg in ("grpo", "dr_grpo"):
    c.algo.estimator = arg
    c.rollout.prompts_per_iteration = 16
    c.rollout.samples_per_prompt = 4
    c.algo.kl_in_reward = False  # GRPO puts the KL in the loss
    c.algo.kl_estimator = "k3"
    if arg == "dr_grpo":  # Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): both of its changes
      c.algo.loss_agg = "seq-mean-token-sum-norm"
      # Its policy term is a response's token sum over the 12-token horizon times raw score
      # differences (no std division), several times smaller here than GRPO's token mean of
      # std-normalised ones, while the KL loss term stays a token mean: at GRPO's 0.01 the KL
      # held the policy (reward 0.04 -> 0.25 in 400 iterations, seeds 0 and 1 alike). Of 0.01,
      # 0.002 and 0 tried: docs/results.md, "tiny Dr. GRPO learns".
      c.algo.kl_coef = 0.002
  elif arg == "fused":
    c.mesh.stage = 4  # data = 8 / 4 = 2
    c.model.num_layers = 4  # one layer per actor stage
    c.pipeline.critic_pp = 2  # critic layers 2: one per stage, 2 replicas
    c.pipeline.actor_microbatches = 8  # 32 rows / 2 data shards = 16 rows: 2 per micro-batch
    c.pipeline.critic_microbatches = 4  # 2 replicas x 4 = 8 micro-batches of 2 rows
    c.fusion.intra_stage = True
    c.fusion.inter_stage = True  # both fusions: the README's main command
    # A long tail for inter-stage fusion to act on. 'repeat' with uniform lengths has none (every
    # sample ends in the same few decode chunks: no consolidation in 399 of 400 iterations).
    # 'countdown' ("#n =" -> "#n ... #1") with n = round(exp(N(1.0, 0.8))) clipped to 1..11:
    # median 3, ~14 % of the responses longer than 7 tokens, a few at the 12-token limit
    # (n + EOS <= rollout.max_new_tokens = 12). Its steps are local (#k -> #k-1), so the rare
    # long n reuse what the short ones teach and the trained policy keeps the tail.
    c.data.task = "countdown"
    c.data.length_dist = "lognormal"
    c.data.length_max = 11
    c.rollout.chunk_size = 2  # consolidation is decided between decode chunks: finer chunks
    # Fixed Rt: consolidate when <= 30 % of the 64 samples are unfinished (with this tail:
    # after 4 decode steps, 8 instances -> 2 or 3). "auto" (the default) simulates the Rt
    # candidates with costs measured on the instances; on 8 fake CPU devices sharing a few cores
    # they all simulate within a few percent of each other, and in a trial run the choice
    # flipped between 0 (never consolidate) and 1 as the length histogram grew. Add
    # --config.fusion.migration_threshold=auto to see it choose (fusion/rt_simulated_s in
    # metrics.jsonl).
    c.fusion.migration_threshold = "0.3"
    # At 3e-3 the 4-layer actor collapsed to empty responses after ~170 iterations in a trial
    # run of countdown (log-normal mu=0.7); at 1e-3 it learns (docs/results.md, the main job's
    # row: reward, consolidations).
    c.optim.actor_lr = 1e-3
    # One PPO epoch (default 2): when this was chosen (2026-11-25, before the stage-sharded
    # pipeline state) one epoch took 5 min 52 s instead of 7 min 32 s and still learned while
    # keeping the tail; minibatch_size=64 at 2 epochs was as fast but taught the policy to end
    # early (inference overlapped the tail in only 62 of 400 iterations). Today's figures:
    # docs/results.md, "main job".
    c.algo.epochs = 1
  elif arg != "ppo":
    raise ValueError(f"configs/ppo_tiny.py: unknown variant {arg!r}; expected 'ppo', 'grpo', "
                     "'dr_grpo' or 'fused'")
  return c


def get_sweep(arg: str = ""):
  """Seeds x estimators: the tiny run's sensitivity to the seed and the estimator. grpo's and
  dr_grpo's sweeps are over seeds alone, with the variant's own estimator (a sweep over
  estimators replaced it in every run). `fused`'s is the fusion ablation: both fusions, each
  alone and neither, one seed (the four train the same trajectory: docs/architecture.md §2-3),
  so the summary sets their throughput (median_tokens_per_s, median_step_s) side by side;
  add --config.num_iterations=40 for a quick one."""
  if arg == "fused":
    return [{"name": f"inter{int(inter)}_intra{int(intra)}", "fusion.inter_stage": inter,
             "fusion.intra_stage": intra} for inter in (True, False) for intra in (True, False)]
  estimators = (("gae", "reinforce_pp") if arg in ("", "ppo") else
                (get_config(arg).algo.estimator,))
  return [{"name": f"{est}_s{seed}", "seed": seed, "algo.estimator": est}
          for est in estimators for seed in (0, 1)]
