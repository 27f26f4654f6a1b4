"""Synthetic verifiable tasks that a tiny randomly initialised decoder learns by RL on a CPU.

Each task makes prompts whose correct response is known, over its own small word-level
vocabulary, and scores responses with partial credit (`rewards.target_match`): the fraction of
positions that agree with the target, over the longer of response and target, EOS included.

  repeat    prompt "3 #4 ="        target "3 3 3 3"       copy a symbol, stop after n
  count_up  prompt "8 #4 ="        target "8 9 0 1"       successors modulo num_symbols
  countdown prompt "#4 ="          target "#4 #3 #2 #1"   count down from n to 1
  sort      prompt "3 1 2 1 ="     target "1 1 2 3"       sort the symbols

Why this learns from scratch (repeat, defaults: 10 symbols, n uniform in 1..8, vocabulary 22):
a near-uniform initial policy matches each position with probability ~1/22 and stops after ~22
tokens on average, scoring about 0.03, and about 20 % of its samples score above 0
(`test_data_tasks` measures both). Every sampled copy of the prompt's symbol raises the reward by
1/max(n+1, len), so the policy gradient first teaches "emit the prompt symbol" (attention to one
prompt token) and "stop", which alone reaches about 0.57 with a fixed response length of 5;
counting to n then lifts it towards 1.

The target length n is drawn from a `LengthDistribution`: 'lognormal' makes a trained policy's
response lengths long-tailed, as the fusion benchmarks need.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Sequence, Union

import numpy as np
import tokenizers
from tokenizers import models, pre_tokenizers

from rlhfuse_jax.data.lengths import LengthDistribution
from rlhfuse_jax.data.rewards import target_match
from rlhfuse_jax.data.tokenizer import HFTokenizer

PAD, BOS, EOS, SEP = "<pad>", "<bos>", "<eos>", "="


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What a synthetic task generates.

  Attributes:
    name: a key of TASKS.
    num_symbols: content symbols '0', '1', ... (2..10).
    length_dist: how the target length n is drawn: 'uniform' or 'lognormal' (long tail).
    length_min: smallest n.
    length_max: largest n (the task's vocabulary holds count tokens '#1'..'#length_max').
    length_mu: log-normal location (log of the median n).
    length_sigma: log-normal scale.
  """
  name: str = "repeat"
  num_symbols: int = 10
  length_dist: str = "uniform"
  length_min: int = 1
  length_max: int = 8
  length_mu: float = 1.5
  length_sigma: float = 0.8

  def __post_init__(self):
    if self.name not in TASKS:
      raise ValueError(f"unknown task {self.name!r}; known: {sorted(TASKS)}")
    if not 2 <= self.num_symbols <= 10:
      raise ValueError(f"num_symbols={self.num_symbols}: expected 2..10")
    _ = self.lengths  # validates the length fields

  @property
  def lengths(self) -> LengthDistribution:
    return LengthDistribution(kind=self.length_dist, min_len=self.length_min,
                              max_len=self.length_max, mu=self.length_mu,
                              sigma=self.length_sigma)


def build_task_tokenizer(num_symbols: int, max_count: int) -> HFTokenizer:
  """Word-level vocabulary: <pad> <bos> <eos> = 0..k-1 #1..#max_count, split on whitespace."""
  words = [PAD, BOS, EOS, SEP] + [str(s) for s in range(num_symbols)]
  words += [f"#{c}" for c in range(1, max_count + 1)]
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([PAD, BOS, EOS])  # so that decode can drop them
  return HFTokenizer(tok, pad_id=0, bos_id=1, eos_id=2, add_bos=True,
                     name=f"task vocabulary ({num_symbols} symbols, counts to {max_count})")


