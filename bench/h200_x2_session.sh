#!/usr/bin/env bash
# A session on a 2-GPU H200 machine, using both GPUs side by side, then together:
#   GPU 1: why a compiled package crashes at load (bench/aoti_variants.py, on the SDXL artifacts in
#          $ART and on small models per option set); if the SDXL UNet loads, compiled vs plain step
#          times and profiles (bench/probe_compile.py);
#   GPU 0: the LoRA part of the bench (issue: LoRA per shot), then the GPU tests;
#   both:  jobs/bench.yaml on 2 GPUs against 1 (bench/two_gpus.sh bench).
# Usage: ART=.art OUT=/some/dir bash bench/h200_x2_session.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p $BCG_CACHE/compiled && cp $ART/*.pt2 $BCG_CACHE/compiled/
step() { local limit=$1 log=$2; shift 2; echo "== $* (at ${SECONDS}s)" >> $log; timeout $limit "$@" >> $log 2>&1; echo "== rc=$? at ${SECONDS}s" >> $log; }
( export CUDA_VISIBLE_DEVICES=1
  step 200 $OUT/variants.log python bench/aoti_variants.py $BCG_CACHE/compiled $OUT/variants.json
  grep -q SDXL_LOADS $OUT/variants.log && step $((330 - SECONDS)) $OUT/probe.log python bench/probe_compile.py time $BCG_CACHE/compiled $OUT/probe.json --profile ) &
( export CUDA_VISIBLE_DEVICES=0
  step 240 $OUT/lora.log python -m storyboard_cli bench jobs/bench.yaml --parts lora --results $OUT
  step $((340 - SECONDS)) $OUT/gpu_tests.log python -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_lora.py ) &
wait
step $((590 - SECONDS)) $OUT/two_gpus.log bash bench/two_gpus.sh bench
for f in $OUT/*.log; do echo "== $f"; tail -n 6 $f; done
