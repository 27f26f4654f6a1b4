"""Time-indexed LP relaxation of "a fused schedule of makespan <= T within the memory budget",
and exactly checked certificates that it has no solution.

Why: the exact CP-SAT check (experiments/schedule_cp_check.py) decides small reference instances
but runs out of time on the large ones. The time-indexed relaxation is a classic, much stronger
linear model of scheduling: when even its fractional version has no solution, no schedule
exists, and a Farkas certificate (one non-negative multiplier per row) proves it in a form anyone
can re-check with integer arithmetic. Measured on the 2-core machine: e8 at 186 infeasible in
~6 s, e10 at 318 in ~90 s (HiGHS PDLP), where CP-SAT needed 17 s and 852 s; e1 at 372 and e0 at
708 are feasible as LPs, so there the relaxation proves nothing (CP-SAT proved e1 unreachable).

Model (integer time in units of `unit`, the gcd of the durations and the latency; list-scheduled
starts are sums of those, so every schedule has integer starts in this unit). For task i with
window [lo_i, hi_i] (pipeline/windows.py heads and tails with the memory lags, at makespan T):

  y[i, t] = [S_i <= t]   for t in [lo_i, hi_i - 1];  y = 0 before lo_i, 1 from hi_i on.

Rows (all "<="), each implied by any valid schedule within budget, so the LP is a relaxation:
  monotone       y[i, t-1] - y[i, t] <= 0
  precedence     y[b, t] - y[a, t - delta] <= 0     for every edge a -> b with start_b >=
                 start_a + delta: graph.py's dependencies, the canonical order on a device, the
                 round-trip lag F(d, j) -> B(d, j) and the memory lag B(d, j - K) -> F(d, j)
  capacity       sum_i (y[i, t] - y[i, t - p_i]) <= 1            per device and slot [t, t+1)
  memory         sum_F m_F y[F, t] - sum_B m_B y[B, t - p_B] <= budget   per device and instant t
                 (a backward ending at t releases before a forward starting at t allocates, as in
                 evaluate.py's device order; m and budget times `memory_scale`: integers)

Certificate: lambda >= 0 over the rows with min over y in [0,1]^n of lambda^T (A y - b) > 0, i.e.
sum_j min(0, (A^T lambda)_j) - b^T lambda > 0, contradicts A y <= b. `verify_certificate` checks it
in exact integer arithmetic (multipliers rounded down to multiples of 2^-30), so a solver's
floating-point error cannot produce a false proof. Like every proof in this package it assumes
the canonical order (micro-batches of one kind in increasing order on a device).
"""
from __future__ import annotations

import dataclasses
import io
import math
import time
from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import windows
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem

_CERT_BITS = 30  # multipliers are rounded down to multiples of 2^-30 for the exact check


@dataclasses.dataclass(frozen=True)
class TimeIndexedModel:
  """A y <= b, 0 <= y <= 1. `infeasible_reason` is set (and A empty) when the windows alone, or a
  row without variables, already rule the target out."""
  problem: PipelineProblem
  target: float
  unit: float
  A: sp.csr_matrix               # [rows, vars] integer-valued coefficients
  b: np.ndarray                  # [rows]
  tasks: np.ndarray              # [tasks, 3] (kind, device, micro-batch)
  lo: np.ndarray                 # [tasks] earliest start, in units
  hi: np.ndarray                 # [tasks] latest start, in units
  offsets: np.ndarray            # [tasks + 1] first variable of each task
  soft: np.ndarray               # [rows] bool: capacity and memory rows (elastic in `solve`)
  infeasible_reason: Optional[str] = None
  devices: Optional[tuple] = None  # the devices modelled (None: all)

  @property
  def num_vars(self) -> int:
    return int(self.offsets[-1])

  def encode(self, starts: np.ndarray) -> np.ndarray:
    """y of a schedule given each task's start time ([tasks], in the problem's time unit)."""
    s = np.rint(np.asarray(starts, dtype=np.float64) / self.unit).astype(np.int64)
    y = np.zeros(self.num_vars)
    for i in range(len(self.tasks)):
      t = np.arange(self.lo[i], self.hi[i])
      y[self.offsets[i]:self.offsets[i + 1]] = (s[i] <= t).astype(np.float64)
    return y


