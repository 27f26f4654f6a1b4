"""Config files on the command line: loading `FILE.py[:variant]` (the sweep, plan_search's
trainer configs), naming a misspelled field with a hint, `parse_flags`, the binaries' flag
parser, which turns ml_collections' errors into one line naming the flag, and `run`, the
binaries' `app.run`, which ends on a bad value's message rather than its traceback and keeps
the libraries' INFO lines out of the log.

ml_collections reports a misspelled override (`--config.algo.clip_range=0.2`) as a 40-line
traceback ending in `AttributeError: "'clip_range'"`, a missing config file as an uncaught
OSError, and an error inside the config file as that file's whole traceback; absl prints its
own one-line form only for `flags.Error`. No absl flags are defined here."""
from __future__ import annotations

import ast
import difflib
import errno
import importlib.util
import inspect
import math
import os
import re
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from absl import app, flags, logging

from experiments import runner
from rlhfuse_jax import fields
from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd


def split_config_path(config_path: str) -> tuple[str, Optional[str]]:
  """(file, variant or None) of `FILE.py[:variant]`, split at the first ':' as ml_collections
  does, unless the whole string names a file."""
  if os.path.isfile(config_path) or ":" not in config_path:
    return config_path, None
  path, variant = config_path.split(":", 1)
  return path, variant


def load_module(config_path: str, flag: str = "--config") -> tuple[Any, Optional[str]]:
  """(the module of `FILE.py[:variant]`, the variant or None); a ValueError naming `flag`
  when the file is missing or is not Python."""
  path, variant = split_config_path(config_path)
  if not os.path.isfile(path):
    raise ValueError(f"{flag}={config_path!r}: no such file {path!r}{_closest_file(path)}")
  spec = importlib.util.spec_from_file_location("_config_" + re.sub(r"\W", "_", path), path)
  if spec is None or spec.loader is None:
    raise ValueError(f"{flag}={config_path!r}: cannot load {path!r} as Python")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, variant


def call_with_variant(fn: Callable[..., Any], variant: Optional[str]) -> Any:
  """fn(variant) if a variant was given and fn takes an argument, else fn()."""
  takes_arg = bool(inspect.signature(fn).parameters)
  return fn(variant) if variant is not None and takes_arg else fn()


def default_variant(module: Any) -> Optional[str]:
  """The variant `module`'s get_config() takes when none is named (its first parameter's
  default), or None (no get_config, no parameter, no default)."""
  try:
    first = next(iter(inspect.signature(module.get_config).parameters.values()), None)
  except (AttributeError, TypeError, ValueError):
    return None
  if first is None or first.default is inspect.Parameter.empty:
    return None
  return None if first.default is None else str(first.default)


def get_config(config_path: str, flag: str = "--config") -> Any:
  """get_config() of `FILE.py[:variant]` (an empty variant: none); a ValueError for a variant
  given to a get_config() that takes none."""
  module, variant = load_module(config_path, flag)
  if not hasattr(module, "get_config"):
    raise ValueError(f"{flag}={config_path!r} defines no get_config()")
  check_variant(module, variant, config_path, flag)
  return call_with_variant(module.get_config, variant or None)


def check_variant(module: Any, variant: Optional[str], config_path: str,
                  flag: str = "--config") -> None:
  """A ValueError when a variant is given to a module whose get_config() takes none."""
  if variant and not inspect.signature(module.get_config).parameters:
    # (ml_collections would call it with the variant: a TypeError about positional arguments)
    path = split_config_path(config_path)[0]
    extra = (f"; to run one entry of its get_sweep(): python -m experiments.sweep "
             f"--config={path} --binary=BINARY --workdir=DIR --only={variant}"
             if hasattr(module, "get_sweep") else "")
    raise ValueError(f"{flag}={config_path!r}: {path}'s get_config() takes no variant "
                     f"(':{variant}'){extra}")


def check_int(name: str, value: Any, minimum: int = 1, hint: str = "") -> None:
  """A ValueError naming config.`name` unless `value` is an integer (a bool is not one)
  >= `minimum` (and within fields.MAX_INT, a seed's excepted: fields.check_int32): the
  binaries' check of their count fields. `hint` follows in brackets (what a special value means)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"config.{name}={value!r}: expected an integer >= {minimum}"
                     + (f" ({hint})" if hint else ""))
  fields.check_int32(name, value)


def check_ints(config: Any, names: Sequence[str], minimum: int = 1) -> None:
  """check_int of each of `config`'s fields `names`, in order."""
  for name in names:
    check_int(name, config[name], minimum)


