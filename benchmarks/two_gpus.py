"""One job on two GPUs against one, on one machine in one call (docs/PERFORMANCE.md, "Multi-GPU"): whether the
pixels are equal, and the images/s after loading (capture included, weight loading excluded) with the workers
table. The 1-GPU figure is the job's images over the render's wall less its load stage; the 2-GPU figure is what
run/dist.py reports (from the first worker ready to the last one done).

    python benchmarks/two_gpus.py bench [--work DIR] [--out REC.json]   # jobs/bench.yaml on sdxl-random, --compile
        off: the speed-up (goal >= 1.85x), and whether one GPU repeats itself (two 1-GPU renders at once, one per GPU)
    python benchmarks/two_gpus.py tiny [--work DIR]                     # a small tiny-model job: the path, the pixels
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
TINY = """version: 1
model: tiny
controlnet: tiny
buckets: [1, 2, 4]
shots:
  - {id: big, prompt: a lighthouse at night, steps: 8, size: 256x384, candidates: 5, seed: 11}
  - {id: wide, prompt: a boat in the waves, steps: 8, size: 384x256, candidates: 3, seed: 12}
  - {id: small, prompt: a hut, steps: 6, size: 256x256, candidates: 6, seed: 13, sampler: dpmpp_2m}
  - {id: pose, prompt: the keeper, steps: 6, size: 256x256, candidates: 2, seed: 14, control: {image: control/hero_pose.png, scale: 0.8}}
"""
# NVLink multicast stays off on the lent machines
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def render(work: Path, job: str, out: str, *args: str, gpu: str | None = None) -> subprocess.Popen:
    env = {**os.environ, **ENV, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    return subprocess.Popen([sys.executable, "-m", "storyboard_cli", "render", job, "--out", out, "--quiet", *args],
                            cwd=work, env=env)


def wait(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.wait() != 0:
            sys.exit(f"{' '.join(p.args)}: exit {p.returncode}")


def pixels(a: Path, b: Path) -> dict:
    """Which PNGs of two output folders differ, and by how much."""
    pa, pb = (sorted(p.relative_to(d).as_posix() for p in d.rglob("*.png")) for d in (a, b))
    if pa != pb:
        sys.exit(f"{a.name} has {len(pa)} PNGs, {b.name} {len(pb)}")
    diff = {}
    for p in pa:
        x, y = (np.asarray(Image.open(d / p), dtype=np.int16) for d in (a, b))
        if not np.array_equal(x, y):
            diff[p] = f"max |diff| {np.abs(x - y).max()}, {int((x != y).any(-1).sum())} pixels"
    return {"images": len(pa), "different": diff}


def speed(one: Path, two: Path) -> dict:
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (one, two))
    single = ra["images_rendered"] / (ra["wall_s"] - ra["stages_s"]["load"])
    return {"one_gpu": {"wall_s": ra["wall_s"], "load_s": ra["stages_s"]["load"], "capture_s": ra["stages_s"]["capture"],
                        "images_per_s_after_load": round(single, 4)},
            "two_gpus": {"wall_s": rb["wall_s"], "render_s": rb["render_s"],
                         "images_per_s_after_load": rb["render_images_per_s"], "workers": rb["workers"]},
            "ratio": round(rb["render_images_per_s"] / single, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", choices=("bench", "tiny"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/two-gpus"), help="the job's copy and the output folders")
    ap.add_argument("--out", type=Path, help="the record as JSON")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "jobs" / "control", work / "control", dirs_exist_ok=True)
    rec: dict = {"job": args.job}
    if args.job == "tiny":
        (work / "tiny.yaml").write_text(TINY)
        wait(render(work, "tiny.yaml", "t1", "--device", "cuda", "--json"))
        wait(render(work, "tiny.yaml", "t2", "--gpus", "2"))
        rec.update(pixels=pixels(work / "t1", work / "t2"), speed=speed(work / "t1", work / "t2"))
    else:
        shutil.copy(ROOT / "jobs" / "bench.yaml", work / "bench.yaml")
        # one GPU twice at once (is one GPU's render itself repeatable?), then both GPUs on the job
        wait(render(work, "bench.yaml", "b1", "--device", "cuda", "--compile", "off", gpu="0"),
             render(work, "bench.yaml", "b1x", "--device", "cuda", "--compile", "off", gpu="1"))
        wait(render(work, "bench.yaml", "b2", "--compile", "off", "--gpus", "2"))
        rec.update(one_gpu_twice=pixels(work / "b1", work / "b1x"), pixels=pixels(work / "b1", work / "b2"),
                   speed=speed(work / "b1", work / "b2"))
    text = json.dumps(rec, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
