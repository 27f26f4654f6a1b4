"""What a run is made of, built once from its config (docs/architecture.md §1): the task and
tokenizer, the prompt records, the reward resolver, the resolved config and the models.

`resolve_config` fixes everything the config leaves open (the vocabulary from the tokenizer,
the model shapes from HF checkpoints' config.json) reading no weights, so that
`trainer/validate.validate` checks the final config before anything is allocated or compiled;
`build_models` then loads or initialises the weights, placed on the mesh.
"""
from __future__ import annotations

import dataclasses
import filecmp
import functools
import json
import os
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlhfuse_jax.data import chat as chat_lib
from rlhfuse_jax.data import prompts as prompts_lib
from rlhfuse_jax.data import records as records_lib
from rlhfuse_jax.data import rewards as rewards_lib
from rlhfuse_jax.data import tasks as tasks_lib
from rlhfuse_jax.data import tokenizer as tokenizer_lib
from rlhfuse_jax.data import verifiers
from rlhfuse_jax.data.tokenizer import HFTokenizer, Tokenizer
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.models import hf_loader, llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.trainer.config import TrainConfig, stat_label


def load_named(field: str, path: str, load, *args, **kwargs):
  """`load(path, ...)`, a missing file or one it cannot read named by the config field that
  gave it. The loaders name the file only ("p.jsonl:2: invalid JSON", "not a valid
  tokenizer.json"), which left the user of a run with several files (prompts, held-out prompts,
  tokenizer, checkpoints) to match the path to a field. An error that names a field already,
  or of another type (whose constructor may take other arguments), is raised as it is."""
  try:
    return load(path, *args, **kwargs)
  except (FileNotFoundError, ValueError) as e:
    if type(e) not in (FileNotFoundError, ValueError) or str(e).startswith("config."):
      raise
    raise type(e)(f"config.{field}={path!r}: {e}") from None


def build_task_and_tokenizer(cfg: TrainConfig):
  d = cfg.data
  if d.task not in tasks_lib.TASKS:
    raise ValueError(f"config.data.task={d.task!r}: expected one of {sorted(tasks_lib.TASKS)}")
  task = tasks_lib.make_task(d.task, length_dist=d.length_dist, length_min=d.length_min,
                             length_max=d.length_max, length_mu=d.length_mu,
                             length_sigma=d.length_sigma)
  tokenizer: Tokenizer = task.tokenizer
  # (A checkpoint path that does not exist is named later, by resolve_config.)
  if cfg.init.actor_checkpoint and not cfg.init.tokenizer and os.path.exists(
      cfg.init.actor_checkpoint):
    # The task's own word-level vocabulary would pass every check (it is smaller) and feed a
    # real model ids that mean other tokens in its vocabulary, stopping on the wrong EOS.
    beside = os.path.join(cfg.init.actor_checkpoint, "tokenizer.json")
    hint = (f"its own, {beside!r}" if os.path.isfile(beside) else
            "the tokenizer.json the checkpoint was trained with")
    raise ValueError(
        f"config.init.tokenizer is empty but config.init.actor_checkpoint="
        f"{cfg.init.actor_checkpoint!r} is set: the task's {task.tokenizer.vocab_size}-token "
        f"vocabulary would give the model ids of other tokens; set config.init.tokenizer to "
        f"{hint}")
  if cfg.init.tokenizer:
    tokenizer = load_named("init.tokenizer", cfg.init.tokenizer, HFTokenizer.from_file)
    tokenizer = with_checkpoint_stop_ids(cfg, tokenizer)
  return task, tokenizer


def with_checkpoint_stop_ids(cfg: TrainConfig, tokenizer: HFTokenizer) -> HFTokenizer:
  """The tokenizer, also stopping on the eos_token_id of the actor checkpoint's
  generation_config.json (else its config.json's: tokenizer_lib.checkpoint_eos) when
  init.tokenizer lives in another directory: the tokenizer reads the files beside its own
  only, so the run generated past ids that the export (which copies the checkpoint's
  generation_config.json and config.json's eos_token_id) told transformers to stop on."""
  ckpt = cfg.init.actor_checkpoint
  path = tokenizer_lib.tokenizer_file(cfg.init.tokenizer)
  if not ckpt or not os.path.isdir(ckpt) or os.path.samefile(
      os.path.dirname(os.path.abspath(path)), ckpt):
    return tokenizer
  own, ids = load_named("init.actor_checkpoint", ckpt, tokenizer_lib.checkpoint_eos)
  outside = [i for i in ids if i >= tokenizer.vocab_size]
  if outside:  # the tokenizer is the one at fault (the example's, left from the config)
    raise ValueError(
        f"config.init.tokenizer={cfg.init.tokenizer!r} is not the tokenizer of config.init."
        f"actor_checkpoint={ckpt!r}: its {tokenizer.vocab_size} tokens lack the ids "
        f"{outside} that the checkpoint's {os.path.basename(own)} stops on; set "
        f"config.init.tokenizer to the checkpoint's own tokenizer.json")
  added = [i for i in ids if i not in tokenizer.stop_ids]
  if not added:
    return tokenizer
  logging.info("responses also end on token ids %s: the eos_token_id of %s (config.init."
               "actor_checkpoint's)", added, own)
  return load_named("init.tokenizer", path, functools.partial(
      HFTokenizer.from_file, extra_eos_ids=tuple(tokenizer.extra_eos_ids) + tuple(added)))


def _reward_names(cfg: TrainConfig) -> set[str]:
  """The functions the run's reward adds up: reward.format, and reward.function unless a
  reward model scores in its place."""
  return {cfg.reward.format} | ({cfg.reward.function} if cfg.reward.kind == "function" else set())


def _needs_answer(cfg: TrainConfig) -> bool:
  """Whether the run's reward or a statistic (reward.stats) verifies against each record's
  answer (then every row needs one; a reward model or a user's function may do without). A
  statistic's verifier stops the run on a row without one as a reward's does, but only once
  the row is drawn: mid-training, where the load would have named it."""
  names = _reward_names(cfg) | set(cfg.reward.stat_specs)
  return "task" in names or bool(names & rewards_lib.NEEDS_ANSWER)


def _load(cfg: TrainConfig, field: str) -> list[dict]:
  d = cfg.data
  records = load_named(f"data.{field}", getattr(d, field), records_lib.load_records,
                       d.prompt_key, d.answer_key, require_answer=_needs_answer(cfg),
                       check_answer_key=field == "prompts_file",
                       keys_of="config.data.prompts_file" if field == "val_file" else "")
  checks = sorted(n for n in _reward_names(cfg) | set(cfg.reward.stat_specs)
                  if n in verifiers.ANSWER_CHECKS)
  for r in records:
    for name in checks:
      try:
        verifiers.ANSWER_CHECKS[name](r[records_lib.ANSWER_KEY])
      except ValueError as e:
        raise ValueError(f"config.data.{field}: {r[prompts_lib.SOURCE_KEY]}: {e}, which the "
                         f"run's {name!r} verifier reads (field '{d.answer_key}'); fix or drop "
                         "the row") from None
  return records


