#!/usr/bin/env bash
# LEGS (comma-separated, run one after another on GPU 0, or side by side with GPU=split on a two-GPU host):
#   tests  the compiled, FP8 and LoRA GPU tests against a cache filled from $ARTZ (each file in its own process)
#   vae    bench/vae_scout.py: where the VAE decode's time goes, and its variants (VAE_VARIANTS at 1024x1024; torch's
#          GroupNorm against the wide one at 832x1216 too)
#   gn     the wide GroupNorm's GPU test (tests/test_groupnorm.py)
#   gpu    tests/test_gpu.py and tests/test_gpu_draft.py (the graph engine on tiny, every decode through the wide GroupNorm)
#   slice  `bcg bench jobs/bench.yaml --parts b_slice`: (a), (b) diffusers' regional compile, (e), (f) on the 1024x1024 shots
#   job    `bcg bench jobs/bench.yaml --parts a_diffusers,e_bcg_compiled,f_bcg_fp8`, kernels from $ARTZ
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
# the GPU's clocks, power and temperature every second, read only (a render's replays ran slower than short loops)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv -l 1 > $R/clocks.csv 2>&1 &
SMI=$!
for leg in ${LEGS//,/ }; do
  case $leg in
  tests)
    for t in compiled fp8 lora; do
      BCG_CACHE=/tmp/bcg PYTEST_BCG_CACHE=/tmp/bcg timeout 150 python -m pytest -q -m gpu tests/test_gpu_$t.py \
        -p no:cacheprovider > $R/gpu_${t}_tests.log 2>&1
      echo "gpu_$t tests rc=$? at ${SECONDS}s" >> $R/walls.txt
    done;;
  vae)
    BCG_CACHE=/tmp/bcg timeout 240 python bench/vae_scout.py --out $R/vae.json --budget 200 \
      ${VAE_VARIANTS:+--variants $VAE_VARIANTS} ${VAE_OVERLAP:---no-overlap} > $R/vae.log 2>&1
    echo "vae scout rc=$? at ${SECONDS}s" >> $R/walls.txt
    BCG_CACHE=/tmp/bcg timeout 120 python bench/vae_scout.py --out $R/vae832.json --size 832x1216 --budget 100 \
      --variants fp32,wide,product --no-overlap > $R/vae832.log 2>&1
    echo "vae scout 832x1216 rc=$? at ${SECONDS}s" >> $R/walls.txt;;
  gn)
    timeout 120 python -m pytest -q -m gpu tests/test_groupnorm.py -p no:cacheprovider > $R/gpu_gn_tests.log 2>&1
    echo "gn tests rc=$? at ${SECONDS}s" >> $R/walls.txt;;
  gpu)
    BCG_CACHE=/tmp/bcg PYTEST_BCG_CACHE=/tmp/bcg timeout 200 python -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_draft.py \
      -p no:cacheprovider > $R/gpu_gpu_tests.log 2>&1
    echo "gpu tests rc=$? at ${SECONDS}s" >> $R/walls.txt;;
  slice)
    BCG_CACHE=/tmp/bcg timeout $(left 15) python -m storyboard_cli bench jobs/bench.yaml --parts b_slice --results $R/slice \
      > $R/bench_slice.log 2>&1
    echo "bench slice rc=$? at ${SECONDS}s" >> $R/walls.txt;;
  job)
    BCG_CACHE=/tmp/bcg timeout $(left 15) python -m storyboard_cli bench jobs/bench.yaml \
      --parts ${JOB_PARTS:-a_diffusers,e_bcg_compiled,f_bcg_fp8} --results $R/job > $R/bench_job.log 2>&1
    echo "bench job rc=$? at ${SECONDS}s" >> $R/walls.txt;;
  first)
    BCG_CACHE=/tmp/bcg1 timeout $(left 15) python -m storyboard_cli bench jobs/bench.yaml --parts first_render_fp8 \
      --results $R/first > $R/first.log 2>&1
    echo "first render fp8 rc=$? at ${SECONDS}s" >> $R/walls.txt
    ls -la /tmp/bcg1/compiled > $R/cache1_at_end.txt 2>&1
    pkill -f "storyboard_cli.engine.build" ; sleep 2;;  # the background builds it started: not beside the next leg
  esac
done
kill $SMI 2>/dev/null
cat $R/walls.txt; for t in compiled fp8 lora gn gpu; do tail -n 3 $R/gpu_${t}_tests.log 2>/dev/null; done
grep -h "first render\|Error" $R/first.log 2>/dev/null | tail -n 5
for f in $R/vae.json $R/vae832.json; do
  [ -f $f ] && python -c "import json; r=json.load(open('$f')); r.pop('runs',None); print(json.dumps(r)[:4000])"
done
cat $R/job/*.md $R/slice/*.md 2>/dev/null | head -40
true
