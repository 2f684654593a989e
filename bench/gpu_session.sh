#!/usr/bin/env bash
# A GPU call with the bench job's compiled kernels carried in $ART (from bench/gpu_first.sh or
# bench/gpu_build.sh): a new process ready after the weights (bench/ready.py), the compiled-path GPU
# tests (LoRA included), then one bench run: (a) diffusers against (e) bcg on its compiled kernels over
# the whole job, plain against compiled step curves, the kernel profile, and last (b) diffusers' regional
# torch.compile on a slice next to (e). Results come back as $OUT/logs.tgz.
# Usage: ART=.art OUT=/some/dir bash bench/gpu_session.sh
set -uo pipefail
export BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-}
R=/tmp/results; mkdir -p $BCG_CACHE/compiled $R && cp $ART/* $BCG_CACHE/compiled/
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
trap 'tar czf $OUT/logs.tgz -C $R .' EXIT
{ nproc; free -g | head -2; nvidia-smi -L; ls $BCG_CACHE/compiled; } > $R/machine.txt 2>&1
step 90 python bench/ready.py jobs/bench.yaml $R/ready.json > $R/ready.log 2>&1
step 110 python -m pytest -q -m gpu tests/test_gpu_compiled.py -k "lora or uncompiled" > $R/gpu_compiled_tests.log 2>&1
step $((${LIMIT:-530} - SECONDS)) python -m storyboard_cli bench jobs/bench.yaml \
  --parts a_diffusers,e_bcg_compiled,curves,profile,b_slice --results $R > $R/bench.log 2>&1
cat $R/ready.log; tail -n 4 $R/gpu_compiled_tests.log; grep -v '^{' $R/bench.log | tail -n 60
