#!/usr/bin/env bash
# A GPU call with the bench job's compiled kernels carried in $ART (from bench/gpu_first.sh or
# bench/gpu_build.sh): a new process ready after the weights (bench/ready.py), then one bench run: (a)
# diffusers against (e) bcg on its compiled kernels over the whole job, plain against compiled step curves,
# the kernel profile, and (b) diffusers' regional torch.compile on a slice next to (e); last the
# compiled-path GPU tests (LoRA included). A step that runs past its limit dumps every thread's Python
# stack (SIGABRT + faulthandler) into its log. Results come back as $OUT/logs.tgz.
# Usage: ART=.art OUT=/some/dir [LIMIT=530] [PARTS=a_diffusers,e_bcg_compiled] [LOAD_CHECK=1] bash bench/gpu_session.sh
set -uo pipefail
export BCG_CACHE=${BCG_CACHE:-/tmp/bcg} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-} BCG_LOG=info
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
R=${R:-/tmp/results}; mkdir -p $BCG_CACHE/compiled $R && cp $ART/* $BCG_CACHE/compiled/
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout -s ABRT -k 15 $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
pack() { ls -la --full-time $BCG_CACHE/compiled > $R/cache_at_end.txt; cp $BCG_CACHE/compiled/*.log $R/ 2>/dev/null; tar czf $OUT/logs.tgz -C $R .; }
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; ls -la --full-time $BCG_CACHE/compiled; } > $R/machine.txt 2>&1
[ -n "${LOAD_CHECK:-}" ] && step 45 python bench/load_check.py $(ls $BCG_CACHE/compiled/unet-*.pt2 | head -1) > $R/load_check.log 2>&1
step 120 python bench/ready.py jobs/bench.yaml $R/ready.json > $R/ready.log 2>&1
ls -la --full-time $BCG_CACHE/compiled > $R/cache_after_ready.txt
step $((${LIMIT:-530} - 90 - SECONDS)) python -m storyboard_cli bench jobs/bench.yaml \
  --parts ${PARTS:-a_diffusers,e_bcg_compiled,curves,profile,b_slice} --results $R > $R/bench.log 2>&1
step $((${LIMIT:-530} - SECONDS)) python -m pytest -q -m gpu tests/test_gpu_compiled.py -k "lora or uncompiled" > $R/gpu_compiled_tests.log 2>&1
cat $R/load_check.log 2>/dev/null; tail -n 30 $R/ready.log; tail -n 4 $R/gpu_compiled_tests.log; grep -v '^{' $R/bench.log | tail -n 60
