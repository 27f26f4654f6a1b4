"""The programs of experiments/plan_check.py: lowered from shapes, compiled, measured.

Every program is the codebase's own, reached through the function its caller jits:

  train_step  trainer/pipelined.PipelinedUpdate.lower (pp > 1: the fused executor's gradients,
              then AdamW, donating both states) or trainer/ppo.make_update_fn (pp == 1, its
              gradients accumulated over micro-batches of microbatch_size rows per data shard,
              0 for the whole shard at once: the trainer's algo.microbatch_size); the states
              are built as the trainer builds them: parameters placed by the logical rules of
              parallel/mesh.py (pp == 1) or stage-stacked, each stage's layers on its stage
              devices (pp > 1), AdamW +
              global-norm clipping of rl/optim.py (stepped on a float32 copy of the weights
              with master_weights: rl/optim.float32_master), optimizer leaves placed like
              their parameters, scalars replicated
  decode      generation/instances.GenerationInstance's decode chunk (donated SlotState) on one
              instance of gen_tp devices with gen_slots slots; with generation="mesh" (the
              trainer's plan.generation default) the Generator's: one instance over the whole
              training mesh (pp > 1: stage folded into data, parallel/mesh.fold_stage), gen_slots
              = the rollout batch split over data x fsdp (x stage), the parameters placed as the
              trainer places the whole models (fsdp x tensor)
  inference   the same instance's reference log-prob forward (inference/scoring.py) on one
              inference micro-batch (generation="mesh": the Scorer's, the whole rollout batch);
              without a reference (config.reference False: algo.kl_coef=0) the critic's value
              forward; none without a critic either (config.trains_critic False)
  prefill     the same instance's prefill of every slot's prompt: it writes the whole new KV
              cache (its output) beside one layer's activations of those prompts
  migrate     generation="instances": a consolidation's migration at the instance's largest
              bucket (gen_slots, or migration_rows where smaller: migrate_program), the
              source's gather (a copy of those rows beside its cache) or the target's scatter
              into its donated cache, whichever peaks higher; the instance's weights beside it
  reward      with a reward model (config.reward_model: a run's reward.kind='model'), its
              scalar forward (inference/scoring.reward_model_scores) on the same instance and
              micro-batch: a reward model larger than the actor (13B actor, 33B reward model)
              can be the instance's largest program, which the other three do not show
  placement   the actor's hand-over to generation each iteration, on the training devices
              (placement_programs): pp > 1, Update.whole's conversion of the stage-stacked
              actor (and critic) into the copy handed over (a scanned layer stack stays split
              over the stages; unrolled layers are gathered), then, for instances over the
              training devices, the one reshard of the actor onto all of them
              (FusedGenerator.place_actor); its figures are its costliest part's, its fit the
              most any part adds to the training state, its collectives all parts' together
  actor_logp  the actor's log-prob forward the trainer runs on the training devices before the
              update, where the run runs it (actor_logp_program): algo.old_logp's
              recomputation (old_logp "recompute", or "auto" with a 16-bit actor and pp == 1;
              AlgoConfig.recomputes_old_logp), in the unpipelined update's micro-batches, or
              asynchronous PPO's proximal log-probs (staleness > 0, whatever its objective: the
              lag's metrics need them too), a mini-batch a piece; the trainer's Scorer and its
              jitted forward (inference/scoring.Scorer.lower_logprobs) on the training mesh
              (pp > 1: the whole actor gathered, a copy beside the stage shards; on the folded
              mesh where the serial rollout generates) with the training state beside it
  critic_values  asynchronous PPO's value pass (staleness > 0): each batch generated earlier is
              scored again with the current critic on the training devices before its
              advantages (trainer/loop.PPOTrainer._current_values), a mini-batch a piece; the
              trainer's Scorer and its jitted critic_values (Scorer.lower_values) on the mesh
              actor_logp scores on, with the training state beside it (critic_values_program)

Arguments are jax.ShapeDtypeStructs with NamedShardings: nothing is allocated.

Measured per program, per device (SPMD: XLA compiles one program per device):
  argument_bytes, output_bytes, temp_bytes, alias_bytes  compiled.memory_analysis()
  peak_bytes = argument + output + temp - alias  (donated outputs reuse their arguments' buffers)
  xla_flops  compiled.cost_analysis()["flops"]: per device (checked: a matmul split over 4
             devices reports a quarter), but XLA counts a loop body once and a conditional as its
             costliest branch, and counts elementwise work
  flops_per_device  dot FLOPs with every loop iteration counted (perf/hlo_flops.py)
  analytic   params, grads, optimizer state, activations (the simulator's 34*h bytes per token
             and layer of 16-bit ones, at the model's dtype: twice for float32; sim/
             cost_model.py), KV cache, and FLOPs per device if the plan split the
             work perfectly (perf/accounting.py formulas)
  replication  flops_per_device / analytic useful FLOPs per device (1.0: no repeated work)
  fits       the peak plus what stays on its devices beside it (beside_train_state: the
             training state, the models kept there, asynchronous PPO's copy of the actor) <= the
             hardware preset's HBM bytes; fits_alone: the peak alone. Not counted: the
             rollout's arrays the trainer keeps on the training devices through the update
             (sim/cost_model.rollout_bytes: 16.8 MB for 512 samples of 2,048 tokens unsplit)
  collective_bytes  per kind, the buffer bytes each device's collectives move, loops counted
             (perf/hlo_flops.py; a decode chunk's loop counts once: one step)
  collective_s  those collectives one after another on the hardware preset (the simulator's
             NCCL ring formulas over each collective's own device groups and nodes): the time
             the program spends communicating unless XLA overlaps it; compute_s: the dot FLOPs
             at peak FLOP/s; decode's analytic hbm_s: the perfect split's weights and cache read
             once. Lower bounds to compare layouts with, not predictions.
  program_collective_bytes / program_collective_s  the same at the widths the partitioned
             program asks for: XLA:CPU widens 16-bit collectives to float32 after partitioning
             (a bf16 weight's all-gather, a bf16 gradient's all-reduce), a GPU does not. Read
             from an XLA dump of the program before that pass (`_compile`; perf/hlo_flops.py
             "Widths"): half the bytes of the LLaMA presets' updates (7B: 625 -> 314 GB a
             device, 2.16 -> 1.15 s). A gradient reduction XLA:CPU runs as an all-reduce where
             XLA:GPU makes a reduce-scatter still counts as the all-reduce (up to 2x the seconds).

XLA:CPU's buffer assignment is not XLA:GPU's: temp_bytes are an estimate (docs/results.md,
"Scale checks").

One CPU artefact is corrected by default (`cpu_upcast="per_layer"`): XLA:CPU runs bfloat16 dots
in float32 and, compiled as is, hoists the float32 copy of every weight out of the decode loop
(while-loop-invariant code motion), a copy as large as twice the weights that XLA:GPU, with
native bfloat16 dots, never makes (checked on one H100: docs/results.md). With 16-bit weights on
a CPU backend the instance's programs are therefore compiled with the layers scanned and that
pass off (`compiler_options`, this compile only), so the copy is made one layer at a time inside
the layer loop: their temp_bytes then over-count a GPU's by about one layer's float32 weights
and the LM head's (outside the layer loop, still converted whole). Each program is also compiled
as the config has it (`cpu_upcast.as_compiled`), and the smaller temp is reported
(`cpu_upcast.used`): a newer XLA:CPU that no longer hoists the copy (jax 0.11.2) needs no
correction. `cpu_upcast="as_compiled"` compiles only the program as the config has it.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import logging as std_logging
import math
import os
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jaxlib
import optax
from jax.experimental.compilation_cache import compilation_cache
from absl import logging

from configs import ppo_llama
from experiments import config_files, runner
from experiments.runner import fixed_or_sci
from rlhfuse_jax import metrics
from rlhfuse_jax.fields import check as _check
from rlhfuse_jax.generation import instances as inst_lib
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.inference import stages as inf_stages
from rlhfuse_jax.models import attention, llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.perf import accounting, hlo_flops, scale_check
from rlhfuse_jax.pipeline import stages
from rlhfuse_jax.policy import async_copies
from rlhfuse_jax.rl import optim
from rlhfuse_jax.sim import hardware as hw_lib
from rlhfuse_jax.sim import shapes as sim_shapes
from rlhfuse_jax.sim.cost_model import LOGITS_COPIES_SCORING, CostModel
from rlhfuse_jax.trainer import config as tc
from rlhfuse_jax.trainer import pipelined, ppo
from rlhfuse_jax.trainer import update as update_lib
from rlhfuse_jax.trainer import validate

# always compiled, but inference for a critic-free run without a reference (trains_critic and
# reference False: the trainer's instances score no such forward; since 2026-12-08)
PROGRAMS = ("train_step", "decode", "inference")
# prefill: compiled since 2026-12-05 (results before lack it; a review found it the largest
# program of an instance: it writes the whole new KV cache beside the activations of every
# slot's prompt); reward: compiled when the plan has a reward model; placement: when the actor
# is handed over from the training devices to instances on them or, pipelined, to another group
# (placement_programs); migrate: on instances, since 2026-12-05 (a consolidation's largest
# migration bucket: its gathered rows are a copy beside the cache, migrate_program)
# actor_logp: since 2026-12-06, when the run executes it (the trainer's algo.old_logp
# recomputation or async PPO's proximal log-probs, on the training devices beside the state);
# critic_values: since 2026-12-06, async PPO's current-critic values there (staleness > 0)
OPTIONAL_PROGRAMS = ("prefill", "migrate", "reward", "placement", "actor_logp",
                     "critic_values")
# The passes on the training devices before the update, beside the training state: each one's
# field of the bytes of the state's own model its arguments count (0 where it reads a copy)
TRAINING_PASSES = {"actor_logp": "state_actor_bytes", "critic_values": "state_critic_bytes"}
CPU_UPCAST_MODES = ("per_layer", "as_compiled")
GENERATION_MODES = ("instances", "mesh")
# XLA's name of the pass that hoists a loop-invariant float32 copy of the weights out of a loop.
PER_LAYER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def program_names(result: dict) -> list[str]:
  """The programs a result holds, in the table's order (PROGRAMS, then the optional ones)."""
  return [n for n in PROGRAMS + OPTIONAL_PROGRAMS if n in result["programs"]]


