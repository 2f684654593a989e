#!/bin/bash
# bcg workers as a Slurm array: one task per GPU, each a `bcg worker` leasing from the server
# (docs/SERVE.md, "Scaling"). The array's size is the number of GPUs; tasks that start late join the jobs
# already running. Arguments go to `bcg worker` (--upload where the nodes do not share the server's --root).
#   BCG_SERVER=http://bcg-server:8188 BCG_WORKER_TOKEN=... sbatch deploy/slurm-workers.sh
#SBATCH --job-name=bcg-workers
#SBATCH --array=0-7
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=08:00:00
#SBATCH --signal=INT@120
# SIGINT 2 minutes before the time limit: the running batch finishes, the rest of the lease goes back
set -euo pipefail
: "${BCG_WORKER_TOKEN:?set BCG_WORKER_TOKEN (the --worker-token of the server)}"
export BCG_WORKER_TOKEN
# a worker whose render stopped progressing (its GPU hung: --stall-s) exits 75; the task starts it again on a fresh
# device context. Any other status ends the task with it (0: stopped by the SIGINT above)
while :; do
  status=0
  srun bcg worker --server "${BCG_SERVER:-http://bcg-server:8188}" \
    --name "slurm-${SLURM_ARRAY_JOB_ID:-0}-${SLURM_ARRAY_TASK_ID:-0}" "$@" || status=$?
  [ "$status" -eq 75 ] || exit "$status"
  echo "slurm-workers.sh: the worker's render stalled (exit 75): starting it again" >&2
done
