"""Decisions shared by the engine and the simulator, in plain numpy (docs/architecture.md §7).

The generation engine (jax) and the simulator (numpy) run the very same consolidation plan, Rt
choice and calibration format, so a simulated iteration and a real one make the same decisions.
This package imports nothing else of rlhfuse_jax: both sides depend on it, never the reverse.
"""
