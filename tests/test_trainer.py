"""The PPO loop: sharded == single device, critic-free estimators, config errors. (Resume
exactness: tests/test_faults.py.)"""
import dataclasses
import json
import logging
import re
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import ppo_tiny
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer.config import TrainConfig
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES, _zero1_label


def tiny_config(**overrides):
  """ppo_tiny shrunk further so that a test iteration compiles and runs in seconds."""
  return with_overrides(tiny_config_dict(), **overrides)


def tiny_config_dict():
  """tiny_config's ConfigDict (what train_ppo records in config.json: config_lib.config_record)."""
  c = ppo_tiny.get_config()
  c.num_iterations = 4
  c.model.num_layers = 1
  c.critic_model.num_layers = 1
  c.model.hidden_size = c.critic_model.hidden_size = 32
  c.model.intermediate_size = c.critic_model.intermediate_size = 64
  c.rollout.prompts_per_iteration = 16
  c.rollout.max_new_tokens = 6
  c.rollout.chunk_size = 3
  c.algo.minibatch_size = 8
  c.data.num_prompts = 64
  c.checkpoint.every = 2
  return c


def with_overrides(c, **overrides) -> TrainConfig:
  """The TrainConfig of ConfigDict `c` with dotted-path overrides ("algo.epochs": 1)."""
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return TrainConfig.from_config_dict(c)


def record_rollouts(trainer) -> list:
  """Keeps (Prompts, StageOutputs) of every call of the trainer's rollout stage, in order."""
  stage, seen = trainer.rollout, []

  def recorded(params, prompts, key):
    seen.append((prompts, stage(params, prompts, key)))
    return seen[-1][1]
  trainer.rollout = recorded
  return seen


def _params(trainer):
  state = {"actor": trainer.actor.params}
  if trainer.critic is not None:
    state["critic"] = trainer.critic.params
  return jax.device_get(state)


def _deterministic(rows):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def _check_train_flops(cfg, seen, history):
  """perf/train_flops_per_s counts each sample at its own lengths (docs/architecture.md §1):
  per model 3 x forward, forward = S * (2 * layers * matmul weights per layer + 4 * layers *
  heads * head_dim * (S + 1) / 2) + R * 2 * hidden * head width, for S = prompt + response and R
  = response tokens; perf/train_useful_frac is that over the padded count. (No perf/mfu: a CPU
  has no known peak.)"""
  def forward(m, s, r):
    hd = m.head_dim_
    per_layer = (m.hidden_size * hd * (m.num_heads + 2 * m.num_kv_heads) +
                 m.num_heads * hd * m.hidden_size + 3 * m.hidden_size * m.intermediate_size)
    width = m.vocab_size if m.head == "lm" else 1
    return (s * (2 * m.num_layers * per_layer + 4 * m.num_layers * m.num_heads * hd * (s + 1) / 2)
            + r * 2 * m.hidden_size * width)
  models = [cfg.model, dataclasses.replace(cfg.critic_model, vocab_size=cfg.model.vocab_size,
                                           head="scalar")]
  for (_, out), h in zip(seen, history, strict=True):
    p, r = out.batch.prompt_lens.astype(float), out.rollout.response_lens.astype(float)
    want = cfg.algo.epochs * sum(3 * float(np.sum(forward(m, p + r, r))) for m in models)
    assert h["perf/train_flops_per_s"] * h["timing_s/train"] == pytest.approx(want, rel=1e-9)
    big_r = cfg.rollout.max_new_tokens
    big_p = out.batch.tokens.shape[1] - big_r
    padded = cfg.algo.epochs * sum(3 * len(r) * forward(m, big_p + big_r, big_r) for m in models)
    assert h["perf/train_useful_frac"] == pytest.approx(want / padded, rel=1e-9)
    assert h["perf/train_useful_frac"] < 0.95  # the tiny task's responses leave padding
    assert "perf/mfu" not in h


def test_mfu_is_reported_for_16_bit_models_only(monkeypatch):
  """perf/mfu divides by the device's dense bf16 peak: reported where that peak is known and
  the actor computes in bfloat16/float16, not for a float32 model (another peak)."""
  import types
  from rlhfuse_jax.sim import hardware
  from rlhfuse_jax.trainer import loop as loop_lib
  monkeypatch.setattr(hardware, "hardware_for_device_kind",
                      lambda kind: types.SimpleNamespace(peak_flops=1e12))
  gen = types.SimpleNamespace(prompt_lens=np.array([3, 4]), response_lens=np.array([2, 5]),
                              tokens=np.zeros((2, 8 + 6), np.int32))
  base = tiny_config()
  model = dataclasses.replace(base.model, vocab_size=16)
  got = {}
  for dtype in ("float32", "bfloat16"):
    cfg = dataclasses.replace(base, model=dataclasses.replace(model, dtype=dtype),
                              rollout=dataclasses.replace(base.rollout, max_new_tokens=6))
    fake = types.SimpleNamespace(cfg=cfg, use_critic=False, mesh=types.SimpleNamespace(
        devices=np.array([types.SimpleNamespace(device_kind="H100")] * 2)))
    got[dtype] = loop_lib.PPOTrainer._train_flops_metrics(fake, 2.0, gen)
  assert "perf/mfu" not in got["float32"]
  m = got["bfloat16"]
  assert m["perf/mfu"] == pytest.approx(m["perf/train_flops_per_s"] / (1e12 * 2))


@pytest.mark.parametrize("overrides, message", [
    ({"algo.minibatch_size": 5}, "algo.minibatch_size=5"),
    ({"algo.estimator": "grpo"}, "rollout.samples_per_prompt"),
    ({"fusion.migration_threshold": "1.5"}, "fusion.migration_threshold"),
    ({"fusion.migration_threshold": "sometimes"}, "fusion.migration_threshold"),
    ({"model.num_heads": 3}, "model.num_heads=3"),
    # (passed as even, then a TypeError traceback from the parameters' reshape in the set-up)
    ({"critic_model.head_dim": -2}, "config.critic_model.head_dim=-2: expected 0"),
    # RoPE's inverse frequencies inf or NaN, RMSNorm's rsqrt NaN: found only after compiling.
    ({"model.rope_theta": 0.0}, "config.model.rope_theta=0.0: expected a finite value > 0"),
    ({"critic_model.rms_norm_eps": -1e-06},
     "config.critic_model.rms_norm_eps=-1e-06: expected a finite value >= 0"),
    ({"rollout.temperature": 0.0}, "rollout.temperature"),
    # Finite but small enough that logits / temperature overflow float32: the draw took the
    # lowest positive logit's id, not the argmax, with a NaN log-prob.
    ({"rollout.temperature": 1e-38}, r"rollout.temperature=1e-38: expected a finite value >= "
                                     r"1e-06"),
    ({"data.length_dist": "zipf"}, "data.length_dist"),
    # Refused when the task was built, after the workdir was locked, naming no field.
    ({"data.length_sigma": -1.0}, "config.data.length_sigma=-1.0: expected a finite value > 0"),
    ({"data.length_mu": float("nan")}, "config.data.length_mu=nan: expected a finite value"),
    ({"rollout.chunk_size": 4, "rollout.steps_per_check": 3},
     "rollout.steps_per_check=3: expected a positive divisor of rollout.chunk_size=4"),
    ({"algo.kl_in_reward": False, "algo.kl_estimator": "k1"},
     "algo.kl_estimator='k1': expected 'k3'"),
    ({"algo.value_clip_eps": -0.1}, "algo.value_clip_eps=-0.1: expected a finite value >= 0"),
    ({"algo.clip_eps": 3.0}, r"algo.clip_eps=3.0: expected in \(0, 1\)"),
    ({"algo.clip_eps_high": -0.1}, r"algo.clip_eps_high=-0.1: expected 0 \(= algo.clip_eps\)"),
    ({"algo.clip_ratio_c": 0.5}, r"algo.clip_ratio_c=0.5: expected 0 \(dual clip off\) or"),
    # A dual-clip cap inside the clip range stopped negative-advantage tokens' gradients there.
    ({"algo.clip_ratio_c": 1.1}, r"algo.clip_ratio_c=1.1: expected 0 \(dual clip off\) or >= "
                                 r"the PPO clip's upper bound 1.2 \(1 \+ algo.clip_eps\)"),
    ({"algo.clip_ratio_c": 1.25, "algo.clip_eps_high": 0.28},
     r"algo.clip_ratio_c=1.25: expected 0 \(dual clip off\) or >= the PPO clip's upper "
     r"bound 1.28 \(1 \+ algo.clip_eps_high\)"),
    ({"algo.estimator": "gea"}, "algo.estimator='gea': expected one of"),
    ({"algo.kl_estimator": "k4"}, "algo.kl_estimator='k4': expected one of"),
    ({"algo.vf_coef": -1.0}, "algo.vf_coef=-1.0: expected a finite value >= 0"),
    ({"optim.actor_lr": float("inf")}, "optim.actor_lr=inf: expected a finite value > 0"),
    ({"optim.weight_decay": -0.1}, "optim.weight_decay=-0.1: expected a finite value >= 0"),
    ({"rollout.temperature": float("nan")}, "rollout.temperature=nan"),
    ({"log_every": 0}, "config.log_every=0: expected > 0"),
    # The fused schedule's search refused it in the set-up, as "seed=-1 must be >= 0".
    ({"pipeline.search_seed": -1}, "config.pipeline.search_seed=-1: expected >= 0"),
    # The schedule search never returned: the run hung before its first iteration.
    ({"pipeline.search_time_s": float("inf")},
     "config.pipeline.search_time_s=inf: expected a number of seconds > 0 and at most 86400"),
    ({"seed": -1}, "config.seed=-1: expected an integer in "),
    # 2**70 failed in jit, MLIR or numpy after the set-up began, or hung (num_layers).
    ({"model.num_layers": 2**70}, "config.model.num_layers=1180591620717411303424: expected an "
                                  "integer of at most 2147483647"),
    ({"pipeline.xla_opt_level": 4}, "config.pipeline.xla_opt_level=4: expected -1"),
    ({"pipeline.search_time_s": 2.0**70}, "config.pipeline.search_time_s=1.1805916207174113e"),
    # jax.random.key(2**32 + 5) is key(5): the models and samples of seed 5, silently.
    ({"seed": 2**32 + 5}, "config.seed=4294967301: expected an integer in "),
    ({"algo.loss_agg": "mean"}, "config.algo.loss_agg='mean': expected one of"),
    ({"guard.on_nonfinite": "ignore"}, "config.guard.on_nonfinite='ignore'"),
    ({"optim.offload_during_rollout": True, "async_ppo.staleness": 1},
     "optim.offload_during_rollout=True: expected False with async_ppo.staleness > 0"),
    ({"optim.offload_during_rollout": True, "async_ppo.generation_devices": 4},
     "or async_ppo.generation_devices > 0"),
    ({"algo.microbatch_size": -1}, "algo.microbatch_size=-1: expected an integer >= 0"),
    ({"algo.gradient_sync": "twice"}, "algo.gradient_sync='twice': expected one of"),
])
def test_bad_config_names_the_field(overrides, message):
  with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("*", r"\*")):
    tiny_config(**overrides)


