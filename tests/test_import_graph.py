"""The package graph is one-way, as docs/architecture.md §7 states it.

The rule is read from the ```deps block of docs/architecture.md (so the doc and the check cannot
drift apart); the graph is derived from the source with `ast` (no import is executed). Checked:
every arrow between groups is allowed by the rule, the group graph has no cycle, and the modules
listed under `nojax` reach no jax/flax/optax/orbax import, directly or through the package
modules they import.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCH = ROOT / "docs" / "architecture.md"
BASE = {"rlhfuse_jax.checkpointing", "rlhfuse_jax.fields", "rlhfuse_jax.metrics",
        "rlhfuse_jax.workdir", "rlhfuse_jax"}
JAX_ROOTS = {"jax", "jaxlib", "flax", "optax", "orbax", "chex"}


def parse_rule(text: str) -> tuple[dict, list]:
  """({group: allowed groups}, nojax module prefixes) from the ```deps block of `text`."""
  m = re.search(r"```deps\n(.*?)```", text, re.S)
  if not m:
    raise ValueError("docs/architecture.md has no ```deps block")
  allowed, nojax = {}, []
  for line in m.group(1).splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    name, _, rest = line.partition(":")
    if name.strip() == "nojax":
      nojax = rest.split()
    else:
      allowed[name.strip()] = set(rest.split())
  return allowed, nojax


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set:
  """Absolute names imported by a file (`from a import b` gives a and a.b)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


def source_graph(root: pathlib.Path = ROOT) -> dict:
  """{module: imported names} for the library, the binaries and the configs."""
  files = [p for d in ("rlhfuse_jax", "experiments", "configs") for p in (root / d).rglob("*.py")
           if "results" not in p.parts]
  return {module_name(p): imports_of(p) for p in files}


def group_of(module: str, groups) -> str:
  """The group of a module: the longest group name that prefixes it (`base` for the top-level
  helper modules); None for names outside the project."""
  if module in BASE or module.rsplit(".", 1)[0] in BASE - {"rlhfuse_jax"}:
    return "base"  # a base module, or a name imported from one (`from ..fields import check`)
  top = module.split(".")[0]
  if top in ("experiments", "configs"):
    return top
  if top != "rlhfuse_jax":
    return None
  rel = module[len("rlhfuse_jax."):]
  best = None
  for g in groups:
    if (rel == g or rel.startswith(g + ".")) and (best is None or len(g) > len(best)):
      best = g
  if best is None:
    raise AssertionError(f"{module} belongs to no group of the ```deps rule in "
                         "docs/architecture.md: add its package there")
  return best


def group_edges(graph: dict, groups) -> dict:
  """{(from group, to group): [example 'module -> import', ...]} for arrows between groups."""
  edges = {}
  for mod, names in graph.items():
    a = group_of(mod, groups)
    for name in names:
      b = group_of(name, groups)
      if b is not None and a != b:
        edges.setdefault((a, b), []).append(f"{mod} -> {name}")
  return edges


def violations(graph: dict, allowed: dict) -> list:
  return [f"{a} -> {b} is against docs/architecture.md §7 (e.g. {ex[0]})"
          for (a, b), ex in sorted(group_edges(graph, allowed).items())
          if b not in allowed.get(a, set())]


def cycles(graph: dict, groups) -> list:
  """The group cycles (each as a list of groups) found by depth-first search."""
  succ = {}
  for a, b in group_edges(graph, groups):
    succ.setdefault(a, set()).add(b)
  found, state = [], {}

  def visit(g, path):
    state[g] = 1
    for h in sorted(succ.get(g, ())):
      if state.get(h) == 1:
        found.append(path[path.index(h):] + [h])
      elif h not in state:
        visit(h, path + [h])
    state[g] = 2
  for g in sorted(succ):
    if g not in state:
      visit(g, [g])
  return found


def jax_reach(graph: dict, start: str) -> list:
  """An import chain from `start` to a jax-family import, or [] if there is none."""
  seen, stack = {start}, [(start, [start])]
  while stack:
    mod, chain = stack.pop()
    for name in sorted(graph.get(mod, ())):
      if name.split(".")[0] in JAX_ROOTS:
        return chain + [name]
      for target in (name, name.rpartition(".")[0]):  # `from pkg import module`
        if target in graph and target not in seen:
          seen.add(target)
          stack.append((target, chain + [target]))
  return []


def nojax_violations(graph: dict, prefixes) -> list:
  out = []
  for mod in sorted(graph):
    rel = mod[len("rlhfuse_jax."):] if mod.startswith("rlhfuse_jax.") else None
    if rel and any(rel == p or rel.startswith(p + ".") for p in prefixes):
      chain = jax_reach(graph, mod)
      if chain:
        out.append(" -> ".join(chain))
  return out


@pytest.fixture(scope="module")
def rule():
  return parse_rule(ARCH.read_text())


def test_the_rule_names_every_package(rule):
  allowed, _ = rule
  packages = {module_name(p.parent)[len("rlhfuse_jax."):]
              for p in (ROOT / "rlhfuse_jax").rglob("__init__.py") if p.parent != ROOT /
              "rlhfuse_jax"}
  missing = sorted(p for p in packages if not any(p == g or p.startswith(g + ".")
                                                  for g in allowed))
  assert not missing, f"packages missing from the ```deps rule: {missing}"


def test_every_arrow_follows_the_rule(rule):
  allowed, _ = rule
  assert violations(source_graph(), allowed) == []


def test_no_cycle_between_packages(rule):
  allowed, _ = rule
  assert cycles(source_graph(), allowed) == []


def test_numpy_layers_import_no_jax(rule):
  allowed, nojax = rule
  assert nojax, "the ```deps rule lists no nojax modules"
  assert nojax_violations(source_graph(), nojax) == []


def test_the_checks_catch_a_back_import_a_cycle_and_jax(rule):
  """The checks fail on what they are for: a back-import (sim -> generation), the cycle it
  closes, and jax reached through a numpy module."""
  allowed, nojax = rule
  graph = dict(source_graph())
  graph["rlhfuse_jax.sim.generation_sim"] = graph["rlhfuse_jax.sim.generation_sim"] | {
      "rlhfuse_jax.trainer.loop"}
  assert any(v.startswith("sim -> trainer") for v in violations(graph, allowed))
  assert any(c[0] == c[-1] and "sim" in c and "trainer" in c for c in cycles(graph, allowed))
  assert any("rlhfuse_jax.trainer.loop -> jax" in v for v in nojax_violations(graph, nojax))
