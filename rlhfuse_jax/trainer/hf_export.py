"""The Hugging Face export of a run's actor (checkpoint.export_hf, and experiments/export_hf.py
through trainer/export.py), or of its critic (export_hf --model=critic): the weights written as
a HF checkpoint with the run's tokenizer files, chat template and special ids, marked with the
iteration, run and model it holds, and renamed into place whole (docs/own_model.md), each of
its files fsynced before the rename and the rename after it: a power loss right after leaves
the old export or the whole new one, not one of empty files. A critic is written as a
*ForSequenceClassification (hf_loader.save_hf_checkpoint: `score.weight`, and `score.bias`
when its value bias is not zero, which transformers ignores).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Collection, Mapping, Optional

import jax
import numpy as np
import tokenizers
from absl import logging

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.data import chat as chat_lib
from rlhfuse_jax.data import tokenizer as tokenizer_lib
from rlhfuse_jax.data.tokenizer import HFTokenizer, Tokenizer
from rlhfuse_jax.models import hf_loader
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer.config import TrainConfig
from rlhfuse_jax.trainer.hooks import Hook, writing

HF_EXPORT_DIR = "hf_export"
# The models an export can hold: the actor, or the critic of a run that trains one.
MODELS = ("actor", "critic")


def check_model_name(model: str, field: str = "model") -> None:
  """A ValueError naming `field` (export_hf's --model) unless `model` is one of MODELS."""
  if model not in MODELS:
    raise ValueError(f"{field}={model!r}: expected one of {list(MODELS)}")


# What a model directory holds besides the weights, copied into the export where the run's
# tokenizer (init.tokenizer's directory) or the model's source checkpoint has them, so that the
# export loads as a whole model (AutoTokenizer, chat template, generation's EOS ids) and not
# weights alone. The checkpoint's generation config, copied after, wins over the tokenizer
# directory's.
TOKENIZER_FILES = ("tokenizer.json", chat_lib.CONFIG_FILE, chat_lib.TEMPLATE_FILE,
                   tokenizer_lib.SPECIAL_TOKENS_MAP, tokenizer_lib.GENERATION_CONFIG)
CHECKPOINT_FILES = (tokenizer_lib.GENERATION_CONFIG,)


def model_config(cfg: TrainConfig, model: str = "actor") -> ModelConfig:
  """The architecture of `model` ("actor" or "critic") in the resolved config `cfg`."""
  return cfg.model if model == "actor" else cfg.critic_model


def source_checkpoint(cfg: TrainConfig, model: str = "actor") -> str:
  """The HF checkpoint `model` started from ('': none, built from the seed)."""
  return cfg.init.actor_checkpoint if model == "actor" else cfg.init.critic_checkpoint


def export_family(cfg: TrainConfig, model: str = "actor") -> Optional[str]:
  """The HF family checkpoint.export_hf asks for; None: the one the model's shape implies.
  'auto' is the family of the checkpoint `model` started from."""
  family = cfg.checkpoint.export_hf
  if family != "auto":
    return family
  if source_checkpoint(cfg, model):
    return hf_loader.checkpoint_family(source_checkpoint(cfg, model))
  return None


# config.json fields that describe the model, not the run: the run may set its own context (a
# shorter model.max_seq_len for training) and never writes the special ids, so an export keeps
# the source checkpoint's values and loads as the same model (a 1B Llama 3.2 still advertises
# its 131072 positions, a Mistral its window; without them transformers reads bos 1 / eos 2,
# which are other tokens in Llama 3's vocabulary).
SOURCE_CONTEXT_FIELDS = ("max_position_embeddings", "sliding_window", "bos_token_id",
                         "eos_token_id", "pad_token_id")


def check_family(cfg: TrainConfig, model: str = "actor") -> None:
  """A ValueError when the family checkpoint.export_hf asks for cannot express `model`."""
  hf_loader.hf_config_dict(model_config(cfg, model), family=export_family(cfg, model))


class ExportInputError(ValueError):
  """A file of the run's inputs that the HF export copies or reads (init.tokenizer's
  tokenizer.json and the files beside it, the chat template data.chat_template names, the
  source checkpoint's generation_config.json and config.json) could not be read: moved or
  deleted since the run read it, no longer readable, a directory in its place. Not a failed
  write of the export (hooks.writing: LogWriteError, exit 3, "writing ... failed", which named
  the missing tokenizer as if the export wrote it): a file to put back (exit 1, one line)."""


def _read_input(path: str, what: str) -> bytes:
  """The bytes of `path`, the run's input `what` (which config field names it); an OSError
  reading it as ExportInputError naming both, and what to do: make a file its permissions
  refuse readable, else put it back (gone, a directory in its place, an I/O error)."""
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    fix = "make it readable" if isinstance(e, PermissionError) else "put it back"
    raise ExportInputError(
        f"{wd.read_failed(e, path)}; it is {what}, which the run read and its HF export "
        f"copies: {fix} (nothing of the export is left)") from e


# What data.chat_template names, in an ExportInputError (_read_input): a template file, or a
# directory's file that holds it.
TEMPLATE_INPUT = "the chat template config.data.chat_template names"
TEMPLATE_DIR_INPUT = "a file of the chat template directory config.data.chat_template names"


def _check_template_file(cfg: TrainConfig, inputs: Optional[Mapping[str, Any]]) -> None:
  """ExportInputError when data.chat_template names a template file that the run read (its
  fingerprints name it; without them: one there now) and that does not read now: no permission,
  an I/O error, a directory in its place, gone. ChatTemplate.load said "cannot read the chat
  template" naming no field (a directory: "holds no chat_template.jinja"), and the run's end
  left out that nothing of it was lost (trainer/loop.py adds that to an ExportInputError).
  A directory's template likewise: its chat_template.jinja, else its tokenizer_config.json (the
  first of them read, as chat.py's _find_template picks); its chat_template.jinja gone was
  passed over and the export shipped the tokenizer_config.json's template, silently: one the
  run never rendered a prompt with (2026-12-08)."""
  spec = cfg.data.chat_template
  if spec in ("none", "auto"):
    return
  read = _names_read(inputs, "data.chat_template")
  if os.path.isfile(spec) or os.path.basename(os.path.normpath(spec)) in read:
    _read_input(spec, TEMPLATE_INPUT)
  elif os.path.isdir(spec):
    for name in (chat_lib.TEMPLATE_FILE, chat_lib.CONFIG_FILE):
      path = os.path.join(spec, name)
      if name in read or os.path.isfile(path):
        _read_input(path, TEMPLATE_DIR_INPUT)
        return


def _write_json(path: str, obj: Any, **kwargs) -> None:
  """`obj` as json.dump writes it (indent=2, `kwargs`), whole and fsynced (before the export's
  rename: a power loss after it left no empty file in a renamed export)."""
  wd.atomic_write_text(path, json.dumps(obj, indent=2, **kwargs))


def _names_read(inputs: Optional[Mapping[str, Any]], field: str) -> Collection[str]:
  """The names of the files under config `field` that the run read as it started, from its
  fingerprints ({field: {file name: digest}}, trainer/inputs.py); none where not known."""
  return ((inputs or {}).get(field) or {}).keys()


def _copy_tokenizer(cfg: TrainConfig, tokenizer: Optional[Tokenizer], out: str,
                    read: Collection[str] = ()) -> None:
  """The tokenizer the run read, as tokenizer.json, with the files beside it that it read too
  (tokenizer_config.json, special_tokens_map.json, chat_template.jinja); then a chat template
  given by path (data.chat_template), which is what the prompts were rendered with. A run on
  the synthetic task's tokenizer (no init.tokenizer) writes that one. `read`: the names of the
  files beside it that the run read (_names_read): one of them gone since is
  ExportInputError naming it, as tokenizer.json is (it was left out of the export, silently:
  another special token or template than the run's); the others are copied if there."""
  tok = cfg.init.tokenizer
  if tok:
    path = tokenizer_lib.tokenizer_file(tok)
    wd.atomic_write_bytes(os.path.join(out, "tokenizer.json"), _read_input(
        path, "the tokenizer config.init.tokenizer names"))
    for name in TOKENIZER_FILES:
      src = os.path.join(os.path.dirname(path), name)
      if name != "tokenizer.json" and (os.path.isfile(src) or name in read):
        data = _read_input(src, "a file beside the tokenizer config.init.tokenizer names")
        # The template as the run read it: without the byte-order mark chat.py drops, which
        # transformers would render before every prompt of the export.
        bom = chat_lib.BOM.encode("utf-8")
        if name == chat_lib.TEMPLATE_FILE and data.startswith(bom):
          data = data[len(bom):]
        wd.atomic_write_bytes(os.path.join(out, name), data)
  elif isinstance(tokenizer, HFTokenizer):
    wd.atomic_write_text(os.path.join(out, "tokenizer.json"),
                         tokenizer.backend.to_str(pretty=True))  # (what its save() writes)
  if isinstance(tokenizer, HFTokenizer) and not os.path.isfile(
      os.path.join(out, chat_lib.CONFIG_FILE)):
    _write_tokenizer_config(tokenizer, out)
  if cfg.data.chat_template not in ("none", "auto"):
    template = chat_lib.ChatTemplate.load(cfg.data.chat_template, tok)
    wd.atomic_write_text(os.path.join(out, chat_lib.TEMPLATE_FILE), template.source)
    # The copied tokenizer_config.json's own template (the source model's) would disagree with
    # it for readers of that file alone (transformers before chat_template.jinja, other tools).
    config_path = os.path.join(out, "tokenizer_config.json")
    if os.path.isfile(config_path):
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
      if "chat_template" in config:
        config["chat_template"] = template.source
        _write_json(config_path, config, ensure_ascii=False)


def _write_tokenizer_config(tokenizer: HFTokenizer, out: str) -> None:
  """A tokenizer_config.json naming the special tokens the run resolved, for a tokenizer.json
  that came without one (or the synthetic task's): transformers read such a file with no BOS or
  EOS token and no BOS prepended, where the run put BOS first in every prompt. transformers
  (5.x) prepends BOS only through tokenizer.json's post-processor, not add_bos_token, so a
  tokenizer.json without one gets one that puts BOS first, as the run did; our loader reads it
  back the same way (tokenizer.post_processor_adds)."""
  name = lambda i: None if i is None else tokenizer.id_to_token(int(i))
  config = {"bos_token": name(tokenizer.bos_id), "eos_token": name(tokenizer.eos_id),
            "pad_token": name(tokenizer.pad_id), "add_bos_token": tokenizer.add_bos}
  _write_json(os.path.join(out, chat_lib.CONFIG_FILE), config, ensure_ascii=False)
  path = os.path.join(out, "tokenizer.json")
  if tokenizer.add_bos and tokenizer_lib.post_processor_adds(path, config["bos_token"]) is None:
    backend = tokenizers.Tokenizer.from_file(path)
    bos = config["bos_token"]
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)])
    wd.atomic_write_text(path, backend.to_str(pretty=True))


