"""Delayed inter-batch pipelined generation (docs/architecture.md §4).

A pp-stage generation pipeline holds layers s*L/pp .. (s+1)*L/pp - 1 on stage s (one device per
stage on the mesh axis `stage`); stage 0 also embeds, the last stage also runs the head and
samples. Decoding one batch through such a pipeline leaves pp-1 of pp stages idle: a token must
leave the last stage before the next step can enter the first. Here the batch is split into
G >= pp groups of Bg = B/G rows that enter the pipeline one tick apart: at decode tick t stage s
works on job j = t - s, i.e. decode step k = j // G of group g = j % G. The last stage samples
the group's next token and sends it (with the row's next position and whether the group still
has a live row) back to stage 0, where it waits in a per-group inbox; it arrives pp ticks after
the group entered, and the group's next step enters G ticks after the last one, so G >= pp means
stage 0 never waits. After the fill every stage is busy every tick until groups run out of work.

Tick count. Group g needs n_g - 1 decode steps (n_g: its longest response; the first token comes
from prefill). Its step k runs on stage s at tick k*G + g + s, if k < n_g - 1; otherwise that
stage idles for the tick (the round robin keeps the slot: groups never overtake each other). The
pipeline's last useful tick is therefore max_g ((n_g - 2) * G + g) + pp - 1; with equal
n_g = N + 1 for all groups, N*G + pp - 1 ticks: N*G per stage busy, pp - 1 of fill (and the same
drain). Decoding runs in chunks of K*G ticks (K = sampling.chunk_size steps per group) and the
in-flight activations are carried from one chunk to the next, so a chunk boundary costs no
drain; the host stops after the first chunk in which every row finished, so the executed ticks
are that count rounded up to a multiple of K*G (`ticks_formula`, `expected_tick_table`).
Busy fraction = busy stage-ticks / (pp * executed ticks), counted from the tick table the
program itself records (each stage writes the group it ran, or -1, every tick).

Where things live. The KV cache of group g's layers on stage s lives on stage s only: per device
k, v [G * L/pp, Bg, max_len, kv_heads, head_dim], group-major, so group g's layer l is cache
layer g*L/pp + l and the model's own attention writes and reads it in place (no per-group copy).
The rows' decode state (tokens, log-probs, stop state: engine.DecodeState without the cache) is
updated by the last stage, which samples; stage 0 keeps only the per-group inbox of next tokens.

Tokens equal the engine's. Every row is decoded by the same layer code (llama.block_class over a
llama.CacheView, the engine's stop rule `engine._record`, the per-sample keys of sampling.py), so
a sample's tokens depend on its prompt, uid, budget and the iteration key only. Bitwise equality
of the log-probs with `instances.Generator` holds when the per-device rows match: XLA's matmuls
can round differently for another number of rows, so the tests and the benchmark compare with a
Generator whose data-parallel mesh puts Bg rows on each device (`reference_mesh`). A stage runs
its layers as the engine does: scanned for a scan_layers model, unrolled for an unrolled one
(the tests compare both bitwise; the cut between two stages' layers is one XLA could fuse across
in the unrolled engine, which it has not been seen to do). What XLA can see as a constant must
match too, as it changes the compiled code: the prefill's positions (`_Stage.run_layers`) and
the parameters of a stage that holds one layer (`_Stage.layers`: a one-row stack's are
constants, the engine's loop body slices each layer out of L rows). The price of the latter:
such a stage writes a two-row copy of its layer's weights each tick it runs (to slice from),
several times the weight traffic of its decode step; only a pipeline of one layer per stage pays
it (a real model puts many layers on each stage).

Prefill runs through the same pipeline (G + pp - 1 ticks, each group's whole prompt per tick),
so each stage writes its own layers' cache and no stage ever holds another stage's weights.
Embedding and head weights are replicated on every stage (only the first and last use them).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import time
from typing import Any, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation import sampling as sampling_lib
from rlhfuse_jax.generation.engine import DecodeState
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import attention
from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib

STAGE = "stage"
IDLE = -1  # a tick-table entry: the stage ran nothing this tick


PIPELINE_FIELDS = ("config.generation.pipeline_stages", "config.generation.pipeline_groups")


def check_pipeline(cfg: ModelConfig, batch_size: int, stages: int, groups: int,
                   num_devices: int, fields: tuple[str, str] = PIPELINE_FIELDS) -> int:
  """Checks the pipeline's shape before anything compiles; returns the rows per group Bg.
  `fields`: the config fields that set `stages` and `groups`, named in errors."""
  pp, g = fields
  for name, value in ((pp, stages), (g, groups), ("batch_size", batch_size)):
    # An integral float (2.0) is the integer, as in SamplingConfig; anything else failed deep in
    # jax (a float stage count while building the mesh, a float group count at the first call).
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or
        not float(value).is_integer()):
      raise ValueError(f"{name}={value!r}; expected an integer")
  stages, groups, batch_size = int(stages), int(groups), int(batch_size)
  if stages < 1:
    raise ValueError(f"{pp}={stages}; expected >= 1")
  if cfg.num_layers % stages:
    raise ValueError(f"model.num_layers={cfg.num_layers} is not divisible by "
                     f"{pp}={stages} (each stage holds L/pp layers)")
  if groups < stages:
    raise ValueError(f"{g}={groups} < {pp}={stages}: "
                     "with fewer groups than stages a group's next token is not back at stage 0 "
                     "when its turn comes (G >= pp, docs/architecture.md §4)")
  if batch_size < groups or batch_size % groups:
    raise ValueError(f"batch_size={batch_size} is not a positive multiple of "
                     f"{g}={groups}")
  if stages > num_devices:
    raise ValueError(f"{pp}={stages} needs {stages} devices, but only "
                     f"{num_devices} are available")
  return batch_size // groups


def ticks_formula(steps: Sequence[int], stages: int, chunk_ticks: int) -> dict:
  """The tick counts of the schedule (module docstring) for groups needing `steps[g]` decode
  steps each: pipeline ticks (up to the last useful one), executed ticks (whole chunks), busy
  stage-ticks, and the steady-state window (every stage busy when all groups run alike)."""
  g = len(steps)
  live = [i for i in range(g) if steps[i] > 0]
  pipeline = (max((steps[i] - 1) * g + i for i in live) + stages) if live else 0
  executed = -(-pipeline // chunk_ticks) * chunk_ticks
  return {"pipeline_ticks": pipeline, "executed_ticks": executed,
          "busy_stage_ticks": stages * int(sum(steps)), "fill_ticks": stages - 1,
          "chunk_ticks": chunk_ticks}


def expected_tick_table(steps: Sequence[int], stages: int, ticks: int) -> np.ndarray:
  """[ticks, stages] group each stage runs at each decode tick (IDLE: none), by the formula."""
  g = len(steps)
  out = np.full((ticks, stages), IDLE, np.int32)
  for t in range(ticks):
    for s in range(stages):
      j = t - s
      if j >= 0 and j // g < steps[j % g]:
        out[t, s] = j % g
  return out


def busy_stats(table: np.ndarray) -> dict:
  """Busy fractions of an executed tick table [ticks, stages] (entries: group or IDLE)."""
  ticks, stages = table.shape
  busy = table != IDLE
  per_stage = busy.mean(axis=0) if ticks else np.zeros(stages)
  # Steady state: from the tick the last stage first works to the last tick the first stage
  # works (fill and drain excluded).
  rows = np.nonzero(busy.any(axis=1))[0]
  first = np.nonzero(busy[:, -1])[0]
  last = np.nonzero(busy[:, 0])[0]
  steady = (busy[first[0]:last[-1] + 1].mean() if len(first) and len(last) and
            last[-1] >= first[0] else 0.0)
  return {"ticks": int(ticks), "busy_stage_ticks": int(busy.sum()),
          "stage_busy_frac": float(busy.mean()) if ticks else 0.0,
          "stage_busy_frac_per_stage": [float(x) for x in per_stage],
          "stage_busy_frac_steady": float(steady),
          "active_ticks": int(len(rows))}


@flax.struct.dataclass
class PipeState:
  """The pipeline between decode chunks; every leaf has a leading [stages] axis split over
  `stage` (row s = what device s holds).

  rows: the rows' engine.DecodeState (cache None) with leaves [pp, G, Bg, ...]; authoritative on
    the last stage (it samples), the other stages' copies are unused.
  k, v: [pp, G*L/pp, Bg, max_len, kv_heads, head_dim] KV cache bits (llama.KVCache), group-major
    (module docstring).
  inbox_token, inbox_position: [pp, G, Bg] int32, inbox_live: [pp, G] bool: on stage 0, each
    group's next input token, its position, and whether the group has a live row.
  msg_x: [pp, Bg, 1, H] activation, msg_position: [pp, Bg], msg_group: [pp] (IDLE: none): the
    message each stage received at the end of the last tick, input of the next.
  tick: [pp] int32 the next decode tick (the same on every stage).
  """
  rows: DecodeState
  k: jax.Array
  v: jax.Array
  inbox_token: jax.Array
  inbox_position: jax.Array
  inbox_live: jax.Array
  msg_x: jax.Array
  msg_position: jax.Array
  msg_group: jax.Array
  tick: jax.Array


def _take(tree, i):
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _put(tree, i, value):
  return jax.tree.map(lambda x, y: lax.dynamic_update_index_in_dim(x, y, i, 0), tree, value)


class _Stage:
  """One device's part of the pipeline (inside the shard_map): its layers, the embedding on
  stage 0 and the head + sampler on the last stage."""

  def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, stages: int, groups: int,
               params: dict, key: jax.Array):
    self.cfg, self.sampling, self.pp, self.g = cfg, sampling, stages, groups
    self.per_stage = cfg.num_layers // stages
    self.params, self.key = params, key
    self.s = lax.axis_index(STAGE)
    self.first, self.last = self.s == 0, self.s == stages - 1
    self.cache_dtype = jnp.dtype(cfg.jnp_dtype).name

  def embed(self, tokens):  # [Bg, len] -> [Bg, len, H]
    return llama.Transformer(self.cfg).apply({"params": {"embed": self.params["embed"]}}, tokens,
                                             method=lambda m, t: m.embed(t))

  def head(self, x):  # [Bg, n, H] -> float32 logits [Bg, n, V]
    p = {"embed": self.params["embed"], "head": self.params["head"]}
    return llama.Transformer(self.cfg).apply({"params": p}, x,
                                             method=lambda m, h: m.head(h, m.embed))

  def layers(self, x, positions, k, v, group):
    """This stage's layers on group `group`'s rows: x [Bg, len, H] at positions [Bg, len],
    reading and writing the group's layers of the stage cache in place (the engine's own
    attention, llama.CacheView). Returns (x, k, v)."""
    cfg = self.cfg
    view = llama.CacheView(k=k, v=v, dtype=self.cache_dtype, layer=group * self.per_stage,
                           live_len=jnp.max(positions).astype(jnp.int32) + 1)

    def body(carry, p):
      h, vw = carry
      h, vw = llama.block_class(cfg)(cfg).apply({"params": p}, h, positions, vw)
      return (h, vw.replace(layer=vw.layer + 1)), None

    layers = self.params["layers"]
    if cfg.scan_layers and self.per_stage == 1 < cfg.num_layers:
      # One layer on this stage: scanned from its one-row stack, its parameters are constants
      # to XLA, which then compiles the layer otherwise than the engine's loop body slicing
      # each layer out of L rows (log-probs off in the last bits: with qk_norm about half of
      # them). Run as that body: sliced out of two rows (the layer twice: a temporary copy) by
      # the index of a loop whose one trip XLA cannot see.
      two = jax.tree.map(lambda a: jnp.concatenate([a, a]), layers)
      trips = lax.optimization_barrier(jnp.int32(1))

      def step(carry):
        i, h, vw = carry
        p = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), two)
        (h, vw), _ = body((h, vw), p)
        return i + 1, h, vw
      _, x, view = lax.while_loop(lambda c: c[0] < trips, step, (jnp.int32(0), x, view))
    elif cfg.scan_layers:
      (x, view), _ = lax.scan(body, (x, view), layers)
    else:
      # The engine's unrolled layers, unrolled here too: XLA fuses across an unrolled layer
      # boundary, and a scan would round a few log-probs differently (7e-7: the default-codegen
      # test of tests/test_pipelined_generation.py, two layers a stage).
      for i in range(self.per_stage):
        (x, view), _ = body((x, view), jax.tree.map(lambda a, i=i: a[i], layers))
    return x, view.k, view.v

  def run_layers(self, active, x, positions, k, v, group):
    """`layers` when active, else nothing (an idle stage-tick costs no compute). positions None:
    a prefill's, 0 .. len-1 on every row, built inside the branch, where XLA sees them as the
    constants the engine's prefill has: its attention's key-block loop then has the engine's
    known trip count. (Passed in as an operand of the cond they were opaque there: with a cache
    longer than one key block, attention.CACHE_BLOCK_K, 40-60 % of the log-probs then differed
    from the engine's in their last bits, the prefill's included.)"""
    if positions is None:
      def prefill(a):
        x, k, v = a
        pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        return self.layers(x, pos, k, v, group)
      return lax.cond(active, prefill, lambda a: a, (x, k, v))
    return lax.cond(active, lambda a: self.layers(*a, group), lambda a: (a[0], a[2], a[3]),
                    (x, positions, k, v))

  def exchange(self, x, position, group, token, live):
    """End of a tick: activations stage s -> s+1, the sampled token (with its position and the
    group's liveness) last stage -> stage 0. Returns what this stage received."""
    pp = self.pp
    if pp > 1:
      fwd = [(s, s + 1) for s in range(pp - 1)]
      x_in, pos_in, grp_in = lax.ppermute((x, position, group), STAGE, fwd)
    else:
      x_in, pos_in, grp_in = x, position, group
    ret = [(pp - 1, 0)]
    tok_r, pos_r, grp_r, live_r = lax.ppermute((token, position, group, live), STAGE, ret)
    # Stage 0 receives only returns; a non-first stage only activations (ppermute gives zeros
    # to a device that is no target, so group 0 would look valid: mask by role).
    grp_in = jnp.where(self.first, IDLE, grp_in) if pp > 1 else jnp.full_like(group, IDLE)
    grp_r = jnp.where(self.first, grp_r, IDLE)
    return (x_in, pos_in, grp_in), (tok_r, pos_r, grp_r, live_r)

  @staticmethod
  def file(inbox, ret):
    """Stage 0 files a returned token into the group's inbox (a no-op for IDLE)."""
    tok, pos, grp, live = ret
    tokens, positions, lives = inbox
    ok = grp >= 0
    gi = jnp.maximum(grp, 0)
    tokens = jnp.where(ok, lax.dynamic_update_index_in_dim(tokens, tok, gi, 0), tokens)
    positions = jnp.where(ok, lax.dynamic_update_index_in_dim(positions, pos, gi, 0), positions)
    lives = jnp.where(ok, lives.at[gi].set(live), lives)
    return tokens, positions, lives


def _prefill_body(cfg: ModelConfig, sampling: SamplingConfig, stages: int, groups: int,
                  max_len: int, params, tokens, lens, uids, budget, key):
  """Per device: G + pp - 1 ticks; tick t runs group t - s's whole prompt on stage s."""
  st = _Stage(cfg, sampling, stages, groups, _local_params(params), key)
  g, pp, lp = groups, stages, st.per_stage
  bg, p_len = tokens.shape[1:]
  t_max = sampling.max_new_tokens
  shape = (g * lp, bg, max_len, cfg.num_kv_heads, cfg.head_dim_)
  bits = llama.cache_bits_dtype(cfg.jnp_dtype)
  zeros = jnp.zeros((g, bg), jnp.int32)
  rows = DecodeState(
      cache=None, last_token=zeros, position=zeros, prompt_len=lens.astype(jnp.int32),
      num_generated=zeros, done=jnp.zeros((g, bg), bool), stop_reason=zeros,
      uid=uids.astype(jnp.int32), budget=jnp.minimum(budget.astype(jnp.int32), t_max),
      tokens=jnp.full((g, bg, t_max), sampling.pad_id, jnp.int32),
      logprobs=jnp.zeros((g, bg, t_max), jnp.float32))
  inbox = (zeros, zeros, jnp.zeros((g,), bool))
  x0 = jnp.zeros((bg, p_len, cfg.hidden_size), cfg.jnp_dtype)
  ticks = g + pp - 1

  def tick(t, carry):
    k, v, rows, inbox, msg, rec = carry
    grp = t - st.s
    active = (grp >= 0) & (grp < g)
    gi = jnp.clip(grp, 0, g - 1)
    x_in = jnp.where(st.first, st.embed(tokens[gi]), msg)
    x, k, v = st.run_layers(active, x_in, None, k, v, gi)  # positions 0 .. P-1 (run_layers)

    def sample(rows):
      r = _take(rows, gi)
      at = (r.prompt_len - 1)[:, None, None]  # [Bg, 1, 1]
      logits = st.head(jnp.take_along_axis(x, at, axis=1))  # [Bg, 1, V] as engine.prefill
      keys = sampling_lib.sample_keys(key, r.uid, jnp.zeros_like(r.uid))
      token, logprob = sampling_lib.sample_token(logits[:, 0], keys, sampling)
      r = engine._record(r.replace(last_token=token, position=r.prompt_len), token, logprob,
                         sampling)
      return _put(rows, gi, r)

    rows = lax.cond(active & st.last, sample, lambda r: r, rows)
    r = _take(rows, gi)
    (x_in, _, _), ret = st.exchange(x, r.position, jnp.where(active, grp, IDLE), r.last_token,
                                    ~jnp.all(r.done))
    inbox = st.file(inbox, ret)
    rec = rec.at[t].set(jnp.where(active, grp, IDLE))
    return k, v, rows, inbox, x_in, rec

  carry = (jnp.zeros(shape, bits), jnp.zeros(shape, bits), rows, inbox, x0,
           jnp.full((ticks,), IDLE, jnp.int32))
  k, v, rows, inbox, _, rec = lax.fori_loop(0, ticks, tick, carry)
  state = PipeState(
      rows=rows, k=k, v=v, inbox_token=inbox[0], inbox_position=inbox[1], inbox_live=inbox[2],
      msg_x=jnp.zeros((bg, 1, cfg.hidden_size), cfg.jnp_dtype),
      msg_position=jnp.zeros((bg,), jnp.int32), msg_group=jnp.int32(IDLE), tick=jnp.int32(0))
  return _lead(state), rec[None]


def _decode_body(cfg: ModelConfig, sampling: SamplingConfig, stages: int, groups: int,
                 params, state: PipeState, key):
  """Per device: K*G decode ticks (module docstring); returns (state, tick record [1, K*G])."""
  st = _Stage(cfg, sampling, stages, groups, _local_params(params), key)
  g = groups
  state = jax.tree.map(lambda x: x[0], state)
  ticks = sampling.chunk_size * g

  def tick(t, carry):
    s, rec = carry
    # Stage 0 takes the group whose turn it is, if it has a live row; the others what came in.
    g0 = s.tick % g
    grp = jnp.where(st.first, jnp.where(s.inbox_live[g0], g0, IDLE), s.msg_group)
    active = grp >= 0
    gi = jnp.maximum(grp, 0)
    position = jnp.where(st.first, s.inbox_position[gi], s.msg_position)  # [Bg]
    x_in = jnp.where(st.first, st.embed(s.inbox_token[gi][:, None]), s.msg_x)  # [Bg, 1, H]
    x, k, v = st.run_layers(active, x_in, position[:, None], s.k, s.v, gi)

    def sample(rows):  # engine.decode_step on the group's rows
      r = _take(rows, gi)
      logits = st.head(x)  # [Bg, 1, V]
      keys = sampling_lib.sample_keys(key, r.uid, r.num_generated)
      token, logprob = sampling_lib.sample_token(logits[:, 0], keys, sampling)
      r = r.replace(position=jnp.where(~r.done, r.position + 1, r.position))
      return _put(rows, gi, engine._record(r, token, logprob, sampling))

    rows = lax.cond(active & st.last, sample, lambda r: r, s.rows)
    r = _take(rows, gi)
    out_pos = jnp.where(st.last, r.position, position)
    (x_in, pos_in, grp_in), ret = st.exchange(x, out_pos, jnp.where(active, grp, IDLE),
                                              r.last_token, ~jnp.all(r.done))
    tok_box, pos_box, live_box = st.file((s.inbox_token, s.inbox_position, s.inbox_live), ret)
    s = s.replace(rows=rows, k=k, v=v, inbox_token=tok_box, inbox_position=pos_box,
                  inbox_live=live_box, msg_x=x_in, msg_position=pos_in, msg_group=grp_in,
                  tick=s.tick + 1)
    return s, rec.at[t].set(jnp.where(active, grp, IDLE))

  state, rec = lax.fori_loop(0, ticks, tick, (state, jnp.full((ticks,), IDLE, jnp.int32)))
  return _lead(state), rec[None]


def _lead(tree):
  return jax.tree.map(lambda x: x[None], tree)


def _local_params(params):
  """A device's block of the stage-stacked params: layer leaves [1, L/pp, ...] -> [L/pp, ...]."""
  return {"embed": params["embed"], "head": params["head"],
          "layers": jax.tree.map(lambda x: x[0], params["layers"])}


def _summary(state: PipeState):
  """int32 [pp, 3, B] (done, num_generated, stop_reason) of every stage's rows; the host reads
  the last stage's (the others' copies are never updated)."""
  r = state.rows
  flat = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731
  return jnp.stack([flat(r.done.astype(jnp.int32)), flat(r.num_generated),
                    flat(r.stop_reason)], axis=1)


def stack_params(cfg: ModelConfig, params: Any, stages: int) -> dict:
  """Unpipelined params (unrolled or scan_layers) -> {"embed", "head", "layers": leaves
  [pp, L/pp, ...]}: row s = layers s*L/pp .. (s+1)*L/pp - 1, the training pipeline's layout
  (llama.stage_stack, which pipeline/stages.py's StageLayout.stack uses too)."""
  if "layers_0" in params:
    held = sum(1 for k in params if k.startswith("layers_"))
  else:
    held = jax.tree.leaves(params["layers"]["block"])[0].shape[0]
  if held != cfg.num_layers:  # else: a numpy reshape error, or extra layers dropped silently
    raise ValueError(f"params hold {held} layers; expected model.num_layers={cfg.num_layers}")
  return llama.stage_stack(params, cfg.num_layers, stages)


def check_staged(cfg: ModelConfig, staged: dict, stages: int,
                 field: str = PIPELINE_FIELDS[0]) -> None:
  """Already stage-stacked params must be stacked for this pipeline: every layer leaf
  [stages, L/stages, ...]. (A stack for another stage count was split over the stage axis as it
  came and each stage ran the wrong layers: wrong log-probs, no error.)"""
  want = (stages, cfg.num_layers // stages)
  for path, x in jax.tree_util.tree_leaves_with_path(staged["layers"]):
    if tuple(x.shape[:2]) != want:
      raise ValueError(
          f"stage-stacked params: layers{jax.tree_util.keystr(path)} has shape {tuple(x.shape)};"
          f" expected [{want[0]}, {want[1]}, ...] for {field}={stages} and model.num_layers="
          f"{cfg.num_layers}: pass unpipelined params, or `place` them with this generator")


def is_staged(params: Any) -> bool:
  """Whether params are already stage-stacked (`stack_params`): a scan_layers tree's "layers"
  holds "block", an unrolled tree has layers_i instead."""
  return (hasattr(params, "keys") and set(params.keys()) == {"embed", "head", "layers"} and
          "block" not in params["layers"])


def reference_mesh(devices: Sequence[jax.Device], batch_size: int, groups: int) -> Mesh:
  """A data-parallel mesh with Bg = B/G rows per device: the non-pipelined Generator on it runs
  the very per-device shapes the pipeline runs, so their log-probs are bitwise comparable
  (module docstring). Needs G devices."""
  if len(devices) < groups:
    raise ValueError(f"the reference generator needs pipeline_groups={groups} devices, only "
                     f"{len(devices)} are available")
  if batch_size < groups or batch_size % groups:  # else its Generator splits rows otherwise
    raise ValueError(f"batch_size={batch_size} is not a positive multiple of "
                     f"pipeline_groups={groups}")
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=groups), list(devices)[:groups])


