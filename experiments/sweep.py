r"""Generic sweep runner: runs a binary once per override dict of a config's get_sweep().

  python -m experiments.sweep --config=configs/X.py --binary=NAME --workdir=DIR \
      [--config.field=value ...]

For each entry of get_sweep() (a dict of dotted config paths -> values; an optional "name" key
names the run and is not passed on), runs, one after the other,
  python -m experiments.NAME --config=configs/X.py --workdir=DIR/<run> --config.k=v ...
with the sweep's own --config.* flags appended to every run (so they override the sweep's
values). Output is streamed with a prefix, [i/N run]. Then writes DIR/summary.json,
DIR/summary.csv and DIR/summary.md: one row per run with its overrides, its status, and the
scalar fields of its result.json (or of the last line of its metrics.jsonl), nested dicts
flattened with '/' and lists skipped (summary.md's table: for train_ppo the headline results
alone, HEADLINE_COLUMNS, the others named below it); runs that differ only in seed fields
also as one row per setting with each result's mean and standard deviation
(DIR/summary_seeds.json, a second table of summary.md), and training runs' curves in
DIR/curves.png (a setting's seeds as their mean in a band). summary.md opens with a
line on where the sweep stands (runs with a row of all, failed, not run yet, wall time). A failed
run is a row with its status, not the end of the sweep; the sweep then exits 1 naming the failed
runs. A run stopped by a signal (exit 75), or SIGTERM to the sweep (passed on to the run in
progress), ends the sweep after that run: the summary has the runs so far (and the earlier
rows of those it did not reach), and the sweep exits 75, as train_ppo does (the same command
runs it again: train_ppo runs resume, and a one-shot
binary's run that finished with the same config from the same code (commit and uncommitted
changes) and the same files its config names by path (RUN/sweep_inputs.json), its row ok in
summary.json, its config.json and result.json in place, is kept, not run again, unless
--rerun). A workdir holds one sweep (DIR/sweep.json: config, variant, binary; another is
refused). A second start while one runs is refused (DIR/.lock): at once when the holder is on
this host, after up to --lock_wait_s (240 s) when it names another host (a crashed node's lock
on a shared filesystem lasts until the server's lease on it ends; a SIGTERM or SIGHUP
meanwhile ends the wait with exit 75). Ctrl-C ends the sweep with 130 once
the run in progress (which gets it too) has ended: the summary has the runs so far, and the
sweep logs its line on where it stands (as at its end) and the command that continues it. A
training run's wall_s sums its starts that trained, as its result.json's trained_by records
each (a finished run started again, with nothing left to train, keeps its wall_s). Each run
starts in the repository root; a relative
--config file or --workdir is the caller's (made absolute). `--config=configs/X.py:variant`
gives every run that variant (and get_sweep the variant, if it takes an argument). Each run's
output is appended to DIR/<run>/log.txt; --dry_run prints the commands and writes nothing;
--only=NAME,... runs those entries alone (in their directories of the whole sweep; the summary
keeps the other runs' earlier rows). Before
anything runs, every overridden field (the entries' and the sweep's own --config.* flags) must
exist in the file's get_config(): a misspelled one is named once, with the closest field,
instead of failing every run; likewise a value its field's type does not take. A train_ppo
sweep also checks each run's whole config as train_ppo does, and refuses a run whose
checkpoints were trained with other values of fields that change the trajectory (unless its
checkpoint.resume_changes names them); a failed start of a finished run keeps that run's
figures in the summary, its status saying so.

Docs: docs/usage.md ("Configs and sweeps").
"""
from __future__ import annotations

import ast
import csv
import difflib
import hashlib
import io
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
import unicodedata
from typing import Any, Collection, Optional, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments.runner import (REPO_ROOT, RunInterrupted, across_seeds, build_command,
                                command_line, format_value, code_state, home_expanded,
                                merge_rows, repo_env, run_streamed, seed_groups, smooth)
from rlhfuse_jax import workdir as wd
from rlhfuse_jax import metrics

_CONFIG = flags.DEFINE_string("config", None, "config file defining get_sweep()", required=True)
_BINARY = flags.DEFINE_string("binary", None, "module name under experiments/", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "sweep output directory", required=True)
_DRY = flags.DEFINE_bool("dry_run", False, "print the commands without running them")
_ONLY = flags.DEFINE_list("only", None, "run only these entries of get_sweep(), by run name "
                          "(e.g. --only=e0,e7; --dry_run lists the names)")
_RERUN = flags.DEFINE_bool("rerun", False, "run every entry again, also a one-shot binary's "
                           "run that finished earlier with the same config (kept otherwise); "
                           "a train_ppo run resumes from its checkpoints whatever this says: "
                           "a finished one trains nothing (remove its directory to retrain)")
# As train_ppo's config.lock_wait_s: a sweep requeued (exit 75) onto another node right after
# its node crashed meets the dead node's lock on a shared filesystem until the lease ends.
_LOCK_WAIT = flags.DEFINE_float("lock_wait_s", 240.0, "seconds to wait for the workdir's lock "
                                "when a sweep on another host holds it (0: refuse at once)",
                                lower_bound=0.0)
flags.register_validator("lock_wait_s", math.isfinite,  # nan passes the bound, then waited for ever
                         message="expected a finite number of seconds >= 0")


def load_sweep(config_path: str) -> list[dict]:
  """get_sweep() of `FILE.py[:variant]` (the variant, when given, is passed on to every run's
  --config, and to get_sweep if it takes an argument)."""
  return _sweep_of(*config_files.load_module(config_path), config_path)


def _sweep_of(module: Any, variant: Optional[str], config_path: str) -> list[dict]:
  """load_sweep on the loaded config module."""
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"--config={config_path!r} defines no get_sweep()")
  got = config_files.call_with_variant(module.get_sweep, variant)
  # A forgotten `return` (None) or a dict ended in a TypeError's traceback or "get_sweep()[0] is
  # str" (a dict's first key); an empty list in exit 0 and an empty summary table.
  if got is None or isinstance(got, (dict, str, bytes)) or not hasattr(got, "__iter__"):
    raise ValueError(f"--config={config_path!r}: get_sweep() returned {type(got).__name__}; "
                     "expected a list of dicts, one per run (field: value overrides, and an "
                     "optional 'name')")
  sweep = list(got)  # (a generator too)
  if not sweep:
    raise ValueError(f"--config={config_path!r}: get_sweep() returned no runs; expected a list "
                     "of dicts, one per run")
  seen: dict[str, int] = {}
  for i, entry in enumerate(sweep):
    if not isinstance(entry, dict):
      raise ValueError(f"get_sweep()[{i}] is {type(entry).__name__}; expected a dict")
    keys = [k for k in entry if not isinstance(k, str)]
    if keys:
      raise ValueError(f"get_sweep()[{i}] has the key {keys[0]!r}; expected field names as "
                       "text ('algo.lr', 'name')")
    # A run's name is its directory: two runs of one name shared it (the second resumed the
    # first's checkpoint, or was refused as another config).
    name = run_name(i, entry)
    if name in seen:
      raise ValueError(f"get_sweep()[{seen[name]}] and [{i}] are both named {name!r}; each run "
                       "needs its own name (its directory under --workdir)")
    # ',': --only splits its list there; a name of the sweep's own files made a directory the
    # summary could not be written over (IsADirectoryError, the later runs never ran).
    if ("/" in name or name.startswith(".") or os.sep in name or "," in name
        or name != name.strip() or name in SWEEP_OUTPUTS):
      raise ValueError(f"get_sweep()[{i}]['name']={name!r}: expected a directory name (no "
                       "'/' or ',', not starting with '.', not starting or ending with a "
                       "space) other than the "
                       f"sweep's own files {list(SWEEP_OUTPUTS)}")
    # A None reached the run as the text "None" (a prompts_file 'None' not found), and the
    # summary showed it as an empty cell, as if the field kept its default.
    # A name past the file system's NAME_MAX passed --dry_run, then the sweep crashed on its
    # directory (OSError: File name too long) after the earlier runs had trained; a tab or a
    # newline made a directory no shell line names plainly, and broke summary.md's table.
    control = [c for c in name if unicodedata.category(c) == "Cc"]
    if control:
      raise ValueError(f"get_sweep()[{i}]['name']={name!r}: expected a directory name without "
                       f"control characters (it has {control[0]!r})")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > MAX_NAME_BYTES:
      raise ValueError(f"get_sweep()[{i}]['name']={name[:40]!r}... is {size} bytes long; "
                       f"expected at most {MAX_NAME_BYTES} (a directory name's limit, NAME_MAX)")
    nones = [k for k, v in entry.items() if v is None]
    if nones:
      raise ValueError(f"get_sweep()[{i}] ({name}): {', '.join(repr(k) for k in nones)} "
                       "is None; a --config flag has no None: give a value of the field's "
                       "type ('' for an empty text), or leave the field out to keep its "
                       "default")
    seen[name] = i
  return sweep


