r"""Tiny GRPO run on CPU (critic-free, 4 samples per prompt, KL as a loss term).

  python -m experiments.train_ppo --config=configs/grpo_tiny.py --workdir=/tmp/grpo_tiny
"""
from configs import ppo_tiny


def get_config():
  return ppo_tiny.get_config("grpo")
