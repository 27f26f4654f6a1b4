"""What the files a run reads by path held, for the resume check (docs/usage.md, faults).

The checkpoints' config fingerprint holds the paths of the files a run reads (the actor's HF
checkpoint, the tokenizer, a reward model, the prompts): a path alone let a resume read other
weights at the same path, silently (the KL reference is re-read from init.actor_checkpoint at
every start: a run whose source directory was re-exported went on against another reference,
its KL jumping from 3e-6 to 0.9), and refused the same weights at another path (a trailing
slash; a job that copies the model to node-local scratch gets a new path every time). Each
checkpoint now also stores a content fingerprint of each such input, taken as the run starts,
and a resume compares contents: another path to the same content is accepted, other content
at any path refused.

A fingerprint is {file name: digest} over the files the loaders read: of a checkpoint
directory its config.json, generation_config.json, safetensors shards and their index; of a
tokenizer its tokenizer.json (a directory names its own) and the files read beside it
(tokenizer_config.json, special_tokens_map.json, generation_config.json, chat_template.jinja);
a prompts file and a pipeline.schedule_file whole; a data.chat_template path's template and the
special tokens' files beside it (its content decides every prompt's text, as the tokenizer's
does). Weight shards are hashed
by size and three 1 MiB samples (start, middle, end: a 130 GB checkpoint costs ~100 MB of reads,
and any re-export or other revision changes them); every other file in full. Other files (a
README, a model card) are not read, so adding one changes nothing, and a refusal names the
files that changed.
"""
from __future__ import annotations

import ast
import hashlib
import os
from typing import Any, Mapping, Optional

from absl import logging

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.data import tokenizer as tokenizer_lib

# The config fields that name files the run reads, and what each one's content decides.
PATH_FIELDS = {
    "init.actor_checkpoint": "the KL reference is read from it at every start",
    "init.tokenizer": "every prompt and response is tokenised with it",
    "reward.model_checkpoint": "it scores every response",
    "data.prompts_file": "the prompts are drawn from it",
    # A path only ('none' and 'auto' are no file: 'auto' reads the tokenizer's files, above).
    "data.chat_template": "every prompt is rendered with it",
    # Its weights are read once, by the first start: they are in the checkpoints since (a
    # resume reads its config.json alone, for the critic's architecture: trainer/loop.py).
    "init.critic_checkpoint": "",
    # The schedule a pipelined update executes (its path alone refused a copy elsewhere and
    # took another schedule at the same path).
    "pipeline.schedule_file": "the pipelined update executes its fused schedule",
}
SAMPLE_BYTES = 1 << 20
SAMPLED = (".safetensors",)  # weight shards (the only ones the loaders read): sampled; the rest
# is hashed whole
# What the loaders read of a checkpoint directory (models/hf_loader.py, the stop ids and the
# export's copy of generation_config.json), and beside a tokenizer.json (data/tokenizer.py,
# data/chat.py).
CHECKPOINT_FILES = ("config.json", "generation_config.json")
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json",
                        "generation_config.json", "chat_template.jinja")
# What a data.chat_template path makes the run read (data/chat.py): a directory's template (its
# chat_template.jinja, else its tokenizer_config.json's entry), and beside a template file the
# special tokens' files, read when the tokenizer names none.
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json")


def _file_digest(path: str) -> str:
  h = hashlib.sha256()
  size = os.path.getsize(path)
  h.update(f"{size}\0".encode())
  with open(path, "rb") as f:
    if not path.endswith(SAMPLED) or size <= 3 * SAMPLE_BYTES:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    else:
      for start in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
        f.seek(start)
        h.update(f.read(SAMPLE_BYTES))
  return h.hexdigest()


def _read_files(field: str, path: str) -> list[str]:
  """The files of `path` (config.`field`) that the run reads; [] when there are none."""
  if field == "init.tokenizer":
    main = tokenizer_lib.tokenizer_file(path)
    if not os.path.isfile(main):
      return []
    beside = os.path.dirname(main)
    return [main] + [os.path.join(beside, n) for n in TOKENIZER_SIDE_FILES
                     if os.path.isfile(os.path.join(beside, n))]
  if field == "data.chat_template":
    if path in ("none", "auto"):
      return []
    beside = path if os.path.isdir(path) else os.path.dirname(path)
    return ([path] if os.path.isfile(path) else []) + [
        os.path.join(beside, n) for n in TEMPLATE_FILES
        if os.path.isfile(os.path.join(beside, n)) and n != os.path.basename(path)]
  if os.path.isfile(path):
    return [path]
  if not os.path.isdir(path):
    return []
  return [os.path.join(path, n) for n in sorted(os.listdir(path))
          if os.path.isfile(os.path.join(path, n)) and (
              n in CHECKPOINT_FILES or n.endswith((".safetensors", ".safetensors.index.json")))]


