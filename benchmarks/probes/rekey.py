"""A kernel cache's artifacts renamed from the key that named the GPU (before f9ffd5c: `torch.cuda.get_device_name`)
to today's, which names its properties (engine/kernels/artifacts.py `gpu_facts`), so that the sets built on an H100
before that commit serve this machine's card without a rebuild (about 500 s for the bench job's two sets).

    python benchmarks/probes/rekey.py "NVIDIA H100 80GB HBM3" [--job jobs/bench.yaml] [--root CACHE/compiled]

The job's artifacts, fp16 and FP8 (`artifacts.targets` of its batches' shapes, as a render asks for them): each one's
path as the code before named it on the card named, and where the cache has that file, the artifact and its marker,
failure and build record renamed to the path this card gives. A file the job does not name keeps its name. The check
records (`checked-*.json`) name the artifacts they checked, so each graph is checked against eager again at its first
use. Prints one line per target and this card's facts; writes nothing but the renames (each renamed file touched:
benchmarks/gpu.sh sends back what is newer than its call's start).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import torch

from storyboard_cli.engine.kernels import artifacts
from storyboard_cli.engine.kernels.export import Target
from storyboard_cli.engine.variants import COMPILED, FP8
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.models.tiny import cache_root
from storyboard_cli.run.batch import batch_shapes

SUFFIXES = (".pt2", ".ok", ".bad", ".build.json")


def job_targets(job_path: Path) -> list[Target]:
    """The fp16 and FP8 artifacts a render of the job uses."""
    job = load_job(job_path)
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    return [t for variant in (COMPILED, FP8) for t in artifacts.targets(shapes, controlnet=True, variant=variant)]


def legacy_path(target: Target, model: torch.nn.Module, root: Path, built_on: str) -> Path:
    """`target`'s file as the code before f9ffd5c named it on the card named `built_on`: the GPU's name where its
    facts are now."""
    with mock.patch.object(artifacts, "gpu_facts", lambda dev: built_on):
        return artifacts.artifact_path(target, model, root)


def rekey(root: Path, models, targets: list[Target], built_on: str) -> list[str]:
    """Renames the artifacts of `targets` under `root` built on `built_on` to this card's names; a line for each."""
    lines = []
    for target in targets:
        model = artifacts.module_of(models, target.module)
        old, new = legacy_path(target, model, root, built_on), artifacts.artifact_path(target, model, root)
        if not old.is_file():
            lines.append(f"{target.label}: kept what the cache holds (no {old.name}, built on {built_on})")
            continue
        for suffix in SUFFIXES:
            if (was := old.with_name(old.name.removesuffix(".pt2") + suffix)).exists():
                moved = was.rename(new.with_name(new.name.removesuffix(".pt2") + suffix))
                moved.touch()  # a rename keeps the time: a GPU call's art.tgz carries what is newer than its start
        lines.append(f"{old.name} -> {new.name}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("built_on", help="the GPU's name the artifacts were built on")
    ap.add_argument("--job", type=Path, default=Path("jobs/bench.yaml"))
    ap.add_argument("--root", type=Path, default=None, help="the cache's compiled/ folder")
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    models = load_sdxl(args.model, args.model, args.device, dtype)
    if device.type == "cuda":
        print(f"this card: {torch.cuda.get_device_name(device)} {artifacts.gpu_facts(device)}", flush=True)
    for line in rekey(args.root or cache_root() / "compiled", models, job_targets(args.job), args.built_on):
        print(line, flush=True)


if __name__ == "__main__":
    main()
