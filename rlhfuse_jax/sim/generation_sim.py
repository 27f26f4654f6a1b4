"""Sample-level discrete-event simulation of generation + inference on G instances
(docs/architecture.md §2).

Model of the engine (the one issue 5 builds): the batch is dealt round-robin to G instances of
`tp` devices with S slots each (all samples start at once, as in the engine); each instance runs
a prefill (which samples the first token), then decode chunks of up to K steps; the host sees a
sample finish only at the end of the chunk in which it finished. A decode step costs
`CostModel.decode_step_s(rows still live, KV tokens they read)`.

With consolidation (`threshold` = Rt not None): after the prefill and after every chunk the host
calls the shared policy `rlhfuse_jax.policy.consolidation.plan_consolidation` on the instances'
states (each unfinished sample counted at its current length plus `max_new_tokens -
generated`); when it returns moves, each destination waits for its in-flight chunk and its
sources' chunks, then receives the KV rows (`CostModel.kv_migration_s`), and the released
instances leave generation.
At most `max_consolidations` plans are executed.

Inference (reference log-probs, reward, critic values) runs per micro-batch of finished samples.
Baseline (`stream_inference` False): every instance starts inference when the last sample
finishes. Fused: an instance serves the inference queue as soon as it holds no unfinished
sample (released by consolidation, or its own samples all done), while the tail still decodes.
With `offload_frozen` the frozen models' weights are first copied from host memory onto each
instance that runs inference (`CostModel.weight_load_s`).

`devices_share_compute` (a CPU with fake devices; set in GenSetup or in the calibration file):
all instances are one processor, so every operation also waits for the previous one anywhere.

Times are seconds from the start of generation. The result holds per-instance timelines
(segments of prefill / decode / migrate / load / inference) and the unfinished-sample curve.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Optional, Sequence

import numpy as np

from rlhfuse_jax.policy.consolidation import (InstanceState, SampleState, plan_consolidation,
                                              within_threshold)
from rlhfuse_jax.sim.cost_model import CostModel, same_node, stage_cost
from rlhfuse_jax.sim.shapes import ModelShape, stage_shape

KINDS = ("prefill", "decode", "migrate", "load", "inference")


@dataclasses.dataclass(frozen=True)
class GenSetup:
  """How generation and inference are laid out (see module docstring)."""
  num_instances: int
  slots: int
  tp: int = 1
  chunk_steps: int = 16
  max_new_tokens: int = 1024
  threshold: Optional[float] = None  # Rt; None = no consolidation (baseline)
  max_consolidations: int = 1
  stream_inference: bool = False  # freed instances run inference while the tail decodes
  inference_microbatch: int = 8  # samples per inference micro-batch
  kv_capacity_tokens: int = 0  # per instance; 0 = slots * (longest prompt + max_new_tokens)
  offload_frozen: bool = False
  devices_share_compute: bool = False
  devices_per_node: int = 8  # for whether a migration crosses nodes
  # Inference runs on units of this many instances (paired as they leave generation), a
  # forward pipeline of as many stages (each instance 1/inference_pp of the frozen models'
  # layers): where the frozen models do not fit on one instance beside what stays there
  # (iteration_sim.inference_pp).
  inference_pp: int = 1
  # The group of each instance whose units stay within it (the engine's: the process that
  # drives it, generation/fused.py; trainer/rt_auto.py); () for one group (any instances)
  instance_groups: tuple = ()
  # The engine's prompt bucket P (GenerationInstance.prompt_len): its inference micro-batches
  # are [micro-batch, P + max_new_tokens], the width of the hidden states a pipeline hands
  # between stages (handoff_s); 0: the batch's longest prompt
  prompt_len: int = 0

  def __post_init__(self):
    for f in ("num_instances", "slots", "tp", "chunk_steps", "max_new_tokens",
              "inference_microbatch", "devices_per_node", "inference_pp"):
      if getattr(self, f) < 1:
        raise ValueError(f"generation.{f}={getattr(self, f)} must be >= 1")
    if self.num_instances % self.inference_pp:
      raise ValueError(f"generation.inference_pp={self.inference_pp} must divide "
                       f"num_instances={self.num_instances} (a unit of that many instances "
                       "runs one inference pipeline)")
    groups = self.instance_groups
    if groups and (len(groups) != self.num_instances or any(
        n % self.inference_pp for n in collections.Counter(groups).values())):
      raise ValueError(f"generation.instance_groups={groups}: expected a group for each of the "
                       f"{self.num_instances} instances, each group's count divisible by "
                       f"inference_pp={self.inference_pp}")
    if self.max_consolidations < 0:
      raise ValueError(f"generation.max_consolidations={self.max_consolidations} must be >= 0")
    if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"generation.threshold (Rt)={self.threshold} must be in [0, 1] or None")
    if self.prompt_len < 0:
      raise ValueError(f"generation.prompt_len={self.prompt_len} must be >= 0 (0: the batch's "
                       "longest prompt)")
    if self.kv_capacity_tokens < 0:
      raise ValueError(f"generation.kv_capacity_tokens={self.kv_capacity_tokens} must be >= 0")


@dataclasses.dataclass
class GenResult:
  gen_end_s: float  # last sample seen finished
  gen_plus_inf_s: float  # last inference micro-batch done
  finish_s: np.ndarray  # [B] time each sample was seen finished
  unfinished_curve: list  # [(t, U)]
  segments: list  # [(instance, start, end, kind)]
  consolidations: list  # [{time_s, kept, released, moves, moved_bytes, migration_s, reason}]
  instance_busy_frac: float
  inference_overlap_frac: float  # inference busy time before gen_end / all inference time

  @property
  def inf_exposed_s(self) -> float:
    return self.gen_plus_inf_s - self.gen_end_s

  def summary(self) -> dict:
    return {"gen_s": self.gen_end_s, "gen_plus_inf_s": self.gen_plus_inf_s,
            "inf_exposed_s": self.inf_exposed_s, "instance_busy_frac": self.instance_busy_frac,
            "inference_overlap_frac": self.inference_overlap_frac,
            "consolidations": [{k: v for k, v in c.items() if k != "kept_list"}
                               for c in self.consolidations]}


class _Clock:
  """Per-instance clocks, plus one shared processor when devices share compute."""

  def __init__(self, n: int, shared: bool):
    self.t = np.zeros(n)
    self.shared = shared
    self.cpu_free = 0.0
    self.segments: list = []

  def run(self, inst: int, duration: float, kind: str, not_before: float = 0.0) -> float:
    start = max(self.t[inst], not_before, self.cpu_free if self.shared else 0.0)
    end = start + duration
    if duration > 0:
      self.segments.append((inst, start, end, kind))
    self.t[inst] = end
    if self.shared:
      self.cpu_free = end
    return end


@dataclasses.dataclass
class _Batch:
  """Host-side bookkeeping of one simulated batch, updated as generation proceeds."""
  prompt_lens: np.ndarray  # [B]
  target: np.ndarray  # [B] response length of each sample
  slot_uid: np.ndarray  # [G, S] uid of the sample in each slot (-1 = free)
  generated: np.ndarray  # [B] response tokens so far
  finish: np.ndarray  # [B] time each sample was seen finished (inf until then)
  active: np.ndarray  # [G] instance still in generation
  done_gen_at: np.ndarray  # [G] when an instance stopped holding unfinished samples
  unfinished: int
  consolidations: list = dataclasses.field(default_factory=list)  # records of _consolidate

  @classmethod
  def dealt(cls, num_instances: int, slots: int, prompt_lens: np.ndarray, target: np.ndarray
            ) -> "_Batch":
    """The batch dealt round-robin to the instances (sample uid to instance uid % G), as the
    engine admits it: every sample at the start, nothing generated yet."""
    b, g = prompt_lens.size, num_instances
    slot_uid = np.full((g, slots), -1, dtype=np.int64)
    for uid in range(b):
      i = uid % g
      slot_uid[i, uid // g] = uid
    return cls(prompt_lens=prompt_lens, target=target, slot_uid=slot_uid,
               generated=np.zeros(b, dtype=np.int64), finish=np.full(b, np.inf),
               active=np.ones(g, dtype=bool), done_gen_at=np.full(g, np.inf), unfinished=b)

  @property
  def size(self) -> int:
    return self.prompt_lens.size

  def finished(self, uids: np.ndarray, t: float):
    """Samples `uids` seen finished at time t."""
    self.finish[uids] = t
    self.unfinished -= uids.size

  def release(self, i: int, t: float):
    """Instance i leaves generation at time t (it holds no unfinished sample)."""
    self.active[i] = False
    self.done_gen_at[i] = t


def simulate_generation(cost: CostModel, actor: ModelShape, frozen: Sequence[ModelShape],
                        setup: GenSetup, prompt_lens: np.ndarray, response_lens: np.ndarray
                        ) -> GenResult:
  """Simulates one batch. prompt_lens / response_lens: [B] ints (a response finishes after
  exactly response_lens[i] tokens, 1 <= response_lens[i] <= max_new_tokens).

  Steps: check the batch, deal it to the instances, prefill, decode chunks with the
  consolidations they trigger (`_generate`), then inference and the totals (`_result`).
  """
  prompt_lens, target, kv_cap, slot_cap = _checked_lengths(setup, prompt_lens, response_lens)
  shared = setup.devices_share_compute or cost.shares_compute
  clock = _Clock(setup.num_instances, shared)
  batch = _Batch.dealt(setup.num_instances, setup.slots, prompt_lens, target)
  _prefill(cost, actor, setup, clock, batch)
  _generate(cost, actor, setup, clock, batch, kv_cap, slot_cap)
  return _result(cost, frozen, setup, clock, batch)


def _checked_lengths(setup: GenSetup, prompt_lens, response_lens
                     ) -> tuple[np.ndarray, np.ndarray, int, int]:
  """(prompt_lens, response_lens) as int64 [B], then the KV tokens an instance holds (kv_cap)
  and one slot may need (slot_cap); a ValueError for a batch the engine would not admit."""
  prompt_lens = np.asarray(prompt_lens, dtype=np.int64)  # [B]
  target = np.asarray(response_lens, dtype=np.int64)  # [B]
  b = prompt_lens.size
  if target.shape != (b,) or b == 0:
    raise ValueError(f"prompt_lens {prompt_lens.shape} and response_lens {target.shape} must be "
                     "the same non-empty [B]")
  if prompt_lens.min() < 0:  # a negative prompt read negative KV bytes, silently
    raise ValueError(f"prompt lengths must be >= 0, got {int(prompt_lens.min())}")
  if target.min() < 1 or target.max() > setup.max_new_tokens:
    raise ValueError(f"response lengths must be in [1, max_new_tokens={setup.max_new_tokens}]")
  g, s = setup.num_instances, setup.slots
  if g * s < b:
    raise ValueError(f"generation: num_instances*slots={g}*{s}={g * s} < batch={b}; the engine "
                     "admits every sample at the start")
  slot_cap = int(prompt_lens.max()) + setup.max_new_tokens
  kv_cap = setup.kv_capacity_tokens or s * slot_cap
  per_inst = -(-b // g)
  if per_inst * slot_cap > kv_cap:
    raise ValueError(f"generation: {per_inst} samples per instance may need {per_inst * slot_cap}"
                     f" KV tokens > kv_capacity_tokens={kv_cap}")
  return prompt_lens, target, kv_cap, slot_cap


def _prefill(cost: CostModel, actor: ModelShape, setup: GenSetup, clock: _Clock, batch: _Batch):
  """Every instance prefills its samples, which samples their first response token."""
  for i in range(setup.num_instances):
    uids = batch.slot_uid[i][batch.slot_uid[i] >= 0]
    clock.run(i, cost.prefill_s(actor, setup.tp, batch.prompt_lens[uids]), "prefill")
    batch.generated[uids] = 1
    batch.finished(uids[batch.target[uids] <= 1], clock.t[i])


def _generate(cost: CostModel, actor: ModelShape, setup: GenSetup, clock: _Clock,
              batch: _Batch, kv_cap: int, slot_cap: int):
  """Decode chunks until every sample has finished, with the consolidations they trigger.

  Chunks are processed in order of their start times. A consolidation decided at the end T
  of some chunk is applied once every instance has reached T (the host sees all the chunks
  that were in flight at T; sources hand over their rows when their chunk ends).
  """
  kv_bpt = actor.kv_bytes_per_token()
  heap = [(clock.t[i], i) for i in range(setup.num_instances)]
  heapq.heapify(heap)
  due = _due_after_prefill(setup, clock, batch)
  decided = -np.inf  # when the host last planned a consolidation
  while heap:
    t_now, i = heapq.heappop(heap)
    if not batch.active[i] or t_now != clock.t[i]:
      continue  # stale entry (instance released, or its clock moved by a migration)
    if due is not None and t_now >= due:
      heapq.heappush(heap, (t_now, i))
      rec = _consolidate(cost, setup, clock, batch, kv_cap, slot_cap, kv_bpt, due,
                         actor.kv_itemsize)
      decided, due = due, None
      for kept in ([] if rec is None else rec["kept_list"]):
        heapq.heappush(heap, (clock.t[kept], kept))
      continue
    end = _decode_chunk(cost, actor, setup, clock, batch, i)
    if end is None:
      continue
    if batch.active[i]:
      heapq.heappush(heap, (end, i))
    # The host decides when it has seen the count within Rt: at the finish (a chunk's or a
    # prefill's end) that brought it there, which may come before a prefill end or a chunk end
    # already due (chunks are processed in order of their starts, not their ends), and never
    # before. Once it has decided, the count stays within: the next chunk end.
    if _consolidation_due(setup, batch):
      seen = _seen_within_at(setup, batch)
      cand = seen if seen > decided else end
      due = cand if due is None else min(due, cand)


def _seen_within_at(setup: GenSetup, batch: _Batch) -> float:
  """The earliest finish time by which at most Rt * B samples are left unfinished (-inf: at
  any time, e.g. Rt = 1; within_threshold's rounding of Rt * B)."""
  fin = np.sort(batch.finish[np.isfinite(batch.finish)])
  need = math.ceil(batch.size - round(setup.threshold * batch.size, 9))  # finishes needed
  return float(fin[need - 1]) if 1 <= need <= fin.size else -np.inf


def _due_after_prefill(setup: GenSetup, clock: _Clock, batch: _Batch) -> Optional[float]:
  """When the host first plans a consolidation on seeing the prefills end, or None.

  The engine's host checks the threshold after the prefill too, before any decode step
  (generation/fused.py `_execute`, step 0, once it has read every instance's prefill):
  samples whose response is one token finish there, and with Rt = 1 it consolidates then
  whatever finished. The simulated host sees each instance's prefill end as it happens, as it
  sees each chunk end (the engine's instances run in lockstep; the simulated ones do not), so
  the decision falls at the first prefill end after which at most Rt * B samples are
  unfinished: the finish that brought the count there (_seen_within_at; every finish so far is
  a prefill's end), or with Rt = 1 the first prefill end."""
  if not _consolidation_due(setup, batch):
    return None
  return max(_seen_within_at(setup, batch), float(clock.t.min()))


def _consolidation_due(setup: GenSetup, batch: _Batch) -> bool:
  """Whether the host plans a consolidation now: with a threshold Rt, plans left, and some but
  at most Rt * B samples unfinished."""
  return (setup.threshold is not None and
          len(batch.consolidations) < setup.max_consolidations and
          0 < batch.unfinished and within_threshold(batch.unfinished, setup.threshold,
                                                    batch.size))


def _decode_chunk(cost: CostModel, actor: ModelShape, setup: GenSetup, clock: _Clock,
                  batch: _Batch, i: int) -> Optional[float]:
  """One chunk of up to K decode steps on instance i; returns its end time, or None when the
  instance holds no unfinished sample. Samples that finish free their slots, and an instance
  left with no sample leaves generation (so does one found without unfinished samples)."""
  occ = batch.slot_uid[i]
  live_uids = occ[(occ >= 0)]
  live_uids = live_uids[batch.generated[live_uids] < batch.target[live_uids]]
  if live_uids.size == 0:
    batch.release(i, clock.t[i])
    return None
  g0 = batch.generated[live_uids]  # [r]
  left = batch.target[live_uids] - g0  # [r]
  n_steps, dur = _chunk_cost(cost, actor, setup, batch.prompt_lens[live_uids] + g0, left)
  end = clock.run(i, dur, "decode")
  batch.generated[live_uids] = g0 + np.minimum(left, n_steps)
  fin = live_uids[batch.generated[live_uids] >= batch.target[live_uids]]
  batch.finished(fin, end)
  for u in fin:
    occ[occ == u] = -1
  if not np.any(occ >= 0):
    batch.release(i, end)
  return end


def _chunk_cost(cost: CostModel, actor: ModelShape, setup: GenSetup, ctx0: np.ndarray,
                left: np.ndarray) -> tuple[int, float]:
  """(steps, seconds) of one decode chunk over rows with ctx0 [r] KV tokens and left [r]
  tokens to generate: step k is taken by the rows with k < left, each reading ctx0 + k."""
  n_steps = int(min(setup.chunk_steps, left.max()))
  k = np.arange(n_steps)[:, None]  # [n_steps, 1]
  live = k < left[None, :]  # [n_steps, r]
  ctx = ctx0[None, :] + k  # [n_steps, r] KV tokens read
  rows = live.sum(axis=1)  # [n_steps]
  tokens = (live * ctx).sum(axis=1)  # [n_steps]
  return n_steps, float(np.sum(cost.decode_step_s(actor, setup.tp, rows, tokens)))


def _result(cost: CostModel, frozen: Sequence[ModelShape], setup: GenSetup, clock: _Clock,
            batch: _Batch) -> GenResult:
  """Runs inference after generation and sums up both from the clock's segments."""
  b, g = batch.size, setup.num_instances
  gen_end = float(batch.finish.max())
  t_fin, counts = np.unique(batch.finish, return_counts=True)
  curve = [(0.0, b)] + [(float(t), int(b - c)) for t, c in zip(t_fin, np.cumsum(counts))]
  # The engine's inference micro-batch: [micro-batch, P + max_new_tokens] (GenerationInstance's
  # compiled shape), the width of the hidden states handed between stages.
  width = (setup.prompt_len or int(batch.prompt_lens.max(initial=0))) + setup.max_new_tokens
  inf_busy = _simulate_inference(cost, frozen, setup, clock, batch.prompt_lens + batch.target,
                                 batch.finish, batch.done_gen_at, gen_end, width)
  gpi = float(max(clock.t.max(), gen_end))
  busy = sum(e - st for _, st, e, _ in clock.segments)
  before = sum(max(0.0, min(e, gen_end) - st) for _, st, e, kd in clock.segments
               if kd == "inference")
  return GenResult(
      gen_end_s=gen_end, gen_plus_inf_s=gpi, finish_s=batch.finish,
      unfinished_curve=curve, segments=clock.segments, consolidations=batch.consolidations,
      instance_busy_frac=busy / (g * gpi) if gpi > 0 else 0.0,
      inference_overlap_frac=before / inf_busy if inf_busy > 0 else 0.0)


def _consolidate(cost: CostModel, setup: GenSetup, clock: _Clock, batch: _Batch, kv_cap: int,
                 slot_cap: int, kv_bpt: float, t_decide: float,
                 kv_itemsize: int) -> Optional[dict]:
  """Plans with the shared policy and, if it moves samples, applies the moves and their costs,
  releases the emptied instances and records the consolidation (also returned)."""
  slot_uid, generated, target = batch.slot_uid, batch.generated, batch.target
  states = []
  for i in np.flatnonzero(batch.active):
    samples = []
    for slot, u in enumerate(slot_uid[i]):
      if u >= 0 and generated[u] < target[u]:
        # The KV rows hold the prompt and every response token but the newest, as the engine's
        # (generation/fused.py's consolidation: the next step writes it).
        samples.append(SampleState(uid=int(u), slot=slot,
                                   length=int(batch.prompt_lens[u] + generated[u] - 1),
                                   remaining=int(setup.max_new_tokens - generated[u])))
    states.append(InstanceState(index=int(i), slots=setup.slots, kv_capacity_tokens=kv_cap,
                                samples=tuple(samples), slot_capacity_tokens=slot_cap))
  plan = plan_consolidation(states, setup.threshold, batch.size, bytes_per_token=kv_bpt)
  if not plan.consolidate:
    return None
  # Each destination waits for its own chunk and its sources' chunks, then receives its rows.
  per_inst = setup.tp
  start_by_dst: dict = {}
  bytes_by_dst: dict = {}
  secs_by_dst: dict = {}
  for m in plan.moves:
    start_by_dst[m.dst_instance] = max(start_by_dst.get(m.dst_instance, clock.t[m.dst_instance]),
                                       clock.t[m.src_instance], t_decide)
    apart = not same_node(m.src_instance * per_inst, m.dst_instance * per_inst,
                          setup.devices_per_node)
    secs = cost.kv_migration_s(m.bytes, setup.tp, apart, kv_itemsize)
    secs_by_dst[m.dst_instance] = secs_by_dst.get(m.dst_instance, 0.0) + secs
    bytes_by_dst[m.dst_instance] = bytes_by_dst.get(m.dst_instance, 0) + m.bytes
  src_done: dict = {}
  for d, st in start_by_dst.items():
    end = clock.run(d, secs_by_dst[d], "migrate", not_before=st)
    for m in plan.moves:
      if m.dst_instance == d:
        src_done[m.src_instance] = max(src_done.get(m.src_instance, 0.0), end)
  for m in plan.moves:
    slot_uid[m.src_instance][m.src_slot] = -1
    slot_uid[m.dst_instance][m.dst_slot] = m.uid
  for src, end in src_done.items():
    if src in plan.released:
      clock.segments.append((src, max(clock.t[src], t_decide), end, "migrate"))
      clock.t[src] = max(clock.t[src], end)
  migration_s = max(secs_by_dst.values())
  rec = {"time_s": float(t_decide), "unfinished": plan.unfinished, "kept": len(plan.kept),
         "kept_list": list(plan.kept), "released": list(plan.released),
         "moves": len(plan.moves), "moved_bytes": int(plan.moved_bytes),
         "migration_s": float(migration_s), "reason": plan.reason}
  batch.consolidations.append(rec)
  for r in rec["released"]:
    batch.release(r, clock.t[r])
  return rec


def _simulate_inference(cost, frozen, setup, clock, seq_lens, finish, done_gen_at, gen_end,
                        width: int = 0) -> float:
  """Greedy list scheduling of inference micro-batches on units of `inference_pp` instances;
  returns total inference busy time (summed over the instances).

  With inference_pp > 1 a unit is a forward pipeline: instance k of the unit runs stage k
  (shapes.stage_shape) of each micro-batch after instance k-1 has, so consecutive micro-batches
  overlap and the unit takes the next one once its first stage is free. Units are formed in
  the order the instances become free (the first pp, the next pp, ...; fixed pairs of
  neighbours kept a pair idle beside each instance a consolidation kept; within each of
  setup.instance_groups, the engine's processes, where given), each instance loads
  its stage's weights as soon as it is free itself, and a unit computes once all its
  instances have. Each frozen model's stage k starts once its stage k-1 output has reached the
  instance (handoff_s: [micro-batch, `width`] tokens, one hidden vector a token), as the engine
  dispatches it (fused.InferenceQueue._score_stages: model by model, each copy overlapping the
  next models' compute); the copies delay a stage but occupy neither instance's compute. With
  stage k-1 running its models back to back from S, stage k's run of them back to back can
  start at S + max_j (d_j + h_j) (d_j: model j's share of the stage, h_j its copy): one model
  waits for the whole stage and its copy, several overlap them."""
  g, pp = setup.num_instances, setup.inference_pp
  avail = np.array([done_gen_at[i] if setup.stream_inference else gen_end for i in range(g)])
  avail = np.maximum(avail, clock.t)  # an instance's own work (e.g. a migration) ends first
  free_order = np.argsort(avail, kind="stable") if pp > 1 else np.arange(g)
  groups = setup.instance_groups or (0,) * g
  units = []  # within each group, in freeing order; ordered by their first instance's
  for grp in dict.fromkeys(groups[i] for i in free_order):
    mine = [int(i) for i in free_order if groups[i] == grp]
    units += [mine[k:k + pp] for k in range(0, len(mine), pp)]
  rank = {int(i): r for r, i in enumerate(free_order)}
  units.sort(key=lambda unit: rank[unit[0]])
  order = np.argsort(finish, kind="stable")  # samples by readiness
  ready_t = finish[order]
  nxt = 0
  stages = list(frozen) if pp == 1 else [stage_shape(s, pp) for s in frozen]
  # Each instance of a unit loads its stage's share: the weights over tp * pp devices.
  load_s = cost.weight_load_s(frozen, setup.tp * pp) if setup.offload_frozen else 0.0
  loaded = np.zeros(len(units), dtype=bool)
  # Keyed by when the unit could start computing (after loading the frozen weights), so a
  # unit that still has to load does not grab work a loaded one would finish sooner.
  heap = [(max(avail[m] for m in unit) + load_s, u) for u, unit in enumerate(units)]
  heapq.heapify(heap)
  busy = 0.0
  while nxt < order.size:
    t, u = heapq.heappop(heap)
    if setup.offload_frozen and not loaded[u]:
      t = max(clock.run(m, load_s, "load", not_before=avail[m]) for m in units[u])
      loaded[u] = True
    t = max(t, ready_t[nxt])
    # Take every sample ready by t, up to a micro-batch.
    hi = int(np.searchsorted(ready_t, t, side="right"))
    take = order[nxt:min(hi, nxt + setup.inference_microbatch)]
    nxt += take.size
    dur = float(stage_cost(cost, "inference_s", stages, list(frozen), setup.tp, seq_lens[take]))
    start, first_free, prev = t, None, None
    # the same for every stage of the micro-batch: split once
    shares = _model_shares(cost, stages, setup.tp, seq_lens[take], dur) if pp > 1 else None
    for m in units[u]:  # stage k after stage k-1, once its hidden states are here
      if prev is not None:
        start += max(d + h for d, h in zip(shares, handoff_s(cost, frozen, setup, prev, m,
                                                              width)))
      end = clock.run(m, dur, "inference", not_before=start)
      start = end - dur  # this stage's start (the clock's, which waits for the instance)
      first_free = end if first_free is None else first_free
      prev = m
    busy += dur * pp
    heapq.heappush(heap, (first_free, u))
  return busy


def _model_shares(cost: CostModel, stages: Sequence[ModelShape], tp: int, lens: np.ndarray,
                  dur: float) -> list[float]:
  """Each frozen model's part of a stage that takes `dur` in all: split as the formulas split
  it (a calibration measures the models together)."""
  f = cost.formulas()
  parts = [float(f.inference_s([st], tp, lens)) for st in stages]
  total = sum(parts)
  return [dur * x / total if total > 0 else dur / len(parts) for x in parts]


def handoff_s(cost: CostModel, frozen: Sequence[ModelShape], setup: GenSetup, src: int,
              dst: int, width: int) -> list[float]:
  """Seconds to hand one inference micro-batch's hidden states from instance `src`'s stage to
  instance `dst`'s, one per frozen model: [inference_microbatch, width, hidden] at its
  act_itemsize. An instance's devices each hold them whole (GenerationInstance.row3: split over
  the data axes only, replicated over tensor), so its tp devices receive a copy each, in
  parallel: the copy an instance-to-instance device copy of tp x those bytes (cost_model's
  kv_migration_s: a calibration's measured migration where it has one, else one point-to-point
  copy of the whole), across nodes where the two instances' first devices are in different
  nodes (instance i on devices i*tp ...)."""
  apart = not same_node(src * setup.tp, dst * setup.tp, setup.devices_per_node)
  return [cost.kv_migration_s(setup.inference_microbatch * width * s.hidden_size *
                              s.act_itemsize * setup.tp, setup.tp, apart, s.act_itemsize)
          for s in frozen]


def choose_threshold(cost: CostModel, actor: ModelShape, frozen: Sequence[ModelShape],
                     setup: GenSetup, prompt_lens: np.ndarray, response_lens: np.ndarray,
                     candidates: Sequence[float] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
                     ) -> tuple[float, dict]:
  """Rt with the smallest simulated gen+inf time over the given lengths (e.g. the histogram
  kept across iterations). Returns (best Rt, {Rt: gen_plus_inf_s})."""
  times = {}
  for rt in candidates:
    res = simulate_generation(cost, actor, frozen, dataclasses.replace(
        setup, threshold=float(rt), stream_inference=True), prompt_lens, response_lens)
    times[float(rt)] = res.gen_plus_inf_s
  best = min(times, key=lambda r: (times[r], r))
  return best, times
