"""The schedule data structure handed to executors: per-device ordered tasks with times.

A `Schedule` is what the search produces and what an executor (e.g. a shard_map program with a
per-device instruction table) consumes:

  Schedule
    problem: PipelineProblem            # the instance (placement, durations, memory, budget)
    devices: tuple[tuple[Task, ...]]    # devices[d] = tasks of device d in execution order
    makespan, peaks (per device), budget (per device)

  Task (frozen):
    model: 'actor' | 'critic'
    replica: int       # critic data-parallel replica (0 for the actor)
    stage: int         # the model's pipeline stage run by this device
    microbatch: int    # index within the model's (replica's) micro-batches
    kind: 'F' | 'B'    # forward or backward
    start, end: float  # list-scheduled times in the problem's time unit

Invariants (checked by `from_order` and `from_json`): on device d the actor tasks have stage d;
the critic tasks have replica d // Pc and stage Pc-1-(d mod Pc); each (model, replica, stage,
microbatch, kind) appears exactly once; executing each device's list in order, with a task
waiting for its dependency (graph.py), finishes without deadlock. An executor needs only the
order: the times say how long each device idles in a cost model and order ticks.

JSON (`to_json` / `from_json`): {"problem": {...PipelineProblem fields}, "makespan": x,
"peak_memory": [...], "budget": [...], "devices": [[{"model", "replica", "stage", "microbatch",
"kind", "start", "end"}, ...], ...]}.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import numpy as np

from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import (AB, AF, CB, CF, KIND_NAMES, PipelineProblem,
                                        validate_order)

_KIND_OF = {("actor", "F"): AF, ("actor", "B"): AB, ("critic", "F"): CF, ("critic", "B"): CB}


@dataclasses.dataclass(frozen=True)
class Task:
  model: str
  replica: int
  stage: int
  microbatch: int
  kind: str
  start: float
  end: float

  def __post_init__(self):
    if (self.model, self.kind) not in _KIND_OF:
      raise ValueError(f"task model={self.model!r} kind={self.kind!r}; expected model in "
                       "('actor', 'critic') and kind in ('F', 'B')")


@dataclasses.dataclass(frozen=True)
class Schedule:
  problem: PipelineProblem
  devices: tuple[tuple[Task, ...], ...]
  makespan: float
  peaks: tuple[float, ...]
  budget: tuple[float, ...]

  @property
  def within_budget(self) -> bool:
    return not self.over_budget()

  def over_budget(self) -> str:
    """'device d: peak > budget; ...' for each device whose peak exceeds its budget ("" when
    none does)."""
    return "; ".join(f"device {d}: {p:g} > {b:g}"
                     for d, (p, b) in enumerate(zip(self.peaks, self.budget)) if p > b + 1e-9)

  def order(self) -> np.ndarray:
    """The per-device kind order, int8 [N, T] (graph.py codes)."""
    return np.array([[_KIND_OF[(t.model, t.kind)] for t in dev] for dev in self.devices],
                    dtype=np.int8)

  def starts(self) -> dict[tuple[int, int, int], float]:
    """{(kind, device, microbatch): start} of every task: the key the CP model's starts use."""
    return {(_KIND_OF[(t.model, t.kind)], d, t.microbatch): t.start
            for d, dev in enumerate(self.devices) for t in dev}

  def to_dict(self) -> dict[str, Any]:
    return {"problem": self.problem.to_dict(), "makespan": self.makespan,
            "peak_memory": list(self.peaks), "budget": list(self.budget),
            "devices": [[dataclasses.asdict(t) for t in dev] for dev in self.devices]}

  def to_json(self) -> str:
    return json.dumps(self.to_dict())


def deadlock_reason(problem: PipelineProblem, order: np.ndarray) -> str:
  """Why a valid-shaped `order` deadlocks: the first backward placed before its own forward on
  the same device (micro-batches count in order on each device), which a hand-edited file
  makes; else the cyclic wait between devices. (Every such order was said to deadlock
  "between devices", naming no device or task.)"""
  for d in range(problem.num_devices):
    forwards, backwards = {AF: 0, CF: 0}, {AB: 0, CB: 0}
    for p, k in enumerate(order[d].tolist()):
      if k in forwards:
        forwards[k] += 1
        continue
      forward = AF if k == AB else CF
      if backwards[k] >= forwards[forward]:
        return (f"order deadlocks: on device {d}, position {p}, the "
                f"{'actor' if k == AB else 'critic'} backward of micro-batch {backwards[k]} "
                "comes before its own forward (on the same device)")
      backwards[k] += 1
  return ("order deadlocks (cyclic wait between devices: a task waits on another device's, "
          "which waits on it in turn)")


def from_order(problem: PipelineProblem, order: np.ndarray) -> Schedule:
  """Times an order and labels every task; raises ValueError on a deadlock."""
  order = validate_order(problem, order)
  ev = evaluate(problem, order)
  if not ev.valid:
    raise ValueError(deadlock_reason(problem, order))
  devices = []
  for d in range(problem.num_devices):
    cnt = [0, 0, 0, 0]
    tasks = []
    for p, k in enumerate(order[d].tolist()):
      actor = k in (AF, AB)
      tasks.append(Task(model="actor" if actor else "critic",
                        replica=0 if actor else problem.critic_replica(d),
                        stage=problem.actor_stage(d) if actor else problem.critic_stage(d),
                        microbatch=cnt[k], kind="F" if k in (AF, CF) else "B",
                        start=float(ev.starts[d, p]), end=float(ev.ends[d, p])))
      cnt[k] += 1
    devices.append(tuple(tasks))
  return Schedule(problem=problem, devices=tuple(devices), makespan=ev.makespan,
                  peaks=tuple(float(x) for x in ev.peaks),
                  budget=tuple(float(x) for x in ev.budget))


