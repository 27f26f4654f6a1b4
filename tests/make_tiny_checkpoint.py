"""Builds the tiny HF checkpoints that tests/test_hf_loader.py checks our loader against.

Run once, by hand, from the repository root (needs torch and transformers; the tests do not):

  python tests/make_tiny_checkpoint.py

It writes, for a random LlamaForCausalLM (untied, saved SHARDED) and a random Qwen2ForCausalLM
(q/k/v biases, tied embeddings, single file), in float32:

  tests/fixtures/tiny_llama/  config.json, model.safetensors.index.json + model-0000k-of-0000n
                              shards, tokenizer.json, golden.npz
  tests/fixtures/tiny_qwen2/  config.json, model.safetensors, tokenizer.json, golden.npz

golden.npz holds `input_ids` [batch, len] (int32) and HF's float32 `logits` [batch, len, vocab].
Every parameter, norm scales and biases included, is drawn from a fixed torch seed with a scale
that gives O(1) activations, so the logits discriminate between right and wrong numerics (HF's
own init, std 0.02 with unit norms and zero biases, would leave them nearly constant and leave the
biases and norm scales untested). The shapes are deliberately unusual where our config mapping
could go wrong: LLaMA uses head_dim=32 != hidden/heads, rms_norm_eps=1e-5 and rope_theta=5e5;
both use grouped-query attention (4 query heads, 2 KV heads).

Recorded with torch 2.13.0+cpu, transformers 5.23.0, tokenizers 0.23.3.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import tokenizers
import torch
import transformers

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
VOCAB = 128
SEQ_LEN = 16
BATCH = 2

_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model learns to count and add small numbers",
    "reinforcement learning from human feedback trains the actor",
    "the critic predicts the value of every token in the response",
    "one plus two is three and three plus four is seven",
    "hello world, this is a tokenizer fixture for tests",
]


def make_tokenizer() -> tokenizers.Tokenizer:
  """A byte-level BPE with LLaMA-style special tokens, small enough for the 128-entry embedding.

  Its alphabet is only the bytes seen in `_SENTENCES` (the full 256-byte alphabet would not fit).
  """
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
  tok.train_from_iterator(_SENTENCES, trainer=trainer)
  assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
  return tok


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Replaces every parameter with a seeded draw that keeps activations O(1)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.2 * noise)
      elif "embed_tokens" in name:  # also the tied LM head: keep those logits O(1) too
        p.copy_(0.25 * noise)
      else:  # a Linear weight [out, in]
        p.copy_(noise / math.sqrt(p.shape[1]))


def golden_inputs(tok: tokenizers.Tokenizer, seed: int) -> np.ndarray:
  """Row 0: a tokenized sentence padded with random ids; row 1: random ids over the full vocab."""
  rng = np.random.default_rng(seed)
  ids = np.asarray(rng.integers(0, VOCAB, size=(BATCH, SEQ_LEN)), np.int32)  # [batch, len]
  sentence = [1] + tok.encode(_SENTENCES[0]).ids
  n = min(len(sentence), SEQ_LEN)
  ids[0, :n] = sentence[:n]
  return ids


def build(kind: str, out_dir: str, seed: int, tok: tokenizers.Tokenizer,
          max_shard_size=None) -> None:
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if kind == "llama":
    config = transformers.LlamaConfig(
        **common, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, attention_bias=False)
    cls = transformers.LlamaForCausalLM
  else:
    config = transformers.Qwen2Config(
        **common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    cls = transformers.Qwen2ForCausalLM
  torch.manual_seed(seed)
  model = cls(config).to(torch.float32).eval()
  randomize(model, seed)
  if config.tie_word_embeddings:
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

  if os.path.isdir(out_dir):
    shutil.rmtree(out_dir)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
  tok.save(os.path.join(out_dir, "tokenizer.json"))

  input_ids = golden_inputs(tok, seed)
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(input_ids).long()).logits  # [batch, len, vocab]
  np.savez(os.path.join(out_dir, "golden.npz"), input_ids=input_ids,
           logits=logits.to(torch.float32).numpy())
  files = sorted(os.listdir(out_dir))
  size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
  print(f"{out_dir}: {files} ({size / 1024:.0f} KiB), logits std {logits.std():.3f}")
  if max_shard_size is not None:
    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
      shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 2, f"expected a sharded checkpoint, got {shards}"


def main():
  tok = make_tokenizer()
  build("llama", os.path.join(FIXTURES, "tiny_llama"), seed=0, tok=tok, max_shard_size="200KB")
  build("qwen2", os.path.join(FIXTURES, "tiny_qwen2"), seed=1, tok=tok)


if __name__ == "__main__":
  main()
