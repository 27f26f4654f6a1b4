"""Time windows of every task: earliest start (head) and least time left after its start (tail).

Why: an exact check of "is makespan T reachable within the memory budget" (CP-SAT, in
experiments/schedule_cp_check.py) proves infeasibility far sooner when every task's start is
confined to [head, T - tail] and the round trip through the other devices is stated as a lag.
These are redundant constraints (implied by the model), so they never cut a valid schedule:
tests check that the starts of many valid schedules lie in their windows.

Heads (longest path from time 0, by dynamic programming over the task graph of graph.py):
  - F(s, j) after F(s-1, j) (+ transfer latency) and after F(s, j-1) on its device;
  - B(last, j) after F(last, j); B(s, j) after B(s+1, j) (+ latency) and after B(s, j-1);
  - set reasoning on one device (edge finding): the forced same-device predecessors of B(s, j)
    are F(s, 0..j) and B(s, 0..j-1); for any h, all those with head >= h run, one after the
    other, before B(s, j) starts, so head(B) >= h + the sum of their durations.
Tails mirror heads in reversed time: tail(x) = dur(x) + the least time from x's end to the end
of the schedule; the forced same-device successors of F(s, j) are F(s, j+1..) and B(s, j..), those
of B(s, j) are B(s, j+1..); with q(y) = tail(y) - dur(y) and S_t = {y : q(y) >= t}, every task of
S_t runs after x ends, so tail(x) >= dur(x) + sum dur(S_t) + t.
Lag: B(s, j) starts at least (P-1-s)(f+b) + 2(P-1-s)·latency after F(s, j) ends (the chain of
forwards up to the last stage and backwards down again).

Only one model's tasks are considered on the other devices (the other model's contention is
ignored), which keeps every bound valid. Micro-batches of one kind run in increasing order on
a device (graph.py's canonical order), so task (k, d, j) is the j-th task of kind k on device d.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem


@dataclasses.dataclass(frozen=True)
class Windows:
  heads: tuple  # per kind k: f8 [N, count_k], earliest start of task (k, d, j)
  tails: tuple  # per kind k: f8 [N, count_k], least (makespan - start) of task (k, d, j)
  lags: np.ndarray  # f8 [N, 2]: least time from F(d, j)'s end to B(d, j)'s start (actor, critic)

  def bound(self) -> float:
    """max over tasks of head + tail: a lower bound on the makespan (weaker than the tight one
    on most instances; a sanity figure)."""
    return float(max((h + t).max() for h, t in zip(self.heads, self.tails)))

  def window(self, kind: int, device: int, index: int, makespan: float) -> tuple[float, float]:
    """[earliest, latest] start of the task in any valid schedule of this makespan."""
    return (float(self.heads[kind][device, index]),
            float(makespan - self.tails[kind][device, index]))


def _model_chain(problem: PipelineProblem, fwd_kind: int) -> list[list[int]]:
  """Devices of one model's stages, per pipeline (actor: one; critic: one per replica)."""
  p = problem
  if fwd_kind == AF:
    return [list(range(p.num_devices))]
  return [[p.critic_device(r, s) for s in range(p.critic_pp)] for r in range(p.critic_replicas)]


def _set_head(fwd: np.ndarray, bwd: np.ndarray, j: int, f: float, b: float, base: float) -> float:
  """Edge-finding head of B(j) on one device: predecessors F(0..j), B(0..j-1)."""
  heads = np.concatenate([fwd[:j + 1], bwd[:j]])
  durs = np.concatenate([np.full(j + 1, f), np.full(j, b)])
  idx = np.argsort(-heads, kind="stable")  # by head, latest first
  # For the set of the r latest-released predecessors: head >= their smallest head + their work.
  return max(base, float((heads[idx] + np.cumsum(durs[idx])).max()))


def _set_tail(items_q: np.ndarray, items_d: np.ndarray, own: float, base: float) -> float:
  """Edge-finding tail: successors with q = tail - dur >= t all follow, then t more."""
  if items_q.size == 0:
    return base
  idx = np.argsort(-items_q, kind="stable")
  return max(base, float((own + np.cumsum(items_d[idx]) + items_q[idx]).max()))


def memory_caps(problem: PipelineProblem) -> np.ndarray:
  """int [N, 2]: micro-batches of the actor / critic that can be in flight on each device within
  its memory budget even when the other model holds none: floor(budget / activation memory)."""
  budget = problem.budget()
  caps = np.zeros((problem.num_devices, 2), dtype=np.int64)
  for i, mem in enumerate((problem.actor_mem, problem.critic_mem)):
    # Capped at 1 << 30 ("no limit", as for memory 0): a huge budget (1e30) would overflow int64.
    caps[:, i] = np.minimum(np.floor(budget / mem + 1e-9), 1 << 30) if mem > 0 else 1 << 30
  return caps


