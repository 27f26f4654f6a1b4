"""Performance accounting for the benchmarks: bytes and FLOPs per operation, and fractions of a
device's peak (rlhfuse_jax.sim.hardware presets)."""
