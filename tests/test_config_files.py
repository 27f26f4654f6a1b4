"""experiments/config_files.py: config files on the command line, and the binaries' flag parser
that reports a config-file mistake on one line naming the flag (ml_collections' own errors are a
traceback ending in `AttributeError: "'clip_range'"`, or a deferred OSError); and the
experiments/runner.py pieces the binaries share (the sweep's summary merge)."""
import errno
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import ml_collections
import pytest

from configs import ppo_tiny
from experiments import config_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A binary with a config file flag, run by config_files.run; prints the parsed config, and
# raises a ValueError (a bad value its own check finds) for a negative lr.
_BINARY = textwrap.dedent("""
  from absl import flags
  from ml_collections import config_flags
  from experiments import config_files
  _CONFIG = config_flags.DEFINE_config_file("config", None, "config file")
  flags.DEFINE_string("workdir", None, "output directory")
  def main(argv):
    if _CONFIG.value.lr < 0:
      raise ValueError(f"config.lr={_CONFIG.value.lr}: expected >= 0")
    print("parsed", _CONFIG.value.model.width, _CONFIG.value.lr)
  config_files.run(main)
""")

_CONFIG_FILE = textwrap.dedent("""
  import ml_collections
  def get_config(variant="small"):
    if variant not in ("small", "big"):
      raise ValueError(f"unknown variant {variant!r}; expected 'small' or 'big'")
    c = ml_collections.ConfigDict()
    c.lr = 0.1
    c.model = ml_collections.ConfigDict(dict(width=8 if variant == "small" else 64, depth=2))
    c.extras = {"free": 1}
    return c
""")


def _run(tmp_path, *args):
  (tmp_path / "cfg.py").write_text(_CONFIG_FILE)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-c", _BINARY, *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)


def _fatal_line(proc) -> str:
  assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
  lines = [l for l in proc.stderr.splitlines() if l.startswith("FATAL Flags parsing error: ")]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  return lines[0][len("FATAL Flags parsing error: "):]


def test_a_good_command_line_parses_as_before(tmp_path):
  ok = _run(tmp_path, "--config=cfg.py:big", "--config.lr=0.5")
  assert ok.returncode == 0 and "parsed 64 0.5" in ok.stdout, ok.stderr


def test_a_section_given_whole_or_a_field_under_a_value_is_one_line(tmp_path):
  """`--config.model={'width': 4}` replaced the section: its other fields lost the file's
  values without a word (a sweep entry {"optim": {"actor_lr": ...}} trained with the default
  warm-up and critic LR). A field under a scalar ended in ml_collections' KeyError traceback."""
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config.model.width.x=1")) == (
      "--config.model.width.x: cfg.py has no field 'model.width.x': model.width is a value "
      "(8), not a section")
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config.model={'width': 4}")) == (
      "--config.model: replaces the section 'model' whole: its fields not given (depth) would "
      "lose the values cfg.py gives them; set each field instead (--config.model.width=4)")
  ok = _run(tmp_path, "--config=cfg.py", "--config.model={'width': 4, 'depth': 3}")
  assert ok.returncode == 0 and "parsed 4 0.1" in ok.stdout, ok.stderr  # every field: taken
  # A free-form dict field given other keys is a new value, taken as it is.
  ok = _run(tmp_path, "--config=cfg.py", "--config.extras={'other': 2}")
  assert ok.returncode == 0 and "parsed 8 0.1" in ok.stdout, ok.stderr


def test_an_override_without_its_config_file_says_what_is_missing(tmp_path):
  """--run_config.rollout.chunk_size without --run_config=FILE: absl said only "Unknown command
  line flag"."""
  assert _fatal_line(_run(tmp_path, "--config.lr=0.2")) == (
      "--config.lr overrides a field of --config's config file, which was not given: add "
      "--config=FILE.py")


def test_a_misspelled_field_is_named_with_the_closest_one(tmp_path):
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config.model.widht=3")) == (
      "--config.model.widht: cfg.py has no field 'model.widht'; did you mean 'model.width'?")
  # The space-separated form (absl takes --config FILE too).
  assert _fatal_line(_run(tmp_path, "--config", "cfg.py", "--config.model.widht=3")).startswith(
      "--config.model.widht: cfg.py has no field 'model.widht'")
  # No close match: the section's fields are listed. A later good override does not hide it.
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config.optim.lr=3",
                          "--config.lr=0.2")) == (
      "--config.optim.lr: cfg.py has no field 'optim'; its fields: extras, lr, model")


def test_a_config_flag_given_twice_is_named_not_an_override(tmp_path):
  """--config twice with an override was absl's "The flag 'config.lr' is defined twice", which
  blamed the override; without one the last --config wins, as absl's flags do."""
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config=cfg.py:big",
                          "--config.lr=0.5")) == (
      "--config given twice ('cfg.py' and 'cfg.py:big'); give it once (a variant follows the "
      "file after a colon: --config=FILE:VARIANT)")
  ok = _run(tmp_path, "--config=cfg.py", "--config=cfg.py:big")
  assert ok.returncode == 0 and "parsed 64 0.1" in ok.stdout, ok.stderr


