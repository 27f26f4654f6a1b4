"""Docs that cannot rot: every command and link in README.md, docs/*.md and the READMEs of
experiments/results/ still refers to things that exist. Nothing is run; the test takes seconds.

A command is `python -m experiments.X ...` in a fenced block (continued over lines ending in a
backslash) or in an inline code span (which may wrap), or in a script kept under
experiments/results/ (a GPU session's prepared calls). For each one:
  - experiments/X.py exists;
  - `--config=configs/Y.py[:variant]` exists and `get_config(variant)` returns a ConfigDict
    (the sweep binary: `get_sweep()` exists and `--binary=NAME` names a binary);
  - every `--config.FIELD=VALUE` names a field of that config (dotted), and a bool, int or
    float field gets a value of its type (placeholders such as DIR are not checked);
  - every other `--flag` (or `--noflag` for a boolean) is defined by the binary, or is absl's;
  - a flag value that is a path under experiments/results/ exists.
Placeholders: `...` is skipped, an upper-case module name (`experiments.NAME`) is not checked.
Every relative Markdown link must resolve to a file or folder, and its #anchor, if any, to a
heading of that file. docs/architecture.md keeps the
numbered section headings that code cites as "docs/architecture.md §n", and pyproject.toml
lists requirements.txt's dependencies.
"""
from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import shlex

import ml_collections
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_GLOBS = ("README.md", "docs/*.md", "experiments/results/*/README.md")
README_MAX_BYTES = 8000
ARCHITECTURE_SECTIONS = (
    "## 1. One PPO iteration",
    "## 2. Inter-stage fusion",
    "## 3. Intra-stage fusion",
    "## 4. Pipe-RLHF ideas",
    "## 5. Other system optimisations",
    "## 6. Simulator",
    "## 7. Conventions and the dependency rule",
    "## 8. Changing the code",
)
# Flags absl defines for every binary.
ABSL_FLAGS = {"help", "helpfull", "helpshort", "flagfile", "logtostderr", "alsologtostderr",
              "verbosity", "v", "log_dir", "stderrthreshold", "only_check_args"}
# (a script may break the line after -m)
_COMMAND = re.compile(r"python3? -m\s+(?:\\\n\s*)?experiments\.(\w+)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*([/.].*)?$")  # DIR, OUT, BG, DIR/schedule.json
_CONFIG_FILE = re.compile(r"^configs/[\w/.-]+\.py(:.*)?$")


def _doc_files() -> list[str]:
  found = []
  for pattern in DOC_GLOBS:
    found += sorted(glob.glob(os.path.join(ROOT, pattern)))
  return [os.path.relpath(p, ROOT) for p in found]


def _read(rel: str) -> str:
  with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
    return f.read()


# A metric name in backticks: `timing_s/generate|inference` names two, and so does
# `gen/consolidated_from|to` (an alternative replaces the whole name or its last word);
# `reward/<label>_mean` any label.
_METRIC = re.compile(r"`([a-z_]+)/([a-z_0-9|<>]+)`")
METRIC_DOCS = ("docs/architecture.md", "docs/usage.md")


def undocumented_metrics(names) -> list[str]:
  """Those of the metric `names` (a row of metrics.jsonl's keys) that docs/architecture.md and
  docs/usage.md name nowhere (`step` is the row's number, not a metric)."""
  known = []
  for rel in METRIC_DOCS:
    for group, rest in _METRIC.findall(_read(rel)):
      first, *alts = rest.split("|")
      stem = first.rpartition("_")[0]
      for name in [first, *alts, *(f"{stem}_{a}" for a in alts if stem)]:
        parts = re.split(r"<[a-z_]+>", f"{group}/{name}")  # a placeholder: any word
        known.append(re.compile("[a-z_0-9]+".join(map(re.escape, parts))))
  return [n for n in names if n != "step" and not any(k.fullmatch(n) for k in known)]


