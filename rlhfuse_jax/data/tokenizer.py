"""Tokenizers: one small interface for real (HF `tokenizer.json`) and synthetic-task vocabularies.

The trainer, generation and reward code only need text <-> ids and the special ids (BOS, EOS,
PAD), so everything speaks the `Tokenizer` interface below. `HFTokenizer` wraps a
`tokenizers.Tokenizer` (the Rust library HF models ship with); it is built either from a
`tokenizer.json` file (special tokens resolved from an optional `tokenizer_config.json` next to
it) or directly from an in-memory `tokenizers.Tokenizer` (the synthetic tasks' vocabularies).

BOS handling is explicit: `encode` never runs the library's post-processor (whose templates
differ between model families) and prepends `bos_id` itself when `add_bos` is set.
"""
from __future__ import annotations

import abc
import functools
import json
import os
from typing import Any, Mapping, Optional, Sequence

import tokenizers

from rlhfuse_jax import workdir as wd

SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # names special tokens beside tokenizer_config
GENERATION_CONFIG = "generation_config.json"  # its eos_token_id: the ids generation stops on

# Tried in order when neither the caller nor tokenizer_config.json names a special token.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>",
                   "[SEP]")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")


class Tokenizer(abc.ABC):
  """Text <-> token ids plus the special ids the RL loop needs.

  Attributes:
    vocab_size: number of ids the tokenizer can produce (a model's embedding may be larger).
    bos_id: id prepended to every prompt by `encode(..., add_bos=True)`; None if the vocabulary
      has no BOS token.
    eos_id: id that ends a response (generation stops on it); the one appended to targets.
    extra_eos_ids: other ids that also end a response (a chat model's generation_config.json
      often lists several: Llama 3 Instruct's <|end_of_text|>, <|eom_id|> and <|eot_id|>).
    pad_id: id used to fill padded positions (never attended to; may equal eos_id).
  """
  vocab_size: int
  bos_id: Optional[int]
  eos_id: int
  pad_id: int
  extra_eos_ids: tuple[int, ...] = ()

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Every id that ends a response: eos_id first, then extra_eos_ids."""
    return (self.eos_id,) + tuple(self.extra_eos_ids)

  @abc.abstractmethod
  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of `text`; BOS prepended when `add_bos` (default: the tokenizer's own setting)."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids` (special tokens such as EOS and PAD dropped unless asked for).

    Ids beyond the vocabulary are dropped silently by the `tokenizers` library; verifiers that
    compare text must check the id range themselves (see `rewards.exact_match`).
    """

  def encode_batch(self, texts: Sequence[str], add_bos: Optional[bool] = None) -> list[list[int]]:
    """`encode` over many texts (subclasses may do this in parallel)."""
    return [self.encode(t, add_bos=add_bos) for t in texts]

  @property
  def special_ids(self) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops (none unless a subclass says)."""
    return frozenset()


SENTENCEPIECE_FILE = "tokenizer.model"  # SentencePiece's: Llama 1/2, Mistral's first releases
_SENTENCEPIECE_HINT = ("the run reads the `tokenizers` library's tokenizer.json, which "
                       "transformers writes from it: AutoTokenizer.from_pretrained(DIR)"
                       ".save_pretrained(DIR)")


def tokenizer_file(path: str) -> str:
  """The tokenizer.json that config.init.tokenizer's `path` names: the file, or the one in the
  model directory it names."""
  return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


class HFTokenizer(Tokenizer):
  """A `tokenizers.Tokenizer` with explicit special ids (see the module docstring)."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_id: int, pad_id: Optional[int] = None,
               bos_id: Optional[int] = None, add_bos: Optional[bool] = None,
               extra_eos_ids: Sequence[int] = (), name: str = "tokenizer"):
    """Wraps `tokenizer`.

    Args:
      tokenizer: the library tokenizer.
      eos_id: end-of-sequence id (required: generation must be able to stop).
      pad_id: padding id; defaults to `eos_id` (padded positions are masked, so any id works, and
        many LLaMA-family vocabularies have no pad token).
      bos_id: beginning-of-sequence id, or None.
      add_bos: whether `encode` prepends BOS by default; defaults to `bos_id is not None`.
      extra_eos_ids: other ids that also end a response (eos_id itself and repeats are dropped).
      name: how errors refer to this tokenizer (e.g. the file it came from).
    """
    if tokenizer.truncation is not None or tokenizer.padding is not None:
      # A tokenizer.json saved after a call with truncation/padding keeps those settings and
      # the library applies them on every encode: prompts would be cut silently (past the
      # max_prompt_len check) or padded with ids counted as prompt tokens. transformers resets
      # both per call; so do we, on a copy (the caller's object stays as it was).
      tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
      tokenizer.no_truncation()
      tokenizer.no_padding()
    self._tok = tokenizer
    self.name = name
    self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    for field, value in (("eos_id", eos_id), ("pad_id", pad_id), ("bos_id", bos_id)):
      if value is not None and not 0 <= int(value) < self.vocab_size:
        raise ValueError(f"{name}: {field}={value} is outside the vocabulary "
                         f"[0, {self.vocab_size})")
    for value in extra_eos_ids:
      if isinstance(value, bool) or int(value) != value or not 0 <= value < self.vocab_size:
        raise ValueError(f"{name}: extra_eos_ids has {value!r}; expected token ids in "
                         f"[0, {self.vocab_size})")
    self.eos_id = int(eos_id)
    self.extra_eos_ids = tuple(dict.fromkeys(int(v) for v in extra_eos_ids
                                             if int(v) != self.eos_id))
    self.pad_id = self.eos_id if pad_id is None else int(pad_id)
    self.bos_id = None if bos_id is None else int(bos_id)
    if add_bos and self.bos_id is None:
      raise ValueError(f"{name}: add_bos=True but the tokenizer has no bos_id")
    self.add_bos = (self.bos_id is not None) if add_bos is None else bool(add_bos)

  @functools.cached_property
  def special_ids(self) -> frozenset[int]:
    """The added tokens marked special (what the library's skip_special_tokens drops)."""
    return frozenset(int(i) for i, token in self._tok.get_added_tokens_decoder().items()
                     if token.special)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped `tokenizers.Tokenizer`."""
    return self._tok

  def token_to_id(self, token: str) -> Optional[int]:
    return self._tok.token_to_id(token)

  def id_to_token(self, idx: int) -> Optional[str]:
    return self._tok.id_to_token(int(idx))

  def _with_bos(self, ids: list[int], add_bos: Optional[bool]) -> list[int]:
    add = self.add_bos if add_bos is None else add_bos
    if add:
      if self.bos_id is None:
        raise ValueError(f"{self.name}: add_bos=True but the tokenizer has no bos_id")
      return [self.bos_id] + ids
    return ids

  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    try:
      ids = self._tok.encode(text, add_special_tokens=False).ids
    except Exception as e:  # the Rust library raises a bare Exception (e.g. an unknown word)
      raise ValueError(f"{self.name}: cannot encode {text!r}: {e}") from e
    return self._with_bos(list(ids), add_bos)

  def encode_batch(self, texts: Sequence[str], add_bos: Optional[bool] = None) -> list[list[int]]:
    try:
      encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    except Exception:
      # Re-run one by one so that the error names the offending text.
      return [self.encode(t, add_bos=add_bos) for t in texts]
    return [self._with_bos(list(e.ids), add_bos) for e in encodings]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  @classmethod
  def from_file(cls, path: str, *, eos_token: Optional[str] = None,
                bos_token: Optional[str] = None, pad_token: Optional[str] = None,
                add_bos: Optional[bool] = None,
                extra_eos_ids: Optional[Sequence[int]] = None) -> "HFTokenizer":
    """Loads `tokenizer.json` (or a directory holding one).

    Special tokens are resolved, per token, from (1) the explicit argument, (2) the
    `tokenizer_config.json` next to the file (`bos_token`, `eos_token`, `pad_token`,
    `add_bos_token`, as HF writes them), (3) well-known names among the vocabulary's added
    tokens. EOS must resolve; PAD falls back to EOS; BOS may stay None. A token set to null in
    tokenizer_config.json (e.g. Qwen2's `bos_token`) counts as absent and is not guessed.
    Whether `encode` prepends BOS: the argument, else `add_bos_token`, else what the file's
    post-processor does (`post_processor_adds`), else yes when there is a BOS.
    The ids that end a response besides EOS: the argument, else the `eos_token_id` of a
    `generation_config.json` next to the file (an id or a list, as transformers' generate and
    vLLM read it: a chat model may end a turn on any of them).
    """
    path = tokenizer_file(path)
    if not os.path.isfile(path):
      sp = os.path.join(os.path.dirname(path), SENTENCEPIECE_FILE)
      raise FileNotFoundError(f"tokenizer file not found: {path}" + (
          f"; {sp} is there: {_SENTENCEPIECE_HINT}" if os.path.isfile(sp) else ""))
    if os.path.basename(path) == "tokenizer_config.json":  # a model directory's other file
      raise ValueError(f"{path} is a tokenizer_config.json (special tokens, chat template); the "
                       "tokenizer is the tokenizer.json beside it: name that file or the model's "
                       "directory")
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # malformed JSON or an unknown model type
      # A Llama 1/2 or original Mistral download's tokenizer.model (protobuf, not JSON) read as
      # "stream did not contain valid UTF-8" alone.
      hint = (f"; {os.path.basename(path)} looks like a SentencePiece model: "
              f"{_SENTENCEPIECE_HINT}" if path.endswith(".model") else "")
      raise ValueError(f"{path}: not a valid tokenizer.json ({e}); expected the `tokenizers` "
                       f"library's file, as a HF model directory has it{hint}") from e

    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    config = _read_tokenizer_config(config_path)
    # The map's tokens too, as the chat template reads them: otherwise a Llama-3-style
    # vocabulary got <|end_of_text|> from the candidates below as its EOS while the template
    # ended turns with the map's <|eot_id|>.
    named = special_token_entries(config_path, config)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}

    def resolve(kind: str, explicit: Optional[str], candidates: Sequence[str]) -> Optional[int]:
      source = "argument"
      if explicit is not None:
        token = explicit
      elif f"{kind}_token" in named:
        value, source = named[f"{kind}_token"]
        try:
          token = _token_content(value)
        except ValueError as e:
          raise ValueError(f"{source}: {kind}_token: {e}") from e
        if token is None:
          return None
      else:
        token = next((c for c in candidates if c in added or tok.token_to_id(c) is not None), None)
        if token is None:
          return None
      idx = tok.token_to_id(token)
      if idx is None:
        raise ValueError(f"{path}: {kind}_token={token!r} (from {source}) is not in the vocabulary")
      return idx

    eos_id = resolve("eos", eos_token, _EOS_CANDIDATES)
    if eos_id is None:
      # A null entry stops the search (as Qwen2's null bos_token): "none of ... in the
      # vocabulary" was said of one that holds <|im_end|>. train_ppo takes no eos_token
      # argument: the fix there is the file's entry.
      if "eos_token" in named:
        why = f"{named['eos_token'][1]} sets eos_token to null"
      else:
        why = (f"no eos_token in tokenizer_config.json or {SPECIAL_TOKENS_MAP} and none "
               f"of {list(_EOS_CANDIDATES)} in the vocabulary")
      raise ValueError(f"{path}: cannot find an EOS token ({why}); set eos_token in {config_path} "
                       "to the token that ends a response (HFTokenizer.from_file's eos_token= "
                       "in Python)")
    bos_id = resolve("bos", bos_token, _BOS_CANDIDATES)
    pad_id = resolve("pad", pad_token, _PAD_CANDIDATES)
    if add_bos is None and config is not None and config.get("add_bos_token") is not None:
      add_bos = bool(config["add_bos_token"]) and bos_id is not None
    if add_bos is None and bos_id is not None:
      add_bos = post_processor_adds(path, tok.id_to_token(bos_id))
    if extra_eos_ids is None:
      generation, extra_eos_ids = checkpoint_eos(os.path.dirname(path))
      size = int(tok.get_vocab_size(with_added_tokens=True))
      outside = [i for i in extra_eos_ids if i >= size]
      if outside:  # (named as the tokenizer's "extra_eos_ids" below, in the wrong file)
        raise ValueError(f"{generation}: eos_token_id has {outside}, outside the vocabulary of "
                         f"{path} ([0, {size}))")
    return cls(tok, eos_id=eos_id, pad_id=pad_id, bos_id=bos_id, add_bos=add_bos,
               extra_eos_ids=extra_eos_ids, name=path)


def checkpoint_eos(directory: str) -> tuple[str, tuple[int, ...]]:
  """The ids generation stops on that a model directory's files name, with the file read:
  generation_config.json's eos_token_id, else (no such file) config.json's, as transformers'
  generate and vLLM take it (GenerationConfig.from_model_config: the original Llama 3 Instruct
  layout has eos_token_id <|eot_id|> in config.json beside a tokenizer_config.json whose
  eos_token is <|end_of_text|>); ("", ()) when neither names one. A config.json that is not
  a model's (no model_type or architectures) is not read."""
  generation = os.path.join(directory, GENERATION_CONFIG)
  if os.path.isfile(generation):
    return generation, _generation_config_eos(generation)
  config = os.path.join(directory, "config.json")
  if os.path.isfile(config):
    fields = wd.read_json_object(config, ValueError, "not a valid config.json")
    if fields.get("model_type") or fields.get("architectures"):
      return config, _eos_ids(config, fields.get("eos_token_id"))
  return "", ()


def _generation_config_eos(path: str) -> tuple[int, ...]:
  """The eos_token_id of a generation_config.json (an int, a list of them, null or absent), as
  a tuple; () when the file is absent."""
  if not os.path.isfile(path):
    return ()
  return _eos_ids(path, wd.read_json_object(path, ValueError,
                                            f"not a valid {GENERATION_CONFIG}").get("eos_token_id"))


def _eos_ids(path: str, value: Any) -> tuple[int, ...]:
  """An eos_token_id field's value (an int, a list of them, or null) read from `path`."""
  ids = [] if value is None else value if isinstance(value, list) else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"{path}: eos_token_id={value!r}; expected a token id or a list of them")
  return tuple(ids)


