"""Accelerator presets for the simulator: peak compute, memory, and link bandwidths per device.

Every figure is a vendor datasheet / documentation number, cited next to it, converted to SI
units (FLOP/s, bytes, bytes/s). Conventions, applied when converting:

- `peak_flops`: dense (no structured sparsity) bf16 matrix throughput. NVIDIA datasheets print
  the sparse figure with a footnote "shown with sparsity, specifications 1/2 lower without".
- Bandwidths are PER DEVICE and PER DIRECTION (what one device can send while it receives the
  same). NVIDIA prints NVLink as the bidirectional total (900 GB/s = 450 GB/s each way) and
  InfiniBand per port in Gb/s (400 Gb/s = 50 GB/s each way); Google prints ICI bidirectional.
- A "node" is the domain of the fast link: an 8-GPU NVLink/NVSwitch board, or a TPU ICI slice.
  `inter_node_bw` is the per-device share of the scale-out network (GPU: one NIC per GPU on
  the DGX/HGX reference designs; TPU: data-center network per chip).
- `hbm_bytes`: the datasheet's figure as printed, in SI bytes: NVIDIA's "80 GB" is 80e9 here,
  though an H100 80GB reports 81,559 MiB (about 85.5e9 bytes) to nvidia-smi; the 7 % between
  them is left unused (a conservative fit; docs/usage.md says how to let a run use it). Google's
  v5p page prints GiB and is taken as GiB.
- `host_to_device_bw`: PCIe per direction; None where the vendor page does not give it (the
  simulator then refuses to model offloading frozen models to host memory). The cost model
  applies no efficiency to it, so host -> device copies are an optimistic bound.

Anything here is an upper bound; achieved fractions are the cost model's efficiency parameters.

Collective latencies (`collective_protocols`, the alpha of the cost model's alpha-beta
collectives) are not on datasheets. NVIDIA presets use NCCL's own cost model, the constants NCCL
uses to choose an algorithm and protocol (NVIDIA/nccl, src/graph/tuning.cc, v2.18-2.19:
`baseLat` and `hwLat` of the Ring algorithm): a call costs a base latency, and every ring step
one hop latency, NVLink inside a node and the network across nodes. Two of NCCL's protocols
are modelled: LL (low latency; NCCL models its bandwidth as 1/4 of the link's for all-reduce)
and Simple (full bandwidth, higher latencies); a collective takes the cheaper, as NCCL picks.
Left out: LL128, Tree, NVLS and CollNet, and the refinements NCCL applies on top. TPU presets
have no cited per-hop figure here and keep the cost model's one `collective_latency_s`.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from typing import Optional

from rlhfuse_jax import workdir as wd

GB = 1e9
TB = 1e12
TFLOPS = 1e12
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class CollectiveProtocol:
  """One protocol of a ring collective's alpha-beta cost (module docstring): a call takes
  base_s + (ring steps inside nodes) * intra_step_s + (steps across nodes) * inter_step_s +
  bytes through each device / (link bandwidth * net_eff * bw_fraction)."""
  name: str
  base_s: float
  intra_step_s: float
  inter_step_s: float
  bw_fraction: float  # all-reduce, and any collective spanning nodes
  bw_fraction_in_node: float = 0.0  # other collectives inside one node; 0: bw_fraction


# NCCL's Ring constants (src/graph/tuning.cc, v2.18-2.19, microseconds): baseLat Ring
# {LL 6.6, Simple 8.4}; hwLat NVLink Ring {LL .6, Simple 3.4}; hwLat NET Ring {LL 2.7,
# Simple 14.0}; LL bus bandwidth = link bandwidth / 4 for all-reduce and multi-node rings,
# / 3 for the other collectives inside one node.
NCCL_RING = (
    CollectiveProtocol("LL", base_s=6.6e-6, intra_step_s=0.6e-6, inter_step_s=2.7e-6,
                       bw_fraction=0.25, bw_fraction_in_node=1.0 / 3.0),
    CollectiveProtocol("Simple", base_s=8.4e-6, intra_step_s=3.4e-6, inter_step_s=14.0e-6,
                       bw_fraction=1.0),
)


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator type and how devices are wired (SI units, see module docstring)."""
  name: str
  peak_flops: float  # dense bf16 FLOP/s per device
  hbm_bw: float  # bytes/s per device
  hbm_bytes: float  # bytes per device
  intra_node_bw: float  # bytes/s per device per direction (NVLink / ICI)
  inter_node_bw: float  # bytes/s per device per direction (InfiniBand / DCN)
  devices_per_node: int
  host_to_device_bw: Optional[float] = None  # bytes/s per device per direction (PCIe)
  source: str = ""  # where the numbers come from
  # alpha of the collectives (module docstring); None: the cost model's collective_latency_s
  collective_protocols: Optional[tuple[CollectiveProtocol, ...]] = None
  # Devices one host drives (one process of a multi-host run: what the trainer's generation
  # instances and inference pipelines must fit in); 0: devices_per_node (a GPU node is a host,
  # a TPU pod's ICI domain spans many)
  devices_per_host: int = 0

  def __post_init__(self):
    for f in ("peak_flops", "hbm_bw", "hbm_bytes", "intra_node_bw", "inter_node_bw"):
      v = getattr(self, f)
      if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
              and v > 0):
        raise ValueError(f"hardware {self.name!r}: {f}={v!r} must be a positive finite number")
    if (not isinstance(self.devices_per_node, int) or isinstance(self.devices_per_node, bool)
        or self.devices_per_node < 1):
      raise ValueError(f"hardware {self.name!r}: devices_per_node={self.devices_per_node!r} "
                       "must be an integer >= 1")
    if (not isinstance(self.devices_per_host, int) or isinstance(self.devices_per_host, bool)
        or self.devices_per_host < 0):
      raise ValueError(f"hardware {self.name!r}: devices_per_host={self.devices_per_host!r} "
                       "must be an integer >= 0 (0: devices_per_node)")
    h2d = self.host_to_device_bw  # a hardware file's string was a TypeError, inf a free copy
    if h2d is not None and not (isinstance(h2d, (int, float)) and not isinstance(h2d, bool)
                                and math.isfinite(h2d) and h2d > 0):
      raise ValueError(f"hardware {self.name!r}: host_to_device_bw={h2d!r} must be a positive "
                       "finite number or None")
    for p in self.collective_protocols or ():
      if (min(p.base_s, p.intra_step_s, p.inter_step_s) < 0 or not 0 < p.bw_fraction <= 1
          or not 0 <= p.bw_fraction_in_node <= 1):
        raise ValueError(f"hardware {self.name!r}: collective protocol {p.name!r} needs "
                         f"latencies >= 0 and bw_fraction in (0, 1], got {p}")

  @property
  def host_devices(self) -> int:
    """Devices of one host (one process): devices_per_host, or devices_per_node if 0."""
    return self.devices_per_host or self.devices_per_node

  def nodes_spanned(self, devices: int) -> int:
    """Nodes that `devices` consecutive devices occupy (at least 1)."""
    return max(1, -(-devices // self.devices_per_node))

  def link_bw(self, group_size: int, stride: int = 1) -> float:
    """Per-device bandwidth of a collective over `group_size` devices `stride` apart
    (consecutive numbering): the fast link while the group stays inside one node; once it spans
    nodes, min(fast link, k x inter_node_bw) with k the group's members per node. A ring over
    nodes runs one channel per NIC (NCCL: bus bandwidth = channels x per-channel network
    bandwidth, src/graph/tuning.cc), so each byte crosses the network once per node, through
    the k members' k NICs, and the hops inside the node ride the fast link. k is the fewest
    members any node holds (the group starting on a node's first device): that node's NICs set
    the pace, as in CostModel.group_collective_s (12 devices on nodes of 8: 4, not 8)."""
    span = (group_size - 1) * stride + 1
    if span <= self.devices_per_node:
      return self.intra_node_bw
    per_node = collections.Counter(i * stride // self.devices_per_node
                                   for i in range(group_size))
    return min(self.intra_node_bw, min(per_node.values()) * self.inter_node_bw)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 SXM column:
    # BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.4 dense; GPU memory 80 GB; memory
    # bandwidth 3.35 TB/s; NVLink 900 GB/s (bidirectional -> 450 each way); PCIe Gen5 128 GB/s
    # (-> 64 each way). NVIDIA DGX H100 datasheet: 8 GPUs per node, 8x ConnectX-7 400 Gb/s
    # InfiniBand, one per GPU -> 50 GB/s per GPU each way.
    "h100_sxm": Hardware(
        name="h100_sxm", peak_flops=989.4 * TFLOPS, hbm_bw=3.35 * TB, hbm_bytes=80 * GB,
        intra_node_bw=450 * GB, inter_node_bw=50 * GB, devices_per_node=8,
        host_to_device_bw=64 * GB,
        source="NVIDIA H100 datasheet (SXM), NVIDIA DGX H100 datasheet",
        collective_protocols=NCCL_RING),
    # NVIDIA H800 (the export variant of H100 SXM): same GH100 compute and 80 GB HBM3 at
    # 3.35 TB/s; NVLink limited to 400 GB/s bidirectional (NVIDIA H800 Tensor Core GPU
    # datasheet, SXM) -> 200 GB/s each way. Scale-out assumed as on DGX H100: 400 Gb/s per GPU.
    "h800_sxm": Hardware(
        name="h800_sxm", peak_flops=989.4 * TFLOPS, hbm_bw=3.35 * TB, hbm_bytes=80 * GB,
        intra_node_bw=200 * GB, inter_node_bw=50 * GB, devices_per_node=8,
        host_to_device_bw=64 * GB,
        source="NVIDIA H800 datasheet (SXM); NIC per GPU as DGX H100",
        collective_protocols=NCCL_RING),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM:
    # BF16 1,979 TFLOPS with sparsity -> 989.4 dense; 141 GB HBM3e; 4.8 TB/s; NVLink 900 GB/s
    # (-> 450 each way); PCIe Gen5 128 GB/s (-> 64). NVIDIA DGX H200 datasheet: 8 GPUs,
    # 8x ConnectX-7 400 Gb/s -> 50 GB/s per GPU.
    "h200_sxm": Hardware(
        name="h200_sxm", peak_flops=989.4 * TFLOPS, hbm_bw=4.8 * TB, hbm_bytes=141 * GB,
        intra_node_bw=450 * GB, inter_node_bw=50 * GB, devices_per_node=8,
        host_to_device_bw=64 * GB,
        source="NVIDIA H200 datasheet (SXM), NVIDIA DGX H200 datasheet",
        collective_protocols=NCCL_RING),
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), A100 80GB SXM:
    # BF16 Tensor Core 312 TFLOPS dense (624 with sparsity); 80 GB HBM2e at 2,039 GB/s; NVLink
    # 600 GB/s (-> 300 each way); PCIe Gen4 64 GB/s (-> 32). NVIDIA DGX A100 datasheet: 8 GPUs,
    # 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand -> 25 GB/s per GPU.
    "a100_80g_sxm": Hardware(
        name="a100_80g_sxm", peak_flops=312 * TFLOPS, hbm_bw=2.039 * TB, hbm_bytes=80 * GB,
        intra_node_bw=300 * GB, inter_node_bw=25 * GB, devices_per_node=8,
        host_to_device_bw=32 * GB,
        source="NVIDIA A100 datasheet (80GB SXM), NVIDIA DGX A100 datasheet",
        collective_protocols=NCCL_RING),
    # Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e): peak compute per chip
    # (bf16) 197 TFLOPs; HBM2 16 GB at 819 GBps (a later version of the page prints
    # 800 GiBps, about 859 GB/s: the lower figure is kept); bidirectional ICI 400 GBps per chip
    # (-> 200 each way); TPU Pod (one ICI domain, 2D torus) 256 chips; per-host NIC 2 x 100 Gbps
    # with 8 chips per host -> 25 GB/s per host = 3.125 GB/s per chip of data-center network
    # (its slice table: 16 chips on 2 hosts, 256 on 32).
    "tpu_v5e": Hardware(
        name="tpu_v5e", peak_flops=197 * TFLOPS, hbm_bw=819 * GB, hbm_bytes=16 * GB,
        intra_node_bw=200 * GB, inter_node_bw=3.125 * GB, devices_per_node=256,
        host_to_device_bw=None, source="Google Cloud TPU v5e system architecture page",
        devices_per_host=8),
    # Google Cloud TPU v5p documentation (cloud.google.com/tpu/docs/v5p): peak compute per chip
    # (BF16) 459 TFLOPs; HBM 95 GiB at 2765 GBps; bidirectional ICI 1200 GBps per chip (-> 600
    # each way); 8960 chips per pod (one ICI domain, 3D torus); data-center network 50 Gbps per
    # chip -> 6.25 GB/s; 4 chips per host (its slice table: 2x2x1, 4 chips, on 1 host; 2x2x2,
    # 8 chips, on 2).
    "tpu_v5p": Hardware(
        name="tpu_v5p", peak_flops=459 * TFLOPS, hbm_bw=2765 * GB, hbm_bytes=95 * GIB,
        intra_node_bw=600 * GB, inter_node_bw=6.25 * GB, devices_per_node=8960,
        host_to_device_bw=None, source="Google Cloud TPU v5p system architecture page",
        devices_per_host=4),
}


