#!/bin/bash
# Superseded (2026-12-06): every step still to run (3, 4, 6-9) is in
# ../h200_2026-12-04/run_gpu.sh, which writes straight to $OUT, stops a compiling step with
# `timeout -k`, and keeps each call within 600 s; this script did none of these (a call cut at
# its limit lost /tmp/res). Kept as the record of the plan of 2026-12-03; it refuses to run.
echo "superseded: run experiments/results/h200_2026-12-04/run_gpu.sh (its README)" >&2; exit 2
# 2026-12-04 (bd): steps 0-2 and 5 ran on an H200; 6, 8 and 9 are ../h200_2026-12-04/run_gpu.sh
# now, with the fixes step 6 needed (its README: "For the next GPU session"); 3, 4 and 7 not yet.
# Prepared for the next session that is lent a GPU (one call of at most ~10 min), from the
# repository root with `wheels/` (the ml-collections wheel) carried:
#   bash experiments/results/h100_pallas_decode/next_gpu.sh
# Results land in /tmp/res and come back as $OUT/res.tgz; the log goes straight to $OUT.
# Order of calls (15 device-minutes a session, start-up included): first STEPS=1567 (the bench
# for issue 26, the two compiles for issue 25, the offload probe; <= 580 s), then, with the time
# left, STEPS=23489 (9: the fused 13B preset for 32 mocked GPUs).
set -u
STEPS=${STEPS:-1567}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
D=experiments/results/h100_decode_variants
R=/tmp/res; mkdir -p $R; L=$OUT/log.txt
trap 'tar czf $OUT/res.tgz -C $R .' EXIT
# memory.total and JAX's bytes_limit: sim/hardware.py takes "80 GB" as 80e9 bytes, the
# datasheet's figure; if the card has 80 GiB the simulator under-counts HBM by 7 %.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,memory.total \
  --format=csv > $R/nvidia_smi.txt 2>&1
python3 -c "import jax; print(jax.devices()[0].memory_stats())" >> $R/nvidia_smi.txt 2>&1
# 0. perf/hlo_flops.py on the GPU's HLO (written without one, 2026-12-03): a matmul's FLOPs,
#    counted through cuBLAS's custom-call (or a Triton fusion's dot), should be 2*m*n*k exactly.
python3 -c "
import jax, jax.numpy as jnp
from rlhfuse_jax.perf import hlo_flops
x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 1024), jnp.bfloat16)
c = hlo_flops.analyze(jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text())
print('GEMM_FLOPS counted', c.flops, 'expected', 2 * 256 * 512 * 1024, 'uncounted',
      c.uncounted_calls)" >> $L 2>&1
# 1. The bench as configured (attention "auto" = the kernel on one GPU, the update at 32
#    sequences): the defaults' own figures for issue 26.
[[ $STEPS == *1* ]] && date >> $L && timeout 240 python3 -m experiments.bench_decode \
  --config=configs/bench_decode.py:1b --config.scan_compile_layers=2,4 \
  --config.capacities=512,1024 --config.peer=none --workdir=$R/bench >> $L 2>&1
# 2. Batch 1 streams the weights at 1.09 TB/s against 1.64 at batch 16: XLA:GPU runs half of
#    the batch-1 matmuls as Triton reduction fusions. Do cuBLAS GEMMs do better?
[[ $STEPS == *2* ]] && date >> $L && OUT=$R TAG=cublas VARIANTS=auto:c BATCHES=1,16,128 \
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 120 python3 $D/diag.py decode >> $L 2>&1
# 3. Where the batch-1 regime ends: batch 2, 4, 8 (same engine as step 1).
[[ $STEPS == *3* ]] && date >> $L && OUT=$R TAG=small VARIANTS=auto:c BATCHES=2,4,8 \
  timeout 120 python3 $D/diag.py decode >> $L 2>&1
# 4. model.fused_projections (q/k/v and gate/up as one matmul each): fewer kernels per step?
[[ $STEPS == *4* ]] && date >> $L && OUT=$R TAG=fused VARIANTS=auto+fp:c BATCHES=1,16,128 \
  timeout 120 python3 $D/diag.py decode >> $L 2>&1