MAX_NAME_BYTES = 255  # NAME_MAX of Linux's file systems: a run's name is its directory's


def flag_field(arg: str) -> tuple[str, str]:
  """(field, value) of a `--config.FIELD=VALUE` flag (the sweep's own, passed to every run)."""
  field, _, value = arg[len("--config."):].partition("=")
  return field, value


def check_overrides(module: Any, variant: Optional[str], config_path: str,
                    runs: Sequence[tuple[int, str, dict]], passthrough: Sequence[str]
                    ) -> dict[str, dict]:
  """Every field the runs' entries (`select`'s triples) and the sweep's own --config.* flags
  override exists in the config (get_config() of the loaded file and variant), and takes the
  value (check_values); a ValueError naming the first that does not, before any run starts
  (each run would otherwise start, import jax and fail on it). Warns of an entry's field that
  the variant sets: every run then loses the variant's value (a sweep of ppo_tiny.py:grpo over
  estimators ran no GRPO), unless get_sweep() gives the variant entries of its own (then it
  sets them on purpose: ppo_tiny.py:fused's fusion ablation). Returns check_values' configs
  ({} without a get_config())."""
  if not hasattr(module, "get_config"):
    return {}
  # every run's --config carries the variant: its get_config() must take it
  config_files.check_variant(module, variant, config_path)
  config = config_files.call_with_variant(module.get_config, variant)
  keys = [(f"get_sweep()[{i}]", k) for i, _, entry in runs for k in entry if k != "name"]
  keys += [("the sweep's flag", flag_field(arg)[0]) for arg in passthrough]
  for where, key in keys:
    problem = config_files.missing_field(config, key)
    if problem:
      raise ValueError(f"{where}: --config.{key}: {config_path} {problem}")
  # {"optim": {"actor_lr": ...}} (an entry's, or the sweep's own flag) would replace the section
  given = [(f"get_sweep()[{i}]", k, v) for i, _, entry in runs for k, v in entry.items()
           if k != "name"]
  for arg in passthrough:
    key, text = flag_field(arg)
    try:
      given.append(("the sweep's flag", key, ast.literal_eval(text)))
    except (ValueError, SyntaxError):  # not a literal: not a dict
      pass
  for where, key, value in given:
    problem = config_files.replaced_section(config, key, value, config_path)
    if problem:
      raise ValueError(f"{where}: --config.{key}: {problem}")
  if variant is not None and not _own_sweep(module, variant):
    warn_variant_overridden(config, config_files.call_with_variant(module.get_config, None),
                            config_path, runs)
  return check_values(config_path, runs, passthrough)


def _newest_checkpoint(run_dir: str) -> Optional[int]:
  """The iteration of the newest checkpoint (checkpoints/<iteration>/) a train_ppo run in
  `run_dir` saved, that a start resumes from; None without one."""
  try:
    return max((int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints"))
                if n.isdigit()), default=None)
  except OSError:
    return None


def _own_sweep(module: Any, variant: str) -> bool:
  """Whether get_sweep() gives `variant` other entries than it gives the file's default: a sweep
  written for that variant, whose entries override its fields on purpose."""
  def entries(v: Optional[str]) -> Any:  # without their names (a name may spell the variant)
    return wd.as_json([{k: x for k, x in e.items() if k != "name"}
                       for e in config_files.call_with_variant(module.get_sweep, v)])
  try:
    return entries(variant) != entries(None)
  except Exception:  # pylint: disable=broad-except  (get_sweep() wants its variant)
    return False


def _field(config: Any, key: str) -> Any:
  """config's value at the dotted `key` (a field check_overrides found)."""
  for part in key.split("."):
    config = config[part]
  return config


def warn_variant_overridden(variant_config: Any, base_config: Any, config_path: str,
                            runs: Sequence[tuple[int, str, dict]]) -> list[str]:
  """Warns (and returns them) of the fields that the variant of `config_path` sets to another
  value than the file's default get_config() and that an entry overrides with a third: the
  entries' values replace the variant's in those runs."""
  clash = []
  for key in dict.fromkeys(k for _, _, entry in runs for k in entry if k != "name"):
    try:
      own = wd.as_json(_field(variant_config, key))
      base = wd.as_json(_field(base_config, key))
    except (KeyError, AttributeError, TypeError):  # a field only the variant has
      continue
    if own != base and any(key in e and wd.as_json(e[key]) != own for _, _, e in runs):
      clash.append(key)
  if clash:
    logging.warning("get_sweep()'s entries set %s, which --config=%s sets itself: each run "
                    "gets the entry's value, not the variant's (%s)", ", ".join(clash),
                    config_path, ", ".join(f"{k}={_field(variant_config, k)!r}" for k in clash))
  return clash


def check_values(config_path: str, runs: Sequence[tuple[int, str, dict]],
                 passthrough: Sequence[str]) -> dict[str, dict]:
  """Every run's overrides (`select`'s triples, then the sweep's own --config.* flags) parse
  as its binary will parse them: ml_collections' own parsing of `--config.k=v` against the
  field's type, on a private FlagValues. A ValueError naming the run (or the sweep's flag) and
  the value before any run starts; a value of the wrong type (num_iterations='abc') failed
  each run after it had started. What a binary checks of a value beyond its type (ranges,
  combinations) it still checks itself, at the run's start. Returns each run's config as
  its binary gets it, {run name: config as a dict}."""
  path, variant = config_files.split_config_path(config_path)
  config_arg = f"--config={os.path.abspath(path)}" + (f":{variant}" if variant is not None else "")
  own = [(name, f"get_sweep()[{i}] ({name})",
          [f"--config.{k}={format_value(v)}" for k, v in entry.items() if k != "name"])
         for i, name, entry in runs]
  configs = {}
  for name, where, args in [(None, "the sweep's flag", [])] + own:
    argv = home_expanded(["sweep", config_arg, *args, *passthrough])  # as its runs do
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    try:
      values(argv)
      config = values["config"].value  # (applies the overrides)
    except flags.Error as e:
      raise ValueError(f"{where}: {config_files.shorten(str(e))}") from None
    if name is not None:
      configs[name] = config.to_dict() if hasattr(config, "to_dict") else config
  return configs


def check_train_configs(runs: Sequence[tuple[int, str, dict]], configs: dict[str, dict],
                        passthrough: Sequence[str]) -> dict[str, Any]:
  """Each train_ppo run's config checked as train_ppo checks it as it starts
  (TrainConfig.from_config_dict of check_values' config, `given` the fields its command sets,
  and its reward functions resolved, build.check_reward_functions): a ValueError naming the run
  and the field before any run starts, where `algo.minibatch_size=5`, or a reward.function
  misspelt, failed its run after the earlier runs had trained. No jax device is touched; what
  train_ppo checks against the devices and the checkpoints it still checks at its start.
  Returns {run name: TrainConfig}."""
  from rlhfuse_jax.trainer import build  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer.config import TrainConfig  # pylint: disable=import-outside-toplevel
  flagged = [flag_field(arg)[0] for arg in passthrough]
  out = {}
  for i, name, entry in runs:
    if name not in configs:
      continue
    given = set(flagged) | {k for k in entry if k != "name"}
    try:
      out[name] = TrainConfig.from_config_dict(configs[name], given=given)
      build.check_reward_functions(out[name])
    except ValueError as e:
      raise ValueError(f"get_sweep()[{i}] ({name}): {e}") from None
  return out


def _record_has(record: dict, field: str) -> bool:
  """Whether config record `record` (config.json's nested sections) holds dotted `field`."""
  section, _, key = field.rpartition(".")
  node: Any = record
  for part in section.split(".") if section else ():
    node = node.get(part) if isinstance(node, dict) else None
  return isinstance(node, dict) and key in node