def content_fingerprint(field: str, path: str) -> Optional[dict[str, str]]:
  """{file name: digest} of what config.`field`=`path` makes the run read (see the module
  docstring); None when there is nothing there (the run's own checks name a missing input).
  A file there that does not read (no permission, an I/O error) is workdir.ReadError naming it
  and the field: every start hashes its inputs first, and a finished run's re-run stopped on
  the bare PermissionError, naming no field (2026-12-07)."""
  out = {}
  try:  # (listing a checkpoint directory too: one without read permission was the bare error)
    for f in _read_files(field, path):
      out[os.path.basename(f)] = _file_digest(f)
  except OSError as e:
    raise wd.ReadError(
        f"{wd.read_failed(e, path)}; config.{field}={path!r} names it, and its content is "
        "fingerprinted (a run's starts check it against their checkpoints'; plan files, "
        "against the run they plan): make it readable") from e
  return out or None


def fingerprints(cfg: Any) -> dict[str, dict[str, str]]:
  """{field: content fingerprint} of the PATH_FIELDS that the config `cfg` (a TrainConfig)
  sets to an existing path and reads (a reward model's only with reward.kind='model')."""
  out = {}
  for field in PATH_FIELDS:
    section, name = field.split(".")
    path = getattr(getattr(cfg, section, None), name, "")
    if field == "reward.model_checkpoint" and getattr(
        getattr(cfg, "reward", None), "kind", "model") != "model":
      continue
    if isinstance(path, str) and path:
      digest = content_fingerprint(field, path)
      if digest is not None:
        out[field] = digest
  return out


def same_files(was: Any, is_: Any) -> bool:
  """Whether two fingerprints of an input ({file: digest}) are of the same files: equal, or
  the file the path names renamed (its name is its key) with every other file the same. A
  copy of a prompts file or tokenizer under another name was refused as "own.jsonl, own2.jsonl
  changed", where the same files at another path are accepted."""
  if was == is_:
    return True
  if not (isinstance(was, Mapping) and isinstance(is_, Mapping)) or len(was) != len(is_):
    return False
  gone, new = set(was) - set(is_), set(is_) - set(was)
  return (len(gone) == len(new) == 1 and was[gone.pop()] == is_[new.pop()] and
          all(was[n] == is_[n] for n in set(was) & set(is_)))