def test_metric_names_are_read_from_the_docs():
  """undocumented_metrics, which the trainer tests check their runs' rows with
  (tests/test_fused_trainer.py), reads the docs' shorthand."""
  assert undocumented_metrics(["step", "timing_s/generate", "timing_s/inference",
                               "gen/consolidated_from", "gen/consolidated_to",
                               "reward/format_mean", "stats/num_chars_mean"]) == []
  assert undocumented_metrics(["timing_s/nonesuch", "reward/mean_x"]) == [
      "timing_s/nonesuch", "reward/mean_x"]


@dataclasses.dataclass(frozen=True)
class Command:
  doc: str  # path of the Markdown file, relative to the repository
  line: int  # 1-based line where the command starts
  module: str  # X of `python -m experiments.X`
  args: tuple[str, ...]  # shell words after the module

  @property
  def where(self) -> str:
    return f"{self.doc}:{self.line}"

  def __str__(self) -> str:  # the parametrize id
    return f"{self.where}:{self.module}"


def _command_text(text: str, start: int) -> str:
  """The command from `start` to the end of its code span or of its (continued) line."""
  inline = start > 0 and text[start - 1] == "`"
  out = []
  i = start
  while i < len(text):
    ch = text[i]
    if ch == "`":
      break
    if ch == "\n":
      stripped = "".join(out).rstrip()
      if stripped.endswith("\\"):
        out = [stripped[:-1], " "]
      elif not inline:
        break
      else:
        out.append(" ")
    else:
      out.append(ch)
    i += 1
  cmd = "".join(out)
  # A shell comment, or what follows the command in a pipeline or list, is not its argument.
  cmd = re.split(r"\s#|\s&&|\s\|\|?|;|\s>", cmd)[0]
  return cmd


def find_commands(doc: str, text: str) -> list[Command]:
  commands = []
  for m in _COMMAND.finditer(text):
    line = text.count("\n", 0, m.start()) + 1
    words = shlex.split(_command_text(text, m.start()))
    # words: python, -m, experiments.X, args...
    commands.append(Command(doc, line, m.group(1), tuple(words[3:])))
  return commands


# Scripts kept for a later machine (a GPU session's prepared calls): their commands are checked
# too, so that a flag renamed since does not cost that rare session a run.
SCRIPT_GLOBS = ("experiments/results/*/*.sh",)


def _all_commands() -> list[Command]:
  out = []
  scripts = [os.path.relpath(p, ROOT) for g in SCRIPT_GLOBS
             for p in sorted(glob.glob(os.path.join(ROOT, g)))]
  for doc in _doc_files() + scripts:
    out += find_commands(doc, _read(doc))
  return out


COMMANDS = _all_commands()


