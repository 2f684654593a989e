#!/usr/bin/env bash
# The FP8 scout on two GPUs of one host, two processes side by side (bench/fp8_scout.py): GPU 0 builds and
# times the fp16 recipe compiled with coordinate_descent_tuning, GPU 1 builds and times the FP8 variant (and
# its eager graphs); each also times the plain graph and the production fp16 artifact carried in $ART, so
# every ratio is measured within one process. Each process has its own cache, inductor cache and compile
# threads. Everything comes back as ONE $OUT/logs.tgz (the JSON records, the logs, the machine).
# Usage: ART=.art OUT=/some/dir [BUDGET=520] bash bench/gpu_fp8.sh
#        SMOKE=1 OUT=/tmp/x bash bench/gpu_fp8.sh   (CPU, tiny preset, builds its own production artifact)
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ART=${ART:-.art}; BUDGET=${BUDGET:-520}
R=$(mktemp -d /tmp/fp8-results.XXXX); mkdir -p "$OUT"
EXTRA=""
[ "${SMOKE:-0}" = 1 ] && EXTRA="--model tiny --side 256 --min-tokens 64 --build-missing --loops 2 --replays 2"
pack() { tar czf "$OUT/logs.tgz" -C "$R" .; }
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; python -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)"; ls -la $ART; } > $R/machine.txt 2>&1
# one process per GPU: NAME GPU VARIANTS
scout() {
  local name=$1 gpu=$2 variants=$3
  ( export CUDA_VISIBLE_DEVICES=$gpu BCG_CACHE=/tmp/bcg-$name TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$name \
      TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / 2 ))
    mkdir -p $BCG_CACHE/compiled && cp $ART/* $BCG_CACHE/compiled/ 2>/dev/null
    echo "== $name on GPU $gpu: $variants (at ${SECONDS}s, limit $((BUDGET + 30))s)"
    timeout -s ABRT -k 15 $((BUDGET + 30)) python bench/fp8_scout.py --variants $variants --budget $BUDGET \
      --out $R/$name.json --build-dir /tmp/fp8-build-$name $EXTRA
    echo "== rc=$? at ${SECONDS}s" ) > $R/$name.log 2>&1 &
}
scout fp16 0 plain,prod,cdt
scout fp8 1 plain,prod,fp8,fp8_eager,fp8_eager_fast
wait
for n in fp16 fp8; do grep -v Warning $R/$n.log | grep -v "return cls.__new__" | tail -n 25; done
