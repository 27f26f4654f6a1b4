r"""Compile a plan's real programs from shapes on fake CPU devices and check their memory.

  python -m experiments.plan_check --config=configs/plan_check.py:tiny --workdir=/tmp/pc_tiny
  python -m experiments.plan_check --config=configs/plan_check.py:7b_host8 --workdir=/tmp/pc_7b8

Variants: `tiny` (seconds; the test's), `7b_host8` (the 7B pair on one 8-GPU host), and the
RLHFuse paper's pairs `7b/7b`, `13b/13b`, `33b/13b`, `65b/33b` on the plan the simulator picks
for them on 256 H100s (sim/training_sim.best_plan, whole layers per stage: tp 4; 7B and 13B 8
stages, dp 8; 33B/13B 4 stages, dp 16; 65B/33B 16 actor and 4 critic stages, dp 4; micro-batch
1; generation tp 8 with the slots of sim/iteration_sim.gen_plan for the trainer's engine beside
the training state, tp 4 for 33B, whose 52 heads do not split 8 ways). Those compile a 256-device
program; `--config.layers=N` compiles N layers per model instead (result.json says so in
`layers_compiled`). `llama/<variant>` (`llama/13b`, `llama/65b/33b`, ... any variant of
configs/ppo_llama.py) checks that preset as its trainer runs it, on its smallest device count
(one model replica, data 1: fsdp x tensor devices, or stage x tensor for the pipelined
`fused/` presets): its update with its micro-batches, generation and scoring where its
plan.generation puts them;
`hf_gpu/<model>` the same for configs/ppo_hf.py:ppo_gpu on the models of docs/own_model.md
(HF_MODELS); `run/<config file>[:<variant>]` for any training config, as train_ppo's --config
names it (its checkpoints' config.json for the architectures):
  python -m experiments.plan_check --config=configs/plan_check.py:run/configs/ppo_hf.py:ppo_gpu --workdir=/tmp/pc_run
Writes result.json and config.json; logs a table.
"""
import ml_collections

# Plans of sim/training_sim.best_plan and sim/iteration_sim.gen_plan (h100_sxm, 256 devices,
# mini-batch 64, micro-batch 1, prompts up to 1024 + 1024 new tokens), re-read 2026-12-05.
# gen_slots: the slots gen_plan gives at gen_tp for the trainer's engine, which prefills every
# slot at the longest prompt (Workload.kv_at_max_prompt), beside the training state the
# colocated plan keeps on the devices (iteration_sim.train_state_bytes): 90 % of HBM less the
# actor's weights, that state and room for a migration's copy of 8 slots (migration_rows), over
# a slot's KV cache of 1024 + 1024 tokens and its prompt's prefill activations; at most 256.
# 33B generates at tp 4 (52 heads), where its weights take twice the memory per device. Until
# 2026-12-05 the slots filled the KV budget alone (68 and 82, with the optimizer state moved to
# host memory): their prefill did not fit beside the state (docs/results.md "Plan check").
PAPER_PAIRS = {
    "7b/7b": {"gen_tp": 8, "gen_slots": 256},
    "13b/13b": {"gen_tp": 8, "gen_slots": 256},
    "33b/13b": {"gen_tp": 4, "gen_slots": 50},
    "65b/33b": {"gen_tp": 8, "gen_slots": 59},
}


def _tiny_model(layers: int) -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()  # a full model section (fields of models/llama.ModelConfig)
  m.vocab_size = 256
  m.hidden_size = 64
  m.intermediate_size = 128
  m.num_layers = layers
  m.num_heads = 4
  m.num_kv_heads = 2
  m.head_dim = 0
  m.max_seq_len = 64
  m.param_dtype = "float32"
  m.dtype = "float32"
  return m


