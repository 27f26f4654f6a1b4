"""Chat templates: a prompt (text or a list of messages) rendered as an instruct model expects.

HF tokenizers ship a Jinja template (`chat_template` in tokenizer_config.json, or a
`chat_template.jinja` file next to it in newer checkpoints) that turns messages into the text the
model was tuned on. `ChatTemplate` renders it the way transformers' `apply_chat_template` does,
without transformers: the same sandboxed jinja2 environment (trim_blocks, lstrip_blocks, loop
controls, its `tojson`, `raise_exception` and `strftime_now`, `namespace`), the tokenizer's named
special tokens as variables (`bos_token`, `eos_token`, ...), message keys whose value is None
dropped, and `add_generation_prompt=True` so the text ends where the assistant's answer starts.
The rendered text is tokenised without adding BOS (the template writes it, as HF's
`add_special_tokens=False`). tests/test_data_chat.py compares text and ids with transformers'
own output, recorded in tests/fixtures/tiny_chat/goldens.json.

`data.chat_template`: "none" (prompts are plain text, as before), "auto" (the tokenizer's own
template; an error if it has none), or a path: a .jinja file, a tokenizer_config.json, or a
directory holding either.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.meta
from absl import logging
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.data.tokenizer import special_token_entries

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# What some editors write first in a UTF-8 file; a .jinja template's is dropped (_template_file).
BOM = "\ufeff"
# The named special tokens HF passes to every template (PreTrainedTokenizerBase.special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

Message = Mapping[str, Any]
Prompt = Union[str, Sequence[Message]]


class ChatTemplateError(ValueError):
  """A template that does not load or does not render (its raise_exception included)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # HF's filter: jinja's own tojson escapes HTML characters, which templates do not expect.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


# The instant a template's `strftime_now` renders. transformers renders the wall clock, but a
# prompt that changes with the day would change the run's prompt pool (its fingerprint refuses a
# resume on another day) and the tokens two runs train on (Llama 3.1+ templates print
# "Today Date: ..." whenever the messages set no date_string). Prompts are rendered with this
# fixed date instead, the same on every start.
TEMPLATE_NOW = datetime.datetime(2026, 1, 1)


def _strftime_now(fmt):
  return TEMPLATE_NOW.strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
  """jinja's namespace without underscore attributes (as HF's sandbox: no dunder access)."""

  def __init__(*args, **kwargs):  # noqa: N805 jinja's signature trick, kept
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


class _TemplateDict:
  """`dict(...)` and `dict.fromkeys(...)` for templates without handing them the type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: marks the assistant's text in templates written
  for assistant-only losses (TRL). transformers records the marked span; rendering a prompt
  needs only the body, which this writes unchanged."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _environment() -> ImmutableSandboxedEnvironment:
  """The environment transformers compiles chat templates in (templates are untrusted code
  from the Hub: sandboxed, immutable)."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["namespace"] = _Namespace
  env.globals["dict"] = _TemplateDict()
  return env


def _plain(value: Any) -> Any:
  """Plain JSON-like data for the template (numpy scalars from parquet rows become Python
  ones; message keys set to None are dropped, as HF's _normalize_chat_messages does)."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
    return value.item()
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
    return [_plain(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
  return str(value)


def as_messages(prompt: Prompt) -> list[dict[str, Any]]:
  """A string prompt is one user message; a list is taken as messages (None keys dropped)."""
  if isinstance(prompt, str):
    return [{"role": "user", "content": prompt}]
  return [{k: _plain(v) for k, v in m.items() if v is not None} for m in prompt]


class ChatTemplate:
  """A compiled chat template plus the special-token strings it may read."""

  def __init__(self, source: str, *, special_tokens: Optional[Mapping[str, str]] = None,
               name: str = "chat template"):
    """`source`: the Jinja text; `special_tokens`: {'bos_token': '<s>', ...} (None entries
    are left undefined, as HF leaves an unset token out); `name`: how errors refer to it."""
    self.source, self.name = source, name
    self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    env = _environment()
    try:
      tree = env.parse(source)  # (parsed once: the check below reads it, the template compiles it)
      reads = jinja2.meta.find_undeclared_variables(tree)
      self._template = env.from_string(tree)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise ChatTemplateError(f"{name}: not a valid Jinja template (line {e.lineno}: "
                              f"{e.message})") from e
    if "messages" not in reads:  # (a system prompt given as data.chat_template: every prompt
      # rendered as that text, the questions gone, and the export carried it as the template)
      raise ChatTemplateError(
          f"{name}: never reads `messages` (the conversation), so every prompt would render "
          "as the same text; expected a chat template: Jinja over `messages`, as a "
          "tokenizer_config.json's chat_template or a chat_template.jinja")

  def render(self, prompt: Prompt, add_generation_prompt: bool = True) -> str:
    """The text of `prompt` as the model reads it, ending with the assistant's header."""
    messages = as_messages(prompt)
    if not messages:
      raise ChatTemplateError(f"{self.name}: cannot render an empty conversation")
    try:
      return self._template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{self.name}: {type(e).__name__}: {e}") from e

  @classmethod
  def load(cls, spec: str, tokenizer_path: str = "") -> Optional["ChatTemplate"]:
    """The template `data.chat_template` names; None for "none".

    spec: "none"; "auto" (the template next to `tokenizer_path`, the run's init.tokenizer);
      or a path to a .jinja file, a tokenizer_config.json, or a directory holding either
      (chat_template.jinja first, as transformers reads them).
    tokenizer_path: tokenizer.json or its directory; its tokenizer_config.json gives the
      special-token variables (bos_token, eos_token, ...) whichever file the template is from.
    """
    if spec == "none":
      return None
    tok_dir = _directory(tokenizer_path) if tokenizer_path else ""
    special = _special_tokens(os.path.join(tok_dir, CONFIG_FILE)) if tok_dir else {}
    if spec == "auto":
      if not tok_dir:
        raise ChatTemplateError(
            "config.data.chat_template='auto' reads the tokenizer's own template, but "
            "config.init.tokenizer is empty (the synthetic task's tokenizer has none): set "
            "init.tokenizer, a template path, or 'none'")
      found = _find_template(tok_dir)
      if found is None:
        config_path = os.path.join(tok_dir, CONFIG_FILE)
        # (a tokenizer.json copied alone has no config beside it: say so, not that its entry
        # was looked for in a file that is not there)
        looked = (f"and a 'chat_template' entry in {config_path}" if os.path.isfile(config_path)
                  else f"and {config_path}, which does not exist")
        raise ChatTemplateError(
            f"config.data.chat_template='auto': no chat template next to the tokenizer (looked "
            f"for {os.path.join(tok_dir, TEMPLATE_FILE)} {looked}); a base model has none: set "
            "'none' or a template path")
    else:
      if not os.path.exists(spec):
        raise ChatTemplateError(f"config.data.chat_template={spec!r}: no such file or directory; "
                                "expected 'none', 'auto', or a path to a .jinja file, a "
                                "tokenizer_config.json or a directory holding either")
      found = _find_template(spec) if os.path.isdir(spec) else _template_file(spec)
      if found is None:
        raise ChatTemplateError(f"config.data.chat_template={spec!r}: the directory holds no "
                                f"{TEMPLATE_FILE} and no {CONFIG_FILE} with a 'chat_template'")
      if not special:  # no tokenizer config: the template's own directory may have one
        special = _special_tokens(os.path.join(_directory(found[1]), CONFIG_FILE))
    source, where = found
    return cls(source, special_tokens=special, name=where)


