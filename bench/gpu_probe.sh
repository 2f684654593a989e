#!/usr/bin/env bash
# Where the first compiled-artifact load of a process goes (bench/load_probe.py), with the process tree
# sampled every 3 s; twice in fresh processes, then once with a single compile thread.
# Usage: ART=.art OUT=/some/dir bash bench/gpu_probe.sh
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R; trap 'tar czf $OUT/logs.tgz -C $R .' EXIT
A=$(ls $ART/unet-1024x1024-*.pt2); B=$(ls $ART/unet-1216x832-*.pt2)
sample() { while true; do echo "-- $(date +%T)"; ps -eo pid,ppid,etimes,pcpu,rss,args --forest | grep -v "ps -eo" | cut -c1-200 | tail -n 25; sleep 3; done; }
caches() { echo "-- caches: $(du -sh ~/.triton 2>/dev/null) $(du -sh ~/.nv 2>/dev/null) $(du -sh /tmp/inductor 2>/dev/null)"; }
for run in 1 2 3; do
  [ $run = 3 ] && export TORCHINDUCTOR_COMPILE_THREADS=1
  caches >> $R/probe$run.log
  sample > $R/ps$run.log 2>&1 & S=$!
  timeout -s ABRT 75 python -X faulthandler bench/load_probe.py $A $B >> $R/probe$run.log 2>&1; echo "rc=$?" >> $R/probe$run.log
  kill $S; caches >> $R/probe$run.log
  grep -v "^ *File\|^Thread\|^Current\|^$" $R/probe$run.log | head -n 20
done
