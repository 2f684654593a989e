#!/usr/bin/env bash
# First call of a GPU session: builds the SDXL (sdxl-random, fp16) UNet and ControlNet artifacts side
# by side, checks in a child process that the first one done loads here (while the other builds; a
# crash gets a native backtrace, bench/segv_trace.c), then times compiled against plain inside CUDA graphs (bench/probe_compile.py)
# and copies the artifacts to $OUT so that a later call can carry them (ART=... bash bench/h200_session.sh).
# (The tiny model is no quicker check on a GPU: its compile took over 200 s, as many kernels as SDXL.)
# Usage: OUT=/some/dir bash bench/h200_build.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
DIR=$BCG_CACHE/compiled; mkdir -p $DIR
( timeout 400 python bench/probe_compile.py build controlnet $DIR > $OUT/build_controlnet.log 2>&1; echo "rc=$? at ${SECONDS}s" >> $OUT/build_controlnet.log
  p=$(ls $DIR/controlnet-*.pt2 2>/dev/null | head -1)
  [ -n "$p" ] || exit 0
  code='import sys, torch._inductor as i; i.aoti_load_package(sys.argv[1], run_single_threaded=True); print("loaded")'
  gcc -shared -fPIC -o /tmp/segv_trace.so bench/segv_trace.c -ldl  # a native backtrace if it crashes (no gdb there)
  LD_PRELOAD=/tmp/segv_trace.so timeout 120 python -c "$code" "$p" > $OUT/load_check.log 2>&1; echo "rc=$? at ${SECONDS}s" >> $OUT/load_check.log ) &
timeout 470 python bench/probe_compile.py build unet $DIR > $OUT/build_unet.log 2>&1; echo "rc=$? at ${SECONDS}s" >> $OUT/build_unet.log
wait
cp $DIR/*.pt2 $OUT/ 2>/dev/null
if grep -q "^loaded" $OUT/load_check.log 2>/dev/null; then
  timeout $((575 - SECONDS)) python bench/probe_compile.py time $DIR $OUT/probe.json --profile > $OUT/probe.log 2>&1; echo "rc=$? at ${SECONDS}s" >> $OUT/probe.log
fi
for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done