def load_prompt_records(cfg: TrainConfig, task, cap: bool = True
                        ) -> tuple[list[dict], list[dict]]:
  """(training, held-out) prompt records: data.prompts_file or the task's prompts, and
  data.val_file or a data.val_fraction split of them (held-out: [] without either), the
  held-out ones capped at data.val_max_prompts (`cap` False: the whole held-out pool)."""
  if cfg.data.prompts_file:
    records = _load(cfg, "prompts_file")
  else:
    records = task.make_prompts(cfg.data.num_prompts, np.random.default_rng([cfg.seed, 17]))
  held_out = []
  if cfg.data.val_fraction > 0:
    records, held_out = records_lib.split_records(records, cfg.data.val_fraction, cfg.seed)
  elif cfg.data.val_file:
    held_out = _load(cfg, "val_file")
  if cfg.data.prompts_file or cfg.data.val_file:  # (a task's own prompts repeat by design)
    _warn_seen_in_training(records, held_out)
  return records, (_cap_held_out(cfg, held_out) if cap else held_out)


def _warn_seen_in_training(records: list, held_out: list) -> None:
  """A warning when held-out prompts are also training prompts (the same text, or messages):
  a data.val_file that is the training file, or a data.val_fraction split of a file that
  repeats a prompt (GSM8K's train split does), validated on trained prompts without a word."""
  if not held_out:
    return
  key = lambda r: json.dumps(r.get(records_lib.PROMPT_KEY), sort_keys=True)
  trained = {key(r) for r in records}
  seen = [r for r in held_out if key(r) in trained]
  if seen:
    logging.warning("%d of the %d held-out prompts are also training prompts (the first: %s): "
                    "validation measures them after training on them; drop the repeats from "
                    "the held-out set (or give a data.val_file of other prompts)", len(seen),
                    len(held_out), seen[0].get(prompts_lib.SOURCE_KEY, "a prompt of the task"))


def _cap_held_out(cfg: TrainConfig, held_out: list) -> list:
  """The held-out records validation uses: the first data.val_max_prompts (0: all)."""
  return held_out[:cfg.data.val_max_prompts or None]


def _prompt_text(prompt: Any) -> str:
  """A record's prompt as plain text: the string, or its messages' contents."""
  if isinstance(prompt, str):
    return prompt
  return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))


def warn_unspellable(records: list, tokenizer: Tokenizer, where: str, sample: int = 64) -> int:
  """Warns (and returns how many) when the tokenizer cannot spell some of the first `sample`
  prompts: their text does not read back from its tokens (whitespace aside). A tokenizer
  without byte fallback or an unknown token drops what its vocabulary lacks, silently: a test
  fixture's turned every GSM8K prompt's numbers into nothing, and the verifier could never
  score. Byte-level tokenizers (Llama 3, Qwen) always read back."""
  lost = []
  for record in records[:sample]:
    text = _prompt_text(record.get(records_lib.PROMPT_KEY, ""))
    # (special tokens kept: a prompt rendered by another tool holds the chat template's
    # <|eot_id|> ..., which the default decode drops, and every prompt was said unspellable)
    back = tokenizer.decode(tokenizer.encode(text, add_bos=False), skip_special_tokens=False)
    if "".join(back.split()) != "".join(text.split()):
      lost.append((text, back))
  if lost:
    text, back = lost[0]
    logging.warning("the tokenizer cannot spell %d of the first %d prompts of %s: e.g. %r reads "
                    "back from its tokens as %r (characters outside its vocabulary are dropped: "
                    "a tokenizer without byte fallback or an unknown token; is config.init."
                    "tokenizer the model's own?)", len(lost), min(sample, len(records)), where,
                    text[:120], back[:120])
  return len(lost)


def warn_short_budget(cfg: TrainConfig, records: list, tokenizer: Tokenizer,
                      sample: int = 4096) -> int:
  """Warns (and returns how many of the first `sample` records) when rollout.max_new_tokens
  cannot hold a record's target and its EOS while the reward scores the whole target (the
  task's verifier, target_match, length_match, exact_match): those responses are cut before
  they can earn full marks. (A run may mean it, e.g. to train on truncation; so a warning.)"""
  if not _reward_names(cfg) & (rewards_lib.WHOLE_TARGET | {"task"}):
    return 0
  targets = [r[records_lib.ANSWER_KEY] for r in records[:sample]
             if isinstance(r.get(records_lib.ANSWER_KEY), str)]
  if not targets:
    return 0
  needed = np.array([len(ids) + 1 for ids in tokenizer.encode_batch(targets, add_bos=False)])
  over = int((needed > cfg.rollout.max_new_tokens).sum())
  if over:
    logging.warning("config.rollout.max_new_tokens=%d cannot hold the target and its EOS of %d "
                    "of the first %d prompts (up to %d tokens): the reward scores the whole "
                    "target, so those responses are cut before they can reach full marks; "
                    "raise rollout.max_new_tokens%s", cfg.rollout.max_new_tokens, over,
                    len(targets), int(needed.max()),
                    "" if cfg.data.prompts_file else " (or lower data.length_max)")
  return over


def build_datasets(cfg: TrainConfig, task, tokenizer: Tokenizer
                   ) -> tuple[prompts_lib.PromptDataset, Optional[prompts_lib.PromptDataset]]:
  """The training prompt stream (its position is checkpointed) and the held-out prompts (None
  without any), both rendered through data.chat_template and tokenised now, so that a bad row
  stops the run before anything is compiled."""
  return build_datasets_and_pool(cfg, task, tokenizer)[:2]