@pytest.mark.parametrize("field, value", [("reward.stats", 5), ("algo.estimator", ["gae"]),
                                          ("plan.file", True), ("plan.file", 0),
                                          ("data.val_file", 5), ("model.dtype", None)])
def test_a_string_field_of_another_type_is_refused_by_name(field, value):
  """A plain dict (a sweep's, a plan file's: ml_collections types only its own overrides):
  a string field given a number or a list failed far away, naming nothing ("'int' object has
  no attribute 'split'", "unhashable type: 'list'"), or later in the set-up (val_file=5); and
  plan.file=True opened, then closed, file descriptor 1, the process's stdout."""
  d = ppo_tiny.get_config().to_dict()
  section, name = field.split(".")
  d[section][name] = value
  with pytest.raises(ValueError, match=re.escape(f"config.{field}={value!r}: expected a string")):
    TrainConfig.from_config_dict(d)


def test_a_dual_clip_cap_at_or_beyond_the_clip_range_is_accepted():
  """The dual clip caps ratios beyond the PPO clip; a cap at its upper bound changes no token
  the clip leaves in range, so it is accepted (below it is refused, above)."""
  from rlhfuse_jax.trainer.config import AlgoConfig
  assert AlgoConfig(clip_ratio_c=1.2).clip_ratio_c == 1.2
  assert AlgoConfig(clip_ratio_c=1.28, clip_eps_high=0.28).clip_ratio_c == 1.28
  assert AlgoConfig(clip_ratio_c=3.0, clip_eps_high=0.28).clip_ratio_c == 3.0


def test_integer_fields_refuse_floats_and_bools():
  """ml_collections refuses a float for an int field set on a ConfigDict, but a plain dict (a
  sweep's, a JSON plan's 2.0) and the dataclasses built directly reach the checks as given."""
  from rlhfuse_jax.trainer.config import AlgoConfig
  for field, value in (("epochs", 1.5), ("minibatch_size", 8.0), ("epochs", True)):
    with pytest.raises(ValueError, match=f"config.algo.{field}={value!r}: expected an integer"):
      AlgoConfig(**{field: value})
  for section, field, value in (("rollout", "max_new_tokens", 6.0), ("mesh", "data", 2.0),
                                ("model", "num_layers", 2.5), ("critic_model", "num_layers", 1.0),
                                ("checkpoint", "keep", False)):
    c = ppo_tiny.get_config().to_dict()
    c[section][field] = value
    with pytest.raises(ValueError, match=f"config.{section}.{field}={value!r}: expected an "
                                         "integer"):
      TrainConfig.from_config_dict(c)


@pytest.mark.parametrize("path,value,expected", [
    ("num_iterations", 2.5, "an integer"), ("seed", True, "an integer"),
    ("log_every", 1.5, "an integer"),
    # "False" is truthy: the KL would have gone into the reward, the opposite of what was asked.
    ("algo.kl_in_reward", "False", "True or False"),
    ("algo.whiten_advantages", None, "True or False"),
    ("algo.gamma", "0.9", "a number"), ("algo.kl_coef", True, "a number"),
])
def test_fields_of_the_wrong_type_are_refused_by_name(path, value, expected):
  """A plain dict (a sweep's, a plan file's) reaches TrainConfig without ml_collections' typed
  overrides: a wrong type is refused naming the field, not accepted or failing far away."""
  c = ppo_tiny.get_config().to_dict()
  *section, field = path.split(".")
  (c[section[0]] if section else c)[field] = value
  with pytest.raises(ValueError, match=f"config.{path}={value!r}: expected {expected}"):
    TrainConfig.from_config_dict(c)


@pytest.mark.parametrize("path, value, message", [
    ("mesh.data", -2, "config.mesh.data=-2; expected a positive size or -1"),
    ("critic_model.num_heads", 3, "config.critic_model.num_heads=3 must be a multiple of "
                                  "config.critic_model.num_kv_heads=2"),
    ("model.hidden_size", 66, "config.model.hidden_size=66 must be divisible by "
                              "config.model.num_heads=4 when config.model.head_dim is 0"),
])
def test_shared_classes_name_the_field_as_the_command_line_does(path, value, message):
  """MeshConfig and ModelConfig, shared beyond the trainer, name their fields without
  "config.", and a critic_model message named the actor's model.num_kv_heads."""
  c = ppo_tiny.get_config().to_dict()
  section, field = path.split(".")
  c[section][field] = value
  with pytest.raises(ValueError) as e:
    TrainConfig.from_config_dict(c)
  assert str(e.value).startswith(message), str(e.value)


def test_unknown_field_is_rejected():
  c = ppo_tiny.get_config().to_dict()
  c["algo"]["clip_epsilon"] = 0.1
  with pytest.raises(ValueError, match=r"config\.algo: unknown fields \['clip_epsilon'\]"):
    TrainConfig.from_config_dict(c)


def test_a_field_without_a_default_that_the_config_lacks_is_named():
  """seed, num_iterations and the models' shapes have no default: a config file without one
  ended in the dataclass's TypeError traceback, naming no config section."""
  c = ppo_tiny.get_config().to_dict()
  del c["seed"]
  with pytest.raises(ValueError, match=r"^config: missing fields \['seed'\]; expected a value "
                     r"for each \(they have no default: set config\.seed\)"):
    TrainConfig.from_config_dict(c)
  c = ppo_tiny.get_config().to_dict()
  del c["critic_model"]["num_layers"], c["critic_model"]["num_heads"]
  with pytest.raises(ValueError, match=r"^config\.critic_model: missing fields \['num_layers', "
                     r"'num_heads'\]; .*set config\.critic_model\.num_layers, "
                     r"config\.critic_model\.num_heads\)"):
    TrainConfig.from_config_dict(c)


def test_a_critic_vocabulary_beside_the_tokenizers_is_refused():
  """With model.vocab_size=0 (the tokenizer's) a critic_model.vocab_size of its own was
  replaced by the tokenizer's without a word; equal to a set model.vocab_size it is kept."""
  c = ppo_tiny.get_config().to_dict()
  c["critic_model"]["vocab_size"] = 999
  with pytest.raises(ValueError, match=r"^config\.critic_model\.vocab_size=999: expected 0 or "
                     r"unset with model\.vocab_size=0"):
    TrainConfig.from_config_dict(c)
  c["model"]["vocab_size"] = c["critic_model"]["vocab_size"] = 64
  assert TrainConfig.from_config_dict(c).with_vocab(40).critic_model.vocab_size == 64


