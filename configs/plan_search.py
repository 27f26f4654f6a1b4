r"""Pipe-RLHF's hierarchical plan search (rlhfuse_jax/sim/plan_search.py) on one setting.

  python -m experiments.plan_search --config=configs/plan_search.py:65b/33b --workdir=/tmp/plan

The variant names the actor/critic pair of the RLHFuse paper (13b/13b, 33b/13b, 65b/33b,
65b/65b; default 65b/33b); every other field (cluster, workload, lengths, efficiencies,
calibration, simulated systems) is configs/ablations.py's, with one max generation length.
Asynchronous PPO: `sim.staleness` k >= 1 (default 1) also searches the splits of the devices
into a generation and a training group (in steps of `sim.async_split_unit` devices, 0: a node);
`--config.sim.staleness=0` searches the synchronous plans only (with `systems` not naming
pipe_rlhf_async).
Writes plan.json (the fastest plan; an asynchronous one carries "async": {generation_devices,
training_devices, staleness}), result.json (best synchronous plan, top plans, best uniform
layout, the async plan, the other systems, search_s) and plan_search.md.
"""
import ml_collections

from configs import ablations

PAIRS = {"13b/13b": "llama-13b/llama-13b", "33b/13b": "llama-33b/llama-13b",
         "65b/33b": "llama-65b/llama-33b", "65b/65b": "llama-65b/llama-65b"}


def get_config(arg: str = "65b/33b") -> ml_collections.ConfigDict:
  if arg not in PAIRS:
    raise ValueError(f"unknown config variant {arg!r}; expected one of {sorted(PAIRS)}")
  c = ablations.get_config()
  c.pairs = PAIRS[arg]
  c.max_new_tokens = "1024"  # one setting: the max generation length
  c.top_k = 5  # plans listed in the report (the best combinations of each stage's best)
  # the simulator's other systems on the same setting, for comparison ("" for none)
  c.systems = "realhf_like,rlhfuse_base,rlhfuse,pipe_rlhf,rlhfuse_planned,pipe_rlhf_async"
  return c
