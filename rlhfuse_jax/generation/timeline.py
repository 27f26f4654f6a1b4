"""When each generation instance was busy, and with what: measured timelines of the real engine.

JAX dispatch is asynchronous, so the host cannot see when work runs by timing its own calls.
`ActivityLog` keeps one watcher thread per instance: every dispatched operation is queued with its
kind (prefill / decode / migrate / load / inference), its dispatch time and one small output that
is never donated; the watcher waits for that output and records the segment

  [max(dispatch time, end of the instance's previous operation), completion time]

since one device set runs its work in dispatch order. Waiting releases the GIL, so the watchers
cost the host loop nothing.

`Timeline` is the result: segments, the unfinished-sample curve, consolidation events, the end of
generation and of generation+inference. It has the fields that
`rlhfuse_jax.sim.plots.plot_generation_timelines` draws, so measured and simulated runs share
one figure style, and it derives the docs/architecture.md §2 metrics (busy fraction, inference
overlap).
"""
from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Any, Optional

import jax

KINDS = ("prefill", "decode", "migrate", "load", "inference")


class ActivityLog:
  """Per-instance watcher threads turning dispatched work into timed segments."""

  def __init__(self, num_instances: int, t0: Optional[float] = None):
    self.t0 = time.perf_counter() if t0 is None else t0
    self.segments: list = []  # (instance, start_s, end_s, kind), seconds from t0
    self.tagged: dict = {}  # tag -> [(start_s, end_s)] of the segments recorded with that tag
    self._lock = threading.Lock()
    self._queues = [queue.Queue() for _ in range(num_instances)]
    self._last_end = [0.0] * num_instances
    self._threads = [threading.Thread(target=self._watch, args=(i,), daemon=True)
                     for i in range(num_instances)]
    for t in self._threads:
      t.start()

  def now(self) -> float:
    return time.perf_counter() - self.t0

  def record(self, instance: int, kind: str, output: Any, since: Optional[float] = None,
             tag: Optional[str] = None, after: Any = None) -> None:
    """`output`: arrays produced by the dispatched work that stay alive (not donated);
    `since`: when the work was issued, if before now (e.g. a copy the caller waited on);
    `tag`: also file the segment under this tag (e.g. same-host migrations: `tag_span`);
    `after`: arrays of another instance's work this one waits for (a pipeline's previous
    stage): the segment starts no earlier than the watcher sees them ready."""
    if kind not in KINDS:
      raise ValueError(f"activity kind {kind!r}; expected one of {KINDS}")
    self._queues[instance].put((kind, self.now() if since is None else since, output, tag,
                                after))

  def note(self, tag: str) -> None:
    """Files the moment now under `tag` (a zero-length span): when the host asked for
    something, whenever a worker thread gets to it."""
    t = self.now()
    with self._lock:
      self.tagged.setdefault(tag, []).append((t, t))

  def tag_span(self, tag: str) -> float:
    """From the first start to the last end of the segments filed under `tag` (0 if none);
    call after `close`."""
    spans = self.tagged.get(tag, [])
    return max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0

  def _watch(self, i: int) -> None:
    while True:
      item = self._queues[i].get()
      if item is None:
        return
      kind, t_dispatch, output, tag, after = item
      if after is not None:
        jax.block_until_ready(after)
        t_dispatch = max(t_dispatch, self.now())
      jax.block_until_ready(output)
      end = self.now()
      with self._lock:
        start = max(t_dispatch, self._last_end[i])
        self.segments.append((i, start, max(start, end), kind))
        if tag is not None:
          self.tagged.setdefault(tag, []).append((start, max(start, end)))
        self._last_end[i] = max(self._last_end[i], end)

  def close(self) -> list:
    """Waits for every recorded operation; returns the segments sorted by start. Idempotent
    (a failed batch closes its log on the way out)."""
    if self._threads:
      for q in self._queues:
        q.put(None)
      for t in self._threads:
        t.join()
      self._threads = []
    return sorted(self.segments, key=lambda s: (s[1], s[0]))