# Quantities a user may try to set that follow from other fields (the closest name by spelling
# would point elsewhere: rollout.batch_size -> rollout.chunk_size).
DERIVED = {"rollout.batch_size": "the rollout batch is rollout.prompts_per_iteration x "
                                 "rollout.samples_per_prompt samples: set those"}


def check_makespan_target(value: float, default: float) -> int:
  """The makespan schedule_cp_check asks for: --target (-1: `default`), rounded down, and the
  check of --target schedule_lp_check shares. Durations are integers there, so every makespan
  is: "<= 372.6" is "<= 372" (as schedule_lp_check's horizon has it), where rounding to 373
  answered a weaker question than the one asked. (Here, not in a binary: a test importing a
  binary defines its flags, twice with another's.)"""
  # (nan and inf passed: int() then raised "cannot convert float NaN to integer", naming no
  # flag, or an OverflowError's traceback)
  if value != -1 and not (math.isfinite(value) and value >= 0):
    raise ValueError(f"--target={value:g}: expected a makespan >= 0 (finite), or -1 for the "
                     "default")
  return int(math.floor((default if value == -1 else value) + 1e-9))


def missing_field(config: Any, key: str) -> Optional[str]:
  """None when the dotted `key` names a field of `config`; else "has no field 'a.b'" with the
  closest field's path as a hint (or the section's fields; or, for a DERIVED quantity, what
  sets it); or, for a part under a scalar, that it is a value (ml_collections' KeyError came in
  a 40-line traceback). A part under a list or tuple is left to ml_collections."""
  node, walked = config, []
  for part in key.split("."):
    if isinstance(node, (bool, int, float, str)) or node is None:
      return (f"has no field {key!r}: {'.'.join(walked)} is a value ({node!r}), not a "
              "section")
    if not hasattr(node, "keys"):
      return None
    fields = [str(f) for f in node.keys()]
    if part not in fields:
      close = difflib.get_close_matches(part, fields, n=1)
      derived = DERIVED.get(".".join(walked + [part]))
      hint = (f"; {derived}" if derived else
              f"; did you mean {'.'.join(walked + close)!r}?" if close else
              f"; its fields: {', '.join(sorted(fields))}")
      return f"has no field {'.'.join(walked + [part])!r}{hint}"
    node = node[part]
    walked.append(part)
  return None


def replaced_section(config: Any, key: str, value: Any, source: str) -> Optional[str]:
  """What is wrong with setting the dotted `key` of `config` to `value` whole, when `key` names
  a section (a config of fields) and `value` a dict of some of them only: ml_collections
  replaces the section, so the fields not given lose the file's values (the trainer's defaults
  take their place, and config.json records only those given); `source` names the file.
  None otherwise."""
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return None
    node = node[part]
  if not (hasattr(node, "keys") and hasattr(value, "keys")):
    return None
  # Some of the section's own fields and not the others: a dict of other keys is a free-form
  # dict field given a new value (a test config's extras={"free": 1}), taken as it is.
  lost = sorted(str(k) for k in node.keys() if k not in value.keys())
  if not lost or any(k not in node.keys() for k in value.keys()):
    return None
  first = next(iter(value.keys()), None)
  example = (f" (--config.{key}.{first}={value[first]!r})" if first is not None else "")
  return (f"replaces the section {key!r} whole: its fields not given ({', '.join(lost[:6])}"
          f"{', ...' if len(lost) > 6 else ''}) would lose the values {source} gives them; set "
          f"each field instead{example}")


def _config_flag_values(argv: Sequence[str]) -> list[tuple[str, str]]:
  """(flag name, its `FILE[:variant]`) of each config file flag (ml_collections'
  DEFINE_config_file) given in `argv`, in order, a repeated one each time."""
  given = []
  for i, arg in enumerate(argv):
    m = re.match(r"^--?(\w+)(?:=(.*))?$", arg)  # --config=FILE, or --config FILE
    value = m and (m.group(2) if m.group(2) is not None else
                   argv[i + 1] if i + 1 < len(argv) else None)
    if value is not None and m.group(1) in flags.FLAGS and \
        flags.FLAGS[m.group(1)].flag_type() == "config object":
      given.append((m.group(1), value))
  return given


