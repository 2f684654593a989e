#!/usr/bin/env bash
# The draft kinds' capture cost on two GPUs of one host, side by side, --compile off: GPU 0 runs bench/gpu_draft.sh
# (the draft GPU tests, then `bcg bench --parts draft`: step loops, the bench job with and without --draft, and
# the capture seconds / warm-ups / pool MB of the draft kinds against today's); GPU 1 runs `bcg capture
# jobs/bench.yaml --warm` without and with --draft (each its own process: the whole command's wall seconds, model
# loading included, and its JSON rows). Everything comes back as $OUT/logs.tgz. Budget: 560 s.
# Usage: OUT=/some/dir bash bench/gpu_capture.sh
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=$(mktemp -d /tmp/capture-results.XXXX); mkdir -p "$OUT" $R/draft
pack() { tar czf "$OUT/logs.tgz" -C "$R" .; }
trap pack EXIT
(export CUDA_VISIBLE_DEVICES=0 BCG_CACHE=/tmp/bcg-draft; OUT=$R/draft BUDGET=540 bash bench/gpu_draft.sh \
  > $R/draft/stdout.log 2>&1; tar xzf $R/draft/logs.tgz -C $R/draft) &
(export CUDA_VISIBLE_DEVICES=1 BCG_CACHE=/tmp/bcg-capture
 for mode in plain draft; do
   flag=""; [ $mode = draft ] && flag="--draft"
   start=$EPOCHREALTIME
   timeout 240 python -m storyboard_cli capture jobs/bench.yaml --warm --compile off $flag --json > $R/capture-$mode.json 2> $R/capture-$mode.log
   echo "$mode rc=$? wall_s=$(awk "BEGIN{print $EPOCHREALTIME - $start}")" >> $R/capture-walls.txt
 done) &
wait
cat $R/capture-walls.txt; tail -n 3 $R/draft/gpu_tests.log; grep -h "draft capture\|draft job\|draft steps" $R/draft/draft.log