@pytest.mark.parametrize("overrides, mesh_cfg, message", [
    ({"rollout.prompts_per_iteration": 12, "algo.minibatch_size": 12}, {"data": 8},
     r"config\.rollout\.prompts_per_iteration\*samples_per_prompt=12 must be a multiple of the "
     r"data-parallel size 8"),
    ({"model.max_seq_len": 10}, {"data": 8},
     r"max_new_tokens = 14 exceeds the max_seq_len=10 of config\.model:"),
    ({"critic_model.max_seq_len": 10}, {"data": 8}, r"max_seq_len=10 of config\.critic_model"),
    # Every model too short is named at once, with what to raise (raising the actor's alone
    # then failed on the critic's).
    ({"model.max_seq_len": 10, "critic_model.max_seq_len": 12}, {"data": 8},
     r"exceeds the max_seq_len=10 of config\.model and the max_seq_len=12 of "
     r"config\.critic_model: .*; raise config\.model\.max_seq_len and "
     r"config\.critic_model\.max_seq_len to at least 14"),
    # With a checkpoint the context is still the config's field, which the error names.
    ({"critic_model.max_seq_len": 10, "init.critic_checkpoint": os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_llama3")}, {"data": 8},
     r"max_seq_len=10 of config\.critic_model: a prompt"),
    ({"algo.estimator": "grpo", "rollout.samples_per_prompt": 2}, {"data": 4, "stage": 2},
     r"config\.algo\.estimator='grpo' trains no critic"),
    ({}, {"data": 4, "stage": 2}, r"config\.model\.num_layers=1 must be divisible by its "
     r"pipeline stages 2"),
    ({"pipeline.actor_microbatches": 3, "model.num_layers": 2, "critic_model.num_layers": 2},
     {"data": 4, "stage": 2}, r"config\.pipeline\.actor_microbatches=3 must divide"),
    ({"algo.minibatch_size": 16, "algo.microbatch_size": 3},
     {"data": 2, "fsdp": 2, "tensor": 2},
     r"config\.algo\.microbatch_size=3 must divide the mini-batch rows per data shard "
     r"\(algo\.minibatch_size=16 / mesh data\*fsdp=4 = 4\)"),
    ({"fusion.inter_stage": True, "fusion.instance_devices": 16}, {"data": 8},
     r"config\.fusion\.instance_devices=16 exceeds the 8 devices"),
    ({"fusion.inter_stage": True, "fusion.num_instances": 16}, {"data": 8},
     r"fusion\.num_instances=16 x fusion\.instance_devices=1 = 16 devices, but only 8 are "
     r"available"),
    ({"fusion.inter_stage": True, "fusion.slots": 1}, {"data": 8},
     r"config\.fusion\.slots=1: 16 samples dealt to num_instances=8 put 2 in one instance; "
     r"expected slots >= 2"),
])
def test_mesh_and_cross_section_errors_come_before_any_build(tmp_path, monkeypatch, overrides,
                                                            mesh_cfg, message):
  """trainer/validate.py: every check that needs the mesh or several sections runs on the
  resolved config before a model is initialised or a program compiled."""
  def no_build(*args, **kwargs):
    raise AssertionError("models were built before the config was validated")
  monkeypatch.setattr(build, "build_models", no_build)
  with pytest.raises(ValueError, match=message):
    PPOTrainer(tiny_config(**overrides), str(tmp_path),
               mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(**mesh_cfg)))


# Every registered critic-free estimator, read from the registry: a new one trains here without
# being listed (a hand-kept list left a new estimator's first run to its user).
@pytest.mark.parametrize("estimator", [n for n in adv_lib.ADVANTAGE_ESTIMATORS
                                       if not adv_lib.needs_critic(n)])
def test_critic_free_estimators_train_with_the_kl_loss_and_entropy_bonus(tmp_path, estimator):
  # Two iterations of each critic-free estimator with the KL as a loss term and an entropy
  # bonus: no critic is built or logged, the KL-loss branch runs, and the actor moves.
  cfg = tiny_config(**{"num_iterations": 2, "algo.estimator": estimator,
                       "rollout.samples_per_prompt": 2, "rollout.prompts_per_iteration": 8,
                       "algo.kl_in_reward": False, "algo.kl_coef": 0.1, "algo.kl_estimator": "k3",
                       "algo.entropy_coef": 0.01})
  trainer = PPOTrainer(cfg, str(tmp_path))
  before = jax.device_get(trainer.actor.params)
  history = trainer.run()
  assert trainer.critic is None
  assert [h["step"] for h in history] == [1, 2]
  for h in history:
    assert not any(k.startswith("critic/") for k in h)
    assert np.isfinite(h["actor/kl_loss"]) and np.isfinite(h["actor/entropy"])
    assert h["actor/entropy"] > 0
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(_params(trainer)["actor"]), jax.tree.leaves(before)))
  assert moved > 1e-4


@pytest.mark.parametrize("offload,estimator", [(False, "gae"), (True, "gae"), (False, "grpo")])
def test_the_update_compiles_once(tmp_path, offload, estimator):
  """On a one-device mesh too: the optimizer state's step counts start mesh-placed as the
  update returns them (trainer/update.init_optimizer_state), so iteration 2 reuses iteration 1's
  executable instead of compiling the update again; also when the optimizer state came back
  from host memory (optim.offload_during_rollout restores its shardings exactly), and without
  a critic (grpo: the critic's state is None, which left the update's out_shardings unset, so
  the actor came back as P('tensor', 'fsdp') and the second mini-batch compiled it again)."""
  group = {} if estimator == "gae" else {"rollout.samples_per_prompt": 2,
                                         "algo.kl_in_reward": False, "algo.kl_estimator": "k3"}
  cfg = tiny_config(num_iterations=2, **{"optim.offload_during_rollout": offload,
                                         "algo.estimator": estimator, **group})
  trainer = PPOTrainer(cfg, str(tmp_path),
                       mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1]))
  # (train_ppo's form: no rows kept in memory, all of them in metrics.jsonl)
  assert trainer.run(keep_history=False) == []
  assert [r["step"] for r in wd.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]
  # every placement's jitted update: a state that came back placed otherwise gets its own
  assert sum(f._cache_size() for f in trainer.update._fn._jitted.values()) == 1


@pytest.mark.parametrize("guard", ["stop", "skip_update"])
def test_an_iteration_reads_the_devices_twice_outside_the_rollout(tmp_path, monkeypatch, guard):
  """Host syncs outside the rollout stage: one read of the rollout statistics, and one of the
  updates' metrics with config.guard's per-model checks (parameters finite) and the models'
  LRs; "skip_update" reads the LRs apart, after the skipped steps they depend on. Each was a
  read of its own (4, or 6 under "skip_update", with a critic) besides implicit ones (bool of
  the finite check, float of each LR): each a stall of the accelerator. No implicit read (a
  device array's value outside to_host) is left there, and every read is of scalars: the
  advantages and returns [B, T] were read with the statistics and put back per mini-batch.
  (jax.transfer_guard does not see reads of CPU arrays: the reads are counted instead.)"""
  from jax._src import array as array_impl  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(num_iterations=2, **{"guard.on_nonfinite": guard})
  trainer = PPOTrainer(cfg, str(tmp_path),
                       mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1]))
  stage, where, reads, implicit = trainer.rollout, ["off"], [], []

  def rollout(*args, **kw):
    was, where[0] = where[0], "rollout"
    try:
      return stage(*args, **kw)
    finally:
      where[0] = was
  trainer.rollout = rollout
  to_host, value = mesh_lib.to_host, array_impl.ArrayImpl._value

  def counted(tree):
    if where[0] != "on":
      return to_host(tree)
    reads.append([np.shape(x) for x in jax.tree.leaves(tree)])
    where[0] = "to_host"
    try:
      return to_host(tree)
    finally:
      where[0] = "on"

  def read_value(x):
    if where[0] == "on":
      implicit.append(x.shape)
    return value.fget(x)
  monkeypatch.setattr(mesh_lib, "to_host", counted)
  monkeypatch.setattr(array_impl.ArrayImpl, "_value", property(read_value))
  iteration = trainer.iteration

  def watched(it):
    reads.clear()
    implicit.clear()
    where[0] = "on"
    try:
      out = iteration(it)
    finally:
      where[0] = "off"
    assert len(reads) == (2 if guard == "stop" else 3), (it, reads)
    # scalars only: the advantages and returns [B, T] stay on the devices for the mini-batches
    assert all(shape == () for read in reads for shape in read), (it, reads)
    assert not implicit, (it, implicit)
    return out
  trainer.iteration = watched
  history = trainer.run()
  assert [h["step"] for h in history] == [1, 2]
  assert ("guard/skipped_updates" in history[-1]) == (guard == "skip_update")
  # each model's LR at the iteration's last optimizer step (no step skipped)
  n = cfg.algo.epochs * cfg.rollout.batch_size // cfg.algo.minibatch_size
  for i, h in enumerate(history):
    assert h["actor/lr"] == float(trainer.update.actor_lr(n * (i + 1) - 1))
    assert h["critic/lr"] == float(trainer.update.critic_lr(n * (i + 1) - 1))


def test_each_mini_batch_gathers_its_rows_on_the_devices(tmp_path):
  """The rollout's training arrays go to the devices once an iteration; each mini-batch is
  gathered there (one program), batch-sharded as the update takes it, and holds exactly the
  rows of its indices. Each mini-batch used to put its rows from the host, array by array (8
  puts, the advantages and returns among them, read from the devices for it)."""
  trainer = PPOTrainer(tiny_config(num_iterations=1), str(tmp_path))  # data=8: 8 devices
  real_advantages, real_put = trainer._advantages, trainer._put
  host, puts, seen = {}, [], []

  def advantages(gen):
    data, stats = real_advantages(gen)
    host.update({k: np.asarray(v) for k, v in data.items()})
    return data, stats

  def put(x):
    puts.append(np.shape(x))
    return real_put(x)
  real_minibatch = trainer._minibatch

  def minibatch(data, idx):
    puts.clear()
    mb = real_minibatch(data, idx)
    seen.append((idx, mb, list(puts)))
    return mb
  trainer._advantages, trainer._put, trainer._minibatch = advantages, put, minibatch
  trainer.run()
  cfg = trainer.cfg
  assert len(seen) == cfg.algo.epochs * cfg.rollout.batch_size // cfg.algo.minibatch_size
  keys = {"tokens", "prompt_lens", "mask", "old_logp", "old_values", "ref_logp", "advantages",
          "returns"}
  for idx, mb, put_here in seen:
    assert put_here == [] and set(mb) == keys
    for k, v in mb.items():
      assert v.sharding == mesh_lib.batch_sharding(trainer.mesh, v.ndim), k
      np.testing.assert_array_equal(np.asarray(v), host[k][idx], err_msg=k)


