#!/usr/bin/env bash
# A GPU call on an empty cache: the bench job's first render with --compile auto against --compile off
# (its kernels then go on compiling in the background), the plain GPU tests meanwhile, then (waiting for
# those builds) compiled against plain step times and the kernel profile. Everything measured comes back
# as $OUT/logs.tgz; the artifacts as $OUT/art.tgz.* (15 MB pieces: `cat art.tgz.* | tar xz` in a cache's
# compiled/ folder), for a later call to carry (bench/gpu_session.sh).
# Usage: OUT=/some/dir bash bench/gpu_first.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
R=/tmp/results; mkdir -p $BCG_CACHE/compiled $R
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
pack() {
  (cd $BCG_CACHE/compiled && ls *.pt2 >/dev/null 2>&1 && tar czf - *.pt2 *.ok *.build.json | split -b 15m - $OUT/art.tgz.)
  cp $BCG_CACHE/compiled/*.log $R/ 2>/dev/null; tar czf $OUT/logs.tgz -C $R .
}
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; } > $R/machine.txt 2>&1
step 200 python -m storyboard_cli bench jobs/bench.yaml --parts first_render --results $R > $R/first_render.log 2>&1
mv $R/*.json $R/first_render.json 2>/dev/null; mv $R/*.md $R/first_render.md 2>/dev/null; rm -f $R/*.svg
step 150 python -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_lora.py > $R/gpu_tests.log 2>&1
step $((575 - SECONDS)) python -m storyboard_cli bench jobs/bench.yaml --parts curves,profile --results $R > $R/micro.log 2>&1
tail -n 3 $R/first_render.log $R/gpu_tests.log; tail -n 40 $R/micro.log
