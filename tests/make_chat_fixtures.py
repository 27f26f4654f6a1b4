"""Builds the chat-template fixtures that tests/test_data_chat.py checks our renderer against.

Run once, by hand, from the repository root, in a separate environment with transformers (the
tests do not need it; torch is not needed either):

  python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install transformers tokenizers jinja2
  /tmp/hfvenv/bin/python tests/make_chat_fixtures.py

It writes tests/fixtures/tiny_chat/:

  tokenizer.json             a byte-level BPE (every byte encodes) with the special tokens of
                             three chat formats, trained here on a few sentences
  chatml/                    tokenizer.json + tokenizer_config.json whose chat_template is a
                             ChatML-style template (default system prompt, whitespace control)
  headers/                   tokenizer.json + tokenizer_config.json with a header-style template
                             (bos_token, role headers, `| trim`)
  inst/                      tokenizer.json + tokenizer_config.json (no chat_template) +
                             chat_template.jinja (transformers' newer file): an [INST]-style
                             template that folds the system prompt into the first user turn and
                             calls raise_exception when roles do not alternate
  goldens.json               for every directory and conversation: the string transformers'
                             `apply_chat_template(..., add_generation_prompt=True,
                             tokenize=False)` renders and the ids of `tokenize=True`, or the
                             error message it raised

The three templates are written here for the tests, in the styles of common model families; they
use what Hub templates use (namespace, loop controls, tojson, slicing, raise_exception).

Recorded with transformers 5.24.0, tokenizers 0.23.3, jinja2 3.1.6.
"""
from __future__ import annotations

import json
import os
import shutil

import tokenizers
import transformers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_chat")

SPECIALS = ["<pad>", "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

_CORPUS = [
    "You are a helpful assistant. Solve the problem step by step.",
    "What is 12 plus 30? The answer is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Put the final answer in \\boxed{} and think before you answer.",
    "system user assistant tool",
] * 3

CHATML = (
    "{%- for message in messages %}\n"
    "  {%- if loop.first and message['role'] != 'system' %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "  {%- endif %}\n"
    "  {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "  {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

# Written over several lines: block tags on their own (indented) lines rely on jinja's
# trim_blocks and lstrip_blocks, as transformers compiles templates.
HEADERS = """\
{{ bos_token }}{% set ns = namespace(turns=0) %}
{% for message in messages %}
  {% if message['role'] == 'tool' %}
    {% continue %}
  {% endif %}
  {% set ns.turns = ns.turns + 1 %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message.content | trim }}{% if message.meta is defined %} {{ message.meta | tojson }}{% endif %}
<|eot_id|>{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

INST = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "  {%- set system = messages[0]['content'] %}\n"
    "  {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "  {%- set system = '' %}\n"
    "  {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "    {{- raise_exception('Conversation roles must alternate"
    " user/assistant/user/assistant') }}\n"
    "  {%- endif %}\n"
    "  {%- if message['role'] == 'user' %}\n"
    "    {%- if loop.first and system %}\n"
    "      {{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "    {%- else %}\n"
    "      {{- '[INST] ' + message['content'] + ' [/INST]' }}\n"
    "    {%- endif %}\n"
    "  {%- else %}\n"
    "    {{- ' ' + message['content'] + eos_token }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n")

CONFIGS = {
    "chatml": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "headers": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                "pad_token": "<pad>"},
    "inst": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None},
}
TEMPLATES = {"chatml": CHATML, "headers": HEADERS, "inst": INST}

# Conversations every template renders (the name is the key in goldens.json).
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 12 plus 30?"}],
    "system_user": [{"role": "system", "content": "Solve the problem step by step."},
                    {"role": "user", "content": "  Natalia sold 48 clips in April. \n"}],
    "multi_turn": [{"role": "user", "content": "What is 12 plus 30?"},
                   {"role": "assistant", "content": "The answer is 42."},
                   {"role": "user", "content": "Put the final answer in \\boxed{}."}],
    "unicode": [{"role": "user", "content": "Combien font 2 × 3 ? Réponds en français ✓"}],
    "tool_turn": [{"role": "user", "content": "add 1 and 2"},
                  {"role": "tool", "content": "3"},
                  {"role": "assistant", "content": "3", "meta": {"a": [1, "é"]}}],
    "two_users": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
    # A key set to None is dropped before rendering (a parquet list of structs fills absent
    # fields with None): `meta is defined` is false here.
    "none_field": [{"role": "user", "content": "hi", "meta": None}],
}


def make_tokenizer() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_CORPUS, trainer=trainer)
  return tok


def _compact(goldens: dict) -> str:
  """JSON with one line per recorded conversation (reviewable diffs, no line per id)."""
  lines = []
  for key, value in goldens.items():
    if isinstance(value, dict) and "conversations" in value:
      dump = lambda x: json.dumps(x, ensure_ascii=False)
      convs = ",\n".join(f"   {dump(c)}: {dump(v)}" for c, v in value["conversations"].items())
      stm = json.dumps(value["special_tokens_map"], ensure_ascii=False)
      lines.append(f' {json.dumps(key)}: {{"special_tokens_map": {stm}, "conversations": {{\n'
                   f"{convs}}}}}")
    else:
      lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
  return "{\n" + ",\n".join(lines) + "\n}"


def main() -> None:
  shutil.rmtree(OUT, ignore_errors=True)
  os.makedirs(OUT)
  tok_path = os.path.join(OUT, "tokenizer.json")
  make_tokenizer().save(tok_path)
  goldens = {"versions": {"transformers": transformers.__version__,
                          "tokenizers": tokenizers.__version__}}
  for name, specials in CONFIGS.items():
    d = os.path.join(OUT, name)
    os.makedirs(d)
    shutil.copy(tok_path, os.path.join(d, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
              "model_max_length": 4096, **specials}
    if name == "inst":  # transformers' newer layout: the template in its own file
      with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TEMPLATES[name])
    else:
      config["chat_template"] = TEMPLATES[name]
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    assert hf.chat_template == TEMPLATES[name], name
    out = {}
    for conv_name, messages in CONVERSATIONS.items():
      try:
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
        out[conv_name] = {"text": text, "ids": [int(i) for i in ids]}
      except Exception as e:  # noqa: BLE001 recorded: the renderer must raise it too
        out[conv_name] = {"error": str(e), "type": type(e).__name__}
    goldens[name] = {"special_tokens_map": hf.special_tokens_map, "conversations": out}
  goldens["conversations"] = CONVERSATIONS
  with open(os.path.join(OUT, "goldens.json"), "w", encoding="utf-8") as f:
    f.write(_compact(goldens) + "\n")
  print(json.dumps({k: v for k, v in goldens.items() if k != "conversations"}, indent=1,
                   ensure_ascii=False)[:6000])


if __name__ == "__main__":
  main()
