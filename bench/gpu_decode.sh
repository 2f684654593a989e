#!/usr/bin/env bash
# LEGS (comma-separated, run one after another on GPU 0, or side by side with GPU=split on a two-GPU host):
#   tests  the compiled, FP8 and LoRA GPU tests against a cache filled from $ARTZ (each file in its own process)
#   vae    bench/vae_scout.py: where the VAE decode's time goes, and its variants
#   first  on an EMPTY cache of its own: the first render with `--compile auto --fp8` against `--compile off`
#          (`bcg bench --parts first_render_fp8`)
# Results: $OUT/logs.tgz.   Usage: ARTZ=.artz/all.tgz OUT=/some/dir LEGS=tests,vae [LIMIT=560] bash bench/gpu_decode.sh
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 BCG_LOG=info
R=$(mktemp -d /tmp/decode-results.XXXX); mkdir -p "$OUT" /tmp/bcg/compiled /tmp/bcg1
tar xzf ${ARTZ:-.artz/all.tgz} -C /tmp/bcg/compiled
LIMIT=${LIMIT:-560}
pack() { tar czf "$OUT/logs.tgz" -C "$R" .; }
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; git log --oneline -1; } > $R/machine.txt 2>&1
left() { echo $((LIMIT - $1 - SECONDS)); }
for leg in ${LEGS//,/ }; do
  case $leg in
  tests)
    for t in compiled fp8 lora; do
      BCG_CACHE=/tmp/bcg PYTEST_BCG_CACHE=/tmp/bcg timeout 150 python -m pytest -q -m gpu tests/test_gpu_$t.py \
        -p no:cacheprovider > $R/gpu_${t}_tests.log 2>&1
      echo "gpu_$t tests rc=$? at ${SECONDS}s" >> $R/walls.txt
    done;;
  vae)
    BCG_CACHE=/tmp/bcg timeout $(left 15) python bench/vae_scout.py --out $R/vae.json --budget $(left 40) > $R/vae.log 2>&1
    echo "vae scout rc=$? at ${SECONDS}s" >> $R/walls.txt;;
  first)
    BCG_CACHE=/tmp/bcg1 timeout $(left 15) python -m storyboard_cli bench jobs/bench.yaml --parts first_render_fp8 \
      --results $R/first > $R/first.log 2>&1
    echo "first render fp8 rc=$? at ${SECONDS}s" >> $R/walls.txt
    ls -la /tmp/bcg1/compiled > $R/cache1_at_end.txt 2>&1;;
  esac
done
cat $R/walls.txt; for t in compiled fp8 lora; do tail -n 3 $R/gpu_${t}_tests.log 2>/dev/null; done
grep -h "first render\|Error" $R/first.log 2>/dev/null | tail -n 5
[ -f $R/vae.json ] && python -c "import json; r=json.load(open('$R/vae.json')); r.pop('runs',None); print(json.dumps(r,indent=0)[:6000])"
true
