#!/usr/bin/env bash
# The graph pool and capture seconds of draft mode's kinds on one GPU (sdxl-random, fp16, --compile off):
# bench/pool_probe.py at 8 x 1024x1024 in fresh processes (bcg's expandable segments against torch's default
# allocator), then `bcg bench jobs/bench.yaml --parts draft_capture` (today's graphs, then the draft's; and
# all in one prepare against today's alone). Results: $OUT/pool.tgz.
# Usage: OUT=/some/dir [BUDGET=520] [NO_PROBES=1 | NO_CAPTURE=1] bash bench/gpu_pool.sh
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 BCG_CACHE=${BCG_CACHE:-/tmp/bcg-pool}
R=$(mktemp -d /tmp/pool-results.XXXX); mkdir -p "$OUT"
pack() { tar czf "$OUT/pool.tgz" -C "$R" .; }
trap pack EXIT
BUDGET=${BUDGET:-520}
RESERVE=$([ -n "${NO_CAPTURE:-}" ] && echo 0 || echo 200)  # seconds kept for the bench part
probe() {  # name, order, allocator settings
  [ -n "${NO_PROBES:-}" ] && return
  local left=$((BUDGET - SECONDS - RESERVE)); [ $left -lt 30 ] && { echo "probe $1 skipped: no time" >> $R/walls.txt; return; }
  env ${3:+PYTORCH_CUDA_ALLOC_CONF=$3} timeout $((left < 90 ? left : 90)) python bench/pool_probe.py $R/probe-$1.json --order $2 \
    > $R/probe-$1.log 2>&1
  echo "probe $1 rc=$? at ${SECONDS}s" >> $R/walls.txt
}
probe expandable write,read,cond-write,cond-read ""  # bcg's allocator settings (models/loader.py cuda_allocator)
probe segments write,read,cond-write,cond-read expandable_segments:False  # torch's default: a segment per large tensor
probe segments-today-then-deepcache full,write,read expandable_segments:False
if [ -z "${NO_CAPTURE:-}" ]; then
  timeout $((BUDGET - SECONDS)) python -m storyboard_cli bench jobs/bench.yaml --parts draft_capture --results $R/bench \
    > $R/draft_capture.log 2>&1
  echo "draft_capture rc=$? at ${SECONDS}s" >> $R/walls.txt
fi
cat $R/walls.txt; for f in $(ls $R/probe-*.log 2>/dev/null); do echo "== $f"; grep -v Warning $f | tail -n 25; done
grep -h "draft capture" $R/draft_capture.log 2>/dev/null; grep -h -A4 "^Capture of" $R/bench/*.md 2>/dev/null
