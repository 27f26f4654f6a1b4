"""Compiling a fused actor/critic schedule into a lockstep instruction table (plain numpy).

The executor (executor.py) runs every device of the pipeline axis in lockstep: at each *tick*
every device runs at most one task, then the two pipeline channels move one message each
(`up`: device d -> d+1, `down`: d -> d-1). A schedule (graph.py: per-device kind order, int8
[N, T], micro-batches of one kind in increasing order) becomes a table [N, ticks, FIELDS]:

- Ticks come from an ASAP topological leveling of the schedule's task graph with unit steps:
  tick(task) = 1 + max(tick(previous task on its device), tick(its dependency)). A message sent
  at tick t is received at the end of tick t, so any consumer at a later tick sees it; every
  sender and receiver agree because both read the same table. A cyclic wait leaves tasks
  unleveled: the schedule deadlocks and is rejected. With `barrier=True` no critic task starts
  before every actor task is done (the serial baseline of docs/architecture.md §3: actor 1F1B, then
  critic 1F1B).
- Directions (docs/architecture.md §3 placement): the actor's forward activations go up and its
gradients go
  down; the critic runs reversed (stage s of replica r on device r*Pc + Pc-1-s), so its
  activations go down and its gradients go up. One task sends at most one message.
- Buffers are rings indexed by (micro-batch mod size): per model a *stash* of stage inputs held
  from the forward to the backward (sized by the schedule's peak in-flight micro-batches, which
  is what its memory model counts), and four *inboxes* for messages received but not yet used.
  Both forwards and backwards of one model run in micro-batch order on a device, so the live
  entries of a ring always form a contiguous range of micro-batches and `m mod size` never
  collides; `_check_rings` verifies it anyway on the concrete table.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from rlhfuse_jax.pipeline.graph import (AB, AF, CB, CF, KIND_NAMES, PipelineProblem,
                                        validate_order)

# Fields of one table row (one device, one tick).
MODEL = 0       # 0 idle, 1 actor, 2 critic (the executor's switch branch)
BACKWARD = 1    # 0 forward, 1 backward
FIRST = 2       # the task's stage is its model's first (embeds tokens, sends no gradient)
LAST = 3        # its model's last stage (head and loss, sends no activation)
MICRO = 4       # data micro-batch of the task (critic: replica * Mc + local micro-batch)
STASH_SLOT = 5  # ring slot of the task's stashed stage input
INBOX_SLOT = 6  # ring slot of the message the task consumes
UP_RECV = 7     # what arrives on the up channel at the end of the tick (RECV_* codes)
UP_SLOT = 8
DOWN_RECV = 9   # what arrives on the down channel
DOWN_SLOT = 10
FIELDS = 11
IDLE, ACTOR, CRITIC = 0, 1, 2

# Arrival codes. Up channel: actor activations and critic gradients; down: the other two.
RECV_NONE, RECV_ACT, RECV_GRAD = 0, 1, 2

# Inbox index per kind: the message that kind consumes (actor/critic activation/gradient).
INBOXES = ("actor_act", "actor_grad", "critic_act", "critic_grad")


@dataclasses.dataclass(frozen=True)
class Task:
  """Where a task sits in its model's pipeline."""
  kind: int     # AF, AB, CF, CB
  first: bool   # first stage of its model: embeds tokens, sends no gradient
  last: bool    # last stage: head and loss, sends no activation


@dataclasses.dataclass(frozen=True)
class ProgramShape:
  """What the compiled executor depends on besides the table's contents: schedules with equal
  shapes (and problems) share one compiled program."""
  ticks: int
  stash_sizes: tuple   # (actor, critic)
  inbox_sizes: tuple   # per INBOXES entry


def common_shape(*programs: "Program") -> ProgramShape:
  """The smallest shape that holds every given program (pass it to build_program(min_shape=))."""
  return ProgramShape(
      ticks=max(p.ticks for p in programs),
      stash_sizes=tuple(max(s) for s in zip(*(p.stash_sizes for p in programs))),
      inbox_sizes=tuple(max(s) for s in zip(*(p.inbox_sizes for p in programs))))


