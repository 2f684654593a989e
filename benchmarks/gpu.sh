#!/usr/bin/env bash
# One call on a GPU machine: the measurements behind docs/PERFORMANCE.md as named legs (benchmarks/README.md says
# which leg measures which claim). From the repository root:
#
#   OUT=/some/dir [ARTZ=art.tgz] [FP8=1] [LIMIT=560] [CLOCKS=1] bash benchmarks/gpu.sh LEG[:ARG][@GPU] ...
#   SMOKE=1 OUT=/tmp/x bash benchmarks/gpu.sh draft serve scout   # the same steps on the CPU, tiny preset
#
# Each leg runs on GPU 0 unless @GPU names another (@1b: a second lane on GPU 1, beside @1); the legs of a lane run
# one after another, the lanes side by side.
# Every step stops at its own cap or at LIMIT seconds after the start, whichever comes first (a step that runs past
# it dumps every thread's Python stack into its log). ARTZ: tarballs of compiled artifacts, commas between, to start
# the shared cache with (the art.tgz of an earlier call, its checks against eager included: engine/graph/ledger.py;
# an artifact's key names the GPU's chip by its capability and properties, not its name: one set serves an H100 SXM
# and an H200 where their properties match, machine.txt shows them). FP8=1: build, cold, ready, curves and first with
# --fp8. CLOCKS=1: the GPUs' clocks, power and throttle reasons every second (clocks.csv). Results: $OUT/logs.tgz
# (each step's log, JSON and Markdown, walls.txt, machine.txt); the files a leg added to the shared cache (artifacts it
# built, checks against eager), ARTZ's left out: $OUT/art.tgz (over 15 MiB: in parts, art.tgz.part-00 and on, which
# `cat` puts together).
#
# Legs (ARG where a leg takes one):
#   tests[:FILES]     pytest -m gpu, each file in a process of its own; FILES: names of tests/test_*.py joined by
#                     commas (gpu,gpu_draft,...; default every GPU test file); each file stops at TESTS_CAP seconds (200)
#                     (gpu_compiled's and gpu_regions' fixtures build or wait for 1024² kernels: not beside a `build`)
#   rng               tests/test_gpu_compiled.py with probes/rng_probe.py: after which test the CUDA generator breaks
#   build[:fp8]       `bcg capture jobs/bench.yaml --warm --compile on --steps 4 --eager` on the shared cache: the
#                     job's kernels built side by side, then every shape captured, checked and timed beside eager
#                     (fp8: with --fp8 whatever FP8 says; `build build:fp8@0b` builds both sets at once)
#   cold              the same on an empty cache of its own: a cold build's wall time
#   progress[:cold]   `bcg capture jobs/bench.yaml --warm --compile on --steps 4` (FP8=1: --fp8) without --json, its
#                     stderr through a pipe, each line timed (benchmarks/stderr_times.py); cold: on an empty cache
#   ready             benchmarks/ready.py: a new process ready after the weights (the shared cache's kernels)
#   job[:PARTS]       `bcg bench jobs/bench.yaml --parts PARTS` (default a_diffusers,e_bcg_compiled,f_bcg_fp8)
#   job_eager[:PARTS] the same with CUDA_MODULE_LOADING=EAGER (every kernel module loaded when CUDA starts, none at a
#                     kernel's first launch, which waits for the GPU's queued work: docs/PERFORMANCE.md, 2026-12-03)
#   job_alt[:PARTS]   the same from .alt/ (git-ignored: carry it), another commit's tree (`git archive REV |
#                     tar -x -C .alt`), its code first on the path (default e_bcg_compiled,f_bcg_fp8): an A/B of two
#                     commits in one call, `job job_alt`
#   slice             `--parts b_slice`: (a), (b) diffusers' regional compile, (e), (f) on the 1024x1024 shots
#   curves            `--parts curves,profile`: step curves plain against compiled, the kernel profile
#                     (FP8=1: `--parts fp8`, FP8's step curves and per-step drift)
#   first             `--parts first_render` (FP8=1: first_render_fp8) on an empty cache of its own; the builds it
#                     started are stopped after it
#   draft             `--parts draft`: the draft levers' loops, the job with and without --draft, their capture
#   capture           `bcg capture jobs/bench.yaml --warm --compile off`, then the same with --draft, each a process
#   pool              probes/pool_probe.py in fresh processes (bcg's expandable segments, torch's default
#                     allocator), then `--parts draft_capture`
#   vae               probes/vae_scout.py at 1024x1024 (ARG: its --variants), then 832x1216
#   scout[:VARIANTS]  probes/fp8_scout.py (default plain,prod,fp8,fp8_eager,fp8_eager_fast; plain,prod,cdt: tuning)
#   step[:WHAT]       probes/step_scout.py WHAT (controlnet, the default: the ControlNet's Linears in FP8 against
#                     its fp16 artifact; bucket16: the fp16 UNet for 16 images against 8; layout_force, layout_nd:
#                     the up blocks' NCHW inputs, two inductor options against the fp16 artifact; tune_fp8: the
#                     FP8 UNet's pointwise kernels tuned at build), at 1024x1024; legs side by side:
#                     step:controlnet step:bucket16@0b, step:layout_force step:layout_nd@0b; skip_cat: the
#                     cache's UNets against those of the recipe before (after `build build:fp8@0b`); persistent:
#                     the same for the persistent reductions (the recipe before carried in ARTZ); fp8_inverse: the
#                     FP8 UNet quantising by a bound inverse scale against the cache's artifact; fp8_unfused: the
#                     FP8 UNet with its feed-forwards unfused (the recipe before engine/kernels/geglu.py), the same;
#                     fp8_noconv: the FP8 UNet with its inner convolutions in fp16 (before conv8.py), the same;
#                     fp8_fastaccum: the FP8 UNet's Linears on cuBLASLt's fast accumulation, the same; autotune,
#                     fp8_autotune: the fp16 and the FP8 UNet with their GEMMs autotuned over cuBLAS and Triton
#   profile[:ROWS]    probes/step_profile.py: one compiled 8 x 1024² step's kernels grouped (GEMMs, FP8 GEMMs, attention,
#                     convolutions, the compiler's), from the cache (ROWS: the variants, default compiled,fp8)
#   attention         probes/attention_scout.py: cuDNN, flash and efficient SDPA against a Triton FP8 attention kernel
#                     at SDXL's attention shapes, with each one's error
#   trace[:PARTS]     probes/overlap_trace.py job: `bcg bench jobs/bench.yaml --parts PARTS` (default f_bcg_fp8) with
#                     the batch path traced on one clock: what stays exposed at a render's start, between its batches
#                     and at its end (text encoders, kernel loads, captures, the PNGs' tail)
#   capture_thread    probes/capture_thread.py: a graph captured on a second thread while the main thread replays the
#                     batch before (its warm-up there too, or not), against one captured after the replays and one
#                     between two of them (the UNet at 1024², eager modules)
#   setup[:VARIANTS]  probes/shape_setup.py, each variant (compiled,fp8 by default) in a fresh process: the cache's
#                     UNet at 1024x1024, its first call at new rows against its second, per library, and a capture at
#                     new rows against one at rows already captured
#   plans[:VARIANTS]  probes/plan_prewarm.py, each variant (compiled by default) in a fresh process: the cache's UNet at
#                     1024x1024, its first call at new rows with the libraries' plans made ahead (engine/kernels/plans.py)
#                     against without, and a capture the same
#   pointwise         probes/pointwise_scout.py: the FP8 step's quantisation kernels (GEGLU's, LayerNorm's, the
#                     attention output's) compiled alone at 8 x 1024², production's options against inductor's
#                     tuning options, against the bound their bytes give
#   firstbatch[:VARIANT]  probes/first_batch.py: a render's first batch (8 x 1024², 30 steps, the cache's UNet of
#                     VARIANT, compiled by default) in a fresh process, its setup before its loop (ahead, as today)
#                     against its graph captured beside its own first steps run outside the graph (beside); twice
#                     each, alternating
#   check[:VARIANTS]  probes/check_scout.py: a healthy graph's first step against the whole batch's step, its first
#                     image alone and its first 2 and 4 alone, at guidance 1.5 to 30 (VARIANTS: fp8,compiled by
#                     default), 8 x 1024² and 2 x 1024² with a ControlNet, and each reference step's ms
#   conv              probes/conv_scout.py: the UNet's convolutions at 16 and 4 rows of 1024², cuDNN's fp16 against an
#                     implicit-GEMM Triton kernel in fp16 and in FP8, each one's ms, TFLOPS and error, ms per step
#   conv_psnr[:VARIANTS]  probes/conv_psnr.py: the bench job's pictures through the diffusers loop with the FP8 Linears, and
#                     with FP8 convolutions too, emulated (rounded through FP8), each variant's PSNR against fp16
#   geglu             probes/geglu_scout.py: the feed-forward's first Linear and GEGLU at 16 and 4 rows of 1024², fp8 and
#                     fp16: cuBLAS's GEMM and the compiler's GEGLU kernel (today's) against a Triton GEMM with GEGLU in
#                     its epilogue (pointer, block-pointer, TMA and persistent forms), each one's ms, TFLOPS and error,
#                     ms per UNet and ControlNet step
#   export_triton     probes/export_triton_probe.py: that fused kernel as a triton_op through bcg's artifact path
#                     (export, AOTInductor, load), pointer and TMA tiles, against the production arithmetic's package
#   cn_embed          probes/cn_embed_scout.py: the ControlNet's conditioning embedding at 1024² and 832x1216, 2 to 16
#                     rows, eager, channels_last and compiled, and the whole net with it and with it passed in: what
#                     precomputing it once per batch would take off every +control step
#   load              probes/load_probe.py three times in fresh processes (the third with one compile thread)
#   queue[:SCALES]    probes/queue_probe.py: how many replays of a graph of 1,900 kernels the host queues before a
#                     launch waits, at each CUDA_SCALE_LAUNCH_QUEUES of SCALES (default default,4x), and the GPU's idle
#                     time under pieces of host work, the runner's pacing before and now (`Pace`)
#   rekey[:L2]        probes/rekey.py: the bench job's artifacts in the shared cache, built before the key left out the
#                     L2's size on a card with L2 bytes (default an H100 SXM's, 52428800), renamed to today's keys
#                     (ARTZ's sets then serve an H100 SXM and an H200; the renamed files come back in art.tgz); first,
#                     before the legs that use them
#   serve[:PHASES]    benchmarks/serve_gpu.py on GPUs 0 and 1 (default render,serve1,serve2; IMAGES=32 STEPS=20)
#   gpus[:JOB]        benchmarks/two_gpus.py on GPUs 0 and 1: JOB (bench, the default, or tiny) on two against one
#   refs[:COMPILE]    `bcg capture benchmarks/jobs/references.yaml --warm --compile COMPILE` (default off), then the
#                     same job without its IP-Adapter: a reference's cost per step at 8 x 1024², two ControlNets
#                     against one at 2 x 1024²
#   regions[:COMPILE] `bcg capture benchmarks/jobs/regions.yaml --warm --compile COMPILE` (default off: four slots),
#                     its two-region shot alone (two slots), then the job without its regions: the regions' cost per
#                     image-step at 8 x 1024² (on: the two regions' UNet artifacts, 1024² +regions4 and +regions2,
#                     built side by side first; the plain UNet's comes from ARTZ)
# serve and gpus take both GPUs: give them a call, or a GPU's turn, of their own.
set -uo pipefail
: "${OUT:?OUT=/some/dir: where logs.tgz and art.tgz go}"
[ $# -gt 0 ] || { sed -n '2,/^# serve and gpus take/p' "$0"; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 BCG_LOG=info
export BCG_CACHE=/tmp/bcg PYTEST_BCG_CACHE=/tmp/bcg TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
LIMIT=${LIMIT:-560}
SMOKE=${SMOKE:-0}
FP8_FLAG=$([ "${FP8:-0}" = 1 ] && echo --fp8)
GPU_TESTS=gpu_compiled,gpu_fp8,gpu_fp8_kernels,overlap,gpu,gpu_draft,gpu_lora,groupnorm,gpu_references,gpu_source,gpu_refine
GPU_TESTS+=,gpu_regions,estimate,dist,capture_beside,vae_attention  # every test file with a GPU test
R=$(mktemp -d /tmp/gpu-call.XXXX)
mkdir -p "$OUT" "$BCG_CACHE/compiled"
ARTZ=${ARTZ:-}
for a in ${ARTZ//,/ }; do tar xzf "$a" -C "$BCG_CACHE/compiled"; done
ls "$BCG_CACHE/compiled" > "$R/cache_at_start.txt"
touch "$R/at_start"  # ARTZ's files keep their archived times: a file of theirs the call rewrites is newer

pack() {
  for f in "$R"/*/*-server.pid; do [ -f "$f" ] && kill -KILL -- "-$(cat "$f")" 2>/dev/null; done  # serve's servers
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  ls -la --full-time "$BCG_CACHE/compiled" > "$R/cache_at_end.txt" 2>&1
  mkdir -p "$R/builds"; cp "$BCG_CACHE"/compiled/*.{log,build.json} "$R/builds/" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$R" .
  # what the call added to the cache or rewrote in it (stored FP8 scales calibrated again under the same name; ARTZ
  # holds the rest): a file back from a call is at most 16 MiB
  local added
  added=$(cd "$BCG_CACHE/compiled" && find . -maxdepth 1 -type f -newer "$R/at_start" \( -name '*.pt2' -o \
    -name '*.ok' -o -name '*.build.json' -o -name 'fp8-scales-*.json' -o -name 'checked-*.json' \) -printf '%f\n' \
    | sort)
  [ -n "$added" ] && (cd "$BCG_CACHE/compiled" && tar czf "$OUT/art.tgz" $added)
  # a whole build (18 MB) is over that: in parts, `cat art.tgz.part-* > art.tgz` puts it together again
  if [ -f "$OUT/art.tgz" ] && [ "$(stat -c %s "$OUT/art.tgz")" -gt $((15 << 20)) ]; then
    split -b 15M -d "$OUT/art.tgz" "$OUT/art.tgz.part-" && rm "$OUT/art.tgz"
  fi
}
trap pack EXIT

left() { echo $((LIMIT - 10 - SECONDS)); }
# step NAME CAP CMD...: CMD under the smaller of CAP and what is left of LIMIT; stdout and stderr in NAME.log
# (NAME.json takes stdout when STDOUT=json); its exit status and times in walls.txt
step() {
  local name=$1 cap=$2 limit; shift 2
  limit=$(left); [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -lt 20 ]; then echo "$name: not run, ${limit}s of the limit left" >> "$R/walls.txt"; return 1; fi
  local start=$SECONDS out="$R/$name.log"
  [ "${STDOUT:-}" = json ] && out="$R/$name.json"
  timeout -s ABRT -k 15 "$limit" "$@" > "$out" 2>> "$R/$name.log"
  local rc=$?
  echo "$name rc=$rc from ${start}s to ${SECONDS}s (limit ${limit}s)" >> "$R/walls.txt"
  return $rc
}
bench() {  # NAME CAP PARTS [ARGS...]: one `bcg bench` run of the bench job, its record in NAME/
  local name=$1 cap=$2 parts=$3; shift 3
  step "$name" "$cap" python -m storyboard_cli bench jobs/bench.yaml --parts "$parts" --results "$R/$name" \
    $([ "$SMOKE" = 1 ] && echo --quick) "$@"
}
stop_builds() {  # the compiled-kernel builds a leg started on cache $1: they run in sessions of their own
  for e in /proc/[0-9]*/environ; do
    grep -qzx "BCG_CACHE=$1" "$e" 2>/dev/null && kill "$(basename "$(dirname "$e")")" 2>/dev/null
  done
}

leg() {  # LEG ARG NAME
  local leg=$1 arg=$2 n=$3
  case $leg in
  tests)
    for t in $(tr , " " <<< "${arg:-$GPU_TESTS}"); do
      step "$n-$t" "${TESTS_CAP:-200}" python -m pytest -q -rP -m gpu "tests/test_$t.py" -p no:cacheprovider
    done;;
  rng)
    step "$n" 150 env PYTHONPATH="$PWD/benchmarks/probes:$PYTHONPATH" python -m pytest -q -s -m gpu \
      tests/test_gpu_compiled.py -p rng_probe -p no:cacheprovider;;
  build|cold)
    local cache=$BCG_CACHE
    [ "$leg" = cold ] && cache=/tmp/bcg-cold && rm -rf "$cache" && mkdir -p "$cache"
    STDOUT=json step "$n" 540 env BCG_CACHE="$cache" python -m storyboard_cli capture jobs/bench.yaml --warm \
      --compile on --steps 4 $([ "$arg" = fp8 ] && echo --fp8 || echo $FP8_FLAG) --eager --json
    [ "$leg" = cold ] && mkdir -p "$R/$n-builds" && cp "$cache"/compiled/*.{log,build.json} "$R/$n-builds/" 2>/dev/null
    python benchmarks/capture_table.py "$R/$n.json" >> "$R/$n.log";;
  progress)
    local cache=$BCG_CACHE
    [ "$arg" = cold ] && cache=/tmp/bcg-cold && rm -rf "$cache" && mkdir -p "$cache"
    step "$n" 540 python benchmarks/stderr_times.py "$R/$n-stderr.log" env BCG_CACHE="$cache" \
      python -m storyboard_cli capture jobs/bench.yaml --warm --compile on --steps 4 $FP8_FLAG;;
  ready)
    step "$n" 150 python benchmarks/ready.py jobs/bench.yaml "$R/$n.json" $FP8_FLAG;;
  job|job_eager)
    (if [ "$leg" = job_eager ]; then export CUDA_MODULE_LOADING=EAGER; fi
     bench "$n" 540 "${arg:-a_diffusers,e_bcg_compiled,f_bcg_fp8}");;
  job_alt)
    if [ ! -d .alt/storyboard_cli ]; then echo "$n: not run, no .alt/ tree" >> "$R/walls.txt"; return 1; fi
    (cd .alt && PYTHONPATH=$PWD:$PYTHONPATH bench "$n" 540 "${arg:-e_bcg_compiled,f_bcg_fp8}");;
  slice)
    bench "$n" 300 b_slice;;
  curves)
    bench "$n" 540 "$([ -n "$FP8_FLAG" ] && echo fp8 || echo curves,profile)";;
  first)
    rm -rf /tmp/bcg-first && mkdir -p /tmp/bcg-first
    BCG_CACHE=/tmp/bcg-first bench "$n" 540 "$([ -n "$FP8_FLAG" ] && echo first_render_fp8 || echo first_render)"
    ls -la /tmp/bcg-first/compiled > "$R/$n-cache-at-end.txt" 2>&1
    stop_builds /tmp/bcg-first; sleep 2;;
  draft)
    bench "$n" 540 draft;;
  refs)
    local plain=benchmarks/jobs/references-plain.yaml
    grep -v -e '^ip_adapter:' -e '^characters:' -e '^  mei:' benchmarks/jobs/references.yaml \
      | sed 's/, characters: \[mei\]//' > "$plain"
    for job in benchmarks/jobs/references.yaml "$plain"; do
      STDOUT=json step "$n-$(basename "$job" .yaml)" 540 python -m storyboard_cli capture "$job" --warm \
        --compile "${arg:-off}" --steps 10 --json
      python benchmarks/capture_table.py "$R/$n-$(basename "$job" .yaml).json" >> "$R/$n.log"
    done
    rm -f "$plain" "$two";;
  regions)
    local plain=benchmarks/jobs/regions-plain.yaml two=benchmarks/jobs/regions-two.yaml
    awk '/^    regions:/ {skip=1; next} skip && /^      - / {next} {skip=0; print}' benchmarks/jobs/regions.yaml > "$plain"
    sed '/^  - id: four/,$d' benchmarks/jobs/regions.yaml > "$two"  # the two-region shot alone: two slots
    if [ "${arg:-off}" = on ]; then  # the two regions' UNet artifacts (4 and 2 slots) built side by side first
      step "$n-build" 480 bash -c "python -m storyboard_cli capture benchmarks/jobs/regions.yaml --warm \
        --compile on --steps 2 & python -m storyboard_cli capture $two --warm --compile on --steps 2 & wait"
    fi
    for job in "$plain" "$two" benchmarks/jobs/regions.yaml; do  # the plain one first: each ratio needs it
      STDOUT=json step "$n-$(basename "$job" .yaml)" 540 python -m storyboard_cli capture "$job" --warm \
        --compile "${arg:-off}" --steps 10 --json
      python benchmarks/capture_table.py "$R/$n-$(basename "$job" .yaml).json" >> "$R/$n.log"
    done
    rm -f "$plain" "$two";;
  capture)
    for mode in plain draft; do
      STDOUT=json step "$n-$mode" 240 python -m storyboard_cli capture jobs/bench.yaml --warm --compile off \
        $([ $mode = draft ] && echo --draft) --json
    done;;
  pool)
    local probe name order conf
    for probe in expandable:write,read,cond-write,cond-read: \
                 segments:write,read,cond-write,cond-read:expandable_segments:False \
                 segments-today-then-deepcache:full,write,read:expandable_segments:False; do
      IFS=: read -r name order conf <<< "$probe"
      step "$n-probe-$name" 90 env ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} \
        python benchmarks/probes/pool_probe.py "$R/$n-probe-$name.json" --order "$order"
    done
    bench "$n" 300 draft_capture;;
  vae)
    step "$n" 240 python benchmarks/probes/vae_scout.py --out "$R/$n.json" --budget 200 ${arg:+--variants $arg} \
      --no-overlap $([ "$SMOKE" = 1 ] && echo --model tiny)
    step "$n-832x1216" 120 python benchmarks/probes/vae_scout.py --out "$R/$n-832x1216.json" --size 832x1216 \
      --budget 100 --variants fp32,wide,fast,product --no-overlap $([ "$SMOKE" = 1 ] && echo --model tiny);;
  scout)
    local smoke=""
    [ "$SMOKE" = 1 ] && smoke="--model tiny --side 256 --min-tokens 64 --build-missing --loops 2 --replays 2"
    step "$n" 560 env TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$n" \
      TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / ${#PLAN[@]} )) python benchmarks/probes/fp8_scout.py \
      --variants "${arg:-plain,prod,fp8,fp8_eager,fp8_eager_fast}" --budget "$(( $(left) - 30 ))" \
      --out "$R/$n.json" --build-dir "/tmp/fp8-build-$n" $smoke;;
  step)
    local smoke=""
    [ "$SMOKE" = 1 ] && smoke="--model tiny --side 128 --build-missing --loops 2 --replays 2"
    step "$n" 560 env TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$n" \
      TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / ${#PLAN[@]} )) python benchmarks/probes/step_scout.py \
      "${arg:-controlnet}" --budget "$(( $(left) - 30 ))" --out "$R/$n.json" --build-dir "/tmp/step-build-$n" $smoke;;
  profile)
    step "$n" 150 python benchmarks/probes/step_profile.py --out "$R/$n.json" ${arg:+--rows $arg} \
      $([ "$SMOKE" = 1 ] && echo --model tiny --side 128 --batch 2);;
  queue)
    step "$n" 150 python benchmarks/probes/queue_probe.py "$R/$n.json" --scales "${arg:-default,4x}" --replays 8;;
  rekey)
    step "$n" 150 python benchmarks/probes/rekey.py ${arg} $([ "$SMOKE" = 1 ] && echo --device cpu --model tiny);;
  attention)
    step "$n" 150 python benchmarks/probes/attention_scout.py --out "$R/$n.json" $([ "$SMOKE" = 1 ] && echo --smoke);;
  capture_thread)
    step "$n" 240 python benchmarks/probes/capture_thread.py "$R/$n.json";;
  trace)
    step "$n" 300 python benchmarks/probes/overlap_trace.py job "$R/$n.json" --parts "${arg:-f_bcg_fp8}";;
  pointwise)
    step "$n" 300 env TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$n" python benchmarks/probes/pointwise_scout.py \
      "$R/$n.json" $([ "$SMOKE" = 1 ] && echo --smoke --reps 3);;
  setup)
    local v
    for v in $(tr , " " <<< "${arg:-compiled,fp8}"); do  # each in a fresh process: what a first call at new rows costs
      step "$n-$v" 120 python benchmarks/probes/shape_setup.py "$R/$n-$v.json" --variant "$v" \
        $([ "$SMOKE" = 1 ] && echo --model tiny --side 128)
    done;;
  plans)
    local v
    for v in $(tr , " " <<< "${arg:-compiled}"); do  # each in a fresh process: the plans for new rows made ahead
      step "$n-$v" 120 python benchmarks/probes/plan_prewarm.py "$R/$n-$v.json" --variant "$v" \
        $([ "$SMOKE" = 1 ] && echo --model tiny --side 128)
    done;;
  firstbatch)
    local m i=0
    for m in ahead beside ahead beside; do  # each in a fresh process: the first batch's setup is per process
      i=$((i + 1))
      step "$n-$m-$i" 90 python benchmarks/probes/first_batch.py "$R/$n-$m-$i.json" --mode "$m" \
        --variant "${arg:-compiled}" $([ "$SMOKE" = 1 ] && echo --model tiny --side 128)
    done;;
  check)
    step "$n" 200 python benchmarks/probes/check_scout.py "$R/$n.json" ${arg:+--variants $arg} --parts 2,4 \
      $([ "$SMOKE" = 1 ] && echo --model tiny --side 128 --variants plain --shapes 2x0,2x1 --guidance 1.5,6 --seeds 0);;
  conv)
    step "$n" 260 python benchmarks/probes/conv_scout.py --out "$R/$n.json" --budget 220 \
      $([ "$SMOKE" = 1 ] && echo --smoke);;
  conv_psnr)
    step "$n" 300 python benchmarks/probes/conv_psnr.py --out "$R/$n.json" ${arg:+--variants $arg} \
      $([ "$SMOKE" = 1 ] && echo --smoke);;
  geglu)
    step "$n" 260 python benchmarks/probes/geglu_scout.py --out "$R/$n.json" --budget 220 \
      $([ "$SMOKE" = 1 ] && echo --smoke);;
  export_triton)
    step "$n" 200 python benchmarks/probes/export_triton_probe.py "$R/$n.json" $([ "$SMOKE" = 1 ] && echo --trace);;
  cn_embed)
    step "$n" 200 python benchmarks/probes/cn_embed_scout.py --out "$R/$n.json" --budget 160 \
      $([ "$SMOKE" = 1 ] && echo --smoke);;
  load)
    local a b
    a=$(ls "$BCG_CACHE"/compiled/unet-1024x1024-*.pt2 | head -1); b=$(ls "$BCG_CACHE"/compiled/unet-1216x832-*.pt2 | head -1)
    for run in 1 2 3; do
      (while true; do echo "-- $(date +%T)"; ps -eo pid,ppid,etimes,pcpu,rss,args --forest | cut -c1-200 | tail -n 25
                      sleep 3; done) > "$R/$n-$run-ps.log" 2>&1 &
      local sampler=$!
      step "$n-$run" 80 env $([ $run = 3 ] && echo TORCHINDUCTOR_COMPILE_THREADS=1) \
        python -X faulthandler benchmarks/probes/load_probe.py "$a" "$b"
      kill $sampler
    done;;
  serve)
    local args="--gpus 0,1 --model sdxl-random --images ${IMAGES:-32} --steps ${STEPS:-20} --size 1024x1024"
    [ "$SMOKE" = 1 ] && args="--gpus cpu,cpu --model tiny --images 8 --steps 2 --size 256x256"
    local phase limit
    for phase in $(tr , " " <<< "${arg:-render,serve1,serve2}"); do
      limit=$(case $phase in render) echo 150;; serve1) echo 200;; *) echo 540;; esac)
      [ "$limit" -gt "$(left)" ] && limit=$(left)
      step "$n-$phase" "$limit" env -u CUDA_VISIBLE_DEVICES python benchmarks/serve_gpu.py $args --phases "$phase" \
        --deadline-s $((limit - 10)) --out "$R/$n"
    done;;
  gpus)
    step "$n" 540 env -u CUDA_VISIBLE_DEVICES python benchmarks/two_gpus.py "${arg:-bench}" --work "/tmp/two-gpus-$n" \
      --out "$R/$n.json";;
  *)
    echo "$n: no leg named $leg (benchmarks/gpu.sh lists them)" >> "$R/walls.txt";;
  esac
}

{ nproc; grep -m1 "model name" /proc/cpuinfo; free -g | head -2; nvidia-smi -L; git log --oneline -1
  python -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)"
  python -c "import torch; from storyboard_cli.engine.kernels.artifacts import gpu_facts
[print('gpu', i, torch.cuda.get_device_name(i), gpu_facts(torch.device('cuda', i))) for i in range(torch.cuda.device_count())]"
} > "$R/machine.txt" 2>&1
if [ "${CLOCKS:-0}" = 1 ]; then
  nvidia-smi --query-gpu=index,timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv -l 1 > "$R/clocks.csv" 2>&1 &
  SMI=$!
fi
declare -A PLAN
i=0
for spec in "$@"; do
  i=$((i + 1)); lane=0
  [[ $spec == *@* ]] && lane=${spec##*@} && spec=${spec%@*}
  PLAN[$lane]+="$i:$spec "
done
LANES=()
for lane in "${!PLAN[@]}"; do
  (export CUDA_VISIBLE_DEVICES=${lane%%[!0-9]*}
   for item in ${PLAN[$lane]}; do
     n=${item%%:*}; spec=${item#*:}; leg=${spec%%:*}; arg=""
     [[ $spec == *:* ]] && arg=${spec#*:}
     leg "$leg" "$arg" "$n-$leg-gpu$lane"
   done) &
  LANES+=($!)
done
wait "${LANES[@]}"  # the lanes only: CLOCKS=1's sampler runs until pack stops it
cat "$R/walls.txt"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -v Warning "$f" | tail -n 4; done
cat "$R"/*/*.md 2>/dev/null | head -n 60
true
