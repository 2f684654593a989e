#!/usr/bin/env bash
# Second 2-GPU call: GPU 0 runs the LoRA part of the bench (realistic LoRA magnitudes) while GPU 1
# takes a backtrace of the compiled UNet package's crash at load (bench/segv_trace.c) and reruns the
# fixed GPU test; then jobs/bench.yaml on 1 GPU twice at once and on 2 GPUs (bench/two_gpus.sh bench).
# Usage: ART=.art OUT=/some/dir bash bench/h200_x2_session2.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
step() { local limit=$1 log=$2; shift 2; echo "== $* (at ${SECONDS}s)" >> $log; timeout $limit "$@" >> $log 2>&1; echo "== rc=$? at ${SECONDS}s" >> $log; }
( export CUDA_VISIBLE_DEVICES=0
  step 250 $OUT/lora.log python -m storyboard_cli bench jobs/bench.yaml --parts lora --results $OUT ) &
( export CUDA_VISIBLE_DEVICES=1
  gcc -shared -fPIC -o /tmp/segv_trace.so bench/segv_trace.c -ldl
  code='import sys, torch, torch._inductor as i; torch.zeros(1, device="cuda"); print("cuda up", flush=True); i.aoti_load_package(sys.argv[1], run_single_threaded=True); print("loaded")'
  LD_PRELOAD=/tmp/segv_trace.so step 170 $OUT/segv.log python -c "$code" $(ls $ART/unet-*.pt2 | head -1)
  step 60 $OUT/gpu_test.log python -m pytest -q -m gpu tests/test_gpu.py -k render_graph_equals_eager ) &
wait
step $((585 - SECONDS)) $OUT/two_gpus.log bash bench/two_gpus.sh bench
for f in $OUT/*.log; do echo "== $f"; tail -n 8 $f; done