def _config_flags(argv: Sequence[str]) -> dict[str, str]:
  """{flag name: its `FILE[:variant]`} of the config file flags given in `argv` (the last of
  a repeated one)."""
  return dict(_config_flag_values(argv))


def _override_without_file(message: str) -> Optional[str]:
  """An override of a config file flag that was not given (--run_config.rollout.chunk_size
  without --run_config=FILE): absl said only "Unknown command line flag"."""
  m = re.search(r"Unknown command line flag '(\w+)\.([\w.]+)'", message)
  if not (m and m.group(1) in flags.FLAGS and
          flags.FLAGS[m.group(1)].flag_type() == "config object"):
    return None
  return (f"--{m.group(1)}.{m.group(2)} overrides a field of --{m.group(1)}'s config file, "
          f"which was not given: add --{m.group(1)}=FILE.py")


def _repeated_config_flag(argv: Sequence[str]) -> Optional[str]:
  """A config file flag given twice, with overrides: absl's error named an override instead
  ("The flag 'config.num_iterations' is defined twice"), as if that field were the mistake."""
  seen: dict[str, str] = {}
  for name, value in _config_flag_values(argv):
    if name in seen:
      return (f"--{name} given twice ({seen[name]!r} and {value!r}); give it once (a variant "
              f"follows the file after a colon: --{name}=FILE:VARIANT)")
    seen[name] = value
  return None


def diagnose(argv: Sequence[str]) -> Optional[str]:
  """The first config-file problem in `argv` as one line: a missing file, a variant its
  get_config() cannot take, or an override of a field the file's config does not have. None
  when none is found (the caller then shows the original error)."""
  for name, config_path in _config_flags(argv).items():
    try:
      config = get_config(config_path, f"--{name}")
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(e, ValueError) and str(e).startswith(f"--{name}="):
        return str(e)
      # The config file's own error (a misspelled section, a syntax error, a failed import, a
      # missing file it reads): one line with its line number; its traceback was 40-60 lines.
      # One raised further in (a module it imports, the library) keeps its traceback.
      if _raised_in_file(e, config_path) and not traceback_wanted():
        return _load_message(name, config_path, e)
      return None
    if config is None:
      return _returned_none(name, config_path)
    for arg in argv:
      m = re.match(rf"^--?(?:no)?{name}\.([\w.]+)(=|$)", arg)
      problem = m and missing_field(config, m.group(1))
      if problem:
        return f"--{name}.{m.group(1)}: {config_path} {problem}"
  return None


def _replaced_section(argv: Sequence[str]) -> Optional[str]:
  """The first `--config.SECTION={...}` of `argv` that replaces a section of the file's config
  (replaced_section), as one line naming the flag."""
  for name, config_path in _config_flags(argv).items():
    dicts = {}  # the overrides that gave a dict: only they need the file's own config
    for arg in argv:
      m = re.match(rf"^--?{name}\.([\w.]+)=", arg)
      if not m:
        continue
      value = flags.FLAGS[name].value
      for part in m.group(1).split("."):
        value = value[part] if hasattr(value, "keys") and part in value.keys() else None
      if hasattr(value, "keys"):
        dicts[m.group(1)] = value
    if not dicts:
      continue
    try:
      config = get_config(config_path, f"--{name}")
    except Exception:  # pylint: disable=broad-except  (reported by the other checks)
      return None
    for key, value in dicts.items():
      problem = replaced_section(config, key, value, config_path)
      if problem:
        return f"--{name}.{key}: {problem}"
  return None


def _returned_none(name: str, config_path: str) -> str:
  return (f"--{name}={config_path!r}: its get_config() returned None; expected a config (an "
          "ml_collections.ConfigDict: a `return` missing?)")


def _no_config(argv: Sequence[str]) -> Optional[str]:
  """A config file flag whose get_config() returned None (ml_collections warns and goes on)."""
  for name, config_path in _config_flags(argv).items():
    if flags.FLAGS[name].value is None:
      return _returned_none(name, config_path)
  return None


def _missing_file(argv: Sequence[str]) -> Optional[str]:
  """A config file flag naming no file (ml_collections defers that error to the first use of
  the config, deep in the binary)."""
  for name, config_path in _config_flags(argv).items():
    path, _ = split_config_path(config_path)
    if not os.path.isfile(path):
      return f"--{name}={config_path!r}: no such file {path!r}{_closest_file(path)}"
  return None