# The fields a hardware file may change of its base preset. collective_protocols: a list of
# {name, base_s, intra_step_s, inter_step_s, bw_fraction[, bw_fraction_in_node]} (seconds; the
# cheaper per collective, as NCCL's Ring LL and Simple above), or null for the cost model's one
# efficiency.collective_latency_s per call (as the TPU presets): NCCL's NVLink hop latencies do
# not hold for a node without NVLink.
FILE_FIELDS = ("name", "peak_flops", "hbm_bw", "hbm_bytes", "intra_node_bw", "inter_node_bw",
               "devices_per_node", "host_to_device_bw", "source", "collective_protocols",
               "devices_per_host")


def get_hardware(name: str) -> Hardware:
  """The preset called `name`, or the hardware a JSON file describes (`name` ending in .json:
  {"base": PRESET, FIELD: value, ...}, the preset with those fields replaced: an A100 40 GB, a
  4-GPU node, fewer NICs); the error lists the known names or the file's bad field."""
  if name.endswith(".json"):
    return hardware_file(name)
  if name not in HARDWARE:
    raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)}, or a JSON file "
                     '{"base": PRESET, FIELD: value} (FIELD one of ' f"{list(FILE_FIELDS)})")
  return HARDWARE[name]


_FILE_UNITS = {"peak_flops": "FLOP/s", "hbm_bw": "bytes/s", "hbm_bytes": "bytes",
               "intra_node_bw": "bytes/s", "inter_node_bw": "bytes/s",
               "host_to_device_bw": "bytes/s"}


