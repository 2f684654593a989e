"""A kernel cache's artifacts renamed from the key that named the GPU's L2 size (before the thirty-fifth session's
change to engine/kernels/artifacts.py `GPU_FACTS`) to today's, which leaves it out, so that the sets built before
serve this machine's card without a rebuild (about 770 s for the bench job's two sets) and an H200 finds an H100 SXM's
sets (their L2: 60 against 50 MiB; every other property the key names is the same).

    python benchmarks/probes/rekey.py [L2_BYTES] [--job jobs/bench.yaml] [--root CACHE/compiled]

L2_BYTES: the L2 of the card the artifacts were built on (default an H100 SXM's, 52428800). The job's artifacts, fp16
and FP8 (`artifacts.targets` of its batches' shapes, as a render asks for them): each one's path as the code before
named it on this card's properties with that L2, and where the cache has that file, the artifact and its marker,
failure and build record renamed to the path this card gives. A file the job does not name keeps its name. The check
records (`checked-*.json`) name the artifacts by their bytes, not their names: they still match on the card they were
made on. Prints one line per target and this card's facts; writes nothing but the renames (each renamed file touched:
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
H100_SXM_L2 = 50 << 20


def job_targets(job_path: Path) -> list[Target]:
    """The fp16 and FP8 artifacts a render of the job uses."""
    job = load_job(job_path)
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    return [t for variant in (COMPILED, FP8) for t in artifacts.targets(shapes, controlnet=True, variant=variant)]


def legacy_path(target: Target, model: torch.nn.Module, root: Path, l2: int) -> Path:
    """`target`'s file as the code before named it: this card's properties, and the L2 size `l2`."""
    facts = artifacts.gpu_facts
    with mock.patch.object(artifacts, "gpu_facts", lambda dev: {**facts(dev), "L2_cache_size": l2}):
        return artifacts.artifact_path(target, model, root)


def rekey(root: Path, models, targets: list[Target], l2: int) -> list[str]:
    """Renames the artifacts of `targets` under `root` built on a card with L2 size `l2` to today's names; a line
    for each."""
    lines = []
    for target in targets:
        model = artifacts.module_of(models, target.module)
        old, new = legacy_path(target, model, root, l2), artifacts.artifact_path(target, model, root)
        if not old.is_file():
            lines.append(f"{target.label}: kept what the cache holds (no {old.name})")
            continue
        for suffix in SUFFIXES:
            if (was := old.with_name(old.name.removesuffix(".pt2") + suffix)).exists():
                moved = was.rename(new.with_name(new.name.removesuffix(".pt2") + suffix))
                moved.touch()  # a rename keeps the time: a GPU call's art.tgz carries what is newer than its start
        lines.append(f"{old.name} -> {new.name}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("l2", nargs="?", type=int, default=H100_SXM_L2, help="the L2 bytes of the card built on")
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
    for line in rekey(args.root or cache_root() / "compiled", models, job_targets(args.job), args.l2):
        print(line, flush=True)


if __name__ == "__main__":
    main()