def _names_ids(eos: Any, stops: list) -> bool:
  """Whether an `eos_token_id` entry (an id or a list of them) names exactly the ids `stops`.
  A value that is not token ids (a null in the list, a token's text) names none: sorted with
  the ids it failed the export with a TypeError."""
  ids = eos if isinstance(eos, list) else [eos]
  return (all(isinstance(i, int) and not isinstance(i, bool) for i in ids) and
          sorted(ids) == sorted(stops))


def _write_generation_eos(tokenizer: Optional[Tokenizer], out: str) -> None:
  """A generation_config.json whose eos_token_id is every id the run's responses ended on:
  written where the export has none and its config.json names other ids (the source
  checkpoint's eos beside an EOS the run found in the vocabulary), and set in the one copied
  from the source checkpoint where that one names other ids (its other settings kept): the run
  stops on the init.tokenizer directory's generation_config.json ids too, which a checkpoint
  in another directory may lack (a Llama 3 Instruct tokenizer's <|eot_id|> beside a checkpoint
  that lists <|end_of_text|> alone). transformers' generate() stops on these, and a run that
  reads the export as its tokenizer stops on them (tokenizer.checkpoint_eos)."""
  path = os.path.join(out, tokenizer_lib.GENERATION_CONFIG)
  if tokenizer is None:
    return
  stops = list(tokenizer.stop_ids)
  if os.path.isfile(path):
    config = wd.read_json_object(path, ValueError,
                                 f"not a valid {tokenizer_lib.GENERATION_CONFIG}")
    eos = config.get("eos_token_id")
    # (init.critic_checkpoint's file, copied for the critic's export, is read nowhere before)
    if _names_ids(eos, stops):
      return
    logging.warning("the export's %s names eos_token_id=%s, where the run's responses ended on "
                    "%s: written as the run's (transformers' generate() stops on it)",
                    tokenizer_lib.GENERATION_CONFIG, eos, stops)
    config["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    _write_json(path, config)
    return
  with open(os.path.join(out, "config.json")) as f:
    eos = json.load(f).get("eos_token_id")
  if _names_ids(eos, stops):
    return
  _write_json(path, {"bos_token_id": tokenizer.bos_id, "eos_token_id": stops,
                     "pad_token_id": tokenizer.pad_id})


def _fill_special_ids(tokenizer: Optional[Tokenizer], config_path: str) -> None:
  """bos/eos/pad ids the export's config.json lacks (no source checkpoint gave them, or it gave
  null), from the run's tokenizer: without them transformers reads LlamaConfig's bos 1 / eos 2,
  other tokens in most vocabularies, and generation would not stop on the run's EOS."""
  if tokenizer is None:
    return
  with open(config_path) as f:
    out = json.load(f)
  # Every id a response ends on, as transformers writes several (a list) in config.json too.
  eos = list(tokenizer.stop_ids) if tokenizer.extra_eos_ids else tokenizer.eos_id
  for key, value in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", eos),
                     ("pad_token_id", tokenizer.pad_id)):
    if out.get(key) is None:  # null, not absent, for no BOS: absent reads as LlamaConfig's 1
      out[key] = None if value is None else value if isinstance(value, list) else int(value)
  _write_json(config_path, out)