def _model(section: Any, field: str, head: str, layers: int, remat: str, attention: str,
           seq_len: int, scan_layers: bool = False) -> ModelConfig:
  """A preset name of configs/ppo_llama.py SHAPES or a model section -> ModelConfig."""
  if isinstance(section, str):
    _check(section in ppo_llama.SHAPES, field, section, f"one of {list(ppo_llama.SHAPES)} or a "
           "model section")
    hidden, inter, num_layers, heads, _ = ppo_llama.SHAPES[section]
    kw = dict(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
              num_layers=num_layers, num_heads=heads, num_kv_heads=heads, max_seq_len=4096,
              param_dtype="bfloat16", dtype="bfloat16")
  else:
    kw = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  kw.update(head=head, remat=remat, attention=attention)
  if scan_layers:
    kw["scan_layers"] = True
  kw["max_seq_len"] = max(kw.get("max_seq_len", 0), seq_len)
  if layers:
    kw["num_layers"] = layers
  try:
    return ModelConfig(**kw)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.{field}: {e}") from None


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """A pair of models and the plan they run on (configs/plan_check.py comments the fields)."""
  actor: ModelConfig
  critic: ModelConfig
  actor_layers: int  # the model's own layer counts (the compiled ones are in actor/critic)
  critic_layers: int
  pp: int
  critic_pp: int
  tp: int
  dp: int
  fsdp: int
  minibatch_size: int
  microbatch_size: int
  seq_len: int
  response_len: int
  intra_stage: bool
  search_time_s: float
  cpu_upcast: str
  gen_tp: int
  gen_slots: int
  chunk_size: int
  inference_microbatch: int
  hardware: hw_lib.Hardware
  # Instances scoring on pipelines of this many instances (the trainer's fusion.inference_pp,
  # plan.inference_pp): each scoring program is a stage's (inference/stages.py), and the
  # heaviest stage's is reported
  inference_pp: int = 1
  offload_optimizer: bool = False  # the trainer's optim.offload_during_rollout
  # The trainer's fusion.migration_rows: rows a migration moves at once (0: up to gen_slots)
  migration_rows: int = 8
  # The trainer's optim.master_weights: a float32 copy of the weights and float32 moments in
  # the optimizer state (rl/optim.float32_master)
  master_weights: bool = False
  zero1: bool = False  # the trainer's optim.zero1: optimizer state split over data (ZeRO-1)
  gradient_sync: str = "per_microbatch"  # the trainer's algo.gradient_sync (pp == 1)
  generation: str = "instances"  # instances | mesh (module docstring)
  critic_microbatch_size: int = 0  # pp > 1: the critic's rows per micro-batch (0: the actor's)
  # Asynchronous PPO's generation group (the trainer's async_ppo.generation_devices): generation
  # and inference on that many devices of their own, which hold no training state; 0: on the
  # training devices.
  generation_devices: int = 0
  # The group also holds the critic (the trainer's synchronous loop on a separate group scores
  # values there: async_ppo.staleness 0), whole beside the actor and the reference.
  group_critic: bool = False
  search_seed: int = 0  # the fused-schedule search's seed (the trainer's pipeline.search_seed)
  # Its budget as a count of evaluations instead of search_time_s (the trainer's
  # pipeline.search_evaluations; 0: the wall clock): the schedule checked is then the one the run
  # trains, on any machine
  search_evaluations: int = 0
  # Whether the run builds a reference model (the trainer's algo.kl_coef > 0: AlgoConfig.
  # uses_reference): the inference program is its log-prob forward; without one the critic's
  # value forward (what an instance still scores; an upper bound where it scores nothing), and
  # an asynchronous generation group holds no reference beside the actor.
  reference: bool = True
  # Whether the run trains a critic (the trainer's algo.trains_critic: False for a critic-free
  # estimator, grpo, rloo, ...). False: what the trainer compiles for such a run: the actor's
  # update alone (ppo.make_update_fn with the critic state None; pp 1 only, as
  # trainer/pipelined.check_config refuses mesh.stage > 1), no critic on the instances, the
  # group or in the placement hand-over, no critic_values pass. `critic` is then unused.
  trains_critic: bool = True
  # The reward model (a run's reward.kind='model': its checkpoint's architecture), scored on
  # the instances beside the reference: the `reward` program; None: a reward function.
  reward: ModelConfig | None = None
  reward_layers: int = 0  # its own layer count (the compiled one is in reward)
  # The trainer's algo.old_logp ("auto" | "generation" | "recompute") and async_ppo.staleness:
  # the actor's log-prob pass on the training devices (the `actor_logp` program) where the run
  # makes one: the recomputation (actor_logp_pass), or with staleness > 0 the proximal pass.
  old_logp: str = "auto"
  staleness: int = 0

  @property
  def train_devices(self) -> int:
    return self.pp * self.tp * self.dp * self.fsdp

  @property
  def num_devices(self) -> int:
    return max(self.train_devices, self.gen_devices)

  @property
  def gen_devices(self) -> int:
    """Devices of the program generation and inference run on."""
    if self.generation == "instances":
      return self.gen_tp
    return self.generation_devices or self.train_devices

  @property
  def gen_model_shards(self) -> int:
    """Ways the actor's parameters are split there (the training mesh: fsdp x tensor; the
    generation group's data-only mesh: none; data replicates)."""
    if self.generation == "instances":
      return self.gen_tp
    return 1 if self.generation_devices else self.fsdp * self.tp

  @property
  def gen_tensor(self) -> int:
    """Size of the tensor axis generation runs with (an instance's gen_tp; the training mesh's
    tp; none on async PPO's data-only group)."""
    if self.generation == "instances":
      return self.gen_tp
    return 1 if self.generation_devices else self.tp

  @property
  def gen_kv_shards(self) -> int:
    """Ways the decode cache is split: its rows over the batch axes, its KV heads over the
    tensor devices only where these divide them (generation/engine.state_shardings; otherwise
    every tensor device holds all of its rows' heads)."""
    tp = self.gen_tensor
    return self.gen_devices // tp * (tp if self.actor.num_kv_heads % tp == 0 else 1)

  @property
  def gen_batch_shards(self) -> int:
    """Ways generation="mesh" splits the rollout batch: the group's devices, or the training
    mesh's data x fsdp (x stage, folded as the trainer does)."""
    return self.generation_devices or self.dp * self.fsdp * self.pp

  @property
  def actor_logp_pass(self) -> str:
    """The trainer's actor log-prob pass before the update: "recompute" (algo.old_logp
    resolved as the trainer resolves it, AlgoConfig.recomputes_old_logp), "proximal"
    (asynchronous PPO, staleness > 0: every iteration, whatever the objective), or "" (none)."""
    if self.staleness:
      return "proximal"
    algo = tc.AlgoConfig(minibatch_size=self.minibatch_size, old_logp=self.old_logp)
    return "recompute" if algo.recomputes_old_logp(0, self.pp > 1, self.actor) else ""

  @property
  def critic_values_pass(self) -> bool:
    """Whether the trainer scores each batch's values with the current critic on the training
    devices (asynchronous PPO, staleness > 0: PPOTrainer._current_values); a critic-free
    estimator's run (trains_critic False) skips it."""
    return self.staleness > 0 and self.trains_critic

  @property
  def keeps_actor_copy(self) -> bool:
    """Whether the trainer keeps a copy of the actor on the training devices for each next
    batch's generation (asynchronous PPO, staleness > 0, without a generation group:
    trainer/loop.PPOTrainer._snapshot; with a group the copy is the group's actor)."""
    return async_copies.keeps_actor_copy(self.staleness, self.generation_devices)

  @property
  def prompt_len(self) -> int:
    return self.seq_len - self.response_len

  @property
  def rows_per_shard(self) -> int:
    return self.minibatch_size // (self.dp * self.fsdp)

  @property
  def micro_rows(self) -> int:
    """Rows per micro-batch and data shard: microbatch_size, or (pp == 1) the whole shard for 0
    or a size at least the shard's rows."""
    if self.pp == 1:  # as the trainer: 0 or a size >= the shard's rows is the whole shard
      return min(self.microbatch_size or self.rows_per_shard, self.rows_per_shard)
    return self.microbatch_size

  @property
  def actor_microbatches(self) -> int:
    return self.rows_per_shard // self.micro_rows

  @property
  def critic_micro_rows(self) -> int:
    """Rows per critic micro-batch: the actor's unless critic_microbatch_size is set (pp > 1)."""
    return self.critic_microbatch_size or self.micro_rows

  @property
  def critic_microbatches(self) -> int:
    """Micro-batches per critic replica (pp / critic_pp replicas share each data shard's rows)."""
    return self.rows_per_shard // (self.pp // self.critic_pp * self.critic_micro_rows)

  @classmethod
  def from_config_dict(cls, c: Any) -> "PlanConfig":
    d = c.to_dict() if hasattr(c, "to_dict") else dict(c)
    # actor_layers / critic_layers are derived (the presets' own counts): set, they were
    # accepted and overwritten without a word; config.layers is the field to set.
    known = {"actor", "critic", "layers", "remat", "attention", "hardware", "generation",
             "scan_layers", "gradient_sync", "reward_model"} | {
        f.name for f in dataclasses.fields(cls)} - {
            "actor_layers", "critic_layers", "reward", "reward_layers"}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"config: unknown fields {sorted(unknown)}; known: {sorted(known)}")
    config_files.check_ints(d, ("pp", "critic_pp", "tp", "dp", "fsdp", "minibatch_size",
                                "seq_len", "response_len", "gen_tp", "gen_slots", "chunk_size",
                                "inference_microbatch"))
    config_files.check_int("microbatch_size", d["microbatch_size"], 0,
                           "0, pp 1 only: each data shard's rows at once")
    for name in ("group_critic", "reference", "trains_critic"):
      _check(isinstance(d.get(name, name != "group_critic"), bool), name, d.get(name),
             "True or False")
    # (0 reached the trainer's PipelineConfig in make_update, after the earlier result had
    # moved aside, as "config.pipeline.search_time_s=0.0", a field plan_check does not have)
    t = d["search_time_s"]
    _check(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf"),
           "search_time_s", t, "a finite number of seconds > 0")
    seed = d.get("search_seed", 0)
    _check(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, "search_seed",
           seed, "an integer >= 0")
    for name, zero in (("generation_devices", "generation on the training devices"),
                       ("search_evaluations", "the wall-clock budget search_time_s"),
                       ("critic_microbatch_size", "microbatch_size"),
                       ("layers", "the model's own"), ("migration_rows", "up to gen_slots")):
      config_files.check_int(name, d.get(name, 0), 0, f"0: {zero}")
    config_files.check_int("inference_pp", d.get("inference_pp", 1), 1,
                           "1: each instance scores alone")
    config_files.check_int("staleness", d.get("staleness", 0), 0, "0: synchronous PPO")
    _check(d.get("old_logp", "auto") in tc.OLD_LOGP_SOURCES, "old_logp", d.get("old_logp"),
           f"one of {list(tc.OLD_LOGP_SOURCES)} (a run's algo.old_logp)")
    _check(d.get("old_logp") != "recompute" or not d.get("staleness", 0), "old_logp",
           "recompute", "'auto' or 'generation' with staleness > 0 (as the trainer refuses: "
           "asynchronously the proximal pass runs instead)")
    try:
      hardware = hw_lib.get_hardware(str(d["hardware"]))
    except ValueError as e:
      raise ValueError(f"config.hardware={d['hardware']!r}: {e}") from None
    _check(d["cpu_upcast"] in CPU_UPCAST_MODES, "cpu_upcast", d["cpu_upcast"],
           f"one of {list(CPU_UPCAST_MODES)}")
    _check(d.get("generation", "instances") in GENERATION_MODES, "generation",
           d.get("generation"), f"one of {list(GENERATION_MODES)}")
    _check(d.get("gradient_sync", "per_microbatch") in tc.GRADIENT_SYNC_MODES, "gradient_sync",
           d.get("gradient_sync"), f"one of {list(tc.GRADIENT_SYNC_MODES)}")
    _check(isinstance(d.get("offload_optimizer", False), bool), "offload_optimizer",
           d.get("offload_optimizer"), "True or False")
    # (accepted, decode's and the scoring programs' fits left the moments out, for a plan its
    # trainer refuses: TrainConfig's optim.offload_during_rollout check)
    _check(not d.get("offload_optimizer", False) or not (
        d.get("staleness", 0) or d.get("generation_devices", 0)), "offload_optimizer", True,
           "False with staleness > 0 or generation_devices > 0 (as the trainer refuses a run's "
           "optim.offload_during_rollout with async_ppo.staleness or generation_devices: "
           "asynchronously the moments train meanwhile; a generation group holds none)")
    for name in ("master_weights", "zero1"):
      _check(isinstance(d.get(name, False), bool), name, d.get(name), "True or False")
    _check(d["response_len"] < d["seq_len"], "response_len", d["response_len"],
           f"< seq_len={d['seq_len']} (a prompt of at least one token)")
    models = {}
    for field, head in (("actor", "lm"), ("critic", "scalar")):
      models[field] = _model(d[field], field, head, d["layers"], d["remat"], d["attention"],
                             d["seq_len"], d.get("scan_layers", False))
      models[f"{field}_layers"] = _model(d[field], field, head, 0, d["remat"], d["attention"],
                                         d["seq_len"]).num_layers
      # Both train (the train_step program): refused in float16 as train_ppo and --run_config
      # refuse a trained model (it compiled and said every program fits, exit 0)
      validate.check_trained_dtype(models[field], f"config.{field}")
    # "" or an empty section: a reward function (no model); forward only, so no remat, as the
    # trainer builds it (trainer/build.reward_model_config)
    reward = d.get("reward_model") or None
    _check(reward is None or isinstance(reward, (str, dict)), "reward_model", reward,
           f"'' (no reward model), one of {list(ppo_llama.SHAPES)} or a model section")
    if reward is not None:
      models["reward"] = _model(reward, "reward_model", "scalar", d["layers"], "none",
                                d["attention"], d["seq_len"], d.get("scan_layers", False))
      models["reward_layers"] = _model(reward, "reward_model", "scalar", 0, "none",
                                       d["attention"], d["seq_len"]).num_layers
      if isinstance(reward, str):  # a preset: the actor's numerics and vocabulary, as the
        # trainer gives a reward model (build.reward_model_config; it shares the tokenizer)
        actor = models["actor"]
        models["reward"] = models["reward"].replace(
            dtype=actor.dtype, param_dtype=actor.param_dtype, vocab_size=actor.vocab_size)
    cfg = cls(**models, **{k: d[k] for k in (
        "pp", "critic_pp", "tp", "dp", "fsdp", "minibatch_size", "microbatch_size", "seq_len",
        "response_len", "intra_stage", "search_time_s", "gen_tp", "gen_slots", "chunk_size",
        "inference_microbatch", "cpu_upcast")}, hardware=hardware,
        offload_optimizer=d.get("offload_optimizer", False),
        master_weights=d.get("master_weights", False), zero1=d.get("zero1", False),
        generation=d.get("generation", "instances"),
        gradient_sync=d.get("gradient_sync", "per_microbatch"),
        critic_microbatch_size=d.get("critic_microbatch_size", 0),
        generation_devices=d.get("generation_devices", 0),
        group_critic=d.get("group_critic", False),
        search_seed=d.get("search_seed", 0),
        search_evaluations=d.get("search_evaluations", 0), reference=d.get("reference", True),
        trains_critic=d.get("trains_critic", True),
        inference_pp=d.get("inference_pp", 1),
        migration_rows=d.get("migration_rows", 8), old_logp=d.get("old_logp", "auto"),
        staleness=d.get("staleness", 0))
    cfg.validate()
    return cfg

  def validate(self) -> None:
    shards = self.gen_batch_shards
    where = (f"generation_devices={shards}" if self.generation_devices else
             f"dp*fsdp*pp={shards}")
    _check(self.generation != "mesh" or self.gen_slots % shards == 0,
           "gen_slots", self.gen_slots,
           f"a multiple of {where} (generation='mesh': the rollout batch split over the "
           "generation group, or over the data axes with pp > 1's stage axis folded into them "
           "as the trainer does; a batch that does not split so, which the trainer runs whole "
           "on every stage, is not modelled)")
    # trainer/pipelined.check_config's refusal, named by plan_check's fields
    _check(self.trains_critic or self.pp == 1, "pp", self.pp,
           "1 with trains_critic=False: a critic-free estimator trains no critic, but pp > 1 "
           "(mesh.stage > 1) trains through the fused actor/critic pipeline executor, which has "
           "no actor-only pipeline")
    _check(self.trains_critic or not self.group_critic, "group_critic", self.group_critic,
           "False with trains_critic=False (there is no critic to score values with)")
    _check(self.pp % self.critic_pp == 0, "critic_pp", self.critic_pp, f"a divisor of pp={self.pp}")
    for field, model, n_stages, full in (("actor", self.actor, self.pp, self.actor_layers),
                                         ("critic", self.critic, self.critic_pp,
                                          self.critic_layers)):
      # config.layers set the compiled count (the model's own is `full`): the error names it.
      name, want = (("layers", f"a multiple of the {field}'s {n_stages} pipeline stages (e.g. "
                     f"{n_stages})") if model.num_layers != full else
                    (f"{field}.num_layers", f"divisible by its {n_stages} pipeline stages (set "
                     "config.layers to compile fewer)"))
      _check(model.num_layers % n_stages == 0, name, model.num_layers, want)
    ipp = self.inference_pp
    _check(ipp == 1 or self.generation == "instances", "inference_pp", ipp,
           "1 with generation='mesh' (pipelines of instances score on generation instances)")
    for field, model in (("actor", self.actor),
                         ("critic", self.critic if self.trains_critic else None),
                         ("reward_model", self.reward)):
      _check(model is None or model.num_layers % ipp == 0, "inference_pp", ipp,
             f"a divisor of the {model.num_layers if model else 0} layers compiled of the "
             f"{field} (each stage holds whole layers; config.layers sets the count compiled)")
    if self.pp > 1:  # the pipelined update's tensor split (trainer/pipelined.check_config),
      # named by plan_check's fields: it was "config.model.num_heads=32 must be divisible by
      # mesh.tensor=3", after jax had started, fields plan_check does not have
      for field, model in (("actor", self.actor), ("critic", self.critic)):
        bad = [f"{name}={getattr(model, name)}" for name in ("num_heads", "intermediate_size")
               if getattr(model, name) % self.tp]
        kv = model.num_kv_heads
        if kv % self.tp and self.tp % kv:
          bad.append(f"num_kv_heads={kv} (or a multiple of it)")
        _check(not bad, "tp", self.tp,
               f"a divisor of the {field}'s {', '.join(bad)} (config.{field}): the pipelined "
               "update (pp > 1) splits heads and MLP width over the tensor devices")
    shards = self.dp * self.fsdp
    _check(self.microbatch_size > 0 or self.pp == 1, "microbatch_size", self.microbatch_size,
           f">= 1 with pp={self.pp} (0, each data shard's rows at once, is the unpipelined "
           "update's)")
    _check(self.minibatch_size % shards == 0, "minibatch_size", self.minibatch_size,
           f"a multiple of dp*fsdp={shards}")
    _check(self.rows_per_shard % self.micro_rows == 0, "microbatch_size", self.microbatch_size,
           f"a divisor of the rows per data shard (minibatch_size/(dp*fsdp) = "
           f"{self.minibatch_size}/{shards} = {self.rows_per_shard})")
    reps = self.pp // self.critic_pp
    _check(self.critic_microbatch_size == 0 or self.pp > 1, "critic_microbatch_size",
           self.critic_microbatch_size, "0 with pp=1 (the unpipelined update's micro-batches "
           "are microbatch_size for both models)")
    field = "critic_microbatch_size" if self.critic_microbatch_size else "microbatch_size"
    _check(self.rows_per_shard % (reps * self.critic_micro_rows) == 0, field,
           getattr(self, field), f"a size that splits the rows per data shard "
           f"({self.rows_per_shard}) over the critic replicas pp/critic_pp={reps}: "
           f"{reps} x {self.critic_micro_rows} does not divide {self.rows_per_shard}")


