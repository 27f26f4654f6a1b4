r"""Pipe-RLHF's hierarchical plan search (rlhfuse_jax/sim/plan_search.py) on one setting.

  python -m experiments.plan_search --config=configs/plan_search.py:65b/33b --workdir=/tmp/plan

The variant names the actor/critic pair of the RLHFuse paper (13b/13b, 33b/13b, 65b/33b,
65b/65b; default 65b/33b); every other field (cluster, workload, lengths, efficiencies,
calibration, simulated systems) is configs/ablations.py's, with one max generation length.
Asynchronous PPO: `sim.staleness` k >= 1 (default 1) also searches the splits of the devices
into a generation and a training group (in steps of `sim.async_split_unit` devices, 0: a node,
or a host or a device where one node holds all);
`--config.sim.staleness=0` searches the synchronous plans only (with `systems` not naming
pipe_rlhf_async: e.g. `--config.systems=pipe_rlhf`, or `--config.systems=` for the plan search
alone, no systems' comparison).
Writes plan.json (the fastest plan; an asynchronous one carries "async": {generation_devices,
training_devices, staleness}; "workload": what it was searched for), result.json (best
synchronous plan, top plans, best uniform layout, the async plan, the other systems, search_s)
and plan_search.md.

`train`: a plan for a run of the trainer, searched on that run's workload and restricted to
plans the trainer runs, then run with it:

  python -m experiments.plan_search --config=configs/plan_search.py:train --workdir=/tmp/ps_tiny
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train_ppo \
    --config=configs/ppo_tiny.py --config.plan.file=/tmp/ps_tiny/plan.json --workdir=/tmp/ppo_p

`train_config` (a train_ppo config, PATH[:VARIANT]; default configs/ppo_tiny.py) gives the
models, rollout batch, mini-batch, epochs, max_new_tokens and lengths (experiments/
plan_search.py); the binary's --run_config=PATH[:VARIANT] replaces it and takes train_ppo's
overrides as --run_config.<field>=... (as plan_check's --run_config); `pairs`,
`max_new_tokens`, `global_batch`, `minibatch`, `epochs`, `prompt` and `response` are then not
read (overridden on the command line, refused). The hardware is
configs/ablations.py's (h100_sxm, 8 a node; `--config.hardware` picks another preset): the
plan is what the search picks for this workload on `num_devices` = 8 of them; the trainer then
runs it on whatever devices it has (8 fake CPU devices here, which share the host's cores, so
the predicted times say nothing about the CPU run). ppo_tiny rather than its `fused` variant:
`fused` pins mesh.stage=4 and pipeline.critic_pp=2, and its inter-stage fusion needs generation
on instances with inference on them, which leaves the search almost nothing to choose;
ppo_tiny leaves the layout to the plan. `sim.trainer_runnable` keeps only plans the trainer
runs as simulated, and the binary checks each with the trainer's own validation of the run's
config. `devices_per_host`: the devices of each of the run's processes (0, the default: the
hardware's host, 8 H100s), within which the trainer keeps a generation instance, an inference
pipeline and pipelined generation: 4 for `launch/local_multiprocess.sh 2 4` (a tp8 instance
searched for 8 was refused there; without it, such a plan is said in a log line).
Asynchronous splits in steps of one device (`sim.async_split_unit` = 1, what the default
0 comes to here too: the 8 devices are one node and one host).
"""
import ml_collections

from configs import ablations

PAIRS = {"13b/13b": "llama-13b/llama-13b", "33b/13b": "llama-33b/llama-13b",
         "65b/33b": "llama-65b/llama-33b", "65b/65b": "llama-65b/llama-65b"}


def get_config(arg: str = "65b/33b") -> ml_collections.ConfigDict:
  if arg not in PAIRS and arg != "train":
    raise ValueError(f"unknown config variant {arg!r}; expected one of {sorted(PAIRS)} or "
                     "'train'")
  c = ablations.get_config()
  c.pairs = PAIRS.get(arg, PAIRS["65b/33b"])
  c.max_new_tokens = "1024"  # one setting: the max generation length
  c.top_k = 5  # plans listed in the report (the best combinations of each stage's best)
  # the simulator's other systems on the same setting, for comparison ("" for none: the plan
  # search alone)
  c.systems = "realhf_like,rlhfuse_base,rlhfuse,pipe_rlhf,rlhfuse_planned,pipe_rlhf_async"
  # a train_ppo config (PATH[:VARIANT]) whose workload is searched, restricted to plans the
  # trainer runs ("": the pair above, with this config's workload fields)
  c.train_config = ""
  # the devices of each of the run's processes, which the trainer keeps a generation instance,
  # an inference pipeline and pipelined generation within (0: the hardware's host,
  # devices_per_host or devices_per_node: 8 for the H100 nodes); e.g. 4 for a run of
  # launch/local_multiprocess.sh 2 4
  c.devices_per_host = 0
  if arg == "train":
    c.train_config = "configs/ppo_tiny.py"
    c.num_devices = 8
    c.sim.trainer_runnable = True
    c.sim.async_split_unit = 1
  return c
