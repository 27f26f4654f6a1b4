"""Inter-stage fusion (docs/architecture.md §2): sample-level generation on G instances, long-tail
consolidation with KV migration, and streaming inference on the freed instances.

One batch, step by step (`FusedGenerator.run`):

  1. Deal: sample b goes to instance b % G, slot b // G (as the simulator deals). Each instance
     prefills its slots; empty slots get budget 0 and are done at once.
  2. Rounds: every instance that still holds unfinished samples decodes one chunk of K steps
     (dispatched to all instances before any result is read, so disjoint sub-meshes run at the
     same time). The host then reads each instance's summary (done, generated, stop: 12 bytes
     per slot) and, for rows that just finished, their tokens and log-probs.
  3. Consolidation (fused mode): when the unfinished count U <= Rt * B, the shared policy
     `consolidation.plan_consolidation` picks the smallest set of instances that holds the U
     samples under slot and KV limits (each counted at prompt + max_new_tokens), keeping the
     instances with the most KV tokens. The other instances' samples move with their KV rows
     (gather, device_put, scatter; no recompute) and those instances are released. If nothing
     fits, nothing moves and the reason is logged.
  4. Streaming inference (fused mode): a finished sample joins the inference queue at once. An
     instance holding no unfinished sample (released, or its samples all done) loads the frozen
     models' weights from host memory (the critic's from its training devices, or a host copy:
     trainer/rollout.FusedStage._instance_ready) and runs full
     micro-batches of reference log-probs, critic values and reward-model scores while the tail
     still decodes; what is left runs when generation ends, one micro-batch per instance
     (those freed first, then the least loaded), on as many instances as it has micro-batches.

Baseline mode (`fuse=False`): the same instances and executables, no consolidation, and
inference only after the last sample finished (spread over the instances the same way). The
two modes produce the same tokens bitwise: a sample's tokens depend only on (prompt, uid,
iteration key) and all instances share one shape class.

Rounds are synchronous on the host, so decisions (which chunk consolidates, what moves) depend
only on the tokens, never on timing: with a fixed Rt the fusion metrics are deterministic too.

Host bookkeeping of a batch (`_Run`) is two pieces: a `SlotTable` (which sample sits in which
instance and slot, what each has generated, which finished, the migrations' moves) and an
`InferenceQueue` (finished samples waiting for inference, the instances freed for it and their
weight loads, micro-batching, the micro-batches in flight). The device states of the decoding
instances (`engine.DecodeState`, the per-sample budget inside) stay with `_Run`.

Several processes (jax.distributed): each process drives its own instances and keeps the whole
slot table and inference queue, made identical on every process by small all-gathers after each
round; a migration between two processes' instances is a collective both run
(generation/multihost.py; docs/architecture.md §2).

Config: `FusionFields` declares the fields the user's config.fusion (trainer/config.py
FusionConfig) and the engine's `FusedGenConfig` share, with their one validation.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, Union

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding

from rlhfuse_jax import fields as fields_lib
from rlhfuse_jax.policy import consolidation as policy
from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import instances as inst_lib
from rlhfuse_jax.generation import measure
from rlhfuse_jax.generation import multihost
from rlhfuse_jax.generation import sampling as sampling_lib
from rlhfuse_jax.generation.instances import FrozenModels, GenerationInstance
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.generation.timeline import ActivityLog, Timeline, combined_figures
from rlhfuse_jax.inference import stages as inf_stages
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.policy import rt as rt_choice
from rlhfuse_jax.policy.lengths import LengthHistogram

INFERENCE_MODELS = ("reference", "critic", "reward")
PER_INSTANCE_QUEUE = 2  # micro-batches queued on one free instance while the tail decodes
# How "auto" models one batch for a candidate Rt: rt_model(generator, calibration) returns a
# policy.rt.Simulate. The trainer plugs in the simulator's (trainer/rt_auto.py); the engine does
# not import the simulator (docs/architecture.md §7).
RtModel = Callable[["FusedGenerator", dict], rt_choice.Simulate]
RESIMULATE_GROWTH = 1.25  # "auto" re-simulates Rt once the length histogram grew by this factor


@dataclasses.dataclass(frozen=True)
class FusionFields:
  """The inter-stage fusion fields (docs/architecture.md §2) that the user's config.fusion
  (trainer/config.py FusionConfig) and the engine's FusedGenConfig share, declared and checked
  once, here. Errors name `config.<section>.<field>` and what was expected.

  0 in num_instances or slots means "automatic" only where AUTOMATIC_LAYOUT is set (config.fusion:
  the trainer's `fused_config` resolves it from the devices and the batch); the engine takes a
  resolved layout, >= 1.
  """
  num_instances: int = 0  # G generation instances; 0 (automatic): devices / instance_devices
  slots: int = 0  # S batch slots per instance; 0 (automatic): ceil(batch / num_instances)
  instance_devices: int = 1  # devices per instance (tensor parallel inside it when > 1)
  migration_threshold: Union[float, str] = "auto"  # Rt in [0, 1], or "auto" (simulated)
  max_consolidations: int = 1  # long-tail consolidations per batch (the simulator's default too)
  inference_micro_batch: int = 0  # samples per inference micro-batch on freed instances; 0: slots
  # Instances one inference micro-batch runs through: > 1 splits every inference model into
  # that many stages of whole layers, each held by one instance of a unit formed as instances
  # are freed (InferenceQueue), for models too large for one instance beside what its devices
  # keep (the plan's inference pp; the simulator's GenSetup.inference_pp). With several
  # processes a unit's instances are one process's (each process's instances divide by it).
  inference_pp: int = 1
  # Rows a migration moves at once, more in parts (instances.migration_buckets): the gathered
  # rows are a copy of that many slots' KV cache beside the cache on both instances, so this
  # bounds what a consolidation adds to an instance's memory (plan_check's `migrate`); 0: up to
  # the slots, which may double the cache.
  migration_rows: int = 8
  # Several processes (generation/multihost.py): where the per-round host exchanges run,
  # "host" (a CPU device of each process, so an exchange never waits for work queued on the
  # accelerators: the scoring on freed instances, an asynchronous update) or "devices" (every
  # device of every process, jax's process_allgather); and after how many seconds a collective
  # of the loop that has not completed (a peer died or hangs) ends the process (exit 69).
  exchange_on: str = "host"
  exchange_timeout_s: float = 600.0

  # Class attributes, not fields. The config section a user edits for these fields, named in
  # errors (FusedGenConfig makes it a field: "generation" in bench_generation).
  section = "fusion"
  AUTOMATIC_LAYOUT = False  # whether num_instances / slots may be 0 (automatic)

  def _fail(self, name: str, value: Any, expected: str):
    fields_lib.fail(f"{self.section}.{name}", value, expected)

  def _check_int(self, name: str, low: int, expected: str) -> None:
    v = getattr(self, name)
    if not isinstance(v, int) or v < low:
      self._fail(name, v, expected)

  def __post_init__(self):
    for name in ("num_instances", "slots"):
      if self.AUTOMATIC_LAYOUT:
        self._check_int(name, 0, "an integer >= 0 (0: automatic)")
      else:
        self._check_int(name, 1, "an integer >= 1")
    self._check_int("instance_devices", 1, "an integer >= 1")
    self._check_int("max_consolidations", 0, "an integer >= 0")
    self._check_int("inference_micro_batch", 0, "an integer >= 0 (0: slots)")
    self._check_int("inference_pp", 1, "an integer >= 1 (1: each instance scores alone)")
    self._check_int("migration_rows", 0, "an integer >= 0 (0: up to the slots)")
    rt = self.migration_threshold
    if isinstance(rt, str) and rt != "auto":
      # A ConfigDict field holding "auto" is a string field, so
      # --config.fusion.migration_threshold=0.2 arrives as "0.2": stored as the number.
      try:
        object.__setattr__(self, "migration_threshold", float(rt))
      except ValueError:
        pass
    rt_choice.resolve_threshold(self.migration_threshold, f"{self.section}.migration_threshold")
    if self.exchange_on not in multihost.EXCHANGE_ON:
      self._fail("exchange_on", self.exchange_on, f"one of {multihost.EXCHANGE_ON}")
    t = self.exchange_timeout_s
    # At most the longest wait Python's timers take: inf (meant as "never") was accepted, then
    # a multi-process run failed at its start converting it to the barrier's milliseconds
    # (OverflowError), and above TIMEOUT_MAX every collective's watchdog thread died.
    if (isinstance(t, bool) or not isinstance(t, (int, float)) or
        not 0 < t <= threading.TIMEOUT_MAX):
      self._fail("exchange_timeout_s", t, f"a number of seconds > 0 and <= "
                 f"{threading.TIMEOUT_MAX:.0f} (Python's longest timer)")

  def fusion_fields(self) -> dict:
    """{name: value} of the FusionFields fields (what FusedGenConfig.of copies)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(FusionFields)}