def resume_changes(changes: list[str], saved: Optional[Mapping[str, str]],
                   now: Mapping[str, str], iteration: Any) -> tuple[list[str], list[str]]:
  """(the config changes left to judge, the inputs whose content changed) on resuming
  checkpoints whose inputs' fingerprints are `saved` (None: written before they existed, when
  paths alone are compared) with this start's `now`. A path change to the same content is
  taken off `changes` (logged); other content at an input read on every start is returned as a
  line naming the field and why it matters (the critic's checkpoint, whose weights only the
  first start reads, is logged, unless its config.json changed); so is a new path to other
  content at such an input, or to nothing the run reads (each was left a config change,
  refused as a field no resume may change, where another path to the same files is
  accepted)."""
  if not saved:
    return changes, []
  left, changed = [], []
  moved = {c.split(":")[0]: c for c in changes}
  for c in changes:
    field = c.split(":")[0]
    if field in PATH_FIELDS and saved.get(field) and same_files(saved.get(field), now.get(field)):
      logging.info("resuming iteration %s with %s: the same content at the new path", iteration,
                   c)
      continue
    if PATH_FIELDS.get(field) and saved.get(field) and now.get(field):
      changed.append(f"{c} holds other files than the run started with ("
                     f"{_changed_files(saved[field], now[field])}; {PATH_FIELDS[field]})")
      continue
    if (field in PATH_FIELDS and saved.get(field) and not now.get(field) and
        _to_an_empty_path(field, c)):
      # A new path with nothing the run reads (a copy to scratch that failed, a typo) was left
      # a config change, refused as a field no resume may change: the same files at another
      # path are accepted, so the files are what is missing. (No path at all, or a chat
      # template's 'none' or 'auto', is the config change it reads as; so is a path with the
      # files where the run no longer reads the input: a reward model beside reward.kind
      # 'function', which has no fingerprint now.)
      changed.append(f"{c}: nothing there that the run reads ("
                     f"{PATH_FIELDS[field] or 'the run reads it as it starts'})")
      continue
    left.append(c)
  for field, why in PATH_FIELDS.items():
    if field in moved or not saved.get(field) or same_files(saved.get(field), now.get(field)):
      continue
    if not why:
      if config_changed(saved[field], now.get(field)):
        # Its config.json still gives the critic's architecture (rope_theta, rms_norm_eps,
        # shapes): another one ran the checkpoints' weights as another function, silently.
        changed.append(f"{field}: config.json changed since the checkpoints were written (it "
                       "gives the critic's architecture; its weights are the checkpoints')")
        continue
      logging.info("config.%s holds other files than when the run started: its weights are "
                   "unused on resume (the critic's are in the checkpoints; its config.json, "
                   "unchanged, still gives the critic's architecture)", field)
      continue
    if field not in now:
      changed.append(f"{field}: no longer there ({why})")
      continue
    changed.append(f"{field}: {_changed_files(saved[field], now[field])} since the checkpoints "
                   f"were written ({why})")
  return left, changed


def config_changed(was: Any, is_: Any) -> bool:
  """Whether a checkpoint directory's config.json differs between two fingerprints ({file:
  digest}); one missing from either side is for the loaders to name."""
  if not (isinstance(was, Mapping) and isinstance(is_, Mapping)):
    return False
  return ("config.json" in was and "config.json" in is_ and
          was["config.json"] != is_["config.json"])


def _to_an_empty_path(field: str, change: str) -> bool:
  """Whether fingerprint_changes' 'field: old -> new' sets config.`field` to a path (a
  non-empty string other than a chat template's 'none' and 'auto') that holds nothing the run
  would read there."""
  try:
    new = ast.literal_eval(change.rsplit(" -> ", 1)[1])
  except (IndexError, ValueError, SyntaxError):
    return False
  return (isinstance(new, str) and new not in ("", "none", "auto") and
          content_fingerprint(field, new) is None)


# The inputs an HF export copies files from (trainer/hf_export.py: the tokenizer's files, the
# chat template, the actor checkpoint's generation config and special ids).
EXPORT_FIELDS = ("init.actor_checkpoint", "init.tokenizer", "data.chat_template")


def export_changes(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any]) -> list[str]:
  """'config.init.tokenizer=...: tok.json changed' for each EXPORT_FIELDS input whose files
  differ from the checkpoint's fingerprints `saved` (None: written before they were kept:
  nothing to compare; an input no longer there is left to the loaders, whose error says where
  relative paths are read from). An export after those files changed shipped the new template
  and EOS ids with weights trained under the old ones, where a resume refuses the change."""
  out = []
  for field in EXPORT_FIELDS:
    was, is_ = (saved or {}).get(field), now.get(field)
    if field == "init.actor_checkpoint" and was and is_:  # only its config files are copied
      # (the weights exported are the run's: a re-downloaded base model blocked every export)
      was, is_ = ({k: v for k, v in fp.items() if k in CHECKPOINT_FILES} for fp in (was, is_))
    if was and is_ and not same_files(was, is_):
      out.append(f"config.{field}: {_changed_files(was, is_)}")
  return out


def _changed_files(was: Any, is_: Any) -> str:
  """'a.json, b.safetensors changed' between two fingerprints of an input ({file: digest}), or
  'its files changed' when they do not say which."""
  files = sorted(n for n in set(was) | set(is_) if was.get(n) != is_.get(n)) if (
      isinstance(was, dict) and isinstance(is_, dict)) else []
  return f"{', '.join(files)} changed" if files else "its files changed"