def _source_file(model: str) -> str:
  """What a file of `model`'s source checkpoint is, in an ExportInputError (_read_input)."""
  return f"a file of the checkpoint config.init.{model}_checkpoint names"


def _keep_source_context(source_dir: str, config_path: str, what: str) -> None:
  """SOURCE_CONTEXT_FIELDS of the source checkpoint in `source_dir` (its config.json, the run's
  input `what`) written over those of the export's config.json at `config_path`."""
  source = json.loads(_read_input(os.path.join(source_dir, "config.json"), what))
  with open(config_path) as f:
    out = json.load(f)
  for k in SOURCE_CONTEXT_FIELDS:
    if k in source:
      out[k] = source[k]
  _write_json(config_path, out)


# Inside an export: the iteration, run and model ("actor", or "critic"; a marker without one is
# an actor's) it holds. Written with the export (renamed into place together), so a run whose
# export is missing or older than its last checkpoint (an export that failed or was killed, an
# extended run) knows to write it again.
EXPORT_MARKER = "rlhfuse_export.json"


def _export_marker(out_dir: str) -> Optional[dict]:
  try:
    with open(os.path.join(out_dir, EXPORT_MARKER)) as f:
      marker = json.load(f)
    return {"step": int(marker["step"]), "family": marker.get("family"),
            "run": marker.get("run"), "model": marker.get("model", "actor"),
            "value_bias": marker.get("value_bias")}
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None


