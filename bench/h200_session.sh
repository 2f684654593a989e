#!/usr/bin/env bash
# The GPU measurements behind docs/PERFORMANCE.md ("Compiled kernels"), in one session on one H200:
# compiled-vs-plain step times and kernel profiles, the bench job (diffusers loop vs bcg with the
# compiled kernels from the cache), then the GPU tests. Artifacts built earlier are read from $ART.
# First, a one-minute check that a compiled artifact built on this machine loads here at all.
# Usage: ART=.art OUT=/some/dir bash bench/h200_session.sh
# $ART holds artifacts built with the current options by an earlier call on the same kind of machine:
#   python -m storyboard_cli capture jobs/bench.yaml --warm   (builds them side by side, then captures),
#   then copy $BCG_CACHE/compiled/*.pt2 to $OUT to carry them. Artifacts are keyed by the compile
#   options: ones built before an option changed are never used under the new key.
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p $BCG_CACHE/compiled && cp $ART/*.pt2 $BCG_CACHE/compiled/
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
step 150 python bench/aoti_load_check.py /tmp/aoti-check cuda > $OUT/load_check.log 2>&1
step 130 python bench/probe_compile.py time $BCG_CACHE/compiled $OUT/probe.json --profile > $OUT/probe.log 2>&1
step 330 python -m storyboard_cli bench jobs/bench.yaml --parts a_diffusers,e_bcg_compiled,lora --results $OUT > $OUT/bench.log 2>&1
step 90 python -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_lora.py > $OUT/gpu_tests.log 2>&1
[ $SECONDS -lt 360 ] && step $((460 - SECONDS)) python -m pytest -q -m gpu tests/test_gpu_compiled.py > $OUT/gpu_compiled_tests.log 2>&1
tail -3 $OUT/*.log
