#!/usr/bin/env bash
# Draft renders on one GPU, on an empty cache, no compiler started (every part runs --compile off): the draft
# graphs against eager (tests/test_gpu_draft.py, tiny, fp32 and fp16), then `bcg bench --parts draft` on
# sdxl-random fp16: ms per image-step at 8 x 1024x1024 for full / DeepCache interval 3 / cfg_cutoff 0.5 /
# cfg_cutoff 0.7 / the draft preset side by side after warm-up, the capture seconds and pool MB of the draft
# kinds against today's for the bench job's shapes, jobs/bench.yaml with and without --draft (ControlNet shots
# included), and the PSNR / mean absolute difference of every draft against the full image of its seed.
# Everything comes back as $OUT/logs.tgz (the bench's JSON and Markdown, the logs). Budget: 540 s.
# Usage: OUT=/some/dir bash bench/gpu_draft.sh
#        SMOKE=1 OUT=/tmp/x bash bench/gpu_draft.sh   (CPU, tiny preset: the same steps, a few minutes)
set -uo pipefail
export BCG_CACHE=${BCG_CACHE:-/tmp/bcg} PYTHONPATH=$PWD:${PYTHONPATH:-}
R=$(mktemp -d /tmp/draft-results.XXXX); mkdir -p "$BCG_CACHE" "$OUT"
QUICK=""; [ "${SMOKE:-0}" = 1 ] && QUICK="--quick"
BUDGET=${BUDGET:-540}
step() { local limit=$1; shift; echo "== $* (at ${SECONDS}s, limit ${limit}s)"; timeout $limit "$@"; echo "== rc=$? at ${SECONDS}s"; }
pack() { tar czf "$OUT/logs.tgz" -C "$R" .; }
trap pack EXIT
{ nproc; free -g | head -2; nvidia-smi -L; python -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)"; } > $R/machine.txt 2>&1
[ -z "${NO_TESTS:-}" ] && step 120 python -m pytest -q -m gpu tests/test_gpu_draft.py > $R/gpu_tests.log 2>&1
step $((BUDGET - 10 - SECONDS)) python -m storyboard_cli bench jobs/bench.yaml --parts draft $QUICK --results $R > $R/draft.log 2>&1
tail -n 3 $R/gpu_tests.log; tail -n 12 $R/draft.log; cat $R/*.md 2>/dev/null | head -n 40