def _closest_file(path: str) -> str:
  """'; did you mean ...?' with the closest Python file in the directory `path` names (a
  misspelled configs/ppo_tny.py), else _from_the_root's hint, or ''."""
  folder, name = os.path.split(path)
  try:
    names = [n for n in os.listdir(folder or ".") if n.endswith(".py")]
  except OSError:
    return _from_the_root(path)
  close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
  if close:
    return f"; did you mean {os.path.join(folder, close[0])!r}?"
  return _from_the_root(path)


def _from_the_root(path: str) -> str:
  """'; ...' when `path` is relative, missing from the current directory and present in the
  repository root (a binary started elsewhere with the repository on PYTHONPATH), or ''."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  there = os.path.join(root, path)
  if os.path.isabs(path) or os.path.abspath(path) == there or not os.path.isfile(there):
    return ""
  return (f" in the current directory {os.getcwd()!r}; the binaries run from the repository "
          f"root (docs/usage.md): cd {root} or pass {there!r}")


def _raised_in_file(error: BaseException, config_path: str) -> bool:
  """Whether `error` was raised by the config file's own code: its innermost frame outside
  ml_collections (which raises a misspelled section's AttributeError) is in the file, or it
  is the file's SyntaxError."""
  given = os.path.abspath(split_config_path(config_path)[0])
  if isinstance(error, SyntaxError):
    return bool(error.filename) and os.path.abspath(error.filename) == given
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if f"{os.sep}ml_collections{os.sep}" not in f.filename]
  return bool(frames) and os.path.abspath(frames[-1].filename) == given


def traceback_wanted() -> bool:
  """Whether RLHFUSE_TRACEBACK asks for tracebacks in place of the one-line errors."""
  return os.environ.get(TRACEBACK_ENV, "").lower() not in ("", "0", "false", "no", "off")


def _load_message(name: str, config_path: str, error: BaseException) -> str:
  """One line for an error raised while `--name=config_path` was loaded, with the config file's
  line that raised it."""
  given = split_config_path(config_path)[0]
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(given)]
  line = (frames[-1].lineno if frames else  # a SyntaxError is raised before any frame runs
          error.lineno if isinstance(error, SyntaxError) and error.lineno else None)
  where = f" ({given}, line {line})" if line else ""
  # ml_collections' AttributeError of a misspelled section is a quoted, two-line text.
  text = (error.msg if isinstance(error, SyntaxError) else
          error.args[0] if isinstance(error, (KeyError, AttributeError)) and error.args and
          isinstance(error.args[0], str) else str(error))
  text = " ".join(_unquote(text).split())
  return f"--{name}={config_path!r}: loading it raised {type(error).__name__}: {text}{where}"


def _unquote(text: str, times: int = 1) -> str:
  """The text inside up to `times` layers of Python quotes (a KeyError's message, which
  ml_collections quotes again); `text` itself when it is not a quoted string literal."""
  for _ in range(times):
    try:
      inner = ast.literal_eval(text) if text[:1] in "'\"" else None
    except (ValueError, SyntaxError):
      break
    if not isinstance(inner, str):
      break
    text = inner
  return text


def _load_error(argv: Sequence[str]) -> Optional[str]:
  """An OSError raised while a config file was loaded (its get_config() reading a missing
  file): ml_collections keeps it in a placeholder config and raises it at the config's first
  use, deep in the binary. None when every config flag loaded."""
  for name, config_path in _config_flags(argv).items():
    value = flags.FLAGS[name].value
    error = vars(value).get("_error") if type(value).__name__ == "_ErrorConfig" else None
    if isinstance(error, BaseException):
      return _load_message(name, config_path, error)
  return None


# What ml_collections (through absl's parsers) says of a value its field's type does not take,
# and what the field expects, said plainly: "('Non-boolean argument to boolean flag', 'yes')"
# and "invalid literal for int() with base 10: '1.5'" named neither the type nor what it takes.
_TYPE_ERRORS = (
    (r"invalid literal for int\(\) with base 10: ", "expected an integer (the field is an int)"),
    (r"could not convert string to float: ", "expected a number (the field is a float)"),
    (r"\('Non-boolean argument to boolean flag', ",
     "expected true or false (the field is a bool; also 1/0, t/f)"),
)


