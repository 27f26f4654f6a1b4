r"""Paper-scale ablations from the simulator: actor/critic pairs x max generation lengths x systems.

  python -m experiments.reproduce_ablations --config=configs/ablations.py --workdir=/tmp/ablations

Writes result.json (rows: setting, system, iteration_s, gen_s, inf_s, gen_plus_inf_s, train_s,
samples_per_s), ablations.md (tables, speedups, every input, validation), PNGs and config.json.
Variants: `--config=configs/ablations.py:quick` (one setting, short searches, for smoke tests);
`:vllm_sync` (decode pays the host time of a vLLM-class engine that does not overlap it).
Validation (predicted vs measured, sim/validation.py): `--config.validate.bench_generation_workdir=D1
--config.validate.bench_pipeline_workdir=D2`; each bench is predicted from its own
D/calibration.json unless `--config.validate.calibration=CAL.json` names one for both.
`--config.validate.bench_decode_workdir=D3` (a GPU/TPU run of bench_decode) is predicted from the
datasheet preset of its device and `efficiency`, uncalibrated.
"""
import ml_collections


def get_config(arg: str = "paper"):
  c = ml_collections.ConfigDict()
  c.hardware = "h100_sxm"  # preset in rlhfuse_jax/sim/hardware.py (h800_sxm, h200_sxm, ...)
  c.num_devices = 256  # devices in the cluster
  c.global_batch = 512  # prompts per iteration (one response each)
  c.minibatch = 64  # samples per PPO mini-batch (one optimizer step)
  c.epochs = 1  # PPO epochs over the batch
  c.micro_batch = 1  # samples per pipeline micro-batch
  # actor/critic pairs (comma-separated 'actor/critic', shapes in rlhfuse_jax/sim/shapes.py)
  c.pairs = "llama-13b/llama-13b,llama-33b/llama-13b,llama-65b/llama-33b,llama-65b/llama-65b"
  # Shapes of your own for `pairs`, from HF config.json files (the file or its model
  # directory): 'NAME=PATH,...', e.g. 'llama3-8b=/models/llama3-8b' then pairs='llama3-8b/...'
  c.shapes = ""
  c.max_new_tokens = "512,1024,2048"  # max generation lengths (comma-separated)
  # systems to simulate (rlhfuse_jax/sim/iteration_sim.py)
  c.systems = ("deepspeed_chat_like,realhf_like,rlhfuse_base,inter_stage,intra_stage,"
               "rlhfuse,pipe_rlhf,rlhfuse_planned,pipe_rlhf_async")
  c.seed = 0  # seed of the sampled prompt/response lengths and of the schedule search

  # Prompt lengths: an assumption too (no cited trace): log-normal, median 256, sigma 0.5,
  # clipped to [16, 1024]. The cap sets the KV a generation slot must hold (prompt +
  # max_new_tokens), so it decides which generation plans fit.
  c.prompt = ml_collections.ConfigDict()  # prompt-length distribution (sim/lengths.py)
  c.prompt.kind = "lognormal"
  c.prompt.median = 256.0
  c.prompt.sigma = 0.5
  c.prompt.min_len = 16
  c.prompt.max_len = 1024
  c.prompt.alpha = 1.5
  c.prompt.value = 0
  c.prompt.path = ""

  # Response lengths: an assumption, not a measurement or a cited trace (the papers show their
  # traces only as plots): log-normal, median 256, sigma 0.8. Inter-stage fusion's gain depends
  # on it directly; `empirical` replays a run's own lengths (sim/lengths.py).
  c.response = ml_collections.ConfigDict()  # response lengths; max_len = each max_new_tokens
  c.response.kind = "lognormal"  # lognormal | pareto | uniform | constant | empirical
  c.response.median = 256.0  # lognormal median (tokens)
  c.response.sigma = 0.8  # lognormal sigma (tail weight)
  c.response.min_len = 1
  c.response.max_len = 2048  # replaced by each setting's max_new_tokens
  c.response.alpha = 1.5  # pareto tail index
  c.response.value = 0  # constant length
  c.response.path = ""  # empirical: .npy/.txt/.json/.jsonl lengths file

  c.efficiency = ml_collections.ConfigDict()  # achieved fractions (sources: sim/cost_model.py)
  c.efficiency.train_mfu = 0.45
  c.efficiency.prefill_mfu = 0.45
  c.efficiency.decode_mfu = 0.45
  c.efficiency.decode_bw_eff = 0.7
  c.efficiency.net_eff = 0.8
  c.efficiency.collective_latency_s = 10e-6
  c.efficiency.memory_headroom = 0.9
  c.efficiency.bwd_over_fwd = 2.0
  c.efficiency.act_bytes_per_token_layer_per_h = 34.0
  # host time per decode step the device waits for, / the step's device time (0: overlapped)
  c.efficiency.decode_host_overhead = 0.0

  c.sim = ml_collections.ConfigDict()  # simulated system knobs (iteration_sim.SimOptions)
  c.sim.threshold = -1.0  # consolidation Rt; < 0: chosen by simulation per setting
  c.sim.threshold_candidates = "0,0.05,0.1,0.2,0.3,0.5"  # Rt tried (0: stream, never migrate)
  # decode steps between host checks (an engine setting: ours checks every 8 by default, a
  # vLLM-class engine every step; 16 charges the tail up to 15 steps of lateness)
  c.sim.chunk_steps = 16
  c.sim.inference_microbatch = 8  # samples per inference micro-batch (configs/ppo_llama.py's)
  # Slots per generation instance at most (vLLM's max_num_seqs default), and fewer where the
  # KV cache holds fewer; but never fewer than the instance's share of the global batch, which
  # the simulated engine decodes all at once (a smaller value is raised to that share).
  c.sim.max_slots = 256
  c.sim.gen_tps = "1,2,4,8"  # generation tensor-parallel degrees tried
  c.sim.offload_frozen = True  # reference/reward/critic weights loaded from host when used
  # The AdamW state in host memory while the instances generate (the trainer's
  # optim.offload_during_rollout); False: the whole training state stays beside generation
  c.sim.offload_optimizer = False
  c.sim.search_time_s = 2.0  # fused-schedule search budget per distinct pipeline problem
  # asynchronous PPO (pipe_rlhf_async, plan_search's async plan): updates the generating policy
  # lags behind; it sets the lag, not the simulated time (docs/simulator.md)
  c.sim.staleness = 1
  c.sim.async_split_unit = 0  # generation-group sizes tried in steps of this (0: a node, ...)
  # plan search: only plans the trainer runs as simulated (sim/plan_search.trainer_refusal)
  c.sim.trainer_runnable = False

  c.calibration = ""  # calibration JSON whose measured op costs replace the formulas
  c.figure_setting = -1  # setting drawn in the timeline and Gantt figures (-1: the last)

  c.validate = ml_collections.ConfigDict()  # predicted vs measured (sim/validation.py)
  c.validate.calibration = ""  # calibration for both benches ("": each workdir's calibration.json)
  c.validate.bench_generation_workdir = ""  # workdir of experiments/bench_generation.py
  c.validate.bench_pipeline_workdir = ""  # workdir of experiments/bench_pipeline.py
  # workdir of experiments/bench_decode.py on an accelerator: predicted uncalibrated, from the
  # matching hardware preset and the efficiencies above, and by the decode model fitted to its
  # steps (sim/decode_fit.py)
  c.validate.bench_decode_workdir = ""
  # more bench_decode result files in that workdir for the fit (the same model at other depths;
  # missing ones are skipped), comma-separated
  c.validate.bench_decode_extra = "result_11_layers.json"

  if arg == "vllm_sync":
    # A vLLM-class engine whose scheduler is not overlapped with the GPU: vLLM v0.5.3 spent 29 %
    # of a step scheduling against 38 % on the GPU (vLLM blog, 2024-09-05; sim/cost_model.py).
    # Our own engine's measured decode costs instead: --config.calibration=FILE with a
    # decode_fit (docs/simulator.md).
    c.efficiency.decode_host_overhead = 29.0 / 38.0
  elif arg == "quick":
    c.pairs = "llama-13b/llama-13b"
    c.max_new_tokens = "512"
    c.num_devices = 64
    c.sim.search_time_s = 0.5
    c.sim.threshold_candidates = "0.1,0.3"
    c.sim.gen_tps = "4,8"
  elif arg != "paper":
    raise ValueError(f"unknown config variant {arg!r}; expected 'paper', 'vllm_sync' or "
                     "'quick'")
  return c
