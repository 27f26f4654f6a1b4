"""Host-memory offload bandwidth on the lent GPU: optim.offload_during_rollout's moves
(parallel/mesh.to_host_memory / from_host_memory) of `GB` GB of bfloat16 leaves shaped like
AdamW moments, each way, `REPEATS` times; prints one JSON line (GB/s out and back, median).

  GB=8 REPEATS=3 python3 experiments/results/h100_pallas_decode/offload_probe.py
"""
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from rlhfuse_jax.parallel import mesh as mesh_lib

GB, REPEATS = float(os.environ.get("GB", "8")), int(os.environ.get("REPEATS", "3"))
mesh = jax.make_mesh((1,), ("data",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
leaf = 256 * 2**20  # elements: 512 MB leaves (a 65B MLP weight's moment is 360 MB)
n = max(1, int(GB * 1e9 // (2 * leaf)))
tree = [jax.device_put(jnp.full((leaf,), i, jnp.bfloat16), sharding) for i in range(n)]
nbytes = sum(x.nbytes for x in tree)
out_s, back_s = [], []
for _ in range(REPEATS):
  t0 = time.perf_counter()
  host, placed = mesh_lib.to_host_memory(tree)
  jax.block_until_ready(host)
  del tree
  t1 = time.perf_counter()
  tree = mesh_lib.from_host_memory(host, placed)
  jax.block_until_ready(tree)
  del host
  out_s.append(t1 - t0)
  back_s.append(time.perf_counter() - t1)
assert all(bool(x[0] == i) for i, x in enumerate(tree))
print(json.dumps({"device": jax.devices()[0].device_kind, "bytes": nbytes,
                  "to_host_GBps": nbytes / statistics.median(out_s) / 1e9,
                  "to_device_GBps": nbytes / statistics.median(back_s) / 1e9,
                  "to_host_s": out_s, "to_device_s": back_s}))