# Abstract arguments -----------------------------------------------------------------------------

def abstract_params(cfg: ModelConfig, mesh) -> Any:
  """Parameter structs placed as the trainer places them (parallel/mesh.py logical rules)."""
  shapes = llama.param_shapes(cfg)
  return scale_check.abstract_params(
      cfg, mesh_lib.param_shardings(shapes, llama.logical_specs(cfg), mesh))


def abstract_opt_state(tx: optax.GradientTransformation, params: Any, mesh,
                       zero1: bool = False) -> Any:
  """Optimizer-state structs placed as the trainer places them (trainer/update.Update.
  init_state): leaves that mirror a parameter take its sharding (with `zero1`, split further
  over the axes it is replicated over), the rest (step counts) replicated."""
  return mesh_lib.abstract(jax.eval_shape(tx.init, params),
                           update_lib.optimizer_state_shardings(tx, params, mesh, zero1))


def batch_shapes(cfg: PlanConfig) -> dict:
  """The trainer's mini-batch fields: name -> (shape, dtype)."""
  b, s, t = cfg.minibatch_size, cfg.seq_len, cfg.response_len
  out = {"tokens": ((b, s), jnp.int32), "prompt_lens": ((b,), jnp.int32)}  # [B, P+T], [B]
  for k in ("mask", "old_logp", "ref_logp", "advantages", "returns", "old_values"):
    out[k] = ((b, t), jnp.float32)  # [B, T]
  return out


def abstract_batch(cfg: PlanConfig, mesh) -> dict:
  return {k: jax.ShapeDtypeStruct(shape, dt, sharding=mesh_lib.batch_sharding(mesh, len(shape)))
          for k, (shape, dt) in batch_shapes(cfg).items()}


def make_optimizer(staged: bool, master_weights: bool = False) -> optax.GradientTransformation:
  """The trainer's optimizer (AdamW, warm-up + cosine, clipping; for stage-stacked parameters
  when `staged`, as trainer/update.py builds it for pp > 1; stepped on a float32 copy of the
  weights with `master_weights`); rates do not change shapes."""
  mask = {"weight_decay_mask": stages.staged_decay_mask} if staged else {}
  tx = optim.make_optimizer(1e-6, 10, 1000, grad_clip=1.0, **mask)
  return optim.float32_master(tx) if master_weights else tx


def train_mesh(cfg: PlanConfig):
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=cfg.dp, fsdp=cfg.fsdp, stage=cfg.pp,
                                                tensor=cfg.tp),
                            jax.devices()[:cfg.train_devices])


def pipeline_config(cfg: PlanConfig) -> tc.PipelineConfig:
  """The pipeline section a pipelined plan's update runs with: with the problem it sets
  (trainer/pipelined.pipeline_problem), the key of the fused schedule it looks up in
  WORKDIR/cache/schedules (the GPU script seeds that cache with the CPU's searches)."""
  return tc.PipelineConfig(
      critic_pp=cfg.critic_pp, actor_microbatches=cfg.actor_microbatches,
      critic_microbatches=cfg.critic_microbatches, search_time_s=cfg.search_time_s,
      search_evaluations=cfg.search_evaluations, search_seed=cfg.search_seed)


def make_update(cfg: PlanConfig, mesh, tx, workdir: str):
  """(the trainer's update callable with .lower, info) for the plan."""
  algo = tc.AlgoConfig(minibatch_size=cfg.minibatch_size, epochs=1)
  if cfg.pp == 1:
    algo = dataclasses.replace(algo, microbatch_size=cfg.microbatch_size,
                               gradient_sync=cfg.gradient_sync)
    # Without a critic the actor's update alone: the trainer's (update._plain_update) has no
    # critic optimizer and calls it with the critic state None.
    return (ppo.make_update_fn(cfg.actor, cfg.critic, algo, 1.0, tx,
                               tx if cfg.trains_critic else None, mesh=mesh),
            {"schedule": "none", "accumulated_microbatches": cfg.actor_microbatches})
  train_cfg = tc.TrainConfig(
      seed=0, num_iterations=1, model=cfg.actor, critic_model=cfg.critic,
      mesh=mesh_lib.MeshConfig(data=cfg.dp, fsdp=cfg.fsdp, stage=cfg.pp, tensor=cfg.tp),
      data=tc.DataConfig(), rollout=tc.RolloutConfig(prompts_per_iteration=cfg.minibatch_size),
      algo=algo, optim=tc.OptimConfig(), reward=tc.RewardConfig(), init=tc.InitConfig(),
      fusion=tc.FusionConfig(intra_stage=cfg.intra_stage), checkpoint=tc.CheckpointConfig(),
      pipeline=pipeline_config(cfg))
  update = pipelined.make_pipelined_update_fn(cfg.actor, cfg.critic, algo, 1.0, tx, tx, mesh=mesh,
                                              config=train_cfg, workdir=workdir)
  program = update.executor.program
  return update, {"schedule": update.schedule_name, "ticks": int(program.ticks),
                  "stash_sizes": list(program.stash_sizes),
                  "inbox_sizes": list(program.inbox_sizes),
                  "actor_microbatches": cfg.actor_microbatches,
                  "critic_microbatches": cfg.critic_microbatches}


def train_args(cfg: PlanConfig, mesh, tx, update) -> tuple:
  """The update's arguments as the trainer holds them: whole models placed by the logical
  rules (pp == 1), or stage-stacked with each stage's layers on its stage devices (pp > 1);
  without a critic (trains_critic False, pp 1 only) the critic's state None, as the trainer
  calls its update."""
  state = lambda p: ppo.ModelState(p, abstract_opt_state(tx, p, mesh, cfg.zero1))
  if cfg.pp == 1:
    critic = state(abstract_params(cfg.critic, mesh)) if cfg.trains_critic else None
    return state(abstract_params(cfg.actor, mesh)), critic, abstract_batch(cfg, mesh)
  ex = update.executor
  actor, critic = (state(mesh_lib.abstract(ex.layouts[m].staged_shapes(), ex.staged_shardings(m)))
                   for m in ("actor", "critic"))
  return actor, critic, abstract_batch(cfg, mesh)


def make_instance(cfg: PlanConfig) -> inst_lib.GenerationInstance:
  """One generation instance of gen_tp devices; with generation="mesh" the trainer's Generator
  and Scorer on the training mesh instead: an instance over the whole mesh places the
  parameters by the same logical rules as training (as the trainer's Generator keeps them), and
  scores the whole rollout batch at once (the Scorer's default micro-batch)."""
  sampling = SamplingConfig(max_new_tokens=cfg.response_len, chunk_size=cfg.chunk_size)
  frozen = (inst_lib.FrozenModels(reference=cfg.actor.replace(head="lm"), reward=cfg.reward)
            if cfg.reference else
            inst_lib.FrozenModels(reference=None,
                                  critic=cfg.critic if cfg.trains_critic else None,
                                  reward=cfg.reward))
  if cfg.generation == "mesh" and cfg.generation_devices:  # async PPO's data-only group mesh
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=cfg.generation_devices),
                              jax.devices()[:cfg.generation_devices])
    micro = cfg.gen_slots
  elif cfg.generation == "mesh":  # pipelined: stage folded into data, as the trainer does
    mesh, micro = mesh_lib.fold_stage(train_mesh(cfg)), cfg.gen_slots
  else:
    mesh, micro = inst_lib.split_devices(jax.devices(), 1, cfg.gen_tp)[0], cfg.inference_microbatch
  return inst_lib.GenerationInstance(0, mesh, cfg.actor, sampling, slots=cfg.gen_slots,
                                     prompt_len=cfg.prompt_len, frozen=frozen, micro_batch=micro,
                                     migration_rows=cfg.migration_rows,
                                     inference_pp=cfg.inference_pp)


# Measuring --------------------------------------------------------------------------------------

# The XLA:CPU passes that widen 16-bit collectives (hlo_flops "Widths"), in the order they run
# (jax 0.10.2); the dump before the first one present is the partitioned program at the widths
# it asks for.
_WIDENING_PASSES = ("all-reduce-promotion", "float-normalization-bf16")


def _reset_compilation_cache() -> None:
  """compilation_cache.reset_cache without its INFO line ("Resetting cache at <empty>."): plan_check
  resets twice a compile, six lines a run that say nothing about the plan. Only that logger, only
  during the reset; its level is put back, whatever the user set it to."""
  logger = std_logging.getLogger(compilation_cache.reset_cache.__module__)
  level = logger.level
  logger.setLevel(max(level, std_logging.WARNING))
  try:
    compilation_cache.reset_cache()
  finally:
    logger.setLevel(level)


def _compile(lowered: Any, compiler_options: dict | None) -> tuple[Any, str | None]:
  """(compiled, the partitioned program's HLO text before XLA:CPU widens its 16-bit collectives,
  or None off CPU or where this XLA has no such pass). The text comes from an XLA dump of those
  passes into a temporary directory (XLA:CPU also writes the program's LLVM IR and object files
  there whenever it dumps, about +15 % of compile_s on the tiny config; no option turns that
  off). The persistent compilation cache is off for this compile: jax leaves the dump options
  out of its cache key, so a program loaded from the cache would not be compiled, nor dumped."""
  if jax.default_backend() != "cpu":
    return lowered.compile(compiler_options=compiler_options), None
  cache = jax.config.jax_enable_compilation_cache
  with tempfile.TemporaryDirectory(prefix="plan_check_hlo_") as dump:
    # Text, every module and pipeline, whatever the user's XLA_FLAGS say about dumping.
    options = {**(compiler_options or {}), "xla_dump_to": dump,
               "xla_dump_hlo_pass_re": "|".join(_WIDENING_PASSES),
               "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": ".*",
               "xla_dump_hlo_pipeline_re": ".*"}
    # jax decides once per process whether to use the cache (compilation_cache.is_cache_used
    # keeps its first answer): the flag takes effect, here and after, only through a reset.
    jax.config.update("jax_enable_compilation_cache", False)
    _reset_compilation_cache()
    try:
      compiled = lowered.compile(compiler_options=options)
    finally:
      jax.config.update("jax_enable_compilation_cache", cache)
      _reset_compilation_cache()
    # Named <module>.<step>.<pipeline>.after_<pass>.before_<pass>.txt: the lowest step first.
    found = sorted(f for name in _WIDENING_PASSES
                   for f in glob.glob(os.path.join(dump, f"*.before_{name}.txt")))
    if not found:
      logging.warning("no XLA dump before %s: collectives only as compiled (16-bit ones may "
                      "count as float32)", " or ".join(_WIDENING_PASSES))
      return compiled, None
    with open(found[0]) as f:
      return compiled, f.read()