@dataclasses.dataclass(frozen=True)
class Program:
  """A schedule compiled for the lockstep executor."""
  problem: PipelineProblem
  order: np.ndarray             # int8 [N, T] the schedule it was built from
  table: np.ndarray             # int32 [N, ticks, FIELDS]
  task_tick: np.ndarray         # int32 [N, T] tick of the task at each order position
  stash_peaks: np.ndarray       # int [N, 2] peak in-flight micro-batches (actor, critic)
  stash_sizes: tuple            # (actor, critic) ring sizes: max peak of non-first stages, >= 1
  inbox_sizes: tuple            # ring size per INBOXES entry (>= 1)
  barrier: bool

  @property
  def num_devices(self) -> int:
    return self.table.shape[0]

  @property
  def ticks(self) -> int:
    return self.table.shape[1]

  @property
  def shape(self) -> ProgramShape:
    return ProgramShape(self.ticks, self.stash_sizes, self.inbox_sizes)

  def busy_ticks(self) -> np.ndarray:
    """[N] ticks each device runs a task (equal on all devices: 2 Ma + 2 Mc)."""
    return (self.table[:, :, MODEL] != IDLE).sum(axis=1)

  def lockstep_time(self) -> float:
    """Makespan in the problem's time units if each tick lasts as long as its longest task."""
    durs = self.problem.durations()
    longest = np.zeros(self.ticks)
    for d in range(self.num_devices):
      for p, k in enumerate(self.order[d]):
        t = self.task_tick[d, p]
        longest[t] = max(longest[t], durs[k])
    return float(longest.sum())

  def summary(self) -> dict:
    """JSON-friendly description (for result files)."""
    return {
        "ticks": self.ticks,
        "busy_ticks_per_device": self.busy_ticks().tolist(),
        "lockstep_time": self.lockstep_time(),
        "stash_peaks_per_device": {"actor": self.stash_peaks[:, 0].tolist(),
                                   "critic": self.stash_peaks[:, 1].tolist()},
        "stash_sizes": {"actor": self.stash_sizes[0], "critic": self.stash_sizes[1]},
        "inbox_sizes": dict(zip(INBOXES, self.inbox_sizes)),
        "barrier": self.barrier,
    }


def _task_ids(problem: PipelineProblem, order: np.ndarray) -> np.ndarray:
  """[N, T] micro-batch (per device, per kind, in order) of the task at each position."""
  n, t = order.shape
  micro = np.zeros((n, t), dtype=np.int64)
  for d in range(n):
    cnt = [0, 0, 0, 0]
    for p in range(t):
      k = int(order[d, p])
      micro[d, p] = cnt[k]
      cnt[k] += 1
  return micro


def _dependency(problem: PipelineProblem, d: int, k: int, m: int) -> Optional[tuple]:
  """(kind, device, micro) the task (d, k, m) waits for, or None (graph.py's dependencies)."""
  n, pc = problem.num_devices, problem.critic_pp
  c = problem.critic_stage(d)
  if k == AF:
    return (AF, d - 1, m) if d > 0 else None
  if k == AB:
    return (AB, d + 1, m) if d < n - 1 else (AF, d, m)
  if k == CF:
    return (CF, d + 1, m) if c > 0 else None
  return (CB, d - 1, m) if c < pc - 1 else (CF, d, m)


