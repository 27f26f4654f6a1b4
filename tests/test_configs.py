"""Every configs/*.py parses into the typed config of its binary, in every variant it documents
(train_ppo's with its reward functions resolved), and every get_sweep() entry overrides fields
that exist (and still parses).

A config's binary is the `python -m experiments.NAME --config=configs/THIS.py` of its docstring;
its variants are the `configs/THIS.py:VARIANT` it names. Binaries that take the ConfigDict as it
is (no typed config) are checked for a ConfigDict only. Then the LLaMA-class shape-only configs
(configs/ppo_llama.py) are checked against the published sizes and their meshes.
"""
import glob
import importlib
import inspect
import os
import re

import ml_collections
import pytest

from rlhfuse_jax.perf.bench_config import BenchDecodeConfig
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.sim import shapes as sim_shapes
from rlhfuse_jax.sim.ablations import AblationConfig
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
               if not p.endswith("__init__.py"))


def _train_config(c):
  """train_ppo's checks of its --config that need no device: the typed config, and its reward
  functions resolved (by name or import path), which it refuses only as it starts."""
  cfg = TrainConfig.from_config_dict(c)
  build.check_reward_functions(cfg)
  return cfg


# binary -> the typed conversion it applies to its --config
PARSERS = {
    "train_ppo": _train_config,
    "bench_decode": BenchDecodeConfig.from_config_dict,
    "reproduce_ablations": AblationConfig.from_config_dict,
    "schedule_search": PipelineProblem.from_config,
    "schedule_cp_check": PipelineProblem.from_config,
}


# (config, variant) -> the field a user must give it (the variant leaves it empty, refused by
# name) and a value to parse the rest with
NEEDS = {("ppo_hf", v): ("reward.model_checkpoint", "/models/my-rm") for v in (
    "reward_model", "grpo_reward_model", "ppo_gpu_reward_model", "grpo_gpu_reward_model")}


def _module(name):
  return importlib.import_module(f"configs.{name}")


def _binary(name):
  doc = _module(name).__doc__ or ""
  here = rf"--config=configs/{name}\.py"
  found = re.findall(rf"python -m experiments\.(\w+) {here}", doc)
  found += re.findall(rf"{here}\S* --binary=(\w+)", doc)  # sweeps name the binary they run
  found = [b for b in found if b != "sweep"]
  return found[0] if found else None


def _variants(name):
  doc = _module(name).__doc__ or ""
  return sorted(set(re.findall(rf"configs/{name}\.py:([\w/.-]+)", doc)))


def _parse(name, c):
  binary = _binary(name)
  assert isinstance(c, ml_collections.ConfigDict), f"configs/{name}.py get_config()"
  if binary in PARSERS:
    return PARSERS[binary](c)
  return c


def _flat_keys(d, prefix=""):
  for k, v in d.items():
    if isinstance(v, dict):
      yield from _flat_keys(v, f"{prefix}{k}.")
    else:
      yield prefix + k


def _override(c, dotted, value, where):
  node = c
  *path, leaf = dotted.split(".")
  for part in path:
    assert part in node and isinstance(node[part], ml_collections.ConfigDict), (
        f"{where}: {dotted!r} is not a field of the config")
    node = node[part]
  assert leaf in node and not isinstance(node[leaf], ml_collections.ConfigDict), (
      f"{where}: {dotted!r} is not a field of the config")
  node[leaf] = value  # ConfigDict refuses a value of another type, as the command line does


def test_every_config_names_its_binary():
  assert {"ppo_tiny", "ppo_llama", "bench_decode"} <= set(NAMES)
  for name in NAMES:
    assert _binary(name), f"configs/{name}.py: docstring has no 'python -m experiments.X " \
                          f"--config=configs/{name}.py' launch command"


@pytest.mark.parametrize("name", NAMES)
def test_get_config_and_documented_variants_parse(name):
  mod = _module(name)
  _parse(name, mod.get_config())
  for variant in _variants(name):
    c = mod.get_config(variant)
    if (name, variant) in NEEDS:
      field, value = NEEDS[name, variant]
      with pytest.raises(ValueError, match=rf"^config\.{re.escape(field)}=''"):
        _parse(name, c)
      _override(c, field, value, f"configs/{name}.py:{variant}")
    _parse(name, c)


@pytest.mark.parametrize(
    "name", [n for n in NAMES if inspect.signature(_module(n).get_config).parameters])
def test_unknown_variant_is_an_error(name):
  get_config = _module(name).get_config
  with pytest.raises(ValueError, match="variant"):
    get_config("no_such_variant")


@pytest.mark.parametrize("name", [n for n in NAMES if hasattr(_module(n), "get_sweep")])
def test_sweep_entries_override_existing_fields(name):
  mod = _module(name)
  sweep = mod.get_sweep()
  assert sweep, f"configs/{name}.py get_sweep() is empty"
  for i, entry in enumerate(sweep):
    c = mod.get_config()
    for key, value in entry.items():
      if key != "name":  # the run's name, not a field (experiments/sweep.py)
        _override(c, key, value, f"configs/{name}.py get_sweep()[{i}]")
    _parse(name, c)