def measure(lowered: Any, hardware: hw_lib.Hardware,
            compiler_options: dict | None = None) -> dict:
  """Compiles `lowered` and reads its memory, FLOPs and collectives per device (module
  docstring)."""
  t0 = time.perf_counter()
  compiled, program_text = _compile(lowered, compiler_options)
  compile_s = time.perf_counter() - t0
  widths = None if program_text is None else hlo_flops.program_widths(program_text)
  costs = scale_check.compiled_costs(compiled, CostModel(hardware), widths)
  if widths == {} and any(costs["collective_bytes"].values()):
    # The dump came from before partitioning (an XLA whose passes run in another order): it
    # names no collective, so none was narrowed.
    logging.warning("the XLA dump before %s has no collectives, the compiled program has: "
                    "program_collective_* are as compiled", " / ".join(_WIDENING_PASSES))
  if costs["unread_collective_groups"]:
    logging.warning("%d collectives have device groups in a form perf/hlo_flops.py does not "
                    "read: timed as pairs across nodes", costs["unread_collective_groups"])
  if costs["uncounted_custom_calls"]:
    logging.warning("flops_per_device and compute_s leave out the work of custom-calls "
                    "perf/hlo_flops.py cannot count (target: times run): %s",
                    costs["uncounted_custom_calls"])
  peak = (costs["argument_bytes"] + costs["output_bytes"] + costs["temp_bytes"]
          - costs["alias_bytes"])
  return {**{k: v for k, v in costs.items() if k != "flops"}, "peak_bytes": peak,
          "flops_per_device": costs["flops"],
          "compute_s": costs["flops"] / hardware.peak_flops,
          "hbm_bytes": hardware.hbm_bytes, "fits": bool(peak <= hardware.hbm_bytes),
          "compile_s": compile_s}


def per_layer_upcast(cfg: PlanConfig, models: list[ModelConfig] | None = None) -> bool:
  """Whether the instance's programs are compiled per layer (module docstring): cpu_upcast is
  per_layer, the backend is XLA:CPU and the actor's or the reward model's weights (`models`'
  where given) are 16-bit (each program then reports the smaller of its two compiles)."""
  if models is None:
    models = [cfg.actor] + ([] if cfg.reward is None else [cfg.reward])
  return (cfg.cpu_upcast == "per_layer" and jax.default_backend() == "cpu" and
          any(jnp.dtype(m.param_dtype).itemsize == 2 for m in models))


def instance_programs(cfg: PlanConfig) -> dict:
  """A generation instance's decode chunk and reference forward (cfg.reference; else the
  critic's value forward: scoring_model), and the reward model's forward (cfg.reward), measured.

  Under `per_layer_upcast` each program is compiled twice: scanned with the hoisting off, and as
  the config has it (`cpu_upcast.as_compiled`); the smaller temp is reported (`cpu_upcast.used`).
  An XLA:CPU that hoists the float32 copy (jax 0.10) makes per_layer the smaller by the copy; one
  that does not (jax 0.11.2: 0.29 MB as is, 0.50 MB per layer on the test's tiny bf16 model)
  makes the config's own program the smaller, and its figures are the better estimate of a GPU's.
  """
  per_layer = per_layer_upcast(cfg)
  lowered = {}
  kind = "reference" if cfg.reference else "critic"
  scorer = scoring_model(cfg)
  for scan in {cfg.actor.scan_layers, True} if per_layer else {cfg.actor.scan_layers}:
    actor = cfg.actor.replace(scan_layers=scan)
    reward = None if cfg.reward is None else cfg.reward.replace(scan_layers=scan)
    scan_cfg = dataclasses.replace(cfg, actor=actor, critic=cfg.critic.replace(scan_layers=scan),
                                   reward=reward)
    inst = make_instance(scan_cfg)
    frozen = {}
    if scorer is not None:
      frozen[kind] = llama.param_shapes(scoring_model(scan_cfg))
    if reward is not None:
      frozen["reward"] = llama.param_shapes(reward)
    lowered[scan] = dict(inst.lower_all(llama.param_shapes(actor), frozen,
                                        only=("prefill", "decode", *frozen)))
  out = {}
  wanted = [("decode", "decode", decode_analytic(cfg)),
            ("prefill", "prefill", prefill_analytic(cfg))]
  pp = cfg.inference_pp
  for name, model, key, heads in (("inference", None, kind, None),
                                  ("reward", cfg.reward, "reward", 1)):
    if (name == "reward" and model is None) or (name == "inference" and scorer is None):
      continue
    if pp == 1:
      wanted.append((name, key, inference_analytic(cfg, model, heads)))
    else:  # every stage's program (each instance of a pipeline may hold any stage)
      wanted += [((name, s), (key, s), inference_analytic(cfg, model, heads, stage=s))
                 for s in range(pp)]
  for name, key, analytic in wanted:
    out[name] = _instance_program(cfg, name, lowered, key, analytic, per_layer)
  for name in ("inference", "reward"):
    stages = [out.pop((name, s)) for s in range(pp)] if pp > 1 and (name, 0) in out else None
    if stages:  # the heaviest stage is the program; every stage's peak beside it
      s = max(range(pp), key=lambda k: stages[k]["peak_bytes"])
      out[name] = {**stages[s], "stage": s, "stages": pp,
                   "stage_peak_bytes": [x["peak_bytes"] for x in stages]}
      logging.info("%s: stage %d of %d is the heaviest (peaks %s)", name, s, pp,
                   ", ".join(metrics.size(x["peak_bytes"]) for x in stages))
  if cfg.generation == "instances":
    out["migrate"] = migrate_program(cfg)
  return out


def _instance_program(cfg: PlanConfig, name, lowered: dict, key, analytic: dict,
                      per_layer: bool, scan: bool | None = None) -> dict:
  """Instance program `key` of `lowered` ({scan_layers: {key: Lowered}}) measured beside its
  `analytic` figures; under `per_layer` the smaller of its two compiles (instance_programs).
  `scan`: the scan_layers of the model as configured (default: the actor's)."""
  figures = lambda r: {k: r[k] for k in ("temp_bytes", "peak_bytes", "fits", "compile_s")}
  scan = cfg.actor.scan_layers if scan is None else scan
  m = measure(lowered[scan][key], cfg.hardware)
  record = {"scan_layers": scan}
  if per_layer:
    scanned = measure(lowered[True][key], cfg.hardware, PER_LAYER_OPTIONS)
    used = "per_layer" if scanned["temp_bytes"] <= m["temp_bytes"] else "as_compiled"
    logging.info("%s: temp %s with the float32 weights converted per layer, %s as compiled; "
                 "reporting %s", name, metrics.size(scanned["temp_bytes"]),
                 metrics.size(m["temp_bytes"]), used)
    record = {"mode": "per_layer", "used": used,
              "per_layer": {**figures(scanned), "scan_layers": True,
                            "compiler_options": PER_LAYER_OPTIONS},
              "as_compiled": {**figures(m), **record}}
    m = scanned if used == "per_layer" else m
  else:
    record = {"mode": "as_compiled", **record}
  m["cpu_upcast"] = record
  out = _finish(m, analytic)
  logging.info("%s: compiled in %.1fs", name, out["compile_s"])
  return out


def migrate_program(cfg: PlanConfig) -> dict:
  """A consolidation's migration at the instance's largest bucket (gen_slots, or migration_rows
  where smaller: instances.migration_buckets): the source's gather, whose output is a copy of
  that many slots' rows beside its cache, and the target's scatter of them into its donated
  cache; the figures of the one with the larger peak, both under `parts`. Neither reads the
  weights, which stay on the instance beside them (beside_train_state). No FLOPs: replication
  None."""
  inst = make_instance(cfg)
  rows = inst.buckets[-1]
  lowered = dict(inst.lower_all(llama.param_shapes(cfg.actor), {}, only=("gather", "scatter")))
  parts = {k: measure(lowered[(k, rows)], cfg.hardware) for k in ("gather", "scatter")}
  worst = max(parts, key=lambda k: parts[k]["peak_bytes"])
  decode = decode_analytic(cfg)  # the same weights and cache
  kv = decode["kv_cache_bytes"]
  analytic = {"params_bytes": decode["params_bytes"],
              "kv_cache_bytes": kv, "rows_bytes": kv * rows / cfg.gen_slots,
              "total_bytes": kv * (1 + rows / cfg.gen_slots), "flops_per_device": 0.0}
  figures = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "peak_bytes",
             "compile_s")
  out = _finish(parts[worst], analytic)
  out.update(rows=rows, largest=worst, compile_s=sum(q["compile_s"] for q in parts.values()),
             parts={k: {f: q[f] for f in figures} for k, q in parts.items()})
  logging.info("migrate: %d rows, compiled in %.1fs", rows, out["compile_s"])
  return out


_BITS_NOTE = ("16-bit float weights moved as uint16 of the same bits: XLA:CPU widens a 16-bit "
              "float collective to float32 (a bfloat16 all-gather's temp was twice the bytes "
              "gathered), a GPU moves them as they are; a move is the same bytes either way")


def _as_bits(tree: Any) -> Any:
  """Placed structs with 16-bit float leaves as uint16 (_BITS_NOTE), the rest as they are."""
  def one(x):
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
      return jax.ShapeDtypeStruct(x.shape, jnp.uint16, sharding=x.sharding)
    return x
  return jax.tree.map(one, tree)


def placement_programs(cfg: PlanConfig, mesh, update) -> dict:
  """The actor's hand-over to generation each iteration, measured on the training devices.

  With pp > 1 and generation elsewhere than on the training mesh itself (instances, or
  asynchronous PPO's group): Update.whole's conversion of the stage-stacked actor (and of the
  critic where the instances or the group score with it) into the copy handed over
  (trainer/update.moving_shardings: a scanned layer stack stays split over the stages,
  unrolled layers are gathered). With instances that cover the training devices: the one
  reshard of that copy (pp == 1: of the state's own actor) onto all of them
  (generation/fused.FusedGenerator.place_actor: a grid of data = instances x tensor = gen_tp
  over the training mesh's devices in its order, as the trainer cuts its instances off TPU,
  each instance's weights split by its own logical rules), leaving out the leaves already
  where an instance wants them (mesh_lib.put relabels those, nothing moves). {} where nothing
  of that runs. Asynchronous PPO on the training devices hands over its copy of the actor
  (actor_copy_bytes; pp == 1 beside the reshard, counted by beside_train_state; pp > 1 the
  conversion's output, gathered whole also with scan_layers, which the unstack part here
  hands over split over the stages: an under-count there). Not counted: with several
  processes the critic's host copy (FusedStage._instance_ready gathers it to every process
  first); a fused stage with fewer instances than the devices allow,
  placed one instance at a time (counted as the grid's one reshard); onto a group, what the
  move from the copy may lay out on the training devices first (mesh_lib._pieces' nesting
  layout, where no shard of the copy holds a group device's box).

  {"placement": the figures of the part that adds the most to the training state, with
   "parts": each compiled program's (unstack_actor, unstack_critic, reshard), and
   "over_state_bytes": what each adds at its peak (a conversion: its output and temporaries,
   its argument being the state's own parameters; the reshard: its whole peak and the copy's
   leaves it leaves in place, or with pp == 1 its peak less the state's own actor)}."""
  group = bool(cfg.generation_devices)
  grid_reshard = (cfg.generation == "instances" and not group and
                  cfg.train_devices % cfg.gen_tp == 0)
  converted = cfg.pp > 1 and (cfg.generation == "instances" or group)
  if not (grid_reshard or converted):
    return {}
  shapes, parts, over = {}, {}, {}
  if converted:
    ex = update.executor
    # The critic is handed over where it scores: on the instances, or the group's with
    # group_critic (the trainer's stage_critic).
    # A critic-free run has none (pp > 1 is refused for it: PlanConfig.validate).
    handed = cfg.trains_critic and (not group or cfg.group_critic)
    for model in ("actor", "critic") if handed else ("actor",):
      whole = abstract_params(getattr(cfg, model), mesh)
      staged = _as_bits(mesh_lib.abstract(ex.layouts[model].staged_shapes(),
                                          ex.staged_shardings(model)))
      moving = update_lib.moving_shardings(whole)
      lowered = jax.jit(functools.partial(ex.unstack, model), out_shardings=moving).lower(staged)
      parts[f"unstack_{model}"] = m = measure(lowered, cfg.hardware)
      over[f"unstack_{model}"] = m["peak_bytes"] - m["argument_bytes"]
      shapes[model] = mesh_lib.abstract(whole, moving)
  actor = shapes["actor"] if converted else abstract_params(cfg.actor, mesh)
  n = cfg.train_devices // cfg.gen_tp
  if grid_reshard:
    grid = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=n, tensor=cfg.gen_tp),
                              list(mesh.devices.flat))
    own = make_instance(cfg).param_shardings(cfg.actor, llama.param_shapes(cfg.actor))
    leaves = jax.tree.leaves(_as_bits(actor))
    targets = [jax.sharding.NamedSharding(grid, sh.spec) for sh in jax.tree.leaves(own)]
    in_place = [mesh_lib.places_alike(x, t) for x, t in zip(leaves, targets)]
    moved = [(x, t) for x, t, kept in zip(leaves, targets, in_place) if not kept]
    if moved:
      lowered = jax.jit(lambda xs: xs, out_shardings=[t for _, t in moved]).lower(
          [x for x, _ in moved])
      parts["reshard"] = m = measure(lowered, cfg.hardware)
      kept = _device_bytes([x for x, k in zip(leaves, in_place) if k])
      over["reshard"] = m["peak_bytes"] - m["argument_bytes"] if cfg.pp == 1 else (
          m["peak_bytes"] + kept)
  if not parts:
    return {}
  params = _nbytes(llama.param_shapes(cfg.actor))
  handed = _device_bytes(actor) if converted else 0
  share = params / cfg.gen_tp if grid_reshard else 0.0
  analytic = {"params_bytes": share, "handed_over_bytes": handed,
              "total_bytes": share + handed, "flops_per_device": 0.0}
  figures = lambda r: {k: r[k] for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                         "alias_bytes", "peak_bytes", "compile_s")}
  costliest = max(over, key=over.get)
  out = _finish(parts[costliest], analytic)
  # The hand-over's communication is all its parts': their collectives one after another.
  for key in ("collective", "program_collective"):
    if all(f"{key}_bytes" in q and f"{key}_s" in q for q in parts.values()):
      out[f"{key}_bytes"] = {kind: sum(q[f"{key}_bytes"][kind] for q in parts.values())
                             for kind in out[f"{key}_bytes"]}
      out[f"{key}_s"] = sum(q[f"{key}_s"] for q in parts.values())
    else:  # (no part's, rather than one part's alone)
      out.pop(f"{key}_bytes", None)
      out.pop(f"{key}_s", None)
  out.update(parts={k: figures(v) for k, v in parts.items()}, over_state_bytes=over,
             costliest=costliest, instances=n if grid_reshard else 0, compiled_as=_BITS_NOTE,
             compile_s=sum(q["compile_s"] for q in parts.values()))
  logging.info("placement: compiled in %.1fs (%s)", out["compile_s"], ", ".join(parts))
  return {"placement": out}


