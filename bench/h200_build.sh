#!/usr/bin/env bash
# First call of a GPU session: does a compiled artifact built on this machine load here (the tiny
# model, about a minute), while the SDXL artifacts of jobs/bench.yaml build side by side
# (`capture --warm`, which then loads, checks and captures every shape). The artifacts are copied
# to $OUT so that a later call can carry them (ART=... bash bench/h200_session.sh).
# Usage: OUT=/some/dir bash bench/h200_build.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p $BCG_CACHE/compiled
( SECONDS=0; timeout 530 python -m storyboard_cli capture jobs/bench.yaml --warm --steps 5 > $OUT/capture.log 2>&1
  echo "capture rc=$? after ${SECONDS}s" >> $OUT/capture.log ) &
timeout 200 python -X faulthandler bench/aoti_load_check.py /tmp/aoti-check cuda > $OUT/load_check.log 2>&1
echo "rc=$? at ${SECONDS}s" >> $OUT/load_check.log
if ! grep -q "loads in a child process: True" $OUT/load_check.log; then  # where does it crash?
  p=$(ls /tmp/aoti-check/*.pt2 | head -1)
  code='import sys, torch._inductor as i; i.aoti_load_package(sys.argv[1], run_single_threaded=sys.argv[2] == "1"); print("loaded")'
  if command -v gdb >/dev/null; then
    timeout 120 gdb -batch -ex run -ex bt --args python -c "$code" "$p" 1 > $OUT/diag.log 2>&1
  fi
  for single in 1 0; do timeout 60 python -X faulthandler -c "$code" "$p" $single >> $OUT/diag.log 2>&1; echo "single=$single rc=$?" >> $OUT/diag.log; done
fi
wait
cp $BCG_CACHE/compiled/*.pt2 $OUT/ 2>/dev/null; ls -la $BCG_CACHE/compiled >> $OUT/capture.log
tail -5 $OUT/*.log
