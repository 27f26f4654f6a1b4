"""Running an experiments binary from another one (sweep.py, bench_async.py): the command
line with --config.* overrides, the environment that imports this repository, and a run whose
output is streamed with a prefix and kept in the run's log.txt; and the number format of the
binaries' reports (`fixed_or_sci`). No absl flags are defined here, so binaries can share it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence


def fixed_or_sci(x: float, decimals: int, significant: int = 1) -> str:
  """`x` with `decimals` decimals where they show at least `significant` significant digits,
  else 3 significant digits in e-notation: a tiny model's figures (kilobytes, microseconds)
  and the LLaMA presets' (gigabytes, seconds) share one column."""
  small = 0 < abs(x) < 10.0 ** (significant - 1 - decimals)
  return f"{x:.2e}" if small else f"{x:.{decimals}f}"


def format_value(v: Any) -> str:
  """A value as ml_collections parses it on the command line."""
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, (list, tuple)):
    return "(" + ",".join(format_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
  return str(v)


def caller_path(config: str) -> str:
  """`FILE[:variant]` with FILE made absolute when it is a file relative to this process's
  directory (the runs start in the repository root: run_streamed); otherwise as given (a
  configs/X.py of the repository)."""
  path, sep, variant = config.partition(":")
  if os.path.isfile(config):  # a ':' in the file's own name
    return os.path.abspath(config)
  return os.path.abspath(path) + sep + variant if os.path.isfile(path) else config


def build_command(binary: str, config: str, run_dir: str, overrides: dict,
                  passthrough: Sequence[str]) -> list[str]:
  """The run's command line. Paths the caller gave relative to its own directory (the config
  file, the run directory) are made absolute: the run starts in the repository root, where they
  named another file or put the results where the caller did not look."""
  cmd = [sys.executable, "-m", f"experiments.{binary}", f"--config={caller_path(config)}",
         f"--workdir={os.path.abspath(run_dir)}"]
  cmd += [f"--config.{k}={format_value(v)}" for k, v in overrides.items() if k != "name"]
  return cmd + list(passthrough)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_env(**extra: str) -> dict:
  """This environment with the repository importable (and `extra` variables set)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


def run_streamed(cmd: Sequence[str], run_dir: str, name: str, env: dict,
                 started: Optional[Callable[[subprocess.Popen], None]] = None) -> int:
  """Runs `cmd` from the repository root, its output streamed with a [name] prefix and appended
  to run_dir/log.txt after a header line (a re-run, e.g. a resumed sweep, keeps the earlier
  runs' logs); returns its exit status. `started` gets the process once it runs (a caller that
  passes signals on)."""
  proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=REPO_ROOT, env=env)
  if started is not None:
    started(proc)
  os.makedirs(run_dir, exist_ok=True)
  # Line-buffered: `tail -f log.txt` follows the run as it goes (it saw nothing until the end).
  with open(os.path.join(run_dir, "log.txt"), "a", buffering=1) as log_file:
    log_file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd[1:])}\n")

    def copy_output():
      for line in proc.stdout:
        log_file.write(line)
        print(f"[{name}] {line}", end="", flush=True)
    try:
      copy_output()
    except KeyboardInterrupt:
      # Ctrl-C reached the run too: it finishes its iteration and saves; keep its last lines
      # (a second Ctrl-C stops both at once).
      copy_output()
      proc.wait()
      raise
  return proc.wait()