def _load_module(path: str):
  spec = importlib.util.spec_from_file_location(
      "_doc_config_" + re.sub(r"\W", "_", path), os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def binary_flags(module: str) -> tuple[set[str], set[str]]:
  """(all flags, boolean flags) that experiments/<module>.py defines, absl's included."""
  with open(os.path.join(ROOT, "experiments", f"{module}.py"), encoding="utf-8") as f:
    source = f.read()
  defs = re.findall(r"flags\.DEFINE_(\w+)\(\s*[\"'](\w+)[\"']", source)
  names = {name for _, name in defs} | ABSL_FLAGS
  bools = {name for kind, name in defs if kind in ("bool", "boolean")} | {"logtostderr",
                                                                          "alsologtostderr"}
  return names, bools


def required_flags(module: str) -> set[str]:
  """The flags experiments/<module>.py requires (`required=True`, mark_flags_as_required)."""
  with open(os.path.join(ROOT, "experiments", f"{module}.py"), encoding="utf-8") as f:
    source = f.read()
  required = set(re.findall(r"DEFINE_\w+\(\s*[\"'](\w+)[\"'][^)]*required=True", source))
  for listed in re.findall(r"mark_flags?_as_required\(\s*\[([^\]]*)\]", source):
    required |= set(re.findall(r"[\"'](\w+)[\"']", listed))
  return required


def _parse_args(args):
  """[(name, value or None)] of the --flags; other words (positional) are returned as None."""
  for word in args:
    if word == "..." or not word.startswith("-"):
      continue
    name, sep, value = word.lstrip("-").partition("=")
    yield name, (value if sep else None)


def _field(config: ml_collections.ConfigDict, dotted: str):
  node = config
  for i, part in enumerate(dotted.split(".")):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      raise KeyError(f"no field {'.'.join(dotted.split('.')[:i + 1])!r} (known here: {known})")
    node = node[part]
  return node


def _type_error(field, value: str) -> str | None:
  if _PLACEHOLDER.match(value):
    return None
  try:
    if isinstance(field, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        return f"expected a bool, got {value!r}"
    elif isinstance(field, int):
      int(value)
    elif isinstance(field, float):
      float(value)
  except ValueError:
    return f"expected {type(field).__name__}, got {value!r}"
  return None


def check_command(cmd: Command) -> list[str]:
  """Everything wrong with one documented command, each message naming file and line."""
  where = f"{cmd.where}: `python -m experiments.{cmd.module}`"
  if _PLACEHOLDER.match(cmd.module):
    return []
  if not os.path.exists(os.path.join(ROOT, "experiments", f"{cmd.module}.py")):
    return [f"{where}: no binary experiments/{cmd.module}.py"]
  problems = []
  names, bools = binary_flags(cmd.module)
  parsed = list(_parse_args(cmd.args))
  # A command to copy has every flag its binary requires ("..." stands for the rest; a bare
  # `python -m experiments.X` names the binary in prose).
  if cmd.args and "..." not in cmd.args:
    given = {name for name, _ in parsed}
    problems += [f"{where}: no --{flag}, which experiments/{cmd.module}.py requires"
                 for flag in sorted(required_flags(cmd.module) - given)]
  # Config flags: --config, and any other flag given a config file (plan_check's --run_config);
  # each may be followed by --<flag>.<field>=... overrides.
  config_flags = {"config"} | {n for n, v in parsed
                               if n in names and v and _CONFIG_FILE.match(v)}
  configs = {}
  for name, value in parsed:
    if name not in config_flags:
      continue
    if value is None:
      problems.append(f"{where}: --{name} without a value")
      continue
    path, _, variant = value.partition(":")
    if not os.path.exists(os.path.join(ROOT, path)):
      problems.append(f"{where}: --{name}={value}: no file {path}")
      continue
    try:
      module = _load_module(path)
      if cmd.module == "sweep" and name == "config":
        if not hasattr(module, "get_sweep"):
          problems.append(f"{where}: --config={value}: {path} defines no get_sweep()")
        configs[name] = module.get_config()
      else:
        configs[name] = module.get_config(variant) if variant else module.get_config()
    except Exception as e:  # pylint: disable=broad-except
      problems.append(f"{where}: --{name}={value}: get_config({variant!r}) raised "
                      f"{type(e).__name__}: {e}")
      continue
    if not isinstance(configs[name], ml_collections.ConfigDict):
      problems.append(f"{where}: --{name}={value}: get_config returned "
                      f"{type(configs[name]).__name__}")
      del configs[name]
  for name, value in parsed:
    if name in config_flags:
      continue
    flag, dot, rest = name.partition(".")
    if dot and flag in config_flags:
      config = configs.get(flag)
      if config is None:
        problems.append(f"{where}: --{name} but no loadable --{flag}=configs/....py")
        continue
      try:
        field = _field(config, rest)
      except KeyError as e:
        problems.append(f"{where}: --{name}: {e.args[0]}")
        continue
      if value is not None and (msg := _type_error(field, value)):
        problems.append(f"{where}: --{name}={value}: {msg}")
      continue
    base = name[2:] if name.startswith("no") and name[2:] in bools else name
    if base not in names:
      problems.append(f"{where}: --{name} is not a flag of experiments/{cmd.module}.py "
                      f"(its flags: {sorted(names - ABSL_FLAGS)})")
      continue
    if cmd.module == "sweep" and name == "binary" and value and not _PLACEHOLDER.match(value):
      if not os.path.exists(os.path.join(ROOT, "experiments", f"{value}.py")):
        problems.append(f"{where}: --binary={value}: no experiments/{value}.py")
    if value and value.startswith("experiments/results/"):
      if not os.path.exists(os.path.join(ROOT, value)):
        problems.append(f"{where}: --{name}={value}: no such file")
  return problems


def test_docs_document_commands():
  assert len(COMMANDS) >= 10, f"found only {len(COMMANDS)} commands in {_doc_files()}"
  readme = {c.module for c in COMMANDS if c.doc == "README.md"}
  assert "train_ppo" in readme, "README.md no longer shows the main command (experiments.train_ppo)"


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_documented_command_is_valid(cmd: Command):
  problems = check_command(cmd)
  assert not problems, "\n".join(problems)


def _links() -> list[tuple[str, int, str]]:
  out = []
  for doc in _doc_files():
    text = _read(doc)
    # Code may show link syntax; only prose links are followed.
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in _LINK.finditer(prose):
      target = m.group(1) or m.group(2)
      if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        continue  # http(s), mailto, and anchors in the same file
      out.append((doc, prose.count("\n", 0, m.start()) + 1, target))
  return out


def _anchors(path: str) -> set[str]:
  """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces -> -."""
  with open(path, encoding="utf-8") as f:
    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
  return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
          for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc,line,target", _links(), ids=lambda x: str(x))
def test_relative_link_resolves(doc: str, line: int, target: str):
  file_part, _, anchor = target.partition("#")
  path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), file_part))
  assert os.path.exists(path), f"{doc}:{line}: link ({target}) resolves to nothing ({path})"
  if anchor and path.endswith(".md"):
    known = _anchors(path)
    assert anchor in known, (f"{doc}:{line}: link ({target}): {os.path.relpath(path, ROOT)} has "
                             f"no heading #{anchor} (its anchors: {sorted(known)})")