def test_a_failed_rollout_leaves_the_offloaded_moments_on_the_devices(tmp_path):
  """optim.offload_during_rollout: a rollout that raises still brings both optimizer states
  back, each leaf placed exactly as before (what the update takes)."""
  cfg = tiny_config(num_iterations=1, **{"optim.offload_during_rollout": True})
  trainer = PPOTrainer(cfg, str(tmp_path),
                       mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1]))
  before = {m: jax.tree.map(lambda x: x.sharding, getattr(trainer, m).opt_state)
            for m in ("actor", "critic")}
  kinds = []

  def broken(params, prompts, key):
    kinds.append({x.sharding.memory_kind for m in ("actor", "critic")
                  for x in jax.tree.leaves(getattr(trainer, m).opt_state)})
    raise RuntimeError("generation failed")
  trainer.rollout = broken
  with pytest.raises(RuntimeError, match="generation failed"):
    trainer.iteration(0)
  assert kinds == [{mesh_lib.HOST_MEMORY}]
  for m in ("actor", "critic"):
    assert jax.tree.map(lambda x: x.sharding, getattr(trainer, m).opt_state) == before[m]


def test_clip_ratio_counts_only_responses_the_budget_cut_off():
  """A response that emits EOS as its last allowed token ended on its own: not clipped."""
  import types
  eos, max_new = 2, 3
  gen = types.SimpleNamespace(response_lens=np.array([3, 3, 1, 2]),
                              response_tokens=np.array([[5, 6, 7], [5, 6, eos], [eos, 0, 0],
                                                        [5, eos, 0]]))
  fake = types.SimpleNamespace(cfg=types.SimpleNamespace(
      rollout=types.SimpleNamespace(max_new_tokens=max_new)),
                               sampling=SamplingConfig(eos_id=eos, max_new_tokens=max_new))
  np.testing.assert_array_equal(PPOTrainer._truncated(fake, gen), [True, False, False, False])
  fake.sampling = SamplingConfig(eos_id=-1)  # no EOS: every full-length response was cut off
  np.testing.assert_array_equal(PPOTrainer._truncated(fake, gen), [True, True, False, False])
  fake.sampling = SamplingConfig(eos_id=9, extra_eos_ids=(eos,))  # any of several ends it
  np.testing.assert_array_equal(PPOTrainer._truncated(fake, gen), [True, False, False, False])


def test_a_uri_workdir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  """gs:// (or any URI) would become a local directory "gs:" on each host: refused by name."""
  from rlhfuse_jax import workdir as wd
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"--workdir='gs://bucket/run': a URI, but workdirs are "
                                       r"filesystem paths.*Cloud Storage FUSE"):
    PPOTrainer(tiny_config(), "gs://bucket/run")
  with pytest.raises(ValueError, match="a URI"):
    wd.write_config("s3://b/x", {"a": 1})
  assert os.listdir(tmp_path) == []


def test_a_reward_model_takes_the_runs_context_and_numerics(tmp_path, caplog):
  """Like the actor's checkpoint, the reward model's gets the run's max_seq_len, dtypes and
  attention: a Mistral-v0.1-style config (sliding window 4,096 < 32,768 positions) loads for a
  run whose context fits the window, instead of being refused with no field to fix it."""
  import json
  import shutil
  fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
  rm = str(tmp_path / "rm")
  shutil.copytree(os.path.join(fixtures, "tiny_mistral"), rm)
  with open(os.path.join(rm, "config.json")) as f:
    hf = json.load(f)
  hf["max_position_embeddings"] = 32768
  hf["sliding_window"] = 4096
  with open(os.path.join(rm, "config.json"), "w") as f:
    json.dump(hf, f)
  cfg = tiny_config(**{"reward.kind": "model", "reward.model_checkpoint": rm,
                       "model.dtype": "bfloat16", "model.attention": "reference"})
  # The fixture is a language model: no trained scalar head, refused (the loader would draw a
  # random one), before anything is built.
  with pytest.raises(ValueError, match=r"config\.reward\.model_checkpoint=.* has no trained "
                                       r"scalar head \(a tensor score\.weight / value_head\."
                                       r"weight / v_head\.summary\.weight\): a reward model"):
    build.reward_model_config(cfg)
  import safetensors.numpy
  weights = safetensors.numpy.load_file(os.path.join(rm, "model.safetensors"))
  weights["score.weight"] = np.zeros((1, hf["hidden_size"]), np.float32)
  safetensors.numpy.save_file(weights, os.path.join(rm, "model.safetensors"))
  got = build.reward_model_config(cfg)
  assert (got.head, got.max_seq_len, got.dtype, got.attention, got.remat) == (
      "scalar", cfg.model.max_seq_len, "bfloat16", "reference", "none")
  assert got.hidden_size == hf["hidden_size"] and got.num_layers == hf["num_hidden_layers"]
  # A score.bias: transformers' *ForSequenceClassification drops it, the run adds it (rewards a
  # constant apart from transformers' without a word): said.
  assert "score.bias" not in caplog.text
  weights["score.bias"] = np.full((1,), 5.0, np.float32)
  safetensors.numpy.save_file(weights, os.path.join(rm, "model.safetensors"))
  with caplog.at_level(logging.WARNING):
    build.reward_model_config(cfg)
  assert "has a score.bias, which transformers' *ForSequenceClassification ignores" in \
      caplog.text, caplog.text


def test_top_k_beyond_the_vocabulary_is_refused_before_anything_is_built():
  """The vocabulary is the tokenizer's, known once the config is resolved: validate names
  config.rollout.top_k (the sampler's own check came after the models were built and named a
  'sampling.top_k' the user never set)."""
  from rlhfuse_jax.trainer.validate import validate
  cfg = tiny_config(**{"rollout.top_k": 100000})
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  cfg = build.resolve_config(cfg, tokenizer)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  with pytest.raises(ValueError, match=rf"config\.rollout\.top_k=100000 exceeds the actor's "
                                       rf"vocabulary \(model\.vocab_size={tokenizer.vocab_size}\)"):
    validate(cfg, mesh)
  validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                top_k=tokenizer.vocab_size)), mesh)


def test_weights_trained_in_bfloat16_are_warned_about(caplog):
  """AdamW at a fine-tuning learning rate barely moves bfloat16 weights (its steps round away:
  1.9 % of them changed in 10 steps, all in float32), so validate warns for each trained model
  whose param_dtype is 16-bit, naming the field to set."""
  from rlhfuse_jax.rl import optim
  from rlhfuse_jax.trainer.validate import validate
  rng = np.random.default_rng(0)
  w = rng.normal(0, 0.02, (256, 256)).astype(np.float32)
  changed = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = optim.make_optimizer(1e-6, 0, 100)
    p = {"w": jnp.asarray(w, dtype)}
    state, q = tx.init(p), p
    for _ in range(10):
      u, state = tx.update({"w": jnp.asarray(rng.normal(size=w.shape), dtype)}, state, q)
      q = jax.tree.map(lambda a, b: a + b, q, u)
    changed[dtype] = float(jnp.mean(q["w"] != p["w"]))
  assert changed[jnp.float32] > 0.99 and changed[jnp.bfloat16] < 0.05, changed
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  for overrides, fields in (({}, []), ({"model.param_dtype": "bfloat16"}, ["model"]),
                            ({"model.param_dtype": "bfloat16",
                              "critic_model.param_dtype": "bfloat16"},
                             ["model", "critic_model"]),
                            ({"model.param_dtype": "bfloat16",
                              "critic_model.param_dtype": "bfloat16",
                              "optim.master_weights": True}, []),
                            ({"optim.master_weights": True}, [])):
    cfg = tiny_config(**overrides)
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      validate(build.resolve_config(cfg, tokenizer), mesh)
    assert [f for f in ("model", "critic_model")
            if f"config.{f}.param_dtype='bfloat16' trains the weights themselves" in caplog.text
            ] == fields, caplog.text
    if fields:  # the smallest step the message names is the one that changes bf16(0.02)
      t = float(re.search(r"magnitude 0\.02 only if lr > ([\d.e+-]+),", caplog.text).group(1))
      w = float(jnp.bfloat16(0.02))
      assert float(jnp.bfloat16(w + 0.98 * t)) == w and float(jnp.bfloat16(w - 0.98 * t)) == w
      assert float(jnp.bfloat16(w + 1.02 * t)) != w and float(jnp.bfloat16(w - 1.02 * t)) != w
    # A float32 copy of float32 weights is only memory: said, naming the model.
    wasted = "config.optim.master_weights=True with config.model.param_dtype='float32'"
    assert (wasted in caplog.text) == (overrides.get("optim.master_weights", False) and
                                       overrides.get("model.param_dtype") != "bfloat16")


