#!/usr/bin/env bash
# One H200 of 16 cores: `bcg capture jobs/bench.yaml --warm --fp8` on an EMPTY cache (the issue's cold-build machine:
# 3 FP8 UNets and 3 fp16 ControlNets built side by side, then every shape captured, checked, timed), while the same
# GPU runs, against a second cache carrying the kernels ($ARTZ), the compiled GPU tests under bench/rng_probe.py (which
# test leaves the default CUDA generator unusable), then the FP8 and LoRA GPU tests, each in its own process.
# Results: $OUT/logs.tgz.   Usage: ARTZ=.artz/all.tgz OUT=/some/dir [LIMIT=570] bash bench/gpu_cold_fp8.sh
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:$PWD/bench:${PYTHONPATH:-} PYTHONUNBUFFERED=1 BCG_LOG=info
R=$(mktemp -d /tmp/cold-results.XXXX); mkdir -p "$OUT" /tmp/bcg-cold /tmp/bcg-warm/compiled
tar xzf ${ARTZ:-.artz/all.tgz} -C /tmp/bcg-warm/compiled
LIMIT=${LIMIT:-570}
pack() {
  cp /tmp/bcg-cold/compiled/*.build.json /tmp/bcg-cold/compiled/*.log $R/ 2>/dev/null
  ls -la --full-time /tmp/bcg-cold/compiled > $R/cold_cache_at_end.txt 2>&1
  tar czf "$OUT/logs.tgz" -C "$R" .
}
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; git log --oneline -1; } > $R/machine.txt 2>&1
(start=$EPOCHREALTIME
 BCG_CACHE=/tmp/bcg-cold timeout $((LIMIT - 10)) python -m storyboard_cli capture jobs/bench.yaml --warm --compile on \
   --fp8 --steps 4 --json > $R/capture.json 2> $R/capture.log
 echo "cold capture rc=$? wall_s=$(awk "BEGIN{print $EPOCHREALTIME - $start}")" >> $R/walls.txt) &
(export BCG_CACHE=/tmp/bcg-warm PYTEST_BCG_CACHE=/tmp/bcg-warm
 timeout 150 python -m pytest -q -s -m gpu tests/test_gpu_compiled.py -p rng_probe -p no:cacheprovider > $R/probe.log 2>&1
 echo "probe rc=$? at ${SECONDS}s" >> $R/walls.txt
 timeout 120 python -m pytest -q -m gpu tests/test_gpu_fp8.py -p no:cacheprovider > $R/gpu_fp8_tests.log 2>&1
 echo "fp8 tests rc=$? at ${SECONDS}s" >> $R/walls.txt
 timeout 150 python -m pytest -q -m gpu tests/test_gpu_lora.py -p no:cacheprovider > $R/gpu_lora_tests.log 2>&1
 echo "lora tests rc=$? at ${SECONDS}s" >> $R/walls.txt) &
wait
cat $R/walls.txt; grep "\[rng\]" $R/probe.log | grep -v "before the test ok, after it ok" | head -20; tail -n 3 $R/probe.log
tail -n 5 $R/gpu_fp8_tests.log $R/gpu_lora_tests.log; tail -n 10 $R/capture.log
python bench/capture_table.py $R/capture.json