def _merged_length(spans) -> float:
  """Total length of the union of [start, end] spans."""
  total, cur_s, cur_e = 0.0, None, None
  for s, e in sorted(spans):
    if cur_e is None or s > cur_e:
      if cur_e is not None:
        total += cur_e - cur_s
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  if cur_e is not None:
    total += cur_e - cur_s
  return total


def combined_overlap(figures) -> tuple:
  """(instances loaded before generation ended, inference overlap) over the instances of every
  row of `figures` [P, 3]: one `Timeline.overlap_figures` per process, each of the instances it
  watched. The overlap is the summed seconds' ratio (0.0 without inference), not a mean of the
  processes' ratios: a process that scored one short micro-batch weighs what it scored."""
  loaded = sum(int(round(float(f[0]))) for f in figures)
  before = sum(float(f[1]) for f in figures)
  total = sum(float(f[2]) for f in figures)
  return loaded, (before / total if total > 0 else 0.0)


# The columns of a process's row of the batch-end exchange (`Timeline.process_figures`); the
# times of its unfinished-sample curve follow them.
FIGURES = ("loaded_before_gen_end", "inference_before_gen_end_s", "inference_s", "load_s",
           "load_bytes", "busy_s", "instance_s", "migration_s", "migration_same_host_s",
           "migration_cross_host_s", "migration_cross_host_compile_s", "gen_end_s",
           "gen_plus_inf_s", "actor_to_instances_s")


def combined_figures(rows, unfinished=()) -> dict:
  """The metrics of docs/architecture.md §2 that each process measures of its own instances or
  by its own clock, over every process: `rows` [P, len(FIGURES) + curve points], one
  `Timeline.process_figures` per process (process 0's alone left out the others' loads:
  256784 of 385176 bytes in a batch of tests/test_fused_multiprocess.py). One row gives that
  process's own values bit for bit: a single process logs what it did before. `unfinished`:
  the curve's counts of unfinished samples (the same on every process), for its times."""
  col = {name: [float(r[k]) for r in rows] for k, name in enumerate(FIGURES)}
  loaded, overlap = combined_overlap([r[:3] for r in rows])
  busy, instance_s = sum(col["busy_s"]), sum(col["instance_s"])
  # Wall times: every process starts a round, a consolidation and the end of generation after
  # the same exchange, so the whole run's span of each is its slowest process's (a mean or
  # process 0's understates the wait of every other; a sum counts the parallel processes
  # twice). Each clock starts at its own process's start: the run's starts at the earliest,
  # where the read-outs are latest (the max of each curve point's time), and generation ends
  # at the latest gen_end_s; each process's inference after it is measured on its own clock.
  generate = max(col["gen_end_s"])
  gen_plus_inf = max(e + (generate - g) for e, g in zip(col["gen_plus_inf_s"], col["gen_end_s"]))
  curve = [max(float(r[k]) for r in rows) for k in range(len(FIGURES), len(rows[0]))]
  return {
      "fusion/loaded_before_gen_end": loaded,
      "fusion/inference_overlap_frac": overlap,
      # Summed, not the slowest process's: the loads' seconds are already summed over the
      # instances (device-seconds, not a wall time), and another process's instances are more
      # instances, as in one process of 8 devices.
      "fusion/weight_load_s": sum(col["load_s"]),
      "fusion/weight_load_bytes": sum(int(x) for x in col["load_bytes"]),
      # Busy instance-seconds over all instances' seconds, each process's instances over its
      # own gen_plus_inf_s (its own clock from its own start: 1.95 s and 1.59 s in a batch of
      # tests/test_fused_multiprocess.py): the mean of every instance's busy fraction weighted
      # by its span, as one process holding all of them computes it; not a mean of the
      # processes' fractions, which weighs an instance by 1 / its process's instance count.
      "gen/instance_busy_frac": busy / instance_s if instance_s > 0 else 0.0,
      "gen/migration_s": max(col["migration_s"]),
      "gen/migration_same_host_s": max(col["migration_same_host_s"]),
      "gen/migration_cross_host_s": max(col["migration_cross_host_s"]),
      "gen/migration_cross_host_compile_s": max(col["migration_cross_host_compile_s"]),
      "timing_s/generate": generate,
      "timing_s/inference": gen_plus_inf - generate,
      "timing_s/gen_plus_inf": gen_plus_inf,
      "timing_s/actor_to_instances": max(col["actor_to_instances_s"]),
      "gen/unfinished_curve": [[round(t, 5), int(u)] for t, u in zip(curve, unfinished,
                                                                      strict=True)]}