def exported_step(out_dir: str) -> Optional[int]:
  """The iteration of the model exported in `out_dir`; None: no (complete) export there."""
  marker = _export_marker(out_dir)
  return None if marker is None else marker["step"]


def exported_run(out_dir: str) -> Optional[str]:
  """The workdir (real path) of the run whose model is exported in `out_dir`; None: no export
  there, or one written before markers named their run."""
  marker = _export_marker(out_dir)
  return None if marker is None or not isinstance(marker["run"], str) else marker["run"]


def exported_model(out_dir: str) -> Optional[str]:
  """Which model of its run `out_dir` holds ("actor", or "critic"; an export written before
  markers named it is an actor's); None: no export there."""
  marker = _export_marker(out_dir)
  return None if marker is None else marker["model"]


def exported_value_bias(out_dir: str) -> Optional[float]:
  """The value bias of the critic exported in `out_dir` (its `score.bias`, which transformers
  does not apply); None: no critic's export there."""
  marker = _export_marker(out_dir)
  bias = None if marker is None else marker["value_bias"]
  return float(bias) if isinstance(bias, (int, float)) else None


def value_bias(params: Any) -> float:
  """A critic's value bias (its scalar head's `value_bias`), as a float."""
  return float(np.asarray(params["head"]["value_bias"], dtype=np.float32).reshape(-1)[0])


