#!/bin/bash
# Prepared for the next session that is lent a GPU (about 10 min of a 15 min budget), from the
# repository root with `wheels/` (the ml-collections wheel) carried:
#   bash experiments/results/h100_decode_variants/next_gpu.sh
# Everything lands in /tmp/res and comes back as $OUT/res.tgz (the device returns at most 8
# files), with the log's summary lines printed last. Order: what the open issues need most.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
D=experiments/results/h100_decode_variants
R=/tmp/res; mkdir -p $R/hlo; L=$R/log.txt
trap 'tar czf $OUT/res.tgz -C $R . ; cp $L $OUT/log.txt' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > $R/nvidia_smi.txt 2>&1
# 1. Issue 26's acceptance run: the bench itself (decode at 1/16/128 with configs/bench_decode.py
#    :1b's attention="auto" and steps_per_check=128, the HF peer in the same call, the update's
#    MFU). The CPU-only parts run small here (scan compile and capacity scaling).
date >> $L
timeout 330 python3 -m experiments.bench_decode --config=configs/bench_decode.py:1b \
  --config.scan_compile_layers=2,4 --config.capacities=512,1024 --workdir=$R/bench >> $L 2>&1
# 2. Does the Pallas decode kernel compile through Triton and match the reference there?
date >> $L
OUT=$R timeout 120 python3 $D/diag.py kernel >> $L 2>&1
# 3. The opt-in Pallas decode kernel against the static path, with the optimised decode HLO of
#    each point (what is the one KV-cache copy in the GPU chunk's temporaries? how many kernels
#    per layer at batch 1?).
date >> $L
OUT=$R DUMP_HLO=$R/hlo TAG=pallas VARIANTS=pallas:c,auto:c timeout 240 \
  python3 $D/diag.py decode >> $L 2>&1
date >> $L
grep -E "^(DECODE|TRAIN|PEER|KERNEL)|batch +[0-9]+:|ppo update:|peer|Error" $L | tail -40