def task_windows(problem: PipelineProblem, memory_lags: bool = False) -> Windows:
  """Heads, tails and lags of every task (module docstring). memory_lags: also use the
  precedences the memory budget implies, F(d, j + K) after B(d, j) with K = memory_caps (then the
  windows hold for schedules within the budget only, which is what the exact check asks)."""
  p = problem
  n, lat = p.num_devices, p.transfer_latency
  dur = p.durations()
  cnt = p.kind_counts()
  caps = memory_caps(p) if memory_lags else np.full((n, 2), 1 << 30, dtype=np.int64)
  heads = [np.zeros((n, int(cnt[k]))) for k in range(4)]
  tails = [np.zeros((n, int(cnt[k]))) for k in range(4)]
  lags = np.zeros((n, 2))
  for fk, bk in ((AF, AB), (CF, CB)):
    f, b = dur[fk], dur[bk]
    m = int(cnt[fk])
    for chain in _model_chain(p, fk):
      last = len(chain) - 1
      for s, d in enumerate(chain):
        lags[d, fk // 2] = (last - s) * (f + b) + 2 * (last - s) * lat
      # Heads, micro-batch by micro-batch (a memory lag reaches back to B(j - K)): forwards up
      # the chain, then backwards down it.
      for j in range(m):
        for s, d in enumerate(chain):
          h = 0.0
          if s > 0:
            h = heads[fk][chain[s - 1], j] + f + lat
          if j > 0:
            h = max(h, heads[fk][d, j - 1] + f)
          k = int(caps[d, fk // 2])
          if j >= k:  # memory: F(j) after B(j - K) ends
            h = max(h, heads[bk][d, j - k] + b)
          heads[fk][d, j] = h
        for s in range(last, -1, -1):
          d = chain[s]
          h = heads[fk][d, j] + f if s == last else heads[bk][chain[s + 1], j] + b + lat
          if j > 0:
            h = max(h, heads[bk][d, j - 1] + b)
          heads[bk][d, j] = _set_head(heads[fk][d], heads[bk][d], j, f, b, h)
      # Tails in reversed time, micro-batch by micro-batch from the last (a memory lag reaches
      # forward to F(j + K)): backwards from stage 0 upwards, then forwards.
      for j in range(m - 1, -1, -1):
        for s, d in enumerate(chain):
          t = b
          if s > 0:
            t = b + lat + tails[bk][chain[s - 1], j]
          if j < m - 1:
            t = max(t, b + tails[bk][d, j + 1])
          k = int(caps[d, fk // 2])
          q, durs = tails[bk][d, j + 1:] - b, np.full(m - 1 - j, b)
          if j + k < m:  # memory: F(j + K..) follow B(j), and so do their successors
            t = max(t, b + tails[fk][d, j + k])
            q = np.concatenate([q, tails[fk][d, j + k:] - f])
            durs = np.concatenate([durs, np.full(m - j - k, f)])
          tails[bk][d, j] = _set_tail(q, durs, b, t)
        for s in range(last, -1, -1):
          d = chain[s]
          t = f + (tails[bk][d, j] if s == last else lat + tails[fk][chain[s + 1], j])
          if j < m - 1:
            t = max(t, f + tails[fk][d, j + 1])
          q = np.concatenate([tails[fk][d, j + 1:] - f, tails[bk][d, j:] - b])
          durs = np.concatenate([np.full(m - 1 - j, f), np.full(m - j, b)])
          tails[fk][d, j] = _set_tail(q, durs, f, t)
  return Windows(heads=tuple(heads), tails=tuple(tails), lags=lags)


def per_task_tails(problem: PipelineProblem) -> np.ndarray:
  """The windows' tails laid out per task as f8 [4, N, max(Ma, Mc)] (kind, device, micro-batch);
  slots past a kind's count hold -1e9 (they are never read for real tasks)."""
  win = task_windows(problem)
  mmax = max(problem.actor_microbatches, problem.critic_microbatches)
  out = np.full((4, problem.num_devices, mmax), -1e9)
  for k in range(4):
    out[k, :, :win.tails[k].shape[1]] = win.tails[k]
  return out


def chain_tails_per_task(problem: PipelineProblem) -> np.ndarray:
  """schedules.task_tails (the chain tail per device and kind) broadcast to [4, N, M]."""
  from rlhfuse_jax.pipeline import schedules  # schedules imports evaluate; keep this light
  mmax = max(problem.actor_microbatches, problem.critic_microbatches)
  chain = schedules.task_tails(problem)  # [N, 4]
  return np.ascontiguousarray(np.broadcast_to(chain.T[:, :, None], (4, problem.num_devices, mmax)))
