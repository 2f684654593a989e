#!/usr/bin/env bash
# Two GPUs of one host, an empty cache: GPU 1 builds the bench job's compiled kernels side by side (`bcg capture
# jobs/bench.yaml --warm --compile on`, then every shape captured, checked against eager and timed), while GPU 0 runs
# the graph, draft and LoRA GPU tests, then the compiled-path GPU tests, which wait for GPU 1's builds of the 1024x1024
# artifacts (one build per artifact, a lock) and load them. Results: $OUT/logs.tgz; the artifacts: $OUT/art.tgz.
# Usage: OUT=/some/dir [LIMIT=540] bash bench/gpu_verify.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export PYTEST_BCG_CACHE=/tmp/bcg BCG_LOG=info
R=$(mktemp -d /tmp/verify-results.XXXX); mkdir -p "$OUT" $BCG_CACHE
LIMIT=${LIMIT:-540}
pack() {
  ls -la --full-time $BCG_CACHE/compiled > $R/cache_at_end.txt 2>&1
  cp $BCG_CACHE/compiled/*.log $R/ 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$R" .
  (cd $BCG_CACHE/compiled 2>/dev/null && tar czf "$OUT/art.tgz" *.pt2 *.ok *.build.json 2>/dev/null)
}
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; } > $R/machine.txt 2>&1
(export CUDA_VISIBLE_DEVICES=1; start=$EPOCHREALTIME
 timeout $((LIMIT - 30)) python -m storyboard_cli capture jobs/bench.yaml --warm --compile on --steps 4 --json \
   > $R/capture.json 2> $R/capture.log
 echo "capture rc=$? wall_s=$(awk "BEGIN{print $EPOCHREALTIME - $start}")" >> $R/walls.txt) &
(export CUDA_VISIBLE_DEVICES=0
 timeout 200 python -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_draft.py tests/test_gpu_lora.py -p no:cacheprovider > $R/gpu_tests.log 2>&1
 echo "gpu tests rc=$? at ${SECONDS}s" >> $R/walls.txt
 timeout $((LIMIT - 20 - SECONDS)) python -m pytest -q -m gpu tests/test_gpu_compiled.py -p no:cacheprovider \
   > $R/gpu_compiled_tests.log 2>&1
 echo "compiled tests rc=$? at ${SECONDS}s" >> $R/walls.txt) &
wait
cat $R/walls.txt; tail -n 15 $R/gpu_tests.log; tail -n 25 $R/gpu_compiled_tests.log; tail -n 5 $R/capture.log
python bench/capture_table.py $R/capture.json