def _as_trained(c, t, dp: int, models=None) -> None:
  """The plan of training config `t` (a ConfigDict of train_ppo's --config) with `dp` data
  replicas (`models`: the (actor, critic) ModelConfigs its checkpoints' config.json give, which
  the trainer's checks below see in place of t's own sections, as trainer/build.resolve_config
  replaces them before trainer/validate runs): its mesh, mini- and micro-batches (a pipelined
  run's pipeline.actor_microbatches / critic_microbatches as rows per micro-batch), fused
  schedule, lengths, remat and scan, and where its rollout stage generates
  (trainer/rollout.stage_kind): on the training mesh with the whole rollout batch (stage folded
  into data when pipelined, as the trainer does), on its plan.generation instances (generation_tp
  devices, the batch dealt over devices / generation_tp of them, inference micro-batches of
  fusion.inference_micro_batch), or on the fused stage's instances (config.fusion.inter_stage:
  fusion.instance_devices each); with asynchronous PPO's async_ppo.generation_devices, on that
  group (its data-only mesh, or the instances over its devices) instead of the training
  devices."""
  # pylint: disable=import-outside-toplevel
  import dataclasses
  import types

  from rlhfuse_jax.trainer import pipelined, rollout
  from rlhfuse_jax.trainer.config import TrainConfig
  run = TrainConfig.from_config_dict(t)
  if models is not None:
    run = dataclasses.replace(run, model=models[0], critic_model=models[1])
  stages = run.mesh.stage
  # An unpipelined run ignores pipeline.critic_pp, as its trainer does.
  c.pp, c.critic_pp = stages, (run.pipeline.critic_pp or stages) if stages > 1 else 1
  c.tp, c.fsdp, c.dp = run.mesh.tensor, run.mesh.fsdp, dp
  c.minibatch_size = run.algo.minibatch_size
  c.gradient_sync = run.algo.gradient_sync
  c.critic_microbatch_size = 0
  if stages == 1:
    c.microbatch_size = run.algo.microbatch_size
  else:  # pipeline.*_microbatches split each data shard's rows (trainer/pipelined.check_config)
    # The trainer's own checks on this mesh's shape (they name the run's fields), and its
    # micro-batch counts (0: one row each).
    pipeline = pipelined.check_config(run, types.SimpleNamespace(shape={
        "data": dp, "fsdp": run.mesh.fsdp, "stage": stages, "tensor": run.mesh.tensor}))
    rows = run.algo.minibatch_size // (dp * run.mesh.fsdp)
    c.microbatch_size = rows // pipeline.actor_microbatches
    c.critic_microbatch_size = rows // (stages // c.critic_pp * pipeline.critic_microbatches)
    c.intra_stage = run.fusion.intra_stage
    c.search_time_s = run.pipeline.search_time_s
    c.search_seed = run.pipeline.search_seed
    c.search_evaluations = run.pipeline.search_evaluations
  c.seq_len = run.data.max_prompt_len + run.rollout.max_new_tokens
  c.response_len = run.rollout.max_new_tokens
  c.remat, c.scan_layers = run.model.remat, run.model.scan_layers
  c.offload_optimizer = run.optim.offload_during_rollout
  c.master_weights = run.optim.master_weights
  c.zero1 = run.optim.zero1
  c.chunk_size = run.rollout.chunk_size
  batch = run.rollout.batch_size
  # Asynchronous PPO's generation group: its own devices (a data-only mesh), beside the
  # training mesh's (async_ppo.meshes).
  c.generation_devices = run.async_ppo.generation_devices
  # A critic-free estimator (grpo, rloo, ...): the trainer builds no critic, and the plan is
  # checked without one (before 2026-12-08 with one, an upper bound)
  c.trains_critic = run.algo.trains_critic
  # Synchronous on a separate group: the critic's values are scored there too (trainer/loop.py
  # stage_critic), where the run has a critic.
  c.group_critic = bool(c.generation_devices and not run.async_ppo.staleness and
                        c.trains_critic)
  # algo.kl_coef=0: the trainer builds and runs no reference (AlgoConfig.uses_reference)
  c.reference = run.algo.uses_reference
  # The actor's log-prob pass on the training devices (the `actor_logp` program), resolved
  # from these as the trainer resolves them
  c.old_logp, c.staleness = run.algo.old_logp, run.async_ppo.staleness
  devices = c.generation_devices or stages * run.mesh.tensor * run.mesh.fsdp * dp
  kind = rollout.stage_kind(run)
  if kind == "serial":
    c.generation, c.gen_slots = "mesh", batch
    c.gen_tp = 1  # unused on the mesh
  elif kind in ("instances", "fused"):  # plan.generation's instances, or FusedStage's
    fc = (rollout.plan_instances_config(run, devices) if kind == "instances" else
          rollout.check_fusion(run, devices))
    c.generation, c.gen_tp, c.gen_slots = "instances", fc.instance_devices, fc.slots
    c.inference_microbatch = fc.micro_batch
    c.inference_pp = fc.inference_pp
    c.migration_rows = run.fusion.migration_rows
  else:
    raise ValueError(f"configs/plan_check.py: the run's rollout stage {kind!r} (plan.generation"
                     f"={run.plan.generation!r}, plan.inference_tp={run.plan.inference_tp}) has "
                     "no plan_check mapping (the serial, instances and fused stages have)")


