r"""Asynchronous PPO vs the synchronous loop (experiments/bench_async.py).

Learning (ppo_tiny and grpo_tiny, staleness 0, 1, 2, 3 seeds each, on one CPU
device; about 10 min on 2 cores, two runs at a time):
  python -m experiments.bench_async --config=configs/bench_async.py --workdir=/tmp/bench_async
Iteration wall time on 8 fake CPU devices, 4 generate and 4 train, staleness 0 vs 1:
  python -m experiments.bench_async --config=configs/bench_async.py:timing --workdir=/tmp/ba_t
"""
import ml_collections


def get_config(arg: str = "learning"):
  c = ml_collections.ConfigDict()
  c.runs = ("configs/ppo_tiny.py", "configs/grpo_tiny.py")  # train_ppo configs[:variant]
  c.staleness = (0, 1, 2)  # 0 first: the synchronous reference
  c.objective = "behaviour"  # config.async_ppo.objective of the async runs
  c.num_iterations = 0  # 0: each config's own (400 for the tiny runs)
  c.generation_devices = 0  # config.async_ppo.generation_devices
  c.seeds = (0, 1, 2)  # every run config and staleness once per seed (gains: their mean)
  c.parallel = 2  # runs at once (learning only: each is single-threaded enough on 2 cores)
  c.host_devices = 1  # fake CPU devices of each run (XLA_FLAGS)
  c.window = 0.1  # reward gain: mean of the last window minus the first (fraction of the run)
  c.skip = 3  # iterations left out of the median step time (compiles)
  c.min_gain_ratio = 0.9  # acceptance: an async run's gain >= this x the synchronous gain
  if arg == "timing":
    c.runs = ("configs/ppo_tiny.py",)
    c.staleness = (0, 1)
    c.num_iterations = 40
    c.host_devices = 8
    c.generation_devices = 4
    c.min_gain_ratio = 0.0  # 40 iterations measure time, not learning
    c.seeds = (0,)
    c.parallel = 1  # alone on the machine: wall times
  elif arg != "learning":
    raise ValueError(f"configs/bench_async.py: unknown variant {arg!r}; expected 'learning' or "
                     "'timing'")
  return c