def export_pending(workdir: str, cfg: TrainConfig, step: int) -> bool:
  """Whether checkpoint.export_hf asks for an export that should hold iteration `step` and
  WORKDIR/hf_export does not (missing, unmarked, older, not the actor, or of another HF family:
  the field may change on a re-run; a marker written before families were recorded is taken as
  current)."""
  if not cfg.checkpoint.export_hf:
    return False
  marker = _export_marker(os.path.join(workdir, HF_EXPORT_DIR))
  if marker is None or marker["step"] != step or marker["model"] != "actor":
    return True
  return marker["family"] is not None and marker["family"] != _resolved_family(cfg)


def _resolved_family(cfg: TrainConfig, model: str = "actor") -> str:
  return export_family(cfg, model) or hf_loader.hf_family(model_config(cfg, model))


def export_work_dirs(out_dir: str) -> tuple[str, str]:
  """(where an export is written, where the one it replaces waits until it is whole): hidden
  names of our own beside out_dir, which an export deletes first. (They were hf_export.tmp and
  hf_export.old, names a user gave an export kept aside, and lost it.)"""
  parent, name = os.path.split(os.path.normpath(out_dir))
  return (os.path.join(parent, f".{name}.rlhfuse-writing"),
          os.path.join(parent, f".{name}.rlhfuse-replaced"))


def export_hf(params: Any, cfg: TrainConfig, out_dir: str, step: Optional[int] = None,
              tokenizer: Optional[Tokenizer] = None, run: str = "",
              model: str = "actor", inputs: Optional[Mapping[str, Any]] = None) -> Optional[str]:
  """Writes the `model` ("actor", or "critic") `params` of the resolved config `cfg` as a HF
  checkpoint in `out_dir` (replacing an earlier export only once the new one is complete),
  marked with `step` (the iteration it is from; None: unmarked), `run` (the run's workdir) and
  `model`, with the run's tokenizer files and chat template, and the special ids of `tokenizer`
  (the run's) where the model's source checkpoint (init.actor_checkpoint /
  init.critic_checkpoint) gave none: a critic's config.json gets a pad_token_id, without which
  transformers' *ForSequenceClassification refuses batches of more than one sequence. Every
  process takes part (a multi-host model is gathered); process 0 writes. Returns the family
  written. `inputs`: the run's fingerprints of the files it read ({field: {file name: digest}},
  trainer/inputs.py): a tokenizer file among them gone since is an ExportInputError, as is the
  source checkpoint's config.json (the run read the model from it), the chat template file (one
  that does not read: _check_template_file) and, of the actor's source, a
  generation_config.json among them."""
  check_model_name(model)
  source = source_checkpoint(cfg, model)
  if source:  # (checkpoint.export_hf='auto' reads the family there: its FileNotFoundError was
    # a failed write of the export, hooks.writing's "writing WORKDIR/hf_export failed", exit 3)
    _read_input(os.path.join(source, "config.json"), _source_file(model))
  _check_template_file(cfg, inputs)  # (here too: on every process, before the gather)
  family = export_family(cfg, model)
  params = mesh_lib.to_host(params)
  if jax.process_index() != 0:
    return family
  tmp, old = export_work_dirs(out_dir)
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    _write_export(params, cfg, tmp, step, tokenizer, run, model, family, inputs)
    wd.fsync_directory(tmp)  # its files' names, before it is renamed into place (each file is)
  except BaseException:  # (a full disk: its space back, no half an export left beside out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  # The earlier export is moved aside first and deleted last, so a crash leaves one whole
  # export: the old one under out_dir or beside it in `old`, or the new one under out_dir or
  # still in `tmp` (which the next export deletes first: the checkpoint exports it again, and
  # export_pending sees out_dir's marker missing or older).
  shutil.rmtree(old, ignore_errors=True)
  if os.path.exists(out_dir):
    os.replace(out_dir, old)
  os.replace(tmp, out_dir)
  wd.fsync_directory(os.path.dirname(os.path.abspath(out_dir)))  # the rename itself
  shutil.rmtree(old, ignore_errors=True)
  return _resolved_family(cfg, model)