def _llama_preset(c, variant: str) -> None:
  """configs/ppo_llama.py's preset on its smallest device count (data 1: one model replica of
  fsdp x tensor devices, or stage x tensor for `fused/`), as its trainer would run it: its
  update (unpipelined, or the fused pipeline) with its micro-batches, generation and scoring
  where its plan.generation puts them."""
  from configs import ppo_llama  # pylint: disable=import-outside-toplevel
  t = ppo_llama.get_config(variant)
  c.actor, c.critic = ppo_llama.parse_variant(variant)
  _as_trained(c, t, dp=1)


# The models docs/own_model.md runs with configs/ppo_hf.py:ppo_gpu / grpo_gpu, from their HF
# config.json (meta-llama/Llama-3.2-1B-Instruct, Qwen/Qwen3-0.6B, Qwen/Qwen2.5-1.5B-Instruct):
# vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim; all three tie the LM head to the embedding; Qwen3 normalises
# queries and keys; Qwen2 has biases on q, k and v (models/hf_loader.py reads them whatever
# attention_bias says).
HF_MODELS = {
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         qkv_bias=True),
}


def _hf_gpu_preset(c, name: str) -> None:
  """configs/ppo_hf.py:ppo_gpu (actor and critic both the model, one 8-GPU host) on one of
  HF_MODELS; for the GRPO commands of docs/own_model.md (no critic) an upper bound unless
  config.trains_critic=False (their update without a critic)."""
  from configs import ppo_hf  # pylint: disable=import-outside-toplevel
  if name not in HF_MODELS:
    raise ValueError(f"configs/plan_check.py: unknown model {name!r} in 'hf_gpu/{name}'; "
                     f"expected one of {list(HF_MODELS)}")
  t = ppo_hf.get_config("ppo_gpu")
  model = ml_collections.ConfigDict(dict(HF_MODELS[name], tie_embeddings=True,
                                         param_dtype=t.model.param_dtype, dtype=t.model.dtype,
                                         max_seq_len=t.model.max_seq_len))
  c.actor, c.critic = model, ml_collections.ConfigDict(model.to_dict())
  _as_trained(c, t, dp=t.mesh.data)


