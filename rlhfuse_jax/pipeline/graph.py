"""The fused actor/critic pipeline problem: placement, tasks, dependencies, durations, memory.

Idea (docs/architecture.md §3, intra-stage fusion): N devices along a pipeline axis. The actor has
Pa = N stages, stage a on device a (forward goes 0 -> N-1). The critic has Pc stages (Pa divisible
by Pc) and R = N / Pc data-parallel replicas; replica r occupies devices r*Pc .. r*Pc+Pc-1 in
**reverse** order (critic stage s of replica r on device r*Pc + Pc-1-s), so the actor's warm-up
devices are the critic's drain devices and the two pipelines fill each other's bubbles.

Every device therefore hosts exactly one actor stage and one critic stage (of one replica), and
holds 2*Ma + 2*Mc tasks. A task is one of four kinds, coded as small integers everywhere in the
scheduling code (numba kernels included):

  AF = 0 actor forward    AB = 1 actor backward    CF = 2 critic forward    CB = 3 critic backward

Micro-batches of one kind run in increasing order on a device (the canonical order: micro-batches
are interchangeable, so permuting them gains nothing), hence a device's schedule is fully given by
its sequence of kinds; the j-th AF in a device's sequence is actor forward of micro-batch j.

Dependencies (one per task at most): F(s, j) after F(s-1, j); B(last, j) after F(last, j) on the
same device; B(s, j) after B(s+1, j). A dependency between two devices adds `transfer_latency`.

Memory: a forward holds its activations (`actor_mem` / `critic_mem` per micro-batch) on its device
until its backward ends. The budget comes from the two models' 1F1B peaks (stage s of a P-stage
1F1B pipeline with M micro-batches holds min(P-s, M)), by `memory_budget_mode`:

  per_device  device d holds at most the sum of the actor's and the critic's peaks on d;
  uniform     every device holds at most the largest of those sums (every device has the same
              HBM). The sum provisions both models' in-flight activations at once. Serial 1F1B
              (actor, then critic) holds only the larger of the two at any time, so a fused
              schedule within this budget may hold more than serial does: the kept schedules
              peak 1.03-1.10x serial's largest device (docs/schedules.md).

An explicit `memory_budget` overrides the mode (recorded as mode "explicit").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from rlhfuse_jax import fields

AF, AB, CF, CB = 0, 1, 2, 3
KIND_NAMES = ("AF", "AB", "CF", "CB")
# memory_budget_mode values. PER_DEVICE is the dataclass default because a problem stored before
# the mode existed (schedule.json, cache keys, certificates' configs) was made under it and must
# keep its meaning when read back; the tools that build new problems (configs/schedule_search.py,
# from_config) default to UNIFORM. EXPLICIT is what any problem with a `memory_budget` records.
UNIFORM, PER_DEVICE, EXPLICIT = "uniform", "per_device", "explicit"
BUDGET_MODES = (UNIFORM, PER_DEVICE)


@dataclasses.dataclass(frozen=True)
class PipelineProblem:
  """One fused-schedule instance. Times and memory are in arbitrary consistent units.

  actor_bwd / critic_bwd / actor_mem / critic_mem left at None take their defaults: backward
  = 2 x forward, activation memory per micro-batch = forward time (memory proportional to compute).
  memory_budget None means the budget of `memory_budget_mode` (module docstring): "per_device"
  (the default here, so that a problem read from a file written before the mode existed keeps
  the budget it was made under) or "uniform" (the default of the tools that build problems).
  A given memory_budget overrides the mode, and the mode is then recorded as "explicit", so two
  problems with the same explicit budget are equal whatever mode they were built with.
  """
  actor_pp: int
  critic_pp: int
  actor_microbatches: int
  critic_microbatches: int
  actor_fwd: float
  critic_fwd: float
  actor_bwd: Optional[float] = None
  critic_bwd: Optional[float] = None
  actor_mem: Optional[float] = None
  critic_mem: Optional[float] = None
  transfer_latency: float = 0.0
  memory_budget: Optional[tuple[float, ...]] = None
  memory_budget_mode: str = PER_DEVICE

  def __post_init__(self):
    for name in ("actor_pp", "critic_pp", "actor_microbatches", "critic_microbatches"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    if self.critic_pp > self.actor_pp:
      raise ValueError(
          f"critic_pp={self.critic_pp} exceeds actor_pp={self.actor_pp}: the pipeline axis has "
          "actor_pp devices, so the critic cannot have more stages than devices")
    if self.actor_pp % self.critic_pp != 0:
      raise ValueError(
          f"actor_pp={self.actor_pp} must be divisible by critic_pp={self.critic_pp} "
          "(the critic is replicated R = actor_pp / critic_pp times over the actor's devices)")
    for name in ("actor_fwd", "critic_fwd"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float, np.number)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={v!r} must be a positive finite number")
    # Defaults are resolved here so every consumer sees concrete numbers; None or a negative
    # value (the config files' sentinel) means "use the default".
    for name, default in (("actor_bwd", 2.0 * self.actor_fwd),
                          ("critic_bwd", 2.0 * self.critic_fwd),
                          ("actor_mem", float(self.actor_fwd)),
                          ("critic_mem", float(self.critic_fwd))):
      v = getattr(self, name)
      if v is not None and not fields.is_numeric(v):
        raise ValueError(f"{name}={v!r} must be a number (or None / negative for the default)")
      if v is None or v < 0:
        object.__setattr__(self, name, float(default))
        continue
      positive = name.endswith("bwd")
      if not math.isfinite(v) or (positive and v == 0):
        raise ValueError(f"{name}={v!r} must be a {'positive' if positive else 'non-negative'} "
                         "finite number (or None / negative for the default)")
      object.__setattr__(self, name, float(v))
    object.__setattr__(self, "actor_fwd", float(self.actor_fwd))
    object.__setattr__(self, "critic_fwd", float(self.critic_fwd))
    if not (fields.is_numeric(self.transfer_latency) and math.isfinite(self.transfer_latency)
            and self.transfer_latency >= 0):
      raise ValueError(f"transfer_latency={self.transfer_latency!r} must be a non-negative number")
    object.__setattr__(self, "transfer_latency", float(self.transfer_latency))
    if self.memory_budget is not None:
      if not isinstance(self.memory_budget, (tuple, list, np.ndarray)) or not all(
          fields.is_numeric(b) for b in self.memory_budget):
        raise ValueError(f"memory_budget={self.memory_budget!r} must be a sequence of numbers "
                         f"(1 entry, or num_devices={self.num_devices})")
      budget = tuple(float(b) for b in self.memory_budget)
      if len(budget) == 1:
        budget = budget * self.num_devices
      if len(budget) != self.num_devices:
        raise ValueError(f"memory_budget has {len(budget)} entries; expected 1 or "
                         f"num_devices={self.num_devices}")
      if any(b < 0 or not math.isfinite(b) for b in budget):
        raise ValueError(f"memory_budget={budget} must be non-negative and finite")
      object.__setattr__(self, "memory_budget", budget)
      object.__setattr__(self, "memory_budget_mode", EXPLICIT)
    elif self.memory_budget_mode not in BUDGET_MODES:
      hint = (" needs a memory_budget" if self.memory_budget_mode == EXPLICIT
              else f": expected one of {BUDGET_MODES}")
      raise ValueError(f"memory_budget_mode={self.memory_budget_mode!r}{hint}")

  # Placement -------------------------------------------------------------------------------------
  @property
  def num_devices(self) -> int:
    return self.actor_pp

  @property
  def critic_replicas(self) -> int:
    return self.actor_pp // self.critic_pp

  @property
  def tasks_per_device(self) -> int:
    return 2 * self.actor_microbatches + 2 * self.critic_microbatches

  def actor_stage(self, device: int) -> int:
    return device

  def critic_stage(self, device: int) -> int:
    return self.critic_pp - 1 - device % self.critic_pp

  def critic_replica(self, device: int) -> int:
    return device // self.critic_pp

  def critic_device(self, replica: int, stage: int) -> int:
    if not (0 <= replica < self.critic_replicas and 0 <= stage < self.critic_pp):
      raise ValueError(f"critic (replica={replica}, stage={stage}) out of range "
                       f"(replicas={self.critic_replicas}, critic_pp={self.critic_pp})")
    return replica * self.critic_pp + self.critic_pp - 1 - stage

  # Per-kind constants ----------------------------------------------------------------------------
  def duration(self, kind: int) -> float:
    return (self.actor_fwd, self.actor_bwd, self.critic_fwd, self.critic_bwd)[kind]

  def durations(self) -> np.ndarray:
    return np.array([self.actor_fwd, self.actor_bwd, self.critic_fwd, self.critic_bwd],
                    dtype=np.float64)  # [4] by kind

  def kind_counts(self) -> np.ndarray:
    m_a, m_c = self.actor_microbatches, self.critic_microbatches
    return np.array([m_a, m_a, m_c, m_c], dtype=np.int64)  # [4] tasks of each kind per device

  def mem_deltas(self) -> np.ndarray:
    """Memory change per kind: a forward allocates, its backward frees."""
    return np.array([self.actor_mem, -self.actor_mem, self.critic_mem, -self.critic_mem],
                    dtype=np.float64)  # [4]

  def work_per_device(self) -> float:
    return (self.actor_microbatches * (self.actor_fwd + self.actor_bwd) +
            self.critic_microbatches * (self.critic_fwd + self.critic_bwd))

  # Memory ----------------------------------------------------------------------------------------
  def one_f_one_b_peaks(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-device activation peaks of the actor's and the critic's 1F1B schedules: [N], [N]."""
    n = self.num_devices
    actor = np.array([min(self.actor_pp - d, self.actor_microbatches) * self.actor_mem
                      for d in range(n)])
    critic = np.array([min(self.critic_pp - self.critic_stage(d), self.critic_microbatches) *
                       self.critic_mem for d in range(n)])
    return actor, critic

  def per_device_memory_budget(self) -> np.ndarray:
    """The "per_device" budget: the sum of the two models' 1F1B peaks on each device, [N]."""
    actor, critic = self.one_f_one_b_peaks()
    return actor + critic  # [N]

  def uniform_memory_budget(self) -> np.ndarray:
    """The "uniform" budget: on every device the largest per-device sum, [N]."""
    return np.full(self.num_devices, float(np.max(self.per_device_memory_budget())))

  def default_memory_budget(self) -> np.ndarray:
    """The budget of `memory_budget_mode` (the problem's budget when none is given), [N]."""
    if self.memory_budget_mode == UNIFORM:
      return self.uniform_memory_budget()
    return self.per_device_memory_budget()

  def budget(self) -> np.ndarray:
    """The memory budget in force per device, [N]."""
    if self.memory_budget is None:
      return self.default_memory_budget()
    return np.array(self.memory_budget, dtype=np.float64)

  def params(self) -> np.ndarray:
    """Flat float64 parameter vector consumed by the numba kernels (see evaluate.py)."""
    return np.array([self.actor_pp, self.critic_pp, self.actor_microbatches,
                     self.critic_microbatches, self.actor_fwd, self.actor_bwd, self.critic_fwd,
                     self.critic_bwd, self.transfer_latency], dtype=np.float64)

  def with_budget(self, budget: Optional[Sequence[float]],
                  mode: Optional[str] = None) -> "PipelineProblem":
    """This problem with an explicit budget, or (budget None) with the budget of `mode`
    (default: this problem's mode, which must then not be "explicit")."""
    if budget is not None:
      return dataclasses.replace(self, memory_budget=tuple(budget))
    mode = mode or self.memory_budget_mode
    if mode == EXPLICIT:
      raise ValueError("with_budget(None) of a problem with an explicit budget needs a mode "
                       f"(one of {BUDGET_MODES})")
    return dataclasses.replace(self, memory_budget=None, memory_budget_mode=mode)

  def time_reversed(self) -> "PipelineProblem":
    """The same instance run backwards in time: a problem of the same family.

    Reversing every edge of the task graph and the time axis turns each backward chain into a
    forward chain over the same devices (B(s+1) after B(s) becomes the new F chain, stage 0 up)
    and vice versa, so the mirror image is this problem with forward and backward durations
    swapped; memory is held from the new forward's start (the old backward's end) to the new
    backward's end (the old forward's start), the same interval, so memory per micro-batch and
    the budget carry over unchanged (fixed explicitly: their defaults depend on the durations).
    With `reverse_order` a schedule of one maps to a schedule of the other with the same
    makespan and the same per-device peaks; a search can therefore work from either end.
    """
    return dataclasses.replace(
        self, actor_fwd=self.actor_bwd, actor_bwd=self.actor_fwd, critic_fwd=self.critic_bwd,
        critic_bwd=self.critic_fwd, actor_mem=self.actor_mem, critic_mem=self.critic_mem,
        memory_budget=tuple(float(b) for b in self.budget()))

  @classmethod
  def from_config(cls, c) -> "PipelineProblem":
    """From a config with the fields of configs/schedule_search.py (-1: the default; any other
    negative value is a typo, and an error naming the field). memory_budget >= 0 overrides
    memory_budget_mode; a config without memory_budget_mode (one written before it existed)
    means "per_device", what it was run under."""
    num = lambda name, kind=float: config_number(c, name, kind)

    def opt(name):
      if getattr(c, name) is None:
        return None
      v = num(name)
      if v == -1:
        return None
      if v < 0:
        raise ValueError(f"config.{name}={v!r}: expected -1 (the default) or a value >= 0")
      return v
    budget = opt("memory_budget")
    mode = getattr(c, "memory_budget_mode", PER_DEVICE)
    if budget is None and mode not in BUDGET_MODES:
      raise ValueError(f"config.memory_budget_mode={mode!r}: expected one of {BUDGET_MODES} "
                       "(or config.memory_budget >= 0 for an explicit budget)")
    return cls(actor_pp=num("actor_pp", int), critic_pp=num("critic_pp", int),
               actor_microbatches=num("actor_microbatches", int),
               critic_microbatches=num("critic_microbatches", int),
               actor_fwd=num("actor_fwd"), critic_fwd=num("critic_fwd"),
               actor_bwd=opt("actor_bwd"), critic_bwd=opt("critic_bwd"),
               actor_mem=opt("actor_mem"), critic_mem=opt("critic_mem"),
               transfer_latency=num("transfer_latency"),
               memory_budget=None if budget is None else (budget,),
               memory_budget_mode=mode if budget is None else EXPLICIT)

  def to_dict(self) -> dict:
    """Every field, memory_budget_mode included (a dict without it reads back as per_device)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "PipelineProblem":
    """The inverse of to_dict; a dict written before memory_budget_mode existed (no such key)
    is a per_device problem, the budget it was made under."""
    d = dict(d)
    if d.get("memory_budget") is not None:
      d["memory_budget"] = tuple(d["memory_budget"])
    return cls(**d)


def config_number(c, name: str, kind: type = float):
  """`c.name` as `kind` (int or float), or a ValueError naming the field. A config file's "8" or
  2.5 for a stage count was read as 8 and 2 (int()), and a str budget failed as a TypeError of
  a comparison, naming no field."""
  v = getattr(c, name)
  fields.check(fields.is_numeric(v, integral=kind is int), name, v,
               "an integer" if kind is int else "a number")
  return kind(v)


def parse_devices(values: Sequence[str], num_devices: int, flag: str = "--devices",
                  allow_each: bool = False):
  """A device subset from a list flag's strings: None for all (empty list), 'each' where
  `allow_each`, else the sorted distinct indices. Anything else is refused naming `flag`."""
  values = [str(v).strip() for v in values]
  expected = (f"expected device indices in 0..{num_devices - 1} separated by commas"
              + (", or 'each'" if allow_each else ""))
  if values == ["each"]:
    if allow_each:
      return "each"
    raise ValueError(f"{flag}=each: {expected}")
  try:
    devices = sorted({int(x) for x in values})
  except ValueError as e:
    raise ValueError(f"{flag}={','.join(values)}: {expected}") from e
  if devices and (devices[0] < 0 or devices[-1] >= num_devices):
    raise ValueError(f"{flag}={','.join(values)}: {expected}")
  return devices or None


def validate_order(problem: PipelineProblem, order: np.ndarray) -> np.ndarray:
  """Checks the shape and kind counts of a per-device kind sequence; returns it as int8 [N, T].

  Dependencies are not checked here: a backward before its own forward, or a cyclic wait across
  devices, is a deadlock that the evaluator reports (valid=False); peak_memory() of such an
  order means nothing.
  """
  order = np.asarray(order)
  n, t = problem.num_devices, problem.tasks_per_device
  if order.shape != (n, t):
    raise ValueError(f"order has shape {order.shape}; expected (num_devices={n}, "
                     f"tasks_per_device={t})")
  # Checked before any cast: astype truncates 0.5 to AF (a float order passed the count check
  # as the order it truncates to) and bincount fails on a negative code with no hint.
  if not (np.issubdtype(order.dtype, np.integer) or np.issubdtype(order.dtype, np.floating)) or (
      order.size and not (np.all(order == np.round(order)) and order.min() >= 0
                          and order.max() <= 3)):
    raise ValueError(f"order must hold kind codes 0..3 ({', '.join(KIND_NAMES)}); got values "
                     f"{np.unique(order)[:8].tolist()} of dtype {order.dtype}")
  counts = problem.kind_counts()
  for d in range(n):
    got = np.bincount(order[d].astype(np.int64), minlength=4)
    if got.shape[0] != 4 or np.any(got != counts):
      raise ValueError(f"device {d}: kind counts {got.tolist()} (AF, AB, CF, CB); expected "
                       f"{counts.tolist()}")
  return order.astype(np.int8)


def reverse_order(order: np.ndarray) -> np.ndarray:
  """Maps an order of a problem to the order of its `time_reversed()` mirror (and back).

  Each device's sequence is read from the end with forward and backward swapped (AF <-> AB,
  CF <-> CB); micro-batch j of a kind becomes micro-batch M-1-j, which the canonical order
  implies, so no index needs rewriting.
  """
  order = np.asarray(order, dtype=np.int8)
  return np.ascontiguousarray(order[:, ::-1] ^ np.int8(1))  # codes: AF=0/AB=1, CF=2/CB=3
