#!/usr/bin/env bash
# Two GPUs of one host, two independent measurements side by side (each on its own GPU and cache):
# GPU 0 runs bench/gpu_session.sh (compiled kernels carried in $ART), GPU 1 bench/gpu_draft.sh.
# Usage: ART=.art OUT=/some/dir [LIMIT=300] [PARTS=...] bash bench/gpu_pair.sh
set -uo pipefail
mkdir -p $OUT/compiled $OUT/draft
(export CUDA_VISIBLE_DEVICES=0; OUT=$OUT/compiled R=/tmp/results-compiled LIMIT=${LIMIT:-300} bash bench/gpu_session.sh \
  > $OUT/compiled/stdout.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 BCG_CACHE=/tmp/bcg-draft; OUT=$OUT/draft BUDGET=${LIMIT:-300} NO_TESTS=${NO_TESTS:-} \
  bash bench/gpu_draft.sh > $OUT/draft/stdout.log 2>&1) &
wait
tail -n 30 $OUT/compiled/stdout.log; tail -n 40 $OUT/draft/stdout.log