def build_datasets_and_pool(cfg: TrainConfig, task, tokenizer: Tokenizer
                            ) -> tuple[prompts_lib.PromptDataset,
                                       Optional[prompts_lib.PromptDataset], int]:
  """build_datasets's two, and the size of the held-out pool before data.val_max_prompts caps
  it (0 without one): a resume that changes val_max_prompts validates on the same prompts when
  min(pool, val_max_prompts) is the same (trainer/inputs.py, warn_eval_changes)."""
  template = chat_lib.ChatTemplate.load(cfg.data.chat_template, cfg.init.tokenizer)
  train, held_out = load_prompt_records(cfg, task, cap=False)
  pool = len(held_out)
  held_out = _cap_held_out(cfg, held_out)
  add_bos = False if template is not None else None

  def make(records: list, shuffle: bool) -> prompts_lib.PromptDataset:
    rendered = records_lib.render_prompts(records, template)
    if cfg.data.overlong_prompts == "skip":
      rendered = skip_overlong(rendered, tokenizer, cfg.data.max_prompt_len, add_bos,
                               "training" if shuffle else "validation")
    return prompts_lib.PromptDataset(
        rendered, tokenizer, batch_size=cfg.rollout.prompts_per_iteration,
        max_prompt_len=cfg.data.max_prompt_len, seed=cfg.seed, shuffle=shuffle,
        padding="right", field=records_lib.PROMPT_TEXT_KEY, add_bos=add_bos)
  try:
    if cfg.data.prompts_file:  # a task's prompts are its tokenizer's own words
      warn_unspellable(train, tokenizer, f"config.data.prompts_file={cfg.data.prompts_file!r}")
    warn_short_budget(cfg, train, tokenizer)
    datasets = make(train, True), (make(held_out, False) if held_out else None)
  except ValueError:
    if cfg.data.prompts_file and not cfg.init.tokenizer:
      _refuse_task_vocabulary(cfg, train + held_out, tokenizer)
    raise
  if template is None:
    warn_double_bos(cfg, tokenizer, *datasets)
  else:
    warn_chat_template(cfg, tokenizer, train + held_out)
    warn_assistant_last(train + held_out)
    warn_no_generation_prompt(cfg, template, train + held_out)
  logging.info("%s", describe_prompts(cfg, template, *datasets))
  return (*datasets, pool)


def warn_double_bos(cfg: TrainConfig, tokenizer: Tokenizer,
                    *datasets: Optional[prompts_lib.PromptDataset]) -> None:
  """Warns of plain-text prompts (data.chat_template='none') that already begin with the BOS
  token, to which the tokenizer adds its own (as transformers' tokenizer(text) does): data
  rendered by another tool (OpenRLHF tokenises it with add_special_tokens=False) is then read
  with two BOS tokens, a prompt the model never saw in training."""
  bos = getattr(tokenizer, "bos_id", None)
  if bos is None or not getattr(tokenizer, "add_bos", False):
    return
  tokens = [ds.tokens for ds in datasets if ds is not None and len(ds)]
  if not tokens:
    return
  both = np.concatenate(tokens)
  twice = int(np.sum((both[:, 0] == bos) & (both[:, 1] == bos))) if both.shape[1] > 1 else 0
  if twice:
    logging.warning(
        "%d of %d prompts begin with two BOS tokens (id %d): their text already starts with "
        "%r and the tokenizer adds its own; take it out of the prompts' text, or leave the "
        "rendering to a chat template (config.data.chat_template), which writes it once",
        twice, len(both), bos,
        tokenizer.id_to_token(bos) if hasattr(tokenizer, "id_to_token") else bos)


def warn_chat_template(cfg: TrainConfig, tokenizer: Tokenizer, records: list,
                       sample: int = 64) -> int:
  """Warns (and returns how many) of the first `sample` prompts whose text already begins with
  the BOS token while a chat template renders them (config.data.chat_template): text another
  tool rendered, rendered again as a user's message (two BOS tokens, the template's headers
  twice), without a word. (warn_double_bos is plain text's counterpart.)"""
  bos = getattr(tokenizer, "bos_id", None)
  if bos is None or not hasattr(tokenizer, "id_to_token"):
    return 0
  text = tokenizer.id_to_token(bos)
  texts = [_prompt_text(r.get(records_lib.PROMPT_KEY, "")) for r in records[:sample]]
  twice = sum(t.lstrip().startswith(text) for t in texts) if text else 0
  if twice:
    logging.warning("%d of the first %d prompts already begin with the BOS token %r (text a "
                    "chat template rendered?) and config.data.chat_template=%r renders them "
                    "again, as a user's message: set config.data.chat_template='none' for "
                    "prompts rendered beforehand", twice, len(texts), text,
                    cfg.data.chat_template)
  return twice


def warn_assistant_last(records: list) -> int:
  """Warns (and returns how many) of prompts whose messages end with the assistant's: chat data
  made for fine-tuning, whose last message is the answer, was rendered with the answer in the
  prompt and a second assistant turn after it, without a word (the policy can copy it)."""
  last = [r for r in records if isinstance(r.get(records_lib.PROMPT_KEY), list) and
          r[records_lib.PROMPT_KEY] and r[records_lib.PROMPT_KEY][-1].get("role") == "assistant"]
  if last:
    logging.warning("%d of the %d prompts end with an assistant message (the first: %s): the "
                    "policy answers after it, in a second assistant turn; if it is the answer "
                    "(chat data made for fine-tuning), drop it from the prompt and give it as "
                    "the row's answer (config.data.answer_key)", len(last), len(records),
                    last[0].get(prompts_lib.SOURCE_KEY, "a prompt"))
  return len(last)


def warn_no_generation_prompt(cfg: TrainConfig, template: chat_lib.ChatTemplate,
                              records: list) -> bool:
  """Warns (and returns True) when the chat template renders the first prompt the same with
  and without add_generation_prompt and the prompt stops inside the user's turn, with no
  assistant header: the text ends with the last message's own words (the policy continues the
  user's text rather than answering it), or the template writes a header before an assistant's
  message that the prompt lacks (ChatML's `<|im_start|>assistant`, written only for a message:
  the prompt ends at the closed user turn and the policy must write the header itself), without
  a word (a template written for fine-tuning). A template whose user turn closes with the cue
  to answer (Mistral's `[/INST]`, before the assistant's words) needs no generation prompt and
  is not warned of."""
  if not records:
    return False
  messages = chat_lib.as_messages(records[0].get(records_lib.PROMPT_KEY))
  try:
    text = template.render(messages)
    same = text == template.render(messages, add_generation_prompt=False)
  except chat_lib.ChatTemplateError:  # (render_prompts has named the row already)
    return False
  last = str(messages[-1].get("content", "")).strip() if messages else ""
  # (a prompt that ends with the assistant's words is a prefill the policy continues, warned
  # of by warn_assistant_last: not the user's text)
  if not same or not messages or messages[-1].get("role") == "assistant":
    return False
  if last and text.rstrip().endswith(last):
    logging.warning("config.data.chat_template=%r writes nothing for add_generation_prompt "
                    "(the first prompt renders the same without it): the prompts end after "
                    "the user's message, with no assistant header, and the policy continues "
                    "the user's text; use the model's own template or one that opens the "
                    "assistant's turn when add_generation_prompt is set",
                    cfg.data.chat_template)
    return True
  header = _assistant_header(template, messages, text)
  if header:
    logging.warning("config.data.chat_template=%r writes nothing for add_generation_prompt "
                    "(the first prompt renders the same without it): the prompts end after "
                    "the user's turn, without the header %r that the template writes before "
                    "an assistant's message, so the policy has to write it itself; use the "
                    "model's own template or one that writes that header when "
                    "add_generation_prompt is set", cfg.data.chat_template, header)
  return bool(header)


# An assistant's answer no template changes, to find where it starts in a rendered conversation.
_ANSWER_MARK = "rlhfuse-answer-mark"