def test_a_missing_config_file_is_named_at_once(tmp_path):
  # Without overrides ml_collections defers this error to the config's first use.
  for extra in ([], ["--config.lr=0.2"]):
    assert _fatal_line(_run(tmp_path, "--config=nope.py", *extra)) == (
        "--config='nope.py': no such file 'nope.py'")
  # A misspelled one is named with the closest Python file beside it.
  assert _fatal_line(_run(tmp_path, "--config=cgf.py:big")) == (
      "--config='cgf.py:big': no such file 'cgf.py'; did you mean 'cfg.py'?")
  typo = os.path.join(ROOT, "configs", "ppo_tny.py")
  with pytest.raises(ValueError, match=rf"^--run='{re.escape(typo)}': no such file .*; did you "
                                       rf"mean '{re.escape(typo[:-6])}tiny\.py'\?$"):
    config_files.load_module(typo, "--run")


def test_a_repository_path_given_outside_the_root_names_the_root(tmp_path, monkeypatch):
  # Started from another directory (the repository on PYTHONPATH), `configs/ppo_tiny.py` is not
  # found; the error says where the binaries run and the path that exists.
  monkeypatch.chdir(tmp_path)
  there = os.path.join(ROOT, "configs", "ppo_tiny.py")
  with pytest.raises(ValueError) as e:
    config_files.load_module("configs/ppo_tiny.py:fused")
  assert str(e.value) == (
      f"--config='configs/ppo_tiny.py:fused': no such file 'configs/ppo_tiny.py' in the current "
      f"directory {str(tmp_path)!r}; the binaries run from the repository root (docs/usage.md): "
      f"cd {ROOT} or pass {there!r}")
  # A file the repository lacks too keeps the plain message.
  with pytest.raises(ValueError, match=r"^--config='configs/nope\.py': no such file "
                                       r"'configs/nope\.py'$"):
    config_files.load_module("configs/nope.py")


def test_an_error_raised_in_the_config_file_is_cut_to_its_message_and_frame(tmp_path):
  assert _fatal_line(_run(tmp_path, "--config=cfg.py:huge")) == (
      "--config='cfg.py:huge': loading it raised ValueError: unknown variant 'huge'; expected "
      "'small' or 'big' (cfg.py, line 5)")


def test_a_file_the_config_file_cannot_open_is_named_at_once(tmp_path):
  # An OSError inside get_config() (a data file it reads): ml_collections keeps it for the
  # config's first use, deep in the binary, as "Configuration is not available because of an
  # earlier failure to load".
  (tmp_path / "reads.py").write_text("import ml_collections\n"
                                     "def get_config():\n"
                                     "  open('missing_prompts.txt')\n")
  for extra in ([], ["--config.lr=0.2"]):
    assert _fatal_line(_run(tmp_path, "--config=reads.py", *extra)) == (
        "--config='reads.py': loading it raised FileNotFoundError: [Errno 2] No such file or "
        "directory: 'missing_prompts.txt' (reads.py, line 3)")


def test_a_value_of_the_wrong_type_names_the_type_the_field_takes(tmp_path):
  """ml_collections said "invalid literal for int() with base 10: '1.5'" and, of a bool,
  "('Non-boolean argument to boolean flag', 'yes')": neither named what the field takes."""
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config.model.width=1.5")) == (
      "--config.model.width='1.5': expected an integer (the field is an int)")
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", "--config.lr=1e-3x")) == (
      "--config.lr='1e-3x': expected a number (the field is a float)")
  (tmp_path / "flags.py").write_text(
      "import ml_collections\n"
      "def get_config():\n"
      "  return ml_collections.ConfigDict(dict(lr=0.1, model=dict(width=8), fused=True))\n")
  assert _fatal_line(_run(tmp_path, "--config=flags.py", "--config.fused=yes")) == (
      "--config.fused='yes': expected true or false (the field is a bool; also 1/0, t/f)")
  # What the bool takes, as the message says.
  for value in ("false", "F", "0", "True", "t", "1"):
    proc = _run(tmp_path, "--config=flags.py", f"--config.fused={value}")
    assert proc.returncode == 0 and "parsed 8 0.1" in proc.stdout, (value, proc.stderr)
  # Another flags.Error is left as it was (absl's own text).
  assert config_files.wrong_type("flag --config.lr=2: value should be a tuple") is None


