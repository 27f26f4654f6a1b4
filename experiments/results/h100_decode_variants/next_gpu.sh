#!/bin/bash
# Prepared for the next session that is lent a GPU (about 10 min of a 15 min budget), from the
# repository root with `wheels/` (the ml-collections wheel) carried:
#   bash experiments/results/h100_decode_variants/next_gpu.sh
# Everything lands in /tmp/res and comes back as $OUT/res.tgz (the device returns at most 8
# files), with the log's summary lines printed last. Order: what the open issues need most.
# The steps' time limits add up to more than one call's 10 minutes: run STEPS=2345 (at most
# 9.5 min) and then, if device time is left, STEPS=1. The log is written straight to $OUT so
# that it comes back even if the call is cut.
set -u
STEPS=${STEPS:-12345}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
D=experiments/results/h100_decode_variants
R=/tmp/res; mkdir -p $R/hlo; L=$OUT/log.txt
trap 'tar czf $OUT/res.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > $R/nvidia_smi.txt 2>&1
# 1. Issue 26's acceptance run: the bench itself (decode at 1/16/128 with configs/bench_decode.py
#    :1b's attention="auto" and steps_per_check=128, the update's MFU over 5 runs). The CPU-only
#    parts run small here (scan compile and capacity scaling); the HF peer runs apart (step 5)
#    so that a slow torch compile cannot cost this run its result.json.
[[ $STEPS == *1* ]] && date >> $L && timeout 300 python3 -m experiments.bench_decode \
  --config=configs/bench_decode.py:1b --config.scan_compile_layers=2,4 \
  --config.capacities=512,1024 --config.peer=none \
  --workdir=$R/bench >> $L 2>&1
# 2. XLA:GPU's DotMerger (default threshold 32 MB) merges dots that share an input (q/k/v,
#    gate/up) into one dot against a concatenation of the weights: is that concatenation done
#    every decode step? The same decode with merging off, HLO kept (look for `concatenate`).
[[ $STEPS == *2* ]] && date >> $L && OUT=$R DUMP_HLO=$R/hlo TAG=nomerge VARIANTS=auto:c \
  BATCHES=1,128 XLA_FLAGS=--xla_gpu_dot_merger_threshold_mb=0 timeout 110 \
  python3 $D/diag.py decode >> $L 2>&1
# 3. Does the Pallas decode kernel compile through Triton and match the reference there?
[[ $STEPS == *3* ]] && date >> $L && OUT=$R timeout 90 python3 $D/diag.py kernel >> $L 2>&1
# 4. The opt-in Pallas decode kernel in the engine (compare with step 1's auto rows), with the
#    optimised decode HLO of each point (the KV-cache copy in the GPU chunk's temporaries).
[[ $STEPS == *4* ]] && date >> $L && OUT=$R DUMP_HLO=$R/hlo TAG=pallas VARIANTS=pallas:c \
  timeout 150 python3 $D/diag.py decode >> $L 2>&1
# 5. The HF peer (transformers' own compiled static-cache generation) at 1 / 16 / 128.
[[ $STEPS == *5* ]] && date >> $L && OUT=$R BATCHES=1,16,128 REPEATS=2 timeout 200 \
  python3 $D/diag.py peer >> $L 2>&1
date >> $L
grep -E "^(DECODE|TRAIN|PEER|KERNEL)|batch +[0-9]+:|ppo update:|peer|Error" $L | tail -40