def level_ticks(problem: PipelineProblem, order: np.ndarray, barrier: bool = False) -> np.ndarray:
  """ASAP unit-step leveling: int [N, T] tick of each task. Raises on a deadlocked order."""
  order = validate_order(problem, order)
  n, t = order.shape
  micro = _task_ids(problem, order)
  tick = np.full((n, t), -1, dtype=np.int64)
  done_at = {}  # (kind, device, micro) -> tick
  pos = [0] * n
  actor_left = n * 2 * problem.actor_microbatches
  actor_end = -1
  remaining = n * t
  while remaining:
    progress = False
    for d in range(n):
      while pos[d] < t:
        p = pos[d]
        k, m = int(order[d, p]), int(micro[d, p])
        dep = _dependency(problem, d, k, m)
        if dep is not None and dep not in done_at:
          break
        if barrier and k in (CF, CB) and actor_left:
          break
        earliest = 0 if p == 0 else tick[d, p - 1] + 1
        if dep is not None:
          earliest = max(earliest, done_at[dep] + 1)
        if barrier and k in (CF, CB):
          earliest = max(earliest, actor_end + 1)
        tick[d, p] = earliest
        done_at[(k, d, m)] = earliest
        if k in (AF, AB):
          actor_left -= 1
          actor_end = max(actor_end, earliest)
        pos[d] += 1
        remaining -= 1
        progress = True
    if not progress:
      stuck = {d: f"{KIND_NAMES[order[d, pos[d]]]}#{micro[d, pos[d]]}" for d in range(n)
               if pos[d] < t}
      why = (" (barrier=True needs every device to run all its actor tasks before any critic "
             "task)" if barrier else "")
      raise ValueError(f"schedule deadlocks: no device can run its next task{why}; next tasks "
                       f"per device: {stuck}")
  return tick


def _stash_peaks(order: np.ndarray) -> np.ndarray:
  """[N, 2] peak number of micro-batches between forward and backward, per model."""
  n = order.shape[0]
  peaks = np.zeros((n, 2), dtype=np.int64)
  for d in range(n):
    cur = [0, 0]
    for k in order[d]:
      model = int(k) // 2
      cur[model] += 1 if int(k) % 2 == 0 else -1
      peaks[d, model] = max(peaks[d, model], cur[model])
  return peaks


def _check_rings(events: list, size: int, what: str) -> None:
  """events: (tick, phase, micro, +1 write / -1 read); phase 0 = compute, 1 = receive."""
  live = {}
  for tick, phase, m, op in sorted(events):
    slot = m % size
    if op > 0:
      if slot in live:
        raise AssertionError(f"{what}: slot {slot} overwritten at tick {tick} (micro {m} over "
                             f"{live[slot]})")
      live[slot] = m
    else:
      if live.get(slot) != m:
        raise AssertionError(f"{what}: micro {m} read at tick {tick} from slot {slot} holding "
                             f"{live.get(slot)}")
      del live[slot]


def _ring_size(events: list) -> int:
  """Max live entries; reads (compute phase) free a slot before the same tick's arrivals."""
  live = best = 0
  for _, _, _, op in sorted(events):
    live += op
    best = max(best, live)
  return max(best, 1)