def actor_logp_program(cfg: PlanConfig, mesh) -> dict:
  """The actor's log-prob pass the trainer runs on the training devices before the update
  (cfg.actor_logp_pass; trainer/loop.PPOTrainer._actor_logprobs), measured: {} where the run
  makes none.

  The trainer's own program: its Scorer (the training mesh, or with pp > 1 and the serial
  rollout the mesh folded as the rollout's, where the mini-batch splits over it) with the rows
  AlgoConfig.logprob_rows gives (the unpipelined update's micro-batches for the
  recomputation, else the mini-batch), lowered by Scorer.lower_logprobs: the jitted
  scoring.response_logprobs on the actor's whole parameters as the trainer passes them (pp ==
  1: the state's own, counted once beside the state: `state_actor_bytes`; pp > 1: Update.whole's
  gathered copy, beside the stage shards; the conversion's transient is not counted). Under
  per_layer_upcast compiled twice like the instance's programs, the smaller temp reported."""
  kind = cfg.actor_logp_pass
  if not kind:
    return {}
  pipelined = cfg.pp > 1
  on, on_folded = rescore_mesh(cfg, mesh)
  shards = mesh_lib.batch_size_multiple(on)
  algo = tc.AlgoConfig(minibatch_size=cfg.minibatch_size, old_logp=cfg.old_logp,
                       microbatch_size=0 if pipelined else cfg.microbatch_size)
  rows = algo.logprob_rows(kind == "recompute", pipelined, shards)
  scorer = scoring.Scorer(on, micro_batch_size=rows)
  per_layer = per_layer_upcast(cfg)
  lowered = _lowered_by_scan(cfg.actor, per_layer, "logp", lambda actor: scorer.lower_logprobs(
      actor, abstract_params(actor, on), cfg.minibatch_size, cfg.seq_len, cfg.response_len))
  out = _instance_program(cfg, "actor_logp", lowered, "logp",
                          actor_logp_analytic(cfg, rows, shards), per_layer)
  own = 0 if pipelined else _device_bytes(abstract_params(cfg.actor, mesh))
  out.update({"pass": kind, "rows": rows, "pieces_split_over": shards,
              "mesh": "folded" if on_folded else "training", "state_actor_bytes": own})
  return {"actor_logp": out}


def _lowered_by_scan(model, per_layer: bool, key: str, lower: Callable) -> dict:
  """{scan_layers: {key: lower(model with those scan_layers)}} as _instance_program reads it:
  the model as configured and, under per_layer_upcast, scanned too (the smaller is used)."""
  scans = {model.scan_layers, True} if per_layer else {model.scan_layers}
  return {scan: {key: lower(model.replace(scan_layers=scan))} for scan in scans}


def rescore_mesh(cfg: PlanConfig, mesh) -> tuple[Any, bool]:
  """(the mesh the trainer's scorer on the training devices runs on, whether it is the folded
  one): PPOTrainer._rescorer's, the training mesh, or with pp > 1 and the serial rollout the
  mesh folded as the rollout's, where the mini-batch splits over it (trainer/loop.py
  on_folded)."""
  folded = mesh_lib.fold_stage(mesh)
  on_folded = (cfg.pp > 1 and cfg.generation == "mesh" and not cfg.generation_devices and
               cfg.minibatch_size % mesh_lib.batch_size_multiple(folded) == 0)
  return (folded if on_folded else mesh), on_folded


def critic_values_program(cfg: PlanConfig, mesh) -> dict:
  """Asynchronous PPO's value pass on the training devices (cfg.critic_values_pass;
  trainer/loop.PPOTrainer._current_values: each batch generated earlier scored with the
  current critic before its advantages), measured: {} where the run makes none.

  The trainer's own program: its Scorer (rescore_mesh) with a mini-batch a piece, lowered by
  Scorer.lower_values (the jitted scoring.critic_values) on the critic's whole parameters as
  the trainer passes them (pp == 1: the state's own, counted once beside the state:
  `state_critic_bytes`; pp > 1: Update.whole's gathered copy, beside the stage shards).
  Compiled twice under per_layer_upcast of the critic, like actor_logp_program."""
  if not cfg.critic_values_pass:
    return {}
  on, on_folded = rescore_mesh(cfg, mesh)
  shards = mesh_lib.batch_size_multiple(on)
  rows = cfg.minibatch_size  # the trainer's _rescorer: micro_batch_size=algo.minibatch_size
  scorer = scoring.Scorer(on, micro_batch_size=rows)
  per_layer = per_layer_upcast(cfg, [cfg.critic])
  lowered = _lowered_by_scan(cfg.critic, per_layer, "values", lambda critic: scorer.lower_values(
      critic, abstract_params(critic, on), cfg.minibatch_size, cfg.seq_len, cfg.response_len))
  out = _instance_program(cfg, "critic_values", lowered, "values",
                          actor_logp_analytic(cfg, rows, shards, cfg.critic), per_layer,
                          scan=cfg.critic.scan_layers)
  own = 0 if cfg.pp > 1 else _device_bytes(abstract_params(cfg.critic, mesh))
  out.update({"rows": rows, "pieces_split_over": shards,
              "mesh": "folded" if on_folded else "training", "state_critic_bytes": own})
  return {"critic_values": out}


def actor_copy_bytes(cfg: PlanConfig, mesh) -> int:
  """Bytes per training device of asynchronous PPO's copy of the actor (cfg.keeps_actor_copy;
  0 without one): trainer/loop.PPOTrainer._snapshot's _to_generation(copy=True), made before
  each update and kept through it and the next batch's generation. The actor's whole
  parameters in their dtype, split over fsdp x tensor as the trainer places them: pp == 1 a
  jnp.copy of the state's own; pp > 1 Update.whole's gathered copy (replicated over the
  stages), on the serial rollout's folded mesh placed alike (the same share)."""
  return _device_bytes(abstract_params(cfg.actor, mesh)) if cfg.keeps_actor_copy else 0


def group_actor_bytes(cfg: PlanConfig) -> int:
  """Bytes per device of asynchronous PPO's generation group (generation_devices > 0; 0
  without one): the actor's whole parameters in their dtype. The trainer moves the actor onto
  the group's data-only mesh, whole on every device (trainer/async_ppo.meshes,
  PPOTrainer._to_generation), and keeps that copy, the policy of the batch in flight, through
  the batch's generation and inference; on instances (generation="instances") each instance's
  own copy over its gen_tp devices is beside it."""
  return _nbytes(llama.param_shapes(cfg.actor)) if cfg.generation_devices else 0


def group_critic_bytes(cfg: PlanConfig) -> int:
  """Bytes per device of the critic on a generation group that scores values (group_critic:
  the trainer's async_ppo.staleness 0; 0 otherwise): whole, as group_actor_bytes, moved there
  with the actor (PPOTrainer._snapshot). Until 2026-12-07 split over gen_tp on the group's
  instances."""
  return (_nbytes(llama.param_shapes(cfg.critic))
          if cfg.generation_devices and cfg.group_critic else 0)


def group_instance_critic_bytes(cfg: PlanConfig, copy: float) -> float:
  """Bytes per device of the critic a generation group's freed instance loads to score values
  (group_critic on instances), beside the group's whole copy (group_critic_bytes): `copy`,
  the instance's share of it (a stage's with inference_pp > 1), or 0 where the instance keeps
  every leaf whole on one device (gen_tp 1, no inference pipeline): jax's device_put then
  hands the instance the group's own buffer of each leaf, nothing new is allocated (measured
  2026-12-07, jax 0.10.2, 8 CPU devices: an array replicated over a data-only mesh of 4 put
  onto one of them, or replicated onto 2 of them, shares the source's buffers; split over 2
  it gets new ones). Split over gen_tp devices, its replicated leaves (the norms) share too:
  `copy` counts them, an upper bound by a few kB. Until 2026-12-07 counted as 0 everywhere."""
  if not (cfg.generation_devices and cfg.group_critic and cfg.generation == "instances"):
    return 0.0
  return 0.0 if async_copies.shares_group_buffers(cfg.gen_model_shards, cfg.inference_pp) else copy