def refuse_changed_trajectories(workdir: str, runs: Sequence[tuple[int, str, dict]],
                                cfgs: dict[str, Any]) -> dict[str, list[str]]:
  """A ValueError, before any run starts, naming each train_ppo run whose directory holds
  checkpoints of a config that differs from the run's in fields that change its trajectory
  (the fingerprint train_ppo compares on resume, less the fields the run's
  checkpoint.resume_changes names): a sweep re-run with a changed value launched every run, each
  failed on it, and the failed rows replaced the finished ones in the summary. The checkpoints'
  config is the record of the start that wrote the newest (config.json, config.K.json);
  fields naming input files (init.*, their content compared by the run) are left to the run.
  Returns {run name: the changed fields its checkpoint.resume_changes lets through}."""
  from rlhfuse_jax.trainer import config as config_lib  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer import hooks  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer import inputs  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer import loop  # pylint: disable=import-outside-toplevel
  refused, let_through = [], {}
  for i, name, _ in runs:
    run_dir = os.path.join(workdir, name)
    newest = _newest_checkpoint(run_dir)
    if name not in cfgs or newest is None:
      continue
    record, path = hooks.config_record_of(run_dir, newest)
    try:
      saved = config_lib.TrainConfig.from_config_dict(
          {k: v for k, v in (record or {}).items() if k != "plan_file_content"})
    except (ValueError, TypeError, AttributeError):  # unreadable, or older code's: the run says
      continue
    cfg = cfgs[name]
    allowed = cfg.checkpoint.resume_changes_set
    # A field the record lacks (written before it existed) is compared as the run compares it:
    # with the value such a run had where that is not the default (loop.ran_before_fields),
    # not with the default from_config_dict filled in.
    try:
      ran_before = loop.ran_before_fields(cfg)
    except (OSError, ValueError):  # its reward model unreadable, or 'on' without statistics:
      ran_before = {}  # the run says so as it starts
    absent = {k: v for k, v in ran_before.items() if not _record_has(record or {}, k)}
    old = {k: v for k, v in saved.fingerprint().items() if k not in absent}
    changes = [c for c in config_lib.fingerprint_changes(old, cfg.fingerprint(), absent)
               if c.split(":")[0] not in inputs.PATH_FIELDS]
    passed, changes = config_lib.split_resume_changes(changes, allowed)
    if passed:
      let_through[name] = [c.split(":")[0] for c in passed]
    if changes:
      refused.append(f"get_sweep()[{i}] ({name}): its checkpoints (iteration {newest}; {path}) "
                     f"were trained with other values: {'; '.join(changes)}. " +
                     config_lib.resume_advice(changes, allowed))
  if refused:
    raise ValueError(f"{len(refused)} run(s) of this sweep would be refused as they start: " +
                     " | ".join(refused) + f" (or remove a run's directory under {workdir} to "
                     "train it again from the start)")
  return let_through


def warn_mixed_flags(rows: Sequence[dict], flagged: Sequence[str], warned: Collection[str] = ()
                     ) -> list[str]:
  """Warns (once per field: `warned` are done) of each field this start's --config.* flags set
  whose value differs between the summary's rows: runs of earlier starts (--only, a re-run)
  made with other flags. They are not seeds of one setting (the seeds table leaves them
  apart), and a column compares runs made differently. Returns the fields warned of."""
  out = []
  for key in flagged:
    if key in warned:
      continue
    by_value: dict = {}
    for row in rows:
      by_value.setdefault(json.dumps(row.get(key), default=str), []).append(str(row.get("run")))
    if len(by_value) > 1:
      logging.warning("the summary's runs were made with different %s: %s (earlier starts of "
                      "the sweep had other --config flags); runs that differ in it are not "
                      "grouped as seeds of one setting", key, "; ".join(
                          f"{v} in {', '.join(runs)}" for v, runs in by_value.items()))
      out.append(key)
  return out


def warn_shadowed(runs: Sequence[tuple[int, str, dict]], passthrough: Sequence[str]
                  ) -> tuple[list, list]:
  """Warns of each field that the sweep's own --config.* flag sets and the entries set too:
  the flag wins in every run, so entries that differed only there are the same run (a seeds
  sweep given --config.seed=5 ran each setting twice with seed 5). Returns (those fields, the
  groups of runs that became one)."""
  flags_set = {flag_field(arg)[0] for arg in passthrough}
  shadowed = sorted(flags_set & {k for _, _, e in runs for k in e if k != "name"})
  twins: list = []
  if shadowed:
    same: dict = {}
    for _, name, entry in runs:
      rest = {k: v for k, v in entry.items() if k not in shadowed and k != "name"}
      same.setdefault(json.dumps(rest, sort_keys=True, default=str), []).append(name)
    twins = [names for names in same.values() if len(names) > 1]
    logging.warning("the sweep's flag(s) %s replace the value every entry sets for %s%s",
                    ", ".join(a for a in passthrough if flag_field(a)[0] in shadowed),
                    ", ".join(shadowed),
                    f": runs {'; '.join(', '.join(t) for t in twins)} become the same run"
                    if twins else "")
  return shadowed, twins


def warn_twins(configs: dict[str, dict], shadowed_twins: Sequence[Sequence[str]] = ()
               ) -> list[list[str]]:
  """Warns of runs whose configs (check_values', as each binary gets it) are equal: the same
  run twice (a seeds list with a seed repeated, an entry pasted twice). Twins that
  warn_shadowed already named (the sweep's own flag made them equal) are not named again.
  Returns the groups."""
  same: dict[str, list[str]] = {}
  for name, config in configs.items():
    same.setdefault(json.dumps(wd.as_json(config), sort_keys=True, default=str),
                    []).append(name)
  named = {tuple(t) for t in shadowed_twins}
  twins = [names for names in same.values() if len(names) > 1 and tuple(names) not in named]
  if twins:
    logging.warning("runs %s have the same config: each group runs one thing several times",
                    "; ".join(", ".join(t) for t in twins))
  return twins


def run_row(name: str, overrides: dict, passthrough: Sequence[str],
            config: Optional[dict] = None, also: Sequence[str] = ()) -> dict:
  """A summary row's start: the run's name and the values its command sets, the sweep's own
  --config.* flags included and winning over the entry's, as on the command line (the row
  showed an entry's minibatch_size 5 for a run the sweep's flag gave 8, and never the sweep's
  flags); a flag's value as the run's `config` (check_values') holds it, typed, else its
  text. `also`: fields an earlier start's flags set (sweep.json's "flags"), with the value the
  run's `config` has now: the runs of different starts then compare, and differ where they
  were made differently."""
  row = {"run": name, **{k: v for k, v in overrides.items() if k != "name"}}
  for arg in passthrough:
    key, value = flag_field(arg)
    try:
      row[key] = wd.as_json(_field(config, key)) if config is not None else value
    except (KeyError, AttributeError, TypeError, ValueError):
      row[key] = value
  for key in also:
    if key not in row and config is not None:
      try:
        row[key] = wd.as_json(_field(config, key))
      except (KeyError, AttributeError, TypeError, ValueError):
        pass
  return row


def run_name(index: int, overrides: dict) -> str:
  name = overrides.get("name")
  return str(name) if name not in (None, "") else f"run{index:03d}"


def flatten_scalars(obj: dict, prefix: str = "") -> dict:
  """Nested dicts flattened with '/'; lists and other containers skipped."""
  out = {}
  for k, v in obj.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten_scalars(v, key + "/"))
    elif isinstance(v, (bool, int, float, str)) or v is None:
      out[key] = v
  return out


def read_run_result(run_dir: str) -> Optional[dict]:
  path = os.path.join(run_dir, "result.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  rows = wd.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  return rows[-1] if rows else None


def failure_line(run_dir: str) -> Optional[str]:
  """The error line a failed run ended on (the binaries' one-line `...Error: message`, or a
  flag error), from the end of its log.txt: the summary says why, not only "failed (exit 1)"
  (e.g. a re-run with another value that the checkpoints refuse). None when there is none.
  Only the last start's lines count (log.txt keeps every start, each after a `=== ` header
  line): a start killed without a word (out of memory, SIGKILL) showed an earlier start's
  error."""
  try:
    with open(os.path.join(run_dir, "log.txt"), errors="replace") as f:
      tail = f.read()[-20000:].splitlines()
  except OSError:
    return None
  starts = [i for i, line in enumerate(tail) if line.startswith("=== ")]
  for line in reversed(tail[starts[-1] + 1:] if starts else tail):
    m = re.search(r"(?:\] |^)(\w*(?:Error|Exception)\b.*|FATAL Flags parsing error: .*)$", line)
    if m:
      return m.group(1)[:4000]  # whole in summary.json; summary.md shortens it
  return None


MD_CELL_CHARS = 300  # a longer text (a simulator's error) is shortened in summary.md only


def _fmt_cell(v: Any) -> str:
  if isinstance(v, float):
    # 4 significant digits; from 1e4 on the whole number (a tokens/s column read 7863, then
    # 1.217e+04)
    return f"{v:.0f}" if 1e4 <= abs(v) < 1e15 else f"{v:.4g}"
  text = "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")
  return text if len(text) <= MD_CELL_CHARS else text[:MD_CELL_CHARS] + " ... (summary.json)"