def build_program(problem: PipelineProblem, order: np.ndarray, barrier: bool = False,
                  min_shape: Optional[ProgramShape] = None) -> Program:
  """Compiles a valid schedule into the executor's instruction table (see module docstring).

  `min_shape` enlarges the table (idle ticks at the end) and the rings to at least that shape,
  so that several schedules can run through one compiled executor.
  """
  order = validate_order(problem, order)
  n, t = order.shape
  pa, pc, mc = problem.actor_pp, problem.critic_pp, problem.critic_microbatches
  tick = level_ticks(problem, order, barrier)
  micro = _task_ids(problem, order)
  ticks = int(tick.max()) + 1
  if min_shape is not None:
    ticks = max(ticks, min_shape.ticks)

  def task_of(d: int, k: int) -> Task:
    if k in (AF, AB):
      return Task(k, first=d == 0, last=d == pa - 1)
    c = problem.critic_stage(d)
    return Task(k, first=c == 0, last=c == pc - 1)

  # Ring events per device: stash (per model) and inboxes (per INBOXES entry).
  stash_ev = [[[] for _ in range(2)] for _ in range(n)]
  inbox_ev = [[[] for _ in range(4)] for _ in range(n)]
  arrivals = []  # (receiver, tick, channel 'up'/'down', recv code, inbox index, micro)
  for d in range(n):
    for p in range(t):
      k, m, tk = int(order[d, p]), int(micro[d, p]), int(tick[d, p])
      task = task_of(d, k)
      model = k // 2
      fwd = k % 2 == 0
      # Stage inputs are stashed by the forwards of non-first stages, read by their backwards.
      if not task.first:
        stash_ev[d][model].append((tk, 0, m, +1 if fwd else -1))
      # Messages consumed: forwards of non-first stages read an activation, backwards of
      # non-last stages a gradient.
      consumes = (fwd and not task.first) or (not fwd and not task.last)
      if consumes:
        inbox_ev[d][k].append((tk, 0, m, -1))
      # Messages sent: forwards of non-last stages, backwards of non-first stages.
      sends = (fwd and not task.last) or (not fwd and not task.first)
      if sends:
        up = k in (AF, CB)
        to = d + 1 if up else d - 1
        code = RECV_ACT if fwd else RECV_GRAD
        arrivals.append((to, tk, "up" if up else "down", code, k, m))
        inbox_ev[to][k].append((tk, 1, m, +1))
  stash_peaks = _stash_peaks(order)
  # First stages read tokens, not a stash: the rings are sized by the other devices' peaks.
  stashing = [[d for d in range(n) if d > 0],
              [d for d in range(n) if problem.critic_stage(d) > 0]]
  stash_sizes = tuple(max([int(stash_peaks[d, i]) for d in stashing[i]] + [1]) for i in range(2))
  inbox_sizes = tuple(max(_ring_size(inbox_ev[d][i]) for d in range(n)) for i in range(4))
  if min_shape is not None:
    stash_sizes = tuple(max(a, b) for a, b in zip(stash_sizes, min_shape.stash_sizes))
    inbox_sizes = tuple(max(a, b) for a, b in zip(inbox_sizes, min_shape.inbox_sizes))
  for d in range(n):
    for i in range(2):
      _check_rings(stash_ev[d][i], stash_sizes[i], f"device {d} {('actor', 'critic')[i]} stash")
    for i in range(4):
      _check_rings(inbox_ev[d][i], inbox_sizes[i], f"device {d} {INBOXES[i]} inbox")

  table = np.zeros((n, ticks, FIELDS), dtype=np.int32)
  for d in range(n):
    for p in range(t):
      k, m, tk = int(order[d, p]), int(micro[d, p]), int(tick[d, p])
      row = table[d, tk]
      task = task_of(d, k)
      row[MODEL] = ACTOR if k in (AF, AB) else CRITIC
      row[BACKWARD] = k in (AB, CB)
      row[FIRST] = task.first
      row[LAST] = task.last
      row[MICRO] = m if k in (AF, AB) else problem.critic_replica(d) * mc + m
      row[STASH_SLOT] = m % stash_sizes[k // 2]
      row[INBOX_SLOT] = m % inbox_sizes[k]
  for to, tk, channel, code, k, m in arrivals:
    row = table[to, tk]
    f_code, f_slot = (UP_RECV, UP_SLOT) if channel == "up" else (DOWN_RECV, DOWN_SLOT)
    assert row[f_code] == RECV_NONE, "two messages on one channel in one tick"
    row[f_code] = code
    row[f_slot] = m % inbox_sizes[k]
  return Program(problem=problem, order=order, table=table,
                 task_tick=tick.astype(np.int32), stash_peaks=stash_peaks,
                 stash_sizes=stash_sizes, inbox_sizes=inbox_sizes, barrier=barrier)


def from_schedule(schedule, barrier: bool = False,
                  min_shape: Optional[ProgramShape] = None) -> Program:
  """build_program for a schedule.Schedule (what the search and schedule.json hold)."""
  return build_program(schedule.problem, schedule.order(), barrier, min_shape)