def _assistant_header(template: chat_lib.ChatTemplate, messages: list, prompt: str) -> str:
  """What `template` writes between `prompt` (the rendering of `messages`) and an assistant's
  answer that follows them ('<|im_start|>assistant\\n' for ChatML); '' when it writes only
  whitespace there (Mistral's answer follows its `[/INST]`), or when the conversation with the
  answer does not render as `prompt` followed by more."""
  try:
    full = template.render(messages + [{"role": "assistant", "content": _ANSWER_MARK}],
                           add_generation_prompt=False)
  except chat_lib.ChatTemplateError:
    return ""
  start = full.find(_ANSWER_MARK, len(prompt))
  if not full.startswith(prompt) or start < 0:
    return ""
  header = full[len(prompt):start]
  return header if header.strip() else ""


def describe_prompts(cfg: TrainConfig, template: Optional[chat_lib.ChatTemplate],
                     train: prompts_lib.PromptDataset,
                     held_out: Optional[prompts_lib.PromptDataset]) -> str:
  """The log's line on the prompts as the model reads them: which chat template rendered them
  (the log said nothing of it: a template path or 'auto' that found another template than meant
  went unnoticed) and their token lengths against data.max_prompt_len (to size it)."""
  if template is None:
    how = f"as plain text (config.data.chat_template={cfg.data.chat_template!r})"
  else:
    how = (f"with the chat template of {template.name} "
           f"(config.data.chat_template={cfg.data.chat_template!r})")
  parts = []
  for what, ds in (("training", train), ("validation", held_out)):
    if ds is not None and len(ds):
      lengths = np.asarray(ds.lengths)
      parts.append(f"{what} median {int(np.median(lengths))}, longest {int(lengths.max())}")
  return (f"prompts: rendered {how}; tokens per prompt: {', '.join(parts)} "
          f"(config.data.max_prompt_len={cfg.data.max_prompt_len})")


def skip_overlong(records: list, tokenizer: Tokenizer, max_len: int, add_bos: Optional[bool],
                  what: str) -> list:
  """`records` (rendered) without those whose prompt is longer than `max_len` tokens
  (config.data.overlong_prompts='skip'; verl's filter_overlong_prompts), logging how many and
  the first; a ValueError when none is left. Records the tokenizer cannot encode are kept, for
  the dataset's own error to name."""
  sizes = []  # (tokenised in chunks: a whole pool's encodings at once took GBs, prompts.py)
  for start in range(0, len(records), prompts_lib.ENCODE_CHUNK):
    chunk = records[start:start + prompts_lib.ENCODE_CHUNK]
    try:
      ids = tokenizer.encode_batch([r[records_lib.PROMPT_TEXT_KEY] for r in chunk],
                                   add_bos=add_bos)
    except Exception:  # pylint: disable=broad-except
      return records
    sizes += [len(seq) for seq in ids]
  kept = [r for r, n in zip(records, sizes) if n <= max_len]
  skipped = [(r, n) for r, n in zip(records, sizes) if n > max_len]
  if skipped:
    first, n = skipped[0]
    logging.warning("left out %d of the %d %s prompts longer than config.data.max_prompt_len="
                    "%d tokens (config.data.overlong_prompts='skip'); the first%s has %d",
                    len(skipped), len(records), what, max_len, prompts_lib.where(first), n)
  if not kept:
    raise ValueError(f"every one of the {len(records)} {what} prompts is longer than "
                     f"config.data.max_prompt_len={max_len} tokens: nothing is left to train on "
                     "with config.data.overlong_prompts='skip'; raise max_prompt_len")
  return kept


def _refuse_task_vocabulary(cfg: TrainConfig, records: list, tokenizer: Tokenizer) -> None:
  """A ValueError naming the first of `records` (a prompts file's) whose prompt or answer the
  synthetic task's word-level tokenizer cannot encode, and config.init.tokenizer: the error
  was the tokenizer library's "Missing [UNK] token", naming neither the field nor the row.
  Nothing when every record encodes (the caller's error was another)."""
  for record in records:
    answer = record.get(records_lib.ANSWER_KEY)
    for what, text in (("prompt", _prompt_text(record.get(records_lib.PROMPT_KEY, ""))),
                       ("answer", answer if isinstance(answer, str) else "")):
      try:
        tokenizer.encode(text, add_bos=False)
      except ValueError:
        raise ValueError(
            f"{record.get(prompts_lib.SOURCE_KEY, cfg.data.prompts_file)}: the {what} "
            f"{text[:80]!r} is not in the {cfg.data.task!r} task's word-level vocabulary "
            f"({tokenizer.name}), the tokenizer of a run without config.init.tokenizer; set "
            "config.init.tokenizer to the tokenizer.json of the model the prompts are for (and "
            "config.init.actor_checkpoint to its weights)") from None


def build_dataset(cfg: TrainConfig, task, tokenizer: Tokenizer) -> prompts_lib.PromptDataset:
  """The training prompt stream alone (see build_datasets)."""
  return build_datasets(cfg, task, tokenizer)[0]


# Model fields a run chooses for itself, kept from the config when a checkpoint's config.json
# sets the architecture: numerics, attention kernel, recomputation, layer scanning, context, and
# the fused projections (the same parameters computed as fewer matmuls; models/llama.py).
RUN_MODEL_FIELDS = ("param_dtype", "dtype", "attention", "remat", "scan_layers", "max_seq_len",
                    "fused_projections")


def checkpoint_config(path: str, section: ModelConfig, field: str = "init.actor_checkpoint",
                      **overrides) -> ModelConfig:
  """The architecture of the checkpoint at `path` (config.`field`) with the run's own fields of
  `section`."""
  keep = {f: getattr(section, f) for f in RUN_MODEL_FIELDS}
  return load_named(field, path, hf_loader.load_hf_config, **{**keep, **overrides})


def actor_checkpoint_config(path: str, section: ModelConfig) -> ModelConfig:
  """checkpoint_config of config.init.actor_checkpoint=`path`, refused when it is a
  *ForSequenceClassification (a scalar head): the actor generates with an LM head. Also
  plan_check's run (configs/plan_check.apply_run), which sized it with one."""
  model = checkpoint_config(path, section)
  if model.head != "lm":
    raise ValueError(hf_loader.scalar_actor_error(f"config.init.actor_checkpoint={path!r}"))
  return model


