#!/usr/bin/env bash
# FP8 with its kernels carried in (one tarball of the bench job's fp16 and FP8 artifacts and the stored FP8 scales,
# $ARTZ), two GPUs of one host. GPU 0: the FP8 GPU tests (their own process), `bcg capture jobs/bench.yaml --warm
# --fp8` (every shape captured, checked against the uncompiled eager step, timed against eager), then a new process
# ready after the weights with FP8 (bench/ready.py --fp8). GPU 1: the slice against diffusers' regional compile with
# (e) and (f) side by side (`--parts b_slice`), then the job again: (a), (e), (f) and the FP8 pictures' PSNR.
# Results: $OUT/logs.tgz.   Usage: ARTZ=.artz/all.tgz OUT=/some/dir [LIMIT=540] bash bench/gpu_fp8_session.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export PYTEST_BCG_CACHE=/tmp/bcg BCG_LOG=info
R=$(mktemp -d /tmp/fp8s-results.XXXX); mkdir -p "$OUT" $BCG_CACHE/compiled
tar xzf ${ARTZ:-.artz/all.tgz} -C $BCG_CACHE/compiled
LIMIT=${LIMIT:-540}
pack() { ls -la --full-time $BCG_CACHE/compiled > $R/cache_at_end.txt 2>&1; tar czf "$OUT/logs.tgz" -C "$R" .; }
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; git log --oneline -1; } > $R/machine.txt 2>&1
(export CUDA_VISIBLE_DEVICES=0
 timeout 150 python -m pytest -q -m gpu tests/test_gpu_fp8.py -p no:cacheprovider > $R/gpu_fp8_tests.log 2>&1
 echo "fp8 tests rc=$? at ${SECONDS}s" >> $R/walls.txt
 timeout 200 python -m storyboard_cli capture jobs/bench.yaml --warm --compile on --fp8 --steps 4 --json \
   > $R/capture.json 2> $R/capture.log
 echo "capture rc=$? at ${SECONDS}s" >> $R/walls.txt
 timeout $((LIMIT - 15 - SECONDS)) python bench/ready.py jobs/bench.yaml $R/ready_fp8.json --fp8 > $R/ready_fp8.log 2>&1
 echo "ready rc=$? at ${SECONDS}s" >> $R/walls.txt) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 240 python -m storyboard_cli bench jobs/bench.yaml --parts b_slice --results $R/slice > $R/bench_slice.log 2>&1
 echo "bench slice rc=$? at ${SECONDS}s" >> $R/walls.txt
 timeout $((LIMIT - 10 - SECONDS)) python -m storyboard_cli bench jobs/bench.yaml \
   --parts a_diffusers,e_bcg_compiled,f_bcg_fp8 --results $R/job > $R/bench_job.log 2>&1
 echo "bench job rc=$? at ${SECONDS}s" >> $R/walls.txt) &
wait
cat $R/walls.txt; tail -n 15 $R/gpu_fp8_tests.log; tail -n 4 $R/capture.log; cat $R/ready_fp8.log | head -30
grep -h "slice\|ratio\|PSNR\|failed\|Error" $R/bench_slice.log $R/bench_job.log | tail -n 20
cat $R/job/*.md 2>/dev/null | head -14
python bench/capture_table.py $R/capture.json