class Task(abc.ABC):
  """A prompt generator with a verifier; see the module docstring."""

  def __init__(self, config: TaskConfig):
    self.config = config
    self.lengths = config.lengths
    self.tokenizer = build_task_tokenizer(config.num_symbols, config.length_max)

  @property
  def name(self) -> str:
    return self.config.name

  @abc.abstractmethod
  def _make_one(self, n: int, rng: np.random.Generator) -> dict[str, Any]:
    """One record with 'prompt', 'target' and the task's fields, for target length n."""

  @property
  @abc.abstractmethod
  def max_prompt_len(self) -> int:
    """Longest prompt in tokens, BOS included."""

  @property
  def max_response_len(self) -> int:
    """Longest correct response in tokens, EOS included (max_new_tokens must reach it)."""
    return self.config.length_max + 1

  def make_prompts(self, num: int, rng: Union[np.random.Generator, int]) -> list[dict[str, Any]]:
    """`num` records {'prompt', 'target', ...}; deterministic given `rng` (or a seed)."""
    rng = np.random.default_rng(rng) if isinstance(rng, (int, np.integer)) else rng
    return [self._make_one(int(n), rng) for n in self.lengths.sample(rng, num)]

  def target_ids(self, record: Mapping[str, Any]) -> list[int]:
    """The correct response ids, EOS included."""
    return self.tokenizer.encode(record["target"], add_bos=False) + [self.tokenizer.eos_id]

  def reward(self, record: Mapping[str, Any], response: Union[str, Sequence[int]]) -> float:
    """Partial-credit score in [0, 1] of one response.

    `response` is either generated ids (read up to and including the first EOS) or text, taken
    as a finished answer (EOS appended). Written as a plain loop: the reference that
    `batch_rewards` is tested against.
    """
    if isinstance(response, str):
      ids = self.tokenizer.encode(response, add_bos=False) + [self.tokenizer.eos_id]
    else:
      ids = [int(i) for i in response]
      if self.tokenizer.eos_id in ids:
        ids = ids[:ids.index(self.tokenizer.eos_id) + 1]
    target = self.target_ids(record)
    hits = sum(int(a == b) for a, b in zip(ids, target))
    return hits / max(len(ids), len(target))

  def batch_rewards(self, records: Sequence[Mapping[str, Any]], response_ids: np.ndarray,
                    response_lengths: np.ndarray, tokenizer: Any = None) -> np.ndarray:
    """`reward` over a batch.  response_ids [B, T], response_lengths [B] -> [B] float32.
    `tokenizer`: the one that produced the ids when it is not the task's own (a run with
    init.tokenizer); the targets are tokenised with it too."""
    return target_match(records, response_ids, response_lengths, tokenizer or self.tokenizer)


def _symbol(s: int) -> str:
  return str(int(s))


class RepeatTask(Task):
  """'d #n =' -> d repeated n times."""

  @property
  def max_prompt_len(self) -> int:
    return 4  # <bos> d #n =

  def _make_one(self, n, rng):
    d = int(rng.integers(self.config.num_symbols))
    return {"prompt": f"{d} #{n} {SEP}", "target": " ".join([_symbol(d)] * n), "symbol": d,
            "count": n}


class CountUpTask(Task):
  """'d #n =' -> d, d+1, ... (n symbols, modulo num_symbols)."""

  @property
  def max_prompt_len(self) -> int:
    return 4

  def _make_one(self, n, rng):
    k = self.config.num_symbols
    d = int(rng.integers(k))
    target = " ".join(_symbol((d + i) % k) for i in range(n))
    return {"prompt": f"{d} #{n} {SEP}", "target": target, "symbol": d, "count": n}


class CountdownTask(Task):
  """'#n =' -> #n #n-1 ... #1: every step is decided by the previous token alone.

  Meant for length_dist='lognormal': the response is as long as the drawn n, and after copying
  #n a policy only needs local transitions (#k -> #k-1, #1 -> EOS) that all lengths share, so
  a rare long n reuses what the common short ones taught. 'repeat' must instead count the tokens
  it has emitted, which small policies learn slowly for rare n (a short REINFORCE run on
  'repeat' collapsed to one length; see the data report).
  """

  @property
  def max_prompt_len(self) -> int:
    return 3  # <bos> #n =

  def _make_one(self, n, rng):
    return {"prompt": f"#{n} {SEP}", "target": " ".join(f"#{c}" for c in range(n, 0, -1)),
            "count": n}


class SortTask(Task):
  """'x1 ... xn =' -> the n symbols in ascending order."""

  @property
  def max_prompt_len(self) -> int:
    return self.config.length_max + 2  # <bos> x1..xn =

  def _make_one(self, n, rng):
    xs = rng.integers(self.config.num_symbols, size=n)
    return {"prompt": " ".join(map(_symbol, xs)) + f" {SEP}",
            "target": " ".join(map(_symbol, np.sort(xs))), "count": n}


TASKS: dict[str, type[Task]] = {
    "repeat": RepeatTask,
    "count_up": CountUpTask,
    "countdown": CountdownTask,
    "sort": SortTask,
}


def make_task(config: Union[TaskConfig, str] = "repeat", **overrides: Any) -> Task:
  """A task from a TaskConfig or a name plus TaskConfig fields; unknown names list the known."""
  if isinstance(config, str):
    if config not in TASKS:
      raise ValueError(f"unknown task {config!r}; known: {sorted(TASKS)}")
    config = TaskConfig(name=config, **overrides)
  elif overrides:
    config = dataclasses.replace(config, **overrides)
  return TASKS[config.name](config)