def hardware_file(path: str) -> Hardware:
  """get_hardware of a JSON file: its "base" preset with the file's other fields replaced (SI
  units, as the presets: FLOP/s, bytes/s, bytes). Its collective latencies stay the base's."""
  try:
    with open(path, encoding="utf-8") as f:
      spec = wd.load_json(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"hardware {path!r}: cannot read it as JSON ({e})") from None
  if not isinstance(spec, dict) or not isinstance(spec.get("base"), str) or (
      spec["base"] not in HARDWARE):  # (a list as base was a TypeError: unhashable)
    raise ValueError(f"hardware {path!r}: expected an object whose \"base\" is a preset of "
                     f"{sorted(HARDWARE)}")
  unknown = sorted(set(spec) - {"base", *FILE_FIELDS})
  if unknown:
    raise ValueError(f"hardware {path!r}: unknown fields {unknown}; expected some of "
                     f"{list(FILE_FIELDS)}")
  fields = {k: v for k, v in spec.items() if k != "base"}
  fields.setdefault("name", os.path.splitext(os.path.basename(path))[0])
  if "collective_protocols" in fields:
    fields["collective_protocols"] = _file_protocols(path, fields["collective_protocols"])
  base = HARDWARE[spec["base"]]
  for k, unit in _FILE_UNITS.items():
    v, ref = fields.get(k), getattr(base, k)
    # 989 for an H100's 989e12 FLOP/s or 3.35 for its 3.35e12 B/s passed as positive numbers,
    # and the search chose plans on a device 1e12 times slower (best 8.7e11 s). Below 1e5 in
    # these units is a figure in T, G or M units (no device computes or moves 1e5 a second or
    # holds 100 kB); a CPU host's measured 1e11 FLOP/s stays allowed.
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e5:
      raise ValueError(f"hardware {path!r}: {k}={v!r} {unit}, below 1e5: the file's figures "
                       f"are in {unit} (SI, as the presets), not T/G/M units; e.g. the base "
                       f"preset {base.name}'s is {ref:.4g}")
  # Which figures are the file's and which the base preset's (with its citation): the reports
  # print this source beside every figure.
  changed = sorted(set(fields) - {"name", "source"})
  fields["source"] = (f"{fields['source']}; " if fields.get("source") else "") + (
      f"{path}: {', '.join(changed) or 'no figure'}; the rest from preset {base.name} "
      f"({base.source})")
  return dataclasses.replace(base, **fields)