@dataclasses.dataclass(frozen=True)
class FusedGenConfig(FusionFields):
  """Layout and policy of the fused engine: the shared FusionFields (a resolved layout:
  num_instances and slots >= 1) plus the engine's own knobs."""
  kv_capacity_tokens: int = 0  # KV cache budget per instance in tokens; 0: slots * max_len
  # Cap on inference micro-batches running at once while the tail decodes; 0: no cap. (On 8
  # fake CPU devices a cap of 1, meant to leave the tail a core, measured no better than none:
  # the decode loop is latency bound and leaves the cores idle often enough.)
  inference_inflight: int = 0
  rt_candidates: tuple = rt_choice.DEFAULT_CANDIDATES  # Rt values "auto" simulates
  compile_threads: int = 4  # threads compiling the instances' executables at start-up
  # The config section a user edits for these fields, named in errors: "fusion" in train_ppo,
  # "generation" in bench_generation.
  section: str = "fusion"

  def __post_init__(self):
    super().__post_init__()
    self._check_int("compile_threads", 1, "an integer >= 1")
    self._check_int("inference_inflight", 0, "an integer >= 0 (0: no cap)")
    self._check_int("kv_capacity_tokens", 0, "an integer >= 0 (0: slots * max_len)")
    if not self.rt_candidates:
      self._fail("rt_candidates", self.rt_candidates, "at least one Rt in [0, 1]")
    # Stored as floats: 'auto' (which resolve_threshold accepts, as None) or a string such as
    # "0.3" reached choose_rt as is and failed there with a TypeError comparing it with 0.0.
    resolved = tuple(rt_choice.resolve_threshold(c, f"{self.section}.rt_candidates[]")
                     for c in self.rt_candidates)
    if None in resolved:
      self._fail("rt_candidates", self.rt_candidates, "numbers in [0, 1] ('auto' is none)")
    object.__setattr__(self, "rt_candidates", resolved)

  @classmethod
  def of(cls, fields: FusionFields, **kw) -> "FusedGenConfig":
    """The engine's config from config.fusion (or any FusionFields): its shared fields, then
    `kw` (the resolved num_instances and slots, the engine's own fields)."""
    return cls(**{**fields.fusion_fields(), **kw})

  @property
  def micro_batch(self) -> int:
    return self.inference_micro_batch or self.slots


@dataclasses.dataclass
class FusedOutput:
  """One batch generated and scored (host numpy, rows in the caller's batch order)."""
  rollout: engine.Rollout
  ref_logp: Optional[np.ndarray]  # [B, T] reference log-probs (None without a reference)
  values: Optional[np.ndarray]  # [B, T] critic values (None without a critic)
  rewards: Optional[np.ndarray]  # [B] reward-model scores (None without a reward model)
  timeline: Timeline
  consolidations: list  # one dict per executed plan
  rt: float  # the Rt used
  rt_choice: Optional[rt_choice.RtChoice]  # how "auto" chose it
  no_migration: list  # why a due consolidation moved nothing (distinct reasons, in order)
  metrics: dict  # gen/*, fusion/*, timing_s/* of docs/architecture.md §2 (_Run._execute)
  # [P, n] each process's Timeline.process_figures, which the per-instance metrics and the
  # stage times combine (figures_over_processes)
  by_process: list = dataclasses.field(default_factory=list)

  @property
  def overlap_figures(self) -> list:
    """[P, 3] each process's Timeline.overlap_figures; [] without inference models."""
    if "fusion/loaded_before_gen_end" not in self.metrics:
      return []
    return [row[:3] for row in self.by_process]


