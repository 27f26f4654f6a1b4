"""Data: tokenizers, JSONL prompts and a resumable prompt stream, synthetic verifiable tasks.

  tokenizer  Tokenizer interface; HFTokenizer over tokenizer.json (`tokenizers` library)
  prompts    load_jsonl_prompts, tokenize_prompts, PromptDataset (seeded, resumable batches)
  lengths    LengthDistribution: uniform or clipped log-normal (long-tailed) target lengths
  rewards    REWARD_FUNCTIONS: verifiable Python rewards in [0, 1] (target_match, ...)
  tasks      TASKS: repeat, count_up, countdown, sort, each with its own vocabulary and verifier
"""
from rlhfuse_jax.data.lengths import LengthDistribution
from rlhfuse_jax.data.prompts import (PromptBatch, PromptDataset, load_jsonl_prompts,
                                      tokenize_prompts)
from rlhfuse_jax.data.rewards import REWARD_FUNCTIONS, get_reward_function
from rlhfuse_jax.data.tasks import TASKS, Task, TaskConfig, make_task
from rlhfuse_jax.data.tokenizer import HFTokenizer, Tokenizer