def wrong_type(message: str) -> Optional[str]:
  """`--config.FIELD='VALUE': expected ...` for a flags.Error message that is ml_collections'
  parse failure of a value against its field's type; None for any other message."""
  m = re.match(r"flag (--[\w.]+)=(.*?): (.*)$", message, re.S)
  if not m:
    return None
  for pattern, expected in _TYPE_ERRORS:
    if re.match(pattern, m.group(3)):
      return f"{m.group(1)}={m.group(2)!r}: {expected}"
  return None


def _usage_example() -> Optional[str]:
  """The first `python -m ...` command of the running binary's docstring (its usage line,
  continuation lines joined), or None."""
  lines = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").splitlines()
  for i, line in enumerate(lines):
    if line.strip().startswith("python -m "):
      command = line.strip()
      while command.endswith("\\") and i + 1 < len(lines):
        i += 1
        command = f"{command[:-1].rstrip()} {lines[i].strip()}"
      return " ".join(command.split())
  return None


def missing_required(message: str) -> Optional[str]:
  """One line for absl's error on required flags left out ("flag --workdir=None: Flag --workdir
  must have a value other than None.", one such line per flag), with the binary's usage line
  as the example; None for any other message."""
  names = re.findall(r"Flag (--\w+) must have a value other than None", message)
  if not names:
    return None
  example = _usage_example()
  return (f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} required"
          + (f"; e.g. {example}" if example else " (--help lists the flags)"))


def shorten(message: str) -> str:
  """A flags.Error message with an embedded traceback (ml_collections wraps an exception raised
  in the config file so) cut to its header, the frame that raised and the exception line; a
  value of the wrong type as `wrong_type` says it."""
  typed = wrong_type(message)
  if typed:
    return typed
  section = re.match(r"flag (--[\w.]+)=(.*?): Failed to parse '.*' as a ConfigDict", message)
  if section:  # a value given to a section of fields (plan_check's actor on its tiny variant)
    return (f"{section.group(1)}={section.group(2)}: {section.group(1)[2:]} is a section of "
            f"fields in this config, not a value: set them as {section.group(1)}.<field>=...")
  head, sep, trace = message.partition("Traceback (most recent call last):")
  if not sep:
    return message
  lines = [line.strip() for line in trace.splitlines() if line.strip()]
  frames = [line for line in lines if line.startswith("File ")]
  last = lines[-1] if lines else ""
  where = f" ({frames[-1]})" if frames else ""
  head = head.replace("Error whilst parsing config file:", "").strip()
  return f"{head} {last}{where}"