@dataclasses.dataclass
class Timeline:
  """One generation+inference run as measured (times in seconds from its start)."""
  num_instances: int
  segments: list  # (instance, start, end, kind)
  unfinished_curve: list  # [(t, unfinished samples)] at every host observation
  consolidations: list  # [{time_s, step, moves, moved_bytes, ...}]
  gen_end_s: float  # the host saw the last sample finish
  gen_plus_inf_s: float  # every inference result is on the host
  # The instances this process watched (its own, on many processes); None: all of them. The
  # per-instance metrics average over these only: another process's instances have no segments
  # here, and counting them as idle gave each of 2 processes at most 0.5 busy.
  observed: Optional[tuple] = None
  # tag -> [(start, end)] the run's log filed under it (ActivityLog.tagged: same-host migrations,
  # "load_requested/<i>" moments).
  tagged: Optional[dict] = None

  def to_json(self) -> dict:
    """Every field as JSON values (result.json keeps it: a figure of the run is drawn again
    from it, `from_json`, without running it again)."""
    return {"num_instances": self.num_instances,
            "segments": [[int(i), float(s), float(e), k] for i, s, e, k in self.segments],
            "unfinished_curve": [[float(t), int(u)] for t, u in self.unfinished_curve],
            "consolidations": list(self.consolidations), "gen_end_s": float(self.gen_end_s),
            "gen_plus_inf_s": float(self.gen_plus_inf_s),
            "observed": None if self.observed is None else [int(i) for i in self.observed],
            "tagged": None if self.tagged is None else {
                tag: [[float(s), float(e)] for s, e in spans]
                for tag, spans in self.tagged.items()}}

  @classmethod
  def from_json(cls, d: dict) -> "Timeline":
    """The Timeline `to_json` wrote (as json.load reads it back)."""
    return cls(num_instances=d["num_instances"],
               segments=[(i, s, e, k) for i, s, e, k in d["segments"]],
               unfinished_curve=[(t, u) for t, u in d["unfinished_curve"]],
               consolidations=list(d["consolidations"]), gen_end_s=d["gen_end_s"],
               gen_plus_inf_s=d["gen_plus_inf_s"],
               observed=None if d["observed"] is None else tuple(d["observed"]),
               tagged=None if d["tagged"] is None else {
                   tag: [(s, e) for s, e in spans] for tag, spans in d["tagged"].items()})

  @property
  def watched(self) -> tuple:
    return tuple(range(self.num_instances)) if self.observed is None else tuple(self.observed)

  def busy_s(self, instance: int, kinds=KINDS, until: Optional[float] = None) -> float:
    spans = [(s, e if until is None else min(e, until)) for i, s, e, k in self.segments
             if i == instance and k in kinds and (until is None or s < until)]
    return _merged_length(spans)

  @property
  def instance_busy_frac(self) -> float:
    """Busy instance-seconds / (watched instances x gen_plus_inf_s)."""
    if self.gen_plus_inf_s <= 0 or not self.watched:
      return 0.0
    busy = sum(self.busy_s(i) for i in self.watched)
    return busy / (len(self.watched) * self.gen_plus_inf_s)

  @property
  def inference_overlap_frac(self) -> float:
    """Inference busy time spent before generation ended / all inference busy time."""
    return combined_overlap([self.overlap_figures])[1]

  @property
  def loaded_before_gen_end(self) -> int:
    """Watched instances whose inference weights were in (a "load" segment ended) before
    generation ended: only these can have scored while the tail decoded. With none, inference
    overlap is 0 whatever the driver does (a load longer than the tail after the instances
    were freed: docs/architecture.md §2)."""
    return len({i for i, _, e, k in self.segments
                if k == "load" and e < self.gen_end_s and i in self.watched})

  @property
  def overlap_figures(self) -> tuple:
    """(loaded_before_gen_end, inference busy seconds before generation ended, all inference
    busy seconds) of the watched instances: what `combined_overlap` sums over processes."""
    before = sum(self.busy_s(i, ("inference",), until=self.gen_end_s) for i in self.watched)
    total = sum(self.busy_s(i, ("inference",)) for i in self.watched)
    return (self.loaded_before_gen_end, before, total)

  def process_figures(self, load_bytes: int, place_s: float) -> tuple:
    """This process's row of the batch-end exchange, of the instances it watched and by its
    own clock: what `combined_figures` combines over processes, its columns named by FIGURES.
    `overlap_figures`, then the weight loads' seconds, the bytes they loaded (`load_bytes`: the
    loader's count, which the segments do not keep), busy seconds and instance-seconds (watched
    instances x gen_plus_inf_s), the migrations' spans and waits (`migration_s`,
    `same_host_migration_s`, the consolidations' cross-host waits and compiles), the ends of
    generation and of generation+inference, the actor's placement (`place_s`), then the times
    of `unfinished_curve` (as many on every process: the rounds are the same)."""
    cons = self.consolidations
    return (*self.overlap_figures, self.kind_s("load"), load_bytes,
            sum(self.busy_s(i) for i in self.watched), len(self.watched) * self.gen_plus_inf_s,
            self.migration_s, self.same_host_migration_s,
            sum(c.get("cross_host_s", 0.0) for c in cons),
            sum(c.get("cross_host_compile_s", 0.0) for c in cons),
            self.gen_end_s, self.gen_plus_inf_s, place_s,
            *(t for t, _ in self.unfinished_curve))

  def span_s(self, kind: str) -> float:
    """From the first start to the last end of the segments of one kind (0 if none)."""
    spans = [(s, e) for _, s, e, k in self.segments if k == kind]
    return max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0

  def kind_s(self, kind: str) -> float:
    return sum(self.busy_s(i, (kind,)) for i in self.watched)

  def per_consolidation_span_s(self, spans) -> float:
    """Summed over the consolidations, from the first start to the last end of the `spans`
    [(start, end)] that started during each (from its time_s to the next one's). One span over
    all of them counted the decode rounds between two consolidations as migration time; with
    at most one consolidation the two agree."""
    cuts = [-math.inf] + [c["time_s"] for c in self.consolidations[1:]] + [math.inf]
    total = 0.0
    for lo, hi in zip(cuts, cuts[1:]):
      mine = [(s, e) for s, e in spans if lo <= s < hi]
      if mine:
        total += max(e for _, e in mine) - min(s for s, _ in mine)
    return total

  @property
  def migration_s(self) -> float:
    """Each consolidation's first copy's start to its last copy's end, summed."""
    return self.per_consolidation_span_s(
        [(s, e) for _, s, e, k in self.segments if k == "migrate"])

  @property
  def same_host_migration_s(self) -> float:
    """`migration_s` of the copies between two instances of this process (filed under the tag
    "same_host"; a cross-process move is one collective, timed apart)."""
    return self.per_consolidation_span_s((self.tagged or {}).get("same_host", []))