# 5. Issue 25: plan_check's CPU figures against
#    the GPU's compile of the same 1-device 7B plan (2 layers, attention auto = the kernel).
#    CPU, 2026-11-26, cpu_upcast=per_layer: decode arg 2.14 / temp 1.33 GB (as compiled 3.48),
#    inference 1.33 / 1.95 (3.86), train_step 7.22 / 7.82 GB.
[[ $STEPS == *5* ]] && date >> $L && timeout 120 python3 -m experiments.plan_check \
  --config=configs/plan_check.py:7b_host8 --config.pp=1 --config.critic_pp=1 --config.gen_tp=1 \
  --config.gen_slots=16 --config.layers=2 --config.minibatch_size=1 --config.attention=auto \
  --workdir=$R/plan_gpu >> $L 2>&1
# 6. Issue 25's multi-device GPU compile: jax's mock topology turns the one
#    GPU into host 0 of 8 one-GPU hosts (NCCL mocked; programs are compiled, never run), so the
#    7B-on-8-GPUs plan compiles for 8 H100s: the pp-8 fused train step and the tp-8 decode
#    instance with the Pallas kernel in its shard_map. 8 layers per model (1 per stage) to keep
#    the compile short. CPU, 2026-11-26, same command without the variable (cpu_upcast
#    per_layer): train_step arg 2.73 / temp 10.09 / peak 12.81 GB, repl 2.95; decode 2.08 / 0.18
#    / 2.26 (1.05 temp as compiled), repl 0.95; inference 0.47 / 0.77 / 1.24, repl 1.03.
[[ $STEPS == *6* ]] && date >> $L && JAX_MOCK_GPU_TOPOLOGY=1x8x1 timeout 200 python3 -m \
  experiments.plan_check --config=configs/plan_check.py:7b_host8 --config.attention=auto \
  --config.layers=8 --workdir=$R/plan_gpu8 >> $L 2>&1
# 7. optim.offload_during_rollout's moves on this GPU (PCIe): docs/usage.md "Memory at scale"
#    assumes >= 0.14 s for 65B/33B's 2 x 4.6 GB at 64 GB/s (float32 copy and moments, split by
#    zero1, since 2026-11-29 (v)); this measures the GB/s each way.
[[ $STEPS == *7* ]] && date >> $L && GB=8 timeout 60 python3 \
  experiments/results/h100_pallas_decode/offload_probe.py > $R/offload.json 2>> $L &&
  cat $R/offload.json >> $L
# 8. The ppo_llama 7B preset as its trainer runs it (scanned layers, 2 samples per micro-batch,
#    a float32 copy and moments of the bf16 weights, generation and scoring on 8 one-GPU
#    instances, the optimizer state offloaded meanwhile) compiled for 8 H100s (mock topology, as
#    step 6). CPU, 2026-11-29 (v), same command without the variable: train_step arg 23.36 /
#    temp 35.09 / peak 58.45 GB, repl 1.03; decode 65.02 / 1.41 / 66.42 (69.76 with the state);
#    inference 13.48 / 2.25 / 15.73. Second call: STEPS=23489.
[[ $STEPS == *8* ]] && date >> $L && JAX_MOCK_GPU_TOPOLOGY=1x8x1 timeout 200 python3 -m \
  experiments.plan_check --config=configs/plan_check.py:llama/7b --config.attention=auto \
  --workdir=$R/plan_llama7b_gpu8 >> $L 2>&1
# 9. The fused 13B preset (pipelined: 8 stages x tensor 4, the searched fused schedule, the
#    float32 optimizer state split by zero1) for 32 H100s. CPU, 2026-11-29 (v): train_step arg
#    11.41 / temp 16.36 / peak 27.77 GB, repl 2.22, collectives 237.34 GB; decode 26.64 / 0.49 /
#    27.13 (28.84 with the state)
#    (docs/results.md "Fused presets"). Compare the collective bytes: CPU 237.34 GB as compiled,
#    122 GB at the program's widths (program_collective_bytes, 2026-11-29 (w)), which should be
#    the GPU's up to reduce-scatters that XLA:CPU runs as all-reduces (steps 8-9 on a GPU have
#    no program_collective_* fields: the GPU compiles them as the program asks).
[[ $STEPS == *9* ]] && date >> $L && JAX_MOCK_GPU_TOPOLOGY=1x32x1 timeout 300 python3 -m \
  experiments.plan_check --config=configs/plan_check.py:llama/fused/13b \
  --config.attention=auto --workdir=$R/plan_llama_fused13b_gpu32 >> $L 2>&1
date >> $L
grep -E "GEMM_FLOPS|to_host_GBps|^DECODE|batch +[0-9]+:|ppo update:.*MFU|(train_step|decode|inference) +[0-9]|Error" $L |
  tail -30