def _file_protocols(path: str, value) -> Optional[tuple[CollectiveProtocol, ...]]:
  """A hardware file's collective_protocols (FILE_FIELDS): None, or CollectiveProtocols; a
  ValueError naming the file and what was expected."""
  if value is None:
    return None
  keys = {f.name for f in dataclasses.fields(CollectiveProtocol)}
  need = keys - {"bw_fraction_in_node"}
  if not isinstance(value, list) or not value or not all(
      isinstance(p, dict) and need <= set(p) <= keys for p in value):
    raise ValueError(f"hardware {path!r}: collective_protocols={value!r}; expected null (one "
                     "config.efficiency.collective_latency_s per call) or a non-empty list of "
                     f"objects with {sorted(need)} and optionally bw_fraction_in_node (seconds)")
  out = []
  for p in value:
    for k, v in p.items():
      if k != "name" and (not isinstance(v, (int, float)) or isinstance(v, bool)
                          or not math.isfinite(v)):
        raise ValueError(f"hardware {path!r}: collective_protocols {p.get('name')!r}: {k}={v!r} "
                         "must be a finite number")
    out.append(CollectiveProtocol(**p))
  return tuple(out)


# How `jax.Device.device_kind` names the devices of a preset: the CUDA device name on GPUs
# ("NVIDIA H100 80GB HBM3" is the SXM part), the generation on TPUs ("TPU v5 lite" is v5e,
# "TPU v5" is v5p). PCIe / NVL cards and the 40 GB A100 have other clocks or memory bandwidths
# than the SXM presets, and GH200 is not an H200: those match nothing rather than a wrong preset.
_DEVICE_KIND_PATTERNS = (
    (r"\bh200\b", "h200_sxm"),
    (r"\bh800\b", "h800_sxm"),
    (r"\bh100\b", "h100_sxm"),
    (r"\ba100\b.*\bsxm4\b.*\b80gb\b", "a100_80g_sxm"),
    (r"^tpu v5( lite|e)$", "tpu_v5e"),
    (r"^tpu v5p?$", "tpu_v5p"),
)


def hardware_for_device_kind(device_kind: str) -> Optional[Hardware]:
  """The preset of a `jax.Device.device_kind`, or None when no preset is known to match it
  (CPUs, PCIe/NVL variants, other generations): callers then report an unknown peak."""
  kind = " ".join(device_kind.lower().split())
  if "pcie" in kind or re.search(r"\bnvl\b", kind):
    return None
  for pattern, name in _DEVICE_KIND_PATTERNS:
    if re.search(pattern, kind):
      return HARDWARE[name]
  return None
