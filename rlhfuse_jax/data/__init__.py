"""Data: tokenizers, prompt datasets and a resumable prompt stream, chat templates, rewards,
synthetic verifiable tasks.

  tokenizer  Tokenizer interface; HFTokenizer over tokenizer.json (`tokenizers` library)
  prompts    load_jsonl_prompts, tokenize_prompts, PromptDataset (seeded, resumable batches)
  lengths    LengthDistribution: uniform or clipped log-normal (long-tailed) target lengths
  records    load_records (JSONL/parquet rows, prompt_key/answer_key), split_records, render_prompts
  chat       ChatTemplate: a tokenizer's chat template rendered as transformers does
  rewards    REWARD_FUNCTIONS: verifiable Python rewards in [0, 1] (target_match, gsm8k, math,
             format rewards, ...), per_sample, functions by import path
  verifiers  the math verifiers (GSM8K final number, MATH boxed answers) and format rewards
  tasks      TASKS: repeat, count_up, countdown, sort, each with its own vocabulary and verifier
"""
from rlhfuse_jax.data.lengths import LengthDistribution
from rlhfuse_jax.data.prompts import (PromptBatch, PromptDataset, load_jsonl_prompts,
                                      tokenize_prompts)
from rlhfuse_jax.data.rewards import REWARD_FUNCTIONS, get_reward_function
from rlhfuse_jax.data.tasks import TASKS, Task, TaskConfig, make_task
from rlhfuse_jax.data.tokenizer import HFTokenizer, Tokenizer