def check_shape_overrides(cfg: TrainConfig, overrides: Mapping[str, Any],
                          flag: str = "--config") -> None:
  """Refuses a command-line override of a model's architecture beside the checkpoint whose
  config.json sets it (`--config.model.num_layers=4` with init.actor_checkpoint, or a
  critic_model field with init.critic_checkpoint when a critic trains): the run would build
  the checkpoint's shape, not the one asked for, and said so only in its `actor: ...` log line.
  `overrides`: the command line's {"model.num_layers": 4, ...} (ml_collections'
  config_flags.get_override_values of `flag`). A value the checkpoint has too, and the fields a
  run chooses itself (RUN_MODEL_FIELDS), pass; a config file's own model section is not an
  override (a preset's example shape beside a user's checkpoint is expected). Reads config.json
  only, as resolve_config does."""
  sources = {"model": ("init.actor_checkpoint", cfg.init.actor_checkpoint, {})}
  if adv_lib.needs_critic(cfg.algo.estimator):
    sources["critic_model"] = ("init.critic_checkpoint", cfg.init.critic_checkpoint,
                               {"head": "scalar"})
  names = {f.name for f in dataclasses.fields(ModelConfig)} - set(RUN_MODEL_FIELDS)
  read = {}
  for key in sorted(overrides):
    section, _, name = key.partition(".")
    if section not in sources or name not in names or not sources[section][1]:
      continue
    field, path, fixed = sources[section]
    if section not in read:
      read[section] = checkpoint_config(path, getattr(cfg, section), field, **fixed)
    given, own = getattr(getattr(cfg, section), name), getattr(read[section], name)
    if given != own:
      raise ValueError(
          f"{flag}.{key}={given!r} cannot apply: config.{field}={path!r} sets the model's "
          f"architecture from its config.json, where {name} is {own!r}. Drop the override "
          f"(the run builds the checkpoint's model), or set {flag}.{field}='' to build "
          f"config.{section}'s shape from scratch; of a model section, only "
          f"{', '.join(RUN_MODEL_FIELDS)} apply beside a checkpoint")


# What to change when a checkpoint's own tokenizer.json gives the run's tokens other ids: the
# actor's names the tokenizer at fault, a critic's or reward model's the checkpoint (it reads
# the actor's token ids, so it must have been trained with the run's tokenizer).
_FOREIGN_REMEDY = {
    "init.critic_checkpoint": "the critic would read every sequence as other tokens; set "
                              "config.init.critic_checkpoint to a model trained with the run's "
                              "tokenizer (the actor's directory gives a critic of its shape), "
                              "or '' for a critic of config.critic_model's shape",
    "reward.model_checkpoint": "the reward model would score every sequence as other tokens; "
                               "set config.reward.model_checkpoint to a reward model trained "
                               "with the actor's tokenizer",
}


def check_foreign_tokenizer(checkpoint: str, tokenizer_path: str,
                            field: str = "init.actor_checkpoint") -> bool:
  """Refuses the run's tokenizer (config.init.tokenizer) when it gives a token the actor's
  checkpoint's own tokenizer.json has another id, or shares fewer than half its tokens with it:
  a config made for another model (configs/ppo_hf.py names its example's tokenizer) with only
  init.actor_checkpoint changed trained the new model on the old tokenizer's ids (its prompts
  read as other text) and exported that tokenizer beside it, with one warning line. Another
  file that keeps the checkpoint's ids (an extended tokenizer) is warned of, and True
  returned; the same file or the same contents: False. For `field` init.critic_checkpoint or
  reward.model_checkpoint the same refusal names that checkpoint (configs/ppo_hf.py's critic
  is its example's: a run that changed the actor and the tokenizer trained the example's
  critic on ids it never saw, with one info line), and nothing is warned of."""
  own = os.path.join(checkpoint, "tokenizer.json")
  given = tokenizer_lib.tokenizer_file(tokenizer_path) if tokenizer_path else ""
  if not given or not os.path.isfile(own) or not os.path.isfile(given):
    return False
  if filecmp.cmp(own, given, shallow=False):  # the same file, or the same contents
    return False
  import tokenizers  # pylint: disable=import-outside-toplevel
  ids, added = {}, {}
  for name, path in (("own", own), ("given", given)):
    try:
      tok = tokenizers.Tokenizer.from_file(path)
      # The model's vocabulary (text pieces), apart from the added (special) tokens.
      ids[name] = tok.get_vocab(with_added_tokens=False)
      added[name] = {t: i for t, i in tok.get_vocab(with_added_tokens=True).items()
                     if t not in ids[name]}
    except Exception:  # pylint: disable=broad-except
      ids[name] = None  # the tokenizer's own load reports a file it cannot read
  if ids["own"] is not None and ids["given"] is not None:
    shared = sorted(set(ids["own"]) & set(ids["given"]))
    moved = [t for t in shared if ids["own"][t] != ids["given"][t]]
    if moved or 2 * len(shared) < len(ids["given"]):
      example = (f" (e.g. {moved[0]!r}: {ids['given'][moved[0]]} there, "
                 f"{ids['own'][moved[0]]} in the checkpoint's)" if moved else "")
      if field in _FOREIGN_REMEDY:
        raise ValueError(
            f"config.{field}={checkpoint!r} was not trained with config.init.tokenizer="
            f"{tokenizer_path!r}: of the {len(ids['given'])} pieces of that vocabulary, "
            f"{len(shared)} are in the checkpoint's {own} and {len(moved)} of those have other "
            f"ids{example}; {_FOREIGN_REMEDY[field]}")
      raise ValueError(
          f"config.init.tokenizer={tokenizer_path!r} is not the tokenizer of config.init."
          f"actor_checkpoint={checkpoint!r}: of the {len(ids['given'])} pieces of its "
          f"vocabulary, {len(shared)} are in the checkpoint's {own} and {len(moved)} of those "
          f"have other ids{example}, so the model would read every prompt as other tokens; "
          f"set config.init.tokenizer={own!r} (a tokenizer that extends the checkpoint's, "
          "keeping its ids, is accepted)")
    if field in _FOREIGN_REMEDY:
      return False
    # Special tokens that moved (Llama 3.1 renamed 3.0's reserved ones): the text reads the
    # same, but a template or a stop id naming one of them would not.
    specials = sorted(t for t in set(added["own"]) & set(added["given"])
                      if added["own"][t] != added["given"][t])
    if specials:
      logging.warning("config.init.tokenizer=%r gives %d special token(s) other ids than "
                      "config.init.actor_checkpoint's %s (e.g. %r: %d there, %d in the "
                      "checkpoint's); the text vocabulary agrees", tokenizer_path, len(specials),
                      own, specials[0], added["given"][specials[0]], added["own"][specials[0]])
  logging.warning("config.init.tokenizer=%r is not the tokenizer of config.init.actor_checkpoint="
                  "%r (%s differs; the tokens they share have the same ids): the run tokenises "
                  "with the former and exports it beside the trained weights", tokenizer_path,
                  checkpoint, own)
  return True


# A checkpoint's embedding has at most a few percent more rows than its tokenizer has tokens
# (padding to a multiple of 64 or 128: Qwen2.5 151936 rows for 151665 tokens, GPT-NeoX 50432
# for 50277); a tokenizer under 90 % of the rows is likely another model's.
_VOCAB_SHARE = 0.9


