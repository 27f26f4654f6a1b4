"""rlhfuse_jax: fast RLHF (PPO) training of decoder LLMs in JAX (RLHFuse + Pipe-RLHF ideas)."""
