#!/bin/bash
# The device call of 2026-11-26 (e), run from the repository root with `wheels/` (the
# ml-collections wheel) carried: bash experiments/results/h100_decode_variants/run_gpu.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
D=experiments/results/h100_decode_variants
L=$OUT/log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > $OUT/nvidia_smi.txt 2>&1
date >> $L
# Issue 25: the 1-device plan compiled for the GPU (the same command ran on the CPU here).
timeout 150 python3 -m experiments.plan_check --config=configs/plan_check.py:7b_host8 \
  --config.pp=1 --config.critic_pp=1 --config.gen_tp=1 --config.gen_slots=16 --config.layers=2 \
  --config.minibatch_size=1 --workdir=/tmp/pc1 >> $L 2>&1
cp /tmp/pc1/result.json $OUT/plan_check_gpu.json
date >> $L
TAG=default timeout 330 python3 $D/diag.py decode >> $L 2>&1
date >> $L
TRAIN=cudnn:8,cudnn:16 timeout 200 python3 $D/diag.py train >> $L 2>&1
date >> $L
XLA_FLAGS=--xla_gpu_enable_command_buffer= TAG=nocmdbuf VARIANTS=reference:c BATCHES=1 \
  timeout 100 python3 $D/diag.py decode >> $L 2>&1
date >> $L
timeout 200 python3 $D/diag.py peer >> $L 2>&1
date >> $L
grep -E "^(DECODE|TRAIN|PEER)|train_step |decode  |inference  |Error" $L | tail -40
