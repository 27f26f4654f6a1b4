"""Live bytes on device 0 while the trainer places the actor on its generation instances (a
pipelined update, both fusions, scanned layers, 8 fake CPU devices): Update.whole(moving=True),
the trainer's default since 2026-12-05, against the gathered copy it made before (moving forced
off). Run from the repository root:

  python experiments/results/placement_2026-12-05/transient.py moving
  python experiments/results/placement_2026-12-05/transient.py gathered

The model and mesh come from tests/test_trainer.tiny_config with the overrides below."""
import os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from rlhfuse_jax.trainer import rollout, update as update_lib
from rlhfuse_jax.trainer.loop import PPOTrainer
from rlhfuse_jax.parallel import mesh as mesh_lib
from tests.test_trainer import tiny_config
gather = sys.argv[1] == "gathered"
if gather:
  real_whole = update_lib.Update.whole
  update_lib.Update.whole = lambda self, m, s, moving=False: real_whole(self, m, s, False)
dev0 = jax.devices()[0]


def live0():
  return sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards
             if s.device == dev0)


peaks = []
real_run = rollout.fused_lib.FusedGenerator.run


def run(self, actor_params, frozen, *a, **k):
  def actor():
    w = actor_params(); peaks.append(("after the copy", live0())); return w
  return real_run(self, actor, frozen, *a, **k)


rollout.fused_lib.FusedGenerator.run = run
real_place = rollout.fused_lib.FusedGenerator.place_actor


def place_actor(self, params):
  out = real_place(self, params); peaks.append(("placed, copy still held", live0())); return out


rollout.fused_lib.FusedGenerator.place_actor = place_actor
over = {"num_iterations": 1, "mesh.stage": 4, "mesh.data": 2, "fusion.inter_stage": True,
        "fusion.intra_stage": True, "fusion.instance_devices": 2,
        "model.num_layers": 8, "critic_model.num_layers": 8, "model.hidden_size": 256,
        "model.intermediate_size": 512, "critic_model.hidden_size": 256,
        "critic_model.intermediate_size": 512,
        "model.scan_layers": True, "critic_model.scan_layers": True,
        "pipeline.actor_microbatches": 4, "pipeline.critic_microbatches": 4,
        "pipeline.search_time_s": 0.3, "pipeline.xla_opt_level": 0}
cfg = tiny_config(**over)
t = PPOTrainer(cfg, tempfile.mkdtemp(), mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()))
actor_bytes = sum(x.nbytes for x in jax.tree.leaves(t.actor.params))
print("actor bytes (whole)", actor_bytes, "device-0 live before rollout", live0())
t.run()
for what, b in peaks[:2]:
  print(sys.argv[1], what, b)