def _md_table(rows: list[dict]) -> list[str]:
  columns = _columns(rows)
  return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
          ["| " + " | ".join(_fmt_cell(row.get(c)) for c in columns) + " |" for row in rows])


ALWAYS_SHOWN = ("run", "status")


def _md_table_varying(rows: list[dict]) -> list[str]:
  """_md_table of the columns that differ between the rows, then one line of those every row
  has with the same value (a plan search's ~70 setting/ and hardware/ columns put its results
  past 4,000 characters of header). One row: the whole table."""
  if len(rows) < 2:
    return _md_table(rows)
  first = rows[0]
  same = [k for k in first if k not in ALWAYS_SHOWN and all(
      k in r and _fmt_cell(r[k]) == _fmt_cell(first[k]) for r in rows)]
  table = _md_table([{k: v for k, v in r.items() if k not in same} for r in rows])
  if not same:
    return table
  return table + ["", "The same in every run: " + ", ".join(
      f"{k} = {_fmt_cell(first[k])}" for k in same) + "."]


def sweep_status(rows: list[dict], names: Sequence[str]) -> str:
  """One line on where the sweep stands: how many of its runs (`names`, the whole sweep's)
  have a row, by how they ended, the failed ones and those with no row yet by name, and the
  rows' wall_s summed. A sweep of 16 runs stopped after 11 showed a table of 11 rows and no
  word of the 5 missing, nor of its total time."""
  have = {str(r.get("run")) for r in rows}
  ends: dict[str, int] = {}
  for r in rows:
    word = str(r.get("status", "")).split(" ")[0] or "?"
    ends[word] = ends.get(word, 0) + 1
  ended = ", ".join(f"{n} {w}" for w, n in ends.items())
  parts = [f"{len(have & set(names))} of {len(names)} runs have a row ({ended})"
           if rows else f"0 of {len(names)} runs have a row"]

  def named(label: str, found: list[str]) -> None:
    if found:
      shown = ", ".join(found[:8]) + (f", ... ({len(found)})" if len(found) > 8 else "")
      parts.append(f"{label}: {shown}")
  named("failed", [str(r["run"]) for r in rows
                   if str(r.get("status", "")).startswith("failed")])
  named("not run yet", [n for n in names if n not in have])
  walls = [float(r["wall_s"]) for r in rows if isinstance(r.get("wall_s"), (int, float))]
  if walls:
    parts.append(f"wall time {metrics.duration(sum(walls), short=True)} (the rows' wall_s summed)")
  return "; ".join(parts) + "."


# The columns of summary.md's table for a sweep of a binary, after the run's name, the fields
# its command set and its status: what a person compares first. The other results are in
# summary.json and summary.csv, named below the table (a sweep of train_ppo showed ~38 columns,
# 24 of them final/*). A binary not named here: every column.
HEADLINE_COLUMNS = {
    "train_ppo": ("iterations", "reward_last_10pct", "reward_gain", "final/reward/mean",
                  "final/kl/ref_mean", "final/response_length/mean", "median_tokens_per_s",
                  "median_step_s", "wall_s", "error"),
}


def _columns(rows: Sequence[dict]) -> list[str]:
  """Every key of `rows`, in the order of their first appearance, but a key a row has before
  keys of the columns already goes in before them: a field only some entries set sits among
  the run's fields, not past the results (when the first row lacked it, it followed wall_s)."""
  columns: list[str] = []
  for row in rows:
    keys = list(row)
    for i, k in enumerate(keys):
      if k not in columns:
        after = next((columns.index(n) for n in keys[i + 1:] if n in columns), len(columns))
        columns.insert(after, k)
  return columns


def main_columns(rows: Sequence[dict], override_keys: Sequence[str],
                 headline: Optional[Sequence[str]]) -> list[str]:
  """summary.md's table's columns: with `headline` (HEADLINE_COLUMNS'), the run, its
  overridden fields (`override_keys`), its status and the headline columns the rows have, in
  that order; without, every column of the rows."""
  present = _columns(rows)
  if headline is None:
    return present
  wanted = ["run", *override_keys, "status", *headline]
  return [k for k in dict.fromkeys(wanted) if k in present]


def write_csv(path: str, rows: Sequence[dict]) -> None:
  """`rows` as a CSV file with a column per key (_columns' order; an empty cell for a row
  without it): the whole summary, for a spreadsheet or pandas."""
  buf = io.StringIO()
  writer = csv.writer(buf, lineterminator="\n")
  columns = _columns(rows)
  writer.writerow(columns)
  for row in rows:
    writer.writerow(["" if row.get(c) is None else row[c] for c in columns])
  wd.atomic_write_text(path, buf.getvalue())


def _rest_line(rest: Sequence[str], label: str) -> list[str]:
  """The line below a table that names the columns it leaves out (`label`: which they are and
  where they are)."""
  if not rest:
    return []
  return ["", f"{label} ({len(rest)}): " + ", ".join(rest) + "."]


def write_summary(workdir: str, rows: list[dict], override_keys: Sequence[str] = (),
                  names: Optional[Sequence[str]] = None,
                  headline: Optional[Sequence[str]] = None) -> None:
  """summary.json and summary.csv (every column), and summary.md: a row per run; with `names`
  (the sweep's runs, in order) summary.md opens with sweep_status' line. With `headline` (the
  binary's HEADLINE_COLUMNS) summary.md's table has main_columns' columns and a line naming
  the others (in summary.json and summary.csv). When the sweep's overridden fields
  (`override_keys`) include a seed field and two or more finished runs differ only in seeds,
  also summary_seeds.json (runner.across_seeds: a row per group, each result column's mean and
  standard deviation over its seeds) and the same as a second table of summary.md, "mean ±
  std" per cell (with `headline`, of its columns alone; the others named below it): a
  difference between settings reads against the seeds' own spread."""
  wd.write_json(os.path.join(workdir, "summary.json"), rows)
  write_csv(os.path.join(workdir, "summary.csv"), rows)
  shown = main_columns(rows, override_keys, headline)
  rest = [k for k in _columns(rows) if k not in shown]
  lines = ([sweep_status(rows, names), ""] if names is not None else []) + _md_table_varying(
      [{k: r[k] for k in shown if k in r} for r in rows]) + _rest_line(
          rest, "Further columns, in summary.json and summary.csv")
  seeds_path = os.path.join(workdir, "summary_seeds.json")
  groups = across_seeds(rows, override_keys)
  if groups:
    wd.write_json(seeds_path, groups)
    results = [k[:-len("/mean")] for k in _columns(groups) if k.endswith("/mean")]
    shown_results = results if headline is None else [c for c in headline if c in results]
    table = []
    for g in groups:
      cells = {k: v for k, v in g.items() if not k.endswith(("/mean", "/std"))}
      for col in shown_results:
        if col + "/mean" in g:
          cells[col] = f"{_fmt_cell(g[col + '/mean'])} ± {_fmt_cell(g[col + '/std'])}"
      table.append(cells)
    lines += ["", "Across seeds (runs that differ only in their seed fields; mean ± sample "
              "standard deviation of each result that varies; summary_seeds.json):", ""]
    lines += _md_table(table) + _rest_line(
        [c for c in results if c not in shown_results],
        "Further results, as COLUMN/mean and COLUMN/std in summary_seeds.json")
  elif os.path.exists(seeds_path):  # an earlier sweep's, no longer true of these rows
    os.remove(seeds_path)
  wd.atomic_write_text(os.path.join(workdir, "summary.md"), "\n".join(lines) + "\n")


CURVE_METRICS = ("reward/mean", "kl/ref_mean", "response_length/mean")