def test_master_weights_train_bfloat16_weights_from_a_float32_copy(tmp_path, caplog):
  """optim.master_weights: the trainer's bfloat16 weights are, after every update, its
  optimizer's float32 copy rounded, for the actor and the critic. The set-up log says what a
  device holds: the copy and two float32 moments are 6x the bfloat16 weights."""
  cfg = tiny_config(num_iterations=2, **{"model.param_dtype": "bfloat16",
                                         "critic_model.param_dtype": "bfloat16",
                                         "optim.master_weights": True})
  with caplog.at_level(logging.INFO):
    trainer = PPOTrainer(cfg, str(tmp_path))
  for name in ("actor", "critic"):
    # (metrics.size: 3 significant digits in the unit that fits)
    line = re.search(rf"setup: {name} on .*: weights ([0-9.]+) ([kMGT]?B), optimizer state "
                     r"([0-9.]+) ([kMGT]?B) \(a float32 copy\)", caplog.text)
    assert line, caplog.text
    scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    weights, state = (float(line.group(i)) * scale[line.group(i + 1)] for i in (1, 3))
    assert weights > 0 and abs(state / weights - 6) < 0.05, (name, weights, state)
  trainer.run()
  for state in (trainer.actor, trainer.critic):
    master = state.opt_state.master
    assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    jax.tree.map(lambda p, m: np.testing.assert_array_equal(
        np.asarray(p), np.asarray(m.astype(jnp.bfloat16))), state.params, master)
  init = PPOTrainer(cfg, str(tmp_path / "fresh")).actor.params
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(trainer.actor.params)))


def test_bfloat16_old_logp_recomputed_by_the_training_forward(tmp_path):
  """algo.old_logp: in bfloat16 the decode and the training forward round apart, so the
  decode's log-probs as PPO's old log-probs put a ratio != 1 into the first step (one
  mini-batch, one epoch: the logged ppo_kl is the first step's). "auto" recomputes them with
  the actor's forward on the training devices: the first step's ratio is 1 exactly, and the
  gap the decode's would have brought is logged. float32 keeps the decode's (no extra pass)."""
  base = {"num_iterations": 1, "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
          "optim.master_weights": True, "model.num_layers": 2, "algo.epochs": 1,
          "algo.minibatch_size": 16, "algo.kl_coef": 0.0}
  out = {}
  for name, mode, micro in (("auto", "auto", 0), ("generation", "generation", 0),
                            ("micro", "auto", 1)):
    trainer = PPOTrainer(tiny_config(**base, **{"algo.old_logp": mode,
                                                "algo.microbatch_size": micro}),
                         str(tmp_path / name))
    trainer._start = 0
    out[name] = trainer.iteration(0)
    if name == "micro":  # scored in the update's micro-batches (1 row a data shard)
      assert trainer._old_logp_scorer.micro_batch_size == mesh_lib.batch_size_multiple(
          trainer._old_logp_scorer.mesh) < 16
  auto, gen = out["auto"], out["generation"]
  assert auto["actor/ppo_kl"] == 0.0 and auto["actor/pg_clipfrac"] == 0.0, auto
  assert out["micro"]["actor/ppo_kl"] == 0.0, out["micro"]
  assert 0 < auto["actor/old_logp_gap_mean"] <= auto["actor/old_logp_gap_max"], auto
  assert gen["actor/ppo_kl"] != 0.0 and "actor/old_logp_gap_mean" not in gen, gen
  fp32 = PPOTrainer(tiny_config(num_iterations=1), str(tmp_path / "fp32"))
  assert not fp32._recompute_old_logp
  # A pipelined update: "auto" leaves it the decode's (the pass would run the whole model, not
  # the staged program: no closer to the update's forward).
  staged = PPOTrainer(tiny_config(**{**base, "mesh.stage": 2, "critic_model.num_layers": 2}),
                      str(tmp_path / "staged"))
  assert not staged._recompute_old_logp
  with pytest.raises(ValueError, match=r"algo.old_logp.*'auto', 'generation', 'recompute'"):
    tiny_config(**{"algo.old_logp": "training"})
  with pytest.raises(ValueError, match=r"algo.old_logp=.?recompute.*async_ppo.staleness > 0"):
    tiny_config(**{"algo.old_logp": "recompute", "async_ppo.staleness": 1})


def test_a_bfloat16_checkpoint_from_before_old_logp_warns_that_auto_recomputes(tmp_path,
                                                                              caplog):
  """A checkpoint written before algo.old_logp existed lacks the field, which then counts as
  unchanged at its default, "auto"; for a 16-bit actor "auto" recomputes what that code took
  from the decode: the resume says so and how to continue as before."""
  over = {"num_iterations": 2, "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
          "optim.master_weights": True, "checkpoint.every": 1}
  PPOTrainer(tiny_config(**over), str(tmp_path)).run(stop_after=1)
  again = PPOTrainer(tiny_config(**over), str(tmp_path))
  restore = again.checkpoints.restore

  def older(*args, **kwargs):  # the side-car of a checkpoint written before the field
    start, state, meta = restore(*args, **kwargs)
    meta["config"].pop("algo.old_logp")
    return start, state, meta
  again.checkpoints.restore = older
  with caplog.at_level(logging.WARNING):
    again.run()
  assert ("resuming checkpoint 1, written before algo.old_logp existed" in caplog.text and
          "--config.algo.old_logp=generation continues as it did" in caplog.text), caplog.text


def test_the_set_up_log_says_what_zero1_split():
  """The label reads the placement: the axes the optimizer state is split over beyond the
  weights', or that there were none (data 1: zero1 then splits only leaves the other axes leave
  whole), instead of promising a split over data that did not happen."""
  for shape, want in (({"data": 2, "fsdp": 2, "tensor": 2}, "split over data (zero1)"),
                      ({"data": 1, "fsdp": 4, "tensor": 2},
                       "zero1: no data copies or replicas to split over")):
    mesh = jax.make_mesh(tuple(shape.values()), tuple(shape))
    w = jax.device_put(jnp.zeros((8, 4)), jax.sharding.NamedSharding(mesh, P("fsdp", "tensor")))
    gain = jax.device_put(jnp.zeros((4,)), jax.sharding.NamedSharding(mesh, P()))
    params = {"w": w, "gain": gain}
    state = {k: jax.device_put(x, mesh_lib.zero1_sharding(x.sharding, x.shape))
             for k, x in params.items()}
    assert _zero1_label(SimpleNamespace(params=params, opt_state=state)) == want, shape


def test_grpo_with_the_kl_in_the_reward_is_warned_about(caplog):
  """GRPO's std normalisation turns a tied group's KL penalties into advantages of about +-1
  whatever kl_coef is (the advantages here, then validate's warning); the KL as a loss does not
  reach the advantages."""
  from rlhfuse_jax.trainer.validate import validate
  tied = np.ones(8, np.float32)
  kl_sums = np.random.default_rng(0).normal(size=8).astype(np.float32)
  for coef in (0.02, 0.0002):
    adv, _ = adv_lib.grpo_advantages(jnp.asarray(tied - coef * kl_sums), jnp.ones((8, 1)), 8)
    assert np.abs(np.asarray(adv)).max() > 0.9, (coef, adv)
  overrides = {"algo.estimator": "grpo", "rollout.samples_per_prompt": 4, "algo.kl_coef": 0.02}
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  for kl_in_reward, warned in ((True, True), (False, False)):
    cfg = tiny_config(**overrides, **{"algo.kl_in_reward": kl_in_reward,
                                      "algo.kl_estimator": "k3"})
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      validate(build.resolve_config(cfg, tokenizer), mesh)
    assert ("divides each group's scores by their std" in caplog.text) == warned
  # Keyed on the registry's group_std, not the name: dr_grpo (no std) is not warned about.
  for estimator, agg, half in (("dr_grpo", "token-mean", True),
                               ("dr_grpo", "seq-mean-token-sum-norm", False)):
    cfg = tiny_config(**{**overrides, "algo.estimator": estimator, "algo.loss_agg": agg})
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      validate(build.resolve_config(cfg, tokenizer), mesh)
    assert "divides each group's scores by their std" not in caplog.text
    assert ("is half of Dr. GRPO" in caplog.text) == half, caplog.text


def test_a_warmup_longer_than_the_schedule_is_warned_about(caplog):
  """min(warmup, steps - 1) kept the rate rising to the last step and never decaying, silently."""
  from rlhfuse_jax.trainer import update as update_lib
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  # (2 or 4 iterations) x 2 epochs x 2 mini-batches: 8 or 16 optimizer steps.
  for warmup, warned in ((16, True), (15, False)):
    cfg = tiny_config(**{"optim.warmup_steps": warmup, "algo.epochs": 2})
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      update_lib.make_update(build.resolve_config(cfg, tokenizer), mesh, use_critic=True,
                             schedule_iterations=2 if warmup == 16 else 4)
    assert (f"config.optim.warmup_steps={warmup} covers all" in caplog.text) == warned, (
        caplog.text)


def test_the_warmup_warning_counts_in_the_singular_where_there_is_one(caplog):
  """A one-iteration schedule of one update was warned of as "all 1 optimizer steps of the
  schedule (1 iterations x 1 updates)"."""
  from rlhfuse_jax.trainer import update as update_lib
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  for iterations, epochs, said in (
      (1, 1, "covers all 1 optimizer step of the schedule (1 iteration x 1 update)"),
      (2, 2, "covers all 8 optimizer steps of the schedule (2 iterations x 4 updates)")):
    cfg = tiny_config(**{"optim.warmup_steps": 16, "algo.epochs": epochs,
                         "algo.minibatch_size": 16 if epochs == 1 else 8})
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      update_lib.make_update(build.resolve_config(cfg, tokenizer), mesh, use_critic=True,
                             schedule_iterations=iterations)
    assert f"config.optim.warmup_steps=16 {said}:" in caplog.text, caplog.text