def _fatal(message: str) -> None:
  sys.stderr.write(f"FATAL Flags parsing error: {message}\n"
                   "Pass --helpshort or --helpfull to see help on flags.\n")
  sys.exit(1)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`) with every config-file
  error on one line that names the flag: absl's own form for flags.Error, and for the errors
  ml_collections lets through (a misspelled field, a missing file) the field or file with a
  close match. Anything not diagnosed is raised as it came. A value `--name=~/path` has its `~`
  expanded (runner.home_expanded), as the shell does for `--name ~/path`."""
  argv = runner.home_expanded(argv)
  try:
    args = flags.FLAGS(argv)
  except flags.Error as e:
    # (diagnose first: a config file whose get_config() returned None reads as one left out)
    _fatal(_repeated_config_flag(argv[1:]) or _override_without_file(str(e)) or
           diagnose(argv[1:]) or missing_required(str(e)) or shorten(str(e)))
  except Exception:  # pylint: disable=broad-except  (re-raised unless diagnosed)
    message = diagnose(argv[1:])
    if message is None:
      raise
    _fatal(message)
  problem = (_missing_file(argv[1:]) or _load_error(argv[1:]) or _no_config(argv[1:]) or
             _replaced_section(argv[1:]))
  if problem:
    _fatal(problem)
  workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
  if workdir is not None and not workdir.strip():  # --workdir= (an unset shell variable)
    _fatal(f"--workdir={workdir!r}: expected a directory (new or a run's own)")
  if workdir and os.path.exists(workdir) and not os.path.isdir(workdir):
    _fatal(f"--workdir={workdir!r} is a file; expected a directory (new or a run's own)")
  problem = workdir and "://" not in workdir and unwritable(workdir)
  if problem:
    _fatal(f"--workdir={workdir!r}: {problem}; expected a directory this process can create "
           "and write")
  return args


def unwritable(path: str) -> Optional[str]:
  """Why `path` (a directory, existing or to be made) cannot be written, or None: the nearest
  existing directory on its way (itself, else an ancestor) must be writable. A read-only
  filesystem or a directory without write permission otherwise failed deep in the binary, as an
  OSError traceback, after the config was loaded (and for train_ppo, after jax started)."""
  probe = os.path.abspath(path)
  while not os.path.exists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      return None
    probe = parent
  if not os.path.isdir(probe):
    return f"{probe} is a file, not a directory"
  if not os.access(probe, os.W_OK | os.X_OK):
    return f"{probe} is not writable (read-only filesystem or no write permission)"
  return None


TRACEBACK_ENV = "RLHFUSE_TRACEBACK"
# What `run` reports as one line: bad input (ValueError), a file a field names that does not
# exist (FileNotFoundError: the loaders' messages name the field or the file) and a workdir
# another run holds. Anything else is a bug's traceback.
# FloatingPointError: train_ppo's NaN guard (trainer/loop.NonFiniteError), whose message names
# the iteration, the quantity and what to change; it came as a 30-line traceback. Only its
# subclasses (user_error): jax's own, under jax_debug_nans, is a bare FloatingPointError whose
# traceback, where the NaN arose, is what its user asked for.
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError, wd.WorkdirInUseError,
               wd.MainProcessError)


# An OSError from the machine rather than the code: a full disk or quota, a read-only
# filesystem, a file the user may not write, a file where a directory belongs (EEXIST from
# os.makedirs, ENOTDIR below it) or the reverse
# (a failed write to metrics.jsonl, result.json or .lock ended in a 50-87 line traceback).
# (EFBIG: a file-size limit, `ulimit -f`, a full disk's stand-in in a fault test, which ended
# a resume's first write in a 50-line traceback)
ENVIRONMENT_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EEXIST,
                                errno.EFBIG))


def _config_lacks_field(e: BaseException) -> Optional[ValueError]:
  """A ValueError for ml_collections' KeyError or AttributeError of a field the binary read and
  its config file lacks (a config of another binary, or a copy older than a field): its
  traceback was 33-48 lines ending in `AttributeError: "'memory_budget'"`. Only for a read of a
  missing key on a config file flag's config (found by identity among its sections, which
  names the flag and the field's path); None otherwise (a locked config written to, another
  ConfigDict: the code's own error, its traceback kept)."""
  if not isinstance(e, (KeyError, AttributeError)):
    return None
  section = None  # the ConfigDict the missing key was read from: `self` of ml_collections' frame
  for frame, _ in traceback.walk_tb(e.__traceback__):
    if f"{os.sep}ml_collections{os.sep}" in frame.f_code.co_filename:
      this = frame.f_locals.get("self")
      section = this if hasattr(this, "keys") else section
  key = e.args[0] if e.args else ""
  if isinstance(key, KeyError):  # __getattr__'s AttributeError wraps __getitem__'s KeyError
    key = key.args[0] if key.args else ""
  key = key if isinstance(key, str) else ""
  key = _unquote(key, times=2)  # ml_collections quotes it, once or twice
  # A bare key, on its own line ("'modle'\nDid you mean ..."); a locked config's write says
  # 'Key "x" does not exist and cannot be added ...': not a read of a missing field.
  key = key.split("\n")[0].strip().strip("'\"")
  if section is None or not key.isidentifier() or key in section.keys():
    return None
  for name, config_path in _config_flags(sys.argv[1:]).items():
    where = _section_path(flags.FLAGS[name].value, section)
    if where is not None:
      break
  else:
    return None
  field = f"{where}.{key}" if where else key
  binary = os.path.splitext(os.path.basename(sys.argv[0]))[0]
  ours = os.path.abspath(os.path.dirname(sys.argv[0])) == os.path.join(runner.REPO_ROOT,
                                                                       "experiments")
  who = f"experiments.{binary}" if ours else os.path.basename(sys.argv[0])
  own = os.path.join("configs", f"{binary}.py")
  hint = (f" ({who}'s own is {own})"
          if ours and os.path.isfile(os.path.join(runner.REPO_ROOT, own)) else "")
  return ValueError(f"--{name}={config_path!r} has no field {field!r}, which {who} reads: a "
                    f"config file of another binary, or a copy older than the code{hint}")


def _section_path(config: Any, section: Any, prefix: str = "") -> Optional[str]:
  """The dotted path of `section` (by identity) in `config` ('' for config itself); None."""
  if config is section:
    return prefix
  if not hasattr(config, "keys"):
    return None
  for k in config.keys():
    try:
      found = _section_path(config[k], section, f"{prefix}.{k}" if prefix else str(k))
    except Exception:  # pylint: disable=broad-except  (a field that cannot be read)
      continue
    if found is not None:
      return found
  return None


def user_error(e: BaseException) -> bool:
  """Whether `run` reports `e` as one line (USER_ERRORS, or an OSError of
  ENVIRONMENT_ERRNOS), not as a traceback."""
  return (isinstance(e, USER_ERRORS) and type(e) is not FloatingPointError or
          isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS)


def _save_traceback(text: str, in_workdir: bool = True) -> Optional[str]:
  """Writes a traceback beside the run's outputs (WORKDIR/traceback.txt, on the shared
  filesystem of a multi-host job; the last failure's, so failed starts do not pile up files),
  else in the temp directory (one file per process); returns the path, or None if neither
  can be written. `in_workdir=False`: the temp directory (a start refused from a workdir
  that another run holds, or that holds another binary's outputs: their traceback.txt stays
  theirs)."""
  workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
  beside = in_workdir and workdir and os.path.isdir(workdir)
  places = ([os.path.join(workdir, "traceback.txt")] if beside else []) + [
      os.path.join(tempfile.gettempdir(),
                   f"rlhfuse_traceback.{socket.gethostname()}.{os.getpid()}.txt")]
  for path in places:
    try:
      with open(path, "w") as f:
        f.write(text)
      return path
    except OSError:
      continue
  return None


# Seconds process 0 waits before an error's exit ends the coordination service (the others'
# time to report the same error). RLHFUSE_PEER_GRACE_S replaces it: longer where processes
# reach a shared check far apart (a slow shared filesystem), shorter in tests.
PEER_GRACE_ENV = "RLHFUSE_PEER_GRACE_S"
PEER_GRACE_S = 10


def peer_grace_s() -> float:
  """PEER_GRACE_S, or the environment's RLHFUSE_PEER_GRACE_S (seconds >= 0)."""
  text = os.environ.get(PEER_GRACE_ENV)
  if text is None:
    return PEER_GRACE_S
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value >= 0:  # also NaN
    raise ValueError(f"{PEER_GRACE_ENV}={text!r}: expected seconds, a number >= 0")
  return value


def exit_now(status: int) -> None:
  """Flushes the logs, stdout and stderr, then ends the process with `status` without
  Python's shutdown (no atexit handlers: jax's distributed shutdown barrier, orbax's waits for
  a save's threads)."""
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _exit_now_if_peers(print_first: str = "") -> None:
  """Ends this process at once, status 1, when it is one of several of a multi-host run (after
  printing `print_first`, a traceback). Through Python's exit, jax's atexit
  jax.distributed.shutdown() waits in a barrier for every process, while the others wait for
  this one in their next collective: an error raised on one process only (a reward function
  failing on its own samples) held the run 5 minutes until the barrier's deadline aborted every
  process (status 134, the error's line buried under the abort's). Exiting now closes this
  process's connections: the others end at once (exit 69, a lost peer). What a run writes
  is on disk when it is written (metrics rows, checkpoints, log.txt); what was not saved since
  the last checkpoint is lost, as with any error."""
  jax = sys.modules.get("jax")
  try:
    several = jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1
  except Exception:  # noqa: BLE001 a jax too broken to answer: leave the exit to Python
    several = False
  if not several:
    return
  if print_first:
    sys.stderr.write(print_first)
  if jax.process_index() == 0:
    # Process 0 hosts jax's coordination service: its exit aborts the others (134) before a
    # slower one that fails on the same input (a config every process checks) has said why.
    try:
      grace = peer_grace_s()
    except ValueError as e:  # the error being reported matters more: wait the default
      logging.error("%s; waiting %d s", e, PEER_GRACE_S)
      grace = PEER_GRACE_S
    logging.error("process 0 exits in %g s (the others that fail too report their errors "
                  "first)", grace)
    logging.flush()
    time.sleep(grace)
  exit_now(1)


_SIGNALLED: list = []  # the runs the SIGTERM handler passed the signal on to


class Terminated(BaseException):
  """SIGTERM to a binary that has no handler of its own (the one-shot binaries): raised in the
  main thread, so that `run` ends it with one line and status 143 (it died at once, silently,
  its earlier outputs already moved aside)."""


def _raise_on_sigterm() -> None:
  """Installs the SIGTERM handler that raises Terminated, where SIGTERM has the default action
  (a binary's own handler, installed later, replaces it)."""
  if (threading.current_thread() is threading.main_thread() and
      signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
    def handler(signum, frame):
      del frame
      # The runs this process has going first (bench_async's, in threads the Terminated below
      # does not reach: leaving, it would wait for them to finish training).
      for proc in runner.live_runs():
        if proc.poll() is None:
          proc.send_signal(signum)
          _SIGNALLED.append(proc)
      raise Terminated()
    signal.signal(signal.SIGTERM, handler)


def _stop_runs(sig: Optional[int], timeout_s: float = 600.0) -> int:
  """Passes `sig` (None: the Ctrl-C reached them already, they share the process group) on to
  the runs runner.run_streamed has going that the SIGTERM handler has not signalled already,
  and waits for them to save and end (a second Ctrl-C: at once, killing them); returns how many
  runs were stopped, those the handler signalled included, each once."""
  live = runner.live_runs()
  if live:
    logging.warning("waiting for %d run(s) to save and end (Ctrl-C again: at once)", len(live))
    try:
      for proc in live:
        if sig is not None and proc.poll() is None and proc not in _SIGNALLED:
          proc.send_signal(sig)
      for proc in live:
        proc.wait(timeout=timeout_s)
      for proc in live:  # and for their last lines in their log.txt (exit_now ends the copy)
        runner.wait_output(proc, 10.0)
    except (KeyboardInterrupt, Terminated, subprocess.TimeoutExpired):
      for proc in live:
        proc.kill()
  return len(set(live) | set(_SIGNALLED))


def run(main: Callable[[list[str]], Any], argv: Optional[list[str]] = None,
        traceback_in_workdir: bool = True) -> Any:
  """`app.run(main)` with `parse_flags`, and a USER_ERRORS exception that ends `main` (this
  codebase's bad input: the message names the field or file and what was expected) logged as
  one line, exit status 1, its traceback kept in a file the next line names (or printed, with
  RLHFUSE_TRACEBACK=1). Other exceptions print their traceback as before.
  `traceback_in_workdir=False`: that file always in the temp directory (the sweep, whose input
  errors come before any run: a corrected command re-run on a finished sweep's workdir found
  the last mistake's traceback.txt among the results)."""

  def guarded(args):
    metrics_lib.quiet_library_logs()
    runner.note_start()  # when, from which commit and by which command: read before the run
    _raise_on_sigterm()
    try:
      runner.die_with_parent()  # started by a sweep (run_streamed): end with it
      return main(args)
    except (KeyboardInterrupt, Terminated) as e:
      # One line, not a traceback through jax's compiler (once a segfault at exit, 139); a
      # binary with handlers of its own (train_ppo, the sweep) ends its own way first.
      term = isinstance(e, Terminated)
      runs = _stop_runs(signal.SIGTERM if term else None)
      moved = wd.MOVED_ASIDE[0] if wd.MOVED_ASIDE else ""
      logging.error("%s: stopped before it finished; nothing more is written%s%s",
                    "SIGTERM" if term else "interrupted",
                    f"; its {runs} run(s) saved and ended (the same command resumes them)"
                    if runs else "",
                    f" (the earlier run's outputs are in {moved})" if moved else "")
      exit_now(75 if runs and term else 143 if term else 130)
    except Exception as e:  # noqa: BLE001 a user error in one line, any other re-raised
      e = _config_lacks_field(e) or e
      if not user_error(e) or traceback_wanted():
        _exit_now_if_peers(traceback.format_exc())
        raise
      path = _save_traceback(traceback.format_exc(), in_workdir=traceback_in_workdir and not
                             isinstance(
                                 e, (wd.WorkdirInUseError, wd.ForeignWorkdirError,
                                     wd.MainProcessError)))
      logging.error("%s: %s", type(e).__name__, e)
      logging.flush()
      sys.stderr.write(f"(where it was raised: {path or 'not saved'}; {TRACEBACK_ENV}=1 prints "
                       "it)\n")
      _exit_now_if_peers()
      sys.exit(1)

  return app.run(guarded, argv=argv, flags_parser=parse_flags)


if __name__ == "__main__":
  raise SystemExit("experiments/config_files.py is a library of the binaries, not one "
                   "(docs/usage.md lists them)")