def resolve_config(cfg: TrainConfig, tokenizer: Tokenizer, log: bool = True,
                   weights: bool = True, critic_weights: Optional[bool] = None) -> TrainConfig:
  """`cfg` with the tokenizer's vocabulary and the checkpoints' architectures (config.json
  only; no weights are read; the config's RUN_MODEL_FIELDS are kept): the config every later
  step sees. (The checkpoints' fingerprint is of the config as given, before this.) weights,
  critic_weights (None: as weights): log_architectures'."""
  if not cfg.init.actor_checkpoint:
    cfg = cfg.with_vocab(tokenizer.vocab_size)
  else:  # The checkpoint's config.json sets the vocabulary below, checked against the tokenizer
    # there; a config file's model.vocab_size beside it is not the model built.
    cfg = dataclasses.replace(cfg, vocab_from_tokenizer=False)
    model = actor_checkpoint_config(cfg.init.actor_checkpoint, cfg.model)
    if tokenizer.vocab_size > model.vocab_size:
      own = os.path.join(cfg.init.actor_checkpoint, "tokenizer.json")
      given = (tokenizer_lib.tokenizer_file(cfg.init.tokenizer) if cfg.init.tokenizer
               else "")
      if given and os.path.isfile(own) and os.path.isfile(given) and filecmp.cmp(
          own, given, shallow=False):  # its own tokenizer: the checkpoint disagrees with itself
        raise ValueError(
            f"config.init.actor_checkpoint={cfg.init.actor_checkpoint!r}: its config.json "
            f"has vocab_size={model.vocab_size} but its own tokenizer.json has "
            f"{tokenizer.vocab_size} tokens; one of the two files is wrong (the embedding's "
            "rows, model.embed_tokens.weight, say which)")
      raise ValueError(
          f"the tokenizer has {tokenizer.vocab_size} tokens but config.init.actor_checkpoint="
          f"{cfg.init.actor_checkpoint!r} embeds {model.vocab_size}: use the checkpoint's own "
          "tokenizer (config.init.tokenizer)")
    check_foreign_tokenizer(cfg.init.actor_checkpoint, cfg.init.tokenizer)
    if tokenizer.vocab_size < _VOCAB_SHARE * model.vocab_size and not os.path.isfile(
        os.path.join(cfg.init.actor_checkpoint, "tokenizer.json")):  # nothing to compare with
      logging.warning(
          "the tokenizer (config.init.tokenizer=%r) has %d tokens, %.0f%% of the %d that "
          "config.init.actor_checkpoint=%r embeds, and the checkpoint has no tokenizer.json "
          "to compare it with: if that is not the tokenizer it was trained with, the model "
          "reads every prompt as other tokens", cfg.init.tokenizer, tokenizer.vocab_size,
          100 * tokenizer.vocab_size / model.vocab_size, model.vocab_size,
          cfg.init.actor_checkpoint)
    # Without a checkpoint of its own the critic reads the actor's token ids: its vocabulary.
    cfg = dataclasses.replace(cfg, model=model, critic_model=cfg.critic_model.replace(
        vocab_size=model.vocab_size))
  if cfg.init.critic_checkpoint and adv_lib.needs_critic(cfg.algo.estimator):
    check_foreign_tokenizer(cfg.init.critic_checkpoint, cfg.init.tokenizer,
                            "init.critic_checkpoint")
    cfg = dataclasses.replace(cfg, critic_model=checkpoint_config(
        cfg.init.critic_checkpoint, cfg.critic_model, "init.critic_checkpoint", head="scalar"))
  if log:  # (not for each plan a plan search checks)
    log_architectures(cfg, weights if critic_weights is None else critic_weights)
  return cfg


def _shape(m: ModelConfig) -> str:
  return (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads}/{m.num_kv_heads} "
          f"heads, vocab {m.vocab_size}, {m.num_params() / 1e6:.3g}M parameters")


def log_architectures(cfg: TrainConfig, weights: bool = True) -> None:
  """Logs the models the run builds (a checkpoint's config.json replaces config.model's shape:
  the config file's shape fields beside a checkpoint are not the model trained (a command-line
  override of one is refused: check_shape_overrides), and WORKDIR/config.json holds the config
  as given), and warns of a critic built from
  config.critic_model's shape beside an actor 8 times its size from a checkpoint (ppo_hf.py's
  toy critic, 2 layers 64 wide, beside a user's 1B actor when init.critic_checkpoint='').
  weights=False (an export or a resume, whose checkpoint overwrites the critic):
  init.critic_checkpoint's safetensors are not opened to say where its value head comes from
  (an export failed once they had been moved away)."""
  actor_from = (f"config.init.actor_checkpoint={cfg.init.actor_checkpoint!r}"
                if cfg.init.actor_checkpoint else "config.model")
  logging.info("actor: %s (%s)", _shape(cfg.model), actor_from)
  if not adv_lib.needs_critic(cfg.algo.estimator):
    return
  critic_from = (f"config.init.critic_checkpoint={cfg.init.critic_checkpoint!r}"
                 if cfg.init.critic_checkpoint else "config.critic_model" + (
                     ", randomly initialised" if weights else ""))
  if not weights:  # (a resume's or export's critic from config.critic_model is no random one)
    critic_from += ("; its config.json only: the weights are the checkpoint's"
                    if cfg.init.critic_checkpoint else "; the weights are the checkpoint's")
  elif cfg.init.critic_checkpoint:  # a reward model's trained head or a fresh one
    names = load_named("init.critic_checkpoint", cfg.init.critic_checkpoint,
                       hf_loader.tensor_names)
    prefix = hf_loader.scalar_head_prefix(names, load_named(
        "init.critic_checkpoint", cfg.init.critic_checkpoint, hf_loader.own_head_prefix))
    critic_from += (f"; value head: its {prefix}.weight (a reward model's head)"
                    if prefix else "; value head drawn fresh")
  logging.info("critic: %s (%s)", _shape(cfg.critic_model), critic_from)
  if (cfg.init.actor_checkpoint and not cfg.init.critic_checkpoint and
      8 * cfg.critic_model.num_params() < cfg.model.num_params()):
    logging.warning("the critic is built from config.critic_model's shape (%s) beside an actor "
                    "of %.3gM parameters from its checkpoint: set config.init.critic_checkpoint "
                    "(the actor's directory gives a critic of its shape) or size "
                    "config.critic_model", _shape(cfg.critic_model),
                    cfg.model.num_params() / 1e6)