def _write_export(params: Any, cfg: TrainConfig, tmp: str, step: Optional[int],
                  tokenizer: Optional[Tokenizer], run: str, model: str,
                  family: Optional[str], inputs: Optional[Mapping[str, Any]] = None) -> None:
  """export_hf's files, written into its working directory `tmp`."""
  hf_loader.save_hf_checkpoint(params, model_config(cfg, model), tmp, family=family)
  marker = {"step": step, "family": _resolved_family(cfg, model),
            "run": os.path.realpath(run) if run else None, "model": model}
  if model == "critic":
    marker["value_bias"] = bias = value_bias(params)
    if bias != 0:
      logging.warning(
          "the critic's value bias is %.6g, written as score.bias: rlhfuse_jax's loader "
          "(hf_loader.load_hf_params) reads it back, but transformers' "
          "*ForSequenceClassification has no bias in its score layer and ignores it, so its "
          "values (logits) are the critic's minus %.6g: add it back", bias, bias)
  if step is not None:
    wd.atomic_write_text(os.path.join(tmp, EXPORT_MARKER), json.dumps(marker))
  _copy_tokenizer(cfg, tokenizer, tmp, _names_read(inputs, "init.tokenizer"))
  source = source_checkpoint(cfg, model)
  if source:  # its generation config, and its config.json's special ids
    what = _source_file(model)
    # (the critic's generation config is read nowhere before: optional)
    read = _names_read(inputs, "init.actor_checkpoint") if model == "actor" else ()
    for name in CHECKPOINT_FILES:
      if os.path.isfile(os.path.join(source, name)) or name in read:
        wd.atomic_write_bytes(os.path.join(tmp, name),
                              _read_input(os.path.join(source, name), what))
    _keep_source_context(source, os.path.join(tmp, "config.json"), what)
  # (after the source's: a checkpoint saved with null ids, as transformers writes Qwen3's, kept
  # them, and generate() ran past the run's EOS)
  _fill_special_ids(tokenizer, os.path.join(tmp, "config.json"))
  _write_generation_eos(tokenizer, tmp)


class HFExport(Hook):
  """checkpoint.export_hf: once the run completes num_iterations, the actor (`params_fn()`, its
  whole parameters) as a HF checkpoint in WORKDIR/hf_export. A run stopped earlier exports
  nothing; the run that completes it does. A finished run whose export is missing or older than
  its last checkpoint (export_pending) exports again when re-run (trainer/loop.py).
  `inputs`: the fingerprints of the files the run read as it started (export_hf's)."""

  def __init__(self, workdir: str, cfg: TrainConfig, params_fn: Callable[[], Any],
               tokenizer: Optional[Tokenizer] = None,
               inputs: Optional[Mapping[str, Any]] = None):
    self.workdir, self.out_dir = workdir, os.path.join(workdir, HF_EXPORT_DIR)
    self.cfg, self.params_fn, self.tokenizer = cfg, params_fn, tokenizer
    self.inputs = inputs

  def after(self, step: int, metrics: dict, stopping: bool) -> None:
    if self.cfg.checkpoint.export_hf and step == self.cfg.num_iterations:
      self.export(step)

  def export(self, step: int) -> None:
    # A full disk: hooks.LogWriteError (train_ppo: exit 3, as a failed save), naming the file.
    with writing(self.out_dir):
      family = export_hf(self.params_fn(), self.cfg, self.out_dir, step, self.tokenizer,
                         self.workdir, inputs=self.inputs)
    logging.info("exported the actor of iteration %d as a HF %s checkpoint: %s", step, family,
                 self.out_dir)
