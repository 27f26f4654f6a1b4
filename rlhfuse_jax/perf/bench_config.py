"""Typed configuration of experiments/bench_decode.py (decode throughput, HBM bandwidth, MFU).

`BenchDecodeConfig.from_config_dict` converts the ml_collections ConfigDict of
configs/bench_decode.py once, rejecting unknown fields with the known ones listed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rlhfuse_jax.fields import check as _check
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.sim import hardware as hw_lib


@dataclasses.dataclass(frozen=True)
class BenchDecodeConfig:
  seed: int
  model: ModelConfig  # actor shape; the critic is the same backbone with a scalar head
  batch_sizes: tuple[int, ...]  # decode batches measured
  prompt_len: int  # prompt tokens per row (the cache holds prompt_len + max_new_tokens)
  max_new_tokens: int  # tokens generated per row (no EOS: every row runs to the end)
  chunk_size: int  # decode steps per jitted call
  steps_per_check: int  # decode steps between "all rows done?" tests (sampling.SamplingConfig)
  warmup: int  # untimed runs before timing (compilation happens before these, ahead of time)
  repeats: int  # timed runs; medians are reported
  train_batch: int  # samples per PPO update
  train_prompt_len: int
  train_response_len: int
  hardware: str  # "auto": preset matched on device_kind; a preset name; "none": no peak
  compile_only: bool  # compile from shapes, report XLA's memory figures, run nothing
  capacity_live_len: int  # live positions per row at the end of the capacity-scaling chunk
  capacities: tuple[int, ...]  # cache capacities compared at that live length
  capacity_steps: int  # decode steps timed in the capacity-scaling chunk
  scan_compile_layers: tuple[int, ...]  # depths whose scanned decode chunk compile is timed
  #                                        (empty: not measured)
  peer: str  # "auto" | "hf" | "none": HF transformers generation as the peer baseline

  def __post_init__(self):
    _check(len(self.batch_sizes) > 0 and all(b > 0 for b in self.batch_sizes), "batch_sizes",
           self.batch_sizes, "a non-empty list of positive batch sizes")
    _check(list(self.batch_sizes) == sorted(set(self.batch_sizes)), "batch_sizes",
           self.batch_sizes, "strictly increasing batch sizes")
    for name in ("prompt_len", "max_new_tokens", "chunk_size", "repeats", "train_batch",
                 "train_prompt_len", "train_response_len"):
      _check(getattr(self, name) > 0, name, getattr(self, name), "> 0")
    _check(self.max_new_tokens >= 2, "max_new_tokens", self.max_new_tokens,
           ">= 2 (the first token comes from prefill; decode makes the rest)")
    _check(self.warmup >= 0, "warmup", self.warmup, ">= 0")
    # (numpy's default_rng refused -1 once the earlier outputs had moved aside)
    _check(self.seed >= 0, "seed", self.seed, ">= 0")
    _check(self.steps_per_check > 0 and self.chunk_size % self.steps_per_check == 0,
           "steps_per_check", self.steps_per_check,
           f"a positive divisor of chunk_size={self.chunk_size}")
    _check(self.prompt_len + self.max_new_tokens <= self.model.max_seq_len,
           "prompt_len + max_new_tokens", self.prompt_len + self.max_new_tokens,
           f"<= model.max_seq_len={self.model.max_seq_len}")
    _check(self.train_prompt_len + self.train_response_len <= self.model.max_seq_len,
           "train_prompt_len + train_response_len",
           self.train_prompt_len + self.train_response_len,
           f"<= model.max_seq_len={self.model.max_seq_len}")
    _check(0 < self.capacity_steps < self.capacity_live_len, "capacity_steps",
           self.capacity_steps, f"in [1, capacity_live_len={self.capacity_live_len})")
    _check(len(self.capacities) >= 2 and list(self.capacities) == sorted(set(self.capacities))
           and self.capacities[0] >= self.capacity_live_len, "capacities", self.capacities,
           f"at least two increasing capacities >= capacity_live_len={self.capacity_live_len}")
    _check(len(self.scan_compile_layers) != 1 and all(n > 0 for n in self.scan_compile_layers),
           "scan_compile_layers", self.scan_compile_layers,
           "at least two positive depths, or none (not measured)")
    _check(self.peer in ("auto", "hf", "none"), "peer", self.peer, "'auto', 'hf' or 'none'")
    _check(self.hardware in ("auto", "none") or self.hardware in hw_lib.HARDWARE, "hardware",
           self.hardware, f"'auto', 'none' or a preset in {sorted(hw_lib.HARDWARE)}")

  @property
  def critic_model(self) -> ModelConfig:
    return self.model.replace(head="scalar")

  @property
  def cache_len(self) -> int:
    return self.prompt_len + self.max_new_tokens

  def resolve_hardware(self, device_kind: str) -> hw_lib.Hardware | None:
    """The peak figures to compare with: the named preset, the one matching device_kind
    ("auto"), or None (no preset matches, or "none")."""
    if self.hardware == "none":
      return None
    if self.hardware == "auto":
      return hw_lib.hardware_for_device_kind(device_kind)
    return hw_lib.get_hardware(self.hardware)

  @classmethod
  def from_config_dict(cls, cd: Any) -> "BenchDecodeConfig":
    d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
    model = dict(d.pop("model", {}) or {})
    known_model = {f.name for f in dataclasses.fields(ModelConfig)} - {"head"}
    unknown = set(model) - known_model
    if unknown:
      raise ValueError(f"config.model: unknown fields {sorted(unknown)}; known: "
                       f"{sorted(known_model)}")
    # (ModelConfig's own TypeError, "missing 1 required positional argument", named no section)
    required = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "head" and
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing_model = [f for f in required if f not in model]
    if missing_model:
      raise ValueError(f"config.model: missing fields {missing_model}; expected a value for each "
                       "(they have no default)")
    known = {f.name for f in dataclasses.fields(cls)} - {"model"}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"config: unknown fields {sorted(unknown)}; known: {sorted(known)}")
    missing = known - set(d)
    if missing:
      raise ValueError(f"config: missing fields {sorted(missing)}")
    for name, example in (("batch_sizes", "1,16,128"), ("capacities", "512,4096"),
                          ("scan_compile_layers", "22,44")):
      raw = d[name]
      try:
        d[name] = tuple(int(x) for x in (
            (raw.split(",") if raw.strip() else []) if isinstance(raw, str) else raw))
      except ValueError:
        raise ValueError(f"config.{name}={raw!r}: expected comma-separated integers, "
                         f"e.g. '{example}'") from None
    return cls(model=ModelConfig(**model, head="lm"), **d)