def test_the_update_steps_each_model_at_its_own_rate_on_the_schedule():
  """make_update's learning rates, by the documented formula: linear warm-up over
  optim.warmup_steps optimizer steps, then a cosine to min_lr_ratio over schedule_iterations x
  epochs x mini-batches steps (capped to end the warm-up at the last step); the critic's AdamW
  at optim.critic_lr, the actor's at optim.actor_lr. A schedule over the wrong number of steps
  or a critic stepped at the actor's rate trains on, silently."""
  from rlhfuse_jax.trainer import update as update_lib
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))

  def make(warmup, iterations):  # iterations x 2 epochs x 2 mini-batches optimizer steps
    cfg = tiny_config(**{"optim.warmup_steps": warmup, "algo.epochs": 2, "optim.actor_lr": 1e-3,
                         "optim.critic_lr": 3e-3, "optim.min_lr_ratio": 0.1})
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    return update_lib.make_update(build.resolve_config(cfg, tokenizer), mesh, use_critic=True,
                                  schedule_iterations=iterations)
  upd = make(4, 4)  # 16 steps: 4 of warm-up, a cosine over 12
  peak, end = 1e-3, 1e-4
  lrs = np.asarray(upd.actor_lr(jnp.arange(21)))  # one call: eager dispatch is slow here
  for step, want in ((0, 0.0), (2, peak / 2), (4, peak), (10, (peak + end) / 2), (16, end),
                     (20, end)):
    assert lrs[step] == pytest.approx(want, rel=1e-5, abs=1e-12), step
  # Adam's step t on a constant gradient is -lr(t) * sign(g) (a vector: not decayed), at each
  # model's own peak and floor: 0, a quarter, the peak, halfway down, the floor.
  g = {"b": jnp.array([1.0, -2.0, 3.0])}

  @jax.jit  # one program for both models: eager dispatch and compiles are slow here
  def steps(params):
    def run(tx):
      def one(state, _):
        step, state = tx.update(g, state, params)
        return state, step["b"]
      return jax.lax.scan(one, tx.init(params), None, length=17)[1]
    return {model: run(upd._txs[model]) for model in ("actor", "critic")}
  got = steps({"b": jnp.zeros(3)})
  for model, lr in (("actor", 1e-3), ("critic", 3e-3)):
    for t, frac in ((0, 0.0), (1, 0.25), (4, 1.0), (10, 0.55), (16, 0.1)):
      np.testing.assert_allclose(got[model][t], -lr * frac * np.sign(g["b"]), rtol=1e-5,
                                 atol=1e-12, err_msg=f"{model} step {t}")
  # A warm-up longer than the 8 steps ends at the last one: the peak there, the floor after.
  upd = make(16, 2)
  np.testing.assert_allclose(upd.actor_lr(jnp.arange(7, 9)), [peak, end], rtol=1e-5)


def _validate_warnings(caplog, overrides: dict, mesh_cfg=mesh_lib.MeshConfig(data=8),
                       given=()) -> str:
  """The WARNING lines validate() logs for tiny_config(**overrides) on a mesh of `mesh_cfg`,
  the command line having set the fields `given`."""
  from rlhfuse_jax.trainer.validate import validate
  cfg = tiny_config(**overrides)
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    validate(build.resolve_config(cfg, tokenizer), mesh_lib.make_mesh(mesh_cfg), given=given)
  return caplog.text


def test_pipeline_fields_on_an_unpipelined_mesh_are_warned_about(caplog):
  """pipeline.* only applies with mesh.stage > 1: set on a one-stage mesh they were ignored
  without a word."""
  for overrides, warned in (({"pipeline.critic_pp": 3, "pipeline.actor_microbatches": 2}, True),
                            ({}, False)):
    text = _validate_warnings(caplog, overrides)
    assert ("config.pipeline.critic_pp=3, config.pipeline.actor_microbatches=2 not used: "
            "mesh.stage=1" in text) == warned, text


@pytest.mark.parametrize("intra_stage", [False, True])
def test_schedule_search_fields_of_a_serial_pipeline_are_warned_about(caplog, intra_stage):
  """On a pipelined mesh without fusion.intra_stage the update runs serial 1F1B: the fused
  schedule's search budget, seed and cache were ignored without a word."""
  text = _validate_warnings(caplog, {
      "model.num_layers": 2, "critic_model.num_layers": 2, "pipeline.actor_microbatches": 2,
      "pipeline.critic_microbatches": 2, "pipeline.search_time_s": 5.0,
      "pipeline.search_seed": 3, "fusion.intra_stage": intra_stage, "mesh.data": 4,
      "mesh.stage": 2},
      mesh_lib.MeshConfig(data=4, stage=2))
  assert ("config.pipeline.search_time_s=5.0, config.pipeline.search_seed=3 not used: "
          "fusion.intra_stage=False runs serial 1F1B" in text) != intra_stage, text


@pytest.mark.parametrize("tensor, warned", [(8, True), (2, False)])
def test_a_tensor_axis_that_does_not_divide_the_heads_is_warned_about(caplog, tensor, warned):
  """mesh.tensor=8 with 4 query heads ran without a word (INFO only): the devices cannot each
  take whole heads, so part of the attention is repeated or resharded instead of split."""
  text = _validate_warnings(caplog, {}, mesh_lib.MeshConfig(data=8 // tensor, tensor=tensor))
  assert ("config.mesh.tensor=8 does not divide config.model.num_heads=4: the 8 tensor "
          "devices cannot each take whole heads" in text) == warned, text
  assert ("config.critic_model.num_heads=4" in text) == warned, text


@pytest.mark.parametrize("overrides, warned", [
    ({"fusion.num_instances": 4, "fusion.migration_threshold": "0.5"},
     "config.fusion.num_instances=4, config.fusion.migration_threshold=0.5 not used: "
     "config.fusion.inter_stage=False"),
    # The baseline instances (plan.generation='instances' alone) never consolidate.
    ({"plan.generation": "instances", "fusion.max_consolidations": 2,
      "fusion.migration_threshold": "0.5", "fusion.inference_micro_batch": 2},
     "config.fusion.migration_threshold=0.5, config.fusion.max_consolidations=2 not used: "
     "plan.generation='instances' without fusion.inter_stage"),
    ({"plan.generation": "instances", "fusion.inter_stage": True,
      "fusion.max_consolidations": 2, "fusion.migration_threshold": "0.5"}, None),
    ({"reward.model_checkpoint": "/models/rm"},
     "config.reward.model_checkpoint='/models/rm' not used: reward.kind='function' loads no "
     "reward model"),
    # OpenRLHF's reward normalisation switched off beside a reward function: nothing to switch.
    ({"reward.model_normalize": "off"},
     "config.reward.model_normalize='off' not used: reward.kind='function' loads no reward "
     "model"),
    ({"reward.format_weight": 3.0},
     "config.reward.format_weight=3.0 not used: no reward.format to weigh"),
    ({"data.val_max_prompts": 5}, "config.data.val_max_prompts=5 not used: no held-out prompts"),
    ({"data.val_fraction": 0.25, "data.val_max_prompts": 5},
     "config.data.val_fraction=0.25, config.data.val_max_prompts=5 not used: eval_every=0 runs "
     "no validation pass"),
    ({"data.val_fraction": 0.25, "eval_every": 2}, None),
    ({"data.prompts_file": "p.jsonl", "data.length_dist": "lognormal"},
     "config.data.num_prompts=64, config.data.length_dist='lognormal' not used: "
     "data.prompts_file='p.jsonl' gives the prompts"),
    ({"guard.max_consecutive_skips": 3},
     "config.guard.max_consecutive_skips=3 not used: guard.on_nonfinite='stop' skips no step"),
    ({"guard.max_consecutive_skips": 3, "guard.on_nonfinite": "skip_update"}, None),
    ({"data.prompt_key": "question"}, "config.data.prompt_key='question' not used: they name "
     "the fields of a data.prompts_file or data.val_file's rows"),
    ({"data.prompt_key": "question", "data.val_file": "v.jsonl", "eval_every": 2}, None),
    # Without init.tokenizer the task's vocabulary, the run's tokenizer, holds length_max counts
    # (tiny_config's num_prompts=64 at the default here).
    ({"data.prompts_file": "p.jsonl", "data.num_prompts": 4096, "data.length_max": 11}, None),
    # The pipelined engine tests for finished rows once per chunk, whatever steps_per_check.
    ({"plan.generation": "pipeline", "rollout.steps_per_check": 3},
     "config.rollout.steps_per_check=3 not used: plan.generation='pipeline' tests for finished "
     "rows once per decode chunk"),
    ({"rollout.steps_per_check": 3}, None),
    ({"algo.gradient_sync": "once"},
     "config.algo.gradient_sync='once' not used: it applies to accumulated gradients"),
    ({"algo.gradient_sync": "once", "algo.microbatch_size": 8},
     "config.algo.gradient_sync='once' not used: it applies to accumulated gradients"),
    ({"algo.gradient_sync": "once", "algo.microbatch_size": 1, "algo.minibatch_size": 16}, None),
    # GRPO's KL switches beside kl_coef=0 (DAPO's setting) steered nothing, without a word.
    ({"algo.kl_coef": 0.0, "algo.kl_in_reward": False, "algo.kl_estimator": "k3"},
     "config.algo.kl_estimator='k3', config.algo.kl_in_reward=False not used: algo.kl_coef=0 "
     "puts no KL to the reference in the reward or the loss"),
    ({"algo.kl_in_reward": False, "algo.kl_estimator": "k3"}, None),
    ({}, None),
])
def test_fusion_and_reward_fields_a_run_does_not_read_are_warned_about(caplog, overrides,
                                                                        warned):
  """Inter-stage fusion fields without fusion.inter_stage, a reward model's checkpoint without
  reward.kind='model', a format weight without a format, a cap on held-out prompts without
  any, held-out prompts without a validation pass, algo.gradient_sync='once' without
  micro-batches to accumulate, the task's prompt count and lengths beside a prompts file and
  the KL's estimator and placement without a KL coefficient were ignored without a word."""
  text = _validate_warnings(caplog, overrides)
  if warned:
    assert warned in text, text
  else:
    assert "not used" not in text, text


def test_a_format_weight_the_command_line_left_without_its_format_is_not_warned_of(caplog):
  """configs/ppo_hf.py sets reward.format_weight=0.1 beside its gsm8k_format: clearing the
  format with --config.reward.format='' was warned of as leaving config.reward.format_weight=0.1
  unused, a value the user never set. A weight the command line sets without a format, or a
  config file's weight beside no format of its own, still is."""
  said = "config.reward.format_weight=0.1 not used: no reward.format to weigh"
  for given, warned in (((), True), (("reward.format",), False),
                        (("reward.format", "reward.format_weight"), True),
                        (("reward.format_weight",), True), (("seed",), True)):
    text = _validate_warnings(caplog, {"reward.format_weight": 0.1}, given=given)
    assert (said in text) == warned, (given, text)
  # A format kept: its weight is used whatever the command line set.
  text = _validate_warnings(caplog, {"reward.format": "boxed_format",
                                     "reward.format_weight": 0.1}, given=("reward.format",))
  assert "not used" not in text, text


def test_held_out_fields_beside_an_evaluation_the_command_line_turned_off(caplog, tmp_path):
  """configs/ppo_hf.py sets data.val_file and data.val_max_prompts beside eval_every=25:
  --config.eval_every=0 was warned of as leaving them unused, values the user never set. Those
  the command line set, or a config file's beside its own eval_every=0, still are; and
  data.val_fraction whoever set it (it still holds its prompts out of training)."""
  val = tmp_path / "val.jsonl"
  val.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "target": str(i + 1)}) + "\n"
                         for i in range(4)))
  preset = {"data.val_file": str(val), "data.val_max_prompts": 5, "eval_every": 0}
  said = {"val_file": f"config.data.val_file={str(val)!r}",
          "val_max_prompts": "config.data.val_max_prompts=5"}
  for given, warned in (((), ("val_file", "val_max_prompts")), (("eval_every",), ()),
                        (("eval_every", "data.val_max_prompts"), ("val_max_prompts",)),
                        (("data.val_file",), ("val_file", "val_max_prompts"))):
    text = _validate_warnings(caplog, preset, given=given)
    assert ("eval_every=0 runs no validation pass" in text) == bool(warned), (given, text)
    for field, line in said.items():
      assert (line in text) == (field in warned), (given, field, text)
  text = _validate_warnings(caplog, {"data.val_fraction": 0.25, "eval_every": 0},
                            given=("eval_every",))
  assert "config.data.val_fraction=0.25 not used: eval_every=0" in text, text


