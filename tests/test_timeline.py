"""generation/timeline.py's ActivityLog: the segments its watcher threads record from a scripted
sequence (controlled completions and clock): what any cheaper recording mechanism must keep."""
import threading

from rlhfuse_jax.generation.timeline import ActivityLog


_seen = threading.local()  # per watcher thread: the clock at its last completion


class _Work:
  """A dispatched operation's output that completes at time `at` when the test says so."""

  def __init__(self, at: float):
    self.at, self.done = at, threading.Event()

  def block_until_ready(self):
    self.done.wait()
    _seen.t = self.at
    return self


def test_scripted_work_gives_the_segments_of_the_documented_rule():
  """Per instance, in dispatch order: [max(dispatch, previous end, `after` seen ready),
  completion]; a tag files the segment; instances do not delay each other."""
  log = ActivityLog(2)
  log.now = lambda: _seen.t
  a, b, c, d = _Work(5.0), _Work(7.0), _Work(4.0), _Work(6.0)
  log.record(0, "decode", a, since=1.0)
  log.record(0, "inference", b, since=2.0)  # behind a
  log.record(1, "migrate", d, since=3.0, tag="m", after=c)  # c is ready at 4, after dispatch
  for w in (d, c, b, a):
    w.done.set()
  assert log.close() == [(0, 1.0, 5.0, "decode"), (1, 4.0, 6.0, "migrate"),
                         (0, 5.0, 7.0, "inference")]
  assert log.tagged == {"m": [(4.0, 6.0)]}
