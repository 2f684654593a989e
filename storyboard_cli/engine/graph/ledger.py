"""The checks against the eager step, kept across runs. A compiled graph's first replay is compared with the eager step
once per kernels, weights and machine (engine/graph/runner.py `_check`); the match is written beside the artifacts
(`checked-<id>.json` in the compiled cache). A later run on the same artifacts, weights and machine checks its graphs
against their own kernels outside the graph (one step, engine/graph/check.py `first_step`), as a run does at other
rows after its own eager check. That leaves out a host-bound eager step per size (0.2-0.9 s each on an H200).

A record's identity holds everything the eager check's outcome depends on: the graph's variant, size, ControlNets, step
kind and dtype; the artifacts it runs at that size and precision (the UNet's, and with a guide the ControlNet's), by
the digest its load marker names (a rebuilt artifact is another); the weights (the UNet with its attention processors and each ControlNet, by sampled values: a
LoRA, a fine-tune or another file is other weights) and the files of the variant's constants (FP8's input scales);
the device's name, torch's and CUDA's versions; and the variant's limit. A record that cannot be named, read or
written is no record: the eager check runs.

Beside them, the library calls a warm-up of each size's kernels made (`plans-<id>.json`, engine/kernels/plans.py), by
the artifacts and the machine: a later run makes them ahead of that size's warm-up."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from storyboard_cli.engine.graph.keys import ShapeKey, Warmed
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.kernels.fp8 import fingerprint
from storyboard_cli.engine.variants import VARIANTS
from storyboard_cli.errors import one_line
from storyboard_cli.models.tiny import cache_root


log = logging.getLogger(__name__)


class CheckLedger:
    """The eager checks of `compiled`'s kernels on `models`, read and written under the compiled cache."""

    def __init__(self, models, compiled: CompiledKernels, root: Path | None = None):
        """`root`: where the records are (the compiled cache's folder by default)."""
        self.models, self.compiled = models, compiled
        self.root = root or compiled.root or cache_root() / "compiled"
        self._weights: tuple[int, list[str]] | None = None  # (the models' writes then, the fingerprints)
        self._seen: dict[tuple[ShapeKey, int], int | None] = {}  # read once per key and weights
        self._unnamed: set[ShapeKey] = set()  # whose record's name failed (said once)
        self.bound_writes = models.writes  # the weights' writes when the kernels were bound (`record`)

    def seen(self, key: ShapeKey) -> int | None:
        """The images of the graph whose first replay an earlier run checked `key`'s kernels with, or None."""
        memo = (key, self.models.writes)
        if memo not in self._seen:
            path = self._record_path(key)
            if path is None:  # its kernels are not built yet: read again once they are
                return None
            self._seen[memo] = self._read(path)
        return self._seen[memo]

    def record(self, key: ShapeKey, err: float) -> None:
        """Keeps that `key`'s first replay matched the eager step with relative error `err` (atomically). Only on the
        weights the kernels were bound to (no LoRA then, engine/kernels/calls.py): after an in-place write
        (SdxlModels.written, a LoRA swap) nothing is kept, so the records stay as many as the sizes and kinds a cache's
        models render, however many LoRA sets a farm's jobs bring."""
        path = None if self.models.writes != self.bound_writes else self._record_path(key)
        if path is None:
            return
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"shape": key.label, "batch": key.batch, "rel_error": err,
                                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.warning("check record %s not written: %s", path.name, e)

    @staticmethod
    def _read(path: Path | None) -> int | None:
        if path is None or not path.is_file():
            return None
        try:
            return int(json.loads(path.read_text())["batch"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("check record %s unreadable (%s): checking against the eager step", path.name, e)
            return None

    def _record_path(self, key: ShapeKey) -> Path | None:
        """`_path`, or None where naming the record fails: a record saves an eager check, and its name failing costs
        only the record, never the batch whose graph is checked (a plain graph's once raised KeyError here)."""
        try:
            return self._path(key)
        except Exception as e:  # noqa: BLE001 - see above
            if key not in self._unnamed:  # once per graph: `seen` asks again at each look
                self._unnamed.add(key)
                log.warning("no check record for %s (%s): checked against the eager step, nothing kept", key.label,
                            one_line(e, 160))
            return None

    def _path(self, key: ShapeKey) -> Path | None:
        """The record's file for `key`, None when its kernels have no marked artifact (nothing to name them by: a plain
        graph's are the modules'). The artifacts named are the ones its graph runs, loaded or not yet (a render loads
        its first batch's kernels just before that batch: CompiledKernels.want's `defer`): the size's UNet, and its
        ControlNet's where it has a guide."""
        variant = VARIANTS[key.variant]
        artifacts = self._artifacts(key.variant, key.height, key.width, key.control)
        if artifacts is None:
            return None
        constants = self.compiled.constants.get(variant.name)
        files = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in getattr(constants, "files", ())]
        identity = [key.variant, key.height, key.width, key.control, key.dtype, key.step.label, variant.check_rtol,
                    artifacts, self._fingerprints(), files, *self._machine()]
        return self._named("checked", identity)

    def plans_path(self, ran: Warmed) -> Path | None:
        """The file of the library calls a warm-up of `ran`'s kernels made (engine/kernels/plans.py `Plans`), kept for a
        later run: they follow from the artifacts it runs and the machine, not the weights. None where its kernels have
        no marked artifact, or are the modules' (a plain graph's warm-up: no artifact names it)."""
        artifacts = self._artifacts(ran.variant, ran.height, ran.width, ran.control)
        if artifacts is None:
            return None
        return self._named("plans", [ran.variant, ran.height, ran.width, ran.whole, ran.control, artifacts,
                                     *self._machine()])

    def _named(self, kind: str, identity: list) -> Path:
        return self.root / f"{kind}-{hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]}.json"

    def _artifacts(self, variant: str, height: int, width: int, control: int) -> list[str] | None:
        """The artifacts a graph of that variant, size and ControlNets runs (`_marker`), None where one has none or the
        variant has no artifacts (a plain graph runs the modules' kernels: its check and its warm-up's calls are not
        kept)."""
        if variant not in VARIANTS or not VARIANTS[variant].compiled:
            return None
        targets = [self.compiled.unet_target(height, width, variant)]
        targets += [self.compiled.controlnet_target(height, width, variant)] if control & 1 else []
        artifacts = sorted(self._marker(t) for t in targets)
        return None if None in artifacts else artifacts

    def _machine(self) -> list[str | None]:
        device = self.models.device
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
        return [machine, torch.__version__, torch.version.cuda]

    def _marker(self, target) -> str | None:
        """`target`'s artifact by the digest its load marker names (engine/kernels/artifacts.py `loads_here`)."""
        path = self.compiled.path(target)
        try:
            return f"{path.name} {path.with_suffix('.ok').read_text().split()[-1]}"
        except (OSError, IndexError):
            return None

    def _fingerprints(self) -> list[str]:
        """The weights' fingerprints, made again after an in-place write (SdxlModels.written: a LoRA swap)."""
        writes = self.models.writes
        if self._weights is None or self._weights[0] != writes:
            nets = [self.models.unet, *self.models.controlnets]
            self._weights = (writes, [fingerprint(self.models, net) for net in nets])
        return self._weights[1]