def actor_logp_analytic(cfg: PlanConfig, rows: int, shards: int,
                        model: ModelConfig | None = None) -> dict:
  """The perfect split of actor_logp_program's forward (critic_values_program's with `model`
  the critic): the model's whole weights split over fsdp x tensor (the state's own, or pp > 1
  a gathered copy), one layer's activations and an LM head's float32 logits of its rows per
  device (`rows` over `shards` batch shards), the FLOPs over every training device."""
  a = cfg.actor if model is None else model
  params = _nbytes(llama.param_shapes(a)) / (cfg.fsdp * cfg.tp)
  cost = CostModel(cfg.hardware)
  shape = sim_shapes.from_model_config(a, dtypes=True)
  acts = cost.activation_bytes(shape, cfg.tp, rows // shards * cfg.seq_len, 1)
  logits = cost.logits_bytes(shape, cfg.tp, rows / shards, cfg.response_len,
                             LOGITS_COPIES_SCORING)
  flops = accounting.forward_flops(a, rows, cfg.seq_len, cfg.response_len)
  return {"params_bytes": params, "activations_bytes": acts, "logits_bytes": logits,
          "total_bytes": params + acts + logits, "flops_per_device": flops / cfg.train_devices}


def _device_bytes(tree: Any) -> int:
  """Bytes one device holds of placed ShapeDtypeStructs (its shard of each; the shardings here
  split evenly, so every device holds as much)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _stage_cfg(model: ModelConfig, stages: int) -> ModelConfig:
  return model.replace(num_layers=model.num_layers // stages)


def train_analytic(cfg: PlanConfig, info: dict) -> dict:
  """Per-device bytes and FLOPs of the update if the plan split everything perfectly."""
  cost = CostModel(cfg.hardware)
  plain_tx = make_optimizer(staged=False, master_weights=cfg.master_weights)
  out = {"params_bytes": 0.0, "grads_bytes": 0.0, "optimizer_bytes": 0.0,
         "activations_bytes": 0.0}
  if cfg.pp == 1 and cfg.actor_microbatches > 1:
    out["grad_accumulator_bytes"] = 0.0  # float32 sums of the micro-batches' gradients
  trained = ((cfg.actor, cfg.pp),) + (((cfg.critic, cfg.critic_pp),) if cfg.trains_critic
                                      else ())  # a critic-free run trains the actor alone
  for model, n_stages in trained:
    rows = cfg.micro_rows if model is cfg.actor else cfg.critic_micro_rows
    shards = n_stages * cfg.tp * cfg.fsdp
    params = llama.param_shapes(model)
    out["params_bytes"] += _nbytes(params) / shards
    out["grads_bytes"] += _nbytes(params) / shards  # gradients in the parameters' dtype
    if "grad_accumulator_bytes" in out:
      # float32 sums split like the parameters, or with "once" each shard's sums of the
      # weights gathered over fsdp (split over tensor only), beside that gathered copy
      once = cfg.gradient_sync == "once"
      out["grad_accumulator_bytes"] += 4.0 * sum(math.prod(x.shape) for x in
                                                 jax.tree.leaves(params)) / (
                                                     cfg.tp if once else shards)
      if once:
        out["gathered_params_bytes"] = (out.get("gathered_params_bytes", 0.0) +
                                        _nbytes(params) / cfg.tp)
    # The same moments (and float32 copy) for the whole tree as for the stage-stacked one (the
    # mask moves no bytes); zero1 splits them over the model's copies too: data, and a
    # pipelined critic's pp / critic_pp replicas.
    copies = cfg.dp * (cfg.pp // n_stages) if cfg.zero1 else 1
    out["optimizer_bytes"] += _nbytes(jax.eval_shape(plain_tx.init, params)) / (shards * copies)
    # In flight per device under 1F1B: min(stages, micro-batches) (sim/training_sim.py); the
    # unpipelined update holds one micro-batch (the whole shard's rows without accumulation).
    micro = cfg.actor_microbatches if model is cfg.actor else cfg.critic_microbatches
    inflight = min(n_stages, micro) if cfg.pp > 1 else 1
    shape = sim_shapes.from_model_config(model, dtypes=True)
    out["activations_bytes"] += inflight * cost.activation_bytes(
        shape, cfg.tp, rows * cfg.seq_len, model.num_layers / n_stages)
    # The actor's update logits (the simulator's cost_model.train_memory_parts "logits").
    logits = cost.train_memory_parts(shape, cfg.tp, n_stages, 1, False, rows * cfg.seq_len,
                                     inflight, False, rows, cfg.response_len).get("logits")
    if logits:
      out["logits_bytes"] = logits
  out["total_bytes"] = sum(out.values())
  useful = accounting.ppo_update_flops(cfg.actor, cfg.critic if cfg.trains_critic else None,
                                       cfg.minibatch_size, cfg.prompt_len,
                                       cfg.response_len) / cfg.train_devices
  out["flops_per_device"] = useful
  if cfg.pp > 1:
    # A lockstep tick lasts as long as its costliest task: a last-stage backward (stage forward
    # recomputed + backward = 3 x forward, head and loss included), tp-way split.
    task = max(3.0 * accounting.forward_flops(_stage_cfg(m, s), rows, cfg.seq_len,
                                              cfg.response_len)
               for m, s, rows in ((cfg.actor, cfg.pp, cfg.micro_rows),
                                  (cfg.critic, cfg.critic_pp, cfg.critic_micro_rows)))
    out["lockstep_flops_per_device"] = info["ticks"] * task / cfg.tp
  else:
    out["lockstep_flops_per_device"] = useful
  return out


def decode_analytic(cfg: PlanConfig) -> dict:
  """One decode step of gen_slots rows over the whole cache (the chunk's loop exits early, so XLA
  knows no trip count: both sides count one step), split over the generation devices.

  `flops_counted_per_device` is what the compiled count can be compared with: where the step's
  attention runs the live-prefix loop over key blocks (models/attention.cached_attention, the
  path on CPU), that loop's trip count is traced too and its body, one block of CACHE_BLOCK_K
  keys, is counted once; `replication` divides by it, so that it shows split or repeated work
  rather than the loop's count."""
  a, n = cfg.actor, cfg.gen_devices
  params = _nbytes(llama.param_shapes(a))
  kv = accounting.decode_step_bytes(a, cfg.gen_slots, cfg.seq_len)["kv_bytes"]
  per_row = lambda keys: (2.0 * a.num_layers * accounting.layer_matmul_params(a) +
                          4.0 * a.num_layers * a.num_heads * a.head_dim_ * keys +
                          2.0 * a.hidden_size * a.vocab_size)
  impl = attention.instance_attention(a.attention, a.num_kv_heads, cfg.gen_tensor)
  loop = attention.cache_attention_path(impl, 1) == "loop"
  counted_keys = min(attention.CACHE_BLOCK_K, cfg.seq_len) if loop else cfg.seq_len
  shards = cfg.gen_model_shards
  kv /= cfg.gen_kv_shards
  total = params / shards + kv
  # A step reads at least the device's weights and cache once (the bandwidth bound).
  return {"params_bytes": params / shards, "kv_cache_bytes": kv, "total_bytes": total,
          "flops_per_device": cfg.gen_slots * per_row(cfg.seq_len) / n,
          "flops_counted_per_device": cfg.gen_slots * per_row(counted_keys) / n,
          "hbm_s": total / cfg.hardware.hbm_bw}


def prefill_analytic(cfg: PlanConfig) -> dict:
  """The prefill of gen_slots rows of prompt_len tokens, split over the generation devices:
  the weights, the new KV cache it writes whole (its output, [gen_slots, seq_len] positions),
  one layer's activations of every prompt token (sim/iteration_sim's 34*h bytes a token and
  layer), and the head's float32 logits at each row's last prompt position (the first token
  sampled)."""
  a, n = cfg.actor, cfg.gen_devices
  params = _nbytes(llama.param_shapes(a))
  kv = accounting.decode_step_bytes(a, cfg.gen_slots, cfg.seq_len)["kv_bytes"]
  cost = CostModel(cfg.hardware)
  shape = sim_shapes.from_model_config(a, dtypes=True)
  rows = cfg.gen_slots // cfg.gen_batch_shards if cfg.generation == "mesh" else cfg.gen_slots
  acts = cost.activation_bytes(shape, cfg.gen_tensor, rows * cfg.prompt_len, 1)
  logits = cost.logits_bytes(shape, cfg.gen_tensor, rows, 1, LOGITS_COPIES_SCORING)
  shards = cfg.gen_model_shards
  flops = accounting.forward_flops(a, cfg.gen_slots, cfg.prompt_len, 1)
  return {"params_bytes": params / shards, "kv_cache_bytes": kv / cfg.gen_kv_shards,
          "activations_bytes": acts, "logits_bytes": logits,
          "total_bytes": params / shards + kv / cfg.gen_kv_shards + acts + logits,
          "flops_per_device": flops / n}


def scoring_model(cfg: PlanConfig) -> ModelConfig | None:
  """The model of the inference program: the reference (the actor's shape, an LM head), or
  without one (cfg.reference False: algo.kl_coef=0) the critic; None without either (a
  critic-free run without a reference: the trainer's instances score no such forward, only the
  reward model where there is one, so there is no inference program)."""
  if cfg.reference:
    return cfg.actor
  return cfg.critic if cfg.trains_critic else None


def inference_analytic(cfg: PlanConfig, model: ModelConfig | None = None,
                       head_positions: int | None = None, stage: int | None = None) -> dict:
  """The perfect split of a scoring forward: `model`'s (the inference program's, scoring_model,
  when None) with its head at `head_positions` per row (the response's when None; a reward
  model's: 1, the last token); with `stage` (cfg.inference_pp > 1) that stage's: its weights
  (inference/stages.py), its layers' FLOPs, and the head's and its logits on the last."""
  a, n = model or scoring_model(cfg), cfg.gen_devices
  shapes = llama.param_shapes(a)
  params = _nbytes(shapes)
  last = stage is None or stage == cfg.inference_pp - 1
  if stage is not None:
    params = inf_stages.stage_nbytes(a, shapes, cfg.inference_pp, stage)
  if cfg.generation == "mesh":  # the whole rollout batch, split over the data axes
    rows = cfg.gen_slots
    tokens = rows // cfg.gen_batch_shards * cfg.seq_len
  else:  # one micro-batch on the instance's tensor devices
    rows = cfg.inference_microbatch
    tokens = rows * cfg.seq_len
  # One layer's activations live at a time (sim/iteration_sim.inference_memory_parts), and an
  # LM head's float32 logits at its positions (cost_model.LOGITS_COPIES_SCORING).
  cost = CostModel(cfg.hardware)
  shape = sim_shapes.from_model_config(a, dtypes=True)
  positions = cfg.response_len if head_positions is None else head_positions
  positions = positions if last else 0  # (a stage before the last runs no head)
  acts = cost.activation_bytes(shape, cfg.gen_tensor, tokens, 1)
  logits = cost.logits_bytes(shape, cfg.gen_tensor, tokens / cfg.seq_len, positions,
                             LOGITS_COPIES_SCORING)
  layers = a if stage is None else a.replace(num_layers=a.num_layers // cfg.inference_pp)
  flops = accounting.forward_flops(layers, rows, cfg.seq_len, positions)
  shards = cfg.gen_model_shards
  out = {"params_bytes": params / shards, "activations_bytes": acts, "logits_bytes": logits,
         "total_bytes": params / shards + acts + logits, "flops_per_device": flops / n}
  if stage is not None:  # (the whole model, as a generation group keeps it: beside_train_state)
    out["model_params_bytes"] = _nbytes(shapes) / shards
  return out


def _finish(measured: dict, analytic: dict) -> dict:
  """The measured figures beside the analytic ones; replication None for a program that should
  compute nothing (placement: a reshard)."""
  out = {**measured, "analytic": analytic}
  useful = analytic.get("flops_counted_per_device", analytic["flops_per_device"])
  out["replication"] = measured["flops_per_device"] / useful if useful else None
  if "lockstep_flops_per_device" in analytic:
    out["replication_lockstep"] = (measured["flops_per_device"] /
                                   analytic["lockstep_flops_per_device"])
  return out


def run(cfg: PlanConfig, workdir: str) -> dict:
  """Lowers, compiles and measures the programs (PROGRAMS, and the OPTIONAL_PROGRAMS the plan
  runs); returns the result dict."""
  if jax.device_count() < cfg.num_devices:
    raise ValueError(f"the plan needs {cfg.num_devices} devices (pp*tp*dp*fsdp="
                     f"{cfg.train_devices}, gen_tp={cfg.gen_tp}) but jax has "
                     f"{jax.device_count()}: run experiments/plan_check.py, which sets the count")
  hbm = cfg.hardware.hbm_bytes
  t_start = time.perf_counter()
  programs = {}
  mesh = train_mesh(cfg)
  tx = make_optimizer(staged=cfg.pp > 1, master_weights=cfg.master_weights)
  logging.info("plan: mesh %s, %d devices; actor %d layers (of %d), %s%s; "
               "compiling on %s", dict(mesh.shape), cfg.num_devices, cfg.actor.num_layers,
               cfg.actor_layers, f"critic {cfg.critic.num_layers} (of {cfg.critic_layers})"
               if cfg.trains_critic else "no critic (trains_critic False)",
               "" if cfg.reward is None else
               f", reward model {cfg.reward.num_layers} (of {cfg.reward_layers})", backend())
  if jax.default_backend() != "cpu":
    logging.warning("on %s, library calls hold most dots and are not counted: FLOPs and "
                    "replication undercount (memory figures are the compiler's)",
                    jax.default_backend())
  update, info = make_update(cfg, mesh, tx, workdir)
  t0 = time.perf_counter()
  args = train_args(cfg, mesh, tx, update)
  optimizer_bytes = sum(_device_bytes(s.opt_state) for s in args[:2] if s is not None)
  lowered = update.lower(*args)
  del args
  logging.info("train_step: lowered in %.1fs (%s schedule); compiling ...",
               time.perf_counter() - t0, info["schedule"])
  programs["train_step"] = {**_finish(measure(lowered, cfg.hardware), train_analytic(cfg, info)),
                            **info, "optimizer_state_bytes": optimizer_bytes}
  del lowered
  # Its figures now, not only in the table at the end: a run stopped while the other programs
  # compile (a GPU session's step at its timeout) keeps the plan's main one in its log.
  t = programs["train_step"]
  logging.info("train_step: compiled in %.1fs; per device: argument %s, output %s, temp %s, "
               "peak %s GB (HBM %s GB)", t["compile_s"], _gb(t["argument_bytes"]),
               _gb(t["output_bytes"]), _gb(t["temp_bytes"]), _gb(t["peak_bytes"]),
               _gb(t["hbm_bytes"]))
  programs.update(instance_programs(cfg))
  programs.update(placement_programs(cfg, mesh, update))
  programs.update(actor_logp_program(cfg, mesh))
  programs.update(critic_values_program(cfg, mesh))
  critic = _nbytes(llama.param_shapes(cfg.critic)) / cfg.gen_model_shards
  copy = critic  # what a freed instance loads of the critic: a stage of it in a pipeline
  if not cfg.trains_critic:  # a critic-free run loads none
    copy = 0.0
  elif cfg.inference_pp > 1:
    copy = max(inf_stages.stage_nbytes(cfg.critic, llama.param_shapes(cfg.critic),
                                       cfg.inference_pp, s)
               for s in range(cfg.inference_pp)) / cfg.gen_model_shards
  group = bool(cfg.generation_devices)
  beside_train_state(programs, hbm, cfg.offload_optimizer, group, group_critic_bytes(cfg),
                     cfg.reference,
                     cfg.generation,
                     critic_copy_bytes=group_instance_critic_bytes(cfg, copy) if group else copy,
                     pipelined=cfg.pp > 1, actor_copy_bytes=actor_copy_bytes(cfg, mesh),
                     group_actor_bytes=group_actor_bytes(cfg),
                     group_actor_shared=async_copies.shares_group_buffers(cfg.gen_model_shards))
  models = {"actor": cfg.actor, "critic": cfg.critic}
  full = {"actor": cfg.actor_layers, "critic": cfg.critic_layers}
  if not cfg.trains_critic:  # (compiled nowhere)
    del models["critic"], full["critic"]
  if cfg.reward is not None:
    models["reward"], full["reward"] = cfg.reward, cfg.reward_layers
  return {
      "plan": {"pp": cfg.pp, "critic_pp": cfg.critic_pp, "tp": cfg.tp, "dp": cfg.dp,
               "fsdp": cfg.fsdp, "minibatch_size": cfg.minibatch_size,
               "microbatch_size": cfg.microbatch_size, "seq_len": cfg.seq_len,
               "response_len": cfg.response_len, "remat": cfg.actor.remat,
               "scan_layers": cfg.actor.scan_layers,
               "attention": cfg.actor.attention, "intra_stage": cfg.intra_stage,
               "gen_tp": cfg.gen_tp, "gen_slots": cfg.gen_slots, "chunk_size": cfg.chunk_size,
               "inference_microbatch": cfg.inference_microbatch, "hardware": cfg.hardware.name,
               "offload_optimizer": cfg.offload_optimizer,
               "migration_rows": cfg.migration_rows,
               "master_weights": cfg.master_weights, "zero1": cfg.zero1,
               "generation": cfg.generation,
               "gradient_sync": cfg.gradient_sync,
               "critic_microbatch_size": cfg.critic_microbatch_size,
               "generation_devices": cfg.generation_devices, "group_critic": cfg.group_critic,
               "search_seed": cfg.search_seed, "search_evaluations": cfg.search_evaluations,
               "reference": cfg.reference, "trains_critic": cfg.trains_critic,
               "reward_model": cfg.reward is not None, "old_logp": cfg.old_logp,
               "staleness": cfg.staleness, "actor_logp_pass": cfg.actor_logp_pass,
               "actor_copy_bytes": programs["train_step"]["actor_copy_bytes"],
               "group_actor_bytes": group_actor_bytes(cfg)},
      "devices": cfg.num_devices, "train_devices": cfg.train_devices,
      "models": {name: {**dataclasses.asdict(m), "num_params": m.num_params()}
                 for name, m in models.items()},
      "layers_compiled": {**{name: m.num_layers for name, m in models.items()},
                          **{f"{name}_full": full[name] for name in models},
                          "reduced": any(m.num_layers != full[name]
                                         for name, m in models.items())},
      "programs": programs,
      "notes": {
          "per_device": "memory_analysis and the HLO are one SPMD partition: every byte and "
                        "FLOP is per device",
          "peak_bytes": "argument_bytes + output_bytes + temp_bytes - alias_bytes",
          "flops_per_device": "dot FLOPs of the optimized HLO with loop bodies times their "
                              "trip counts and conditionals at their costliest branch "
                              "(rlhfuse_jax/perf/hlo_flops.py); xla_flops is "
                              "cost_analysis()['flops'] (loop bodies once, elementwise "
                              "included)",
          "analytic": "the plan's perfect split; activations: the simulator's 34*h bytes per "
                      "token and layer at 16 bits (x2 for float32 models; no remat), "
                      "in-flight micro-batches min(stages, M); "
                      "gradients in the parameters' dtype, split like them (the pipelined "
                      "executor accumulates float32 over its stage plus the whole embedding "
                      "and head, and splits embedding, head and norms over the stage devices "
                      "only: the compiled figures include that)",
          "replication": "flops_per_device / analytic flops_per_device; "
                         "replication_lockstep divides by ticks x the costliest task instead",
          "layers_compiled": "with reduced=true every number is of the compiled layer counts "
                             "(config.layers), not of the full models",
          "cpu": "XLA:CPU buffer assignment: temp_bytes estimate XLA:GPU's",
          "fits": "peak_with_train_state_bytes <= hbm_bytes (fits_alone: the program's peak "
                  "by itself): for decode, inference and reward their peak plus "
                  "resident_train_bytes (the training state that stays on the same devices: "
                  "train_step's argument bytes, minus offloaded_optimizer_bytes when "
                  "offload_optimizer; 0 on an asynchronous PPO generation group) plus "
                  "resident_model_bytes (the models kept beside it where the run keeps them: "
                  "a freed instance's other scoring models, the serial stage's reference and "
                  "reward model, the group's other models); for train_step its peak, plus "
                  "on the serial stage the reference and reward model kept on the mesh; for "
                  "placement the training state plus the most any of its parts adds to it "
                  "(over_state_bytes); for actor_logp its peak plus the training state less "
                  "the state's own actor its arguments count (state_actor_bytes), plus on the "
                  "serial stage the reference and reward model; for critic_values the same "
                  "with the state's own critic (state_critic_bytes); plus, with asynchronous "
                  "PPO on the training devices, actor_copy_bytes: its copy of the actor for "
                  "the next batch, beside the train step and the generation's programs "
                  "(beside_train_state says which); no "
                  "headroom (the simulator plans with 90 % of HBM)",
          "gpu_flops": "on a GPU backend library calls (cuBLAS / cuDNN custom-calls) hold most "
                       "dots, which hlo_flops does not count: flops_per_device and replication "
                       "undercount there",
      },
      "wall_s": time.perf_counter() - t_start,
      "backend": backend(),
      "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
  }


def beside_train_state(programs: dict, hbm: float, offload_optimizer: bool,
                       generation_group: bool = False, group_critic_bytes: float = 0.0,
                       reference: bool = True, generation: str = "instances",
                       critic_copy_bytes: float = 0.0, pipelined: bool = False,
                       actor_copy_bytes: float = 0.0, group_actor_bytes: float = 0.0,
                       group_actor_shared: bool = False) -> None:
  """What stays on a program's devices beside it, and whether the program fits with that.

  The training state: the trainer keeps the actor's and critic's (stage shards of parameters
  and AdamW moments: the train step's arguments) on every training device for the whole run,
  and the generation instances, the freed instances' inference and the serial stage run on
  those same devices: decode and the scoring programs fit when their peak on top of that state
  does, less the moments when the trainer moves them to host memory during the rollout
  (optim.offload_during_rollout).

  The models, per device of the generation layout (each program's analytic params_bytes: the
  actor's for decode, the reference's (the actor's size; a stage of it on pipelines of
  instances, inference_pp), the reward model's):
  - asynchronous PPO's generation group (`generation_group`) keeps no training state but the
    actor, the reference (with a `reference`; none at algo.kl_coef=0), the reward model and,
    where the group also scores values (`group_critic_bytes`: the critic's weights per device),
    the critic whole beside each other (build.Models.frozen_to_mesh): each program has those
    other than its own beside it (an upper bound on the group's instances, which load the
    scoring models from host memory when freed); on the group's instances a freed instance's
    scoring programs also have its own copy of the critic (`critic_copy_bytes` here:
    group_instance_critic_bytes, 0 where it is the group's buffer) beside the whole one,
    loaded from it (the critic's own forward: the whole one beside its copy). The actor there
    is `group_actor_bytes` (group_actor_bytes(): whole on every device of the group's
    data-only mesh, kept through generation and inference; 0: decode's params_bytes), and on
    the group's instances it is beside their programs too, decode's, prefill's and a
    migration's included (their argument is the instance's own copy over its gen_tp devices;
    until 2026-12-07 that copy was counted as the group's actor, gen_tp times less than the
    trainer holds), but where the instance's copy is the group's own buffers
    (`group_actor_shared`: gen_tp 1, async_copies.shares_group_buffers), its argument: counted
    once (until 2026-12-07 twice, a safe over-count);
  - instances on the training devices (`generation`="instances"): the frozen models wait in
    host memory and an instance freed for inference loads all its scoring models at once
    (generation/fused.InferenceQueue._load): the reference, the critic's copy
    (`critic_copy_bytes`; none for a run without a critic) and the reward model; each scoring
    program has the others beside it, decode none;
  - the serial stage on the training mesh (`generation`="mesh"): the reference and the reward
    model stay on the mesh for the whole run, the train step included (its
    peak_with_train_state_bytes here is its peak plus them); unpipelined, decode reads the
    state's own actor, counted twice in its figures, which stands for the reference (the same
    size: an over-count without one), so decode has the reward model beside it; `pipelined`
    (pp > 1), its actor is a gathered copy beside the stage shards of the state, and the
    reference is beside it too.

  actor_logp and critic_values (the actor's log-prob pass, async PPO's value pass: on the
  training devices after the rollout, the optimizer state back) have the whole training state
  beside them, less the state's own model where their arguments count it (TRAINING_PASSES:
  state_actor_bytes, state_critic_bytes), and on the serial stage the frozen models kept on the
  mesh; the instances' and a generation group's models are elsewhere then.

  placement (the hand-over of the actor, on the training devices) has the training state
  beside it, also with a generation group (less the optimizer state where the rollout has
  moved it out: never beside a group), and adds the most any of its parts adds
  (over_state_bytes); the frozen models wait in host memory then.

  Asynchronous PPO on the training devices (`actor_copy_bytes`: actor_copy_bytes(), per
  device; 0 without one) keeps a copy of the actor for the next batch's generation from before
  the update to the end of that generation (trainer/loop.PPOTrainer._snapshot), each program's
  `actor_copy_bytes` beside it: the train step's; the instances' programs' (a copy in the
  training layout beside the instance's own weights; an upper bound where the instances' reshard
  leaves some of its leaves in place); the serial stage's scoring programs'; the unpipelined
  hand-over's (its argument is the copy, beside the state's own actor). Not beside the serial
  stage's decode and prefill, which read the copy as their argument (unpipelined, the state's
  own actor is then a second count no longer standing for the reference: the reference is
  beside them), nor a pipelined hand-over's (the copy is its output or argument), nor
  actor_logp and critic_values (they run before the copy is made)."""
  train = programs["train_step"]
  offloaded = train["optimizer_state_bytes"] if offload_optimizer else 0
  actor = programs["decode"]["analytic"]["params_bytes"]

  def size(name: str) -> float:
    """A scoring program's model: its weights (a stage's on pipelines of instances), whole on
    a generation group, which keeps the frozen models on its mesh."""
    analytic = programs[name]["analytic"]
    whole = analytic.get("model_params_bytes") if generation_group else None
    return whole or analytic["params_bytes"]

  frozen = {"reference": size("inference") if reference else 0.0,
            "reward": size("reward") if "reward" in programs else 0.0}
  # (a migration reads no weights: the instance's actor is beside it, added below; on a
  # generation group's instances this was a KeyError)
  own = {"decode": "actor", "prefill": "actor", "migrate": "actor",
         "inference": "reference" if reference else "critic", "reward": "reward"}
  serial = generation == "mesh" and not generation_group
  copy = 0.0 if generation_group else actor_copy_bytes
  if generation_group:
    kept = {"actor": group_actor_bytes or actor, "critic": group_critic_bytes, **frozen}
    if generation == "instances" and group_actor_bytes and not group_actor_shared:
      # beside the instance's own copy (at gen_tp 1 it is the group's: decode's argument)
      own["decode"] = own["prefill"] = own["migrate"] = "instance"
  elif serial:
    kept = frozen
    if not pipelined and not copy:
      own["decode"] = own["prefill"] = "reference"  # its second count of the actor
  else:
    kept = {"critic": critic_copy_bytes, **frozen}
  train["actor_copy_bytes"] = copy
  if serial or copy:
    train.setdefault("fits_alone", train["fits"])
    train["resident_model_bytes"] = sum(kept.values()) if serial else 0.0
    train["peak_with_train_state_bytes"] = (train["peak_bytes"] +
                                            train["resident_model_bytes"] + copy)
    train["fits"] = bool(train["peak_with_train_state_bytes"] <= hbm)
  for name in PROGRAMS[1:] + OPTIONAL_PROGRAMS:  # the generation devices' programs
    if name not in programs:
      continue
    p = programs[name]
    p.setdefault("fits_alone", p["fits"])
    p["offloaded_optimizer_bytes"] = 0 if generation_group else offloaded
    p["resident_train_bytes"] = 0 if generation_group else train["argument_bytes"] - offloaded
    if name in TRAINING_PASSES:  # on the training devices, beside the whole state
      p["actor_copy_bytes"] = 0.0  # (made after them)
      p["offloaded_optimizer_bytes"] = 0
      p["resident_train_bytes"] = train["argument_bytes"] - p[TRAINING_PASSES[name]]
      p["resident_model_bytes"] = sum(kept.values()) if serial else 0.0
      p["peak_with_train_state_bytes"] = (p["peak_bytes"] + p["resident_train_bytes"] +
                                          p["resident_model_bytes"])
      p["fits"] = bool(p["peak_with_train_state_bytes"] <= hbm)
      continue
    if name == "placement":  # beside the state: its parts' own additions (placement_programs)
      # On the training devices, also for a generation group; the optimizer state is in host
      # memory then where the rollout moves it (on the training devices; the trainer refuses
      # optim.offload_during_rollout beside a generation group).
      moved_out = 0 if generation_group else offloaded
      p["offloaded_optimizer_bytes"] = moved_out
      p["resident_train_bytes"] = train["argument_bytes"] - moved_out
      p["resident_model_bytes"] = 0.0  # the frozen models wait in host memory
      # pp > 1: the copy is the conversion's output, then the reshard's argument
      p["actor_copy_bytes"] = 0.0 if pipelined else copy
      p["peak_with_train_state_bytes"] = (p["resident_train_bytes"] + p["actor_copy_bytes"] +
                                          max(p["over_state_bytes"].values()))
      p["fits"] = bool(p["peak_with_train_state_bytes"] <= hbm)
      continue
    # Generation on instances: nothing loaded yet beside prefill, decode and a migration;
    # a migration reads no weights, but the instance's own stay beside it.
    idle = name in ("prefill", "decode", "migrate") and not (generation_group or serial)
    p["resident_model_bytes"] = 0.0 if idle else sum(
        v for k, v in kept.items() if k != own[name])
    if generation_group and critic_copy_bytes and name in ("inference", "reward"):
      # a freed instance's own copy of the critic beside the group's whole one
      p["resident_model_bytes"] += (kept["critic"] if own[name] == "critic" else
                                    critic_copy_bytes)
    if name == "migrate":
      p["resident_model_bytes"] += actor
    # (the serial stage's decode and prefill read the copy: their argument)
    p["actor_copy_bytes"] = 0.0 if serial and name in ("decode", "prefill") else copy
    p["peak_with_train_state_bytes"] = (p["peak_bytes"] + p["resident_train_bytes"] +
                                        p["resident_model_bytes"] + p["actor_copy_bytes"])
    p["fits"] = bool(p["peak_with_train_state_bytes"] <= hbm)


def backend() -> dict:
  """What compiled the programs. On one GPU, jax's mock topology (JAX_MOCK_GPU_TOPOLOGY=1xNx1:
  N one-GPU hosts, this process host 0, NCCL mocked) makes N devices to compile an N-GPU plan
  for; only one is local, and nothing here needs more (programs are compiled, never run)."""
  devices = jax.devices()
  return {"platform": jax.default_backend(), "device_kind": devices[0].device_kind,
          "device_count": len(devices), "local_device_count": jax.local_device_count(),
          "process_count": jax.process_count(),
          "mock_gpu_topology": os.environ.get("JAX_MOCK_GPU_TOPOLOGY") or None}


def run_and_write(cfg: PlanConfig, workdir: str) -> dict:
  result = run(cfg, workdir)
  runner.write_result(workdir, result)
  return result


def _fixed(x: float, decimals: int) -> str:
  """`decimals` decimals where they show 2 significant digits or more, else 3 significant digits
  in e-notation (runner.fixed_or_sci; plan_search's report uses it for seconds)."""
  return fixed_or_sci(x, decimals, significant=2)


def _gb(x: float) -> str:
  return _fixed(x / 1e9, 2)


def table(result: dict) -> list[str]:
  """The log table: one line per program (GB = 1e9 bytes; figures too small for a column's
  decimals with 3 significant digits: _fixed)."""
  w = max(len(name) for name in PROGRAMS + OPTIONAL_PROGRAMS)  # every table the same widths
  lines = [f"{'program':<{w}} {'arg GB':>8} {'out GB':>8} {'temp GB':>8} {'peak GB':>8} "
           f"{'+state GB':>9} {'HBM GB':>7} {'fits':>5} {'analytic GB':>11} {'TFLOP/dev':>10} "
           f"{'repl':>6} {'compile s':>9}"]
  for name in program_names(result):
    p = result["programs"][name]
    with_state = p.get("peak_with_train_state_bytes")
    lines.append(f"{name:<{w}} {_gb(p['argument_bytes']):>8} {_gb(p['output_bytes']):>8} "
                 f"{_gb(p['temp_bytes']):>8} {_gb(p['peak_bytes']):>8} "
                 f"{_gb(with_state) if with_state is not None else '-':>9} "
                 f"{_gb(p['hbm_bytes']):>7} {str(p['fits']):>5} "
                 f"{_gb(p['analytic']['total_bytes']):>11} "
                 f"{_fixed(p['flops_per_device'] / 1e12, 3):>10} "
                 f"{'-' if p['replication'] is None else format(p['replication'], '.2f'):>6} "
                 f"{p['compile_s']:>9.1f}")
  lines.append(f"time bounds on {result['plan']['hardware']} (s; one decode step): "
               "collectives one after another (as compiled; and at the widths the program asks "
               "for, 16-bit where XLA:CPU widened them to float32), dots at peak FLOP/s, HBM "
               "reads of the perfect split (decode)")
  lines.append(f"{'program':<{w}} {'coll GB':>8} {'coll s':>9} {'16b GB':>8} {'16b s':>9} "
               f"{'dots s':>9} {'HBM s':>9}")
  for name in program_names(result):
    p = result["programs"][name]
    if "collective_s" not in p:  # a result.json written before collectives were counted
      continue
    hbm_s = p["analytic"].get("hbm_s")
    narrow_gb, narrow_s = "-", "-"  # absent: no dump (off CPU; an older result.json)
    if "program_collective_s" in p:
      narrow_gb = _gb(sum(p["program_collective_bytes"].values()))
      narrow_s = _fixed(p["program_collective_s"], 4)
    lines.append(f"{name:<{w}} {_gb(sum(p['collective_bytes'].values())):>8} "
                 f"{_fixed(p['collective_s'], 4):>9} {narrow_gb:>8} {narrow_s:>9} "
                 f"{_fixed(p['compute_s'], 4):>9} "
                 f"{'-' if hbm_s is None else _fixed(hbm_s, 4):>9}")
  return lines + per_layer_notes(result) + link_bound_notes(result) + [verdict(result)]


def verdict(result: dict) -> str:
  """The table's last line: whether every program fits, the ones that do not with what would
  shrink their largest term, and, when fewer layers were compiled (config.layers), that the
  figures are of those layers, not of the model."""
  over = [name for name in program_names(result) if not result["programs"][name]["fits"]]
  if not over:
    line = f"verdict: every program fits in {_gb(result['programs'][PROGRAMS[0]]['hbm_bytes'])} GB"
  else:
    plan = result.get("plan", {})
    # (no stages for a run without a critic: the trainer pipelines PPO's pair only)
    more = ("more tensor devices" if plan.get("trains_critic") is False else
            "more stages or tensor devices")
    split = ([] if plan.get("zero1") else ["zero1 (a run's optim.zero1)"]) + ["fsdp", more]
    # (not where the trainer refuses it: asynchronous PPO, a generation group)
    offload = [] if (plan.get("offload_optimizer") or plan.get("staleness") or
                     plan.get("generation_devices")) else [
        "offload_optimizer (a run's optim.offload_during_rollout)"]
    # The models kept beside: where the run keeps them (beside_train_state).
    if plan.get("generation_devices"):
      # (more generation devices split the batch only: the group's data-only mesh keeps the
      # models whole on every device, group_actor_bytes; proposed here until 2026-12-07)
      models = ["generation on the training devices (generation_devices 0: a run's "
                "async_ppo.generation_devices; a generation group keeps the models whole on "
                "every device)"]
    elif plan.get("generation") == "mesh":
      models = ["generation on instances (a run's plan.generation='instances' or "
                "fusion.inter_stage: the frozen models wait in host memory)"]
    else:
      models = ["more devices per instance (gen_tp: a run's fusion.instance_devices or "
                "plan.generation_tp)"]
    slots = ("fewer slots per instance (gen_slots: a run's plan.generation_slots, "
             "fusion.slots or rollout batch)")
    # A generation group takes the copy off the training devices, but the group's programs
    # hold the actor whole on every device beside them (group_actor_bytes): fsdp x tensor
    # times the copy. Proposed for the programs on the training devices alone (until
    # 2026-12-07 for decode and the scoring programs too, which it makes larger).
    group_remedy = ("a generation group (generation_devices: a run's "
                    "async_ppo.generation_devices; the copy is the group's actor there)")
    fixes = {"arguments": split, "the training state beside it": offload + split,
             "the models beside it": models,
             # asynchronous PPO's copy of the actor on the training devices (actor_copy_bytes)
             "the actor's copy beside it": [
                 group_remedy,
                 "fsdp or more tensor devices (the copy is split over them)",
                 "staleness 0 (a run's async_ppo.staleness: no copy)"],
             # a KV cache written whole (prefill): its rows and their length
             "outputs": [slots,
                         "shorter sequences (seq_len: a run's data.max_prompt_len + "
                         "rollout.max_new_tokens)"] + (
                             [] if plan.get("generation_devices") or
                             plan.get("generation") == "mesh" else models)}
    # Temporaries: each program's own knob, with the run's field (plan_check --run_config
    # says config.<field> of the run; "smaller or more micro-batches" named neither).
    temporaries = {
        "train_step": [("more micro-batches (microbatch_size, the rows of one: a run's "
                        "pipeline.actor_microbatches / critic_microbatches)")
                       if plan.get("pp", 1) > 1 else
                       "smaller micro-batches (microbatch_size: a run's algo.microbatch_size)",
                       "remat (a run's model.remat)"],
        "decode": [slots],
        "prefill": [slots, "shorter prompts (prompt_len: a run's data.max_prompt_len)"],
        "inference": ["smaller micro-batches (inference_microbatch: a run's "
                      "fusion.inference_micro_batch, 0 = the slots)"]}
    temporaries["reward"] = temporaries["inference"]
    logp = result["programs"].get("actor_logp", {})
    temporaries["actor_logp"] = (
        ["smaller micro-batches (microbatch_size: a run's algo.microbatch_size)"]
        if logp.get("pass") == "recompute" and plan.get("pp", 1) == 1 else
        ["a smaller mini-batch (minibatch_size: a run's algo.minibatch_size)"]) + (
            ["no recomputation (a run's algo.old_logp='generation')"]
            if logp.get("pass") == "recompute" else [])
    temporaries["critic_values"] = ["a smaller mini-batch (minibatch_size: a run's "
                                    "algo.minibatch_size)"]
    # A migration's copy of its rows: its output (gather), an argument (scatter) or temp.
    rows = ["fewer rows a migration moves at once (migration_rows: a run's "
            "fusion.migration_rows)"]
    temporaries["migrate"] = rows + temporaries["decode"]
    # The hand-over's copies and temporaries, by its part that adds the most: a pipelined
    # model's conversion (gathered with unrolled layers; else one stage's layers), or the
    # reshard onto the instances (their shares, and a gathered copy it reads).
    gathered = plan.get("pp", 1) > 1 and not plan.get("scan_layers")
    scan = ["scanned layers (scan_layers: a run's model.scan_layers; a pipelined model is "
            "then handed over split over the stages, not gathered)"]
    handover = {"unstack": scan if gathered else ["fsdp", more],
                "reshard": (scan if gathered else []) + models}
    hints = []
    for name in over:
      p = result["programs"][name]
      # What decides is the peak beside what stays on the same devices (beside_train_state;
      # the program's own peak alone was shown, below the HBM it exceeds): the training state
      # and the models kept there, each a term of its own with its own remedy.
      beside = {"the training state": p.get("resident_train_bytes", 0),
                "the models": p.get("resident_model_bytes", 0),
                "the actor's copy": p.get("actor_copy_bytes", 0)}
      # Outputs not written into a donated argument: prefill's new KV cache, the largest term
      # of an instance's prefill (its arguments are the weights alone).
      terms = {"temporaries": p["temp_bytes"], "arguments": p["argument_bytes"],
               "outputs": p.get("output_bytes", 0) - p.get("alias_bytes", 0),
               **{f"{kept} beside it": b for kept, b in beside.items()}}
      peak = p["peak_bytes"] + sum(beside.values())
      if name == "placement":  # its part that adds the most: the copies it holds, its temp
        part = max(p["over_state_bytes"], key=p["over_state_bytes"].get)
        q = p["parts"][part]
        terms.update(temporaries=q["temp_bytes"], outputs=0,
                     arguments=p["over_state_bytes"][part] - q["temp_bytes"])
        peak = p["peak_with_train_state_bytes"]
        temporaries[name] = handover[part.split("_")[0]]
      largest = max(terms, key=terms.get)
      own = (largest == "temporaries" or (name == "placement" and largest == "arguments")
             or (name == "migrate" and largest in ("outputs", "arguments")))
      fix = temporaries[name] if own else fixes[largest]
      if ((name == "placement" and plan.get("generation_devices") or name in TRAINING_PASSES)
          and not own):
        # (the trainer refuses it beside a group; the pass runs with the state moved back)
        fix = [f for f in fix if f not in offload]
      if name not in ("train_step", "placement"):
        fix = [f for f in fix if f != group_remedy]
      remedy = f": {', '.join(fix)}" if fix else ""
      kept = " and ".join(k for k, b in beside.items() if b)
      hints.append(f"{name} (peak {_gb(peak)} of "
                   f"{_gb(p['hbm_bytes'])} GB" + (f" with {kept}" if kept else "") +
                   f"; largest: {largest}{remedy})")
    line = "verdict: DOES NOT FIT: " + "; ".join(hints)
  lc = result.get("layers_compiled", {})
  if lc.get("reduced"):
    reward = (f", {lc['reward']} of {lc['reward_full']} reward model layers" if "reward" in lc
              else "")
    # (a critic-free run's result has no critic: trains_critic False)
    critic = (f" and {lc['critic']} of {lc['critic_full']} critic layers" if "critic" in lc
              else "")
    line += (f" -- for {lc['actor']} of {lc['actor_full']} actor layers{reward}{critic} "
             "(config.layers): not a verdict on the whole models")
  return line


# A program whose collectives take this many times its dots' (and decode's HBM reads') time is
# reported as bound by the links.
LINK_BOUND_RATIO = 2.0
# ... if they take at least this long. Below it the ratio says nothing a plan should act on: a
# few small collectives' latencies against microseconds of dots (the tiny configs: a 4 ms update,
# 0.1 ms a decode step and scoring forward, thousands of times their dots). The update and the
# scoring forward run a few times an iteration, which takes seconds at any real scale; a decode
# step runs once per generated token, hundreds of times, hence its lower floor (a 1B actor decoding
# on a mesh of 8 H100s that splits its weights gathers their 2 GB in ~5 ms a step: above it).
LINK_BOUND_MIN_S = {"train_step": 0.01, "decode": 0.001, "prefill": 0.01, "inference": 0.01,
                    "reward": 0.01, "actor_logp": 0.01, "critic_values": 0.01}


def per_layer_notes(result: dict) -> list[str]:
  """One line naming the programs of unrolled layers whose temp in the table is their scanned
  compile's (cpu_upcast per_layer, `_instance_program`), each with the temp of the program as
  configured. That figure holds XLA:CPU's float32 copy of the weights, which a GPU does not
  make, and also what only the unrolled program holds: a 7B prefill of 4 layers over fsdp 8
  holds 3.35 GB as compiled and grows 148 MB a layer, against 2.08 GB scanned per layer
  (docs/results.md "Unrolled layers in mesh generation")."""
  parts = []
  for name in program_names(result):
    rec = result["programs"][name].get("cpu_upcast") or {}
    if rec.get("used") == "per_layer" and rec["as_compiled"].get("scan_layers") is False:
      parts.append(f"{name} {_gb(rec['as_compiled']['temp_bytes'])}")
  if not parts:
    return []
  return ["temp of the scanned compile for unrolled layers (cpu_upcast=per_layer); GB as "
          "compiled: " + ", ".join(parts)]


def link_bound_notes(result: dict, min_s: dict | None = None) -> list[str]:
  """One line per program whose collectives outlast its other bounds LINK_BOUND_RATIO times
  and take at least its `min_s` (LINK_BOUND_MIN_S; {}: no floor), with the plan change that
  addresses the cause this plan has (docs/usage.md "Communication at scale")."""
  floors = LINK_BOUND_MIN_S if min_s is None else min_s
  plan, lines = result["plan"], []
  for name in program_names(result):
    p = result["programs"][name]
    if "collective_s" not in p or name == "placement":  # (a reshard: nothing but collectives)
      continue
    other = max(p["compute_s"], p["analytic"].get("hbm_s") or 0.0)
    # At the program's widths where known: XLA:CPU's float32 copies of 16-bit collectives
    # would call a plan link-bound that a GPU is not.
    coll = p.get("program_collective_s", p["collective_s"])
    if coll <= LINK_BOUND_RATIO * other or coll < floors.get(name, 0.0):
      continue
    line = (f"{name}: its collectives take >= {coll:.3g} s, "
            f"{coll / max(other, 1e-30):.0f}x its other bounds: bound by the links")
    if (name != "train_step" and name not in TRAINING_PASSES and plan["generation"] == "mesh"
        and plan["fsdp"] > 1 and not plan.get("generation_devices")):
      line += ("; on the training mesh every step gathers the fsdp-split weights "
               "(the trainer's plan.generation='instances' reshards them once per iteration)")
    elif (name == "train_step" and plan["pp"] == 1 and p.get("accumulated_microbatches", 1) > 1
          and plan.get("gradient_sync", "per_microbatch") == "per_microbatch"):
      line += (f"; each of its {p['accumulated_microbatches']} micro-batches gathers the weights "
               "and reduces the gradients (algo.gradient_sync='once' does so once per step, "
               "holding the gathered weights and float32 sums)")
    if (name == "train_step" and plan["pp"] == 1 and plan["fsdp"] > 1 and
        plan.get("trains_critic") is not False):  # (a critic-free run takes no stages)
      line += ("; a pipeline keeps each stage's layers where they are used (mesh.stage, "
               "pipeline.*: configs/ppo_llama.py:fused/<pair>, plan_search)")
    lines.append(line)
  return lines


if __name__ == "__main__":
  raise SystemExit("experiments/plan_programs.py is plan_check's library; run: python -m "
                   "experiments.plan_check --config=configs/plan_check.py:tiny --workdir=DIR")
