"""First-principles cost of every operation of an RLHF iteration (seconds, bytes, FLOPs).

Roofline: an operation takes max(FLOPs / (devices * peak * mfu), bytes / (devices * hbm_bw *
bw_eff)) plus its collectives. Prefill, inference and training are compute bound at their MFU;
decode is bandwidth bound (every step reads the weights and the KV cache), until a large batch
makes its matmuls compute bound. Formulas (P = parameters, L = layers, h = hidden size, t = tensor
parallel degree, FLOPs from shapes.py):

  decode step (b live rows, C KV tokens held in total):
      bytes = weight_bytes/t + C * kv_bytes_per_token/t
      flops = (2 * matmul_params * b + 4 * L * heads * head_dim * C) / t
      time  = (max(flops/(peak*decode_mfu), bytes/(hbm_bw*decode_bw_eff)) + 2L all-reduces of
              b*h*a bytes over t devices (Megatron tensor parallel: after attention, after MLP;
              a = act_itemsize, 2 bytes, 4 for a float32 run's))
              * (1 + decode_host_overhead)
  prefill / inference forward of sequences (lengths l_i):
      flops = sum_i forward_flops(l_i, (l_i+1)/2) / t; time = roofline at prefill_mfu
              + 2L all-reduces of sum(l_i)*h*a bytes
  training stage, one micro-batch of n tokens, pp stages: forward = roofline over L/pp layers at
      train_mfu + its tensor-parallel all-reduces; backward = bwd_over_fwd (2) x the forward's
      compute + the same all-reduces once (no recomputation timed)
  collectives, alpha-beta (hardware.py): ring all-reduce of B bytes over g devices moves
      2(g-1)/g * B through each device in 2(g-1) ring steps; all-gather / reduce-scatter
      (g-1)/g * B in g-1 steps; point-to-point (KV migration, weight resharding) B in 1 step.
      time = min over NCCL's protocols of base + steps inside nodes * intra_step + steps across
      nodes * inter_step + bytes / (bw * net_eff * protocol's bandwidth fraction), with NCCL's
      step counts (an all-reduce spanning n > 1 nodes: 2n steps cross them). bw is the fast
      link while the group fits in one node, otherwise min(fast link, the group's members per
      node x each one's NIC) (hardware.link_bw: one ring channel per NIC). Presets without
      protocols (TPU): bytes / (bw * net_eff) + collective_latency_s. A point-to-point hop
      crosses nodes where the layout puts its ends in two (same_node, crossing_share).
  optimizer step: 28 bytes/param touched (fp32 master, m, v read+write, bf16 grad read and weight
      write) over the device's parameter shard, at hbm_bw*decode_bw_eff.
Memory (per device, bytes): weights bf16 (2/param; a train_config's models at their
param_dtype: ModelShape.weight_itemsize); training adds grads of the weights' dtype and Adam fp32
master+m+v (12, divided by dp with ZeRO-1; m+v, 8, for fp32 weights: no master copy);
activations 34*h bytes per token per layer / t at 16 bits, x a/2 at the shape's compute dtype
(ModelShape.act_itemsize: a float32 run's twice; 16-bit for every shape until 2026-12-04)
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Table 2: tensor + sequence parallel + selective recomputation, i.e. the attention scores not
kept, as flash attention does; nothing else recomputed); KV cache kv_bytes_per_token per
token. A plan fits if its total is below hbm_bytes * memory_headroom.

Measured figures (calibration.py) replace the formula of the op they measure; a fitted decode
model (calibration op decode_fit, sim/decode_fit.py) instead adds fixed per-step and per-layer
costs to the decode roofline and replaces its efficiencies, for any model shape. The same engine
runs prefill and the reference / reward / critic forwards, one launch of every layer per pass,
so with a decode_fit each of those passes also pays step_s + layers * layer_s (its compute stays
at prefill_mfu: the fit's mfu is decode's, measured on single-token matmuls).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np

from rlhfuse_jax import fields
from rlhfuse_jax.policy.calibration import Calibration
from rlhfuse_jax.sim.hardware import Hardware
from rlhfuse_jax.sim.shapes import ModelShape

GIB = 2 ** 30

# Float32 copies of an LM head's logits [rows, response positions, vocab] a program holds at
# once, measured from XLA's memory_analysis of the compiled programs (XLA:CPU, jax 0.10.2,
# 2026-12-05; tests/test_sim_cost.py compiles both and checks these on every CI run): the
# scoring forward's log-probs (inference/scoring.response_logprobs) 1.0 (its temporaries were
# 1.002x one copy at vocab 32000-64000); the update's gradient of the log-probs and the entropy
# bonus (models/sequences.response_logprobs_and_entropy) 4.0 (4.04-4.08x: the logits, the
# log-softmax, the probabilities and the logits' gradient). The vocabulary splits over the
# tensor devices (parallel/mesh.LOGICAL_RULES), the update's copies too: the trainer's whole
# update (trainer/ppo.make_update_fn, both models and AdamW) on a tensor mesh of 1, 2 and 4
# devices held 4.000 float32 copies of each device's V/tp columns, measured as the temp
# bytes' difference over rows x vocabulary (4 -> 8 rows, 16384 -> 32768 columns, 64 response
# positions), which cancels the activations and the parameters (2026-12-07, XLA:CPU, jax
# 0.10.2; tests/test_sim_cost.py checks it at tensor 4 on every CI run).
LOGITS_COPIES_SCORING = 1.0
LOGITS_COPIES_UPDATE = 4.0

# The rollout's arrays the trainer keeps on the training devices from its advantages to the end
# of the update (trainer/loop.PPOTrainer._advantages; every mini-batch gathers its rows there),
# split over the batch axes: per sample the tokens [prompt + response] and the prompt length in
# int32, and ROLLOUT_FLOAT32_ROWS float32 rows [response] (mask, old and reference log-probs,
# old values, advantages, returns). Left out of the memory model, by the figure: at the RLHFuse
# setting (512 samples of 1,024 + 1,024 tokens) 16.8 MB for a whole batch on one device, 2.1 MB
# split over the 7B/13B plans' 8 data replicas: 0.02 % and 0.003 % of an H100's 80 GB; at
# configs/ppo_llama.py's longest sweep point (512 + 2,048 tokens), 30.4 MB unsplit (0.04 %).
ROLLOUT_FLOAT32_ROWS = 6


def rollout_bytes(samples: float, prompt_len: float, response_len: float,
                  batch_shards: int = 1) -> float:
  """Per device, the rollout's arrays kept through the update (ROLLOUT_FLOAT32_ROWS): `samples`
  of `prompt_len` + `response_len` tokens over `batch_shards` devices of the batch axes."""
  per_sample = 4.0 * (prompt_len + response_len + 1) + 4.0 * ROLLOUT_FLOAT32_ROWS * response_len
  return samples * per_sample / batch_shards


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of the datasheet peaks, and other non-datasheet constants.

  Defaults and their sources (a calibration file replaces them; which ones are assumptions
  is said):
    train_mfu 0.45: model-FLOP utilisation (our FLOP count: 3 x the forward, no recompute).
      Published and measured MFUs around it: MegaScale 55.2 % for 175B on 12,288 GPUs (Jiang et
      al. NSDI'24); ours on one H100, 1.1B, 16 x 512 tokens: 42.3 % and 44.3 % (experiments/
      results/h100_decode_variants, h100_pallas_decode train.mfu). Megatron-LM's 43-52 %
      (Narayanan et al. SC'21, Table 1) counts the recomputed forward too (their 96BslH^2 is 4
      forwards), so about 33-39 % as MFU. An assumption inside that range, not a measurement at
      the papers' scale.
    prefill_mfu 0.45: forward-only passes (prefill, reference/reward/critic); the same figure,
      an assumption; ours on one H100 (h100_pallas_decode prefill_mfu): 36 % at 16 prompts,
      47 % at 128.
    decode_bw_eff 0.7 / decode_mfu 0.45: an ASSUMPTION for a tuned engine at the papers' model
      sizes: no cited source gives the achieved HBM fraction of decode (the vLLM paper, Kwon et
      al. SOSP'23, analyses the bandwidth-bound regime but states no such figure). Ours on one
      H100 at 1.1B reach 14-31 % (XLA) and 33-49 % (Pallas) of peak, where per-layer fixed costs
      dominate (sim/decode_fit.py models them; the calibrated variant of configs/ablations.py
      uses that). The same fraction times the byte side of prefill, inference and training
      forwards and the optimizer step. The compute side matters only for large batches.
    net_eff 0.8: NCCL's own model caps a ring's bus bandwidth at 370 GB/s on Hopper and
      235 GB/s on Ampere (src/graph/tuning.cc, "Various model refinements"): 0.82 of H100's
      450 GB/s NVLink, 0.78 of A100's 300. Taken for the network links too (an assumption there).
    collective_latency_s 10e-6: fixed cost per collective call, used only on hardware without
      per-protocol latencies (the TPU presets; NVIDIA presets use NCCL's constants,
      hardware.NCCL_RING). An assumption, not a cited TPU figure: small all-reduces take a
      few to ~20 microseconds on NVLink in nccl-tests; decode issues 2 per layer per step.
  """
  train_mfu: float = 0.45
  prefill_mfu: float = 0.45
  decode_mfu: float = 0.45
  decode_bw_eff: float = 0.7
  net_eff: float = 0.8
  collective_latency_s: float = 10e-6
  # Usable fraction of HBM (allocator, workspace, fragmentation): vLLM's default
  # gpu_memory_utilization, 0.90 (vllm/engine/arg_utils.py, EngineArgs).
  memory_headroom: float = 0.9
  bwd_over_fwd: float = 2.0  # backward / forward time of a training micro-batch
  act_bytes_per_token_layer_per_h: float = 34.0  # activation bytes per token per layer, / h
  # Host time per decode step that the device waits for, as a fraction of the step's device
  # time (scheduling, input preparation, reading the sampled tokens back). 0: hidden behind the
  # device, as engines that overlap it do (vLLM's multi-step scheduling and async output
  # processing, v0.6+). The `vllm_sync` variant of configs/ablations.py sets 29/38 = 0.76:
  # vLLM v0.5.3 on Llama-3-8B, one H100, spent 29 % of the time scheduling against 38 % on the
  # GPU ("vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction", vLLM blog,
  # 2024-09-05; the other 33 % was the HTTP server, which offline RLHF generation has not).
  decode_host_overhead: float = 0.0

  def __post_init__(self):
    for f in dataclasses.fields(self):  # (a config file's "0.4" failed as a TypeError of '<')
      v = getattr(self, f.name)
      fields.check(fields.is_numeric(v), f"efficiency.{f.name}", v, "a number")
    for f in ("train_mfu", "prefill_mfu", "decode_mfu", "decode_bw_eff", "net_eff",
              "memory_headroom"):
      v = getattr(self, f)
      if not 0 < v <= 1:
        raise ValueError(f"config.efficiency.{f}={v} must be in (0, 1]")
    # `not x >= 0` rather than `x < 0`: a NaN (or an infinity) slipped through, and a NaN
    # activation size passed every memory check (NaN > usable is False).
    for f, low in (("collective_latency_s", 0.0), ("bwd_over_fwd", None),
                   ("act_bytes_per_token_layer_per_h", None)):
      v = getattr(self, f)
      if not (math.isfinite(v) and (v >= low if low is not None else v > 0)):
        raise ValueError(f"config.efficiency.{f}={v} must be a finite number "
                         + (f">= {low:g}" if low is not None else "> 0"))
    if not 0 <= self.decode_host_overhead < 10:
      raise ValueError(f"config.efficiency.decode_host_overhead={self.decode_host_overhead} must "
                       "be a fraction of the decode step's device time in [0, 10)")