def test_a_discount_an_estimator_does_not_take_is_warned_about(caplog, monkeypatch):
  """algo.gamma beside an estimator that takes no gamma (read from its registry entry, not from
  group_size: a batch-mean baseline on the scores alone, registered as docs/architecture.md §8
  says, ignored a gamma of 0.5 without a word)."""
  import jax.numpy as jnp

  def batch_centred(scores, mask):
    adv = jnp.where(mask > 0, (scores - jnp.mean(scores))[:, None], 0.0)
    return adv, adv
  monkeypatch.setitem(adv_lib.ADVANTAGE_ESTIMATORS, "batch_centred", adv_lib.AdvantageEstimator(
      batch_centred, ("scores", "mask"), False, "new"))
  text = _validate_warnings(caplog, {"algo.estimator": "batch_centred", "algo.gamma": 0.5})
  assert "config.algo.gamma=0.5 not used: algo.estimator='batch_centred'" in text, text
  text = _validate_warnings(caplog, {"algo.estimator": "reinforce_pp", "algo.gamma": 0.5})
  assert "algo.gamma" not in text, text
  # A critic-free estimator that takes lam (a lambda-return of the token rewards with no
  # values) reads it: warned of as ignoring it, as every critic-free estimator was.

  def lambda_returns(token_rewards, mask, gamma, lam):
    return adv_lib.gae(token_rewards, jnp.zeros_like(token_rewards), mask, gamma, lam)
  monkeypatch.setitem(adv_lib.ADVANTAGE_ESTIMATORS, "lambda_returns", adv_lib.AdvantageEstimator(
      lambda_returns, ("token_rewards", "mask", "gamma", "lam"), False, "new"))
  text = _validate_warnings(caplog, {"algo.estimator": "lambda_returns", "algo.lam": 0.9,
                                     "algo.vf_coef": 1.0})
  assert "config.algo.vf_coef=1.0 not used: algo.estimator='lambda_returns'" in text, text
  assert "algo.lam" not in text, text


def test_critic_settings_of_a_critic_free_run_are_warned_about(caplog):
  """A critic-free estimator ignores the critic's settings (and grpo/rloo the discount): a
  critic checkpoint or lambda set away from the defaults were ignored without a word. The
  critic-free presets set none of them."""
  from configs import grpo_tiny
  from rlhfuse_jax.trainer.validate import validate
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  grpo = {"algo.estimator": "grpo", "rollout.samples_per_prompt": 4, "algo.kl_in_reward": False,
          "algo.kl_estimator": "k3"}
  for overrides, warned in (
      ({**grpo, "algo.lam": 0.9, "algo.gamma": 0.99},
       "config.algo.lam=0.9, config.algo.gamma=0.99 not used: algo.estimator='grpo' trains no "
       "critic"),
      ({"algo.estimator": "reinforce_pp", "algo.gamma": 0.99, "algo.vf_coef": 1.0},
       "config.algo.vf_coef=1.0 not used: algo.estimator='reinforce_pp'"),
      (grpo, None), ({"algo.lam": 0.9}, None)):
    cfg = tiny_config(**overrides)
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      validate(build.resolve_config(cfg, tokenizer), mesh)
    if warned:
      assert warned in caplog.text, caplog.text
    else:
      assert "trains no critic" not in caplog.text, caplog.text
  from configs import ppo_hf
  from rlhfuse_jax.trainer.validate import _critic_free_unused, _reward_unused
  # A verifier left in the config of a run a reward model scores is said to be unused.
  model = {"reward.kind": "model", "reward.model_checkpoint": "/models/rm"}
  assert _reward_unused(tiny_config(**model, **{"reward.function": "gsm8k"})) == [
      "reward.function='gsm8k'"]
  assert _reward_unused(tiny_config(**model)) == []
  assert _reward_unused(tiny_config(**{"reward.function": "gsm8k"})) == []
  # An empty function clears a preset's (ppo_hf's gsm8k): it was warned of as unused.
  assert _reward_unused(tiny_config(**model, **{"reward.function": ""})) == []
  for preset in (grpo_tiny.get_config(), ppo_hf.get_config("grpo"),
                 ppo_hf.get_config("grpo_gpu")):
    assert _critic_free_unused(TrainConfig.from_config_dict(preset)) == []


def test_a_scalar_head_checkpoint_is_refused_as_the_actor(tmp_path):
  """A *ForSequenceClassification (a reward model's directory) as init.actor_checkpoint was
  accepted by validate and failed in the build asking for an rng."""
  import json
  import shutil
  llama = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_llama3")
  rm = str(tmp_path / "rm")
  shutil.copytree(llama, rm)
  with open(os.path.join(rm, "config.json")) as f:
    hf = json.load(f)
  hf["architectures"] = ["LlamaForSequenceClassification"]
  with open(os.path.join(rm, "config.json"), "w") as f:
    json.dump(hf, f)
  cfg = tiny_config(**{"init.actor_checkpoint": rm,
                       "init.tokenizer": os.path.join(rm, "tokenizer.json")})
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  with pytest.raises(ValueError, match=r"config\.init\.actor_checkpoint=.* is a "
                                       r"\*ForSequenceClassification"):
    build.resolve_config(cfg, tokenizer)


