"""Builds the tiny HF checkpoints that tests/test_hf_loader.py checks our loader against.

Run once, by hand, from the repository root (needs torch and transformers; the tests do not):

  python tests/make_tiny_checkpoint.py [NAME ...]   # default: all of FIXTURE_NAMES

It writes, for random models in float32:

  tests/fixtures/tiny_llama/    LlamaForCausalLM, untied, saved SHARDED: config.json,
                                model.safetensors.index.json + model-0000k-of-0000n shards,
                                tokenizer.json, golden.npz
  tests/fixtures/tiny_qwen2/    Qwen2ForCausalLM: q/k/v biases, tied embeddings (single file,
                                as all below: config.json, model.safetensors, tokenizer.json,
                                golden.npz)
  tests/fixtures/tiny_llama3/   LlamaForCausalLM with Llama 3.1 RoPE scaling (rope_type "llama3",
                                original_max_position_embeddings=64 so that the 8 frequencies of
                                head_dim 16 fall in all three bands: kept, blended, divided by
                                factor=8), tied embeddings as Llama 3.2
  tests/fixtures/tiny_qwen3/    Qwen3ForCausalLM: per-head q/k RMSNorm, head_dim=32 != hidden /
                                heads, no biases, tied embeddings
  tests/fixtures/tiny_qwen2_5/  Qwen2ForCausalLM as Qwen2.5 7B+ configures it: untied, a
                                sliding_window that use_sliding_window=false leaves unused
  tests/fixtures/tiny_mistral/  MistralForCausalLM, untied, sliding_window=4096 (Mistral 7B v0.1)
                                longer than max_position_embeddings=256, so it never binds

golden.npz holds `input_ids` [batch, len] (int32) and HF's float32 `logits` [batch, len, vocab].
Every parameter, norm scales and biases included, is drawn from a fixed torch seed with a scale
that gives O(1) activations, so the logits discriminate between right and wrong numerics (HF's
own init, std 0.02 with unit norms and zero biases, would leave them nearly constant and leave the
biases and norm scales untested). The shapes are deliberately unusual where our config mapping
could go wrong: LLaMA uses head_dim=32 != hidden/heads, rms_norm_eps=1e-5 and rope_theta=5e5;
both use grouped-query attention (4 query heads, 2 KV heads).

Recorded with torch 2.13.0+cpu, transformers 5.23.0, tokenizers 0.23.3 (tiny_llama and
tiny_qwen2 on 2026-11-23; tiny_llama3, tiny_qwen3, tiny_qwen2_5 and tiny_mistral on 2026-11-26
with the same versions, after checking that re-running tiny_llama and tiny_qwen2 reproduced
their committed files byte for byte).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys

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


def make_config(kind: str) -> tuple[transformers.PreTrainedConfig, type]:
  """The (config, model class) of fixture `kind`: 2 layers, 4 query heads over 2 KV heads."""
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if kind == "llama":
    config = transformers.LlamaConfig(
        **common, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, attention_bias=False)
    return config, transformers.LlamaForCausalLM
  if kind == "qwen2":
    config = transformers.Qwen2Config(
        **common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    return config, transformers.Qwen2ForCausalLM
  if kind == "llama3":
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = transformers.LlamaConfig(
        **common, rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=True,
        attention_bias=False)
    return config, transformers.LlamaForCausalLM
  if kind == "qwen3":
    config = transformers.Qwen3Config(
        **common, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        attention_bias=False)
    return config, transformers.Qwen3ForCausalLM
  if kind == "qwen2_5":
    config = transformers.Qwen2Config(
        **common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=131072, max_window_layers=1)
    return config, transformers.Qwen2ForCausalLM
  if kind == "mistral":
    config = transformers.MistralConfig(
        **common, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
        sliding_window=4096)
    return config, transformers.MistralForCausalLM
  raise ValueError(f"unknown fixture kind {kind!r}")


def build(kind: str, out_dir: str, seed: int, tok: tokenizers.Tokenizer,
          max_shard_size=None) -> None:
  config, cls = make_config(kind)
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


# name -> (seed, max_shard_size); the seeds of the first two are those they were made with.
FIXTURE_NAMES = {"llama": (0, "200KB"), "qwen2": (1, None), "llama3": (2, None),
                 "qwen3": (3, None), "qwen2_5": (4, None), "mistral": (5, None)}


def main(names):
  tok = make_tokenizer()
  for name in names or FIXTURE_NAMES:
    seed, shard = FIXTURE_NAMES[name]
    build(name, os.path.join(FIXTURES, f"tiny_{name}"), seed=seed, tok=tok, max_shard_size=shard)


if __name__ == "__main__":
  main(sys.argv[1:])