def post_processor_adds(path: str, bos: str) -> Optional[bool]:
  """Whether tokenizer.json's post-processor puts `bos` first in a single sequence (what
  transformers' fast tokenizers do with add_special_tokens=True): a TemplateProcessing starting
  with it, alone or in a Sequence. None when the file has no post-processor (then the BOS the
  vocabulary names is added, as before: LLaMA-class tokenizers add theirs by default); False for
  any other one (a GPT-2-style ByteLevel adds nothing, although its config names a bos_token)."""
  with open(path, encoding="utf-8") as f:
    processor = json.load(f).get("post_processor")
  if not processor:
    return None
  pieces = processor.get("processors", [processor]) if processor.get("type") == "Sequence" \
      else [processor]
  for piece in pieces:
    if piece.get("type") == "TemplateProcessing" and piece.get("single"):
      first = piece["single"][0]
      return isinstance(first, dict) and first.get("SpecialToken", {}).get("id") == bos
  return False


def special_token_entries(config_path: str, config: Optional[Mapping[str, Any]],
                          error: type = ValueError) -> dict[str, tuple[Any, str]]:
  """{key: (entry, the file it came from)} of a tokenizer_config.json (`config`, parsed from
  `config_path`; None: absent) and of the special_tokens_map.json beside it, the config's entry
  where it has the key: transformers reads both, so a name the config does not mention comes from
  the map, and one it sets to null (Qwen2's bos_token) stays unset. The tokenizer's special ids
  and the chat template's variables (data/chat.py) both read them here. `error`: raised for a map
  that is not a JSON object."""
  map_path = os.path.join(os.path.dirname(config_path), SPECIAL_TOKENS_MAP)
  out = {}
  if os.path.isfile(map_path):
    token_map = wd.read_json_object(map_path, error, "not a valid " + SPECIAL_TOKENS_MAP)
    out = {k: (v, map_path) for k, v in token_map.items()}
  out.update({k: (v, config_path) for k, v in (config or {}).items()})
  return out


def _read_tokenizer_config(path: str) -> Optional[dict[str, Any]]:
  if not os.path.isfile(path):
    return None
  return wd.read_json_object(path, ValueError, "not a valid tokenizer_config.json")


def _token_content(value: Any) -> Optional[str]:
  """HF writes a special token either as a string or as an AddedToken dict with 'content'."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"unexpected special-token entry {value!r}: expected a string, null or "
                   "{'content': ...}")
