"""A new process and a cache that has a job's compiled kernels: seconds from the weights loaded to every
shape of the job loaded (its kernels bound), captured and checked against the eager step, as a render's
first batches would need them. The figure behind docs/PERFORMANCE.md's "ready after the weights".

    python benchmarks/ready.py jobs/bench.yaml OUT.json [--fp8]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from storyboard_cli.engine.build import graph_runner
from storyboard_cli.engine.sampling import schedule
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.run.batch import batch_shapes
from storyboard_cli.run.capture import synthetic_inputs


def main(job_path: str, out: str) -> None:
    job = load_job(Path(job_path))
    t0 = time.perf_counter()
    models = load_sdxl(job.model, tuple(spec for _, spec in job.controlnets), "cuda", torch.float16)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    shapes = sorted(set(batch_shapes(make_batches(work_items(job), job.buckets))), reverse=True)
    notes: list[str] = []
    runner = graph_runner(models, shapes, "auto", notes, fp8="--fp8" in sys.argv)
    runner.prepare(shapes)
    t2 = time.perf_counter()
    sched = schedule("euler", 2, models.scheduler_config)
    for s in shapes:  # the first replay of each graph is checked against the eager step
        x, cond, ctl, guidance = synthetic_inputs(models, s.batch, s.width, s.height, s.control)
        runner.sample(x * sched.init_sigma, sched, None, cond, ctl, guidance)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    rows = runner.describe()
    rec = {"weights_s": round(t1 - t0, 1), "ready_after_weights_s": round(t3 - t1, 1),
           "load_and_capture_s": round(t2 - t1, 1), "checks_s": round(t3 - t2, 1), "shapes": len(shapes),
           "compiled_checked": sum(r["state"] == "graph" and {"compiled", "fp8"} & set(r["shape"].split())
                                   and "checked" in r["reason"]
                                   for r in rows),
           "artifact_load_s": {t.label: round(v, 3) for t, v in runner.compiled.load_s.items()},
           "notes": notes, "graphs": rows}
    Path(out).write_text(json.dumps(rec, indent=1))
    sys.stdout.write(json.dumps({k: v for k, v in rec.items() if k != "graphs"}, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