def reward_model_config(cfg: TrainConfig, weights: bool = True) -> Optional[ModelConfig]:
  """The reward model's shape (reward.kind='model'), from its checkpoint's config.json, with
  the run's numerics and attention (config.model's, as the actor's). Its max_seq_len is the
  smaller of its own positions and the run's, so that a checkpoint advertising more positions
  than it attends over (Mistral v0.1's sliding window) loads for a run that fits the window,
  and one with fewer is still refused by validate for a longer run. weights=False (an export,
  which builds no reward model): its safetensors are not opened, nor its head checked."""
  if cfg.reward.kind != "model":
    return None
  path = cfg.reward.model_checkpoint
  check_foreign_tokenizer(path, cfg.init.tokenizer, "reward.model_checkpoint")
  positions = load_named("reward.model_checkpoint", path, hf_loader.max_positions)
  model = checkpoint_config(path, cfg.model, "reward.model_checkpoint", head="scalar",
                            remat="none", max_seq_len=min(positions, cfg.model.max_seq_len))
  if not weights:
    return model
  reward_normalization(cfg)  # "on" without statistics: refused before any weight is read
  # A reward model is its trained scalar head: without one (a *ForCausalLM, the policy's own
  # directory) the loader would draw a random head and PPO would optimise a random projection.
  names = load_named("reward.model_checkpoint", path, hf_loader.tensor_names)
  own = load_named("reward.model_checkpoint", path, hf_loader.own_head_prefix)
  prefix = hf_loader.scalar_head_prefix(names, own)
  if prefix is None:
    raise ValueError(
        f"config.reward.model_checkpoint={path!r} has no trained scalar head (a tensor "
        f"{' / '.join(p + '.weight' for p in hf_loader.head_prefixes(own))}): a reward model "
        "needs one (a *ForSequenceClassification checkpoint with num_labels=1, or TRL's or "
        "OpenRLHF's value head), not a language model's")
  if prefix == "score" and "score.bias" in names:
    # transformers' *ForSequenceClassification has no score bias and drops this tensor; the
    # run adds it (as our own exports write a trained critic's), a shift of every reward.
    logging.warning("config.reward.model_checkpoint=%r has a score.bias, which transformers' "
                    "*ForSequenceClassification ignores (its score layer has no bias): this run "
                    "adds it to every reward, so its rewards differ from transformers' by that "
                    "constant", path)
  return model


def reward_normalization(cfg: TrainConfig) -> Optional[tuple[float, float]]:
  """(mean, std) that the reward model's scores are normalised by, (score - mean) / std, or
  None (raw scores, or no reward model): reward.model_normalize against the statistics that
  OpenRLHF's reward-model trainer writes into config.json (hf_loader.reward_stats). "on" with a
  config.json that holds none is refused naming both."""
  r = cfg.reward
  if r.kind != "model" or r.model_normalize == "off":
    return None
  stats = load_named("reward.model_checkpoint", r.model_checkpoint, hf_loader.reward_stats)
  if stats is None and r.model_normalize == "on":
    raise ValueError(
        f"config.reward.model_normalize='on': config.reward.model_checkpoint="
        f"{r.model_checkpoint!r} has no reward statistics (`mean` and `std` in its config.json, "
        "as OpenRLHF's reward-model trainer writes them); expected a checkpoint that holds "
        "them, or reward.model_normalize='auto' or 'off' for its raw scores")
  return stats


def log_reward_normalization(cfg: TrainConfig, norm: Optional[tuple[float, float]]) -> None:
  """Says whether the reward model's scores are normalised, and how to change it."""
  r = cfg.reward
  if norm is not None:
    logging.info("reward model %s: rewards are (score - %g) / %g, the mean and std in its "
                 "config.json (OpenRLHF's normalize_reward); reward.model_normalize='off' for "
                 "its raw scores", r.model_checkpoint, *norm)
  elif r.kind == "model" and r.model_normalize == "off":
    stats = load_named("reward.model_checkpoint", r.model_checkpoint, hf_loader.reward_stats)
    if stats is not None:
      logging.info("reward model %s: rewards are its raw scores (reward.model_normalize='off'), "
                   "not normalised by the mean %g and std %g in its config.json",
                   r.model_checkpoint, *stats)


@dataclasses.dataclass
class Models:
  """The run's models, whole and placed on the mesh (the trainer's update may restack them)."""
  actor: Any
  critic: Optional[Any]  # None: the estimator trains no critic
  # The frozen initial actor (a copy: the actor's buffers are donated); None when nothing reads
  # its log-probs (algo.kl_coef=0: AlgoConfig.uses_reference).
  reference: Optional[Any]
  reward_cfg: Optional[ModelConfig]
  reward_params: Optional[Any]

  def frozen_to_host(self) -> None:
    """Moves the frozen models (reference, reward model) to host memory, dropping these device
    copies: a fused rollout stage keeps them on the host (docs/architecture.md §2). A copy
    split over devices of several processes is gathered first (mesh_lib.to_host): jax refuses
    to read such an array, and a multi-host run of the 13B-65B presets (one model copy over
    fsdp x tensor devices of several hosts) stopped here at set-up."""
    self.reference = mesh_lib.to_host(self.reference)
    if self.reward_params is not None:
      self.reward_params = mesh_lib.to_host(self.reward_params)

  def frozen_to_mesh(self, cfg: TrainConfig, mesh: jax.sharding.Mesh) -> None:
    """Moves the frozen models onto `mesh` (the generation group of async_ppo.generation_devices,
    where the serial stage scores), by their logical axes."""
    if self.reference is not None:
      self.reference = mesh_lib.shard_params(self.reference, llama.logical_specs(cfg.model),
                                             mesh)
    if self.reward_params is not None:
      self.reward_params = mesh_lib.shard_params(self.reward_params,
                                                 llama.logical_specs(self.reward_cfg), mesh)


