"""A kernel cache's artifacts renamed from the key that named the GPU (before f9ffd5c: `torch.cuda.get_device_name`)
to today's, which names its properties (engine/kernels/artifacts.py `gpu_facts`), so that the sets built on an H100
before that commit serve this machine's card without a rebuild (about 500 s for the bench job's two sets).

    python benchmarks/probes/rekey.py "NVIDIA H100 80GB HBM3" [--root CACHE/compiled] [--model sdxl-random]

For each artifact in the cache (`<module>[-fp8][-refsN][-tag...]-<W>x<H>-<key>.pt2`), its target is read from its
name and its key made again as the code before computed it on the card named: where that is the file's key, the
artifact and its marker, failure and build record are renamed to the key this card gives. An artifact of a model not
loaded here, or built on another card, keeps its name. The check records (`checked-*.json`) name the artifacts they
checked, so each graph is checked against eager again at its first use. Prints one line per artifact and this card's
facts; writes nothing but the renames (each renamed file touched: benchmarks/gpu.sh sends back what is newer than its
call's start).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from unittest import mock

import torch

from storyboard_cli.engine.kernels import artifacts
from storyboard_cli.engine.kernels.export import Target
from storyboard_cli.engine.variants import PRECISIONS
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.models.tiny import cache_root

NAME = re.compile(r"(?P<module>unet|controlnet)(?P<rest>(?:-[a-z0-9x]+)*?)-(?P<w>\d+)x(?P<h>\d+)-(?P<key>[0-9a-f]{20})")
SUFFIXES = (".pt2", ".ok", ".bad", ".build.json")


def target_of(name: str) -> tuple[Target, str] | None:
    """The target and key an artifact's file name gives (artifacts.artifact_path's name), None for another file."""
    m = NAME.fullmatch(name)
    if m is None:
        return None
    precision, refs, tags = Target.precision, 0, []  # the dataclass's default: fp16's
    for part in filter(None, m["rest"].split("-")):
        if part in PRECISIONS:
            precision = part
        elif part.startswith("refs") and part[4:].isdigit():
            refs = int(part[4:])
        else:
            tags.append(part)
    return Target(m["module"], int(m["h"]), int(m["w"]), precision, refs, tuple(tags)), m["key"]


def legacy_key(target: Target, model: torch.nn.Module, built_on: str) -> str:
    """The key the code before f9ffd5c gave `target` on the card named `built_on`: the GPU's name where its facts
    are now."""
    with mock.patch.object(artifacts, "gpu_facts", lambda dev: built_on):
        return artifacts.artifact_key(target, model)


def rekey(root: Path, models, built_on: str) -> list[str]:
    """Renames the artifacts under `root` built on `built_on` to this card's keys; returns a line for each."""
    lines = []
    for path in sorted(root.glob("*.pt2")):
        found = target_of(path.name.removesuffix(".pt2"))
        if found is None:
            continue
        target, key = found
        model = artifacts.module_of(models, target.module)
        if model is None or legacy_key(target, model, built_on) != key:
            lines.append(f"{path.name}: kept (not built on {built_on} for the models loaded)")
            continue
        new = artifacts.artifact_path(target, model, root)
        for suffix in SUFFIXES:
            old = path.with_name(path.name.removesuffix(".pt2") + suffix)
            if old.exists():
                moved = old.rename(new.with_name(new.name.removesuffix(".pt2") + suffix))
                moved.touch()  # a rename keeps the time: a GPU call's art.tgz carries what is newer than its start
        lines.append(f"{path.name} -> {new.name}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("built_on", help="the GPU's name the artifacts were built on")
    ap.add_argument("--root", type=Path, default=None, help="the cache's compiled/ folder")
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    models = load_sdxl(args.model, args.model, args.device, dtype)
    if device.type == "cuda":
        print(f"this card: {torch.cuda.get_device_name(device)} {artifacts.gpu_facts(device)}", flush=True)
    for line in rekey(args.root or cache_root() / "compiled", models, args.built_on):
        print(line, flush=True)


if __name__ == "__main__":
    main()