def _directory(path: str) -> str:
  return path if os.path.isdir(path) else os.path.dirname(path) or "."


def _read_json(path: str) -> dict[str, Any]:
  return wd.read_json_object(path, ChatTemplateError, "cannot read it as JSON")


def _special_tokens(config_path: str) -> dict[str, str]:
  """The named special tokens of a tokenizer_config.json (strings or {'content': ...}), and for
  a name it does not mention, of the special_tokens_map.json beside it (transformers reads both:
  a config without `bos_token` whose map names "<s>" renders `{{ bos_token }}` as "<s>"; a name
  the config sets to null, as Qwen2's bos_token, stays unset)."""
  config = _read_json(config_path) if os.path.isfile(config_path) else {}
  entries = special_token_entries(config_path, config, ChatTemplateError)
  out = {}
  for name in SPECIAL_TOKEN_NAMES:
    value = entries.get(name, (None, ""))[0]
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      out[name] = value
  return out


def _config_template(path: str, config: Mapping[str, Any]) -> Optional[str]:
  """tokenizer_config.json's chat_template: a string, or a list of named templates (HF's
  multi-template form; the one named 'default' is what apply_chat_template uses)."""
  value = config.get("chat_template")
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ChatTemplateError(f"{path}: chat_template holds the named templates "
                            f"{sorted(map(str, named))} but none named 'default'")
  raise ChatTemplateError(f"{path}: chat_template must be a string or a list of "
                          f"{{'name', 'template'}}, got {type(value).__name__}")


def _template_file(path: str) -> Optional[tuple[str, str]]:
  """(source, path) of a .jinja file or a tokenizer_config.json's template."""
  if path.endswith(".json"):
    source = _config_template(path, _read_json(path))
    if source is None:
      raise ChatTemplateError(f"{path}: has no 'chat_template' entry")
    return source, path
  try:
    with open(path, encoding="utf-8") as f:
      source = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ChatTemplateError(f"{path}: cannot read the chat template ({e})") from e
  if source.startswith(BOM):
    # (rendered, it was the first text of every prompt: three byte tokens before the BOS)
    # (The resume check hashes the file's bytes, mark included: removing it is a change of
    # content, refused on resume like any edit. Not ignored by that digest: the checkpoints of
    # runs that read such a file hold the digest with it.)
    logging.warning("%s starts with a UTF-8 byte-order mark (an editor's): read as nothing, as "
                    "in a prompts file (transformers keeps it, as text before every prompt; "
                    "the run's HF export writes the template without it). Leave it there while "
                    "a run started with it may resume: its resume check compares the file's "
                    "bytes, and refuses the file without the mark as a changed input", path)
    source = source[len(BOM):]
  return source, path


def _find_template(directory: str) -> Optional[tuple[str, str]]:
  """chat_template.jinja in `directory`, else its tokenizer_config.json's entry, else None."""
  jinja_path = os.path.join(directory, TEMPLATE_FILE)
  if os.path.isfile(jinja_path):
    return _template_file(jinja_path)
  config_path = os.path.join(directory, CONFIG_FILE)
  if os.path.isfile(config_path):
    source = _config_template(config_path, _read_json(config_path))
    if source is not None:
      return source, config_path
  return None