def test_a_bad_value_ends_in_one_line_and_keeps_its_traceback_in_a_file(tmp_path):
  proc = _run(tmp_path, "--config=cfg.py", "--config.lr=-1")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert "ValueError: config.lr=-1.0: expected >= 0" in proc.stderr.splitlines()[-2], proc.stderr
  where = proc.stderr.splitlines()[-1]
  assert where.startswith("(where it was raised: ") and "RLHFUSE_TRACEBACK=1" in where, where
  path = where[len("(where it was raised: "):].split(";")[0]
  with open(path) as f:
    text = f.read()
  assert "Traceback" in text and "in main" in text
  assert os.path.dirname(path) == tempfile.gettempdir()  # no --workdir given: the temp folder
  os.remove(path)
  (tmp_path / "out").mkdir()  # with one: beside the run's outputs (a cluster's shared disk)
  proc = _run(tmp_path, "--config=cfg.py", "--config.lr=-1", f"--workdir={tmp_path / 'out'}")
  assert os.listdir(tmp_path / "out") == ["traceback.txt"]
  assert str(tmp_path / "out" / "traceback.txt") in proc.stderr
  for value, printed in (("1", True), ("0", False), ("false", False)):  # any value printed it
    env_run = subprocess.run(
        [sys.executable, "-c", _BINARY, "--config=cfg.py", "--config.lr=-1"], cwd=tmp_path,
        env=dict(os.environ, RLHFUSE_TRACEBACK=value,
                 PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        capture_output=True, text=True, timeout=120)
    assert env_run.returncode == 1 and ("Traceback" in env_run.stderr) == printed, value


def test_a_workdir_that_is_a_file_and_a_variant_of_a_config_without_any(tmp_path):
  (tmp_path / "afile").write_text("mine")
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", f"--workdir={tmp_path / 'afile'}")) == (
      f"--workdir='{tmp_path / 'afile'}' is a file; expected a directory (new or a run's own)")
  assert (tmp_path / "afile").read_text() == "mine"
  (tmp_path / "plain.py").write_text("import ml_collections\n"
                                     "def get_config():\n  return ml_collections.ConfigDict()\n")
  assert _fatal_line(_run(tmp_path, "--config=plain.py:e3")) == (
      "--config='plain.py:e3': plain.py's get_config() takes no variant (':e3')")


def test_an_empty_workdir_is_named_at_once(tmp_path):
  """--workdir= (an unset shell variable: --workdir=$OUT) passed absl's required-flag check and
  ended deep in the binary as "FileNotFoundError: [Errno 2] No such file or directory: ''"."""
  for value in ("", " "):
    assert _fatal_line(_run(tmp_path, "--config=cfg.py", f"--workdir={value}")) == (
        f"--workdir={value!r}: expected a directory (new or a run's own)")


def test_a_workdir_that_cannot_be_written_is_named_at_once(tmp_path, monkeypatch):
  """A workdir under a file or on a read-only place is one flag line naming the path, before the
  binary runs (it was an OSError traceback from os.makedirs deep in the binary, and for a
  read-only workdir an AttributeError from the lock's __del__ after it)."""
  (tmp_path / "afile").write_text("mine")
  bad = tmp_path / "afile" / "run"
  assert _fatal_line(_run(tmp_path, "--config=cfg.py", f"--workdir={bad}")) == (
      f"--workdir='{bad}': {tmp_path / 'afile'} is a file, not a directory; expected a "
      "directory this process can create and write")
  assert (tmp_path / "afile").read_text() == "mine"
  assert config_files.unwritable(str(tmp_path / "new" / "deeper")) is None  # made on the way
  readonly = str(tmp_path)
  monkeypatch.setattr(os, "access", lambda path, mode: path != readonly)  # root ignores chmod
  assert config_files.unwritable(os.path.join(readonly, "run")) == (
      f"{readonly} is not writable (read-only filesystem or no write permission)")


_FAILING_BINARY = textwrap.dedent("""
  import sys
  from absl import flags
  from experiments import config_files
  from rlhfuse_jax import workdir as wd
  flags.DEFINE_string("workdir", None, "output directory")
  def main(argv):
    if sys.argv[-1] == "missing":
      raise FileNotFoundError("config.data.prompts_file='p.jsonl': prompts file not found")
    if sys.argv[-1] == "peer":  # process 1 of 2, told that process 0 could not lock
      import jax
      from rlhfuse_jax.parallel import distributed
      jax.process_index = lambda: 1
      distributed.main_process_verdict = lambda ok: False
      distributed.run_on_main_process(lambda: None, "workdir w could not be locked by process 0")
    if sys.argv[-1] == "debug_nans":  # jax's own, under jax_debug_nans
      raise FloatingPointError("invalid value (nan) encountered in jit(update)")
    if sys.argv[-1] == "guard":  # the NaN guard's (trainer/loop.NonFiniteError)
      class NonFiniteError(FloatingPointError):
        pass
      raise NonFiniteError("iteration 3: non-finite values: ...; lower optim.actor_lr")
    raise wd.WorkdirInUseError("workdir w is in use by another run (pid 1 on h)")
  config_files.run(main)
""")


