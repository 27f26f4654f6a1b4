"""One process of tests/test_multiprocess.py's device-to-device test of `mesh.put` between two
disjoint device groups spread over the processes (async PPO's training and generation groups):
every value arrives where its sharding says, and nothing goes through host memory. Then the
frozen models' move to host memory (build.Models.frozen_to_host) of arrays spanning both
processes.

Usage: python -m tests.put_mp_worker PROCESS_ID NUM_PROCESSES PORT OUT_DIR
"""
import os
import sys

import numpy as np


def main(argv):
  pid, n, port, out_dir = int(argv[1]), int(argv[2]), argv[3], argv[4]
  from rlhfuse_jax.parallel import distributed
  distributed.initialize(f"127.0.0.1:{port}", n, pid)
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from rlhfuse_jax.parallel import mesh as mesh_lib

  def no_host(tree):
    raise AssertionError("mesh.put went through host memory")
  to_host, mesh_lib.to_host = mesh_lib.to_host, no_host

  # As async_ppo.split_devices: the first half of each process's devices generate.
  per = len(jax.local_devices()) // 2
  gen = [d for d in jax.devices() if d.id % len(jax.local_devices()) < per]
  train = [d for d in jax.devices() if d not in gen]
  train_mesh = Mesh(np.array(train).reshape(2, -1), ("fsdp", "tensor"))
  gen_mesh = Mesh(np.array(gen), ("data",))

  rng = np.random.default_rng(0)
  cases = [  # (value, where it starts, where it goes)
      (rng.normal(size=(8, 8)).astype(np.float32), P("fsdp", "tensor"), P()),
      (rng.normal(size=(8, 8)).astype(np.float32), P("fsdp"), P(None, "data")),
      (rng.normal(size=(3, 5)).astype(jnp.bfloat16), P(), P()),  # no dimension divides
      (rng.integers(0, 100, size=(4, 8, 2)).astype(np.int32), P(None, ("fsdp", "tensor")),
       P("data")),
      (np.float32(3.5), P(), P()),
  ]
  xs = [jax.make_array_from_callback(v.shape, NamedSharding(train_mesh, src),
                                     lambda idx, v=v: v[idx]) for v, src, _ in cases]
  dst = [NamedSharding(gen_mesh, d) for _, _, d in cases]
  outs = mesh_lib.put(xs, dst)
  # And back: the generation group's layout onto the training group's.
  back = mesh_lib.put(outs, [x.sharding for x in xs])
  for (v, _, _), out, sharding, b, x in zip(cases, outs, dst, back, xs):
    assert out.sharding == sharding and b.sharding == x.sharding
    for arr in (out, b):
      for s in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(v)[s.index])
  key_data = np.asarray(jax.random.key_data(jax.random.key(7)))
  key = jax.random.wrap_key_data(jax.make_array_from_callback(
      key_data.shape, NamedSharding(train_mesh, P()), lambda idx: key_data[idx]))
  moved = jax.random.key_data(mesh_lib.put(key, NamedSharding(gen_mesh, P())))
  assert {s.device for s in moved.addressable_shards} == set(gen) & set(jax.local_devices())
  for s in moved.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), key_data)
  # The frozen models of a model copy split over both processes' devices (the 13B-65B presets'
  # fsdp x tensor over several hosts) to host memory, as a fused run's set-up does: jax refused
  # jax.device_get of such an array, which ended those runs at set-up.
  mesh_lib.to_host = to_host
  from rlhfuse_jax.trainer import build
  models = build.Models(actor=None, critic=None, reference={"w": xs[0], "b": xs[3]},
                        reward_cfg=None, reward_params={"w": xs[1]})
  models.frozen_to_host()
  for got, (v, _, _) in ((models.reference["w"], cases[0]), (models.reference["b"], cases[3]),
                         (models.reward_params["w"], cases[1])):
    assert isinstance(got, np.ndarray), type(got)
    np.testing.assert_array_equal(got, np.asarray(v))
  open(os.path.join(out_dir, f"ok{pid}"), "w").close()


if __name__ == "__main__":
  main(sys.argv)