def time_unit(problem: PipelineProblem) -> float:
  """Largest unit in which every duration and the latency are integers (list-scheduled starts are
  sums of them); raises if there is none on a 1/1000 grid."""
  vals = list(problem.durations()) + [problem.transfer_latency]
  scaled = [v * 1000 for v in vals]
  if any(abs(v - round(v)) > 1e-6 for v in scaled):
    raise ValueError(f"durations and transfer_latency {vals} must be multiples of 0.001 for the "
                     "time-indexed model")
  g = 0
  for v in scaled:
    g = math.gcd(g, int(round(v)))
  return g / 1000


def memory_scale(problem: PipelineProblem) -> int:
  """Smallest k <= 1000 that makes every activation memory and budget k-fold an integer: the
  memory rows are built k-fold (the same constraint), so `certificate_bound`'s exact check sees
  integers; raises (before any work) if there is none, as `time_unit` does for durations."""
  values = np.concatenate([np.abs(problem.mem_deltas()), problem.budget()]).astype(np.float64)
  for k in range(1, 1001):
    if _integral(values * k):
      return k
  raise ValueError(f"activation memory {np.abs(problem.mem_deltas()).tolist()} and budget "
                   f"{problem.budget().tolist()} must become integers times some k <= 1000 "
                   "(multiples of 0.001 do) for the time-indexed model's exact certificates")