@pytest.mark.parametrize("kind, message", [
    ("missing", "FileNotFoundError: config.data.prompts_file='p.jsonl': prompts file not found"),
    ("held", "WorkdirInUseError: workdir w is in use by another run (pid 1 on h)"),
    ("peer", "MainProcessError: workdir w could not be locked by process 0"),
    ("guard", "NonFiniteError: iteration 3: non-finite values: ...; lower optim.actor_lr"),
])
def test_a_missing_input_file_and_a_held_workdir_end_in_one_line(tmp_path, kind, message):
  """A file a field names that does not exist (the loaders raise FileNotFoundError naming the
  field) and a workdir another run holds are reported like a bad value: one line, status 1, the
  traceback in a file (they were a 30-line traceback ending in that line). So is process 0's
  refusal as the other processes of a multi-process run learn it ("peer": each printed a
  traceback ending in a RuntimeError, beside process 0's one line; a SLURM job's log had one per
  node), its traceback not in the workdir (another run's, when the lock was refused)."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  held = tmp_path / "held"
  held.mkdir()
  proc = subprocess.run([sys.executable, "-c", _FAILING_BINARY, f"--workdir={held}", kind],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.splitlines()[-2].endswith(message), proc.stderr
  assert proc.stderr.splitlines()[-1].startswith("(where it was raised: ")
  assert os.listdir(held) == (["traceback.txt"] if kind in ("missing", "guard") else []), (
      os.listdir(held))


def test_jax_debug_nans_keeps_its_traceback(tmp_path):
  """FloatingPointError was a user error for the NaN guard's sake, which turned jax's own
  (jax_debug_nans, a debugging aid whose traceback is the point: where the NaN arose) into one
  line too. Only subclasses (the guard's NonFiniteError, above) are one line now."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", _FAILING_BINARY, f"--workdir={tmp_path}",
                         "debug_nans"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr, proc.stderr
  assert proc.stderr.rstrip().endswith(
      "FloatingPointError: invalid value (nan) encountered in jit(update)"), proc.stderr


def test_missing_field():
  c = ml_collections.ConfigDict(dict(a=dict(bb=1, cc=2), d={"x": 1}, e=3))
  assert config_files.missing_field(c, "a.bb") is None
  assert config_files.missing_field(c, "d.y") == "has no field 'd.y'; its fields: x"
  assert config_files.missing_field(c, "a.b") == "has no field 'a.b'; did you mean 'a.bb'?"
  # Under a scalar (ml_collections' KeyError came in a 40-line traceback).
  assert config_files.missing_field(c, "e.x") == (
      "has no field 'e.x': e is a value (3), not a section")
  assert config_files.missing_field(c, "zzz") == "has no field 'zzz'; its fields: a, d, e"
  # A derived quantity names what sets it, not the field spelled most like it.
  ppo = ppo_tiny.get_config()
  assert config_files.missing_field(ppo, "rollout.batch_size") == (
      "has no field 'rollout.batch_size'; the rollout batch is rollout.prompts_per_iteration x "
      "rollout.samples_per_prompt samples: set those")
  for key, text in config_files.DERIVED.items():  # each names fields that exist
    assert config_files.missing_field(ppo, key) is not None
    for field in re.findall(r"\b[a-z_]+\.[a-z_]+\b", text):
      assert config_files.missing_field(ppo, field) is None, field


def test_split_and_load(tmp_path):
  (tmp_path / "a:b.py").write_text(_CONFIG_FILE)
  (tmp_path / "c.py").write_text(_CONFIG_FILE)
  assert config_files.split_config_path(str(tmp_path / "a:b.py")) == (str(tmp_path / "a:b.py"),
                                                                       None)
  assert config_files.split_config_path("c.py:big:x") == ("c.py", "big:x")
  assert config_files.get_config(str(tmp_path / "c.py") + ":big").model.width == 64
  assert config_files.get_config(str(tmp_path / "a:b.py")).model.width == 8
  with pytest.raises(ValueError, match=r"^--run='nope\.py:x': no such file 'nope\.py'$"):
    config_files.get_config("nope.py:x", "--run")
  (tmp_path / "plain.py").write_text("import ml_collections\n"
                                     "def get_config():\n  return ml_collections.ConfigDict()\n")
  with pytest.raises(ValueError, match=r"plain\.py's get_config\(\) takes no variant \(':x'\)$"):
    config_files.get_config(str(tmp_path / "plain.py") + ":x")
  assert config_files.get_config(str(tmp_path / "c.py") + ":").model.width == 8  # empty: none
  (tmp_path / "n.py").write_text("x = 1\n")
  with pytest.raises(ValueError, match=r"defines no get_config\(\)"):
    config_files.get_config(str(tmp_path / "n.py"))


def test_the_training_binary_names_a_misspelled_field():
  proc = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                         "--config=configs/ppo_tiny.py", "--config.algo.clip_range=0.3",
                         "--workdir=/nonexistent/never_made"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert _fatal_line(proc) == ("--config.algo.clip_range: configs/ppo_tiny.py has no field "
                               "'algo.clip_range'; did you mean 'algo.clip_eps'?")


def test_every_binary_with_a_config_file_flag_runs_through_config_files():
  binaries = [f for f in sorted(os.listdir(os.path.join(ROOT, "experiments")))
              if f.endswith(".py")]
  with_config = []
  for name in binaries:
    with open(os.path.join(ROOT, "experiments", name)) as f:
      source = f.read()
    if "DEFINE_config_file(" in source:
      with_config.append(name)
      assert "config_files.run(main" in source, name
      # Required: left out it was None, and schedule_cp_check / schedule_lp_check failed on it
      # in main with an AttributeError traceback.
      assert re.search(r'mark_flags_as_required\(\[[^]]*"config"|'
                       r'DEFINE_\w+\("config",[^\n]*required=True', source), name
  assert "train_ppo.py" in with_config and len(with_config) >= 10, with_config


@pytest.mark.parametrize("args, line", [
    (["experiments.train_ppo"],
     "--config and --workdir are required; e.g. python -m experiments.train_ppo "
     "--config=configs/ppo_tiny.py --workdir=/tmp/ppo_tiny"),
    (["experiments.sweep", "--config=configs/ppo_tiny.py"],
     "--binary and --workdir are required; e.g. python -m experiments.sweep "
     "--config=configs/X.py --binary=NAME --workdir=DIR [--config.field=value ...]"),
    (["experiments.schedule_cp_check", "--workdir=/nonexistent/never_made"],
     "--config is required; e.g. python -m experiments.schedule_cp_check "
     "--config=configs/schedule_search.py --config.memory_budget_mode="),
    (["experiments.schedule_lp_check", "--workdir=/nonexistent/never_made"],
     "--config is required; e.g. python -m experiments.schedule_lp_check "
     "--config=configs/schedule_search.py --config.memory_budget_mode="),
])
def test_a_required_flag_left_out_is_named_with_the_binarys_usage_line(args, line):
  """absl said "flag --config=None: Flag --config must have a value other than None." (a line
  per flag, the second without the FATAL prefix); schedule_cp_check and schedule_lp_check did not
  require --config and ended in an AttributeError traceback."""
  proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert _fatal_line(proc).startswith(line), proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr  # + absl's --helpshort line
  assert config_files.missing_required("flag --lr=2: value should be positive") is None


def test_a_subset_rerun_keeps_the_other_runs_rows_in_the_summary(tmp_path):
  from experiments import runner
  (tmp_path / "summary.json").write_text(
      '[{"run": "e0", "status": "ok", "x": 1}, {"run": "e1", "status": "failed (exit 1)"}]')
  rows = runner.merge_rows(str(tmp_path), [{"run": "e1", "status": "ok", "x": 2}],
                           ["e0", "e1", "e2"])
  assert rows == [{"run": "e0", "status": "ok", "x": 1}, {"run": "e1", "status": "ok", "x": 2}]
  assert runner.merge_rows(str(tmp_path / "none"), [{"run": "e2"}], ["e0", "e2"]) == [
      {"run": "e2"}]


@pytest.mark.parametrize("value,minimum,ok", [
    (1, 1, True), (0, 0, True), (0, 1, False), (2.0, 1, False), (True, 0, False),
    ("3", 1, False)])
def test_count_fields_must_be_integers_at_least_the_minimum(value, minimum, ok):
  c = ml_collections.ConfigDict({"repeats": 3, "slots": value})
  if ok:
    config_files.check_ints(c, ("repeats", "slots"), minimum)
  else:
    with pytest.raises(ValueError, match=rf"^config\.slots={value!r}: expected an integer >= "
                                         rf"{minimum}$"):
      config_files.check_ints(c, ("repeats", "slots"), minimum)


def test_count_fields_beyond_int32_are_refused_by_name_but_seeds_are_not():
  """2**70 passed as a count, then failed naming another field (plan_check's pp blamed
  actor.num_layers; bench_generation's batch_size blamed generation.slots)."""
  config_files.check_int("slots", 2**31 - 1)
  with pytest.raises(ValueError, match=r"^config\.slots=2147483648: expected an integer of at "
                                       r"most 2147483647 "):
    config_files.check_int("slots", 2**31)
  config_files.check_int("seed", 2**40, 0)
  config_files.check_int("search_seed", 2**40, 0)


def test_a_value_given_to_a_section_says_it_is_a_section():
  """--config.actor=7b where `actor` is a section of fields (plan_check's tiny variant) printed
  ml_collections' "Failed to parse '7b' as a ConfigDict: SyntaxError('invalid decimal
  literal', ...)"."""
  raw = ("flag --config.actor=7b: Failed to parse '7b' as a ConfigDict: SyntaxError('invalid "
         "decimal literal', ('<unknown>', 1, 1, '7b', 1, 1))")
  assert config_files.shorten(raw) == (
      "--config.actor=7b: config.actor is a section of fields in this config, not a value: set "
      "them as --config.actor.<field>=...")


def test_the_run_log_keeps_what_was_logged_from_the_start_and_the_error(tmp_path, monkeypatch):
  """runner.RunLog: records before keep_in (the workdir lock) are buffered and written first,
  under a header naming the command; an error's traceback goes in; library INFO lines that
  stderr leaves out stay out; a parent that keeps the output (run_streamed) means no file."""
  from absl import logging as absl_logging
  from experiments import runner
  from rlhfuse_jax import metrics as metrics_lib
  metrics_lib.quiet_library_logs()
  monkeypatch.delenv(runner.LOG_KEPT_ENV, raising=False)
  absl_logging.set_verbosity(absl_logging.INFO)
  log = runner.RunLog()
  try:
    absl_logging.info("set-up line before the lock")
    assert log.keep_in(str(tmp_path)) == str(tmp_path / "log.txt")
    absl_logging.info("iter 1/2 reward/mean=0.5")
    import logging as py_logging
    py_logging.getLogger("orbax.checkpoint").info("a library's INFO line")
    try:
      raise ZeroDivisionError("in a reward function")
    except ZeroDivisionError as e:
      log.exception(f"the run ended with ZeroDivisionError: {e}")
  finally:
    log.close()
  absl_logging.info("after close")
  text = (tmp_path / "log.txt").read_text()
  assert text.startswith("=== ") and runner.command_line() in text.splitlines()[0]
  assert text.index("set-up line before the lock") < text.index("iter 1/2 reward/mean=0.5")
  assert "Traceback (most recent call last)" in text and "ZeroDivisionError: in a reward" in text
  assert "a library's INFO line" not in text and "after close" not in text
  monkeypatch.setenv(runner.LOG_KEPT_ENV, "1")
  kept = runner.RunLog()
  assert kept.keep_in(str(tmp_path / "child")) is None
  kept.close()
  assert not (tmp_path / "child").exists()


def _orbax_error(text: str):
  """An ERROR record with its traceback, as orbax's threads log a failed save."""
  import logging as py_logging
  try:
    raise ValueError(text)
  except ValueError:
    return py_logging.getLogger("absl").makeRecord(
        "absl", py_logging.ERROR, "/site-packages/orbax/checkpoint/_src/futures/future.py", 387,
        "_SignalingThread.run() raised an exception: %s", (text,), sys.exc_info())


def test_library_tracebacks_go_to_the_log_file_and_an_unwritable_one_is_said_once(
    tmp_path, monkeypatch):
  """Once the run log is kept, orbax's (and tensorstore's) records print their message on
  stderr and their traceback in log.txt alone (a save failing on a full disk: ~80 of them,
  test_faults.py); our own errors keep theirs. A log file that cannot be written (the same full
  disk) is said in one line on stderr, not logging's ~40-line "--- Logging error ---" per
  record, and the library records then keep their traceback on stderr, the only copy."""
  import io
  import logging as py_logging
  from absl import logging as absl_logging
  from experiments import runner
  monkeypatch.delenv(runner.LOG_KEPT_ENV, raising=False)
  stderr = io.StringIO()
  monkeypatch.setattr(absl_logging.get_absl_handler().python_handler, "stream", stderr)
  absl_logging.set_verbosity(absl_logging.INFO)
  monkeypatch.setattr("sys.stderr", stderr)  # where the unwritable file is said
  root = py_logging.getLogger()
  absl_handler = absl_logging.get_absl_handler()  # on the root logger as app.run puts it
  added = absl_handler not in root.handlers
  if added:
    root.addHandler(absl_handler)
  log = runner.RunLog()
  try:
    path = log.keep_in(str(tmp_path))
    root.handle(_orbax_error("disk full"))
    try:
      raise KeyError("ours")
    except KeyError:
      absl_logging.exception("our error")
    log._file.flush()  # pylint: disable=protected-access
    text = open(path).read()
    assert text.count("Traceback (most recent call last)") == 2 and "ValueError: disk full" in text
    out = stderr.getvalue()
    assert f"raised an exception: disk full (traceback: {path})" in out
    assert out.count("Traceback") == 1 and "KeyError: 'ours'" in out  # ours only
    # A record that does not format is logging's own report, not a file that cannot be written.
    monkeypatch.setattr(py_logging, "raiseExceptions", False)
    absl_logging.warning("x %d", "not a number")
    absl_logging.info("a line after it")
    log._file.flush()  # pylint: disable=protected-access
    assert "a line after it" in open(path).read()

    class Full(io.StringIO):
      def write(self, s):
        raise OSError(28, "No space left on device")
    log._file.stream = Full()  # pylint: disable=protected-access
    for _ in range(3):
      absl_logging.info("iter k")
      root.handle(_orbax_error("again"))
  finally:
    log.close()
    if added:
      root.removeHandler(absl_handler)
  out = stderr.getvalue()
  assert "Logging error" not in out
  assert out.count(f"{path}: cannot write (OSError: [Errno 28] No space left on device)") == 1
  assert out.count("ValueError: again") == 3  # whole on stderr, the only copy left
  # close() gives absl's handler its own formatter back
  assert not isinstance(absl_logging.get_absl_handler().python_handler.formatter,
                        runner._LibraryTracebacksElsewhere)  # pylint: disable=protected-access


def test_the_code_processes_compare_includes_uncommitted_changes(monkeypatch):
  """train_ppo's processes compare runner.start_code(): two checkouts of one commit with
  different uncommitted changes (each "<commit>-dirty") computed their shares of a batch with
  different code and trained on, as the commit alone compared equal."""
  from experiments import runner
  start = {"git_commit": "abc-dirty", "git_changes": "1111"}
  monkeypatch.setattr(runner, "_START", start)
  one = runner.start_code()
  start["git_changes"] = "2222"
  assert runner.start_code() != one and "abc-dirty" in one and "1111" in one
  start.update(git_commit="abc", git_changes=None)
  assert runner.start_code() == "abc"
  start.clear()
  assert runner.start_code() == "?"


def test_a_tilde_after_the_equals_sign_is_the_home_directory(monkeypatch):
  """The shell expands `~` only at a word's start: `--workdir=~/runs/a` reached the binaries as
  typed and made a directory named `~` in the current one. parse_flags expands `--name=~` and
  `--name=~/...` (a config field's path too; absl's `-name=` form too), not a `~` inside a
  value or after `--`. The sweep expands its own flags and its runs' commands the same way
  (it recorded `~/x` where its runs' configs held the expanded path, so a finished run was
  never recognised as the same config)."""
  from experiments import runner
  monkeypatch.setenv("HOME", "/home/u")
  argv = ["prog", "--workdir=~/runs/a", "--config.data.prompts_file=~", "--x=a~/b",
          "--y=~user_unknown_zz/c", "-v=~/d", "--", "--z=~/e"]
  assert runner.home_expanded(argv) == [
      "prog", "--workdir=/home/u/runs/a", "--config.data.prompts_file=/home/u", "--x=a~/b",
      "--y=~user_unknown_zz/c", "-v=/home/u/d", "--", "--z=~/e"]
  cmd = runner.build_command("plan_search", "configs/plan_search.py", "/r", {"hardware": "~/h"},
                             ["--config.calibration=~/c.json"])
  assert cmd[-2:] == ["--config.hardware=/home/u/h", "--config.calibration=/home/u/c.json"]


def test_the_peer_grace_is_read_from_the_environment(monkeypatch):
  """RLHFUSE_PEER_GRACE_S replaces process 0's 10 s wait before an error's exit; a value that
  is not seconds >= 0 is refused by name (the caller then waits the default)."""
  monkeypatch.delenv(config_files.PEER_GRACE_ENV, raising=False)
  assert config_files.peer_grace_s() == config_files.PEER_GRACE_S == 10
  monkeypatch.setenv(config_files.PEER_GRACE_ENV, "2.5")
  assert config_files.peer_grace_s() == 2.5
  for bad in ("-1", "nan", "soon", ""):
    monkeypatch.setenv(config_files.PEER_GRACE_ENV, bad)
    with pytest.raises(ValueError, match=r"RLHFUSE_PEER_GRACE_S=.*expected seconds, a number"):
      config_files.peer_grace_s()


def test_a_full_disk_or_an_unwritable_file_is_one_line_naming_the_file(tmp_path):
  """A write to a run's own files that the machine refuses (metrics.jsonl on a full disk,
  result.json in a read-only directory, a .lock the user may not open) ended in a 50-87 line
  traceback whose last line, for a full disk, named no file: now one line naming it (/dev/full
  fails every write with ENOSPC, as a full disk does)."""
  from rlhfuse_jax import workdir as wd
  with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '/dev/full'") as e:
    wd.append_jsonl("/dev/full", {"step": 1})
  assert config_files.user_error(e.value)
  out = subprocess.run(
      [sys.executable, "-c", textwrap.dedent("""
          from experiments import config_files
          from rlhfuse_jax import workdir as wd
          config_files.run(lambda argv: wd.append_jsonl("/dev/full", {"step": 1}))
          """)], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 1, out.stderr
  assert "] OSError: [Errno 28] No space left on device: '/dev/full'" in out.stderr, out.stderr
  assert "Traceback" not in out.stderr, out.stderr
  # (EEXIST: os.makedirs of a directory where a file is, as a cache_dir naming a file)
  for code in (errno.EACCES, errno.EROFS, errno.EISDIR, errno.EEXIST, errno.EFBIG):
    assert config_files.user_error(OSError(code, os.strerror(code), str(tmp_path)))
  assert not config_files.user_error(OSError(errno.EIO, "I/O error"))  # a fault: traceback
  assert not config_files.user_error(OSError("no errno"))


@pytest.mark.parametrize("body, line", [
    ("import ml_collections\ndef get_config():\n"
     "  c = ml_collections.ConfigDict({'rollout': {'b': 1}})\n  c.rolout.b = 2\n  return c\n",
     "--config='bad.py': loading it raised AttributeError: 'rolout' Did you mean \"rollout\" "
     "instead of \"rolout\"? (bad.py, line 4)"),
    ("x = (\n", "--config='bad.py': loading it raised SyntaxError: '(' was never closed "
     "(bad.py, line 1)"),
    ("import no_such_module_here\n", "--config='bad.py': loading it raised ModuleNotFoundError: "
     "No module named 'no_such_module_here' (bad.py, line 1)"),
    ("def get_config():\n  c = {'lr': 0.1}\n", "--config='bad.py': its get_config() returned "
     "None; expected a config (an ml_collections.ConfigDict: a `return` missing?)"),
])
def test_an_error_inside_a_config_file_is_one_line_with_its_line(tmp_path, body, line):
  """A user's edited copy of a config file with a misspelled section, a syntax error, a failed
  import or no `return`: 39-61 lines of traceback (the last one read as "--config is
  required")."""
  (tmp_path / "bad.py").write_text(body)
  assert _fatal_line(_run(tmp_path, "--config=bad.py")) == line


def test_a_config_of_another_binary_names_the_field_and_the_binary_s_own(tmp_path):
  """schedule_search given ppo_tiny's config: ml_collections' AttributeError of the first
  field it read, in a 48-line traceback."""
  out = subprocess.run([sys.executable, "-m", "experiments.schedule_search",
                        "--config=configs/ppo_tiny.py", f"--workdir={tmp_path / 'w'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert ("ValueError: --config='configs/ppo_tiny.py' has no field 'memory_budget', which "
          "experiments.schedule_search reads: a config file of another binary, or a copy older "
          "than the code (experiments.schedule_search's own is configs/schedule_search.py)"
          ) in out.stderr, out.stderr[-3000:]


_MODES = textwrap.dedent("""
  import os
  import ml_collections
  from absl import flags
  from ml_collections import config_flags
  from experiments import config_files
  _CONFIG = config_flags.DEFINE_config_file("config", None, "config file")
  _RUN = config_flags.DEFINE_config_file("run_config", None, "a second config file")
  def main(argv):
    mode = os.environ["MODE"]
    if mode == "nested":  # a field the config file lacks, in a section
      print(_CONFIG.value.model.depht)
    elif mode == "second":  # ... of the second config file
      print(_RUN.value.lr, _RUN.value.sim)
    elif mode == "locked":  # the code's own error: a write to the locked config
      _CONFIG.value.new_field = 1
    else:  # the code's own error: a ConfigDict that is no flag's
      print(ml_collections.ConfigDict({"a": 1}).b)
  config_files.run(main)
""")


@pytest.mark.parametrize("mode, said", [
    ("nested", "ValueError: --config='cfg.py' has no field 'model.depht', which modes.py reads: "
               "a config file of another binary, or a copy older than the code"),
    ("second", "ValueError: --run_config='cfg.py' has no field 'sim', which modes.py reads"),
    ("locked", None), ("other", None)])
def test_a_field_the_binary_reads_and_its_config_lacks_names_the_flag(tmp_path, mode, said):
  """The field is named with the config flag that lacks it (the first config flag was blamed),
  by its path; the code's own errors (a locked config written to, another ConfigDict) keep
  their traceback."""
  (tmp_path / "cfg.py").write_text(_CONFIG_FILE)
  (tmp_path / "modes.py").write_text(_MODES)
  env = dict(os.environ, MODE=mode,
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "modes.py", "--config=cfg.py", "--run_config=cfg.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 1, out.stderr[-3000:]
  if said is None:
    assert "Traceback" in out.stderr and "has no field" not in out.stderr, out.stderr[-3000:]
  else:
    assert said in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_an_error_raised_further_in_than_the_config_file_keeps_its_traceback(tmp_path):
  """Only the config file's own error is cut to one line: one raised in a module it imports
  (the library mid-edit) showed as the config file's import line, and RLHFUSE_TRACEBACK=1
  brought no traceback back."""
  (tmp_path / "helper.py").write_text("def lr():\n  return 1 / 0\n")
  (tmp_path / "deep.py").write_text("import ml_collections\nimport helper\ndef get_config():\n"
                                    "  return ml_collections.ConfigDict({'lr': helper.lr()})\n")
  out = _run(tmp_path, "--config=deep.py")
  assert out.returncode != 0 and "Traceback" in out.stderr, out.stderr[-3000:]
  assert 'helper.py", line 2' in out.stderr and "ZeroDivisionError" in out.stderr
  (tmp_path / "own.py").write_text("def get_config():\n  return 1 / 0\n")
  assert _fatal_line(_run(tmp_path, "--config=own.py")) == (
      "--config='own.py': loading it raised ZeroDivisionError: division by zero (own.py, line 2)")
  env = dict(os.environ, RLHFUSE_TRACEBACK="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", _BINARY, "--config=own.py"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "Traceback" in out.stderr, out.stderr[-3000:]
