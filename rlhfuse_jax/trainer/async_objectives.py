"""The objectives config.async_ppo.objective takes (trainer/config.py's AsyncPPOConfig), in a
module without jax: experiments/bench_async.py, which only starts train_ppo runs in
subprocesses, checks its config.objective against them before any run starts, and refuses a bad
value or another binary's workdir in about a second instead of after importing jax."""

ASYNC_OBJECTIVES = ("behaviour", "decoupled")
