"""The inference stage of PPO (docs/architecture.md §1, step 2): scores for generated samples.

For each prompt+response (laid out by models/sequences.build_sequences):

  reference log-probs [B, T]  log-prob of each response token under the frozen reference actor
  critic values       [B, T]  value of the state before each response token
  reward              [B]     a reward model's scalar at its score position (sequences.
                              score_positions: the last token that is not the model's
                              score_pad_id, else the last response token), or a Python reward
                              function's output

`Scorer` runs the forward passes jitted, with the batch split over the mesh's data axes, and
optionally in micro-batches of a fixed size (the last one padded, so each shape compiles once):
the inter-stage fusion streams finished samples through it in small groups. Each micro-batch is
dispatched before any result is read, so JAX runs them back to back without host round trips.

`Rewards` is the one reward resolver: a reward model, or any callable `(records,
response_tokens [B, T], response_lens [B]) -> [B]` (data/rewards.py registers such functions by
name; the trainer resolves config.reward), plus weighted function terms (`RewardTerm`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlhfuse_jax.models import llama
from rlhfuse_jax.models import sequences
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib

RewardFn = Callable[[Sequence[Mapping[str, Any]], np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class ScoringBatch:
  """Generated samples as the inference stage sees them (host numpy)."""
  tokens: np.ndarray  # [B, P+T] int32 prompt, response, padding (build_sequences)
  prompt_lens: np.ndarray  # [B] int32
  response_tokens: np.ndarray  # [B, T] int32
  response_lens: np.ndarray  # [B] int32

  def __post_init__(self):
    """Shapes and lengths that index inside the rows: a prompt length of 0 read position -1
    (the row's last column) and gave finite scores of the wrong tokens; lengths past the row
    read beyond it and gave NaN."""
    tok, resp = np.asarray(self.tokens), np.asarray(self.response_tokens)
    plen, rlen = np.asarray(self.prompt_lens), np.asarray(self.response_lens)
    if tok.ndim != 2 or resp.ndim != 2 or resp.shape[0] != tok.shape[0]:
      raise ValueError(f"ScoringBatch: tokens {tok.shape} and response_tokens {resp.shape} must "
                       "be [B, P+T] and [B, T]")
    b, width, t = tok.shape[0], tok.shape[1], resp.shape[1]
    if plen.shape != (b,) or rlen.shape != (b,):
      raise ValueError(f"ScoringBatch: prompt_lens {plen.shape} and response_lens {rlen.shape} "
                       f"must be [{b}]")
    if b and (plen.min() < 1 or plen.max() > width - t):
      raise ValueError(f"ScoringBatch: prompt_lens must be in [1, {width - t}] (tokens width "
                       f"{width} - {t} response positions); got {plen.min()}..{plen.max()}")
    if b and (rlen.min() < 0 or rlen.max() > t):
      raise ValueError(f"ScoringBatch: response_lens must be in [0, {t}]; got "
                       f"{rlen.min()}..{rlen.max()}")

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def num_response(self) -> int:
    return self.response_tokens.shape[1]

  @classmethod
  def from_rollout(cls, rollout: Any, pad_id: int) -> "ScoringBatch":
    """From anything with prompt_tokens, prompt_lens, response_tokens, response_lens (Rollout)."""
    tokens = _build_sequences(rollout.prompt_tokens, rollout.prompt_lens,
                              rollout.response_tokens, rollout.response_lens, pad_id=pad_id)
    return cls(tokens=np.asarray(tokens), prompt_lens=np.asarray(rollout.prompt_lens, np.int32),
               response_tokens=np.asarray(rollout.response_tokens, np.int32),
               response_lens=np.asarray(rollout.response_lens, np.int32))

  def take(self, rows) -> "ScoringBatch":
    """The samples at `rows` (e.g. the ones that just finished)."""
    rows = np.asarray(rows)
    return ScoringBatch(self.tokens[rows], self.prompt_lens[rows], self.response_tokens[rows],
                        self.response_lens[rows])


# build_sequences as one program: run op by op it was 11 tiny programs, each traced, lowered and
# loaded from the compilation cache on every launch. Integer ops only: the same tokens.
_build_sequences = jax.jit(sequences.build_sequences, static_argnames=("pad_id",))


# Jitted forward passes. cfg, T, temperature and the mesh are static (one executable per model
# shape and placement); params keep the shardings the caller gave them. With the `mesh` the
# batch is split over, every activation stays split over its batch axes
# (llama.shard_activations): on a data x fsdp mesh GSPMD would otherwise answer the
# fsdp-sharded weights by replicating activations over fsdp, repeating part of the forward on
# every device (plan_check on ppo_llama:13b's training mesh: 1.36x the FLOPs, 45 GB of
# temporaries per device).
# Static by name only: given both static_argnums and static_argnames, jit does not map one to
# the other, so a keyword call would trace a static value.
@functools.partial(jax.jit, static_argnames=("cfg", "num_response", "temperature", "mesh"))
def response_logprobs(cfg: ModelConfig, params, tokens, prompt_lens, num_response: int,
                      temperature: float = 1.0, *, mesh: Optional[Mesh] = None):
  """[B, T] float32 log-probs of the response tokens under `params` (LM head)."""
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES, forward_only=True):
    return sequences.response_logprobs(cfg, params, tokens, prompt_lens, num_response,
                                       temperature)


@functools.partial(jax.jit, static_argnames=("cfg", "num_response", "mesh"))
def critic_values(cfg: ModelConfig, params, tokens, prompt_lens, num_response: int, *,
                  mesh: Optional[Mesh] = None):
  """[B, T] float32 critic values at positions prompt_len-1+t (scalar head)."""
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES, forward_only=True):
    return sequences.response_values(cfg, params, tokens, prompt_lens, num_response)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def reward_model_scores(cfg: ModelConfig, params, tokens, prompt_lens, response_lens, *,
                        mesh: Optional[Mesh] = None):
  """[B] float32 reward-model scalar at sequences.score_positions (scalar head)."""
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES, forward_only=True):
    return sequences.sequence_scores(cfg, params, tokens, prompt_lens, response_lens)


class Scorer:
  """Runs the inference forward passes on a mesh, whole-batch or in micro-batches."""

  def __init__(self, mesh: Optional[Mesh] = None, micro_batch_size: int = 0):
    self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(
        mesh_lib.MeshConfig(data=1), jax.devices()[:1])
    self._multiple = mesh_lib.batch_size_multiple(self.mesh)
    if micro_batch_size < 0 or micro_batch_size % self._multiple:
      raise ValueError(f"inference micro_batch_size={micro_batch_size} must be 0 (whole batch) or "
                       f"a positive multiple of the data-parallel mesh size {self._multiple}")
    self.micro_batch_size = micro_batch_size

  def _pieces(self, batch: ScoringBatch):
    """Yields (row slice, padded host arrays) of fixed-size pieces covering the batch."""
    b = batch.batch_size
    if b == 0:  # (the pieces would be none: range() of step 0, or nothing to concatenate)
      raise ValueError("Scorer: the batch to score has no rows; expected at least one sequence")
    m = self.piece_rows(b)
    for start in range(0, b, m):
      rows = np.arange(start, start + m)
      rows = np.minimum(rows, b - 1)  # pad with copies of the last row; their results are dropped
      yield slice(start, min(start + m, b)), batch.take(rows)

  def piece_rows(self, batch_size: int) -> int:
    """Rows of each piece a batch of `batch_size` rows is scored in (the last one padded)."""
    return self.micro_batch_size or -(-batch_size // self._multiple) * self._multiple

  def _run(self, fn: Callable, batch: ScoringBatch) -> np.ndarray:
    """fn(tokens, prompt_lens, response_lens) on every piece; results concatenated on the host."""
    outs = []
    for sl, piece in self._pieces(batch):
      args = [mesh_lib.put(x, mesh_lib.batch_sharding(self.mesh, x.ndim))
              for x in (piece.tokens, piece.prompt_lens, piece.response_lens)]
      outs.append((sl, fn(*args)))  # dispatched asynchronously; read all at once below
    results = mesh_lib.to_host([o for _, o in outs])
    return np.concatenate([r[:sl.stop - sl.start] for (sl, _), r in zip(outs, results)], axis=0)

  def logprobs(self, cfg: ModelConfig, params, batch: ScoringBatch,
               temperature: float = 1.0) -> np.ndarray:
    """Log-probs [B, T] of the response tokens under `params`: the reference's, or in
    asynchronous PPO the current actor's (the proximal policy); temperature must match the
    actor's (logprob_temperature)."""
    _check_head(cfg, "lm", "model scored for log-probs")
    t, temp = batch.num_response, float(temperature)
    return self._run(lambda x, p, _: response_logprobs(cfg, params, x, p, t, temp,
                                                       mesh=self.mesh), batch)

  def _piece_structs(self, batch_size: int, seq_len: int) -> tuple:
    """(tokens, prompt_lens) of one piece of a batch of `batch_size` rows of `seq_len` tokens,
    as jax.ShapeDtypeStructs placed as _run places the piece."""
    rows = self.piece_rows(batch_size)
    return tuple(jax.ShapeDtypeStruct(shape, np.int32,
                                      sharding=mesh_lib.batch_sharding(self.mesh, len(shape)))
                 for shape in ((rows, seq_len), (rows,)))

  def lower_logprobs(self, cfg: ModelConfig, params, batch_size: int, seq_len: int,
                     num_response: int, temperature: float = 1.0):
    """The program `logprobs` runs on each piece of a batch of `batch_size` rows of
    `seq_len` tokens, lowered for `params` given as placed jax.ShapeDtypeStructs (or arrays):
    experiments/plan_programs.py compiles the trainer's actor log-prob pass from it."""
    _check_head(cfg, "lm", "model scored for log-probs")
    tokens, lens = self._piece_structs(batch_size, seq_len)
    return response_logprobs.lower(cfg, params, tokens, lens, num_response, float(temperature),
                                   mesh=self.mesh)

  def values(self, cfg: ModelConfig, params, batch: ScoringBatch) -> np.ndarray:
    """Critic values [B, T]."""
    _check_head(cfg, "scalar", "critic")
    t = batch.num_response
    return self._run(lambda x, p, _: critic_values(cfg, params, x, p, t, mesh=self.mesh), batch)

  def lower_values(self, cfg: ModelConfig, params, batch_size: int, seq_len: int,
                   num_response: int):
    """The program `values` runs on each piece of a batch of `batch_size` rows of `seq_len`
    tokens, lowered for `params` given as placed jax.ShapeDtypeStructs (or arrays):
    experiments/plan_programs.py compiles asynchronous PPO's value pass on the training devices
    (trainer/loop.PPOTrainer._current_values) from it."""
    _check_head(cfg, "scalar", "critic")
    tokens, lens = self._piece_structs(batch_size, seq_len)
    return critic_values.lower(cfg, params, tokens, lens, num_response, mesh=self.mesh)

  def reward_scores(self, cfg: ModelConfig, params, batch: ScoringBatch) -> np.ndarray:
    """Reward-model scores [B]."""
    _check_head(cfg, "scalar", "reward model")
    return self._run(lambda x, p, r: reward_model_scores(cfg, params, x, p, r, mesh=self.mesh),
                     batch)


def _check_head(cfg: ModelConfig, head: str, role: str) -> None:
  if cfg.head != head:
    raise ValueError(f"the {role} needs model.head={head!r}, got {cfg.head!r}")


@dataclasses.dataclass(frozen=True)
class RewardTerm:
  """A weighted function term added to a run's reward (config.reward.format): `label` names it
  in the metrics (reward/<label>_mean), `name` (the config value) in errors. As one of
  Rewards' `stats` (config.reward.stats) it is only measured: stats/<label>_mean, weight unused."""
  label: str
  fn: RewardFn
  name: str = ""
  weight: float = 1.0


class Rewards:
  """The one reward resolver of a run: sequence rewards [B] from a Python function of the
  responses or from a scalar-head reward model (read at sequences.score_positions), plus any
  weighted function terms (`extra`: a format reward, a length penalty).

  `fn(records, response_tokens [B, T], response_lens [B]) -> [B]`; `name` (the config field's
  value) appears in errors. The reward is source + sum of weight * term, summed in float32 in
  that order. With more than one term, `scored` also returns each term's unweighted batch mean
  as reward/<label>_mean (labels: "function" or "model", then the extra terms' own); `stats`,
  per-sample functions that are not rewards, add stats/<label>_mean and nothing else. The serial
  rollout calls it whole; the fused one (trainer/rollout.py) scores with the model on freed
  instances and adds the function terms with `combine`.

  `model_norm`: (mean, std) that the reward model's scores are normalised by, (score - mean) /
  std in float64, before any term is added (OpenRLHF's normalize_reward: the statistics its
  reward-model trainer writes into config.json, trainer/build.reward_normalization); None: the
  raw scores.
  """

  def __init__(self, *, fn: Optional[RewardFn] = None, name: str = "",
               model_cfg: Optional[ModelConfig] = None, model_params: Any = None,
               scorer: Optional[Scorer] = None, extra: Sequence[RewardTerm] = (),
               stats: Sequence[RewardTerm] = (),
               model_norm: Optional[tuple[float, float]] = None):
    if (fn is None) == (model_cfg is None):
      raise ValueError("Rewards needs exactly one source: a reward function (fn) or a reward "
                       f"model (model_cfg); got fn={fn!r}, model_cfg={model_cfg!r}")
    if model_cfg is not None:
      _check_head(model_cfg, "scalar", "reward model")
    elif not callable(fn):
      raise ValueError(f"reward function {name!r}: needs a callable, got {fn!r}")
    labels = [t.label for t in extra]
    if len(set(labels)) != len(labels) or {"function", "model"} & set(labels):
      raise ValueError(f"reward terms need distinct labels other than 'function' and 'model'; "
                       f"got {labels}")
    stat_labels = [t.label for t in stats]
    if len(set(stat_labels)) != len(stat_labels):
      raise ValueError(f"reward stats need distinct labels; got {stat_labels}")
    for t in (*extra, *stats):
      if not callable(t.fn):
        raise ValueError(f"reward function {t.name!r}: needs a callable, got {t.fn!r}")
    if model_norm is not None:
      if model_cfg is None:
        raise ValueError(f"Rewards: model_norm={model_norm!r} normalises a reward model's "
                         "scores; the reward here is a function's")
      mean, std = model_norm
      if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
        raise ValueError(f"Rewards: model_norm={model_norm!r}; expected (mean, std) finite, "
                         "std > 0")
      model_norm = (float(mean), float(std))
    self.fn, self.name, self.extra, self.stats = fn, name, tuple(extra), tuple(stats)
    self.model_norm = model_norm
    self.model_cfg, self.model_params = model_cfg, model_params
    self.scorer = scorer or Scorer()

  @property
  def from_model(self) -> bool:
    return self.model_cfg is not None

  def without_model_params(self) -> "Rewards":
    """The same resolver without the reward model's weights (a caller that moved them)."""
    if not self.from_model:
      return self
    return self.with_model_params(None, self.scorer)

  def with_model_params(self, params: Any, scorer: Scorer) -> "Rewards":
    """The same resolver with the reward model's weights `params` scored by `scorer` (a stage
    that placed them on a mesh of its own)."""
    return Rewards(model_cfg=self.model_cfg, model_params=params, name=self.name,
                   scorer=scorer, extra=self.extra, stats=self.stats, model_norm=self.model_norm)

  def _term(self, fn: RewardFn, name: str, records, response_tokens: np.ndarray,
            response_lens: np.ndarray, stat: bool = False) -> np.ndarray:
    """One function's rewards [B] float32, checked: one finite value per sample (`stat`: a
    statistic, named so, which may give NaN, its "no value"). An error the function raises
    names it here unless it already does (data/rewards.RewardFunctionError, which also names
    the sample)."""
    b = response_tokens.shape[0]
    what = "statistic" if stat else "reward function"
    try:
      given = np.asarray(fn(records, response_tokens, response_lens), np.float64)
    except Exception as e:  # noqa: BLE001 re-raised naming the function
      if getattr(e, "names_function", False):
        raise
      raise ValueError(f"{what} {name!r} failed on a batch of {b} samples: "
                       f"{type(e).__name__}: {e}") from e
    if given.shape != (b,):
      raise ValueError(f"{what} {name!r} returned shape {given.shape}; "
                       f"expected ({b},)")
    with np.errstate(over="ignore"):
      out = given.astype(np.float32)
    bad = np.flatnonzero(np.isinf(out) if stat else ~np.isfinite(out))
    if bad.size:
      raise ValueError(f"{what} {name!r} returned a non-finite reward for sample "
                       f"{bad[0]} of the batch of {b} ({bad.size} in all); expected finite "
                       "numbers within float32's range")
    return out

  def combine(self, records: Optional[Sequence[Mapping[str, Any]]], response_tokens: np.ndarray,
              response_lens: np.ndarray,
              model_scores: Optional[np.ndarray] = None) -> tuple[np.ndarray, dict]:
    """(rewards [B] float32, reward/<label>_mean metrics): the source (the function, or the
    reward model's `model_scores`) plus every weighted extra term."""
    return self.combine_terms(records, response_tokens, response_lens, model_scores)[:2]

  def combine_terms(self, records: Optional[Sequence[Mapping[str, Any]]],
                    response_tokens: np.ndarray, response_lens: np.ndarray,
                    model_scores: Optional[np.ndarray] = None
                    ) -> tuple[np.ndarray, dict, dict]:
    """combine's (rewards, metrics) and {label: the term's unweighted values [B] float32} when
    there are several terms ({} for one): the validation pass averages them over its real rows
    (val/function_mean, val/format_mean), where a batch mean would count its filler rows."""
    if self.from_model != (model_scores is not None):
      raise ValueError(f"Rewards.combine: model_scores must be given exactly when the reward is "
                       f"a model's (from_model={self.from_model})")
    if self.from_model and self.model_norm is not None:
      mean, std = self.model_norm
      with np.errstate(over="ignore", invalid="ignore"):
        model_scores = ((np.asarray(model_scores, np.float64) - mean) / std).astype(np.float32)
    parts = [("model", 1.0, np.asarray(model_scores, np.float32)) if self.from_model else
             ("function", 1.0, self._term(self.fn, self.name, records, response_tokens,
                                          response_lens))]
    parts += [(t.label, t.weight, self._term(t.fn, t.name, records, response_tokens,
                                             response_lens)) for t in self.extra]
    total = np.zeros(response_tokens.shape[0], np.float32)
    with np.errstate(over="ignore"):
      for _, weight, values in parts:
        total = total + np.float32(weight) * values
    # Terms finite alone whose sum is not (a reward model's own NaN or inf goes on as before, to
    # the trainer's guard.on_nonfinite).
    overflow = ~np.isfinite(total) & np.all([np.isfinite(v) for _, _, v in parts], axis=0)
    if overflow.any():
      b = int(np.flatnonzero(overflow)[0])
      terms = ", ".join(f"{label} {weight:g} * {values[b]:g}" for label, weight, values in parts)
      raise ValueError(f"the reward of sample {b} of the batch overflows float32: {terms}; "
                       "scale the terms (config.reward.format_weight) into float32's range")
    terms = {label: values for label, _, values in parts} if len(parts) > 1 else {}
    metrics = {f"reward/{label}_mean": float(np.mean(values, dtype=np.float64))
               for label, values in terms.items()}
    for t in self.stats:  # the mean over the samples the statistic has a value for
      values = self._term(t.fn, t.name, records, response_tokens, response_lens, stat=True)
      known = values[~np.isnan(values)].astype(np.float64)
      metrics[f"stats/{t.label}_mean"] = float(known.mean()) if known.size else float("nan")
    return total, metrics, terms

  def scored(self, batch: ScoringBatch, records: Optional[Sequence[Mapping[str, Any]]] = None
             ) -> tuple[np.ndarray, dict]:
    """(rewards [B] float32, per-term metrics) for the batch (records: the B prompt records,
    for functions)."""
    return self.scored_terms(batch, records)[:2]

  def scored_terms(self, batch: ScoringBatch,
                   records: Optional[Sequence[Mapping[str, Any]]] = None
                   ) -> tuple[np.ndarray, dict, dict]:
    """scored's (rewards, metrics) and combine_terms' per-sample terms."""
    scores = None
    if self.from_model:
      if self.model_params is None:
        raise ValueError("this Rewards gave its reward-model weights away "
                         "(without_model_params): score with their new holder")
      scores = self.scorer.reward_scores(self.model_cfg, self.model_params, batch)
    return self.combine_terms(records, batch.response_tokens, batch.response_lens, scores)

  def __call__(self, batch: ScoringBatch,
               records: Optional[Sequence[Mapping[str, Any]]] = None) -> np.ndarray:
    """Rewards [B] float32 for the batch (records: the B prompt records, for functions)."""
    return self.scored(batch, records)[0]