def check_layout(config: FusedGenConfig, batch_size: int, num_devices: int) -> None:
  """The instances fit the devices and a batch of `batch_size` dealt over them fits their
  slots: FusedGenerator's own check, also run by the trainer before it builds anything."""
  inst_lib.check_device_count(config.num_instances, config.instance_devices, num_devices,
                              config.section)
  if batch_size < 1:
    # 0 built a generator whose every run failed in numpy ("zero-size array to reduction").
    raise ValueError(f"generation batch_size={batch_size!r}: expected an integer >= 1")
  g, s = config.num_instances, config.slots
  per_inst = -(-batch_size // g)
  if per_inst > s:
    raise ValueError(f"config.{config.section}.slots={s}: {batch_size} samples dealt to "
                     f"num_instances={g} put {per_inst} in one instance; expected slots >= "
                     f"{per_inst}")
  pp = config.inference_pp
  if g % pp:
    raise ValueError(f"config.{config.section}.inference_pp={pp}: must divide num_instances={g} "
                     "(the freed instances score in units of that many)")
  mb = config.inference_micro_batch
  if mb > batch_size:
    # Each micro-batch is padded to this size with copies of its last sample: 1000 for a batch
    # of 16 ran every inference model on 1000 rows per micro-batch, and none started while the
    # tail decoded (the stream waits for a full one), without a word.
    raise ValueError(f"config.{config.section}.inference_micro_batch={mb}: expected at most "
                     f"the batch's {batch_size} samples (a micro-batch is padded to this size, "
                     f"and scoring starts while the tail decodes only once that many have "
                     f"finished; 0 takes the slots, {s}" + (")" if s <= batch_size else
                                                             ", more than the batch too)"))


class FusedGenerator:
  """G generation instances with AOT-compiled executables; runs batches fused or not."""

  def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, config: FusedGenConfig, *,
               batch_size: int, prompt_len: int, frozen: FrozenModels, actor_params: Any,
               frozen_params: dict, devices: Optional[Sequence[jax.Device]] = None,
               rt_model: Optional[RtModel] = None):
    self.max_len = inst_lib.check_model(cfg, sampling, prompt_len)
    self.cfg, self.sampling, self.config, self.frozen = cfg, sampling, config, frozen
    self.batch_size, self.prompt_len = batch_size, prompt_len
    devices = list(devices) if devices is not None else jax.devices()
    check_layout(config, batch_size, len(devices))
    g, s = config.num_instances, config.slots
    full = s * self.max_len
    self.kv_capacity = config.kv_capacity_tokens or full
    if self.kv_capacity < full:
      raise ValueError(f"config.{config.section}.slots={s} do not fit the KV cache: {s} slots "
                       f"x max_len={self.max_len} (prompt {prompt_len} + max_new_tokens "
                       f"{sampling.max_new_tokens}) = {full} tokens > config."
                       f"{config.section}.kv_capacity_tokens={config.kv_capacity_tokens}")
    meshes = inst_lib.split_devices(devices, g, config.instance_devices)
    self.instances = [GenerationInstance(i, m, cfg, sampling, slots=s, prompt_len=prompt_len,
                                         frozen=frozen, micro_batch=config.micro_batch,
                                         migration_rows=config.migration_rows,
                                         inference_pp=config.inference_pp)
                      for i, m in enumerate(meshes)]
    self.models = {n: c for n, c in zip(INFERENCE_MODELS, (frozen.reference, frozen.critic,
                                                           frozen.reward)) if c is not None}
    for n, c in self.models.items():
      inf_stages.check_split(c, config.inference_pp, f"config.{config.section}.inference_pp", n)
    missing = sorted(set(self.models) - set(frozen_params))
    if missing:
      raise ValueError(f"frozen_params lacks {missing} (shapes of the inference models)")
    self.fixed_rt = rt_choice.resolve_threshold(config.migration_threshold)  # None: "auto"
    if self.fixed_rt is None and rt_model is None:
      raise ValueError(f"config.{config.section}.migration_threshold='auto' needs a model to "
                       "simulate Rt with: pass rt_model=rlhfuse_jax.trainer.rt_auto."
                       "simulated_rt_model (or set a fixed threshold in [0, 1])")
    # Several processes: each drives (compiles, decodes on, scores on) its own instances; the
    # bookkeeping of all of them is global (generation/multihost.py).
    self.exchange = multihost.Exchange(config.exchange_timeout_s, config.exchange_on)
    self.owner = np.array([multihost.process_of(m.devices.flat, f"generation instance {i}",
                                                f"config.{config.section}.instance_devices")
                           for i, m in enumerate(meshes)])  # [G] process of each instance
    self.local = [i for i in range(g) if self.owner[i] == self.exchange.me]
    # Decided from the owners of all instances (the same on every process), so every process
    # stops here: checked by the process left without one alone, the others went on to compile
    # and then waited in their first exchange for a process that had left.
    idle = sorted(set(range(self.exchange.count)) - set(self.owner.tolist()))
    if idle:
      raise ValueError(f"config.{config.section}.num_instances={g} x instance_devices="
                       f"{config.instance_devices} leaves process(es) {idle} of "
                       f"{self.exchange.count} without an instance: every process must drive "
                       "at least one")
    per_process = np.bincount(self.owner, minlength=self.exchange.count)
    if (per_process % config.inference_pp).any():
      # A unit's instances hand hidden states to each other device to device, so they are one
      # process's (cross-host copies run as collectives: multihost.py); each process's
      # instances must then form whole units.
      raise ValueError(f"config.{config.section}.inference_pp={config.inference_pp}: must "
                       f"divide each process's instances ({per_process.tolist()}): a unit's "
                       "instances are one process's")
    if self.exchange.multi and config.inference_inflight:
      raise ValueError(f"config.{config.section}.inference_inflight={config.inference_inflight}"
                       " caps running micro-batches, which a process cannot see on another "
                       f"process's instances: expected 0 with {self.exchange.count} processes")
    self.transfer = multihost.CrossHostTransfer()
    # (treedef, shapes) -> place_actor's layouts of those params: made once (_actor_layouts)
    self._actor_layouts: dict = {}
    # Bytes of one sample's DecodeState row (KV cache and decode state; the same in every
    # instance, one shape class): what a migration copies per row, known to every process.
    st = self.instances[self.local[0]].state_abstract(actor_params)
    self.row_bytes = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(st)) // s
    inst_lib.compile_all([self.instances[i] for i in self.local], actor_params, frozen_params,
                         config.compile_threads)
    self.exchange.warm_up()  # after each process's compiles: the first round finds all there
    # KV bytes of one token of one sample (K and V, all layers), as KVCache.nbytes_per_token.
    itemsize = np.dtype(cfg.jnp_dtype).itemsize
    self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim_ * itemsize
    self.lengths = LengthHistogram(sampling.max_new_tokens)
    self.calibration: Optional[dict] = None  # measured costs (generation/measure.py)
    self.rt_model = rt_model
    self._rt_cache: Optional[tuple] = None  # (histogram total when simulated, RtChoice)
    self.inflight = config.inference_inflight

  @contextlib.contextmanager
  def history_kept(self):
    """Batches generated inside leave the Rt length histogram and the cached Rt choice as they
    were: a validation pass's responses are not the training batches' (without it, eval_every,
    which training never sees, changed the Rt that training batches were given)."""
    counts, cache = self.lengths.counts.copy(), self._rt_cache
    try:
      yield
    finally:
      self.lengths.counts, self._rt_cache = counts, cache

  def rt_state(self) -> dict:
    """What "auto" Rt has learnt that a checkpoint keeps: the training batches' length
    histogram and the cached choice with the histogram total it was made at (the measured
    costs are measured again on the devices of the next start)."""
    out = {"lengths": self.lengths.to_dict()}
    if self._rt_cache is not None:
      total, choice = self._rt_cache
      out["choice"] = {"total": int(total), "rt": float(choice.rt), "reason": choice.reason,
                       "simulated_s": [[float(k), float(v)]
                                       for k, v in choice.simulated_s.items()]}
    return out

  def load_rt_state(self, state: dict) -> None:
    """Restores `rt_state()`'s output: a resumed run chooses Rt from the lengths it has seen,
    and keeps the choice the run had cached until the histogram grows by RESIMULATE_GROWTH
    past it, as the run would have without the restart (until 2026-12-05 it simulated again
    at once). A state without a choice (or one from before it was kept) drops any cached one."""
    dropped = self.lengths.load_dict(state["lengths"])
    if dropped:
      logging.warning("Rt length histogram: %d lengths above max_new_tokens=%d dropped",
                      dropped, self.lengths.max_len)
    c = state.get("choice")
    self._rt_cache = None if c is None else (int(c["total"]), rt_choice.RtChoice(
        float(c["rt"]), str(c["reason"]), {float(k): float(v) for k, v in c["simulated_s"]}))

  def is_local(self, i: int) -> bool:
    """Whether this process drives instance i."""
    return int(self.owner[i]) == self.exchange.me

  # ------------------------------------------------------------------ Rt
  def measures_costs(self, fuse: bool = True) -> bool:
    """Whether the next run(fuse=fuse) (rt unset) measures the instances' costs first (Rt
    'auto', not yet measured): that needs every inference model's params in frozen_params,
    whatever its `models`."""
    return (fuse and self.config.max_consolidations != 0 and self.fixed_rt is None
            and self.calibration is None)

  def choose_rt(self, prompt_lens, auto: bool = False
                ) -> tuple[float, Optional[rt_choice.RtChoice]]:
    """The fixed Rt (unless `auto`), or the simulated choice. The simulation (~0.1-1 s) reruns
    only once the length histogram has grown by RESIMULATE_GROWTH since the last choice: a PPO
    iteration must not pay for it every time, and a few more lengths barely move the histogram.

    Several processes: each simulates with its own measured costs and every one takes
    process 0's Rt (broadcast), so the plans stay the same everywhere. Every process must call
    this at the same point (FusedGenerator.run does)."""
    if self.fixed_rt is not None and not auto:
      return self.fixed_rt, None
    self._require_rt_model("choose_rt(auto=True)")
    rt, choice = self._choose_rt(prompt_lens)
    if self.exchange.multi:
      agreed = self.exchange.broadcast_float(rt)
      if self.exchange.me != 0:
        choice = rt_choice.RtChoice(agreed, "process 0's choice (broadcast)", {})
      rt = agreed
    return rt, choice

  def _require_rt_model(self, what: str) -> None:
    """Raises, naming `what` asked for Rt 'auto', when this generator has no model to simulate
    Rt with (it has a fixed Rt)."""
    if self.rt_model is None:
      raise ValueError(f"{what} needs a model to simulate Rt with: build the FusedGenerator "
                       "with rt_model=rlhfuse_jax.trainer.rt_auto.simulated_rt_model (or pass "
                       "a fixed rt in [0, 1])")

  def _choose_rt(self, prompt_lens) -> tuple[float, rt_choice.RtChoice]:
    if self.calibration is None or self.lengths.total == 0:
      choice = rt_choice.RtChoice(rt_choice.PRIOR_RT, "no lengths or costs measured yet: the "
                                  "prior Rt", {})
      return choice.rt, choice
    last = self._rt_cache
    if last is None or self.lengths.total >= RESIMULATE_GROWTH * last[0]:
      choice = rt_choice.choose_rt(self.lengths, self.rt_model(self, self.calibration),
                                   prompt_lens, self.sampling.max_new_tokens,
                                   candidates=self.config.rt_candidates)
      self._rt_cache = last = (self.lengths.total, choice)
    return last[1].rt, last[1]

  # ------------------------------------------------------------------ one batch
  def _deal(self, prompt_tokens, prompt_lens, uids, budgets):
    g, s, p = self.config.num_instances, self.config.slots, self.prompt_len
    pad = self.sampling.pad_id
    per = []
    for i in range(g):
      rows = np.arange(i, self.batch_size, g)  # samples of instance i, slot = position
      tok = np.full((s, p), pad, np.int32)
      tok[:rows.size] = prompt_tokens[rows]
      lens = np.ones(s, np.int32)
      lens[:rows.size] = prompt_lens[rows]
      uid = np.zeros(s, np.int32)
      uid[:rows.size] = uids[rows]
      bud = np.zeros(s, np.int32)  # budget 0: empty slot, done after prefill
      bud[:rows.size] = budgets[rows]
      per.append((rows, tok, lens, uid, bud))
    return per

  def run(self, actor_params: Any, frozen_params: dict, prompt_tokens, prompt_lens,
          iteration_key, uids=None, budgets=None, fuse: bool = True,
          rt: Optional[float] = None, models: Optional[Sequence[str]] = None,
          observe: bool = True) -> FusedOutput:
    """Generates and scores one batch.

    actor_params: on any devices (copied onto every instance, timed separately), or a callable
      that returns them, called once just before they are placed (a copy made for this call,
      such as a pipelined trainer's gathered actor, is then freed once placed, not held to the
      end);
    frozen_params: {'reference'|'critic'|'reward': params} for the models in FrozenModels,
      kept where the caller holds them (host memory for frozen models) until an instance is
      freed for inference; prompt_tokens [B, <=P] right-padded, prompt_lens [B], uids [B]
      (default 0..B-1), budgets [B] per-sample response budgets (default max_new_tokens);
    fuse: False runs the baseline (no consolidation, inference after generation);
    rt: force this Rt for this batch (default: config.migration_threshold, "auto" simulated);
    models: the inference models to run on this batch, of those in FrozenModels (default: all;
      a validation pass needs the reward model's scores alone): the others are neither loaded
      nor run, their outputs None, and frozen_params may leave them out;
    observe: add the responses' lengths to the history "auto" Rt is simulated over (False for a
      batch already observed, run again: a benchmark's repeat).
    """
    tokens, plens, uids, budgets = inst_lib.check_prompts(
        self.batch_size, self.prompt_len, self.sampling, prompt_tokens, prompt_lens, uids, budgets,
        self.cfg.vocab_size)
    # Checked here too (the constructor checks the shapes it was given): a missing model was a
    # bare KeyError from the loader thread, after the whole batch had decoded.
    if models is not None and not set(models) <= set(self.models):
      raise ValueError(f"models={sorted(models)}: expected some of {sorted(self.models)} (the "
                       "inference models this generator was built with)")
    run_models = {n: c for n, c in self.models.items() if models is None or n in models}
    missing = sorted(set(run_models) - set(frozen_params))
    if missing:
      raise ValueError(f"frozen_params lacks {missing}: the generator scores with "
                       f"{sorted(run_models)}")
    forced = None if rt is None else rt_choice.resolve_threshold(rt, "rt")  # None: 'auto'
    if fuse and rt is not None and forced is None:
      # Checked before anything runs (choose_rt checks too, after the placement and the cost
      # measurement): the first batch took the prior Rt, and the second failed in choose_rt
      # with "'NoneType' object is not callable".
      self._require_rt_model("run(rt='auto')")
    # A callable's copy made before the placement's clock (the trainer times its gather apart:
    # timing_s/reshard) and dropped once placed.
    whole = actor_params() if callable(actor_params) else actor_params
    auto = rt is not None  # rt='auto' for this batch, whatever the config's Rt
    # "auto" simulates with this engine's measured costs: measured once, before timing.
    measure_now = (fuse and forced is None and self.config.max_consolidations != 0 and
                   (self.fixed_rt is None or auto) and self.calibration is None)
    if measure_now and set(self.models) - set(frozen_params):
      raise ValueError("measuring the instances' costs for migration_threshold='auto' "
                       f"needs every inference model's params ({sorted(self.models)}); "
                       f"frozen_params has {sorted(frozen_params)}")
    # Measured before the actor is placed: the measurement places its own copy on one instance
    # and drops it before it times the inference loads, as a run's freed instance does (placed
    # first, every instance's copy stayed while it timed them: a model that fits a run could
    # fail there, out of memory). An actor spread over several processes (a multi-host training
    # mesh) reaches the instances only by place_actor's collective reshard: measured after it,
    # beside the instance's copy.
    spread = any(isinstance(x, jax.Array) and not x.is_fully_addressable
                 for x in jax.tree.leaves(whole))
    if measure_now and not spread:
      self._measure(whole, frozen_params)
    t_place = time.perf_counter()
    actor_params = self.place_actor(whole)
    del whole
    jax.block_until_ready(list(actor_params.values()))
    place_s = time.perf_counter() - t_place
    if measure_now and spread:
      self._measure(actor_params, frozen_params)
    choice = None
    if not fuse:
      rt = 0.0
    elif forced is not None:
      rt = forced
    elif self.config.max_consolidations == 0:
      # Nothing is consolidated, whatever Rt: "auto" would measure the instances' costs and
      # simulate candidates for a threshold nothing reads (seconds to minutes on big models).
      if self.fixed_rt is not None and rt is None:  # a fixed Rt, and no 'auto' for this batch
        rt = self.fixed_rt
      else:
        choice = rt_choice.RtChoice(rt_choice.PRIOR_RT, "max_consolidations=0: nothing is "
                                    "consolidated, so Rt was not simulated", {})
        rt = choice.rt
    else:  # measured above where it had to be
      rt, choice = self.choose_rt(plens, auto=auto)
    run = _Run(self, actor_params, frozen_params, tokens, plens, uids, budgets,
               sampling_lib.as_typed_key(iteration_key), fuse, rt, place_s, run_models)
    del actor_params  # the run holds the instances' copies, and lets each go when it is done
    out = run.execute()
    out.rt_choice = choice
    if observe:
      self.lengths.add(out.rollout.response_lens)
    return out

  def _measure(self, actor_params: Any, frozen_params: dict) -> None:
    """self.calibration from measure.measure_costs, with progress lines."""
    t0 = time.perf_counter()
    logging.info("generation: measuring the instances' costs for migration_threshold='auto' "
                 "(once) ...")
    self.calibration = measure.measure_costs(self, actor_params, frozen_params)
    logging.info("generation: costs measured in %.1fs", time.perf_counter() - t0)

  def place_actor(self, params: Any) -> inst_lib.PlacedOnInstances:
    """The actor on each of this process's instances. From host memory or arrays on other
    devices, a put per instance (mesh_lib.put: device to device from devices). From arrays on
    the instances' own devices (the training mesh they were cut from), also spread over
    several processes (a multi-host training mesh), one reshard (collective: called by every
    process) onto a layout over all instances' devices (data = instances x tensor =
    instance_devices, each instance holding its tensor shards whole), whose local shards each
    process then takes as its instances' arrays: the weights move device to device, never
    through host memory."""
    leaves = jax.tree.leaves(params)
    spread = any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves)
    # On the instances' own devices (the training mesh they were cut from): one reshard of each
    # weight onto all of them too, not one per instance over every device (each redid the same
    # intermediate layout and copied half of it across).
    theirs = {d for inst in self.instances for d in inst.devices}
    on_them = all(isinstance(x, jax.Array) and x.sharding.device_set == theirs for x in leaves)
    if not (spread or on_them):
      return inst_lib.PlacedOnInstances(
          {i: self.instances[i].place(self.cfg, params) for i in self.local})
    on_grid, own = self._actor_layouts_of(params)
    everywhere = mesh_lib.put(params, on_grid)
    # Each instance's shards of `everywhere`, as arrays on its mesh. Every leaf's shards are
    # listed once, not once per instance, and the layouts are made once: remade every call,
    # the main job's place_actor (39 leaves, 8 instances) took 15.0 ms of host time, not 9.5.
    treedef, placed = jax.tree.structure(everywhere), {i: [] for i in own}
    for k, x in enumerate(jax.tree.leaves(everywhere)):
      held = {shard.device: shard.data for shard in x.addressable_shards}
      for i, layout in own.items():
        sharding, devices = layout[k]
        placed[i].append(jax.make_array_from_single_device_arrays(
            x.shape, sharding, [held[d] for d in devices]))
    return inst_lib.PlacedOnInstances(
        {i: jax.tree.unflatten(treedef, leaves) for i, leaves in placed.items()})

  def _actor_layouts_of(self, params: Any) -> tuple[Any, dict]:
    """(the shardings of `params` on the grid of all instances' devices: data = instances x
    tensor = instance_devices; {this process's instance: [(sharding, its addressable devices)]
    per leaf}), each instance holding its tensor shards whole. Made once per tree and shapes:
    the shardings follow from the shapes and the model's logical axes alone."""
    leaves, treedef = jax.tree.flatten(params)
    key = (treedef, tuple(np.shape(x) for x in leaves))
    if key not in self._actor_layouts:
      grid = mesh_lib.make_mesh(
          mesh_lib.MeshConfig(data=len(self.instances), tensor=self.config.instance_devices),
          [d for inst in self.instances for d in inst.devices])
      own = {i: jax.tree.leaves(self.instances[i].param_shardings(self.cfg, params))
             for i in self.local}
      everywhere = jax.tree.unflatten(treedef, [NamedSharding(grid, sh.spec)
                                                for sh in own[self.local[0]]])
      self._actor_layouts[key] = everywhere, {
          i: [(sh, list(sh.addressable_devices)) for sh in shardings]
          for i, shardings in own.items()}
    return self._actor_layouts[key]