def test_readme_is_a_front_door():
  size = len(_read("README.md").encode("utf-8"))
  assert size <= README_MAX_BYTES, (
      f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail into docs/")


def test_architecture_sections_that_code_cites_exist():
  text = _read("docs/architecture.md")
  headings = [line for line in text.splitlines() if re.match(r"## \d+\. ", line)]
  assert tuple(headings) == ARCHITECTURE_SECTIONS, (
      f"docs/architecture.md: numbered sections are {headings}; code cites "
      f"'docs/architecture.md §n' for {list(ARCHITECTURE_SECTIONS)}")
  cited = set()
  for path in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      cited |= {(os.path.relpath(path, ROOT), int(n))
                for n in re.findall(r"docs/architecture\.md §(\d+)", f.read())}
  bad = sorted((p, n) for p, n in cited if not 1 <= n <= len(ARCHITECTURE_SECTIONS))
  assert not bad, f"code cites sections docs/architecture.md does not have: {bad}"


def test_named_doc_sections_that_code_cites_exist():
  """`docs/X.md "Heading"` names a heading of X (its start: the dates after it may change), and
  `docs/architecture.md §n, "Name"` a heading or a bold bullet in section n. A renamed or moved
  section leaves the citation pointing at nothing (found by a docs review: five did; another
  review, one in the binaries' `Docs: docs/X.md ("A", "B")` lines, which went unchecked)."""
  def headings(doc):
    return [re.sub(r"^#+ ", "", line) for line in _read(doc).splitlines()
            if re.match(r"#{2,4} ", line)]

  sections = re.split(r"\n(?=## \d+\. )", _read("docs/architecture.md"))
  bad = []
  for path in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      text = re.sub(r"\n\s*#\s*", " ", f.read())  # a citation wrapped over comment lines
    where = os.path.relpath(path, ROOT)
    # `docs/X.md "A"`, `docs/X.md "A" and "B"`, and a binary's `Docs: docs/X.md ("A", "B")`.
    for doc, names in re.findall(r'(docs/[a-z_]+\.md) \(?("[^"]+"(?:(?:, | and )"[^"]+")*)',
                                 text):
      for name in re.findall(r'"([^"]+)"', names):
        name = " ".join(name.split())  # wrapped in a docstring
        if not any(h.startswith(name) for h in headings(doc)):
          bad.append(f"{where}: {doc} \"{name}\"")
    for n, name in re.findall(r'docs/architecture\.md §(\d+), "([^"]+)"', text):
      name = " ".join(name.split())
      body = sections[int(n)] if int(n) < len(sections) else ""
      if f"**{name}**" not in body and not re.search(rf"^#+ .*{re.escape(name)}", body, re.M):
        bad.append(f"{where}: docs/architecture.md §{n}, \"{name}\"")
  assert not bad, "code cites doc sections that do not exist: " + "; ".join(sorted(set(bad)))


def test_pyproject_lists_the_requirements():
  tomllib = pytest.importorskip("tomllib")
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    declared = tomllib.load(f)["project"]["dependencies"]
  required = []
  for line in _read("requirements.txt").splitlines():
    line = line.split("#")[0].strip()
    if line:
      required.append(line.replace(" ", ""))
  assert sorted(declared) == sorted(required), (
      f"pyproject.toml [project] dependencies {declared} differ from requirements.txt {required}")


def test_the_objective_row_names_every_registered_estimator_and_aggregation():
  """usage.md's objective row lists the choices of algo.estimator, kl_estimator and loss_agg:
  one added to its registry (rl/advantages, rl/kl, rl/losses) without the docs fails here."""
  from rlhfuse_jax.rl import advantages, kl, losses
  with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
    row = next(line for line in f if line.startswith("| objective |"))
  for registry in (advantages.ADVANTAGE_ESTIMATORS, kl.KL_ESTIMATORS, losses.LOSS_AGGREGATIONS):
    missing = [name for name in registry if f"`{name}`" not in row]
    assert not missing, f"docs/usage.md's objective row does not name {missing}"
  # The batch row says which estimators need rollout.samples_per_prompt > 1.
  batch = next(line for line in _read("docs/usage.md").splitlines()
               if line.startswith("| batch |"))
  groups = [n for n in advantages.ADVANTAGE_ESTIMATORS if advantages.compares_groups(n)]
  missing = [name for name in groups if f"`{name}`" not in batch]
  assert not missing, f"docs/usage.md's batch row does not name the group estimators {missing}"


def test_the_package_layout_names_every_module():
  """docs/architecture.md §7's package layout names each module of each package (a module added
  without it, or a name that drifted from its file, `optimizer` for rl/optim.py, fails here)."""
  text = _read("docs/architecture.md")
  block = re.search(r"Package layout \(`rlhfuse_jax/`\):\n\n```\n(.*?)\n```", text, re.S).group(1)
  words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", block))
  missing = []
  for path in sorted(glob.glob(os.path.join(ROOT, "rlhfuse_jax", "**", "*.py"), recursive=True)):
    name = os.path.splitext(os.path.basename(path))[0]
    if name != "__init__" and name not in words:
      missing.append(os.path.relpath(path, ROOT))
  assert not missing, f"docs/architecture.md §7's package layout does not name {missing}"


def test_usage_names_every_registered_reward_and_task():
  """usage.md's reward list ("**Rewards.**" of "Train on your own data and reward") names each
  registered reward function and its data row each task: one added to data/rewards.
  REWARD_FUNCTIONS (data/verifiers.VERIFIERS) or data/tasks.TASKS alone was usable but
  documented nowhere."""
  from rlhfuse_jax.data import rewards, tasks
  text = _read("docs/usage.md")
  listed = text[text.index("**Rewards.**"):text.index("**Validation.**")]
  missing = [name for name in rewards.REWARD_FUNCTIONS if f"`{name}`" not in listed]
  assert not missing, f"docs/usage.md's **Rewards.** list does not name {missing}"
  row = next(line for line in text.splitlines() if line.startswith("| data |"))
  missing = [name for name in tasks.TASKS if f"`{name}`" not in row]
  assert not missing, f"docs/usage.md's data row does not name the tasks {missing}"


# `field` (value ...: a default as usage.md's train_ppo table quotes it. The value is a number,
# True/False, "" or a backticked word (`"auto"`, `uniform`); an optional one-letter symbol may
# stand between the field and the parenthesis (`rollout.prompts_per_iteration` B (32)).
_QUOTED_DEFAULT = re.compile(r"`([a-z_][a-z_0-9.]*)`(?:(?: [A-Za-z])? \("
                             r"(-?[0-9][0-9.e+-]*|True|False|\"\"|`[^`]+`)[ ),;:])?")


def _quoted_defaults(row: str) -> list[tuple[str, str]]:
  """(field, quoted value) of each default in one table row; a field without a section is in the
  section of the last dotted field before it (`rollout.max_new_tokens` (16), `temperature` (1.0)).
  """
  found, section = [], ""
  for m in _QUOTED_DEFAULT.finditer(row):
    name, quoted = m.groups()
    if "." in name:  # any dotted field sets the section
      section = name.split(".")[0]
    elif section:
      name = f"{section}.{name}"
    # A list of choices, "(`k1`, `k2`)", quotes no default (it passed while the default came
    # first): the table writes "(`k1`; or `k2`)", the default before a semicolon.
    assert not (quoted and quoted.startswith("`") and row[m.end() - 1] == "," and
                row[m.end():].lstrip().startswith("`")), (
        f"`{name}` ({quoted}, ...: a list of choices; write the default first, then '; or'")
    if quoted:
      found.append((name, quoted))
  return found


def _table(text: str, header: str) -> list[str]:
  """The body rows of the Markdown table whose header line starts with `header`."""
  table = text[text.index(header):]
  return table[:table.index("\n\n")].splitlines()[2:]


def test_usage_lists_every_config_file_and_its_documented_variants():
  """usage.md's table of configs has a row for each configs/*.py, and that row names each
  variant its docstring documents (`configs/FILE.py:VARIANT`, what tests/test_configs.py builds;
  a family such as `run/<config file>` covers its members). A preset added to a config file's
  docstring and get_config() alone was built and tested, and listed nowhere a user looks."""
  rows = {m.group(1): m.group(2) for m in re.finditer(
      r"^\| `configs/(\w+)\.py` \|[^|\n]*\|([^|\n]*)\|", _read("docs/usage.md"), re.M)}
  missing = []
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    name = os.path.basename(path)[:-3]
    if name == "__init__":
      continue
    doc = ast.get_docstring(ast.parse(_read(os.path.relpath(path, ROOT)))) or ""
    if name not in rows:
      missing.append(f"a row for configs/{name}.py")
      continue
    for variant in sorted(set(re.findall(rf"configs/{name}\.py:([\w/.-]+)", doc))):
      if f"`{variant}`" not in rows[name] and f"`{variant.split('/')[0]}/<" not in rows[name]:
        missing.append(f"configs/{name}.py's variant `{variant}`")
  assert not missing, ("docs/usage.md's table of configs (\"Configs and sweeps\") lacks " +
                       "; ".join(missing))


def test_usage_quotes_the_train_ppo_defaults_of_defaults():
  """usage.md's table of the fields a run sets first quotes each default in parentheses, and
  its own-data table has a default column; every quoted value equals config.defaults()'s (a
  default changed in a dataclass without the tables, or a number mistyped there, fails here)."""
  from rlhfuse_jax.trainer import config as config_lib
  defaults = config_lib.defaults()
  text = _read("docs/usage.md")
  quoted_defaults = [q for row in _table(text, "| what | fields (default) |")
                     for q in _quoted_defaults(row)]
  for row in _table(text, "| field | default | what it does |"):
    name, value = (cell.strip().strip("`") for cell in row.split("|")[1:3])
    quoted_defaults.append((name, value if re.fullmatch(r"[-0-9.e]+|True|False|\"\"", value)
                            else f"`{value}`"))
  checked, bad = 0, []
  for name, quoted in quoted_defaults:
    value = defaults
    for part in name.split("."):
      if not isinstance(value, dict) or part not in value:
        bad.append(f"{name} (quoted {quoted}) is not a field of defaults()")
        break
      value = value[part]
    else:
      want = quoted.strip("`").strip('"') if quoted.startswith(("`", '"')) else quoted
      if isinstance(value, bool) or isinstance(value, str):
        same = str(value) == want
      else:
        same = float(want) == float(value)
      checked += 1
      if not same:
        bad.append(f"{name}: the table quotes {quoted}, defaults() has {value!r}")
  assert checked >= 40, f"only {checked} defaults found in the tables: did their format change?"
  assert not bad, "docs/usage.md's defaults: " + "; ".join(bad)


def test_usage_lists_the_fields_a_resume_may_change():
  """usage.md's "A resume may change ..." sentence (Faults and resuming) names exactly
  config.RESUMABLE_FIELDS (`checkpoint.*` standing for that section's): a field added there and
  not here is a resume users do not know they may make, one named here only is refused."""
  from rlhfuse_jax.trainer import config as config_lib
  text = _read("docs/usage.md")
  start = text.index("A resume may change")
  sentence = text[start:text.index("The LR schedule spans", start)]
  named = set(re.findall(r"`([a-z_][a-z_0-9.*]*)`", sentence))
  fields = {f for f in config_lib.RESUMABLE_FIELDS if not f.startswith("checkpoint.")}
  named.discard("checkpoint.*")
  assert named == fields, (f"docs/usage.md names {sorted(named - fields)} that a resume may not "
                           f"change and leaves out {sorted(fields - named)}")


def test_usage_lists_the_fields_resume_changes_may_name():
  """usage.md's list of what `checkpoint.resume_changes` may name is exactly
  config.RESUME_CHANGEABLE: fusion.inference_pp and plan.inference_pp were allowed and not
  listed."""
  from rlhfuse_jax.trainer import config as config_lib
  text = _read("docs/usage.md")
  start = text.index("To continue with other hyper-parameters")
  sentence = text[start:text.index("These leave the saved state's layout", start)]
  named = set(re.findall(r"`([a-z_][a-z_0-9.]*)`", sentence))
  named.discard("checkpoint.resume_changes")
  fields = set(config_lib.RESUME_CHANGEABLE)
  assert named == fields, (f"docs/usage.md names {sorted(named - fields)} that resume_changes "
                           f"refuses and leaves out {sorted(fields - named)}")


def test_binary_and_config_docstrings_keep_their_lines():
  """A module docstring is the binary's --help and the config file's launch command: in a
  non-raw one a command continued with a backslash was joined into one line with runs of
  spaces (sweep, schedule_cp_check, schedule_lp_check), so --help showed no line breaks and
  nothing to paste as written."""
  joined = []
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")) +
                     glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    source = _read(os.path.relpath(path, ROOT))
    tree = ast.parse(source)
    doc = ast.get_docstring(tree, clean=False)
    if doc is not None:
      written = ast.get_source_segment(source, tree.body[0])
      if written.count("\n") != doc.count("\n"):
        joined.append(os.path.relpath(path, ROOT))
  assert not joined, f"docstrings whose lines Python joins (make them r\"\"\"...): {joined}"


def test_every_binary_help_names_its_docs():
  """A binary's docstring is its --help: it names the docs/*.md that describes the binary, and
  that file exists (bench_decode, calibrate_sim, plan_check, the schedule checks and others
  named none, so `--help` left a newcomer without the page README links)."""
  missing = []
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))):
    module = os.path.basename(path)[:-3]
    doc = ast.get_docstring(ast.parse(_read(os.path.relpath(path, ROOT)))) or ""
    if f"python -m experiments.{module}" not in doc:
      continue  # not a binary (config_files, runner, plan_programs)
    named = re.findall(r"docs/[\w-]+\.md", doc)
    if not named or not all(os.path.isfile(os.path.join(ROOT, n)) for n in named):
      missing.append(f"{module}: {named}")
  assert not missing, f"binaries whose docstring names no existing docs/*.md: {missing}"