def curve_lines(workdir: str, override_keys: Sequence[str] = ()
                ) -> tuple[dict[str, list[tuple]], int]:
  """What curves.png draws: ({metric of CURVE_METRICS: [(label, steps, mean, low, high)]},
  the moving mean's width). A line per run of the summary (in its order) whose directory has a
  metrics.jsonl (train_ppo's), as a trailing moving mean over a twentieth of the longest run.
  Runs that differ only in seeds (runner.seed_groups of `override_keys`) are one line, where
  their first run stood: their mean at the iterations all of them logged, low and high the
  lowest and highest of them (a single run: all three its own)."""
  try:
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      summary_rows = [r for r in json.load(f) if isinstance(r, dict) and "run" in r]
  except (OSError, ValueError, TypeError):
    return {}, 1
  names = [str(r["run"]) for r in summary_rows]
  runs = {n: wd.read_jsonl(os.path.join(workdir, n, "metrics.jsonl")) for n in names}
  runs = {n: rows for n, rows in runs.items() if rows}
  if not runs:
    return {}, 1
  group_of = {}
  groups = seed_groups(summary_rows, override_keys)
  differ = [k for k in dict.fromkeys(k for values, _ in groups for k in values)
            if len({json.dumps(values.get(k), default=str) for values, _ in groups}) > 1]
  for values, members in groups:  # labelled by the fields that tell the groups apart
    members = [str(m["run"]) for m in members if str(m["run"]) in runs]
    if len(members) < 2:  # one run with metrics: its own line
      continue
    label = (", ".join(f"{k}={values.get(k)}" for k in differ) or
             ("+".join(members) if len(members) <= 3 else f"{members[0]}+{len(members) - 1}"))
    for name in members:
      group_of[name] = (f"{label} ({len(members)} seeds)", tuple(members))
  # A run whose last start did not finish is drawn as far as it got, marked (its metrics may
  # be an earlier start's)
  status = {str(r["run"]): str(r.get("status", "")) for r in summary_rows}
  single = lambda n: (n if status.get(n, "ok").startswith("ok") else
                      f"{n} ({status[n].split(' (')[0]})", (n,))
  lines = list(dict.fromkeys(group_of.get(n) or single(n) for n in runs))
  import numpy as np  # pylint: disable=import-outside-toplevel
  width = max(1, max(len(rows) for rows in runs.values()) // 20)
  out: dict[str, list[tuple]] = {}
  for metric in CURVE_METRICS:
    for label, members in lines:
      per_run = [{row["step"]: row[metric] for row in runs[n]
                  if isinstance(row.get(metric), (int, float)) and "step" in row}
                 for n in members]
      steps = sorted(set.intersection(*(set(p) for p in per_run)))
      if steps:
        curves = np.array([smooth([p[t] for t in steps], width) for p in per_run])
        out.setdefault(metric, []).append((label, steps, curves.mean(axis=0),
                                           curves.min(axis=0), curves.max(axis=0)))
  return out, width


def plot_curves(workdir: str, override_keys: Sequence[str] = ()) -> Optional[str]:
  """WORKDIR/curves.png: curve_lines' lines, a panel per metric, a band where a line is the
  mean of several seeds: the comparison a summary of final values cannot show. None (nothing
  written) when no run has such metrics."""
  lines, width = curve_lines(workdir, override_keys)
  path = os.path.join(workdir, "curves.png")
  if not lines:
    if os.path.exists(path):  # an earlier start's, no longer true of these rows
      os.remove(path)
    return None
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig = curves_figure(lines, width)
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
  plt.close(fig)
  wd.atomic_write_bytes(path, buf.getvalue())
  return path


LEGEND_INSIDE = 4  # more lines than this: the legend goes below the panels


def curves_figure(lines: dict[str, list[tuple]], width: int):
  """curve_lines' lines as a matplotlib figure, a panel per metric. Each label keeps one color
  and dash in every panel: the 10 colors of matplotlib's cycle, then again dashed, dotted,
  dash-dotted (a sweep of 16 settings drew its 11th-16th lines in the 1st-6th's colors, and a
  run missing from one panel shifted the colors of the others there)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  labels = list(dict.fromkeys(label for ls in lines.values() for label, *_ in ls))
  dashes = ("-", "--", ":", "-.")
  style = {label: (f"C{k % 10}", dashes[(k // 10) % len(dashes)])
           for k, label in enumerate(labels)}
  fig, axes = plt.subplots(1, len(lines), figsize=(5.5 * len(lines), 4.2), squeeze=False)
  for ax, (metric, metric_lines) in zip(axes[0], lines.items()):
    for label, steps, mean, low, high in metric_lines:
      banded = bool((low != high).any())
      color, dash = style[label]
      # A run with one logged iteration (one that failed early) is a point: drawn as a line
      # it was invisible, though the legend named it.
      ax.plot(steps, mean, color=color, linestyle=dash, marker="o" if len(steps) == 1 else None,
              label=label + (", band: min-max" if banded else ""))
      if banded and len(steps) == 1:  # (a band at one iteration has no width)
        ax.errorbar(steps, mean, yerr=[mean - low, high - mean], fmt="none", color=color,
                    capsize=4)
      elif banded:
        ax.fill_between(steps, low, high, alpha=0.2, color=color, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    every = {t for _, steps, *_ in metric_lines for t in steps}
    if len(every) == 1:  # runs of one iteration: ticks 0.945 ... 1.050 around it, else
      ax.set_xlim(min(every) - 1, min(every) + 1)
    ax.set_title(metric)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"moving mean of {width}" if width > 1 else metric)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  if len(labels) <= LEGEND_INSIDE:
    axes[0][0].legend(fontsize=8)
  else:  # one legend of every label, below the panels, not over the first one's curves
    handles = {}
    for ax in axes[0]:
      for line in ax.get_lines():
        handles.setdefault(line.get_label().split(", band: ")[0], line)
    fig.legend([handles[label] for label in labels if label in handles],
               [handles[label].get_label() for label in labels if label in handles],
               loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
               ncol=min(len(lines), 3), frameon=False)
  return fig


STOPPED = 75  # a run stopped by a signal after saving (train_ppo's EXIT_STOPPED_BY_SIGNAL)


class _Signals:
  """SIGTERM to the sweep (a scheduler's stop, a `kill`), or SIGHUP (a dropped ssh session;
  unless ignored, as under nohup): passed on to the run in progress (a run that got it already
  ignores the second: train_ppo saves once and exits 75), and no further run starts. Without
  it the sweep died at once with no summary, its run went on alone, and SIGTERM to the sweep's
  process alone left the run holding its workdir."""

  def __init__(self):
    self.proc = None
    self.signum = 0
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      hup = signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN
      for sig in (signal.SIGTERM,) + ((signal.SIGHUP,) if hup else ()):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)

  def started(self, proc) -> None:
    self.proc = proc
    if self.signum:  # it came between the last check and the start (the inputs' hashing)
      proc.send_signal(self.signum)

  def _handle(self, signum, frame):
    self.signum = signum
    logging.warning("signal %d: passing it to the run in progress; no further run starts", signum)
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signum)


def run_sweep(config: str, binary: str, workdir: str, passthrough: Sequence[str],
              dry_run: bool = False, only: Optional[Sequence[str]] = None,
              rerun: bool = False, lock_wait_s: float = 0.0) -> tuple[list[dict], bool]:
  """(one row per run that ran or was kept, whether every run ran; see the module docstring).
  It ends early, after writing the summary, when a run stops with exit 75 (stopped by a
  signal; re-running resumes it) or the sweep gets SIGTERM. `only`: the run names to run (all:
  None); `rerun`: run a one-shot binary's finished runs again; `lock_wait_s`: how long to wait
  for the workdir's lock held by a sweep on another host (workdir.WorkdirLock; a signal during
  that wait raises workdir.LockWaitStopped, nothing written)."""
  with _Signals() as signals:
    return _run_sweep(config, binary, workdir, passthrough, dry_run, signals, only, rerun,
                      lock_wait_s)


INPUTS_FILE = "sweep_inputs.json"  # in a run's directory: the input files it ran with


def input_files(config: Any) -> dict[str, str]:
  """{path: sha256 of its bytes} of every file the run's config names by path (a text value
  naming a file, FILE[:variant] included; relative ones from the repository root, where the
  runs start): a plan search's train_config, a hardware JSON, a calibration, a prompts file.
  Directories (checkpoints) are not read."""
  found: dict[str, str] = {}

  def visit(v: Any) -> None:
    if isinstance(v, dict):
      for x in v.values():
        visit(x)
    elif isinstance(v, (list, tuple)):
      for x in v:
        visit(x)
    elif isinstance(v, str) and v and len(v) < 4096 and "\n" not in v:
      for candidate in dict.fromkeys((v, config_files.split_config_path(v)[0])):
        full = os.path.join(REPO_ROOT, candidate)  # (an absolute candidate stays itself)
        if os.path.isfile(full):
          with open(full, "rb") as f:
            found[candidate] = hashlib.file_digest(f, "sha256").hexdigest()
          break
  visit(wd.as_json(config))
  return found


def kept_row(run_dir: str, binary: str, earlier: Optional[dict], config: Optional[dict],
             row: dict, code: tuple[Optional[str], Optional[str]]) -> Optional[dict]:
  """`row` (the run's start, run_row's) completed from run_dir/result.json when a one-shot
  binary's run (not train_ppo's: it resumes from its checkpoints) finished there with this
  config from this code: `earlier` (its summary row) ok, the result written by `binary` at
  the checkout's commit and uncommitted changes (provenance's git_commit, git_changes: another
  commit or an edit may change what it computes; `code`: runner.code_state() of this
  checkout), run_dir/config.json equal to `config` (the
  run's config as check_values resolved it), and the files the config names by path as they
  were (input_files, recorded in run_dir/sweep_inputs.json when the run finished: an edited
  train_config kept the plans of the model before the edit). None when any of that does not
  hold: the run runs. (Directories a config names, and the host, are not compared.)"""
  if (binary == "train_ppo" or not earlier or config is None or
      not str(earlier.get("status", "")).startswith("ok") or
      wd.workdir_writer(run_dir) != binary):
    return None
  commit, changes = code
  try:
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
      written = json.load(f)
    result = read_run_result(run_dir)
  except (OSError, ValueError):
    return None
  made = (result or {}).get("provenance") or {}
  if (written != wd.as_json(config) or not commit or made.get("git_commit") != commit or
      made.get("git_changes") != changes):
    return None
  try:
    with open(os.path.join(run_dir, INPUTS_FILE), encoding="utf-8") as f:
      recorded = json.load(f)
  except (OSError, ValueError):
    recorded = {}
  now = input_files(config)
  if recorded != now:
    changed = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
    logging.info("%s: %s changed since it finished: running it again", run_dir,
                 ", ".join(changed))
    return None
  # Its finding (VERDICT_EXITS' word, as the earlier row says it) stays in the status.
  verdict = next((v for v in VERDICT_EXITS.values()
                  if str(earlier.get("status", "")).startswith(f"ok ({v}")), "")
  return _ended(dict(row), 0, run_dir, float(earlier.get("wall_s") or 0.0), 0,
                kept=True, verdict=verdict)


def select(sweep: list[dict], only: Optional[Sequence[str]]) -> list[tuple[int, str, dict]]:
  """(index in the sweep, run name, entry) of the entries whose run names are in `only` (all
  of them for None), in the sweep's order: names and indices are the whole sweep's, so a
  subset's runs keep their directories. A ValueError naming any name the sweep does not have."""
  runs = [(i, run_name(i, e), e) for i, e in enumerate(sweep)]
  if only is not None and not [n for n in only if n]:  # --only= (an unset shell variable)
    raise ValueError(f"--only={','.join(only)}: no run named; expected run names (e.g. "
                     f"--only={runs[0][1]}), or leave --only out to run them all")
  if not only:
    return runs
  names = [name for _, name, _ in runs]
  missing = [n for n in only if n not in names]
  if missing:
    raise ValueError(f"--only={','.join(only)}: no run named {missing} in this sweep; its runs "
                     f"are {names}")
  return [r for r in runs if r[1] in only]


SWEEP_FILE = "sweep.json"  # which sweep a workdir holds: sweep_identity's
# What the sweep writes in its workdir beside the runs' directories (a run may not be named so).
SWEEP_OUTPUTS = ("summary.md", "summary.json", "summary.csv", "summary_seeds.json",
                 "curves.png", SWEEP_FILE)


def sweep_identity(config: str, binary: str) -> dict:
  """{"config": FILE[:variant] (FILE relative to the repository when in it), "binary"}."""
  path, variant = config_files.split_config_path(config)
  # Links resolved: a file reached through a symbolic link (a home directory that is one) was
  # another sweep than the same file named by its real path.
  full = os.path.realpath(path if os.path.isfile(path) else os.path.join(REPO_ROOT, path))
  rel = os.path.relpath(full, os.path.realpath(REPO_ROOT))
  shown = full if rel.startswith("..") else rel
  return {"config": shown + (f":{variant}" if variant is not None else ""), "binary": binary}


def earlier_flags(workdir: str) -> list[str]:
  """The fields the --config flags of the sweep's earlier starts in `workdir` set (sweep.json's
  "flags"; none before it recorded them)."""
  try:
    with open(os.path.join(workdir, SWEEP_FILE), encoding="utf-8") as f:
      found = json.load(f).get("flags")
  except (OSError, ValueError, AttributeError):
    return []
  return [k for k in found if isinstance(k, str)] if isinstance(found, list) else []


def refuse_another_sweep(workdir: str, identity: dict, default: Optional[str] = None) -> None:
  """ForeignWorkdirError when workdir/sweep.json names another sweep (config file, variant or
  binary): a second sweep there replaced the first one's summary without a word and left its
  curves.png beside the new rows. (A sweep written before sweep.json existed is not known.)
  `default`: the variant get_config() takes when none is named (FILE.py and FILE.py:DEFAULT
  are one sweep)."""
  try:
    with open(os.path.join(workdir, SWEEP_FILE), encoding="utf-8") as f:
      earlier = json.load(f)
  except (OSError, ValueError):
    return

  def named(ident: dict) -> dict:  # the variant filled in
    path, variant = config_files.split_config_path(str(ident.get("config")))
    return {"config": (path, default if variant is None else variant),
            "binary": ident.get("binary")}
  if isinstance(earlier, dict) and named(earlier) != named(identity):
    raise wd.ForeignWorkdirError(
        f"--workdir={workdir!r} holds a sweep of experiments.{earlier.get('binary')} over "
        f"{earlier.get('config')} ({SWEEP_FILE}); this one runs experiments.{identity['binary']}"
        f" over {identity['config']}: give it a directory of its own (the runs' folders and "
        "the summary would mix)")


def _run_sweep(config: str, binary: str, workdir: str, passthrough: Sequence[str],
               dry_run: bool, signals: _Signals, only: Optional[Sequence[str]] = None,
               rerun: bool = False, lock_wait_s: float = 0.0) -> tuple[list[dict], bool]:
  module, variant = config_files.load_module(config)  # executed once: entries and field check
  sweep = _sweep_of(module, variant, config)
  names = [name for _, name, _ in select(sweep, None)]
  runs = select(sweep, only)
  # The fields this start's --config flags set and those earlier starts' set (sweep.json): a
  # run of an earlier start made with --config.workers=1 and one of this start without it were
  # grouped and averaged as seeds of one setting, without a word.
  flags_now = [flag_field(arg)[0] for arg in passthrough]
  flagged = list(dict.fromkeys(flags_now + earlier_flags(workdir)))
  # the fields the runs' commands set (a seed among them groups runs in the summary)
  override_keys = list(dict.fromkeys(
      [k for entry in sweep for k in entry if k != "name"] + flagged))

  # This start's rows and, for the runs it has not run (--only; or not reached yet, or not at
  # all when stopped early), their rows of the earlier summary: a sweep stopped after its first
  # run dropped the rows of runs that had finished before, and the next start ran those again
  # (kept_row keeps a run only with its earlier row).
  warned: set = set()

  def summary(rows_: list[dict]) -> str:  # sweep_status' line, for the console
    merged = merge_rows(workdir, rows_, names)
    warned.update(warn_mixed_flags(merged, flagged, warned))
    write_summary(workdir, merged, override_keys, names, HEADLINE_COLUMNS.get(binary))
    return sweep_status(merged, names)

  if not os.path.isfile(os.path.join(REPO_ROOT, "experiments", f"{binary}.py")):
    binaries = sorted(f[:-3] for f in os.listdir(os.path.join(REPO_ROOT, "experiments"))
                      if f.endswith(".py") and not f.startswith("_"))
    close = difflib.get_close_matches(binary, binaries, n=1)
    raise ValueError(f"--binary={binary!r}: no experiments/{binary}.py" +
                     (f"; did you mean {close[0]!r}?" if close else
                      f"; experiments/ has {binaries}"))
  configs = check_overrides(module, variant, config, runs, passthrough)
  warn_twins(configs, warn_shadowed(runs, passthrough)[1])
  if binary == "train_ppo":
    here, run_root = os.getcwd(), os.path.abspath(workdir)
    # Where the runs start: both read a relative plan.file from there (the checkpoints'
    # config too: from the caller's directory it failed to rebuild, and the run was let through).
    os.chdir(REPO_ROOT)
    try:
      cfgs = check_train_configs(runs, configs, passthrough)
      changed = refuse_changed_trajectories(run_root, runs, cfgs)
    finally:
      os.chdir(here)
  else:
    changed = {}
  # A training run's or a one-shot binary's workdir: the summary and run folders went in
  # beside its outputs.
  wd.refuse_foreign_result(workdir, "sweep")
  if "checkpoints" not in names and os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise wd.ForeignWorkdirError(f"--workdir={workdir!r} holds a training run (checkpoints); "
                                 "give experiments.sweep a directory of its own")
  identity = sweep_identity(config, binary)
  refuse_another_sweep(workdir, identity, config_files.default_variant(module))
  lock = None
  if not dry_run:
    os.makedirs(workdir, exist_ok=True)
    # One sweep per workdir: two at once each found the other's run holding its directory,
    # called it failed (exit 1) and wrote a summary of runs "failed" that the other finished.
    # A SIGTERM while it waits ends the wait (exit 75 in main; _Signals only records it).
    lock = wd.WorkdirLock(workdir, wait_s=lock_wait_s, wait_field="--lock_wait_s",
                          stop=lambda: bool(signals.signum))
    wd.write_json(os.path.join(workdir, SWEEP_FILE), {**identity, "flags": sorted(flagged)})
  also = [k for k in flagged if k not in flags_now]
  try:
    return _run_locked(binary, config, workdir, passthrough, dry_run, signals, runs, summary,
                       override_keys, configs, rerun, also, changed)
  finally:
    if lock is not None:
      lock.release()


def _run_locked(binary: str, config: str, workdir: str, passthrough: Sequence[str],
                dry_run: bool, signals: _Signals, runs: list[tuple[int, str, dict]],
                summary, override_keys: Sequence[str] = (), configs: Optional[dict] = None,
                rerun: bool = False, also: Sequence[str] = (),
                changed: Optional[dict] = None) -> tuple[list[dict], bool]:
  """_run_sweep's runs, under the sweep's workdir lock. `configs`: {run name: its config}
  (check_values'); `rerun`: run those that finished earlier too (else kept_row keeps them);
  `also`: fields only earlier starts' flags set (run_row); `changed`: {run name: the fields
  its checkpoint.resume_changes lets change} (refuse_changed_trajectories')."""
  rows = []
  env = repo_env()
  earlier = {r["run"]: r for r in merge_rows(workdir, [], [name for _, name, _ in runs])}
  code = code_state() if earlier and not rerun else (None, None)  # read once, for kept_row
  try:
    for i, (_, name, overrides) in enumerate(runs):
      run_dir = os.path.join(workdir, name)
      cmd = build_command(binary, config, run_dir, overrides, passthrough)
      # A command to paste (cmd[0] is this interpreter's full path).
      logging.info("[%d/%d] %s: %s", i + 1, len(runs), name, shlex.join(["python", *cmd[1:]]))
      row = run_row(name, overrides, passthrough, (configs or {}).get(name), also)
      if dry_run:  # nothing runs, nothing is written (an earlier sweep's summary stays)
        rows.append(row)
        continue
      if signals.signum:
        break
      kept = None if rerun else kept_row(run_dir, binary, earlier.get(name),
                                         (configs or {}).get(name), row, code)
      if kept is not None:
        rows.append(kept)
        logging.info("[%d/%d] %s: finished earlier with this config at this commit; kept "
                     "(--rerun runs it again)", i + 1, len(runs), name)
        continue
      # What a one-shot run reads, as it starts (kept_row compares it at the next start).
      inputs = (input_files(configs[name]) if binary != "train_ppo" and configs and
                name in configs else None)
      # A training run resumes from its checkpoints: its wall_s is the sum over its starts (a
      # run stopped after 24 s and resumed showed only the 2 s of the start that found it done).
      # One without a saved checkpoint starts over (its outputs moved to previous/): its
      # earlier start's time is not this run's.
      before = earlier.get(name) or {}
      newest = _newest_checkpoint(run_dir) if binary == "train_ppo" else None
      resumes = newest is not None
      earlier_s = float(before.get("wall_s") or 0.0) if resumes else 0.0
      if signals.signum:  # (one during kept_row's or input_files' reads: start nothing)
        break
      start = time.time()
      try:
        # Its lines say which run of the sweep said them ([3/16 e2] ...), as the sweep's own do:
        # interleaved in a log (runs of two sweeps, a grep's output), a bare name did not say
        # how far the sweep was.
        rc = run_streamed(cmd, run_dir, name, env, started=signals.started,
                          prefix=f"{i + 1}/{len(runs)} {name}")
      except RunInterrupted as e:  # Ctrl-C: the run got it too, and has ended since
        rows.append(_ended(row, e.returncode, run_dir, earlier_s + time.time() - start,
                           signals.signum, interrupted=True))
        recorded = recorded_wall_s(run_dir) if binary == "train_ppo" else None
        if recorded is not None:
          row["wall_s"] = recorded
        raise  # (the summary: below)
      this_start = time.time() - start
      rows.append(_ended(row, rc, run_dir, earlier_s + this_start, signals.signum,
                         verdict=VERDICT_EXITS.get((binary, rc), "")))
      row = rows[-1] = _settled_row(row, binary, run_dir, before, newest, earlier_s,
                                    (changed or {}).get(name))
      if row["status"].startswith("ok") and inputs is not None:  # for kept_row
        wd.write_json(os.path.join(run_dir, INPUTS_FILE), inputs)
      summary(rows)  # partial summaries survive an interrupted sweep
      # In minutes and hours past a minute: a run of hours read "ok in 14523.7s".
      logging.info("[%d/%d] %s: %s in %s%s", i + 1, len(runs), name, row["status"],
                   metrics.duration(this_start, short=True),
                   f" (wall_s {metrics.duration(row['wall_s'], short=True)} over its starts)"
                   if resumes else "")
      if rc == STOPPED or signals.signum:  # the job is being stopped: start nothing more
        break
  except KeyboardInterrupt:  # Ctrl-C (RunInterrupted: during a run, which has ended since)
    # The summary, and the line on where the sweep stands that its end logs: a sweep stopped
    # by Ctrl-C (exit 130) ended on main's note alone, with no word of what it had done.
    if not dry_run:
      logging.warning("sweep: %s", summary(rows))
    raise
  if not dry_run:
    _log_sweep_end(workdir, rows, summary, override_keys)
  complete = not signals.signum and len(rows) == len(runs) and not any(
      r.get("status", "").startswith("stopped") for r in rows)
  return rows, complete


def _settled_row(row: dict, binary: str, run_dir: str, before: dict, newest: Optional[int],
                 earlier_s: float, changed_fields) -> dict:
  """The row of a run that has just ended (`row`, _ended's) as the summary keeps it: its wall_s
  summed over the starts that trained, and what a start that trained nothing left of the run's
  earlier figures (`before`: its earlier row; `newest`: its newest checkpoint then, None
  without one)."""
  resumes = newest is not None
  recorded = recorded_wall_s(run_dir) if binary == "train_ppo" else None
  if recorded is not None:
    # What the run itself recorded of its starts that trained: also one the sweep never
    # timed (killed with a sweep killed by kill -9), and no start that trained nothing.
    row["wall_s"] = recorded
  elif resumes and nothing_trained(before, row):
    # A finished run re-started (the sweep run again to refresh its summary) found nothing to
    # train: its wall_s stays its training's (it grew by a start's set-up on every re-run).
    row["wall_s"] = before["wall_s"]
  elif resumes and _newest_checkpoint(run_dir) == newest:
    # A start that saved nothing (a resume refused for a changed config, a crash before
    # its first save) trained nothing the run keeps: wall_s sums the starts that trained.
    row["wall_s"] = round(earlier_s, 2)
  if (row["status"] == "ok" and changed_fields and newest is not None and
      _newest_checkpoint(run_dir) == newest):
    # A finished run started with a changed resume_changes field trains nothing: its row
    # showed the new value (actor_lr=0.01) beside figures no iteration of it made.
    row["status"] = (f"ok (finished earlier; the changed {', '.join(changed_fields)} "
                     "trained no iteration)")
  if row["status"].startswith("failed") and str(before.get("status", "")).startswith("ok"):
    row = finished_row_kept(before, row)
  return row


def _log_sweep_end(workdir: str, rows: list[dict], summary, override_keys: Sequence[str]
                   ) -> None:
  """Writes the sweep's summary and curves and logs where they are and how many runs were ok:
  the line a finished sweep ends on."""
  status = summary(rows)
  ok = sum(str(r.get("status", "")).startswith("ok") for r in rows)
  curves = plot_curves(workdir, override_keys)
  logging.info("%d of %d run(s) ok; summary: %s%s", ok, len(rows),
               os.path.join(workdir, "summary.md"), f", curves: {curves}" if curves else "")
  if isinstance(status, str):  # the whole sweep's, earlier starts' rows included
    logging.info("sweep: %s", status)


def finished_row_kept(before: dict, row: dict) -> dict:
  """The row of a run that finished earlier (`before`, the summary's) whose start now failed
  (`row`): its figures kept, the status still failed (the sweep exits 1) and saying whose the
  figures are, the new error beside them. The failed row replaced the finished one without a
  word (a sweep re-run with a changed value: every finished result gone from the summary)."""
  status = str(row["status"])
  logging.warning("%s finished earlier; this start of it failed (%s): the summary keeps the "
                  "finished run's figures, its status saying so", row.get("run"),
                  row.get("error") or status)
  return {**before, "status": status[:-1] + "; the figures are of its earlier finished start)"
          if status.endswith(")") else status, "error": row.get("error")}


def recorded_wall_s(run_dir: str) -> Optional[float]:
  """The seconds of a train_ppo run's starts that trained the iterations its result.json
  describes, summed from its `trained_by` (each start's `wall_s`, from its beginning to its last
  save: a start killed after saving keeps its time up to that save, and its iterations after it,
  trained again, count again); None where result.json or an entry's `wall_s` is missing (a run
  of code before trained_by recorded it: the sweep's own clock then, _run_locked)."""
  try:
    with open(os.path.join(run_dir, "result.json"), encoding="utf-8") as f:
      starts = json.load(f).get("trained_by")
  except (OSError, ValueError, AttributeError):
    return None
  if not isinstance(starts, list) or not starts:
    return None
  walls = [s.get("wall_s") if isinstance(s, dict) else None for s in starts]
  if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in walls):
    return None
  return round(float(sum(walls)), 2)