def test_a_checkpoint_without_its_tokenizer_is_refused():
  """init.actor_checkpoint with init.tokenizer empty would pair a real model with the task's
  word-level vocabulary (smaller, so no other check objects): refused, naming the field and
  the checkpoint's own tokenizer.json."""
  llama = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_llama3")
  cfg = tiny_config(**{"init.actor_checkpoint": llama})
  with pytest.raises(ValueError, match=r"config\.init\.tokenizer is empty but config\.init\."
                                       r"actor_checkpoint=.*set config\.init\.tokenizer to its "
                                       r"own, '.*tiny_llama3/tokenizer\.json'"):
    build.build_task_and_tokenizer(cfg)
  tok = os.path.join(llama, "tokenizer.json")
  _, tokenizer = build.build_task_and_tokenizer(tiny_config(**{"init.actor_checkpoint": llama,
                                                               "init.tokenizer": tok}))
  assert tokenizer.vocab_size > 22


@pytest.mark.parametrize("field", ["init.tokenizer", "data.prompts_file", "data.val_file",
                                   "init.actor_checkpoint", "init.critic_checkpoint",
                                   "reward.model_checkpoint"])
def test_a_missing_file_names_its_field(field, tmp_path):
  """A path that does not exist is named by the field that gave it (a validation file's error
  read 'prompts file not found', a checkpoint's only '<path>/config.json not found')."""
  missing = str(tmp_path / "nope")
  extra = {"reward.kind": "model"} if field == "reward.model_checkpoint" else {}
  cfg = tiny_config(**{field: missing, **extra})
  with pytest.raises(FileNotFoundError, match=rf"config\.{field}='{missing}': "):
    task, tokenizer = build.build_task_and_tokenizer(cfg)
    build.load_prompt_records(cfg, task)
    build.resolve_config(cfg, tokenizer)
    build.reward_model_config(cfg)


@pytest.mark.parametrize("field, name, text", [
    ("data.prompts_file", "empty.jsonl", ""),
    ("data.prompts_file", "bad.jsonl", '{"prompt": "a", "target": "b"}\n{bad\n'),
    ("data.val_file", "cols.jsonl", '{"question": "a", "target": "b"}\n'),
    ("init.tokenizer", "tokenizer.json", "{not json"),
    ("init.actor_checkpoint", "config.json", '{"model_type": "llama"'),
])
def test_a_file_that_cannot_be_read_names_its_field(field, name, text, tmp_path):
  """A file that is there but empty, not JSON or without the expected column is named by the
  field that gave it too: the error named the path alone ("bad.jsonl:2: invalid JSON"), and a
  run reads several files."""
  target = tmp_path / name
  target.write_text(text)
  path = str(tmp_path if field == "init.actor_checkpoint" else target)
  extra = {"eval_every": 1} if field == "data.val_file" else {}
  if field == "init.actor_checkpoint":
    extra = {"init.tokenizer": os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "fixtures", "tiny_llama3", "tokenizer.json")}
  cfg = tiny_config(**{field: path, **extra})
  with pytest.raises(ValueError, match=rf"^config\.{field}='{path}': {tmp_path}"):
    task, tokenizer = build.build_task_and_tokenizer(cfg)
    build.load_prompt_records(cfg, task)
    build.resolve_config(cfg, tokenizer)


@pytest.mark.parametrize("row, missing", [('{"question": "a", "answer": "#### 1"}', "prompt"),
                                          ('{"prompt": "a", "answer": "#### 1"}', "answer")])
def test_a_val_file_with_other_keys_says_to_rename_them_not_to_change_the_key(row, missing,
                                                                              tmp_path):
  """A held-out file is read with the training file's keys: its missing field said "set
  config.data.prompt_key to the field that holds the prompt", which would break the training
  file the run had just read with that key."""
  train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
  train.write_text('{"prompt": "b", "gt": "#### 2"}\n')
  val.write_text(row + "\n")
  cfg = tiny_config(**{"data.prompts_file": str(train), "data.val_file": str(val),
                       "data.answer_key": "gt", "reward.function": "gsm8k", "eval_every": 1})
  task, _ = build.build_task_and_tokenizer(cfg)
  with pytest.raises(ValueError, match=rf"val\.jsonl:1: missing {missing} field .*read with the "
                     r"keys of config\.data\.prompts_file \(config\.data\.prompt_key='prompt', "
                     r"config\.data\.answer_key='gt'\): give its rows the same field names, "
                     # A preset's held-out file kept beside the user's prompts (configs/ppo_hf.py
                     # with only data.prompts_file replaced) is not to be renamed: replace it.
                     r"or, if it is not your held-out file \(a preset's own, such as "
                     r"configs/ppo_hf\.py's, is read unless replaced\), point "
                     r"config\.data\.val_file at yours \(\'\' for none\)$") as e:
    build.load_prompt_records(cfg, task)
  assert "set config.data" not in str(e.value)


def test_samples_are_written_as_text_once_per_logged_iteration_across_a_resume(tmp_path):
  """config.log_samples=k: every log_every iterations and after the last, the batch's first k
  samples as text in samples.jsonl (a user had no way to see what the policy writes). A resume
  drops rows after its checkpoint, as metrics.jsonl's, so each logged step's rows appear once."""
  from rlhfuse_jax import workdir as wdlib
  run = str(tmp_path / "run")
  cfg = tiny_config(**{"num_iterations": 3, "log_samples": 2, "log_every": 2})
  path = os.path.join(run, "samples.jsonl")
  first = PPOTrainer(cfg, run).run(stop_after=2)  # saved at 2
  assert [(r["step"], r["sample"]) for r in wdlib.read_jsonl(path)] == [(2, 0), (2, 1)]
  # Rows of an iteration 3 that died before its checkpoint: the resume drops them.
  wdlib.append_jsonl(path, {"step": 3, "sample": 0, "prompt": "lost", "response": "lost"})
  trainer = PPOTrainer(cfg, run)
  rest = trainer.run()
  rows = wdlib.read_jsonl(path)
  assert [(r["step"], r["sample"]) for r in rows] == [(2, 0), (2, 1), (3, 0), (3, 1)]
  assert not any(r["prompt"] == "lost" for r in rows)
  by_step = {m["step"]: m for m in first + rest}
  for r in rows:
    assert isinstance(r["reward"], float) and np.isfinite(r["reward"])
    # The sample's length is the batch's (gen/response_lengths) and its text that many tokens
    # up to the EOS (or all of them when the budget ran out).
    assert r["response_length"] == by_step[r["step"]]["gen/response_lengths"][r["sample"]]
    n = r["response_length"] - (r["response_length"] < cfg.rollout.max_new_tokens)
    symbols = r["response"].replace("\ufffd", " ").split()  # U+FFFD: a special token's place
    assert 0 < len(symbols) <= n or n == 0, r
    assert r["prompt"].startswith("<bos>") and r["prompt"].endswith(" ="), r  # as tokenised


def _no_wall(starts):
  return [{k: v for k, v in s.items() if k != "wall_s"} for s in starts]


def test_each_start_s_code_stays_with_the_iterations_it_trained(tmp_path, caplog):
  """trained_by (each checkpoint's side-car, result.json): which start trained which
  iterations, with what it recorded of its code and machine. A resume at other code warns; a
  start that trains nothing adds nothing (result.json's provenance, the last start's, had
  relabelled a finished run with the commit that merely re-ran it)."""
  run = str(tmp_path / "run")
  cfg = tiny_config(**{"num_iterations": 3})
  first = PPOTrainer(cfg, run)
  first.start_record = {"git_commit": "aaa", "host": "one", "jax": "0.10.2"}
  first.run(stop_after=2)  # saved at 2
  # Each start's seconds up to its last save (a sweep sums them as the run's wall_s).
  walls = [e["wall_s"] for e in first.trained_by()]
  assert len(walls) == 1 and walls[0] > 0, walls
  assert _no_wall(first.trained_by()) == [
      {"from": 0, "to": 2, "git_commit": "aaa", "host": "one", "jax": "0.10.2"}]
  second = PPOTrainer(cfg, run)
  second.start_record = {"git_commit": "bbb", "host": "two", "jax": "0.11.2"}
  with caplog.at_level(logging.WARNING):
    second.run()
  assert ("resuming checkpoint 2, whose iterations 1-2 were trained at commit aaa, with commit "
          "bbb: the iterations from 3 on come from other code") in caplog.text, caplog.text
  # Another jax compiles other kernels: not bitwise the uninterrupted run (~1e-7 at once).
  assert ("resuming checkpoint 2, whose iterations 1-2 were trained with jax 0.10.2, with jax "
          "0.11.2: the run continues, but not bitwise") in caplog.text, caplog.text
  spans = [{"from": 0, "to": 2, "git_commit": "aaa", "host": "one", "jax": "0.10.2"},
           {"from": 2, "to": 3, "git_commit": "bbb", "host": "two", "jax": "0.11.2"}]
  assert _no_wall(second.trained_by()) == spans
  kept = second.trained_by()
  # (the first start's as its save at 2 recorded it)
  assert 0 < kept[0]["wall_s"] <= walls[0] and kept[1]["wall_s"] > 0, kept
  again = PPOTrainer(cfg, run)  # finished: trains nothing
  again.start_record = {"git_commit": "ccc", "host": "three", "jax": "0.12.1"}
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    again.run()
  assert _no_wall(again.trained_by()) == spans
  assert "other code" not in caplog.text and "with jax" not in caplog.text
  # The checkpoint's side-car holds them: a restart after a crash keeps them.
  # (with each start's time at its last save: a start that trains nothing adds none)
  assert again.checkpoints.checkpointer.restore_meta(3)["trained_by"] == again.trained_by()
