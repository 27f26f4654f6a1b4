r"""Fused actor/critic pipeline schedule search (docs/architecture.md §3, intra-stage fusion).

One instance:
  python -m experiments.schedule_search --config=configs/schedule_search.py --workdir=/tmp/ss_e0
The 12 reference instances e0..e11 with a 20 s search each (uniform budget; add
--config.memory_budget_mode=per_device for the per-device one):
  python -m experiments.sweep --config=configs/schedule_search.py --binary=schedule_search \
      --workdir=/tmp/ss_sweep --config.time_budget_s=20
"""
import os

import ml_collections

# (name, actor_pp, critic_pp, actor_microbatches, critic_microbatches, actor_fwd, critic_fwd)
REFERENCE_INSTANCES = (
    ("e0", 8, 4, 32, 16, 5.0, 4.0),
    ("e1", 8, 4, 16, 8, 5.0, 4.0),
    ("e2", 8, 4, 8, 4, 5.0, 4.0),
    ("e3", 8, 8, 32, 32, 5.0, 2.0),
    ("e4", 8, 8, 16, 16, 5.0, 2.0),
    ("e5", 8, 8, 8, 8, 5.0, 2.0),
    ("e6", 16, 8, 64, 32, 2.0, 2.0),
    ("e7", 16, 8, 32, 16, 2.0, 2.0),
    ("e8", 16, 8, 16, 8, 2.0, 2.0),
    ("e9", 16, 16, 64, 64, 2.0, 1.0),
    ("e10", 16, 16, 32, 32, 2.0, 1.0),
    ("e11", 16, 16, 16, 16, 2.0, 1.0),
)


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.actor_pp = 8                 # actor pipeline stages = devices on the pipeline axis
  c.critic_pp = 4                # critic stages; actor_pp / critic_pp critic replicas, reversed
  c.actor_microbatches = 32      # actor micro-batches per training step
  c.critic_microbatches = 16     # micro-batches per critic replica
  c.actor_fwd = 5.0              # actor forward time per stage and micro-batch
  c.critic_fwd = 4.0             # critic forward time per stage and micro-batch
  c.actor_bwd = -1.0             # actor backward time; -1: 2 x actor_fwd
  c.critic_bwd = -1.0            # critic backward time; -1: 2 x critic_fwd
  c.actor_mem = -1.0             # actor activation memory per micro-batch and stage; -1: actor_fwd
  c.critic_mem = -1.0            # critic activation memory; -1: critic_fwd
  c.transfer_latency = 0.0       # added to every dependency between two devices
  # The memory budget without an explicit one: "uniform" (every device: the largest over devices
  # of the two models' summed 1F1B peaks; equal HBM everywhere, and the most loaded 1F1B stage
  # must fit anyway) or "per_device" (device d: that sum on d; the tables and proofs made before
  # the mode existed, experiments/results/, are per_device). docs/schedules.md.
  c.memory_budget_mode = "uniform"
  c.memory_budget = -1.0         # explicit budget on every device, overrides the mode; -1: none
  c.time_budget_s = 20.0         # wall-clock seconds for the search
  c.seed = 0                     # search seed (worker i: seed + i)
  # > 0: stop after this many schedule evaluations (per worker) instead of at time_budget_s, so
  # the same seed gives the same schedule on any machine and load (a timed search's result
  # depends on how far it got: two 4 s runs gave 714 and 712); 0: the time budget.
  c.max_evaluations = 0
  # Searches at once, one per core, the best kept (search.py step 6); the reference figures
  # ran 2 on a 2-core machine. More workers than cores split each one's time.
  # (The cores this process may run on: a CPU-affinity limit, e.g. taskset or a container's
  # cpuset, can give it fewer than the machine has.)
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count() or 1)
  c.workers = min(2, cores)
  return c


def get_sweep() -> list[dict]:
  """The 12 reference instances of docs/schedules.md (ba = 2 fa, bc = 2 fc)."""
  return [{"name": name, "actor_pp": pa, "critic_pp": pc, "actor_microbatches": ma,
           "critic_microbatches": mc, "actor_fwd": fa, "critic_fwd": fc}
          for name, pa, pc, ma, mc, fa, fc in REFERENCE_INSTANCES]