# Each Efficiency default's source in a line, for the reports' tables (the docstring above
# has the detail).
EFFICIENCY_SOURCES = {
    "train_mfu": "assumption inside published MFUs (MegaScale 55 %; Megatron-LM SC'21 about "
                 "33-39 %; ours 42-44 % on one H100)",
    "prefill_mfu": "assumption: train_mfu's figure (ours 36-47 % on one H100)",
    "decode_mfu": "assumption: train_mfu's figure (the compute side of large decode batches)",
    "decode_bw_eff": "assumption for a tuned engine, no published figure (ours 14-49 % at 1.1B)",
    "net_eff": "NCCL's cap on a ring's bus bandwidth (src/graph/tuning.cc: 370 of 450 GB/s)",
    "collective_latency_s": "assumption; used only without the hardware's collective_protocols",
    "memory_headroom": "vLLM's default gpu_memory_utilization",
    "bwd_over_fwd": "backward = 2 x the forward's FLOPs (Narayanan et al. SC'21)",
    "act_bytes_per_token_layer_per_h": "Korthikanti et al. 2022: 34 s*b*h bytes a layer, no "
                                       "recomputation",
    "decode_host_overhead": "0: overlapped (vLLM v0.6+); configs/ablations.py:vllm_sync sets "
                            "29/38 (vLLM blog, 2024-09-05)",
}