PAST_NUM_ITERATIONS = "ok (trained to "  # _ended's status of a run past num_iterations


def nothing_trained(before: dict, row: dict) -> bool:
  """Whether a training run's start (`row`, as _ended made it) trained no iteration beyond its
  earlier row `before` of summary.json, which had finished: both ok at the same `iterations`
  (also one _ended marks as trained past num_iterations: a re-run with fewer trains nothing)."""
  status = str(row.get("status", ""))
  return (str(before.get("status", "")).startswith("ok") and
          (status == "ok" or status.startswith(PAST_NUM_ITERATIONS))
          and before.get("wall_s") is not None and before.get("iterations") is not None
          and row.get("iterations") == before.get("iterations"))


def killed_by(rc: int) -> str:
  """What a run's exit status `rc` says when a signal ended it (-N from Python's subprocess, or
  128 + N from a shell): a run killed with kill -9 (the OOM killer's) left no line of its own
  and its row's error was empty. "" for another status."""
  n = -rc if rc < 0 else rc - 128 if 128 < rc < 128 + 65 else 0
  if not n:
    return ""
  try:
    name = signal.Signals(n).name
  except ValueError:
    name = f"signal {n}"
  return f"killed by signal {n} ({name}" + (
      "; the kernel's OOM killer sends it when memory runs out: see dmesg)" if n == 9 else ")")


