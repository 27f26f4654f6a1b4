#!/bin/bash
# Session (bd), 2026-12-04: the session's one H200, 15 device-minutes in all. From the repository
# root with `wheels/` (the ml-collections wheel) carried:
#   STEPS=0156 bash experiments/results/h200_2026-12-04/run_gpu.sh    # call 1
#   STEPS=289  bash experiments/results/h200_2026-12-04/run_gpu.sh    # call 2, with the time left
# Step numbers as in ../h100_pallas_decode/next_gpu.sh, whose steps 3, 4 and 7 (never run) are
# here too since 2026-12-06. Every file lands straight in $OUT (no archive at exit), so a call
# cut at its limit still brings back what it finished.
# Changed after the runs, for the next session (README.md): `timeout -k 10` (a SIGTERM waits
# for Python, which an XLA compile holds); plan_check itself sets jax's mock topology from
# JAX_MOCK_GPU_TOPOLOGY (call 4 used a wrapper for that); the fused schedules the CPU searched
# for steps 6 and 9 are unpacked from schedules/ here (they were copied from a gpu_prep/ made by
# hand: without it steps 6 and 9 were skipped with nothing in log.txt).
# Next session (15 device-minutes, the machine's start-up included): STEPS=09 first (<= 580 s:
# the long compile alone, its timeout inside the call's 600 s), then with what is left STEPS=6347
# (<= 430 s) or a part of it; step 8 last, alone (it did not compile in 229 s on the H200).
set -u
STEPS=${STEPS:-0156}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
D=experiments/results/h100_decode_variants
R=$OUT; L="$OUT/log.txt"
echo "STEPS=$STEPS $(git rev-parse HEAD 2>/dev/null)" >> "$L"
seed_schedules() {  # $1: workdir; $2: the CPU's searched schedule for it, under schedules/
  local f ok=1 files=(experiments/results/h200_2026-12-04/schedules/"$2"/*.json.gz)
  [[ -f "${files[0]}" ]] && mkdir -p "$1/cache/schedules" || ok=0
  for f in "${files[@]}"; do
    [[ $ok == 1 ]] && { gunzip -c "$f" > "$1/cache/schedules/$(basename "${f%.gz}")" || ok=0; }
  done
  [[ $ok == 1 ]] || echo "seed_schedules $2: could not unpack the schedules" >> "$L"
  [[ $ok == 1 ]]
}
if [[ $STEPS == *0* ]]; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,memory.total \
    --format=csv > "$R/nvidia_smi.txt" 2>&1
  timeout -k 10 60 python3 -c "import jax; print(jax.__version__, jax.devices()[0].device_kind, jax.devices()[0].memory_stats())" \
    >> "$R/nvidia_smi.txt" 2>&1
  # perf/hlo_flops.py on the GPU's HLO: a matmul through cuBLAS (or a Triton fusion's dot)
  # should count 2*m*n*k exactly.
  timeout -k 10 60 python3 -c "
import jax, jax.numpy as jnp
from rlhfuse_jax.perf import hlo_flops
x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 1024), jnp.bfloat16)
c = hlo_flops.analyze(jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text())
print('GEMM_FLOPS counted', c.flops, 'expected', 2 * 256 * 512 * 1024, 'uncounted',
      c.uncounted_calls)" >> "$L" 2>&1
fi
# m. Call 1's step 6 saw 1 device under JAX_MOCK_GPU_TOPOLOGY=1x8x1 (jax 0.11.2, CUDA 13):
#    what does each way of asking for the mock give?
if [[ $STEPS == *m* ]]; then
  for v in "JAX_MOCK_GPU_TOPOLOGY=1x8x1" "JAX_MOCK_GPU_TOPOLOGY=1x1x8" "JAX_MOCK_NUM_GPU_PROCESSES=8" \
      "MOCK_NUM_GPU_PROCESSES=8"; do
    env $v timeout -k 10 40 python3 -c "
import jax
from jax._src import xla_bridge as xb
print('MOCK $v', jax.device_count(), jax.local_device_count(), jax.process_count(),
      [n for n in dir(xb) if 'MOCK' in n.upper()], getattr(jax.config, 'jax_mock_gpu_topology', None))" 2>&1 |
      grep -v "^W\|^I" | tail -2 >> "$L"
  done
fi
# 1. The bench as configured (attention "auto": the Pallas kernel on one GPU; the update at 32
#    sequences of 512, not yet run through the bench on a GPU): issue 26's figures on an H200.
[[ $STEPS == *1* ]] && date >> "$L" && timeout -k 10 210 python3 -m experiments.bench_decode \
  --config=configs/bench_decode.py:1b --config.scan_compile_layers=2,4 \
  --config.capacities=512,1024 --config.peer=none --workdir="$R/bench" >> "$L" 2>&1
# 5. Issue 25: the 1-device 7B plan (2 layers per model), compiled here as on the CPU.
[[ $STEPS == *5* ]] && date >> "$L" && timeout -k 10 90 python3 -m experiments.plan_check \
  --config=configs/plan_check.py:7b_host8 --config.pp=1 --config.critic_pp=1 --config.gen_tp=1 \
  --config.gen_slots=16 --config.layers=2 --config.minibatch_size=1 --config.attention=auto \
  --workdir="$R/plan_gpu" >> "$L" 2>&1
# 6. Issue 25: the 7B-on-8-GPUs plan (pp 8, 8 layers per model) compiled for 8 H200s through
#    jax's mock topology (this process is host 0 of 8 one-GPU hosts; NCCL mocked; nothing runs).
[[ $STEPS == *6* ]] && date >> "$L" && seed_schedules "$R/plan_gpu8" plan_gpu8 &&
  JAX_MOCK_GPU_TOPOLOGY=1x8x1 timeout -k 10 150 python3 -m experiments.plan_check \
  --config=configs/plan_check.py:7b_host8 --config.attention=auto --config.layers=8 \
  --workdir="$R/plan_gpu8" >> "$L" 2>&1
# 2. Batch 1 streamed the weights at 1.09 TB/s against 1.64 at batch 16 on the H100: XLA:GPU
#    runs half of the batch-1 matmuls as Triton reduction fusions. Do cuBLAS GEMMs do better?
[[ $STEPS == *2* ]] && date >> "$L" && OUT=$R TAG=cublas VARIANTS=auto:c BATCHES=1,16,128 \
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout -k 10 100 python3 "$D"/diag.py decode >> "$L" 2>&1
# 3. Where the batch-1 regime ends: batch 2, 4, 8 (same engine as step 1).
[[ $STEPS == *3* ]] && date >> "$L" && OUT=$R TAG=small VARIANTS=auto:c BATCHES=2,4,8 \
  timeout -k 10 100 python3 "$D"/diag.py decode >> "$L" 2>&1
# 4. model.fused_projections (q/k/v and gate/up as one matmul each): fewer kernels per step?
[[ $STEPS == *4* ]] && date >> "$L" && OUT=$R TAG=fused VARIANTS=auto+fp:c BATCHES=1,16,128 \
  timeout -k 10 100 python3 "$D"/diag.py decode >> "$L" 2>&1
# 7. optim.offload_during_rollout's moves on this GPU (PCIe): docs/usage.md "Memory at scale"
#    assumes >= 0.14 s for 65B/33B's 2 x 4.6 GB at 64 GB/s; this measures the GB/s each way.
[[ $STEPS == *7* ]] && date >> "$L" && GB=8 timeout -k 10 60 python3 \
  experiments/results/h100_pallas_decode/offload_probe.py > "$R/offload.json" 2>> "$L" &&
  cat "$R/offload.json" >> "$L"
# 8. The ppo_llama 7B preset as its trainer runs it, compiled for 8 H200s (mock topology).
[[ $STEPS == *8* ]] && date >> "$L" && JAX_MOCK_GPU_TOPOLOGY=1x8x1 timeout -k 10 330 python3 -m \
  experiments.plan_check --config=configs/plan_check.py:llama/7b --config.attention=auto \
  --workdir="$R/plan_llama7b_gpu8" >> "$L" 2>&1
# 9. The fused 13B preset (8 stages x tensor 4, the searched fused schedule) for 32 H200s.
[[ $STEPS == *9* ]] && date >> "$L" && seed_schedules "$R/plan_llama_fused13b_gpu32" fused13b &&
  JAX_MOCK_GPU_TOPOLOGY=1x32x1 timeout -k 10 440 python3 -m experiments.plan_check \
  --config=configs/plan_check.py:llama/fused/13b --config.attention=auto \
  --workdir="$R/plan_llama_fused13b_gpu32" >> "$L" 2>&1
date >> "$L"
# The summary: the bench's (not its per-run timings), diag.py's DECODE lines, every program's
# row of plan_check's table, its verdict, the train step's figures as soon as it compiled (a
# step cut later keeps them), and whether a seeded schedule was used (tests/test_gpu_script.py
# checks these against the current binaries).
S="GEMM_FLOPS|to_host_GBps|^MOCK|^DECODE|\] batch +[0-9]+:|ppo update:.*MFU|verdict:|exit status"
S+="|\] [a-z_]+ +[0-9].* (True|False) |fused schedule|per device: argument|seed_schedules"
S+="|Error|rror:"
grep -E "$S" "$L" | tail -40