class CostModel:
  """Costs of RLHF operations on one hardware preset (formulas in the module docstring)."""

  def __init__(self, hw: Hardware, eff: Efficiency = Efficiency(),
               calibration: Optional[Calibration] = None):
    self.hw, self.eff, self.cal = hw, eff, calibration
    self._formulas: Optional["CostModel"] = None

  def formulas(self) -> "CostModel":
    """This hardware and these efficiencies without the calibration: what scales a measured
    time from the layout it was measured at to another (train_stage_fwd_s;
    stage_cost)."""
    if self.cal is None:
      return self
    if self._formulas is None:
      self._formulas = CostModel(self.hw, self.eff)
    return self._formulas

  def measures(self, op: str) -> bool:
    """Whether the calibration's measured times of the whole measured model replace the
    formulas of `op` (decode_step_s: its decode_step table; prefill_s, inference_s: their
    rates): the times of that model only, which a pipeline stage of it scales
    (stage_cost)."""
    field = {"decode_step_s": "decode_step", "prefill_s": "prefill",
             "inference_s": "inference"}[op]
    return self.cal is not None and getattr(self.cal, field) is not None

  @property
  def shares_compute(self) -> bool:
    """Whether the calibration was measured on devices that share one processor (fake CPU
    devices): the simulated devices then run one task at a time, in generation_sim (its _Clock)
    and plan_search's pipelines and inference stage alike (plan_search ran those side by side
    while instance generation was serialised: with calibrate_sim's file it charged instances
    5x what a pipeline of the same work cost, and chose the pipeline for it)."""
    return bool(self.cal is not None and self.cal.devices_share_compute)

  def decode_width_error(self, tp: int) -> Optional[str]:
    """Why the calibration's decode_step table cannot time an instance of `tp` devices (it
    times the instance width it was measured at only), or None."""
    measured_tp = self.cal.instance_devices if self.measures("decode_step_s") else None
    if measured_tp is None or measured_tp == tp:
      return None
    return (f"calibration {self.cal.path or self.cal.device!r}: its decode_step table was "
            f"measured on instances of {measured_tp} device(s) (instance_devices) and cannot "
            f"time an instance of tp={tp}; measure at that width, or give a decode_fit "
            "(per layer and per FLOP, any width) instead of the table")

  def _at_width(self, t: float, op: str, shapes, tp: int, lengths: np.ndarray) -> float:
    """A measured prefill or inference time `t` (op's, of the instance width the calibration
    measured: instance_devices) at `tp` devices: times the formulas' ratio of the two widths,
    as a measured training stage is scaled (train_stage_fwd_s); as measured where the file
    does not say its width. (Taken as measured, inference cost the same at tp 1, 2 and 4.)"""
    measured_tp = self.cal.instance_devices
    if measured_tp is None or measured_tp == tp:
      return t
    f = self.formulas()
    now, then = (getattr(f, op)(shapes, width, lengths) for width in (tp, measured_tp))
    return t * now / then if then > 0 else t

  # --------------------------------------------------------------------- building blocks
  def roofline_s(self, flops: float, nbytes: float, devices: int, mfu: float,
                 bw_eff: float) -> float:
    return np.maximum(flops / (devices * self.hw.peak_flops * mfu),
                      nbytes / (devices * self.hw.hbm_bw * bw_eff))

  def _ring_s(self, wire_bytes, steps: int, inter_steps: int, bw: float,
              allreduce: bool = False):
    """A collective moving `wire_bytes` through each device in `steps` ring steps, of which
    `inter_steps` cross nodes, on links of `bw` bytes/s (module docstring)."""
    protocols = self.hw.collective_protocols
    if not protocols:
      return wire_bytes / bw + self.eff.collective_latency_s
    inter_steps = min(inter_steps, steps)

    def fraction(p):  # NCCL's LL: 1/4 for all-reduce or across nodes, 1/3 otherwise
      in_node = not allreduce and inter_steps == 0
      return p.bw_fraction_in_node if in_node and p.bw_fraction_in_node else p.bw_fraction
    return functools.reduce(np.minimum, [
        p.base_s + (steps - inter_steps) * p.intra_step_s + inter_steps * p.inter_step_s +
        wire_bytes / (bw * fraction(p)) for p in protocols])

  def _allreduce_over(self, nbytes, ranks: int, nodes: int, bw: float):
    """Ring all-reduce of `nbytes` over `ranks` devices spread over `nodes` nodes."""
    if ranks <= 1:
      return 0.0
    return self._ring_s(2.0 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1),
                        2 * nodes if nodes > 1 else 0, bw * self.eff.net_eff, allreduce=True)

  def allreduce_s(self, nbytes: float, group: int) -> float:
    """Ring all-reduce of `nbytes` over `group` consecutive devices."""
    return self._allreduce_over(nbytes, group, self.hw.nodes_spanned(group),
                                self.hw.link_bw(group))

  def _allgather_over(self, nbytes_total, ranks: int, nodes: int, bw: float):
    if ranks <= 1:
      return 0.0
    return self._ring_s((ranks - 1) / ranks * nbytes_total, ranks - 1, nodes - 1,
                        bw * self.eff.net_eff)

  def allgather_s(self, nbytes_total: float, group: int) -> float:
    """All-gather (or reduce-scatter) of a `nbytes_total` buffer over `group` devices."""
    return self._allgather_over(nbytes_total, group, self.hw.nodes_spanned(group),
                                self.hw.link_bw(group))

  def group_collective_s(self, kind: str, nbytes: float, members: Sequence[int]) -> float:
    """One collective of a compiled program (perf/hlo_flops.Collective: `nbytes` per device in
    NCCL's sense) over the devices `members` (consecutive numbering; any layout): the ring
    formulas above, with the nodes the members occupy and min(fast link, the fewest members
    any node has x one NIC each) across nodes. all-to-all moves (g-1)/g of its buffer, as an
    all-gather. (collective-permute is a point-to-point hop: p2p_s.)"""
    per_node = collections.Counter(d // self.hw.devices_per_node for d in members)
    nodes = len(per_node)
    ranks = len(members)
    # Across nodes each byte leaves every node through its members' NICs: the node with the
    # fewest members sets the pace (for the even groups XLA makes, any node's count).
    bw = (self.hw.intra_node_bw if nodes <= 1 else
          min(self.hw.intra_node_bw, min(per_node.values()) * self.hw.inter_node_bw))
    if kind == "all-reduce":
      return self._allreduce_over(nbytes, ranks, nodes, bw)
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
      return self._allgather_over(nbytes, ranks, nodes, bw)
    raise ValueError(f"unknown collective kind {kind!r}")

  def p2p_s(self, nbytes: float, cross_node: bool) -> float:
    bw = (self.hw.inter_node_bw if cross_node else self.hw.intra_node_bw) * self.eff.net_eff
    return self._ring_s(nbytes, 1, int(cross_node), bw)

  def hop_s(self, nbytes: float, crossing: float):
    """Mean point-to-point time of a chain's hops, `crossing` of which cross nodes
    (crossing_share)."""
    if crossing <= 0:
      return self.p2p_s(nbytes, False)
    if crossing >= 1:
      return self.p2p_s(nbytes, True)
    return crossing * self.p2p_s(nbytes, True) + (1 - crossing) * self.p2p_s(nbytes, False)

  def _tp_comm_s(self, shape: ModelShape, tp: int, tokens: float, layers: float) -> float:
    return 2.0 * layers * self.allreduce_s(tokens * shape.hidden_size * shape.act_itemsize, tp)

  # --------------------------------------------------------------------- generation
  def decode_step_s(self, shape: ModelShape, tp: int, batch, context_tokens):
    """One decode step of an instance of `tp` devices with `batch` live rows holding
    `context_tokens` KV tokens in total. Scalars or equal-shape arrays (one entry per step)."""
    batch = np.asarray(batch, dtype=np.float64)
    context_tokens = np.asarray(context_tokens, dtype=np.float64)
    if self.measures("decode_step_s"):
      width = self.decode_width_error(tp)
      if width:
        raise ValueError(width)
      out = self.cal.decode_step.step_s(batch, context_tokens)
    else:
      fit = self.cal.decode_fit if self.cal is not None else None
      flops, nbytes = decode_step_work(shape, batch, context_tokens)
      if fit is not None:  # fitted fixed costs and efficiencies (calibration.DecodeFit)
        out = (fit.step_s + shape.num_layers * fit.layer_s +
               self.roofline_s(flops, nbytes, tp, fit.mfu, fit.bw_eff))
        out = out + self._tp_comm_s(shape, tp, batch, shape.num_layers)
      else:  # assumed efficiencies, plus the host time an engine does not hide
        out = (self.roofline_s(flops, nbytes, tp, self.eff.decode_mfu, self.eff.decode_bw_eff) +
               self._tp_comm_s(shape, tp, batch, shape.num_layers))
        out = out * (1.0 + self.eff.decode_host_overhead)
    return np.where(batch > 0, out, 0.0)

  def prefill_s(self, shape: ModelShape, tp: int, lengths: Sequence[float]) -> float:
    """Prefill of prompts with these lengths on one instance."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
      return 0.0
    if self.measures("prefill_s"):
      return self._at_width(self.cal.prefill.seconds(float(lengths.sum())), "prefill_s", shape,
                            tp, lengths)
    return self._forward_s(shape, tp, lengths, self.eff.prefill_mfu)

  def _forward_s(self, shape: ModelShape, tp: int, lengths: np.ndarray, mfu: float) -> float:
    """One forward pass over sequences of `lengths` on the generation engine (prefill, and
    the reference / reward / critic inference)."""
    n = float(lengths.sum())
    flops = float(np.sum(shape.forward_flops(lengths, (lengths + 1) / 2.0)))
    fit = self.cal.decode_fit if self.cal is not None else None
    fixed = fit.step_s + shape.num_layers * fit.layer_s if fit is not None else 0.0
    return (fixed + self.roofline_s(flops, shape.weight_bytes(), tp, mfu, self.eff.decode_bw_eff)
            + self._tp_comm_s(shape, tp, n, shape.num_layers))

  def inference_s(self, shapes: Sequence[ModelShape], tp: int, lengths: Sequence[float]) -> float:
    """Reference / reward / critic forward passes (`shapes`) over full sequences."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
      return 0.0
    if self.measures("inference_s"):
      return self._at_width(self.cal.inference.seconds(float(lengths.sum())), "inference_s",
                            shapes, tp, lengths)
    return sum(self._forward_s(s, tp, lengths, self.eff.prefill_mfu) for s in shapes)

  def kv_migration_s(self, nbytes: float, tp: int, cross_node: bool, itemsize: int) -> float:
    """KV rows of `nbytes` (all tensor-parallel shards together; `itemsize` bytes an element,
    the shape's kv_itemsize) between two instances; the t shard pairs move in parallel. A
    calibration's rate counts its own byte unit (Calibration.rate_bytes)."""
    if nbytes <= 0:
      return 0.0
    if self.cal is not None and self.cal.migration is not None:
      return self.cal.migration.seconds(self.cal.rate_bytes(nbytes, itemsize))
    return self.p2p_s(nbytes / tp, cross_node)

  def weight_load_s(self, shapes: Sequence[ModelShape], devices: int) -> float:
    """Host -> device copy of the weights of `shapes` (offloaded frozen models), each device
    of `devices` its share, at each shape's weight_itemsize (a calibration's rate counts its own
    byte unit: Calibration.rate_bytes)."""
    if self.cal is not None and self.cal.weight_load is not None:
      return self.cal.weight_load.seconds(sum(
          self.cal.rate_bytes(s.weight_bytes(), s.weight_itemsize) for s in shapes) / devices)
    if self.hw.host_to_device_bw is None:
      raise ValueError(f"hardware {self.hw.name!r} has no host_to_device_bw: set "
                       "config.sim.offload_frozen=False (frozen models stay on the devices)")
    return sum(s.weight_bytes() for s in shapes) / devices / self.hw.host_to_device_bw

  # --------------------------------------------------------------------- training
  def train_stage_fwd_s(self, shape: ModelShape, tp: int, pp: int, mb_tokens: float,
                        mean_context: float, model: str = "actor") -> float:
    """Forward of one micro-batch of `mb_tokens` tokens on one of `pp` pipeline stages. A
    calibration's measured forward, at another layout than it was measured at (its tokens and
    seq_len, on instance_devices devices, one stage or its per-stage lists' count) scaled by
    the formulas' ratio of the two layouts: taken as it is, a 1.1B model's forward measured on
    8 x 512 tokens timed a 1-sample micro-batch and a quarter of the model (tp 2 x pp 2) alike,
    and a plan search with the file preferred tp 1, pp 1 (2026-12-05 review)."""
    if self.cal is not None and self.cal.train_stage is not None:
      ts = self.cal.train_stage
      per_stage = getattr(ts, f"{model}_fwd_per_stage_s")
      if per_stage is not None and len(per_stage) != pp:  # a stage of another split
        raise ValueError(
            f"calibration {self.cal.path or self.cal.device!r}: its train_stage was measured "
            f"with the {model} in {len(per_stage)} pipeline stages and cannot time a stage of "
            f"pp={pp} (another share of the layers); measure at that split, or leave "
            "train_stage out so that the formulas time every split")
      measured = ts.actor_fwd_s if model == "actor" else ts.critic_fwd_s
      if ts.tokens is None:  # (a file before the layout was recorded: every layout alike)
        return measured
      f = self.formulas()
      at = f.train_stage_fwd_s(shape, self.cal.instance_devices or 1,
                               len(per_stage) if per_stage is not None else 1, ts.tokens,
                               (ts.seq_len + 1) / 2.0)
      return measured * f.train_stage_fwd_s(shape, tp, pp, mb_tokens, mean_context) / at
    flops = shape.forward_flops(mb_tokens, mean_context) / pp
    nbytes = shape.weight_bytes() / pp
    return (self.roofline_s(flops, nbytes, tp, self.eff.train_mfu, self.eff.decode_bw_eff) +
            self.train_stage_comm_s(shape, tp, pp, mb_tokens))

  def train_stage_comm_s(self, shape: ModelShape, tp: int, pp: int, mb_tokens: float) -> float:
    """The tensor-parallel all-reduces in train_stage_fwd_s (two per layer, Megatron's g after
    attention and after the MLP); 0 where the calibration measured the stage whole."""
    if self.cal is not None and self.cal.train_stage is not None:
      return 0.0
    return self._tp_comm_s(shape, tp, mb_tokens, shape.num_layers / pp)

  def train_stage_bwd_s(self, fwd_s: float, model: str = "actor", comm_s: float = 0.0) -> float:
    """Backward of the micro-batch whose forward takes `fwd_s`, `comm_s` of it tensor-parallel
    all-reduces (train_stage_comm_s): the calibration's measured `{model}_bwd_s` where it has
    one (the executor's recompute + vjp, head and loss included), else bwd_over_fwd x the
    forward's compute plus the same all-reduces once: Megatron's backward has as many as its
    forward (f's conjugate all-reduces the input gradients of the column-parallel layers;
    Shoeybi et al. 2019, Fig. 3), so they are not scaled with the compute."""
    ts = self.cal.train_stage if self.cal is not None else None
    measured = getattr(ts, f"{model}_bwd_s", None) if ts is not None else None
    if measured is not None:
      if ts.tokens is None:
        return float(measured)
      # At the forward's layout: scaled as train_stage_fwd_s scaled the measured forward.
      return float(measured) * fwd_s / getattr(ts, f"{model}_fwd_s")
    return self.bwd_from_fwd_s(fwd_s, comm_s)

  def bwd_from_fwd_s(self, fwd_s: float, comm_s: float = 0.0) -> float:
    """bwd_over_fwd x the forward's compute plus its `comm_s` of all-reduces once
    (train_stage_bwd_s without a measured backward)."""
    return self.bwd_over_fwd() * (fwd_s - comm_s) + comm_s

  def bwd_over_fwd(self) -> float:
    if self.cal is not None and self.cal.train_stage is not None:
      return self.cal.train_stage.bwd_over_fwd
    return self.eff.bwd_over_fwd

  def grad_sync_s(self, shape: ModelShape, tp: int, pp: int, dp: int) -> float:
    """Data-parallel all-reduce of one device's gradient shard (bf16, or shape.weight_itemsize)
    (layout: tp innermost, then dp, so the dp group spans tp*dp consecutive devices)."""
    nbytes = shape.weight_bytes() / (tp * pp)
    nodes = min(dp, self.hw.nodes_spanned(tp * dp))  # dp ranks tp apart
    return self._allreduce_over(nbytes, dp, nodes, self.hw.link_bw(dp, stride=tp))

  def optimizer_step_s(self, shape: ModelShape, devices_sharing: int) -> float:
    return 28.0 * shape.num_params() / devices_sharing / (self.hw.hbm_bw * self.eff.decode_bw_eff)

  # --------------------------------------------------------------------- memory
  @property
  def usable_bytes(self) -> float:
    return self.hw.hbm_bytes * self.eff.memory_headroom

  def activation_bytes(self, shape: ModelShape, tp: int, tokens: float, layers: float) -> float:
    """34*h bytes per token and layer of 16-bit activations, scaled to the shape's compute dtype
    (ModelShape.act_itemsize: a float32 run's twice; until 2026-12-04 16-bit whatever the
    dtype, half of a float32 program's)."""
    return (self.eff.act_bytes_per_token_layer_per_h * shape.act_itemsize / 2.0
            * shape.hidden_size * tokens * layers / tp)

  def check_fits(self, what: str, need_bytes: float, detail: str) -> None:
    """Raises a ValueError naming the plan when `need_bytes` exceeds the usable HBM."""
    if need_bytes > self.usable_bytes:
      raise ValueError(
          f"{what} does not fit in memory: needs {need_bytes / GIB:.1f} GiB per device > "
          f"{self.usable_bytes / GIB:.1f} GiB usable on {self.hw.name} "
          f"({self.eff.memory_headroom:.0%} of {self.hw.hbm_bytes / GIB:.1f} GiB); {detail}")

  def logits_bytes(self, shape: ModelShape, tp: int, rows: float, positions: float,
                   copies: float) -> float:
    """Per device, `copies` float32 copies of an LM head's logits for `rows` rows of
    `positions` head positions each, the vocabulary over `tp` devices (LOGITS_COPIES_*); 0 for
    a scalar head (critic, reward model)."""
    if shape.head != "lm":
      return 0.0
    return copies * 4.0 * rows * positions * shape.vocab_size / tp

  def train_memory_parts(self, shape: ModelShape, tp: int, pp: int, dp: int, zero1: bool,
                         mb_tokens: float, inflight: int, accumulate: bool = False,
                         head_rows: float = 0.0, head_positions: float = 0.0) -> dict:
    """Per device of a tp x pp x dp training layout of one model, bytes: {"weights" and
    "grads" (shape.weight_itemsize: bf16, or a run's param_dtype), "optimizer" (Adam's m and
    v, and any fp32 master copy: ModelShape.optimizer_bytes_per_param; over dp with ZeRO-1),
    "activations" (`inflight` micro-batches of `mb_tokens` tokens)}, with `accumulate`
    "grad accumulator": the float32 sums of the micro-batches' gradients, split like the
    weights (the trainer's unpipelined update over several micro-batches:
    training_sim.TrainPlan.accumulates), and for an LM head with `head_rows` "logits": its
    update's float32 logits of a micro-batch of that many rows at `head_positions` (the
    response's) positions, LOGITS_COPIES_UPDATE of them. They are the last stage's, which
    holds one micro-batch in flight: counted beyond what the first stage's `inflight` ones
    already add (until 2026-12-05 left out: at a 128k vocabulary, GBs)."""
    shard = shape.num_params() / (tp * pp)
    item = shape.weight_itemsize
    per_mb = self.activation_bytes(shape, tp, mb_tokens, shape.num_layers / pp)
    out = {"weights": item * shard, "grads": item * shard,
           "optimizer": shape.optimizer_bytes_per_param() * shard / (dp if zero1 else 1),
           "activations": inflight * per_mb}
    if accumulate:
      out["grad accumulator"] = 4.0 * shard
    # The busiest device: the first stage's inflight micro-batches, or the last stage's one
    # with the logits beside it.
    head = self.logits_bytes(shape, tp, head_rows, head_positions, LOGITS_COPIES_UPDATE)
    logits = max(0.0, head - (max(inflight, 1) - 1) * per_mb) if head else 0.0
    if logits:
      out["logits"] = logits
    return out

  def train_memory_bytes(self, shape: ModelShape, tp: int, pp: int, dp: int, zero1: bool,
                         mb_tokens: float, inflight: int, accumulate: bool = False,
                         head_rows: float = 0.0, head_positions: float = 0.0) -> float:
    return sum(self.train_memory_parts(shape, tp, pp, dp, zero1, mb_tokens, inflight,
                                       accumulate, head_rows, head_positions).values())


def stage_cost(cost: CostModel, op: str, stage, whole, *args):
  """cost.<op>(stage, *args) of a pipeline stage (`whole`: the model or models it is a stage
  of, in `stage`'s form). Where a calibration's measured times of the whole model replace op's
  formulas (CostModel.measures), they are scaled by the formulas' ratio of the stage to the
  whole model: taken as they are, each of a pp-stage pipeline's stages was charged the whole
  model's decode step, prefill and inference (pipelined generation at pp 2 cost twice the
  instances', 2026-12-05 review)."""
  t = getattr(cost, op)(stage, *args)
  if not cost.measures(op):
    return t
  f = cost.formulas()
  part = np.asarray(getattr(f, op)(stage, *args), dtype=np.float64)
  full = np.asarray(getattr(f, op)(whole, *args), dtype=np.float64)
  scaled = np.asarray(t, dtype=np.float64) * np.divide(part, full, out=np.zeros_like(part),
                                                        where=full > 0)
  return float(scaled) if np.ndim(scaled) == 0 else scaled


def decode_step_work(shape: ModelShape, batch, context_tokens):
  """(FLOPs, bytes) of one decode step: every weight read once, every live KV token once;
  2 x matmul params per row plus attention over the `context_tokens` KV tokens of all rows."""
  nbytes = shape.weight_bytes() + context_tokens * shape.kv_bytes_per_token()
  attn = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim_ * context_tokens
  return 2.0 * shape.matmul_params() * batch + attn, nbytes


def same_node(a: int, b: int, devices_per_node: int) -> bool:
  """Whether devices a and b (consecutive numbering) sit in one node."""
  return a // devices_per_node == b // devices_per_node


def crossing_share(stride: int, hops: int, devices_per_node: int, first: int = 0) -> float:
  """The share of the neighbour hops of a chain of `hops + 1` groups `stride` devices apart
  (group k's devices at k * stride + j, j < stride: pipeline stages, consecutive instances) that
  cross a node boundary. A hop's shards move in parallel and the next group waits for all of
  them, so a hop crosses if any of its shards does. `first`: the chain's first device (a model
  trained on the devices after another's)."""
  if hops <= 0:
    return 0.0
  stride = max(stride, 1)
  crossing = sum(any(not same_node(first + j + k * stride, first + j + (k + 1) * stride,
                                   devices_per_node)
                     for j in range(stride)) for k in range(hops))
  return crossing / hops