def from_dict(data: dict[str, Any]) -> Schedule:
  """Rebuilds a Schedule; the order is re-timed and checked against the stored labels."""
  problem = PipelineProblem.from_dict(data["problem"])
  devs = data["devices"]
  if len(devs) != problem.num_devices:
    raise ValueError(f"schedule has {len(devs)} devices; the problem has {problem.num_devices}")
  for d, dev in enumerate(devs):  # a KeyError ('Actor', 'F') named neither device nor task
    for q, t in enumerate(dev):
      missing = [k for k in ("model", "kind", "replica", "stage", "microbatch")
                 if not isinstance(t, dict) or k not in t]
      if missing or (t["model"], t["kind"]) not in _KIND_OF:
        raise ValueError(f"device {d}, task {q}: {t!r}; expected a dict with model in "
                         "('actor', 'critic'), kind in ('F', 'B'), replica, stage, microbatch")
  kinds = [[_KIND_OF[(t["model"], t["kind"])] for t in dev] for dev in devs]
  counts = problem.kind_counts()  # a task left out or twice: numpy's "inhomogeneous shape"
  for d, dev in enumerate(kinds):
    got = np.bincount(dev, minlength=4)
    if np.any(got != counts):
      name = lambda c: ", ".join(f"{int(n)} {k}" for k, n in zip(KIND_NAMES, c))
      raise ValueError(f"device {d} has {len(dev)} tasks ({name(got)}); expected "
                       f"{int(counts.sum())} ({name(counts)}: each micro-batch's forward and "
                       "backward of the device's actor and critic stages, once)")
  order = np.array(kinds, dtype=np.int8)
  sched = from_order(problem, order)
  for d, (dev, ref) in enumerate(zip(devs, sched.devices)):
    for t, r in zip(dev, ref):
      if (t["replica"], t["stage"], t["microbatch"]) != (r.replica, r.stage, r.microbatch):
        raise ValueError(f"device {d}: task {t} does not match the placement/canonical order "
                         f"(expected replica={r.replica}, stage={r.stage}, "
                         f"microbatch={r.microbatch})")
  return sched


def from_json(text: str) -> Schedule:
  return from_dict(json.loads(text))


def load(path: str, problem: Optional[PipelineProblem] = None) -> Schedule:
  """Reads a schedule.json; with `problem`, checks the schedule is one of that problem. A file
  that is not one (a directory, empty or cut JSON, a result.json) is a ValueError naming it
  (a JSONDecodeError, KeyError or TypeError traceback before)."""
  try:
    with open(path) as f:
      sched = from_json(f.read())
  except Exception as e:  # noqa: BLE001 whatever a file that is not a schedule raises
    raise ValueError(f"{path}: not a schedule.json (a schedule binary's, e.g. "
                     f"WORKDIR/schedule.json): {type(e).__name__}: {e}") from None
  if problem is not None and sched.problem != problem:
    raise ValueError(f"{path}: a schedule of {sched.problem.to_dict()}, not of the expected "
                     f"problem {problem.to_dict()}")
  return sched


def band_pins(sched: Schedule, t1: float, t2: float, move: float, slope: float = 0.0,
              index_shift: tuple[int, int] = (0, 0)) -> dict[tuple[int, int, int], float]:
  """Start times that keep `sched` outside a band: {(kind, device, microbatch): start}.

  On device d the band is [t1 + slope * d, t2 + slope * d). Tasks starting before it keep their
  start; tasks starting at or after it start `move` later (negative: earlier) and take micro-batch
  index + index_shift (actor, critic); tasks in the band are left out (free). Pinning these and
  re-solving the band asks whether the schedule can be repaired locally (move < 0, see
  `splice_pins`) or grown: with index_shift = (0, E) and move = E * (critic fwd + bwd), the
  band also holds E new critic micro-batches of a larger instance (grow.py). A moved task may
  start before a kept predecessor ends (a band narrower than |move|); the solver then finds the
  pins contradictory and says so.
  """
  if not t1 <= t2:
    raise ValueError(f"band [{t1}, {t2}): expected t1 <= t2")
  if any(not isinstance(s, (int, np.integer)) or s < 0 for s in index_shift):
    raise ValueError(f"index_shift={index_shift}: expected two non-negative integers")
  pins = {}
  for (kind, d, j), start in sched.starts().items():
    if start < t1 + slope * d:
      pins[kind, d, j] = start
    elif start >= t2 + slope * d:
      pins[kind, d, j + index_shift[kind // 2]] = start + move
  return pins


def splice_pins(sched: Schedule, t1: float, t2: float, shift: float
                ) -> dict[tuple[int, int, int], float]:
  """Start times that keep `sched` outside the band [t1, t2): {(kind, device, microbatch): start}.

  Tasks starting before t1 keep their start; tasks starting at or after t2 start `shift` earlier;
  tasks in the band are left out (free). Pinning these and re-solving the band at makespan −
  shift asks whether the schedule can be repaired locally (schedule_cp_check --splice). Every
  successor of a task starts later, so no pinned task waits on a free one in the head, nor a free
  one on a moved one; but a moved task may now start before a kept predecessor ends (a band
  narrower than the shift), in which case the pins alone are contradictory and the solver says so.
  """
  if not (t1 <= t2 and shift >= 0):
    raise ValueError(f"splice band [{t1}, {t2}) with shift {shift}: expected t1 <= t2, shift >= 0")
  return band_pins(sched, t1, t2, -shift)
