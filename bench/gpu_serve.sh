#!/usr/bin/env bash
# The render service on two GPUs of one host (bench/serve_gpu.py), sdxl-random fp16, --compile off: job J
# (IMAGES=32 images at 1024x1024, STEPS=20, four batches of 8) through `bcg render` on GPU 0, then
# `bcg serve --gpus 0` (a warm worker: seconds from a job's submission to its first lease, target <= 1 s;
# images/s against the render's steady images/s, target >= 0.95x), then `bcg serve --gpus 0,1` (one job per
# worker at once against one worker's job, target >= 1.85x; and one job alone). Each phase is a step with its
# own limit and writes its JSON as it goes, so a limit loses only the phase it stops. Everything comes back as
# $OUT/logs.tgz (each phase's JSON, the render's report, the servers' logs and /metrics). Budget: 540 s.
# Usage: OUT=/some/dir [BUDGET=540] [IMAGES=32] [STEPS=20] bash bench/gpu_serve.sh
#        SMOKE=1 OUT=/tmp/x bash bench/gpu_serve.sh   (CPU, tiny preset, two CPU workers: a minute)
set -uo pipefail
export BCG_CACHE=${BCG_CACHE:-/tmp/bcg} PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=$(mktemp -d /tmp/serve-results.XXXX); mkdir -p "$BCG_CACHE" "$OUT"
BUDGET=${BUDGET:-540}
ARGS="--gpus 0,1 --model sdxl-random --images ${IMAGES:-32} --steps ${STEPS:-20} --size 1024x1024"
[ "${SMOKE:-0}" = 1 ] && ARGS="--gpus cpu,cpu --model tiny --images 8 --steps 2 --size 256x256"
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout -k 30 $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
phase() {
  [ $1 -lt 30 ] && { echo "$2: FAILED: not run, ${1}s of the budget left" >> $R/serve_gpu.log; return; }
  step $1 python bench/serve_gpu.py $ARGS --phases $2 --deadline-s $(($1 - 10)) --out $R >> $R/serve_gpu.log 2>&1
}
pack() {
  for f in $R/*-server.pid; do [ -f "$f" ] && kill -KILL -- -$(cat "$f") 2>/dev/null; done  # a killed script's server
  tar czf "$OUT/logs.tgz" -C "$R" .
}
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; python -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)"; } > $R/machine.txt 2>&1
phase 150 render
phase 200 serve1
phase $((BUDGET - 15 - SECONDS)) serve2
grep -E "^(==|render|serve1|serve2)" $R/serve_gpu.log; grep -hiE "error|traceback|warning" $R/*-server.log | tail -n 12
! grep -q ": FAILED: " $R/serve_gpu.log  # the exit status: 1 when a phase failed