def _run_preset(c, spec: str) -> None:
  """'run/<file.py>[:<variant>]': the training config file and variant given to train_ppo's
  --config, as written (`apply_run`). (Loaded here rather than by experiments/config_files.py:
  a config file imports nothing outside the library's trainer, docs/architecture.md §7; its
  checks are repeated below.)"""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import inspect  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"configs/plan_check.py: 'run/{spec}': no config file {path!r} (a path "
                     "as train_ppo's --config takes it, e.g. run/configs/ppo_hf.py:ppo_gpu)")
  module_spec = importlib.util.spec_from_file_location("plan_check_run_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  get = getattr(module, "get_config", None)
  if get is None:
    raise ValueError(f"configs/plan_check.py: 'run/{spec}': {path} defines no get_config()")
  if variant and not inspect.signature(get).parameters:
    raise ValueError(f"configs/plan_check.py: 'run/{spec}': {path}'s get_config() takes no "
                     f"variant (':{variant}')")
  apply_run(c, get(variant) if variant else get())


def apply_run(c, t, overrides=None):
  """Sets plan config `c` to training config `t` (a ConfigDict of train_ppo's --config) as its
  trainer would run it, on its smallest device count (data 1 unless `t` fixes mesh.data; with
  a plan.file, on the devices it was searched for: _run_data): the
  models are t's sections, or the architectures of init.actor_checkpoint /
  init.critic_checkpoint (their config.json, as the trainer reads them; no weights); a
  pipelined run (mesh.stage > 1) with its pipeline section's micro-batches and fused schedule.
  A critic-free estimator is checked without a critic (trains_critic); model.vocab_size=0 is the
  run's tokenizer's vocabulary; a reward model (reward.kind='model') is its checkpoint's
  architecture (config.reward_model: the `reward` program). experiments/plan_check.py's
  --run_config calls it with the flag's overrides (`overrides`, the command line's: one of a
  checkpoint's architecture is refused, as train_ppo refuses it). Returns the run's TrainConfig
  with those architectures (for the comparison with a plan.file's workload)."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  from absl import logging  # pylint: disable=import-outside-toplevel

  from rlhfuse_jax.trainer import build, validate  # pylint: disable=import-outside-toplevel
  from rlhfuse_jax.trainer.config import TrainConfig  # pylint: disable=import-outside-toplevel
  run = TrainConfig.from_config_dict(t)
  build.check_shape_overrides(run, overrides or {}, flag="--run_config")
  validate.check_trained_dtypes(run)  # refused by train_ppo whatever the plan (float16)
  try:  # (it said "fits" without a word; a warning, as the presets' own examples point at the
    # tiny model, of 256 positions, until a user gives theirs)
    validate.check_checkpoint_positions(run)
  except ValueError as e:
    logging.warning("train_ppo would refuse this run: %s", e)
  if run.vocab_from_tokenizer:  # model.vocab_size=0: the tokenizer's, as the trainer takes it
    # (it compiled a vocabulary of 1 for ppo_tiny's 22 tokens)
    run = run.with_vocab(build.build_task_and_tokenizer(run)[1].vocab_size)
  init = run.init
  # (a *ForSequenceClassification refused as train_ppo refuses it: it compiled the actor's
  # programs with an LM head and said the plan fits)
  actor = (build.actor_checkpoint_config(init.actor_checkpoint, run.model)
           if init.actor_checkpoint else run.model)
  # A critic-free run never reads init.critic_checkpoint (build.resolve_config): nor does the
  # plan, which leaves its critic unused (until 2026-12-08 read, and a missing one refused
  # as config.init.actor_checkpoint).
  critic = (build.checkpoint_config(init.critic_checkpoint, run.critic_model,
                                    "init.critic_checkpoint")
            if init.critic_checkpoint and run.algo.trains_critic else
            run.critic_model.replace(vocab_size=actor.vocab_size))
  c.actor = ml_collections.ConfigDict(dataclasses.asdict(actor))
  stand_in = critic
  if not run.algo.trains_critic:  # unused (trains_critic False): a float16 section, which
    # train_ppo leaves unused too, stands in as bfloat16, as the plan refuses a trained float16
    # model
    stand_in = critic.replace(**{f: "bfloat16" for f in ("dtype", "param_dtype")
                                 if getattr(critic, f) == "float16"})
  c.critic = ml_collections.ConfigDict(dataclasses.asdict(stand_in))
  # reward.kind='model': its checkpoint's architecture, as the trainer builds it (a section in
  # place of the field's string: the field is deleted first, which an unlocked config allows)
  reward = build.reward_model_config(run)
  if "reward_model" in c:
    del c["reward_model"]
  c.reward_model = ("" if reward is None else
                    ml_collections.ConfigDict(dataclasses.asdict(reward)))
  _as_trained(c, t, dp=_run_data(run), models=(actor, critic))
  return dataclasses.replace(run, model=actor, critic_model=critic)


def _run_data(run) -> int:
  """The data replicas apply_run checks `run` (a TrainConfig) on: its mesh.data, or for
  mesh.data=-1 one replica, or with a plan.file the replicas of the devices that plan was
  searched for, as train_ppo resolves them there (its training group with an asynchronous
  split). With one replica a plan of generation_tp=4 was refused as "a divisor of the 2
  devices", unless --run_config.mesh.data was spelled out."""
  # pylint: disable-next=import-outside-toplevel
  from rlhfuse_jax.trainer import plan_file as plan_file_lib
  if run.mesh.data > 0:
    return run.mesh.data
  devices = (plan_file_lib.plan_devices(plan_file_lib.load_plan_file(run.plan.file))
             if run.plan.file else None)
  if not devices:
    return 1
  try:
    return run.mesh.resolve(devices - run.async_ppo.generation_devices)["data"]
  except ValueError as e:
    raise ValueError(f"config.{e} (the {devices} devices config.plan.file={run.plan.file!r} "
                     "was searched for)") from None


def check_one_training_config(config_arg: str, run_config_given: bool) -> None:
  """A ValueError when --run_config comes with a configs/plan_check.py variant other than the
  default (`tiny`): every other variant (llama/<preset>, hf_gpu/<model>, run/<file>, a paper
  pair, 7b_host8) sets the models and the plan, which --run_config replaces, so
  `--config=configs/plan_check.py:llama/13b --run_config=configs/ppo_hf.py` checked ppo_hf's
  tiny model and reported it fitting, with nothing saying the 13B preset was not checked."""
  path, _, variant = config_arg.partition(":")
  if (run_config_given and path.rsplit("/", 1)[-1] == "plan_check.py" and
      variant not in ("", "tiny")):
    raise ValueError(
        f"--config={config_arg} with --run_config: the variant {variant!r} sets the models and "
        f"the plan, which --run_config sets too; give one: the variant alone, or "
        f"--config={path} (the hardware and the rest, e.g. --config.hardware=...) with "
        f"--run_config")


def get_config(arg: str = "tiny"):
  c = ml_collections.ConfigDict()
  # A preset of configs/ppo_llama.py SHAPES, or a full model section (see tiny).
  section = arg == "tiny" or arg.startswith(("hf_gpu/", "run/"))  # sections, not presets
  c.actor = _tiny_model(4) if section else "7b"
  c.critic = _tiny_model(2) if section else "7b"  # critic backbone (scalar head)
  c.layers = 0  # layers compiled per model (0: the model's own); analytic numbers follow it
  c.pp = 8  # actor pipeline stages (mesh axis `stage`); 1: the unpipelined update
  c.critic_pp = 8  # critic stages; must divide pp
  c.tp = 1  # tensor-parallel degree of training (mesh axis `tensor`)
  c.dp = 1  # data-parallel degree (mesh axis `data`)
  c.fsdp = 1  # parameter-sharded data-parallel degree (mesh axis `fsdp`)
  c.minibatch_size = 64  # samples per optimizer step (one train_step program)
  # samples per micro-batch and data shard: the pipeline's (pp > 1), or the gradient
  # accumulation of the unpipelined update (pp == 1: the trainer's algo.microbatch_size; 0 there
  # runs each data shard's rows at once)
  c.microbatch_size = 1
  # pp > 1: the critic's samples per micro-batch and data shard (0: microbatch_size); its
  # pp / critic_pp replicas share each data shard's rows
  c.critic_microbatch_size = 0
  # Asynchronous PPO (the trainer's async_ppo.generation_devices): generation and inference on
  # that many devices of their own, holding the actor whole on every device (beside an
  # instance's own copy: plan_programs.group_actor_bytes), the reference and the reward model
  # (the critic too with group_critic) and no training state; 0: on the training devices
  c.generation_devices = 0
  c.group_critic = False  # the group also holds the critic (async_ppo.staleness 0)
  # The run builds a reference model (the trainer's algo.kl_coef > 0): the inference program is
  # its log-prob forward and an asynchronous generation group holds it beside the actor; False
  # (algo.kl_coef=0): no reference anywhere, the inference program is the critic's value
  # forward (none without a critic either: trains_critic False). A run's (run/, --run_config)
  # is its algo.kl_coef's.
  c.reference = True
  # The run trains a critic (the trainer's algo.trains_critic); False (a critic-free estimator:
  # grpo, rloo, ...): the programs the trainer compiles for it: the actor's update alone (pp 1
  # only, as the trainer refuses mesh.stage > 1 for it), no critic on the instances or a group,
  # no critic_values pass, no inference program without a reference. A run's is its estimator's.
  c.trains_critic = True
  # The reward model the instances score with beside the reference (a run's reward.kind=
  # 'model'): the `reward` program, its scalar forward on one inference micro-batch (mesh:
  # the whole rollout batch). '' : a
  # reward function (no program); a preset of configs/ppo_llama.py SHAPES ('33b'); set by a
  # run (run/, --run_config) to its checkpoint's architecture. (Set below, after the variants:
  # a run's sets a section in place of the string.)
  # The trainer's algo.old_logp and async_ppo.staleness: where they make the trainer run the
  # actor's log-prob forward on the training devices before the update (old_logp "recompute",
  # or "auto" with a 16-bit actor and pp == 1, in the update's micro-batches; staleness > 0:
  # the proximal log-probs, a mini-batch a piece), the `actor_logp` program compiles it,
  # beside the training state; staleness > 0 also scores each batch's values with the current
  # critic there (the `critic_values` program) and, without generation_devices, keeps a copy of
  # the actor there for the next batch, beside the update and that generation (each program's
  # actor_copy_bytes). A run's (run/, --run_config, llama/, hf_gpu/) are its own.
  c.old_logp = "auto"
  c.staleness = 0
  # pp == 1 with micro-batches: the trainer's algo.gradient_sync, "per_microbatch" (weights
  # gathered and gradients reduced per micro-batch) or "once" (per optimizer step); pipelined
  # plans ignore it, as the trainer does
  c.gradient_sync = "per_microbatch"
  c.seq_len = 2048  # tokens per sample: prompt bucket + response
  c.response_len = 1024  # response tokens (the loss and the heads see these; decode's budget)
  c.remat = "dots"  # none | full | dots (models/llama.py REMAT_POLICIES)
  # True: both models' layers stacked and run by one lax.scan (model.scan_layers)
  c.scan_layers = False
  c.attention = "blockwise"  # reference | blockwise | cudnn | auto | pallas (models/attention.py)
  c.intra_stage = True  # True: the searched fused schedule; False: serial 1F1B
  c.search_time_s = 2.0  # fused-schedule search budget (unit durations; once per run)
  c.search_seed = 0  # its seed (the trainer's pipeline.search_seed)
  # its budget as a count of evaluations (the trainer's pipeline.search_evaluations; 0:
  # search_time_s): deterministic for the seed, so the schedule checked is the run's
  c.search_evaluations = 0
  c.gen_tp = 8  # devices of one generation instance
  c.gen_slots = 54  # batch slots of one generation instance
  c.chunk_size = 64  # decode steps per jitted decode call
  c.inference_microbatch = 8  # samples per inference micro-batch on an instance
  # instances: > 1 scores on pipelines of that many instances (the trainer's fusion.inference_pp
  # or plan.inference_pp): the scoring programs are each stage's, and the heaviest is reported
  c.inference_pp = 1
  # Rows a consolidation's migration moves at once (the trainer's fusion.migration_rows; 0: up
  # to gen_slots): its copy of them sits beside the cache (the `migrate` program)
  c.migration_rows = 8
  c.hardware = "h100_sxm"  # preset of rlhfuse_jax/sim/hardware.py: its HBM is the budget
  # XLA:CPU runs bfloat16 dots in float32 and hoists a float32 copy of every weight out of the
  # decode loop, which no GPU makes: per_layer compiles the instance's programs with scanned
  # layers and that hoisting off, so the copy is one layer's, and reports it unless the program
  # as configured compiles smaller (an XLA:CPU that does not hoist: experiments/plan_programs.py);
  # as_compiled keeps the plain compile's figures.
  c.cpu_upcast = "per_layer"
  # True: the trainer's optim.offload_during_rollout (the optimizer state in host memory while the
  # instances generate and score): decode's and the scoring programs' fit counts the parameters
  # only.
  c.offload_optimizer = False
  # The trainer's optim.master_weights: AdamW steps a float32 copy of the 16-bit weights, with
  # float32 moments (2 + 4 + 4 + 4 bytes of state per parameter, not 2 + 2 + 2): mixed
  # precision as the simulator assumes it (sim/cost_model.py) and as 16-bit weights need to
  # train at all (docs/usage.md); the presets' runs set their own.
  c.master_weights = not section
  # The trainer's optim.zero1: the optimizer state split over the model's copies (the data axis,
  # a pipelined critic's replicas), as the simulator's plans assume (sim/cost_model.py ZeRO-1).
  c.zero1 = not section
  # instances: decode and scoring (inference, reward) on one instance of gen_tp devices
  # (gen_slots slots); mesh: the trainer's default plan.generation, on the training mesh
  # (pp > 1: stage folded into data), gen_slots = the rollout batch, scored whole.
  c.generation = "instances"

  if arg == "tiny":
    c.pp, c.critic_pp, c.tp, c.dp, c.fsdp = 2, 2, 1, 2, 2
    c.minibatch_size, c.microbatch_size = 8, 1
    c.seq_len, c.response_len = 32, 16
    c.remat = "none"
    c.intra_stage = False  # serial 1F1B: no schedule search (the fused one needs numba's compile)
    c.gen_tp, c.gen_slots, c.chunk_size, c.inference_microbatch = 2, 4, 4, 2
  elif arg == "7b_host8":
    # The 7B pair on one 8-GPU host: sim/training_sim.best_plan on 8 H100s picks 8 stages for
    # both models; prompts up to 512 + 1024 new tokens (configs/ppo_llama.py); generation on
    # one 8-GPU instance.
    c.seq_len, c.response_len = 1536, 1024
    c.gen_tp, c.gen_slots = 8, 64
  elif arg.startswith("llama/"):
    _llama_preset(c, arg[len("llama/"):])
  elif arg.startswith("hf_gpu/"):
    _hf_gpu_preset(c, arg[len("hf_gpu/"):])
  elif arg.startswith("run/"):
    _run_preset(c, arg[len("run/"):])
  elif arg in PAPER_PAIRS:
    c.actor, c.critic = arg.split("/")
    # sim/training_sim.best_plan at 2048 tokens per sample (re-read 2026-12-05 (bj); a test
    # keeps them equal): tp 4 for every pair; 7B 16 stages (dp 4; 8 stages, dp 8, until the
    # re-read: 5 % slower in today's cost model), 13B 8 (dp 8), 33B/13B 4 (60 layers),
    # 65B/33B 16 for the actor and 4 for the 33B critic (4 replicas over the 16).
    c.pp, c.critic_pp, c.tp, c.dp = {"7b/7b": (16, 16, 4, 4), "13b/13b": (8, 8, 4, 8),
                                     "33b/13b": (4, 4, 4, 16), "65b/33b": (16, 4, 4, 4)}[arg]
    c.gen_tp, c.gen_slots = PAPER_PAIRS[arg]["gen_tp"], PAPER_PAIRS[arg]["gen_slots"]
    c.offload_optimizer = PAPER_PAIRS[arg].get("offload_optimizer", False)
  else:
    raise ValueError(f"configs/plan_check.py: unknown variant {arg!r}; expected 'tiny', "
                     f"'7b_host8', 'llama/<a configs/ppo_llama.py variant>', "
                     f"'hf_gpu/<one of {list(HF_MODELS)}>', 'run/<config file>[:<variant>]' "
                     f"or one of {list(PAPER_PAIRS)}")
  if "reward_model" not in c:
    c.reward_model = ""
  return c