def test_documented_variants_are_found():
  # A subset: a preset added to ppo_tiny's docstring is found too, and must not fail here.
  assert {"dr_grpo", "fused", "grpo"} <= set(_variants("ppo_tiny"))
  assert {"7b", "13b", "33b", "65b", "33b/13b", "65b/33b"} <= set(_variants("ppo_llama"))
  assert _binary("ppo_llama") == "train_ppo" and _binary("bench_decode") == "bench_decode"


# ----------------------------------------------------------------------- LLaMA-class configs
from configs import ppo_llama, ppo_tiny  # noqa: E402
from rlhfuse_jax.trainer import rollout as rollout_lib  # noqa: E402

SIZES = ["7b", "13b", "33b", "65b"]


@pytest.mark.parametrize("size", SIZES)
def test_llama_sizes_are_within_3_percent_of_nominal(size):
  cfg = TrainConfig.from_config_dict(ppo_llama.get_config(size))
  nominal = ppo_llama.SHAPES[size][-1]
  for model in (cfg.model, cfg.critic_model):
    assert abs(model.num_params() / nominal - 1) < 0.03, (size, model.head, model.num_params())
  assert cfg.critic_model.head == "scalar"
  # The same shapes as the simulator's presets (sim/shapes.py, same paper).
  ref = sim_shapes.get_shape(f"llama-{size}")
  for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads"):
    assert getattr(cfg.model, f) == getattr(ref, f) == getattr(cfg.critic_model, f), f
  assert cfg.model.num_params() == ref.num_params()


@pytest.mark.parametrize("variant", SIZES + ["33b/13b", "65b/33b"])
def test_llama_configs_are_bf16_paper_sized_and_fit_their_mesh(variant):
  cfg = TrainConfig.from_config_dict(ppo_llama.get_config(variant))
  actor, critic = ppo_llama.parse_variant(variant)
  assert cfg.model.num_layers == ppo_llama.SHAPES[actor][2]
  assert cfg.critic_model.num_layers == ppo_llama.SHAPES[critic][2]
  for m in (cfg.model, cfg.critic_model):
    assert m.param_dtype == m.dtype == "bfloat16"
  assert cfg.rollout.batch_size == 512 and cfg.algo.minibatch_size == 64
  assert 512 <= cfg.rollout.max_new_tokens <= 2048
  mesh = cfg.mesh
  for m in (cfg.model, cfg.critic_model):  # every sharded dimension divides evenly
    for dim in (m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size):
      assert dim % mesh.tensor == 0, (variant, dim, mesh)
    assert m.hidden_size % mesh.fsdp == 0
  replica = mesh.fsdp * mesh.stage * mesh.tensor
  assert replica >= 8  # "8 or more GPUs"
  assert mesh.resolve(replica)["data"] == 1
  # The batch splits over data x fsdp = devices / (stage * tensor), which must divide the
  # mini-batch: from one replica up to minibatch * stage * tensor devices.
  largest = cfg.algo.minibatch_size * mesh.stage * mesh.tensor
  for devices in (replica, largest):
    sizes = mesh.resolve(devices)
    assert cfg.algo.minibatch_size % (sizes["data"] * sizes["fsdp"]) == 0, (variant, devices)
    # Generation instances of `tensor` devices: the trainer's plan checks pass on these counts.
    assert (cfg.plan.generation, cfg.plan.generation_tp) == ("instances", mesh.tensor)
    rollout_lib.check_plan(cfg, devices)
  if actor != "7b":  # the RLHFuse paper's pairs (13B and up) on its 256 GPUs
    assert replica <= 256 <= largest
  with pytest.raises(ValueError, match="mesh"):
    mesh.resolve(replica + 1)