# A binary's exit status that is its finding, not a failure: the run finished and wrote its
# result (plan_check's EXIT_DOES_NOT_FIT: a sweep over plans reported the plans that do not fit
# as failed runs, without their figures, and exited 1).
VERDICT_EXITS = {("plan_check", 4): "does not fit"}


def _ended(row: dict, rc: int, run_dir: str, wall_s: float, signum: int,
           interrupted: bool = False, kept: bool = False, verdict: str = "") -> dict:
  """`row` completed with how its run ended (exit status `rc`; `signum`: the signal the sweep
  passed on, 0 for none; `interrupted`: a Ctrl-C came meanwhile; `kept`: an earlier start's
  run, kept_row's; `verdict`: VERDICT_EXITS' word for `rc`, a finished run) and its result's
  scalars."""
  if verdict:
    rc = 0
  # A run that died of the signal the sweep passed on (-15, or 143 from a binary that exits
  # as SIGTERM's death) was stopped; one killed otherwise (-9: the OOM killer) failed.
  signalled = bool(signum) and rc in (-signum, 128 + signum)
  row["status"] = ("ok" if rc == 0 else "stopped (exit 75; re-run to resume)"
                   if rc == STOPPED else f"stopped (exit {rc}: signal {abs(rc) % 128})"
                   if signalled else f"interrupted (exit {rc})" if interrupted
                   else f"failed (exit {rc})")
  row["wall_s"] = round(wall_s, 2)
  if row["status"].startswith("failed"):
    row["error"] = failure_line(run_dir) or killed_by(rc)
  # A run stopped after saving (75) wrote its result.json too (train_ppo: status stopped, the
  # iterations reached, the rewards so far): its row says how far it got, where it was blank.
  result = read_run_result(run_dir) if rc in (0, STOPPED) else None
  if rc == STOPPED and result is not None and result.get("status") != "stopped":
    # Stopped in its set-up, before writing one: the result.json there is an earlier start's
    # (a finished run's "done", re-run with more iterations), not how far this one got.
    result = None
  if rc == 0 and result is None:
    row["status"] = "ok (no result.json / metrics.jsonl)"
  elif kept:
    row["status"] = f"ok ({verdict + '; ' if verdict else ''}kept: finished earlier)"
  elif verdict:
    row["status"] = f"ok ({verdict})"
  done_to, asked = (result or {}).get("iterations"), (result or {}).get("num_iterations")
  if (row["status"].startswith("ok") and isinstance(done_to, int) and isinstance(asked, int)
      and done_to > asked):  # (re-run with fewer iterations: its figures are of all done_to)
    row["status"] = (f"{PAST_NUM_ITERATIONS}{done_to} earlier, past num_iterations={asked}: "
                     "its figures are of all of them; a new --workdir runs the shorter one)")
  if result:
    # A result's own "status" (train_ppo's done / stopped) must not replace the sweep's.
    row.update({f"result/{k}" if k in row else k: v for k, v in flatten_scalars(
        {k: v for k, v in result.items() if k != "provenance"}).items()})
  return row


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Separates --config.* overrides (passed to every run) from the sweep's own flags, each
  written --config.FIELD=VALUE as the runs and the summary read it: absl's other forms, which
  a binary takes, too (`--noconfig.FIELD`, a bool's false, ended in "Unknown command line flag";
  `--config.FIELD VALUE` printed the usage and "unexpected arguments: ['VALUE']")."""
  own, passthrough = [], []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith("--noconfig.") and "=" not in arg:
      passthrough.append(f"--config.{arg[len('--noconfig.'):]}=false")
    elif arg.startswith("--config."):
      if "=" not in arg and args and not args[0].startswith("--"):
        arg = f"{arg}={args.pop(0)}"
      passthrough.append(arg)
    else:
      own.append(arg)
  return own, passthrough


_PASSTHROUGH: list[str] = []


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    rows, complete = run_sweep(_CONFIG.value, _BINARY.value, _WORKDIR.value, _PASSTHROUGH,
                               _DRY.value, _ONLY.value, _RERUN.value, _LOCK_WAIT.value)
  except wd.LockWaitStopped as e:
    logging.error("%s: nothing ran; the same command starts the sweep again", e)
    sys.exit(STOPPED)
  except KeyboardInterrupt:
    # (the line on where the sweep stands came before: _run_locked's)
    logging.error("interrupted: %s has the runs so far; to continue, run the same command "
                  "again (train_ppo runs resume from their checkpoints, and other binaries' "
                  "finished runs are kept): %s",
                  os.path.join(_WORKDIR.value, "summary.md"), command_line())
    sys.exit(130)
  failed = [r["run"] for r in rows if str(r.get("status", "ok")).startswith("failed")]
  if failed:
    logging.error("%d of %d runs failed: %s (their log.txt in %s)", len(failed), len(rows),
                  ", ".join(failed), _WORKDIR.value)
  if not complete:
    # A scheduler's requeue rule acts on 75 as on train_ppo's: the same command resumes.
    logging.error("stopped after %d run(s): the summary has them; the same command runs the "
                  "sweep again (train_ppo runs resume from their checkpoints, and finished "
                  "ones have nothing left to train; other binaries' finished runs are kept)",
                  len(rows))
    sys.exit(STOPPED)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  # (~ expanded here too: its runs' configs, which the sweep records, get the expanded path)
  _own, _PASSTHROUGH[:] = split_passthrough(home_expanded(sys.argv))
  config_files.run(main, argv=_own, traceback_in_workdir=False)
