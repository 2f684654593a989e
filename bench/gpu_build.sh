#!/usr/bin/env bash
# First GPU call of a session: every compiled artifact jobs/bench.yaml needs, built cold by
# `bcg capture jobs/bench.yaml --warm` (side by side, one child per module and size), then captured,
# checked and timed; the plain GPU tests run meanwhile. Finished artifacts are copied to $OUT/art as
# they land, so a later call can carry them (ART=... bash bench/gpu_session.sh).
# Usage: OUT=/some/dir bash bench/gpu_build.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p $BCG_CACHE/compiled $OUT/art
( while true; do cp -n $BCG_CACHE/compiled/*.{pt2,ok,build.json,log,failed} $OUT/art/ 2>/dev/null; sleep 10; done ) &
copier=$!
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
{ nproc; free -g | head -2; nvidia-smi -L; } > $OUT/machine.txt 2>&1
step 200 python -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_lora.py > $OUT/gpu_tests.log 2>&1 &
tests=$!
step ${CAPTURE_LIMIT:-540} python -m storyboard_cli capture jobs/bench.yaml --warm --steps 5 > $OUT/capture.log 2>&1
wait $tests
kill $copier; cp -n $BCG_CACHE/compiled/*.{pt2,ok,build.json,log,failed} $OUT/art/ 2>/dev/null
tail -n 30 $OUT/capture.log; tail -n 5 $OUT/gpu_tests.log; cat $OUT/art/*.build.json 2>/dev/null