# The validation pass's settings: a resume may change them (config.RESUMABLE_FIELDS), so they
# are left out of the config fingerprint; each checkpoint keeps them apart, with the held-out
# file's content, so that a resume says what changed (val/* before and after it then average
# other prompts). eval_every only moves the iterations validated: the pass after an iteration
# is the same whatever it is (its keys are the iteration's, evaluation.validation_key), so its
# change is an info line, not the warning that val/* are no longer comparable.
EVAL_FIELDS = ("eval_every", "data.val_file", "data.val_max_prompts")
# Beside them, the held-out pool's size before data.val_max_prompts caps it (set once the
# prompts are loaded: hooks.Checkpoints.set_val_pool): a changed val_max_prompts selects the
# same prompts when min(pool, val_max_prompts) is the same (e.g. raised past the pool's size).
VAL_POOL = "data.val_pool"


def eval_settings(cfg: Any) -> dict[str, Any]:
  """{field: value} of EVAL_FIELDS of the TrainConfig `cfg`, and under "data.val_file content"
  the file's fingerprint (None: no file there, or a directory)."""
  data = getattr(cfg, "data", None)  # (as `fingerprints`: a partial config reads as unset)
  path = getattr(data, "val_file", "")
  out = {"eval_every": getattr(cfg, "eval_every", 0), "data.val_file": path,
         "data.val_max_prompts": getattr(data, "val_max_prompts", 0)}
  out["data.val_file content"] = (content_fingerprint("data.val_file", path)
                                  if path and os.path.isfile(path) else None)
  return out


def _same_val_prompts(saved: Mapping[str, Any], now: Mapping[str, Any]) -> Optional[int]:
  """How many held-out prompts both data.val_max_prompts values select, min(pool, k) with k = 0
  the whole pool, when they select the same ones from a pool that did not change (the same
  data.val_file, or the same content at another path; a val_fraction split is fixed by fields
  no resume changes); None when they differ or the checkpoints do not say the pool's size."""
  pool = saved.get(VAL_POOL)
  if not isinstance(pool, int):
    return None
  was, is_ = saved.get("data.val_file content"), now.get("data.val_file content")
  same_pool = (was == is_ if saved.get("data.val_file") == now.get("data.val_file") else
               bool(was and is_ and sorted(was.values()) == sorted(is_.values())))
  used = [min(pool, k) if k else pool for k in (saved.get("data.val_max_prompts", 0),
                                                 now.get("data.val_max_prompts", 0))]
  return used[0] if same_pool and used[0] == used[1] else None


def warn_eval_changes(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any],
                      iteration: Any) -> list[str]:
  """Logs a warning naming each validation setting that differs from the checkpoint's `saved`
  ones (None: written before they were kept; nothing to compare), and another content in
  data.val_file (at the same path or a new one); returns the warnings' texts. A changed
  eval_every is an info line: val/* stay comparable, logged at other iterations; so is a
  data.val_max_prompts that selects the same prompts of the same pool (_same_val_prompts)."""
  if not saved:
    return []
  said = []
  was, is_ = saved.get("data.val_file content"), now.get("data.val_file content")
  for field in EVAL_FIELDS:
    if field not in saved or saved[field] == now[field]:
      continue
    if field == "eval_every":
      logging.info("resuming iteration %s with config.eval_every: %r -> %r: the validation pass "
                   "runs at other iterations (the same prompts and keys: val/* stay comparable)",
                   iteration, saved[field], now[field])
      continue
    if field == "data.val_file" and was and is_ and sorted(was.values()) == sorted(is_.values()):
      logging.info("resuming iteration %s with config.data.val_file: %r -> %r: the same content "
                   "at the new path", iteration, saved[field], now[field])
      continue
    used = _same_val_prompts(saved, now)
    if field == "data.val_max_prompts" and used is not None:
      logging.info("resuming iteration %s with config.data.val_max_prompts: %r -> %r: the same "
                   "%d held-out prompts (the pool holds %d; val/* stay comparable)", iteration,
                   saved[field], now[field], used, saved[VAL_POOL])
      continue
    said.append(f"config.{field}: {saved[field]!r} -> {now[field]!r}")
  if saved.get("data.val_file") == now["data.val_file"] and was and is_ and was != is_:
    said.append(f"config.data.val_file={now['data.val_file']!r}: other content than when the "
                "checkpoints were written")
  for what in said:
    logging.warning("resuming iteration %s with a changed %s (a resume may change the validation "
                    "pass's settings: the val/* metrics from here on are not comparable with "
                    "those before)", iteration, what)
  return said
