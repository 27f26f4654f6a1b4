r"""Fused actor/critic pipeline executor: serial 1F1B vs fused schedules, gradients vs jax.grad.

On CPU (8 fake devices, set by the binary; a tiny actor and critic, 72 s on 2 cores, 2026-12-01):
  python -m experiments.bench_pipeline --config=configs/bench_pipeline.py --workdir=/tmp/bench_pipeline
An 8-stage actor with a 4-stage critic (two replicas) on the same 8 devices, no data axis:
  python -m experiments.bench_pipeline --config=configs/bench_pipeline.py:pp8 --workdir=/tmp/bench_pp8

Writes result.json (ticks, lockstep time, wall time, compile time, stash sizes, gradient errors
of both models against jax.grad of the unpipelined losses, per schedule), config.json,
schedules.json (the orders run) and calibration.json (this machine's measured stage and
executor costs, for the simulator's validation in experiments/reproduce_ablations.py).
"""
import ml_collections


def get_config(arg: str = "default"):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.actor_pp = 4  # actor stages = devices on the mesh's `stage` axis
  c.critic_pp = 2  # critic stages (actor_pp / critic_pp critic replicas, reversed placement)
  c.data = 2  # data-parallel mesh axis (stage x data devices in all)
  c.actor_microbatches = 8  # actor micro-batches per mini-batch shard
  c.critic_microbatches = 4  # micro-batches per critic replica
  c.minibatch_size = 32  # rows of the mini-batch (split over data, then into micro-batches)
  c.prompt_len = 8  # prompt tokens per row (all rows; response positions follow)
  c.response_len = 8  # response tokens per row (the last rows are shorter: mask tests padding)
  c.actor = ml_collections.ConfigDict()  # tiny LLaMA-shaped actor (LM head)
  c.actor.vocab_size = 256
  c.actor.hidden_size = 64
  c.actor.intermediate_size = 128
  c.actor.num_layers = 4  # divisible by actor_pp
  c.actor.num_heads = 4
  c.actor.num_kv_heads = 2
  c.critic = ml_collections.ConfigDict()  # tiny critic (scalar value head)
  c.critic.vocab_size = 256
  c.critic.hidden_size = 64
  c.critic.intermediate_size = 128
  c.critic.num_layers = 2  # divisible by critic_pp
  c.critic.num_heads = 4
  c.critic.num_kv_heads = 2
  # Cost model (per stage and micro-batch; backward = ratio x forward) of the reported lockstep
  # and list-scheduled times, and of the `searched_time` schedule's search.
  c.actor_fwd = 1.0
  c.critic_fwd = 1.0
  c.bwd_ratio = 2.0
  c.search_time_s = 5.0  # budget of each of the two schedule searches (seconds)
  c.warmup = 2  # untimed runs after compilation
  c.repeats = 7  # timed runs (median reported)
  c.calib_ticks = 64  # ticks of the calibration tables (calibration.json: task and tick costs)
  c.clip_eps = 0.2  # PPO ratio clip
  c.value_clip_eps = 0.2  # value clip (0: unclipped, as the trainer's algo.value_clip_eps)
  c.vf_coef = 0.5  # critic loss weight
  c.entropy_coef = 0.01  # entropy bonus
  if arg == "pp8":
    c.actor_pp, c.critic_pp, c.data = 8, 4, 1
    c.actor_microbatches, c.critic_microbatches = 16, 8
    c.actor.num_layers, c.critic.num_layers = 8, 4
  elif arg != "default":
    raise ValueError(f"unknown config variant {arg!r}; known: 'default', 'pp8'")
  return c