@pytest.mark.parametrize("pair", sorted(ppo_llama.FUSED_PLANS))
def test_llama_fused_presets_pipeline_the_paper_pairs_at_every_data_size(pair):
  """fused/<pair>: the preset's models on its pipelined plan with the searched fused schedule;
  one row per micro-batch (pipeline.*_microbatches = 0) keeps the pipelined update's checks
  passing from one replica (stage x tensor devices) up to the most data shards the critic's
  replicas allow, and the generation instances' plan alike."""
  import types
  from rlhfuse_jax.trainer import pipelined
  base = TrainConfig.from_config_dict(ppo_llama.get_config(pair))
  cfg = TrainConfig.from_config_dict(ppo_llama.get_config(f"fused/{pair}"))
  assert cfg.model == base.model and cfg.critic_model == base.critic_model
  stages, critic_stages, tensor = ppo_llama.FUSED_PLANS[pair]
  assert (cfg.mesh.stage, cfg.pipeline.critic_pp, cfg.mesh.tensor, cfg.mesh.fsdp) == (
      stages, critic_stages, tensor, 1)
  assert cfg.fusion.intra_stage and cfg.algo.minibatch_size == 64
  replicas = stages // critic_stages
  for data in (1, cfg.algo.minibatch_size // replicas):  # one replica .. 1 critic row per shard
    mesh = types.SimpleNamespace(shape={"data": data, "fsdp": 1, "stage": stages,
                                        "tensor": tensor})
    pipelined.check_config(cfg, mesh)
    rows = cfg.algo.minibatch_size // data
    p = pipelined.resolve_microbatches(cfg.pipeline, stages, rows)
    assert (p.actor_microbatches, p.critic_microbatches) == (rows, rows // replicas)
    rollout_lib.check_plan(cfg, data * stages * tensor)
  mesh.shape["data"] *= 2  # half a row per critic replica, or none per shard
  with pytest.raises(ValueError, match=(
      r"critic_microbatches=0 \(one row per micro-batch\) needs" if replicas > 1
      else "minibatch_size=64 must be at least the data-parallel size")):
    pipelined.check_config(cfg, mesh)
  with pytest.raises(ValueError, match="pipelined plans are those of the paper's pairs"):
    ppo_llama.get_config("fused/33b")


def test_llama_sweep_lengths_fit_the_context():
  c = ppo_llama.get_config()
  for entry in ppo_llama.get_sweep():
    assert c.data.max_prompt_len + entry["rollout.max_new_tokens"] <= c.model.max_seq_len
  assert sorted(e["rollout.max_new_tokens"] for e in ppo_llama.get_sweep()) == [512, 1024, 2048]


def test_llama_has_every_field_of_ppo_tiny():
  tiny = set(_flat_keys(ppo_tiny.get_config().to_dict()))
  for size in SIZES:
    keys = set(_flat_keys(ppo_llama.get_config(size).to_dict()))
    assert tiny <= keys
    # Extra fields only where the tiny config relies on ModelConfig defaults (critic dtypes).
    assert keys - tiny <= {"critic_model.param_dtype", "critic_model.dtype"}


def test_llama_bad_variants():
  for bad in ("70b", "13b/7b/7b", "13B"):
    with pytest.raises(ValueError, match="unknown variant"):
      ppo_llama.get_config(bad)


def test_ppo_hf_variants_have_one_name_each():
  """configs/ppo_hf.py's reward-model form of PPO is 'reward_model' (its docstring, docs/usage.md
  and docs/own_model.md list no other): 'ppo_reward_model' gave the same config under a second,
  undocumented name. Refused, the message naming the one to use; misspellings likewise."""
  from configs import ppo_hf
  for bad in ("ppo_reward_model", "gpu", "ppo_cpu", "reward_model_reward_model"):
    with pytest.raises(ValueError, match="unknown variant") as e:
      ppo_hf.get_config(bad)
    assert "'reward_model' (PPO's with a reward model)" in str(e.value), e.value
  assert set(_variants("ppo_hf")) == {"ppo_gpu", "grpo_gpu", "grpo", "reward_model",
                                      "grpo_reward_model", "ppo_gpu_reward_model",
                                      "grpo_gpu_reward_model"}


@pytest.mark.parametrize("variant", ["", "fused", "grpo"])
def test_every_ppo_tiny_sweep_entry_is_a_valid_run_of_its_variant(variant):
  """sweep --config=configs/ppo_tiny.py:VARIANT gives get_sweep the variant: every entry must be
  a run that variant's config accepts (for :fused, the README's main job, two of the four
  entries were critic-free estimators, which its fused actor/critic pipeline refuses; now its
  four fusion on/off pairs)."""
  from configs import ppo_tiny
  from rlhfuse_jax.trainer.config import TrainConfig
  sweep = ppo_tiny.get_sweep(variant)
  # Seeds x estimators; a variant's over seeds alone, with its own estimator (an empty sweep
  # passed here); fused's is the fusion ablation, its four on/off pairs.
  if variant == "fused":
    assert sorted((e["fusion.inter_stage"], e["fusion.intra_stage"]) for e in sweep) == sorted(
        (a, b) for a in (False, True) for b in (False, True))
    assert len({e["name"] for e in sweep}) == 4
  else:
    own = (ppo_tiny.get_config(variant) if variant else ppo_tiny.get_config()).algo.estimator
    assert sorted((e["algo.estimator"], e["seed"]) for e in sweep) == sorted(
        (est, seed) for est in ({own} if variant else {"gae", "reinforce_pp"}) for seed in (0, 1))
  for entry in sweep:
    c = ppo_tiny.get_config(variant) if variant else ppo_tiny.get_config()
    for key, value in entry.items():
      if key != "name":
        _override(c, key, value, f"get_sweep({variant!r})")
    TrainConfig.from_config_dict(c)


def test_schedule_search_workers_count_the_cores_this_process_may_use(monkeypatch):
  """configs/schedule_search.py runs one search worker per core, at most 2: the cores of this
  process's CPU affinity (taskset, a container's cpuset), not the machine's. Two workers on one
  allowed core split each one's wall-clock budget in half."""
  from configs import schedule_search
  monkeypatch.setattr(os, "cpu_count", lambda: 64)
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
  assert schedule_search.get_config().workers == 1
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
  assert schedule_search.get_config().workers == 2
