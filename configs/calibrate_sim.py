r"""Measures this machine's operation costs into a simulator calibration file.

  python -m experiments.calibrate_sim --config=configs/calibrate_sim.py --workdir=/tmp/cal

Writes calibration.json (format of rlhfuse_jax/policy/calibration.py), model/config.json (the
measured model's shape, which the simulator's --config.shapes takes) and config.json. Match the
model and instance fields to the benchmark the simulator should predict before comparing; e.g.
bench_generation's default run (BG: its workdir), whose model is 128 wide:

  python -m experiments.calibrate_sim --config=configs/calibrate_sim.py --workdir=/tmp/cal \
    --config.model.hidden_size=128 --config.model.intermediate_size=256
  python -m experiments.reproduce_ablations --config=configs/ablations.py:quick --workdir=DIR \
    --config.validate.bench_generation_workdir=BG \
    --config.validate.calibration=/tmp/cal/calibration.json

Plans on the machine measured (a hardware file of it: docs/simulator.md, Inputs):

  python -m experiments.plan_search --config=configs/plan_search.py --workdir=/tmp/ps_cal \
    --config.calibration=/tmp/cal/calibration.json --config.hardware=MY_HOST.json \
    --config.shapes=mine=/tmp/cal/model --config.pairs=mine/mine
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict()  # shape measured (actor; the critic gets a scalar head)
  c.model.vocab_size = 256
  c.model.hidden_size = 64
  c.model.intermediate_size = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.max_seq_len = 256
  c.slots = 8  # batch slots of one generation instance
  c.prompt_len = 16  # prompt tokens per sample
  c.max_new_tokens = 64  # response budget (sets the KV cache length)
  c.chunk_size = 8  # decode steps per jitted call
  c.occupancies = "1,2,4,8"  # live rows at which a decode step is timed
  c.inference_microbatch = 8  # samples per inference forward (reference + reward + critic)
  c.migrate_rows = 4  # KV rows copied between two devices to time a migration
  c.repeats = 20  # timed repetitions per measurement (the median is kept)
  # whether the devices share one processor: "auto" is true on CPU (fake devices), false else
  c.devices_share_compute = "auto"
  return c