def _shardings(model_cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Any:
  return mesh_lib.param_shardings(llama.param_shapes(model_cfg), llama.logical_specs(model_cfg),
                                  mesh)


def critic_normalization(cfg: TrainConfig) -> Optional[tuple[float, float]]:
  """(mean, std) of the reward statistics in init.critic_checkpoint's config.json when the run
  normalises its reward model's scores (reward_normalization), else None. OpenRLHF's critic,
  by default its reward model, normalises its values with its own statistics under the same
  --normalize_reward: a critic read raw beside normalised rewards would start its values on
  another scale than the returns it learns."""
  if not cfg.init.critic_checkpoint or reward_normalization(cfg) is None:
    return None
  return load_named("init.critic_checkpoint", cfg.init.critic_checkpoint,
                    hf_loader.reward_stats)


def _normalized_head(params: Any, mean: float, std: float) -> Any:
  """Host params of a scalar-head model whose value head computes (value - mean) / std: its
  weight / std and its bias (bias - mean) / std, in float64, cast back to their dtypes."""
  head = dict(params["head"])
  w, b = head["value_head"], head["value_bias"]
  head["value_head"] = (np.asarray(w, np.float64) / std).astype(w.dtype)
  head["value_bias"] = ((np.asarray(b, np.float64) - mean) / std).astype(b.dtype)
  return {**params, "head": head}


def build_critic(cfg: TrainConfig, mesh: jax.sharding.Mesh, weights: bool = True) -> Any:
  """The initial critic of the resolved config `cfg` (one that trains a critic), sharded over
  `mesh`: init.critic_checkpoint's weights (a value head drawn from cfg.seed where it has
  none), or without one (or weights=False: a checkpoint is about to overwrite it) initialised
  from cfg.seed."""
  key = jax.random.key(cfg.seed)
  if cfg.init.critic_checkpoint and weights:
    params = load_named("init.critic_checkpoint", cfg.init.critic_checkpoint,
                        hf_loader.load_hf_params, cfg.critic_model, head="scalar",
                        rng=jax.random.fold_in(key, 2))
    norm = critic_normalization(cfg)
    if norm is not None:
      params = _normalized_head(params, *norm)
      logging.info("critic %s: its value head starts as (value - %g) / %g, the mean and std in "
                   "its config.json, on the scale of the normalised rewards (as OpenRLHF's "
                   "critic with --normalize_reward)", cfg.init.critic_checkpoint, *norm)
    return mesh_lib.put(params, _shardings(cfg.critic_model, mesh))
  # Initialised in place: each device computes only its own shards.
  return llama.init_params(cfg.critic_model, jax.random.fold_in(key, 2),
                           _shardings(cfg.critic_model, mesh))[0]


def build_models(cfg: TrainConfig, mesh: jax.sharding.Mesh, restored: bool = False,
                 critic_restored: bool = False) -> Models:
  """Loads (init.*_checkpoint, reward.model_checkpoint) or initialises (from cfg.seed) the
  models of the resolved config `cfg`, each sharded over `mesh` by its logical axes.

  restored: the trainable models are about to be overwritten by a checkpoint (an export):
  actor and critic are initialised from the seed, not read from their HF checkpoints, and
  there is no reference or reward model. An export read all three HF checkpoints for weights
  it then discarded (three models' reads and memory at 65B), and failed once their weights
  had been moved away after training. critic_restored: the critic alone is (a resume: the
  actor's weights are the reference's, read at every start), initialised from the seed; a
  resume that restores no checkpoint after all loads it then (build_critic)."""
  if restored:
    cfg = dataclasses.replace(cfg, init=dataclasses.replace(
        cfg.init, actor_checkpoint="", critic_checkpoint=""))
  key = jax.random.key(cfg.seed)
  if cfg.init.actor_checkpoint:
    actor = mesh_lib.put(load_named("init.actor_checkpoint", cfg.init.actor_checkpoint,
                                    hf_loader.load_hf_params, cfg.model),
                         _shardings(cfg.model, mesh))
  else:  # initialised in place
    actor = llama.init_params(cfg.model, jax.random.fold_in(key, 1),
                              _shardings(cfg.model, mesh))[0]
  critic = (build_critic(cfg, mesh, weights=not critic_restored)
            if adv_lib.needs_critic(cfg.algo.estimator) else None)
  reward_cfg, reward_params = (None, None) if restored else (reward_model_config(cfg), None)
  if reward_cfg is not None:
    # No rng: a checkpoint without its score head is an error (reward_model_config), never a
    # random one.
    reward_params = mesh_lib.put(load_named("reward.model_checkpoint",
                                            cfg.reward.model_checkpoint,
                                            hf_loader.load_hf_params, reward_cfg, head="scalar"),
                                 _shardings(reward_cfg, mesh))
    where = (f"at the last token that is not its pad_token_id {reward_cfg.score_pad_id}, as "
             "transformers' *ForSequenceClassification pools" if reward_cfg.score_pad_id >= 0
             else "at the last response token, EOS included (its config.json names no "
             "pad_token_id, or it is no *ForSequenceClassification: TRL's value head on a "
             "*ForCausalLM, OpenRLHF's RewardModel or CriticModel)")
    logging.info("reward model %s scores each sequence %s", cfg.reward.model_checkpoint, where)
  reference = (jax.tree.map(jnp.copy, actor) if cfg.algo.uses_reference and not restored
               else None)
  # Said once: the metrics it drops are otherwise missed silently.
  if reference is None and not restored:
    logging.info("algo.kl_coef=0: no reference model is kept or run (no KL term reads its "
                 "log-probs), so no kl/* metric is logged")
  return Models(actor=actor, critic=critic, reference=reference,
                reward_cfg=reward_cfg, reward_params=reward_params)


def build_rewards(cfg: TrainConfig, task, tokenizer: Tokenizer, models: Models,
                  mesh: jax.sharding.Mesh) -> scoring.Rewards:
  """config.reward resolved: the task's verifier, a registered function, a user's function by
  import path, or the reward model (scored on `mesh`, where build_models placed it), each plus
  an optional weighted second function (reward.format: a format reward, a length penalty).
  Functions read the ids with the run's tokenizer (init.tokenizer when set, not the task's
  own)."""
  r = cfg.reward

  def term(label: str, spec: str, weight: float = 1.0, stat: bool = False
           ) -> scoring.RewardTerm:
    return scoring.RewardTerm(label=label, name=spec, weight=weight, fn=functools.partial(
        _with_tokenizer, rewards_lib.get_reward_function(spec, stat), tokenizer))
  extra = [term("format", r.format, r.format_weight)] if r.format else []
  stats = [term(stat_label(spec), spec, stat=True) for spec in r.stat_specs]
  if r.kind == "model":
    norm = reward_normalization(cfg)
    log_reward_normalization(cfg, norm)
    if r.format:  # a preset's format term kept beside a reward model went unnoticed
      logging.info("reward: the reward model's score + %g x %r (config.reward.format; "
                   "--config.reward.format='' for the model's score alone)",
                   r.format_weight, r.format)
    return scoring.Rewards(model_cfg=models.reward_cfg, model_params=models.reward_params,
                           scorer=scoring.Scorer(mesh), extra=extra, stats=stats,
                           model_norm=norm)
  if r.function == "task":
    fn, name = (lambda records, ids, lens, tok: task.batch_rewards(records, ids, lens, tok),
                f"task:{cfg.data.task}")
  else:
    fn, name = rewards_lib.get_reward_function(r.function), r.function
  return scoring.Rewards(fn=functools.partial(_with_tokenizer, fn, tokenizer), name=name,
                         extra=extra, stats=stats)


def check_reward_functions(cfg: TrainConfig) -> None:
  """Resolves reward.function and reward.format now (an unknown name, a module that does not
  import), so that the error comes before any weight is read or program compiled."""
  fields = ("function", "format") if cfg.reward.kind == "function" else ("format",)
  specs = [(f, getattr(cfg.reward, f)) for f in fields] + [
      ("stats", s) for s in cfg.reward.stat_specs]
  for field, spec in specs:
    if spec and spec != "task":
      try:
        rewards_lib.get_reward_function(spec)
      except ValueError as e:
        raise ValueError(f"config.reward.{field}={spec!r}: {e}") from None


def _with_tokenizer(fn, tokenizer, records, response_tokens, response_lens):
  return fn(records, response_tokens, response_lens, tokenizer)
