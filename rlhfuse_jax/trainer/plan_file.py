"""The plan file (config.plan.file): the plan.json `python -m experiments.plan_search` writes,
read, checked and mapped onto a run's config fields (docs/usage.md), and compared with the run's
workload. Without jax, and without trainer/config.py (which applies it as a config is read).
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Collection, Mapping, Optional

from rlhfuse_jax import workdir
from rlhfuse_jax.fields import check as _check
from rlhfuse_jax.fields import is_int as _is_int
from rlhfuse_jax.policy import async_copies
from rlhfuse_jax.sim.shapes import DTYPE_ITEMSIZE, ITEMSIZE_DTYPES
from rlhfuse_jax.trainer import inputs as inputs_lib

# A run's TrainConfig and ModelConfig (`cfg`, `reward_model` below) are read by attribute name:
# importing trainer/config.py would bring jax (through its rl/ modules) into this module.


def load_plan_file(path: str) -> dict:
  """The plan.json of `python -m experiments.plan_search` (sim/plan_search.py `_plan_dict`):
  {"generation": {mode, tp, pp, groups, slots}, "inference": {tp, pp}, "training": {placement,
  ...}, "predicted": ..., "summary": ...}."""
  if os.path.isdir(path):  # plan_search's workdir, named for the file it wrote there
    inside = os.path.join(path, "plan.json")
    raise ValueError(f"config.plan.file={path!r} is a directory; expected a plan.json" + (
        f": its {inside!r}?" if os.path.isfile(inside) else " file"))
  try:
    with open(path) as f:
      plan = workdir.load_json(f)  # a key given twice is refused, not the last one kept
  except (OSError, ValueError) as e:
    raise ValueError(f"config.plan.file={path!r}: cannot read a plan: {e}") from None
  for key in ("generation", "inference", "training"):
    _check(isinstance(plan, dict) and isinstance(plan.get(key), dict), "plan.file", path,
           f"a plan.json with a {key!r} object (the format of experiments.plan_search)")
  return plan


def plan_devices(plan: Mapping[str, Any]) -> Optional[int]:
  """How many devices the plan file's plan was searched for (plan_search's num_devices: an
  asynchronous split's two groups, else training's devices); None when it does not say."""
  a = plan.get("async")
  if isinstance(a, Mapping) and not async_copies.split_colocated(a):
    parts = (a.get("generation_devices"), a.get("training_devices"))
  else:
    parts = (plan["training"].get("devices"),)
  if not all(_is_int(p) and p > 0 for p in parts):
    return None  # a hand-edited file's odd value: the field checks name it
  return sum(parts)


# The keys plan_search writes in a plan's stages (sim/plan_search.py: GenerationPlan's and
# InferencePlan's fields, training_candidates' colocated dict); tests/test_plan.py holds them to
# those. Written here, not imported: the simulator's search is no import of every binary.
PLAN_STAGE_KEYS = {
    "generation": ("mode", "tp", "pp", "groups", "slots"),
    "inference": ("tp", "pp"),
    "training": ("placement", "devices", "tp", "actor_pp", "critic_pp", "micro_batch",
                 "actor_microbatches", "critic_microbatches"),
}


# The top-level keys plan_search writes in plan.json (sim/plan_search.py _plan_dict,
# _async_plan; experiments/plan_search.py adds hardware and workload); tests/test_plan.py holds
# them to a search's file. A misspelt one ("asynch") was ignored: the run went synchronous.
PLAN_KEYS = ("generation", "inference", "training", "predicted", "summary", "async",
             "hardware", "workload",
             # result.json's "best" (its iteration time repeated) serves as a plan file too
             # (docs/results_history.md): read as a plan, this one sets nothing.
             "predicted_iteration_s")


def _refuse_unknown(where: str, keys: Collection[str], taken: Collection[str],
                    what: str, prefix: str = "", taker: str = "") -> None:
  """A ValueError naming the first of `keys` not in `taken` (of `what`; `taker` takes them),
  with the closest one."""
  unknown = [k for k in keys if k not in taken]
  if unknown:
    close = difflib.get_close_matches(str(unknown[0]), list(taken), n=1)
    raise ValueError(f"{where}: {prefix}{unknown[0]} is no key of {what}" + (
        f"; did you mean {prefix}{close[0]}?" if close else "") +
        f" ({taker or what} takes {', '.join(taken)})")


def plan_file_settings(plan: Mapping[str, Any], path: str) -> dict[tuple[str, str], tuple]:
  """{(section, field): (value, the plan file's key)}: what a plan file sets. Training's
  colocated (tp, actor_pp, critic_pp) maps onto mesh.tensor, mesh.stage and pipeline.critic_pp
  (mesh.data takes the remaining devices), and optim.zero1 is on (the simulator's memory check
  assumes it); a disjoint placement is refused. An asynchronous
  plan's split ("async": generation_devices, staleness) maps onto config.async_ppo; colocated,
  its staleness with generation_devices 0."""
  gen, inf, train = plan["generation"], plan["inference"], plan["training"]
  where = f"config.plan.file={path!r}"
  _refuse_unknown(where, plan, PLAN_KEYS, "a plan file")
  for stage, keys in PLAN_STAGE_KEYS.items():  # a misspelt key ("slot") was ignored silently
    if stage == "training" and train.get("placement") != "colocated":
      continue  # (refused below, as a placement the trainer does not run)
    _refuse_unknown(where, plan[stage], keys, f"a plan's {stage}", f"{stage}.", stage)
  out: dict[tuple[str, str], tuple] = {}
  mode = gen.get("mode")
  if mode not in ("instances", "pipeline"):
    raise ValueError(f"{where}: generation.mode={mode!r}; expected 'instances' or 'pipeline'")
  out["plan", "generation"] = (mode, "generation.mode")
  out["plan", "generation_tp"] = (gen.get("tp", 1), "generation.tp")
  if mode == "instances":
    out["plan", "generation_slots"] = (gen.get("slots", 0), "generation.slots")
  else:
    out["plan", "generation_pp"] = (gen.get("pp", 1), "generation.pp")
    out["plan", "generation_groups"] = (gen.get("groups", 0), "generation.groups")
  out["plan", "inference_tp"] = (inf.get("tp", 1), "inference.tp")
  out["plan", "inference_pp"] = (inf.get("pp", 1), "inference.pp")
  placement = train.get("placement")
  if placement != "colocated":
    raise ValueError(
        f"{where}: training.placement={placement!r}; expected 'colocated': the trainer runs "
        "actor and critic on the same devices (a disjoint placement, each model on its own "
        "share of the devices at once, is simulated by plan_search but not implemented in the "
        "trainer)")
  tp, actor_pp, critic_pp = (train.get(k, 1) for k in ("tp", "actor_pp", "critic_pp"))
  for key, value in (("tp", tp), ("actor_pp", actor_pp), ("critic_pp", critic_pp)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      # (compared below before any field's own check: "2" or null ended in a TypeError)
      raise ValueError(f"{where}: training.{key}={value!r}; expected an integer >= 1")
  out["mesh", "tensor"] = (tp, "training.tp")
  out["mesh", "stage"] = (actor_pp, "training.actor_pp")
  if actor_pp > 1:
    # (a plan without a critic has no critic_pp: the run's own is left, as a field the file
    # never set; a critic-free run refuses the stages anyway)
    if "critic_pp" in train:
      out["pipeline", "critic_pp"] = (critic_pp, "training.critic_pp")
  elif critic_pp != 1:
    raise ValueError(f"{where}: training.critic_pp={critic_pp} with training.actor_pp=1; the "
                     "trainer pipelines the critic only over the actor's stage axis")
  # The micro-batching the plan was timed and its memory checked with (plan.json since
  # 2026-11-30; older files leave the config's): pipelined, the micro-batches per data shard
  # and per critic replica; unpipelined, the rows a data shard takes at once. A config that
  # sets its own keeps it (PLAN_SOFT_FIELDS).
  if "micro_batch" in train:
    if actor_pp > 1:
      # (a plan searched for a run without a critic records neither critic_pp nor its
      # micro-batches: plan_search.colocated_train_dict; such a run refuses mesh.stage > 1)
      lacking = [k for k in ("actor_microbatches",) + (
          ("critic_microbatches",) if "critic_pp" in train else ()) if k not in train]
      if lacking:  # (a hand-edited actor_pp: "config.pipeline.actor_microbatches=None" before)
        missing = " and ".join(f"training.{k}" for k in lacking)
        raise ValueError(
            f"{where}: training.actor_pp={actor_pp} without {missing}: plan_search writes a "
            "pipelined plan's micro-batches beside its stages; add them, or run plan_search for "
            "the layout you want")
      out["pipeline", "actor_microbatches"] = (train.get("actor_microbatches"),
                                               "training.actor_microbatches")
      if "critic_microbatches" in train:
        out["pipeline", "critic_microbatches"] = (train["critic_microbatches"],
                                                  "training.critic_microbatches")
    else:
      out["algo", "microbatch_size"] = (train["micro_batch"], "training.micro_batch")
  # The simulator's memory check counts the optimizer state split over data (ZeRO-1,
  # sim/cost_model.train_memory_bytes): the plan fits only so.
  out["optim", "zero1"] = (True, "training (its memory check assumes ZeRO-1)")
  # An asynchronous plan (plan_search with sim.staleness >= 1) splits the devices: generation
  # and inference on the first generation_devices, training (the layouts above) on the rest.
  # A hand-edited entry that is not an object, or a split with no generation group, was
  # ignored (the run went synchronous) or taken as a split of no devices.
  a = plan.get("async")
  if a is None:
    return out
  if not isinstance(a, Mapping):
    raise ValueError(f"{where}: async={a!r}; expected an object {{generation_devices, "
                     "training_devices, staleness, colocated} (plan_search's asynchronous "
                     "plan; a synchronous plan has no \"async\" entry)")
  colocated = a.get("colocated", async_copies.SPLIT_COLOCATED)
  gen_devices = a.get("generation_devices", 0)
  if not isinstance(colocated, bool):
    raise ValueError(f"{where}: async.colocated={colocated!r}; expected true or false")
  # A string "4" was taken (plan_devices then knew no device count: the warning of a plan
  # searched for another one never came). A number that is no count (4.5) is named below by
  # the field it sets, async_ppo.generation_devices.
  train_devices = a.get("training_devices")
  if "training_devices" in a and not (_is_int(train_devices) and train_devices >= 1):
    raise ValueError(f"{where}: async.training_devices={train_devices!r}; expected an integer "
                     ">= 1 (the devices of the split's training group)")
  if isinstance(gen_devices, bool) or not isinstance(gen_devices, (int, float)):
    raise ValueError(f"{where}: async.generation_devices={gen_devices!r}; expected an integer "
                     ">= 1 (the devices of the split's generation group)")
  if not colocated and _is_int(gen_devices) and gen_devices < 1:
    raise ValueError(f"{where}: async.generation_devices={gen_devices!r} with async.colocated="
                     "false; expected an integer >= 1 (the devices of the split's generation "
                     "group; a synchronous plan has no \"async\" entry)")
  # Colocated (async_search's colocated option: both groups on all the devices) the search
  # timed it asynchronously (no critic on the instances, a rescore) and sized it with the
  # copy of the actor its staleness keeps (sim/plan_search.async_colocated_predicted,
  # keeps_actor_copy): until 2026-12-07 it set nothing, and a run at its own staleness (0 by
  # default: synchronous) ran another plan than the one searched, without a word.
  out["async_ppo", "staleness"] = (a.get("staleness", async_copies.SPLIT_STALENESS),
                                   "async.staleness")
  out["async_ppo", "generation_devices"] = ((0, "async.colocated") if colocated else
                                            (gen_devices, "async.generation_devices"))
  return out


# What plan.json's "workload" (experiments.plan_search since 2026-12-01) records beside the
# models' shapes, and the field of a run's config each is compared with.
PLAN_WORKLOAD_RUN_FIELDS = {"global_batch": "rollout.batch_size",
                            "minibatch": "algo.minibatch_size", "epochs": "algo.epochs",
                            "max_prompt_len": "data.max_prompt_len",
                            "max_new_tokens": "rollout.max_new_tokens",
                            "reference": "algo.uses_reference",
                            "reward_model": "reward.uses_model",
                            # whether its memory check counted asynchronous PPO's copy of
                            # the actor on the training devices (since 2026-12-07)
                            "actor_copy": "async_ppo.keeps_actor_copy",
                            # whether it searched a critic's training (since 2026-12-08; an
                            # older file's did: UNRECORDED_MEANT)
                            "trains_critic": "algo.trains_critic",
                            # recorded for a run's plan (train_config) only
                            "inference_micro_batch": "fusion.inference_micro_batch",
                            "migration_rows": "fusion.migration_rows",
                            "offload_optimizer": "optim.offload_during_rollout",
                            "master_weights": "optim.master_weights"}
# What a run field plan.json does not record stood for when the file was written, where every
# file before the field was recorded agrees (compared as that value; any other field a file
# lacks is not compared): plan_search searched with a critic until 2026-12-08.
UNRECORDED_MEANT = {"trains_critic": True}
# The actor's and critic's fields it records (sim/plan_search.WORKLOAD_MODEL_FIELDS) and
# compares here, but for the dtypes' bytes (ITEMSIZE_DTYPES, compared below) and max_seq_len:
# a bound on the context, which neither the simulator's times and memory nor the trainer's
# allocations read (its KV cache and rows are max_prompt_len + max_new_tokens, compared). The
# last six since 2026-12-06: a plan for an MLP of 128 ran one of 256 without a word.
PLAN_WORKLOAD_MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                              "vocab_size", "intermediate_size", "head_dim", "tie_embeddings",
                              "qkv_bias", "o_bias", "qk_norm")
# The run fields every plan_search writes, and those it writes for a run's plan (train_config):
# a file that lacks one was written before it did.
_ALWAYS_RECORDED = ("global_batch", "minibatch", "epochs", "max_prompt_len", "max_new_tokens",
                    "reference", "reward_model", "actor_copy")
_RUN_PLAN_RECORDED = ("inference_micro_batch", "migration_rows", "offload_optimizer",
                      "master_weights")


# The run's fields its prompt and response lengths come from (trainer/sim_plan.workload:
# the task's prompts and targets, or a prompts file's prompts (the field data.prompt_key of
# each row) with responses uniform in 1..rollout.max_new_tokens; either less the
# data.val_fraction held out, rendered through data.chat_template and tokenised with
# init.tokenizer), by their key in plan.json's workload "lengths" "data" (since 2026-12-07,
# plan_search with a train_config), where each is compared here: they drive the simulated
# generation times and long tail, and so the plan's choice. Not data.overlong_prompts: 'skip'
# leaves out the prompts longer than data.max_prompt_len (compared), which 'error' refuses, so
# two runs that both build have the same pool; nor data.answer_key (a prompts file's responses
# are uniform) or data.val_file (a pool of its own, for validation alone).
LENGTH_INPUT_FIELDS = {"prompts_file": "data.prompts_file", "task": "data.task",
                       "num_prompts": "data.num_prompts", "length_dist": "data.length_dist",
                       "length_min": "data.length_min", "length_max": "data.length_max",
                       "length_mu": "data.length_mu", "length_sigma": "data.length_sigma",
                       "prompt_key": "data.prompt_key", "val_fraction": "data.val_fraction",
                       "tokenizer": "init.tokenizer", "chat_template": "data.chat_template"}
# Recorded later on 2026-12-07: a plan for one template or tokenizer ran with another without a
# word (tests/fixtures/tiny_chat's chatml template made 64 prompts 67 tokens long on average,
# from 42), and so did one for a file's other field (prompt_key) or a pool with a fraction held
# out. A file without them compares the rest and says which it lacks.
LATER_LENGTH_INPUTS = ("tokenizer", "chat_template", "num_prompts", "prompt_key",
                       "val_fraction")
# Those of a prompts file alone (a task's prompts are its own), and of a task alone.
FILE_LENGTH_INPUTS = ("prompt_key",)
TASK_LENGTH_INPUTS = ("task", "num_prompts", "length_dist", "length_min", "length_max",
                      "length_mu", "length_sigma")
# Beside a prompts file (since 2026-12-07, as its absolute path), "data" records the digest of
# its content the resume check takes (trainer/inputs.py): the prompts' lengths are its content,
# not its path. The path as typed was compared: './p.jsonl', 'p.jsonl' and '/abs/p.jsonl' were
# warned of as three files, and other prompts written to the same path were not.
PROMPTS_DIGEST = "prompts_digest"
# The inputs that are files, compared by content as the prompts file is: {key: (the key of its
# content's digests in "data", the resume check's: a prompts file's one digest, a tokenizer's
# and a chat template path's {file: digest} of the files read, which a copy elsewhere shares;
# the values that name no file: '' no prompts file, the task's own vocabulary; a template of
# 'none', or 'auto', the tokenizer's own, which its digests cover)}.
LENGTH_INPUT_FILES = {"prompts_file": (PROMPTS_DIGEST, ("",)),
                      "tokenizer": ("tokenizer_digests", ("",)),
                      "chat_template": ("chat_template_digests", ("none", "auto"))}


def _run_value(cfg: Any, key: str) -> Any:
  """The run `cfg`'s field that LENGTH_INPUT_FIELDS gives for `key`."""
  section, name = LENGTH_INPUT_FIELDS[key].split(".")
  return getattr(getattr(cfg, section), name)


def _input_digests(cfg: Any, inputs: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
  """{field: content fingerprint ({file: digest})} of the run `cfg`'s inputs: `inputs`, the
  resume check's (trainer/inputs.fingerprints, taken as train_ppo's set-up starts: the files
  are not read again), else those of LENGTH_INPUT_FILES taken here (none where there is no
  file there: the run's own checks name it)."""
  if inputs is not None:
    return inputs
  out = {}
  for key, (_, no_file) in LENGTH_INPUT_FILES.items():
    field, path = LENGTH_INPUT_FIELDS[key], _run_value(cfg, key)
    fp = inputs_lib.content_fingerprint(field, path) if path not in no_file else None
    if fp:
      out[field] = fp
  return out


def run_length_inputs(cfg: Any, inputs: Optional[Mapping[str, Any]] = None) -> dict:
  """The fields (LENGTH_INPUT_FIELDS) the run `cfg`'s lengths come from: a prompts file and
  the field of its rows read as the prompt (its responses uniform, their limit compared as
  max_new_tokens), else the task, its prompt count and its target lengths' distribution
  (length_mu and length_sigma of a log-normal only: a uniform one reads neither); then the
  fraction held out, the tokenizer and the chat template. A file's (LENGTH_INPUT_FILES) as its
  absolute path and its content's digests where it exists: of `inputs`, the resume check's
  fingerprints, where given (_input_digests)."""
  d = cfg.data
  if d.prompts_file:
    out = {"prompts_file": d.prompts_file, "prompt_key": d.prompt_key}
  else:
    out = {"prompts_file": "", "task": d.task, "num_prompts": d.num_prompts,
           "length_dist": d.length_dist, "length_min": d.length_min,
           "length_max": d.length_max}
    if d.length_dist == "lognormal":
      out.update(length_mu=d.length_mu, length_sigma=d.length_sigma)
  out.update(val_fraction=d.val_fraction, tokenizer=cfg.init.tokenizer,
             chat_template=d.chat_template)
  digests = _input_digests(cfg, inputs)
  for key, (digest_key, no_file) in LENGTH_INPUT_FILES.items():
    if out[key] in no_file:
      continue
    out[key] = os.path.abspath(out[key])
    fp = digests.get(LENGTH_INPUT_FIELDS[key])
    if fp:
      # (a prompts file's fingerprint is {its name: digest}: the digest alone, a copy under
      # another name being the same prompts; other inputs' compared by inputs.same_files)
      out[digest_key] = next(iter(fp.values())) if key == "prompts_file" else dict(fp)
  return out


def _same_input(data: Mapping[str, Any], run: Mapping[str, Any], key: str) -> Optional[bool]:
  """Whether the input `key` (LENGTH_INPUT_FILES) plan.json's "data" records is the run's
  (`run`: its run_length_inputs): by content where both digests are known (a copy elsewhere is
  the same file), else by resolved path (a file written before the digest was recorded, its
  relative path read from here); None for other content where the path is the same."""
  digest_key, no_file = LENGTH_INPUT_FILES[key]
  was, now = data.get(key, ""), run.get(key, "")
  if was in no_file or now in no_file:
    return was == now
  known = isinstance(data.get(digest_key), (str, Mapping)) and digest_key in run
  if known and inputs_lib.same_files(data[digest_key], run[digest_key]):
    return True
  same_path = os.path.realpath(str(was)) == os.path.realpath(now)
  return None if same_path and known else same_path


def _length_differences(lengths: Mapping[str, Any], cfg: Any,
                        inputs: Optional[Mapping[str, Any]] = None) -> list[str]:
  """plan_workload_differences' entries of the workload's "lengths" against the run `cfg`
  (`inputs`: its content fingerprints, as run_length_inputs takes them): each field that
  differs ("lengths.data.length_dist='uniform' (this run's data.length_dist is 'lognormal')";
  a prompts file that differs alone of the task's fields, which it replaces; the files by
  content where plan.json records their digests, else by resolved path). [] for a plan
  searched with the simulator's own distributions (no "data": a paper pair's config.prompt and
  config.response), which no run's fields stand for (simulator_lengths_note)."""
  data = lengths.get("data")
  if not isinstance(data, Mapping):
    return []
  run = run_length_inputs(cfg, inputs)
  # (a task's fields where neither has a prompts file, a file's where both have one)
  source = (FILE_LENGTH_INPUTS if data.get("prompts_file", "") and cfg.data.prompts_file else
            () if data.get("prompts_file", "") or cfg.data.prompts_file else TASK_LENGTH_INPUTS)
  # (a prompts file compared also where "data" has no entry for it: then none)
  keys = [k for k in LENGTH_INPUT_FIELDS if k == "prompts_file" or k in data and (
      k in run and k in source or k not in FILE_LENGTH_INPUTS + TASK_LENGTH_INPUTS)]
  out = []
  for k in keys:
    same = (_same_input(data, run, k) if k in LENGTH_INPUT_FILES else
            data.get(k, "") == run[k])
    if same:
      continue
    out.append(f"lengths.data.{k}={data.get(k, '')!r} (this run's {LENGTH_INPUT_FIELDS[k]} is "
               f"{_run_value(cfg, k)!r}" + (")" if same is not None else (
                   ": the same path, other content: its digest is not the one recorded)"
                   if k == "prompts_file" else ": the same path, other content: its files' "
                   "digests are not the ones recorded)")))
  return out


def _model_value(model: Any, field: str) -> Any:
  """A run's ModelConfig `field` as plan.json records it: head_dim as computed with (its
  head_dim_: 0 is hidden_size / num_heads); o_bias and qk_norm False where the config has
  none."""
  if field == "head_dim":
    return model.head_dim_
  return getattr(model, field, False)


def _recorded_value(shape: Mapping[str, Any], field: str) -> Any:
  """plan.json's `field` of a model: a head_dim of 0 (hand-written) read as the model does."""
  value = shape[field]
  if field == "head_dim" and value == 0 and _is_int(shape.get("hidden_size")) and \
      _is_int(shape.get("num_heads")) and shape["num_heads"] > 0:
    return shape["hidden_size"] // shape["num_heads"]
  return value


def attribute_to_plan(msg: str, path: str) -> str:
  """`msg`, an error naming a config field ("config.plan.generation_slots=8: expected ..."),
  with "(set by config.plan.file=PATH, a plan searched for N devices)" added when the field is
  one the plan file at `path` set (plan.*, mesh.*, pipeline.critic_pp, optim.zero1,
  async_ppo.*): the user never wrote that value. `msg` itself otherwise, or without a file."""
  plan = load_plan_file(path) if path else None
  if not plan or not any(f"config.{sec}.{field}=" in msg
                         for sec, field in plan_file_settings(plan, path)):
    return msg
  n = plan_devices(plan)
  return msg + f" (set by config.plan.file={path!r}" + (
      f", a plan searched for {n} devices" if n else "") + ")"


def plan_workload_differences(plan: Mapping[str, Any], cfg: Any,
                              reward_model: Optional[Any] = None,
                              inputs: Optional[Mapping[str, Any]] = None
                              ) -> Optional[list[str]]:
  """'actor num_layers=8 (this run has 2)' for each field of the workload the plan was searched
  for that differs from the run's (`cfg` resolved: the tokenizer's vocabulary, a checkpoint's
  shape; `reward_model`: the run's reward model, build.reward_model_config, compared with the
  plan's "reward" where it records one; `inputs`: the run's content fingerprints, the resume
  check's, run_length_inputs); None when the file records no workload (written before it
  did)."""
  w = plan.get("workload")
  if not isinstance(w, Mapping):
    return None
  out = []
  # (the critic's shape only where the run trains one: a critic-free run's critic_model is
  # unused, and a plan searched with a critic is said by trains_critic below)
  roles = (("actor", cfg.model),) + (
      (("critic", cfg.critic_model),) if cfg.algo.trains_critic else ()) + (
      (("reward", reward_model),) if reward_model is not None else ())
  for role, model in roles:
    shape = w.get(role)
    for f in PLAN_WORKLOAD_MODEL_FIELDS if isinstance(shape, Mapping) else ():
      if f == "tie_embeddings" and role != "actor":
        continue  # a scalar head has no embedding to tie (models/param_count.py)
      now = _model_value(model, f)
      if f in shape and _recorded_value(shape, f) != now:
        out.append(f"{role} {f}={_recorded_value(shape, f)!r} (this run has {now!r})")
    # the bytes per element it sized the weights and the KV cache at, with the run's field each
    # stands for (sim/shapes.ITEMSIZE_DTYPES: param_dtype and dtype)
    for f, dtype in ITEMSIZE_DTYPES.items() if isinstance(shape, Mapping) else ():
      now = DTYPE_ITEMSIZE.get(getattr(model, dtype))
      if f in shape and now is not None and shape[f] != now:
        # (a reward model takes the run's numerics: config.model's)
        section = "critic_model" if role == "critic" else "model"
        out.append(f"{role} {f}={shape[f]!r} bytes (this run's {section}.{dtype}="
                   f"{getattr(model, dtype)!r}: {now})")
  for key, field in PLAN_WORKLOAD_RUN_FIELDS.items():
    sec, name = field.split(".")
    now = getattr(getattr(cfg, sec), name)
    if key not in w and key not in UNRECORDED_MEANT:
      continue
    recorded = w.get(key, UNRECORDED_MEANT.get(key))
    if recorded == now:
      continue
    if key == "reference":  # said by the field a user sets, not the property
      has = f"algo.kl_coef={cfg.algo.kl_coef:g}: {'a' if now else 'no'} reference model"
    elif key == "reward_model":
      has = f"reward.kind={cfg.reward.kind!r}: {'a' if now else 'no'} reward model"
    elif key == "trains_critic":
      has = f"algo.estimator={cfg.algo.estimator!r}: {'a' if now else 'no'} critic"
    elif key == "actor_copy":
      a = cfg.async_ppo
      has = (f"async_ppo.staleness={a.staleness}, generation_devices={a.generation_devices}: "
             f"{'a' if now else 'no'} copy of the actor on the training devices for the next "
             "batch's generation")
    else:
      has = f"{field} is {now!r}"
    out.append(f"{key}={recorded!r} (this run's {has})")
  if isinstance(w.get("lengths"), Mapping):
    out += _length_differences(w["lengths"], cfg, inputs)
  return out


def plan_workload_unrecorded(plan: Mapping[str, Any]) -> list[str]:
  """The fields plan_workload_differences compares that the plan file's workload does not
  record (a plan.json written before plan_search recorded them): a model field once, for all
  the models that lack it ("intermediate_size of the actor and critic"), then the run fields.
  [] without a workload (nothing of it is compared)."""
  w = plan.get("workload")
  if not isinstance(w, Mapping):
    return []
  models = [role for role in ("actor", "critic", "reward") if isinstance(w.get(role), Mapping)]
  out = []
  for f in PLAN_WORKLOAD_MODEL_FIELDS + tuple(ITEMSIZE_DTYPES):
    lacking = [role for role in models if f not in w[role] and not (
        f == "tie_embeddings" and role != "actor")]  # (compared for the actor alone)
    if lacking:
      out.append(f"{f} of the " + (f"{', '.join(lacking[:-1])} and " if lacking[1:] else "")
                 + lacking[-1])
  out += [f"the {role}'s shape" for role in ("actor", "critic") if role not in models and not (
      role == "critic" and w.get("trains_critic") is False)]  # (a plan without a critic)
  if "train_config" in w and w.get("reward_model") and "reward" not in models:
    # (a run's plan with a reward model records its shape since 2026-12-04; the papers' pairs
    # simulate the critic's)
    out.append("the reward model's shape")
  out += [k for k in _ALWAYS_RECORDED + (_RUN_PLAN_RECORDED if "train_config" in w else ())
          if k not in w]
  # the length distributions the search sampled (since 2026-12-07), and for a run's plan the
  # data fields they came from
  lengths = w.get("lengths")
  fields = (" (" + ", ".join(LENGTH_INPUT_FIELDS.values()) + ")") if "train_config" in w else ""
  if not isinstance(lengths, Mapping):
    out.append("prompt and response lengths" + fields)
  elif not isinstance(lengths.get("data"), Mapping):
    if fields:  # (a paper pair's has none to record: simulator_lengths_note says so)
      out.append("run fields of its lengths" + fields)
  else:
    data = lengths["data"]
    if data.get("prompts_file") and PROMPTS_DIGEST not in data:
      # (since 2026-12-07: its prompts file is then compared by path alone)
      out.append("content digest of its prompts file (its data.prompts_file is compared by "
                 "path)")
    # (a prompts file's prompts are its own: no task's fields; a task's, no prompt_key)
    later = [LENGTH_INPUT_FIELDS[k] for k in LATER_LENGTH_INPUTS if k not in data and k not in (
        TASK_LENGTH_INPUTS if data.get("prompts_file") else FILE_LENGTH_INPUTS)]
    if later:
      out.append(f"{', '.join(later)} of its lengths")
  return out


def simulator_lengths_note(plan: Mapping[str, Any]) -> str:
  """What the plan file's workload says of lengths that no field of a run stands for: a paper
  pair's (plan_search without a train_config samples the simulator's config.prompt and
  config.response: plan.json's lengths have their specs and no "data"), which are therefore not
  compared; "" for any other workload. Until 2026-12-07 such a file stopped train_ppo's set-up
  with KeyError: 'data', and had it not, its lengths would have passed without a word."""
  w = plan.get("workload")
  lengths = w.get("lengths") if isinstance(w, Mapping) else None
  if (not isinstance(lengths, Mapping) or "train_config" in w or
      isinstance(lengths.get("data"), Mapping)):
    return ""
  specs = [f"{k} {lengths[k]['spec']}" for k in ("prompt", "response")
           if isinstance(lengths.get(k), Mapping) and "spec" in lengths[k]]
  return ("was searched with the simulator's own prompt and response lengths" +
          (f" ({', '.join(specs)})" if specs else "") + ", which no field of a run stands for: "
          "not compared with this run's")


def plan_workload_note(path: str, cfg: Any,
                       reward_model: Optional[Any] = None,
                       inputs: Optional[Mapping[str, Any]] = None
                       ) -> Optional[tuple[bool, str]]:
  """(a warning?, the line) on how the plan file's workload compares with the run's (`cfg`
  resolved; `reward_model` and `inputs`, the resume check's fingerprints of the run's files,
  as plan_workload_differences); None when they agree. A plan searched for another model or
  batch runs, but its predicted times and memory check are not this run's."""
  plan = load_plan_file(path)
  diffs = plan_workload_differences(plan, cfg, reward_model, inputs)
  if diffs is None:
    return False, (f"config.plan.file={path!r} records no workload (a plan.json written before "
                   "plan_search recorded one): not compared with this run's")
  lacking = plan_workload_unrecorded(plan)
  # (said once, after the differences: an old file's fields that cannot be checked, a paper
  # pair's lengths that no run field stands for)
  unchecked = "; it ".join(x for x in (
      (f"records no {', '.join(lacking)} (a plan.json written before plan_search recorded "
       "them): those are not compared with this run's") if lacking else "",
      simulator_lengths_note(plan)) if x)
  if not diffs:
    return (False, f"config.plan.file={path!r} {unchecked}") if unchecked else None
  spec = plan["workload"].get("train_config")
  return True, (
      f"config.plan.file={path!r} was searched for " + "; ".join(diffs) +
      (f" (plan_search's train_config={spec!r})" if spec else "") +
      ": its predicted times and memory check are for that workload (plan_search --config="
      "configs/plan_search.py:train --config.train_config=<this run's config> searches for "
      "this run's)" + (f"; the file {unchecked}" if unchecked else ""))


# What a plan file sets only where the config leaves the default: its micro-batching. A config
# that chose its own keeps it (its memory is then not what the plan checked: plan_check says).
# A config's value equal to the default reads as the default (a ConfigDict keeps no record of
# what was written): the plan's replaces it.
PLAN_SOFT_FIELDS = frozenset({("pipeline", "actor_microbatches"),
                              ("pipeline", "critic_microbatches"), ("algo", "microbatch_size")})


def plan_file_summary(path: str, cfg: Optional[Any] = None) -> str:
  """One line naming every field the plan file at `path` sets, for the set-up log: some of them
  (optim.zero1) the user may not have written. With the run's config `cfg`, a setting the
  config kept its own value of (PLAN_SOFT_FIELDS) is named as not applied (the line listed
  the plan's 16 actor micro-batches where the run's 8 ran)."""
  settings = plan_file_settings(load_plan_file(path), path)

  def shown(sec, name, value):
    ran = getattr(getattr(cfg, sec), name) if cfg is not None else value
    return (f"{sec}.{name}={value!r}" if ran == value else
            f"{sec}.{name}={value!r} (not applied: the config's {ran!r})")
  return f"config.plan.file={path!r} sets " + ", ".join(
      shown(sec, name, value) for (sec, name), (value, _) in settings.items())


def apply_plan_file(d: dict, defaults: Mapping[str, Any], given: Collection[str] = ()) -> dict:
  """The ConfigDict's dict `d` with config.plan.file's settings applied (unchanged without a
  file). A field the config sets away from its default (`defaults`: {"section.field": value},
  config._field_defaults), or that `given` names ("section.field": the command line's
  --config overrides), to another value than the file's is an error naming both, but for the
  micro-batching (PLAN_SOFT_FIELDS), which the config keeps. (Without `given`, a value equal
  to the default cannot be told from an unset one: --config.async_ppo.staleness=0 was replaced
  by the file's 1 without a word.)"""
  path = (d.get("plan") or {}).get("file", "")
  if not isinstance(path, str):  # (open(True) read, then closed, file descriptor 1: stdout)
    raise ValueError(f"config.plan.file={path!r}: expected a string, the path of a plan.json "
                     "(or '': none)")
  if not path:
    return d
  d = {k: dict(v) if isinstance(v, Mapping) else v for k, v in d.items()}
  for (sec, name), (value, key) in plan_file_settings(load_plan_file(path), path).items():
    section = d.setdefault(sec, {})
    now = section.get(name, defaults.get(f"{sec}.{name}"))
    if now != value and (now != defaults.get(f"{sec}.{name}") or f"{sec}.{name}" in given):
      if (sec, name) in PLAN_SOFT_FIELDS:
        continue  # the config's own micro-batching
      raise ValueError(f"config.{sec}.{name}={now!r} conflicts with config.plan.file={path!r}, "
                       f"whose {key}={value!r} sets it: remove one of the two")
    section[name] = value
  return d


def plan_fsdp_error(mesh: Mapping[str, Any], path: str,
                    available: Optional[int] = None) -> Optional[str]:
  """Why a config's own mesh.fsdp (configs/ppo_hf.py:ppo_gpu's 8) cannot take the plan file at
  `path`, or None. A plan trains on tensor x stage devices per model replica, its data
  parallelism on mesh.data; fsdp multiplies that replica. Refused where the replica outgrows
  the devices the plan trains on and `available`, the devices this run trains on when known
  (train_ppo's training group): the errors that followed named the plan's micro-batches, or
  asked for 144 fake devices for a plan of 32. Checked where the device count is known
  (train_ppo, plan_check, plan_search's trainer check), not as the config is read, where it
  also refused a run on more devices than its plan was searched for, which the trainer runs
  (warning that the plan's times and memory check are for its own count)."""
  plan = load_plan_file(path)
  fsdp, tensor, stage = (mesh.get(k, 1) for k in ("fsdp", "tensor", "stage"))
  devices = plan_devices(plan)
  a = plan.get("async")
  if devices and isinstance(a, Mapping) and not async_copies.split_colocated(a):
    devices = a["training_devices"]
  replica = tensor * stage * fsdp if all(_is_int(x) for x in (fsdp, tensor, stage)) else 0
  if not (replica and fsdp > 1 and devices and replica > max(devices, available or 0)):
    return None
  return (f"config.mesh.fsdp={fsdp} with config.plan.file={path!r}: one model replica then "
          f"spans mesh.tensor={tensor} x mesh.stage={stage} x mesh.fsdp={fsdp} = {replica} "
          f"devices, more than the {devices} the plan trains on (its data parallelism is "
          f"mesh.data, {devices // (tensor * stage)} there)"
          + (f" and the {available} this run trains on" if available else "")
          + "; set config.mesh.fsdp=1, or a divisor of that")