def _edges(problem: PipelineProblem, index, dur_u: np.ndarray, lat_u: int, lags_u: np.ndarray,
           caps: np.ndarray, devices: Sequence[int]) -> list[tuple[int, int, int]]:
  """(a, b, delta): start_b >= start_a + delta, in units, for every precedence the model states
  between tasks on `devices` (index returns None for a task on another device: that edge is
  dropped, which only relaxes the model)."""
  p = problem
  n, pc = p.num_devices, p.critic_pp
  counts = p.kind_counts()
  out = []
  for d in devices:
    c = p.critic_stage(d)
    for k in range(4):
      for j in range(int(counts[k])):
        b = index(k, d, j)
        if j > 0:
          out.append((index(k, d, j - 1), b, int(dur_u[k])))
        if k == AF and d > 0:
          out.append((index(AF, d - 1, j), b, int(dur_u[AF]) + lat_u))
        if k == AB:
          out.append((index(AB, d + 1, j), b, int(dur_u[AB]) + lat_u) if d < n - 1
                     else (index(AF, d, j), b, int(dur_u[AF])))
        if k == CF and c > 0:
          out.append((index(CF, d + 1, j), b, int(dur_u[CF]) + lat_u))
        if k == CB:
          out.append((index(CB, d - 1, j), b, int(dur_u[CB]) + lat_u) if c < pc - 1
                     else (index(CF, d, j), b, int(dur_u[CF])))
        if k % 2:  # round trip through the other devices
          out.append((index(k - 1, d, j), b, int(dur_u[k - 1]) + int(lags_u[d, k // 2])))
        else:
          cap = int(caps[d, k // 2])
          if j >= cap:  # memory: F(j) after B(j - K) ends
            out.append((index(k + 1, d, j - cap), b, int(dur_u[k + 1])))
  return [e for e in out if e[0] is not None]


def build(problem: PipelineProblem, target: float, unit: Optional[float] = None,
          devices: Optional[Sequence[int]] = None) -> TimeIndexedModel:
  """The time-indexed relaxation at makespan `target` (module docstring).

  devices: only the tasks on these devices and the rows among them (a subset of the whole
  model's rows and variables, so a certificate for it also proves the whole model infeasible);
  dependencies on other devices are then represented by the windows alone. Smaller models
  solve in minutes where the whole one does not converge."""
  p = problem
  n = p.num_devices
  devs = sorted(set(range(n) if devices is None else (int(d) for d in devices)))
  if not devs or devs[0] < 0 or devs[-1] >= n:
    raise ValueError(f"devices={devices!r}: expected a non-empty subset of 0..{n - 1}")
  subset = None if len(devs) == n else tuple(devs)
  unit = time_unit(p) if unit is None else float(unit)
  scale = memory_scale(p)
  dur_u = np.rint(p.durations() / unit).astype(np.int64)  # [4]
  if np.any(np.abs(dur_u * unit - p.durations()) > 1e-9):
    raise ValueError(f"unit={unit} does not divide the durations {p.durations().tolist()}")
  lat_u = int(round(p.transfer_latency / unit))
  horizon = int(math.floor(target / unit + 1e-9))
  win = windows.task_windows(p, memory_lags=True)
  caps = windows.memory_caps(p)
  lags_u = np.ceil(win.lags / unit - 1e-9).astype(np.int64)  # [N, 2]
  counts = p.kind_counts()
  tasks = np.array([(k, d, j) for d in devs for k in range(4) for j in range(counts[k])],
                   dtype=np.int64)  # [tasks, 3]
  base = {}
  for i, (k, d, j) in enumerate(tasks.tolist()):
    if j == 0:
      base[k, d] = i
  def index(k, d, j):  # tasks of a (kind, device) are contiguous; None: not in the model
    return base[k, d] + j if (k, d) in base else None
  lo = np.array([math.ceil(win.heads[k][d, j] / unit - 1e-9) for k, d, j in tasks.tolist()],
                dtype=np.int64)
  hi = np.array([math.floor((target - win.tails[k][d, j]) / unit + 1e-9)
                 for k, d, j in tasks.tolist()], dtype=np.int64)
  offsets = np.zeros(len(tasks) + 1, dtype=np.int64)

  def empty(reason):
    return TimeIndexedModel(p, float(target), unit, sp.csr_matrix((0, 0)), np.zeros(0), tasks,
                            lo, hi, offsets, np.zeros(0, dtype=bool), reason, subset)

  bad = np.flatnonzero(hi < lo)
  if bad.size:
    k, d, j = tasks[bad[0]].tolist()
    return empty(f"task {('AF', 'AB', 'CF', 'CB')[k]}(device {d}, micro-batch {j}) has no start "
                 f"in [head, target - tail] = [{lo[bad[0]] * unit:g}, {hi[bad[0]] * unit:g}]")
  offsets[1:] = np.cumsum(hi - lo)
  dur_task = dur_u[tasks[:, 0]]  # [tasks]

  rows, cols, vals = [], [], []  # entries of A
  const_rows, const_vals = [], []  # constant parts of the left-hand sides
  rhs, soft = [], []
  next_row = 0

  def add_terms(i, row_ids, t, coef):
    """Adds coef * y[i, t] to rows row_ids (arrays of the same length)."""
    t = np.asarray(t)
    var = (t >= lo[i]) & (t < hi[i])
    rows.append(row_ids[var])
    cols.append(offsets[i] + t[var] - lo[i])
    vals.append(np.full(int(var.sum()), float(coef)))
    one = t >= hi[i]
    const_rows.append(row_ids[one])
    const_vals.append(np.full(int(one.sum()), float(coef)))

  def new_rows(count, bound, is_soft=False):
    nonlocal next_row
    ids = np.arange(next_row, next_row + count)
    next_row += count
    rhs.append(np.full(count, float(bound)))
    soft.append(np.full(count, is_soft))
    return ids

  for i in range(len(tasks)):  # monotone
    t = np.arange(lo[i] + 1, hi[i])
    ids = new_rows(t.size, 0.0)
    add_terms(i, ids, t - 1, 1.0)
    add_terms(i, ids, t, -1.0)
  for a, b, delta in _edges(p, index, dur_u, lat_u, lags_u, caps, devs):
    # y[b, t] <= y[a, t - delta]; before lo[b] the row holds trivially (y[b, t] = 0), from
    # max(hi[b], hi[a] + delta) on both sides are 1.
    t = np.arange(lo[b], max(hi[b], hi[a] + delta) + 1)
    ids = new_rows(t.size, 0.0)
    add_terms(b, ids, t, 1.0)
    add_terms(a, ids, t - delta, -1.0)
  mem = p.mem_deltas()
  slots = np.arange(horizon)
  # A budget above every forward of a device at once never binds: capped there (+1), so a
  # "no limit" budget (1e30) stays an exact integer in the certificate check.
  held = (mem[AF] * counts[AF] + mem[CF] * counts[CF]) * scale
  for d in devs:
    cap_ids = new_rows(horizon, 1.0, True)
    mem_ids = new_rows(horizon, min(float(p.budget()[d]) * scale, held + 1.0), True)
    for i in np.flatnonzero(tasks[:, 1] == d):
      k = int(tasks[i, 0])
      add_terms(i, cap_ids, slots, 1.0)
      add_terms(i, cap_ids, slots - dur_task[i], -1.0)
      add_terms(i, mem_ids, slots if k % 2 == 0 else slots - dur_task[i], mem[k] * scale)
  b = np.concatenate(rhs)
  const = np.bincount(np.concatenate(const_rows), np.concatenate(const_vals), minlength=next_row)
  b = b - const
  A = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                    shape=(next_row, int(offsets[-1])))
  A.eliminate_zeros()
  used = np.diff(A.indptr) > 0
  if np.any(b[~used] < -1e-9):
    return empty("a row without variables is violated by the windows' constants")
  A, b = A[used], b[used]
  return TimeIndexedModel(p, float(target), unit, A.tocsr(), b, tasks, lo, hi, offsets,
                          np.concatenate(soft)[used], None, subset)


def _integral(x: np.ndarray) -> bool:
  return bool(np.all(np.abs(x - np.rint(x)) < 1e-9))


def certificate_bound(model: TimeIndexedModel, lam: np.ndarray) -> float:
  """min over y in [0,1]^n of lam^T (A y - b), computed exactly (multipliers rounded down to
  multiples of 2^-30, negatives dropped); > 0 proves the model has no solution. The matrix and
  right-hand side must be integral (integer memory and budget), else ValueError."""
  A, b = model.A, model.b
  if not (_integral(A.data) and _integral(b)):
    raise ValueError("exact certificate check needs integer memory and budget")
  lam = np.asarray(lam, dtype=np.float64)
  if lam.shape != b.shape:
    raise ValueError(f"certificate has {lam.shape} multipliers; the model has {b.shape} rows")
  peak = float(np.max(lam, initial=0.0))
  if peak <= 0:
    return 0.0
  scale = float(2 ** _CERT_BITS) / peak
  lam_i = np.floor(np.maximum(lam, 0.0) * scale).astype(np.int64)  # [rows], 0 .. 2^30
  a_i = sp.csr_matrix((np.rint(A.data).astype(np.int64), A.indices, A.indptr), shape=A.shape)
  col = a_i.T.tocsr() @ lam_i  # [vars] exact: |entries| and counts keep it far below 2^63
  if np.abs(b).max(initial=0.0) >= 2.0 ** 62:  # int64 would wrap (a bound out of nothing)
    raise ValueError("exact certificate check needs right-hand sides below 2^62")
  b_i = np.rint(b).astype(np.int64)
  total = int(np.minimum(col, 0).sum(dtype=object)) - int((b_i.astype(object) * lam_i).sum())
  return total / scale


def save_certificate(path: str, multipliers: np.ndarray, target: float,
                     devices: Optional[Sequence[int]] = None,
                     budget: Optional[Sequence[float]] = None) -> None:
  """The non-zero multipliers, compressed, written atomically, with the target, the devices
  the model was built for (None: all) and the memory budget per device of its problem."""
  nz = np.flatnonzero(multipliers > 0)
  buf = io.BytesIO()
  extra = {} if budget is None else {"budget": np.asarray(list(budget), np.float64)}
  np.savez_compressed(buf, rows=np.int64(multipliers.size), index=nz.astype(np.int32),
                      value=multipliers[nz], target=np.float64(target),
                      devices=np.asarray([] if devices is None else list(devices), np.int32),
                      **extra)
  wd.atomic_write_bytes(path, buf.getvalue())


def _read_certificate(path: str) -> dict:
  """save_certificate's arrays in the file at `path`; a ValueError naming the file when it is
  not one (empty, cut, another file, a key missing: numpy's EOFError, BadZipFile or KeyError
  traceback before) or its multipliers are not finite numbers at row indices >= 0."""
  try:
    with np.load(path, allow_pickle=False) as f:
      out = {k: np.asarray(f[k]) for k in f.files}
    rows, index, value = int(out["rows"]), out["index"].astype(np.int64), out["value"]
  except Exception as e:  # noqa: BLE001 numpy raises many types for a file that is not one
    raise ValueError(f"{path}: not a certificate (save_certificate's .npz of rows, index and "
                     f"value): {type(e).__name__}: {e}") from None
  if (index.shape != value.shape or index.ndim != 1 or (index < 0).any() or
      (index >= rows).any() or not np.all(np.isfinite(value))):
    raise ValueError(f"{path}: not a certificate: its multipliers must be finite numbers at "
                     f"row indices in [0, {rows})")
  return out


def certificate_devices(path: str) -> Optional[list[int]]:
  """The devices a certificate's model was built for; None for all, or for a certificate
  saved before they were recorded."""
  f = _read_certificate(path)
  devices = [int(d) for d in f["devices"]] if "devices" in f else []
  return devices or None


def load_certificate(path: str, rows: int, target: float,
                     budget: Optional[Sequence[float]] = None) -> np.ndarray:
  """The multipliers [rows] saved by `save_certificate`; refuses one made for another target,
  another memory budget (`budget`: this problem's per device, compared where the file records
  one) or another model size (it could only fail the exact check there)."""
  f = _read_certificate(path)
  if "target" in f and not np.isclose(float(f["target"]), target):
    raise ValueError(f"{path}: certificate for target {float(f['target']):g}, not {target:g}")
  if ("budget" in f and budget is not None and
      (len(f["budget"]) != len(budget) or not np.allclose(f["budget"], budget))):
    raise ValueError(f"{path}: certificate for the memory budget {f['budget'].tolist()} per "
                     f"device; this instance's is {list(map(float, budget))} "
                     "(config.memory_budget_mode or config.memory_budget?)")
  if int(f["rows"]) != rows:
    made_for = (f", built for devices {[int(d) for d in f['devices']]}"
                if "devices" in f and len(f["devices"]) else "")
    # (the memory budget changes the rows: the uniform one is the default since 2026-11-26,
    # and the kept certificates of the per-device budget were refused naming the rest only)
    raise ValueError(f"{path}: certificate for a model of {int(f['rows'])} rows{made_for}; "
                     f"this instance, target and devices give {rows} (other instance, "
                     "--devices, target, memory budget (config.memory_budget_mode: the kept "
                     "certificates are per_device's) or code version?)")
  lam = np.zeros(rows)
  lam[f["index"]] = f["value"]
  return lam


def solve(model: TimeIndexedModel, solver: str = "pdlp", time_limit_s: float = 3600.0,
          threads: int = 2, log: bool = False) -> dict:
  """Decides the LP through its elastic form and returns a checked certificate when it has no
  solution.

  Elastic form: min sum(s) s.t. A y - s <= b with s >= 0 on the capacity and memory rows only
  (precedence and monotone rows stay hard: the windows' heads satisfy them, so the elastic LP
  always has a solution and the solver ends at an optimum with duals). Its optimum is 0 iff the
  model is feasible; its row duals are multipliers whose certificate bound equals the optimum.
  Solvers: HiGHS through highspy (an optional dependency: 'pdlp', the first-order method that
  handles the million-variable models, 'ipm' or 'simplex'), or 'scipy' (scipy's bundled HiGHS;
  small models only).

  Returns {"status": "infeasible" | "feasible" | "unknown", "certified": bool,
  "certificate_bound": float or None, "elastic_optimum", "multipliers": [rows] or None,
  "solve_s", "solver", "solver_status"}. Only certified=True is a proof: the solver's
  floating-point optimum alone is not.
  """
  if model.infeasible_reason is not None:
    return {"status": "infeasible", "certified": True, "certificate_bound": None,
            "elastic_optimum": None, "multipliers": None, "solve_s": 0.0, "solver": "windows",
            "solver_status": model.infeasible_reason}
  if solver not in ("pdlp", "ipm", "simplex", "scipy"):
    raise ValueError(f"solver={solver!r}; expected 'pdlp', 'ipm', 'simplex' or 'scipy'")
  t0 = time.time()
  m, nv = model.A.shape
  if nv == 0:  # the windows fix every start: the rows are 0 <= b, decided here
    lam = (model.b < 0).astype(np.float64)
    bound = certificate_bound(model, lam) if lam.any() else None
    return {"status": "feasible" if bound is None else "infeasible",
            "certified": bound is not None and bound > 0, "certificate_bound": bound,
            "elastic_optimum": float(np.maximum(-model.b, 0).sum()),
            "multipliers": None if bound is None else lam, "solve_s": time.time() - t0,
            "solver": "windows", "solver_status": "no variables"}
  soft_idx = np.flatnonzero(model.soft)
  slack = sp.csr_matrix((-np.ones(soft_idx.size), (soft_idx, np.arange(soft_idx.size))),
                        shape=(m, soft_idx.size))
  A = sp.hstack([model.A, slack], format="csc")
  cost = np.concatenate([np.zeros(nv), np.ones(soft_idx.size)])
  upper = np.concatenate([np.ones(nv), np.full(soft_idx.size, np.inf)])
  if solver == "scipy":
    optimum, duals, raw = _solve_scipy(A, model.b, cost, upper)
  else:
    optimum, duals, raw = _solve_highs(A, model.b, cost, upper, solver, time_limit_s, threads,
                                       log)
  if optimum is None:
    return {"status": "unknown", "certified": False, "certificate_bound": None,
            "elastic_optimum": None, "multipliers": None, "solve_s": time.time() - t0,
            "solver": solver, "solver_status": raw}
  lam, bound = None, None
  if duals is not None:
    # Sign conventions differ between solvers: keep the sign whose exact bound is larger (any
    # non-negative multipliers with a positive bound are a proof; the exact check decides).
    cands = [np.maximum(sgn * duals, 0.0) for sgn in (-1.0, 1.0)]
    bounds = [certificate_bound(model, c) for c in cands]
    lam, bound = max(zip(cands, bounds), key=lambda x: x[1])
  infeasible = optimum > 1e-6 or (bound is not None and bound > 0)
  return {"status": "infeasible" if infeasible else "feasible",
          "certified": bool(bound is not None and bound > 0), "certificate_bound": bound,
          "elastic_optimum": float(optimum), "multipliers": lam, "solve_s": time.time() - t0,
          "solver": solver, "solver_status": raw}


def _solve_highs(A, b, cost, upper, solver, time_limit_s, threads, log):
  try:
    import highspy
  except ImportError as e:
    raise ImportError("the time-indexed LP needs highspy for large models "
                      "(pip install -e \".[exact]\"), or --solver=scipy for small ones") from e
  h = highspy.Highs()
  h.setOptionValue("output_flag", bool(log))
  h.setOptionValue("solver", solver)
  h.setOptionValue("time_limit", float(time_limit_s))
  h.setOptionValue("threads", int(threads))
  lp = highspy.HighsLp()
  lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
  lp.col_cost_ = cost
  lp.col_lower_ = np.zeros(A.shape[1])
  lp.col_upper_ = np.where(np.isinf(upper), highspy.kHighsInf, upper)
  lp.row_lower_ = np.full(A.shape[0], -highspy.kHighsInf)
  lp.row_upper_ = b
  lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
  lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
  lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
  h.passModel(lp)
  h.run()
  raw = h.modelStatusToString(h.getModelStatus())
  if raw != "Optimal":
    return None, None, raw
  return float(h.getInfo().objective_function_value), np.asarray(h.getSolution().row_dual), raw


def _solve_scipy(A, b, cost, upper):
  from scipy.optimize import linprog
  res = linprog(cost, A_ub=A, b_ub=b, bounds=list(zip(np.zeros(len(upper)),
                                                       np.where(np.isinf(upper), None, upper))),
                method="highs")
  if res.status != 0:
    return None, None, res.message
  return float(res.fun), np.asarray(res.ineqlin.marginals), res.message