class SlotTable:
  """Where each sample of one batch sits and what the host knows of it (host numpy only;
  docs/architecture.md §2). Sample b is row b of the caller's batch. slot_sample[i, s] is the
  sample in slot s of instance i, -1 for a slot never dealt or emptied by a migration; a slot is
  free when it holds no unfinished sample (a finished sample's entry stays until a migration
  writes over it: the consolidation plan sees the unfinished samples only)."""

  def __init__(self, num_instances: int, slots: int, batch_size: int, max_new_tokens: int,
               pad_id: int):
    b, t = batch_size, max_new_tokens
    self.where = np.zeros((b, 2), np.int64)  # [B] (instance, slot) of each sample
    self.dealt = np.full(b, -1, np.int64)  # [B] the instance each sample was dealt to
    self.slot_sample = np.full((num_instances, slots), -1, np.int64)  # [G, S] sample in each slot
    self.n_gen = np.zeros(b, np.int32)  # [B] response tokens so far
    self.finished = np.zeros(b, bool)  # [B]
    self.stop = np.zeros(b, np.int32)  # [B] engine.STOP_* of the finished samples
    self.resp = np.full((b, t), pad_id, np.int32)  # [B, T] responses of the finished samples
    self.logp = np.zeros((b, t), np.float32)  # [B, T] their behaviour log-probs

  def deal(self, i: int, samples: np.ndarray) -> None:
    """Puts `samples` [n] into slots 0..n-1 of instance i."""
    self.slot_sample[i, :samples.size] = samples
    self.where[samples, 0], self.where[samples, 1] = i, np.arange(samples.size)
    self.dealt[samples] = i

  def unfused_chunks(self, chunk_size: int) -> int:
    """The decode chunks summed over instances that the batch would have taken with nothing
    consolidated (the baseline, fuse=False): each instance decodes until the longest of its
    dealt samples ends, ceil((tokens - 1) / K) chunks after the prefill's first token."""
    total = 0
    for i in np.unique(self.dealt[self.dealt >= 0]):
      longest = int(self.n_gen[self.dealt == i].max())
      total += -(-max(longest - 1, 0) // chunk_size)
    return total

  @property
  def unfinished(self) -> int:
    return int(self.finished.size - self.finished.sum())

  def unfinished_in(self, i: int) -> list[int]:
    return [int(x) for x in self.slot_sample[i] if x >= 0 and not self.finished[x]]

  def observe(self, i: int, done, n) -> list[tuple[int, int]]:
    """Records instance i's summary (done [S], num_generated [S]) for its unfinished samples;
    returns (slot, sample) of those that just finished, whose rows `finish` then takes."""
    newly = []
    for slot, b in enumerate(self.slot_sample[i]):
      if b < 0 or self.finished[b]:
        continue
      self.n_gen[b] = n[slot]
      if done[slot]:
        newly.append((slot, b))
    return newly

  def finish(self, newly: list[tuple[int, int]], stop, tokens, logprobs) -> list[int]:
    """Marks the `newly` (slot, sample) pairs finished with their rows of stop [S] and tokens,
    logprobs [S, T]; returns the samples, in slot order."""
    for slot, b in newly:
      self.finished[b], self.stop[b] = True, stop[slot]
      self.resp[b], self.logp[b] = tokens[slot], logprobs[slot]
    return [int(b) for _, b in newly]

  def move(self, moves: Sequence[policy.Move]) -> None:
    """Records a consolidation plan's migrations: each sample leaves its source slot."""
    for m in moves:
      self.slot_sample[m.src_instance, m.src_slot] = -1
      self.slot_sample[m.dst_instance, m.dst_slot] = m.uid
      self.where[m.uid] = (m.dst_instance, m.dst_slot)


def _units(freed: Sequence[int], pp: int, owner: np.ndarray) -> list[tuple]:
  """Units of `pp` instances of the instances `freed`: each process's (`owner`: [G] the
  process of each instance) in the order they were freed, a partial one left out; the units
  ordered by their first instance's place in `freed`."""
  units = []
  for proc in dict.fromkeys(owner[i] for i in freed):
    mine = [i for i in freed if owner[i] == proc]
    units += [tuple(mine[k:k + pp]) for k in range(0, len(mine) - pp + 1, pp)]
  return sorted(units, key=lambda u: freed.index(u[0]))


class InferenceQueue:
  """Streaming inference of one batch (docs/architecture.md §2): the finished samples waiting
  for reference / critic / reward inference, the instances freed for it, micro-batching of the
  waiting samples onto them, and the micro-batches in flight. Inference weights are copied by a
  loader thread, so the host loop never waits for a load before dispatching the next decode
  chunk; results are read once, at the end (`collect`).

  With several processes every process keeps the whole queue (the waiting samples, the freed
  instances, which micro-batch goes where) and runs the micro-batches of its own instances; the
  assignment must then not depend on timing (`stream`).

  Micro-batches go to units: one freed instance each, or with config.inference_pp = pp > 1
  pipelines of pp instances (docs/architecture.md §2, "Inference on pipelines of instances"):
  the k-th instance freed of each group of pp, a process's own, holds stage k of every
  inference model and loads
  it as soon as it is freed; the unit scores once all its instances have loaded, each
  micro-batch passing through them in stage order (JAX runs the next micro-batch's first stage
  while the last stage is still busy: they are different devices). A unit is named by its
  first instance (`batches`, `dispatched`)."""

  def __init__(self, gen: "FusedGenerator", frozen_params: dict, table: SlotTable,
               prompts: np.ndarray, prompt_lens: np.ndarray, log: ActivityLog,
               models: Optional[dict] = None):
    self.gen, self.frozen_params, self.table, self.log = gen, frozen_params, table, log
    self._models = models  # FusedGenerator.run's `models`; None: all of the generator's
    self.prompts, self.plens = prompts, prompt_lens  # [B, P], [B]
    self.waiting: list[int] = []  # finished samples not yet dispatched, in finishing order
    # [instance, samples, {model: device array} or None] per micro-batch, in assignment order;
    # None: not dispatched yet (waits for its instance's weights) or another process's.
    self.batches: list = []
    self.pending: list[int] = []  # indices into batches of this process's undispatched ones
    self.freed: list[int] = []  # instances freed for inference, in order (all processes')
    self.pp = gen.config.inference_pp
    self.loads: dict = {}  # this process's instance -> Future of {model: params on it}
    self.loader = ThreadPoolExecutor(max_workers=1)
    self.dispatched = np.zeros(gen.config.num_instances, np.int64)  # micro-batches per instance

  @property
  def models(self) -> dict:
    """{name: ModelConfig} of the inference models this batch runs."""
    return self.gen.models if self._models is None else self._models

  def add(self, samples: list[int]) -> None:
    self.waiting.extend(samples)

  def free(self, i: int) -> None:
    """Instance i serves inference from now on: its weights start loading (once, on the
    process that drives it)."""
    if i not in self.freed:
      self.freed.append(i)
    if self.gen.is_local(i) and i not in self.loads:
      self.log.note(f"load_requested/{i}")  # the load's thread may start later on a busy host
      self.loads[i] = self.loader.submit(self._load, i)

  def _load(self, i: int) -> dict:
    """Frozen models from host memory, the critic from its training devices (a host copy with
    several processes or a pipelined update: trainer/rollout.FusedStage._instance_ready)."""
    t0, inst = self.log.now(), self.gen.instances[i]
    if self.pp > 1:  # this instance's stage of each (inference/stages.py)
      placed = {n: inst.place_stage(c, self.frozen_params[n], self.stage(i))
                for n, c in self.models.items()}
    else:
      placed = {n: inst.place(c, self.frozen_params[n]) for n, c in self.models.items()}
    self.log.record(i, "load", jax.tree.leaves(placed), since=t0)
    return placed

  @property
  def units(self) -> list[tuple]:
    """The complete units: each process's freed instances, pp at a time in the order they were
    freed (`_units`)."""
    return _units(self.freed, self.pp, self.gen.owner)

  def stage(self, i: int) -> int:
    """The stage freed instance i holds (0 with pp = 1): its place in its unit."""
    mine = [j for j in self.freed if self.gen.owner[j] == self.gen.owner[i]]
    return mine.index(i) % self.pp

  def _unit(self, u: int) -> tuple:
    """The instances of the unit named `u` (its first instance), in stage order."""
    return next(unit for unit in self.units if unit[0] == u)

  def _ready(self, u: int) -> bool:
    return self._loaded(self._unit(u))

  def _loaded(self, unit: tuple) -> bool:
    return all(self.loads[m].done() for m in unit)

  def loaded(self) -> list[int]:
    """This process's units whose instances all have their weights."""
    # (the units once: looked up by name for each, 1.8 ms a round at 64 instances)
    return [unit[0] for unit in self.units if self.gen.is_local(unit[0]) and self._loaded(unit)]

  def _assign(self, i: int, take: list[int]) -> None:
    """One micro-batch of samples `take` to instance i (run by `pump` on i's process)."""
    self.dispatched[i] += 1
    if self.gen.is_local(i):
      self.pending.append(len(self.batches))
    self.batches.append([i, take, None])

  def pump(self, block: bool) -> None:
    """Dispatches this process's assigned micro-batches, in order, whose unit has its
    weights and room (`_full`; all of them when `block`: waits for the loads and the room)."""
    left = []
    for n in self.pending:
      i, take, _ = self.batches[n]
      if block or (self._ready(i) and not self._full(i)):
        self.batches[n][2] = self._score(i, take)
      else:
        left.append(n)
    self.pending = left

  def _score(self, i: int, take: list[int]) -> dict:
    """One micro-batch of samples `take` on instance i (padded with copies of the last one,
    whose results are dropped), every inference model, dispatched without waiting."""
    mb, table = self.gen.config.micro_batch, self.table
    rows = np.asarray(take + [take[-1]] * (mb - len(take)))
    seq = _sequences(self.prompts[rows], self.plens[rows], table.resp[rows], table.n_gen[rows],
                     self.gen.sampling.pad_id)  # [mb, P+T]
    plens, rlens = self.plens[rows], table.n_gen[rows]
    if self.pp > 1:
      return self._score_stages(i, seq, plens, rlens)
    inst = self.gen.instances[i]
    placed = self.loads[i].result()
    inputs: dict = {}  # tokens and lengths on instance i, copied once for every model
    outs = {n: inst.score(n, placed[n], seq, plens, rlens, inputs) for n in self.models}
    self.log.record(i, "inference", list(outs.values()))
    return outs

  def _running(self, u: int) -> list:
    """Unit u's dispatched micro-batches not complete yet, oldest first."""
    return [outs for i, _, outs in self.batches
            if i == u and outs is not None and not all(x.is_ready() for x in outs.values())]

  def _full(self, u: int) -> bool:
    """Unit u (pp > 1) runs as many micro-batches as it has stages and one more."""
    return self.pp > 1 and len(self._running(u)) >= PER_INSTANCE_QUEUE + self.pp - 1

  def _score_stages(self, u: int, seq, plens, rlens) -> dict:
    """One micro-batch through unit u's instances, stage by stage (each stage's hidden states
    copied to the next instance), every inference model; dispatched without waiting, but for
    the unit's oldest micro-batch when it already runs as many as it has stages and one more:
    each holds hidden states [mb, P+T, H] on its instances until it completes, and `drain`
    dispatches every remaining micro-batch at once (`stream` stays within that count; with
    several processes `pump` leaves a full unit's micro-batch for a later round)."""
    if self._full(u):
      jax.block_until_ready(self._running(u)[0])
    x = {n: None for n in self.models}
    for s, m in enumerate(self._unit(u)):  # (a unit lists its instances in stage order)
      inst, placed = self.gen.instances[m], self.loads[m].result()
      prev = list(x.values()) if s else None
      inputs: dict = {}  # tokens and lengths on instance m, copied once for every model
      x = {n: inst.score_stage(n, s, placed[n], x[n], seq, plens, rlens, inputs)
           for n in self.models}
      self.log.record(m, "inference", list(x.values()), after=prev)
    return x

  def stream(self) -> None:
    """While the tail decodes: full micro-batches of the waiting samples onto free instances.

    One process: each free unit with its weights holds at most PER_INSTANCE_QUEUE of them, one
    more per stage past the first (pulled as it completes them, so the unit loaded first does
    not take the whole queue), and at most `gen.inflight` run at once overall when that cap
    is set.
    Several processes: which instance has loaded or completed what differs between processes,
    so the rule reads only global state: each round every unit is assigned at most one
    micro-batch, least assigned first; a process runs its own once their weights are in (and,
    pp > 1, the unit has room: `_full`)."""
    mb = self.gen.config.micro_batch
    if self.gen.exchange.multi:
      for i in sorted((u[0] for u in self.units), key=lambda j: (self.dispatched[j], j)):
        if len(self.waiting) < mb:
          break
        take, self.waiting = self.waiting[:mb], self.waiting[mb:]
        self._assign(i, take)
      self.pump(block=False)
      return
    running = {u: 0 for u in self.loaded()}
    for i, _, outs in self.batches:
      if i in running and not all(x.is_ready() for x in outs.values()):
        running[i] += 1
    room = (self.gen.inflight - sum(running.values()) if self.gen.inflight
            else len(self.waiting))
    while room > 0 and len(self.waiting) >= mb:
      # (a unit of pp instances one more per further stage: each stage holds one of them)
      open_ = [i for i, n in running.items() if n < PER_INSTANCE_QUEUE + self.pp - 1]
      if not open_:
        break
      i = min(open_, key=lambda j: (running[j], self.dispatched[j], j))
      room, running[i] = room - 1, running[i] + 1
      take, self.waiting = self.waiting[:mb], self.waiting[mb:]
      self._assign(i, take)
      self.pump(block=True)  # i has its weights: dispatched at once

  def drain(self) -> None:
    """After generation: every waiting sample over the units, those freed first, then least
    loaded. Instances are freed (one that completes a process's partial unit first, then the
    least loaded) until there are as many units as micro-batches, or all are; the remaining
    loads run in order in the loader thread, so inference starts after one unit's loads, not
    after all of them."""
    mb, g = self.gen.config.micro_batch, self.gen.config.num_instances
    before = list(self.freed)
    key = lambda j: (j not in before, self.dispatched[j], j)  # noqa: E731
    chunks = [self.waiting[k:k + mb] for k in range(0, len(self.waiting), mb)]
    self.waiting = []
    # Freed until there are units enough, or all are: first an instance that completes its
    # process's partial unit (whose other instances already load), then the least loaded.
    new, owner = [], self.gen.owner
    rest = sorted((j for j in range(g) if j not in before), key=key)
    while rest and len(_units(before + new, self.pp, owner)) < len(chunks):
      partial = {p for p, n in collections.Counter(owner[i] for i in before + new).items()
                 if n % self.pp}
      j = next((j for j in rest if owner[j] in partial), rest[0])
      rest.remove(j)
      new.append(j)
    for i in new:
      self.free(i)
    heads = sorted((unit[0] for unit in _units(before + new, self.pp, self.gen.owner)), key=key)
    for n, take in enumerate(chunks):
      self._assign(heads[n % len(heads)], take)
    self.pump(block=True)

  def collect(self) -> list[tuple[int, list[int], dict]]:
    """Waits for this process's micro-batches: (instance, samples, {model: host array}) each,
    in assignment order."""
    mine = [b for b in self.batches if b[2] is not None]
    results = jax.device_get([outs for _, _, outs in mine])
    return [(i, take, res) for (i, take, _), res in zip(mine, results)]

  def unload(self) -> int:
    """Drops the inference weights (they leave the devices with the last reference); returns
    the bytes that were loaded (on this process)."""
    n = sum(x.nbytes for f in self.loads.values() for x in jax.tree.leaves(f.result()))
    self.loads.clear()
    return int(n)

  def close(self) -> None:
    self.loader.shutdown()


class _Run:
  """One batch: the device states of the decoding instances, the SlotTable (where every sample
  sits, what it generated) and the InferenceQueue (what waits for or runs inference), driven
  round by round by `execute` (module docstring). With several processes `active`, the table
  and the queue are global (the same on every process) and `states` holds this process's
  instances only."""

  def __init__(self, gen: FusedGenerator, actor_params, frozen_params, tokens, plens, uids,
               budgets, key, fuse: bool, rt: float, place_s: float,
               models: Optional[dict] = None):
    self.gen, self.fuse, self.rt, self.key = gen, fuse, rt, key
    self.models = gen.models if models is None else models  # the ones this batch runs
    self.frozen_params = frozen_params
    self.tokens, self.plens, self.uids, self.budgets = tokens, plens, uids, budgets
    self.table = SlotTable(gen.config.num_instances, gen.config.slots, gen.batch_size,
                           gen.sampling.max_new_tokens, gen.sampling.pad_id)
    self.infer: Optional[InferenceQueue] = None  # made with the activity log (execute)
    self.log: Optional[ActivityLog] = None
    self.active: list[int] = []  # instances decoding (all processes'), sorted
    self.states: dict = {}  # this process's decoding instance -> DecodeState (donated each chunk)
    self.chunks = 0  # decode chunks run, summed over instances
    self.consolidations: list = []
    self.reasons: list = []
    self.actor_params = actor_params  # a PlacedOnInstances (FusedGenerator.place_actor)
    self.place_s = place_s  # seconds place_actor took
    self.freed_before_end = 0  # instances freed for inference before generation ended

  def read(self, ran: list[int], summaries: dict) -> None:
    """The summaries [3, S] of the instances that ran this round (`summaries`: this process's)
    into the slot table; fetches the rows that just finished and queues those samples for
    inference. With several processes the summaries and then the finished rows are all-gathered
    (module docstring of generation/multihost.py)."""
    gen, table, ex = self.gen, self.table, self.gen.exchange
    # One device_get for all instances (and one below for all finished rows): it starts every
    # copy before waiting for any, where one call per instance waited for each in turn.
    local = {i: np.asarray(x) for i, x in jax.device_get(summaries).items()}
    if ex.multi:
      buf = np.zeros((gen.config.num_instances, 3, gen.config.slots), np.int32)
      for i, x in local.items():
        buf[i] = x
      local = ex.by_owner(buf, gen.owner, "the instances' summaries")  # [G, 3, S], all
    newly = {}
    for i in ran:
      done, n, stop = local[i]
      finished = table.observe(i, done, n)
      if finished:
        newly[i] = (finished, stop)
    if not newly:
      return
    rows = jax.device_get({i: (self.states[i].tokens, self.states[i].logprobs)  # [S, T] each
                           for i in newly if gen.is_local(i)})
    if ex.multi:
      rows = self._exchange_rows(newly, rows)
    for i in sorted(newly):
      finished, stop = newly[i]
      done = table.finish(finished, stop, *rows[i])
      if self.models:  # none to run (no reference, critic or reward model): nothing waits
        self.infer.add(done)

  def _exchange_rows(self, newly: dict, rows: dict) -> dict:
    """{instance: (tokens [S, T], logprobs [S, T])} of every instance in `newly`, from each
    process's own `rows`: each process packs its just-finished rows (instance, then slot order),
    padded to a common count, and all-gathers them."""
    gen, ex = self.gen, self.gen.exchange
    t = gen.sampling.max_new_tokens
    count = np.zeros(ex.count, np.int64)
    for i, (finished, _) in newly.items():
      count[gen.owner[i]] += len(finished)
    n = multihost.pad_rows(int(count.max()))
    tok, lp = np.zeros((n, t), np.int32), np.zeros((n, t), np.float32)
    k = 0
    for i in sorted(newly):
      if gen.is_local(i):
        for slot, _ in newly[i][0]:
          tok[k], lp[k] = rows[i][0][slot], rows[i][1][slot]
          k += 1
    what = "the rows that just finished"
    all_tok, all_lp = ex.allgather(tok, what), ex.allgather(lp, what)  # [P, n, T]
    cursor = np.zeros(ex.count, np.int64)
    out = {}
    for i in sorted(newly):
      p = gen.owner[i]
      tk = np.zeros((gen.config.slots, t), np.int32)
      lk = np.zeros((gen.config.slots, t), np.float32)
      for slot, _ in newly[i][0]:
        tk[slot], lk[slot] = all_tok[p, cursor[p]], all_lp[p, cursor[p]]
        cursor[p] += 1
      out[i] = (tk, lk)
    return out

  def drop(self, i: int) -> None:
    """Instance i leaves generation (its state, on its process, is dropped)."""
    self.active.remove(i)
    self.states.pop(i, None)

  # ---------------------------------------------------------------- consolidation
  def consolidate(self, step: int) -> list[int]:
    """Plans with the shared policy and runs its migrations; returns the released instances.
    Every process computes the same plan from the global slot table and runs the migrations
    that touch its instances: a same-process one as gather, device_put, scatter on that
    process; a cross-process one as one collective both processes run, in plan order."""
    gen, cfg, table, me = self.gen, self.gen.config, self.table, self.gen.exchange.me
    t = gen.sampling.max_new_tokens
    states = []
    for i in self.active:
      # The KV rows hold the prompt and every response token but the newest (engine.DecodeState:
      # the next step writes it), and the row gains one per step left (remaining).
      samples = tuple(policy.SampleState(uid=b, slot=int(table.where[b, 1]),
                                         length=int(self.plens[b] + table.n_gen[b] - 1),
                                         remaining=int(t - table.n_gen[b]))
                      for b in table.unfinished_in(i))
      states.append(policy.InstanceState(
          index=i, slots=cfg.slots, kv_capacity_tokens=gen.kv_capacity, samples=samples,
          slot_capacity_tokens=gen.max_len, shape_class=gen.instances[i].shape_class))
    plan = policy.plan_consolidation(states, self.rt, gen.batch_size,
                                     bytes_per_token=gen.kv_bytes_per_token)
    if not plan.consolidate:
      if plan.reason not in self.reasons:
        self.reasons.append(plan.reason)
        # Verbose only (--v=1): the trainer's progress line sums up each batch's fusion.
        logging.vlog(1, "consolidation at step %d: %s", step, plan.reason)
      return []
    t0 = self.log.now()
    groups: dict = {}
    for m in plan.moves:
      groups.setdefault((m.src_instance, m.dst_instance), []).append(m)
    copied = cross_moves = cross_bytes = 0
    cross_s, compile0 = 0.0, gen.transfer.compile_s
    # Nothing waits here on a same-process move: the next decode chunk of a kept instance
    # depends on its scatter, which depends on the copy, so JAX orders them; the watchers time
    # the copies. A cross-process move is waited for (timed: cross_host_s).
    for (src, dst), moves in sorted(groups.items()):
      s_inst, d_inst = gen.instances[src], gen.instances[dst]
      ps, pd = int(gen.owner[src]), int(gen.owner[dst])
      for k in range(0, len(moves), s_inst.buckets[-1]):
        part = moves[k:k + s_inst.buckets[-1]]
        nbytes = s_inst.bucket(len(part)) * gen.row_bytes
        copied += nbytes
        if ps != pd:
          cross_moves, cross_bytes = cross_moves + len(part), cross_bytes + nbytes
        if me not in (ps, pd):
          continue
        rows, tag = None, ("same_host" if ps == pd else None)
        if me == ps:
          rows, _ = s_inst.gather(self.states[src], [m.src_slot for m in part])
          self.log.record(src, "migrate", rows, tag=tag)
        if ps == pd:
          rows = d_inst.receive(rows)  # device_put between the two sub-meshes
        else:
          t1 = time.perf_counter()
          b = s_inst.bucket(len(part))
          local = s_inst if me == ps else d_inst
          with gen.exchange.guard(f"the KV rows of {len(part)} samples migrating from "
                                  f"instance {src} to instance {dst}"):
            rows = gen.transfer(s_inst.devices, d_inst.devices, local.rows_abstract[b], rows)
          cross_s += time.perf_counter() - t1
        if me == pd:
          self.log.record(dst, "migrate", rows, tag=tag)
          self.states[dst] = d_inst.scatter(self.states[dst], [m.dst_slot for m in part], rows)
    compile_s = gen.transfer.compile_s - compile0
    t1 = self.log.now()
    table.move(plan.moves)
    rec = {"time_s": t0, "step": step, "unfinished": plan.unfinished, "kept": list(plan.kept),
           "released": list(plan.released), "moves": len(plan.moves),
           "moved_bytes": int(plan.moved_bytes), "copied_bytes": int(copied),
           "cross_host_moves": cross_moves, "cross_host_copied_bytes": int(cross_bytes),
           "cross_host_s": cross_s - compile_s, "cross_host_compile_s": compile_s,
           "dispatch_s": t1 - t0, "reason": plan.reason,
           "occupancy": {int(i): len(table.unfinished_in(i)) for i in plan.kept}}
    self.consolidations.append(rec)
    logging.vlog(1, "consolidation at step %d: %s (%d bytes of KV held)", step, plan.reason,
                 plan.moved_bytes)
    for i in plan.released:
      if i in self.active:
        self.drop(i)
    return list(plan.released)

  # ---------------------------------------------------------------- the batch
  def execute(self) -> FusedOutput:
    try:
      return self._execute()
    finally:  # also on errors: no thread outlives the batch
      if self.infer is not None:
        self.infer.close()
      if self.log is not None:
        self.log.close()  # the watchers (idempotent: _execute closed it on success)

  def _execute(self) -> FusedOutput:
    gen, cfg, table = self.gen, self.gen.config, self.table
    b, k = gen.batch_size, gen.sampling.chunk_size
    mine = {i: gen.instances[i] for i in gen.local}
    params = {i: inst.place(gen.cfg, self.actor_params) for i, inst in mine.items()}
    # From here `params` holds the only references to the instances' actor copies: an instance
    # done decoding drops its copy before it scores (the frozen models take that memory; the
    # planner's inference memory check, sim/iteration_sim.py, counts no actor there).
    self.actor_params = None
    keys = {i: jax.device_put(self.key, inst.rep) for i, inst in mine.items()}
    place_s = self.place_s
    self.log = log = ActivityLog(cfg.num_instances)
    self.infer = InferenceQueue(gen, self.frozen_params, table, self.tokens, self.plens, log,
                                self.models)
    summaries = {}
    for i, (rows, tok, lens, uid, bud) in enumerate(gen._deal(self.tokens, self.plens,
                                                              self.uids, self.budgets)):
      table.deal(i, rows)
      if i in mine:
        self.states[i], summaries[i] = mine[i].prefill(params[i], tok, lens, uid, bud, keys[i])
        log.record(i, "prefill", summaries[i])
    self.active = list(range(cfg.num_instances))
    ran = list(self.active)
    curve = [(0.0, b)]
    rounds, t_prefill = 0, None
    while True:
      self.read(ran, summaries)
      if t_prefill is None:
        t_prefill = log.now()
      curve.append((log.now(), table.unfinished))
      idle = [i for i in self.active if not table.unfinished_in(i)]
      for i in idle:
        self.drop(i)
      unfinished = table.unfinished
      if unfinished == 0:
        break
      if (self.fuse and len(self.consolidations) < cfg.max_consolidations and
          policy.within_threshold(unfinished, self.rt, b)):
        idle += self.consolidate(rounds * k)
      summaries = {}
      for i in self.active:
        if i in mine:
          self.states[i], summaries[i] = mine[i].decode(params[i], self.states[i], keys[i])
          log.record(i, "decode", summaries[i])
      self.chunks += len(self.active)
      if not self.active:
        raise RuntimeError("unfinished samples but no instance decoding them (a bug)")
      ran = list(self.active)
      rounds += 1
      for i in idle:
        params.pop(i, None)  # decodes no more
      if self.fuse and self.models:  # (without inference models no instance loads any)
        # After the decode dispatch, so that loading weights never delays the tail.
        for i in idle:
          self.infer.free(i)
        self.infer.stream()
    gen_end = log.now()
    self.freed_before_end = len(self.infer.freed)  # (drain frees more, after generation)
    del params
    self.infer.drain()
    results = self.infer.collect()
    gen_plus_inf = log.now()
    segments = log.close()
    load_bytes = self.infer.unload()
    return self._output(results, segments, curve, rounds, t_prefill, gen_end, gen_plus_inf,
                        place_s, load_bytes)

  def _output(self, results, segments, curve, rounds, t_prefill, gen_end, gen_plus_inf,
              place_s, load_bytes) -> FusedOutput:
    gen, table = self.gen, self.table
    b, t = gen.batch_size, gen.sampling.max_new_tokens
    out = {n: np.zeros((b, t) if n != "reward" else (b,), np.float32) for n in self.models}
    for _, take, res in results:
      for n, arr in res.items():
        out[n][np.asarray(take)] = np.asarray(arr)[:len(take)]
    if gen.exchange.multi:  # each sample's results from the process that scored it
      owner = np.zeros(b, np.int64)
      for i, take, _ in self.infer.batches:
        owner[np.asarray(take)] = gen.owner[i]
      out = {n: gen.exchange.by_owner(x, owner, f"the {n} results") for n, x in out.items()}
    rollout = engine.Rollout(
        prompt_tokens=self.tokens, prompt_lens=self.plens, response_tokens=table.resp,
        response_lens=table.n_gen.copy(), logprobs=table.logp, stop_reason=table.stop,
        uids=self.uids, prefill_s=t_prefill, decode_s=gen_end - t_prefill,
        decode_steps=int(table.n_gen.max()) - 1, decode_chunks=rounds)
    tl = Timeline(num_instances=gen.config.num_instances, observed=tuple(gen.local),
                  segments=segments,
                  unfinished_curve=curve, consolidations=self.consolidations,
                  gen_end_s=gen_end, gen_plus_inf_s=gen_plus_inf, tagged=dict(self.log.tagged))
    cons = self.consolidations
    rows = figures_over_processes(tl, load_bytes, place_s, gen.exchange)
    # Of every process's instances, and every process's clock: timeline.combined_figures
    every = combined_figures(rows, [u for _, u in curve])
    metrics = {
        "gen/unfinished_curve": every["gen/unfinished_curve"],
        "gen/consolidation_step": cons[0]["step"] if cons else -1,
        # Instances decoding just before the first consolidation and after the last (0: none).
        "gen/consolidated_from": len(cons[0]["kept"]) + len(cons[0]["released"]) if cons else 0,
        "gen/consolidated_to": len(cons[-1]["kept"]) if cons else 0,
        "gen/migrated_samples": int(sum(c["moves"] for c in cons)),
        "gen/migrated_kv_bytes": int(sum(c["moved_bytes"] for c in cons)),
        "gen/migration_copied_bytes": int(sum(c["copied_bytes"] for c in cons)),
        # Each consolidation's first copy's start to its last copy's end (measured by the
        # watchers), summed: not the decode rounds between two consolidations. The slowest
        # process's, as its same-process part, its wait for the cross-process collectives
        # (their bytes, rows and padding included, are every process's) and their compiles.
        "gen/migration_s": every["gen/migration_s"],
        "gen/migration_same_host_s": every["gen/migration_same_host_s"],
        "gen/migrated_samples_cross_host": int(sum(c["cross_host_moves"] for c in cons)),
        "gen/migration_cross_host_bytes": int(sum(c["cross_host_copied_bytes"] for c in cons)),
        "gen/migration_cross_host_s": every["gen/migration_cross_host_s"],
        # First use of a (source, target, rows) transfer program: its compile, not counted above.
        "gen/migration_cross_host_compile_s": every["gen/migration_cross_host_compile_s"],
        "gen/instance_busy_frac": every["gen/instance_busy_frac"],
        "fusion/inference_overlap_frac": every["fusion/inference_overlap_frac"],
        "fusion/weight_load_s": every["fusion/weight_load_s"],
        "fusion/weight_load_bytes": every["fusion/weight_load_bytes"],
        "fusion/rt": float(self.rt),
        "gen/decode_rounds": rounds,
        # Summed over instances: each chunk runs all S slots, live or not, so this counts the
        # decode work; consolidation lowers it (fewer, fuller instances).
        "gen/instance_chunks": self.chunks,
        # The same without consolidation (what the baseline decodes; equal to instance_chunks
        # in an iteration that did not consolidate): the decode work the migration saved.
        "gen/instance_chunks_unfused": table.unfused_chunks(gen.sampling.chunk_size),
        # (the slowest process's: every one waits for it at the next collective)
        **{k: every[k] for k in ("timing_s/generate", "timing_s/inference",
                                 "timing_s/gen_plus_inf", "timing_s/actor_to_instances")},
    }
    if self.models:
      # Why an overlap is 0: instances freed for inference before generation ended (released
      # by the consolidation or done with their samples; set by the tokens, not by timing),
      # and of those, the ones whose weights were in by then (timing: the loads). Both, and
      # the overlap, over every process's instances. Not for a batch without inference
      # models: it frees none by design, and the progress line said "no instance freed" of one
      # whose consolidation had released two.
      metrics["fusion/freed_before_gen_end"] = self.freed_before_end
      metrics["fusion/loaded_before_gen_end"] = every["fusion/loaded_before_gen_end"]
    return FusedOutput(rollout=rollout, ref_logp=out.get("reference"), values=out.get("critic"),
                       rewards=out.get("reward"), timeline=tl, consolidations=cons, rt=self.rt,
                       rt_choice=None, no_migration=list(self.reasons), metrics=metrics,
                       by_process=[[float(x) for x in row] for row in rows])


def figures_over_processes(tl: Timeline, load_bytes: int, place_s: float,
                           exchange: multihost.Exchange):
  """[P, n]: every process's `Timeline.process_figures`, which timeline.combined_figures turns
  into the metrics of every process's instances and clocks. Each process watches and loads
  only its own (`tl.observed`), while `freed_before_gen_end` counts all of them (the shared
  inference queue): with process 0's figures alone a "5 freed, none loaded" was false of the
  other processes' instances, the weight loads were process 0's alone, and so were the
  migration spans and the stage times. With several processes one small all-gather of float64
  words (a byte count is exact), called by every process at the same point of `run`, under
  the exchanges' peer-loss guard like every other; the row padded to a power of two (its
  curve's length changes with the rounds: a handful of compiled shapes, not one per length);
  one process keeps its own row as it is (no exchange, no rounding)."""
  row = tl.process_figures(load_bytes, place_s)
  if not exchange.multi:
    return [row]
  padded = np.zeros(multihost.pad_rows(len(row)), np.float64)  # [n, rounded up]
  padded[:len(row)] = row
  return exchange.allgather_float64(padded, "the instances' figures and the processes' "
                                    "clocks")[:, :len(row)]


def _sequences(prompts, prompt_lens, responses, response_lens, pad_id: int) -> np.ndarray:
  """models.sequences.build_sequences in numpy (built on the host, no device dispatch).
  prompts [n, P], responses [n, T] -> [n, P+T]: prompt, response, then pad_id."""
  n, p = prompts.shape
  t = responses.shape[1]
  out = np.full((n, p + t), pad_id, np.int32)
  for r in range(n):
    pl, rl = int(prompt_lens[r]), int(response_lens[r])
    out[r, :pl] = prompts[r, :pl]
    out[r, pl:pl + rl] = responses[r, :rl]
  return out