@dataclasses.dataclass
class PipelinedRollout(engine.Rollout):
  """A Rollout plus the executed schedule: decode_table [ticks, pp] (group or IDLE) over every
  decode chunk, prefill_table [G + pp - 1, pp]."""
  decode_table: Optional[np.ndarray] = None
  prefill_table: Optional[np.ndarray] = None


class PipelinedGenerator:
  """Generation through a pp-stage pipeline with G delayed groups (module docstring).

  Compiles two programs ahead of time (prefill, decode chunk), each one jitted shard_map over
  the `stage` axis of `stages` devices; the decode state is donated from chunk to chunk."""

  def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, *, batch_size: int,
               prompt_len: int, stages: int, groups: int,
               devices: Optional[Sequence[jax.Device]] = None,
               fields: tuple[str, str] = PIPELINE_FIELDS):
    devices = list(jax.devices() if devices is None else devices)
    self.bg = check_pipeline(cfg, batch_size, stages, groups, len(devices), fields)
    stages, groups, batch_size = int(stages), int(groups), int(batch_size)
    self.fields = fields
    self.max_len = instances.check_model(cfg, sampling, prompt_len)
    # Each stage device runs its own layers inside the shard_map, so on GPU "auto" decodes with
    # the Pallas kernel there directly, as a one-device generation instance does.
    cfg = cfg.replace(attention=attention.instance_attention(cfg.attention, cfg.num_kv_heads, 1))
    self.cfg, self.sampling = cfg, sampling
    self.batch_size, self.prompt_len, self.stages, self.groups = (batch_size, prompt_len, stages,
                                                                  groups)
    self.mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, stage=stages), devices[:stages])
    self.rep = NamedSharding(self.mesh, P())
    self.split = NamedSharding(self.mesh, P(STAGE))
    self._exe: dict = {}
    self.num_compiles = 0

  @property
  def chunk_ticks(self) -> int:
    return self.sampling.chunk_size * self.groups

  def param_shardings(self, staged: dict) -> dict:
    """Layers split by stage row; embedding and head replicated (module docstring)."""
    return {"embed": jax.tree.map(lambda _: self.rep, staged["embed"]),
            "head": jax.tree.map(lambda _: self.rep, staged["head"]),
            "layers": jax.tree.map(lambda _: self.split, staged["layers"])}

  def place(self, params: Any) -> dict:
    """Unpipelined params (host or devices) -> the stage-stacked tree on the stage mesh; params
    already stacked for this pipeline are placed as they are (for another one: refused)."""
    if is_staged(params):
      check_staged(self.cfg, params, self.stages, self.fields[0])
      staged = params
    elif (self.split.is_fully_addressable and
          all(mesh_lib.movable_locally(x) for x in jax.tree.leaves(params))):
      return self._place_by_stage(params)
    else:  # host arrays (a numpy reshape is a view) or multi-host
      staged = stack_params(self.cfg, params, self.stages)
    return mesh_lib.put(staged, self.param_shardings(staged))

  def _place_by_stage(self, params: Any) -> dict:
    """`place` of unpipelined device arrays: stage s's rows [1, L/pp, ...] of each layer leaf
    are copied to stage s's device and stacked there. (Stacking first reshaped the whole layers
    on the source devices: each held a second whole copy of them until the put ended, issue 25's
    transient: a 65B actor's layers twice on a device.) Bitwise the stack_params tree."""
    shapes = jax.eval_shape(functools.partial(stack_params, self.cfg, stages=self.stages), params)
    devices, per = list(self.mesh.devices.flat), self.cfg.num_layers // self.stages

    def scanned(x):  # [L, ...] -> stage s's rows [1, L/pp, ...] on stage s's device, each s
      full = (slice(None),) * (x.ndim - 1)
      rows = {d: (slice(s * per, (s + 1) * per),) + full for s, d in enumerate(devices)}
      return [p[None] for p in mesh_lib.local_blocks(x, rows)]

    def unrolled(*xs):  # L leaves [...] -> the same, stage s stacking its own layers' copies
      whole = lambda x, d: mesh_lib.local_blocks(x, {d: (slice(None),) * x.ndim})[0]  # noqa: E731
      return [jnp.stack([whole(x, d) for x in xs[s * per:(s + 1) * per]])[None]
              for s, d in enumerate(devices)]

    if "layers_0" in params:
      shares = jax.tree.map(unrolled, *[params[f"layers_{i}"] for i in range(self.cfg.num_layers)])
    else:
      shares = jax.tree.map(scanned, params["layers"]["block"])
    layers = jax.tree.map(
        lambda shape, parts: jax.make_array_from_single_device_arrays(shape.shape, self.split,
                                                                      parts),
        shapes["layers"], shares, is_leaf=lambda x: isinstance(x, list))
    return {"embed": mesh_lib.put(params["embed"], self.rep), "layers": layers,
            "head": mesh_lib.put(params["head"], self.rep)}

  def _programs(self, staged):
    cfg, sampling, pp, g = self.cfg, self.sampling, self.stages, self.groups
    pspec = jax.tree.map(lambda s: s.spec, self.param_shardings(staged))
    pre = jax.shard_map(
        functools.partial(_prefill_body, cfg, sampling, pp, g, self.max_len),
        mesh=self.mesh, in_specs=(pspec, P(), P(), P(), P(), P()),
        out_specs=(P(STAGE), P(STAGE)), check_vma=False)
    dec = jax.shard_map(functools.partial(_decode_body, cfg, sampling, pp, g), mesh=self.mesh,
                        in_specs=(pspec, P(STAGE), P()), out_specs=(P(STAGE), P(STAGE)),
                        check_vma=False)

    def prefill(params, tokens, lens, uids, budget, key):
      state, rec = pre(params, tokens, lens, uids, budget, key)
      return state, rec, _summary(state)

    def decode(params, state, key):
      state, rec = dec(params, state, key)
      return state, rec, _summary(state)
    return prefill, decode

  def compile(self, staged) -> None:
    """AOT-compiles prefill and the decode chunk for these stage-stacked params."""
    check_staged(self.cfg, staged, self.stages, self.fields[0])
    prefill, decode = self._programs(staged)
    g, bg, p = self.groups, self.bg, self.prompt_len
    prm = mesh_lib.abstract(staged, self.param_shardings(staged))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=self.rep)
    tok = jax.ShapeDtypeStruct((g, bg, p), jnp.int32, sharding=self.rep)
    row = jax.ShapeDtypeStruct((g, bg), jnp.int32, sharding=self.rep)
    split = self.split
    low = jax.jit(prefill, out_shardings=(split, split, split)).lower(prm, tok, row, row, row, key)
    self._exe["prefill"] = low.compile()
    st = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=split),
                      jax.eval_shape(prefill, prm, tok, row, row, row, key)[0])
    self._exe["decode"] = jax.jit(decode, out_shardings=(split, split, split),
                                  donate_argnums=(1,)).lower(prm, st, key).compile()
    self.num_compiles += 2

  def generate(self, params: Any, prompt_tokens, prompt_lens, iteration_key, uids=None,
               budgets=None) -> PipelinedRollout:
    """As instances.Generator.generate (same inputs, same per-sample tokens); `params`
    unpipelined (placed here) or already `place`d. Rows g*Bg .. (g+1)*Bg - 1 form group g."""
    tokens, lens, uids, budgets = instances.check_prompts(
        self.batch_size, self.prompt_len, self.sampling, prompt_tokens, prompt_lens, uids,
        budgets, self.cfg.vocab_size)
    if is_staged(params):  # (place stacks and places the others: nothing to check there)
      check_staged(self.cfg, params, self.stages, self.fields[0])
      staged = params
    else:
      staged = self.place(params)
    if not self._exe:
      self.compile(staged)
    g, bg = self.groups, self.bg
    put = lambda x, shape: mesh_lib.put(x.reshape(shape), self.rep)  # noqa: E731
    key = mesh_lib.put(sampling_lib.as_typed_key(iteration_key), self.rep)
    t0 = time.perf_counter()
    state, pre_rec, summary = self._exe["prefill"](
        staged, put(tokens, (g, bg, self.prompt_len)), put(lens, (g, bg)), put(uids, (g, bg)),
        put(budgets, (g, bg)), key)
    done = mesh_lib.to_host(summary)[-1, 0]
    t1 = time.perf_counter()
    recs = []
    while not done.all():
      state, rec, summary = self._exe["decode"](staged, state, key)
      recs.append(rec)
      done = mesh_lib.to_host(summary)[-1, 0]
    t2 = time.perf_counter()
    r = state.rows
    out = mesh_lib.to_host({"tokens": r.tokens, "logprobs": r.logprobs, "n": r.num_generated,
                            "stop": r.stop_reason})
    last = lambda x, *shape: np.asarray(x[-1]).reshape(*shape)  # noqa: E731
    b, t = self.batch_size, self.sampling.max_new_tokens
    n = last(out["n"], b)
    table = (np.concatenate([np.asarray(mesh_lib.to_host(x)) for x in recs], axis=1).T
             if recs else np.zeros((0, self.stages), np.int32))  # [ticks, pp]
    return PipelinedRollout(
        prompt_tokens=tokens, prompt_lens=lens, response_tokens=last(out["tokens"], b, t),
        response_lens=n, logprobs=last(out["logprobs"], b, t), stop_reason=last(out["stop"], b),
        uids=uids, prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=int(n.max()) - 1,
        decode_chunks=len(recs), decode_table=table,
        prefill_table=np.asarray(mesh_lib.to_host(pre_rec)).T)

  def group_steps(self, response_lens) -> list[int]:
    """Decode steps each group needs: its longest response - 1 (the first token is prefill's)."""
    lens = np.asarray(response_lens).reshape(self.groups, self.bg)
    return [int(x) - 1 for x in lens.max(axis=1)]


def schedule_report(gen: PipelinedGenerator, rollout: PipelinedRollout) -> dict:
  """The executed decode schedule's busy fractions next to the tick formula's counts."""
  steps = gen.group_steps(rollout.response_lens)
  formula = ticks_formula(steps, gen.stages, gen.chunk_ticks)
  stats = busy_stats(rollout.decode_table)
  expected = expected_tick_table(steps, gen.stages, stats["ticks"])
  return {**stats, "formula": formula, "group_steps": steps,
          "ticks_match_formula": bool(stats["ticks"] == formula["executed_ticks"] and
                                      stats["busy_stage_ticks"] == formula["busy_stage_ticks"]),
          "table_matches_formula": bool(np.array_equal(rollout.decode_table, expected)),
          "stages": gen.stages, "groups": gen.groups, "rows_per_group": gen.bg,
          "chunk_size": gen.sampling.chunk_size, "decode_chunks": rollout.decode_chunks}

