"""Writes the data of configs/ppo_hf.py: a tiny Llama-3-style model directory and a small
GSM8K-format dataset, all made here (nothing copied from GSM8K).

  python configs/data/make_tiny_example.py   # from the repository root; rewrites the files

  configs/data/tiny_llama3_chat/   an HF model directory as a user downloads one:
      config.json, model.safetensors, generation_config.json   tests/fixtures/tiny_llama3's
          (random weights, Llama 3.1 RoPE scaling, tied embeddings, 128-entry vocabulary),
          copied byte for byte, so that the HF logits recorded in its golden.npz are this
          model's too (tests/test_ppo_hf_example.py checks the copy)
      tokenizer.json          a byte-level BPE of 128 tokens trained here on the dataset below
          (the fixture's own tokenizer has no digits: it cannot spell a GSM8K answer)
      tokenizer_config.json   Llama 3's special tokens and a Llama-3-style chat template
  configs/data/tiny_gsm8k/{train,val}.jsonl   256 + 64 arithmetic word problems in GSM8K's
      format: {"question": ..., "answer": "<solution with <<calc>> notes>\\n#### N"}

Why here (configs/data/) and not tests/fixtures/: the example config points at these files, and
configs/ is where a run's inputs live; the tests read them as they read any config.

Everything is deterministic: the problems come from random.Random(SEED), and the tokenizer's
BPE training is deterministic for a fixed corpus (tests/test_ppo_hf_example.py re-runs this
script into a temporary directory and compares every file byte for byte). Needs only the
`tokenizers` library (a dependency of the package).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys

import tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tiny_llama3")
MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json")
SEED = 32
NUM_TRAIN, NUM_VAL = 256, 64
VOCAB = 128  # the fixture model's embedding rows

# Ids 0-2 are the fixture's config.json pad/bos/eos ids; <|eot_id|> ends an assistant turn, so
# it is the EOS generation stops on (as in Llama 3 Instruct's generation_config).
SPECIALS = ["<pad>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|end_of_text|>"]

# Llama 3 Instruct's layout (header tokens around the role, <|eot_id|> after each turn) without
# its default system prompt, which would triple the prompt of this 2-layer model.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "  {{- message['content'] | trim }}\n"
    "  {{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")

_PEOPLE = [("Tom", "he"), ("Ann", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"),
           ("Zoe", "she"), ("Max", "he"), ("Lily", "she")]
_ITEMS = ["apples", "pens", "books", "cards", "eggs", "coins", "stickers", "marbles"]


def _problem(rng: random.Random) -> dict:
  """One word problem: 1 or 2 steps of +, -, x over small numbers, GSM8K's answer format."""
  name, he = rng.choice(_PEOPLE)
  item = rng.choice(_ITEMS)
  kind = rng.randrange(4)
  if kind == 0:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    s = a + b
    q = (f"{name} has {a} {item}. {he.capitalize()} buys {b} more. "
         f"How many {item} does {he} have now?")
    sol = f"{name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item} now."
  elif kind == 1:
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    s = a - b
    q = f"{name} has {a} {item} and gives {b} of them away. How many {item} are left?"
    sol = f"{name} has {a} - {b} = <<{a}-{b}={s}>>{s} {item} left."
  elif kind == 2:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    s = a * b
    q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {he} buy?"
    sol = f"{name} buys {a} * {b} = <<{a}*{b}={s}>>{s} {item}."
  else:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    c = rng.randint(1, a + b - 1)
    t, s = a + b, a + b - c
    q = (f"{name} has {a} {item}. {he.capitalize()} buys {b} more and then gives {c} away. "
         f"How many {item} does {he} have now?")
    sol = (f"{name} has {a} + {b} = <<{a}+{b}={t}>>{t} {item}. "
           f"After giving {c} away {he} has {t} - {c} = <<{t}-{c}={s}>>{s} {item}.")
  return {"question": q, "answer": f"{sol}\n#### {s}"}


def make_problems() -> tuple[list[dict], list[dict]]:
  rng = random.Random(SEED)
  rows = [_problem(rng) for _ in range(NUM_TRAIN + NUM_VAL)]
  return rows[:NUM_TRAIN], rows[NUM_TRAIN:]


def make_tokenizer(rows: list[dict]) -> tokenizers.Tokenizer:
  """A byte-level BPE whose alphabet is the bytes of the corpus (the dataset and the template's
  role names): every problem, answer and rendered prompt encodes without loss."""
  corpus = [r["question"] for r in rows] + [r["answer"] for r in rows]
  corpus += ["user", "assistant", "system"]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                           show_progress=False)
  tok.train_from_iterator(corpus, trainer=trainer)
  if tok.get_vocab_size() > VOCAB:
    raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens; the model embeds {VOCAB}")
  for text in corpus:
    if tok.decode(tok.encode(text).ids) != text:
      raise ValueError(f"tokenizer does not round-trip {text!r}")
  return tok


def _write_jsonl(path: str, rows: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")


def main(out_dir: str) -> None:
  train, val = make_problems()
  model_dir = os.path.join(out_dir, "tiny_llama3_chat")
  data_dir = os.path.join(out_dir, "tiny_gsm8k")
  os.makedirs(model_dir, exist_ok=True)
  os.makedirs(data_dir, exist_ok=True)
  for name in MODEL_FILES:
    shutil.copyfile(os.path.join(FIXTURE, name), os.path.join(model_dir, name))
  make_tokenizer(train + val).save(os.path.join(model_dir, "tokenizer.json"))
  tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                "model_max_length": 256, "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
  with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(tok_config, f, indent=2)
    f.write("\n")
  _write_jsonl(os.path.join(data_dir, "train.jsonl"), train)
  _write_jsonl(os.path.join(data_dir, "val.jsonl"), val)


if __name__ == "__main__":
  # An optional output directory; an option was taken for one (--help wrote the example into
  # ./--help/)
  if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
    sys.exit("usage: python configs/data/make_tiny_example.py [OUTPUT_DIR] (default: "
             "configs/data/, whose files it rewrites; the module docstring says what it writes)")
  main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
