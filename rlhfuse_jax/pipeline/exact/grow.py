"""Growing a schedule of an instance into one of the same instance with more micro-batches.

Why: on the larger reference instances a schedule at the tight bound is out of reach of both the
search and a CP-SAT model of the whole instance (e6: 3072 tasks, best 622 against the bound 618
after hours of minimisation), while the half-size instance with the same pipelines and budgets
(e7) is solved at its bound. The larger instance's bound is the smaller one's plus the extra work
per device (same head and tail on the tight device), so a schedule at the bound can be the small
schedule with that work inserted and no idle time added on the tight device.

Two steps, each a restriction (what they build is checked; a failure proves nothing):

1. `insert_pairs` (exact, order level): where one model runs a 1F1B steady state (a forward and a
   backward alternating on every device), more micro-batches of that model fit in as more
   forward/backward pairs. They go in at a cut that is "diagonal" in time (device d at time
   T + slope * d, so each pipeline's dependencies cross the cut one way); a cut is accepted when
   the list-scheduled result is valid, within budget and at most `extra * (fwd + bwd)` longer,
   i.e. nothing but the inserted work was added (list scheduling the grown order can also close
   idle time of the original: a fuzz found grown schedules shorter than that, some as short as
   the original).
2. The other model's extra micro-batches cannot be inserted that way when it has no steady state
   (in e7's schedule at its bound the critic runs only in the warm-up and the drain, frozen
   in between). `schedule.band_pins` then pins the schedule before a band and shifts it after the
   band by that work, and CP-SAT re-solves the band with the new micro-batches in it
   (experiments/schedule_cp_check.py --grow). `grow_pins` does both: actor pairs where the actor
   has a steady state, everything else into the band.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from rlhfuse_jax.pipeline import schedule
from rlhfuse_jax.pipeline.evaluate import Evaluator, evaluate
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem, validate_order

_MICROBATCH_FIELDS = ("actor_microbatches", "critic_microbatches")


def check_grows(small: PipelineProblem, big: PipelineProblem) -> tuple[int, int]:
  """Extra (actor, critic) micro-batches from `small` to `big`; ValueError naming the field if
  the two differ in anything but more micro-batches (durations, memory and budget included)."""
  a, b = small.to_dict(), big.to_dict()
  for name in a:
    if name not in _MICROBATCH_FIELDS and a[name] != b[name]:
      raise ValueError(f"cannot grow a schedule of {name}={a[name]} into one of "
                       f"{name}={b[name]}: only the micro-batch counts may differ")
  if not np.array_equal(small.budget(), big.budget()):
    raise ValueError(f"memory budgets differ ({small.budget().tolist()} vs "
                     f"{big.budget().tolist()}): only the micro-batch counts may differ")
  extra = tuple(b[name] - a[name] for name in _MICROBATCH_FIELDS)
  for name, e in zip(_MICROBATCH_FIELDS, extra):
    if e < 0:
      raise ValueError(f"{name}: {a[name]} -> {b[name]}; a schedule can only grow")
  return extra


@dataclasses.dataclass(frozen=True)
class Cut:
  """Where `insert_pairs` put the new pairs: before the first task of device d that starts at
  or after time + slope * d in the original schedule."""
  time: float
  slope: float
  block: str        # "FB" (forward first) or "BF"
  positions: tuple[int, ...]


def insert_pairs(problem: PipelineProblem, order: np.ndarray, model: str, extra: int
                 ) -> tuple[PipelineProblem, np.ndarray, Cut]:
  """Inserts `extra` forward/backward pairs of `model` on every device at the first cut that
  lengthens the schedule by at most their work and keeps it valid and within budget.

  Cuts are tried in a fixed order (time ascending from 0 in steps of the smallest duration; then
  slopes -3f .. 3f, f the model's forward time; then "FB" before "BF"), so the result is
  deterministic. Returns the grown problem, its order [N, T + 2 * extra] and the cut; raises
  ValueError when no cut works (the model has no steady state to extend).
  """
  if model not in ("actor", "critic"):
    raise ValueError(f"model={model!r}; expected 'actor' or 'critic'")
  if not (isinstance(extra, (int, np.integer)) and extra >= 1):
    raise ValueError(f"extra={extra!r} must be a positive integer")
  order = validate_order(problem, order)
  ev0 = evaluate(problem, order)
  if not (ev0.valid and ev0.within_budget):
    raise ValueError("insert_pairs needs a valid schedule within the memory budget")
  name = f"{model}_microbatches"
  big = dataclasses.replace(problem, **{name: getattr(problem, name) + extra})
  fwd, bwd = (AF, AB) if model == "actor" else (CF, CB)
  f, b = problem.duration(fwd), problem.duration(bwd)
  target = ev0.makespan + extra * (f + b)
  starts = ev0.starts  # [N, T]
  step = min(problem.durations())
  evaluator = Evaluator(big)
  n = problem.num_devices
  for i in range(int(math.floor(ev0.makespan / step)) + 1):
    t = i * step
    for slope in (k * f for k in range(-3, 4)):
      positions = tuple(int(np.searchsorted(starts[d], t + slope * d)) for d in range(n))
      for label, pair in (("FB", (fwd, bwd)), ("BF", (bwd, fwd))):
        block = np.tile(np.array(pair, dtype=np.int8), extra)  # [2 * extra]
        grown = np.ascontiguousarray(np.stack([
            np.concatenate([order[d, :positions[d]], block, order[d, positions[d]:]])
            for d in range(n)]))  # [N, T + 2 * extra]
        ok, makespan, _ = evaluator.timing(grown)
        if (ok and makespan <= target + 1e-9 and
            np.all(evaluator.peak(grown) <= evaluator.budget + 1e-9)):
          return big, grown, Cut(time=float(t), slope=float(slope), block=label,
                                 positions=positions)
  raise ValueError(f"no cut of the schedule takes {extra} more {model} forward/backward pairs "
                   f"within budget without lengthening it by more than their work "
                   f"({extra} x {f + b:g}): the {model} has no steady state to extend")


def grow_pins(kept: schedule.Schedule, problem: PipelineProblem, t1: float, t2: float,
              slope: float = 0.0) -> tuple[dict[tuple[int, int, int], float], dict]:
  """Pins of `problem` that grow `kept`, a schedule of the same instance with fewer
  micro-batches: the extra actor micro-batches as 1F1B pairs (`insert_pairs`) where the actor has
  a steady state to extend, else with the critic's; the extra critic ones (and those actor ones)
  left free in the band [t1 + slope*d, t2 + slope*d) of that schedule, everything after the band
  moved later by their work and renumbered (`schedule.band_pins`).

  Returns ({(kind, device, microbatch): start}, info) where info records what was done and
  info["target"] is the grown makespan (the kept one plus the extra work per device).
  """
  extra_actor, extra_critic = check_grows(kept.problem, problem)
  info = {"from_makespan": kept.makespan, "extra_actor": extra_actor,
          "extra_critic": extra_critic}
  mid, in_band = kept, 0
  if extra_actor:
    try:
      mid_problem, mid_order, cut = insert_pairs(kept.problem, kept.order(), "actor",
                                                 extra_actor)
    except ValueError as e:
      in_band = extra_actor
      info["actor_pairs"] = f"none, the actor's micro-batches go into the band ({e})"
    else:
      mid = schedule.from_order(mid_problem, mid_order)
      info["actor_pairs"] = {"cut_time": cut.time, "cut_slope": cut.slope, "block": cut.block,
                             "makespan": mid.makespan}
  move = (in_band * (problem.actor_fwd + problem.actor_bwd) +
          extra_critic * (problem.critic_fwd + problem.critic_bwd))
  pins = schedule.band_pins(mid, t1, t2, move, slope, index_shift=(in_band, extra_critic))
  info.update(band={"t1": t1, "t2": t2, "slope": slope}, move=move, target=mid.makespan + move)
  return pins, info
