"""What one image is and what a batch of them shares, without torch: `WorkItem` (one image's request, its identity,
the settings that decide its pixels and their fingerprint) and `BucketKey` (what changes a denoising loop's shape
or schedule, and its LoRA set; job/plan.py groups the items by it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from storyboard_cli.job.conditions.reference import Reference
from storyboard_cli.job.digests import SHORT, file_sha256, weights_digest
from storyboard_cli.job.lora_files import lora_set_label
from storyboard_cli.job.preflight import job_spec
from storyboard_cli.job.references import SHORTHAND_NET, LoraFile, ShotControl
from storyboard_cli.steps import (NO_DEEPCACHE, DeepCache, StepPlan, control_steps, guided_steps, levers_label,
                                  step_costs, step_plan)

LoraScales = tuple[tuple[str, float], ...]  # ((name, scale), ...) sorted by name: one LoRA set


@dataclass(frozen=True, order=True)
class BucketKey:
    """Everything that changes the shape or the schedule of a denoising loop, and the LoRA set (a batch
    runs under one set of weights). Not the references: rows with and without them share a batch."""

    width: int
    height: int
    steps: int
    sampler: str
    loras: LoraScales = ()
    guided: bool = True  # False: every image's guidance <= 1, the conditional rows alone at every step
    cfg_cutoff: float = 1.0
    deepcache: DeepCache = NO_DEEPCACHE  # with control: after every ControlNet's end
    control_end: float = 1.0  # the fraction of the steps the ControlNets run (a batch with control): the last's end
    nets: tuple[int, ...] = ()  # the nets the batch runs, sorted indices into Job.controlnets
    control_ends: tuple[float, ...] = ()  # one per entry of `nets` where they end at different fractions; else ()

    @property
    def control(self) -> bool:
        """Whether the batch runs any ControlNet."""
        return bool(self.nets)

    @property
    def control_mask(self) -> int:
        """Bit i set for net i of Job.controlnets."""
        return sum(1 << i for i in self.nets)

    @property
    def guided_steps(self) -> int:
        return guided_steps(self.steps, self.cfg_cutoff) if self.guided else 0

    @property
    def control_steps(self) -> int | None:
        """The steps the ControlNets run (the first ones, until the last of them ends); None without one."""
        return control_steps(self.steps, self.control_end) if self.control else None

    @property
    def plan(self) -> StepPlan:
        """Each step's kind (steps.step_plan): one plan per batch."""
        return step_plan(self.steps, self.guided_steps, self.deepcache.interval, self.deepcache.branch,
                         self.control_steps)

    @property
    def levers(self) -> str:
        """What the batches do differently from a full render ("" when nothing): the label's tail."""
        return levers_label(self.steps, self.guided, self.cfg_cutoff, self.control, self.control_end, self.deepcache)

    @property
    def label(self) -> str:
        nets = len(self.nets) if len(self.nets) > 1 else 0
        control = f" +{nets} controls" if nets else " +control" if self.control else ""
        lora = f" lora {lora_set_label(self.loras)}" if self.loras else ""
        levers = f" [{self.levers}]" if self.levers else ""
        return f"{self.width}x{self.height} {self.steps} steps {self.sampler}{control}{lora}{levers}"

    @property
    def flops_saved(self) -> float:
        """The fraction of the UNet's FLOPs a batch of this key saves against the same batch with every step
        guided and whole, the ControlNet included (step_costs): the estimate `bcg plan` shows per bucket."""
        return 1 - step_costs(self.plan, len(self.nets)) / self.steps


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One image to render. Identical requests share one item with several outputs."""

    shot: str
    k: int
    seed: int
    prompt: str
    negative: str
    width: int
    height: int
    steps: int
    guidance: float
    sampler: str
    outputs: tuple[str, ...]  # paths relative to the output folder; the first is the item's own
    loras: tuple[tuple[LoraFile, float], ...] = ()  # sorted by name, no zero scales
    cfg_cutoff: float = 1.0  # 1.0 where it does not apply (guidance <= 1: no guided step to cut)
    deepcache: DeepCache = NO_DEEPCACHE  # off where it does not apply (a ControlNet that runs to the end)
    draft: bool = False
    controls: tuple[ShotControl, ...] = ()  # every net, in the job's order; each end 1.0 where it runs every step
    references: tuple[Reference, ...] = ()
    reference_scale: float = 0.0  # the adapter's one scale for the row: its references' largest (0: none)
    ip_adapter: str | None = None  # the job's, where the item has references
    image_encoder: str | None = None  # the job's `image_encoder:`, where the item has references and it is given
    folder: Path | None = None  # the job file's folder, which the model fields' relative paths are read from

    @property
    def lora_scales(self) -> LoraScales:
        return tuple((f.name, scale) for f, scale in self.loras)

    @property
    def key(self) -> BucketKey:
        nets = tuple(c.index for c in self.controls)
        ends = tuple(c.end for c in self.controls)
        return BucketKey(self.width, self.height, self.steps, self.sampler, self.lora_scales, self.guidance > 1,
                         self.cfg_cutoff, self.deepcache, max(ends, default=1.0), nets,
                         ends if len(set(ends)) > 1 else ())

    @property
    def identity(self) -> tuple:
        return (self.prompt, self.negative, self.width, self.height, self.seed, self.steps, self.guidance,
                self.sampler, tuple((f.sha256, scale) for f, scale in self.loras), self.cfg_cutoff, self.deepcache,
                self.draft, tuple((str(c.image), c.scale, c.end, c.net) for c in self.controls),
                tuple((r.sha256, r.scale) for r in self.references))

    def settings(self, model: str) -> dict:
        """What decides the pixels: written into each PNG and the manifest, and used to tell a stale file
        from a done one. Files are recorded by content (a control image's sha256, a LoRA's hash, weights
        given as a path by size + mtime + header); keys appear only where they apply, so an image without
        them keeps its fingerprint. The one net of the `controlnet:` shorthand (SHORTHAND_NET): the `control_*`
        keys it always had; named or several nets: a `controls` list."""
        s = {"prompt": self.prompt, "negative": self.negative, "width": self.width, "height": self.height,
             "seed": self.seed, "steps": self.steps, "guidance": self.guidance, "sampler": self.sampler,
             "model": model}
        weights = partial(_put_weights, folder=self.folder)
        weights(s, "model_weights", model)
        if shorthand(self.controls):
            c = self.controls[0]
            s.update(controlnet=c.model, control_image=c.file or str(c.image), control_scale=c.scale,
                     control_sha256=_content(c.image))
            weights(s, "controlnet_weights", c.model)
            if c.end < 1:
                s["control_end"] = c.end
        elif self.controls:
            s["controls"] = [_control_settings(c, weights) for c in self.controls]
        if self.references:
            s["ip_adapter"] = self.ip_adapter
            weights(s, "ip_adapter_weights", self.ip_adapter)
            if self.image_encoder is not None:
                s["image_encoder"] = self.image_encoder
                weights(s, "image_encoder_weights", self.image_encoder)
            s["references"] = [{"file": r.file, "sha256": r.sha256[:SHORT], "scale": r.scale}
                               | ({"character": r.character} if r.character else {}) for r in self.references]
            s["reference_scale"] = self.reference_scale
        if self.loras:
            s["loras"] = [{"name": f.name, "scale": scale, "file": f.file, "sha256": f.sha256,
                           "shorthash": f.shorthash} for f, scale in self.loras]
        if self.cfg_cutoff < 1:
            s["cfg_cutoff"] = self.cfg_cutoff
        if self.deepcache:
            s["deepcache"] = self.deepcache.to_json()
        if self.draft:
            s["draft"] = True
        return s

    def fingerprint(self, model: str) -> str:
        s = self.settings(model)
        # where the files live does not decide the pixels: a moved project folder keeps its images
        s.pop("control_image", None)
        for name, entries in (("image", "controls"), ("file", "references"), ("file", "loras")):
            for entry in s.get(entries, ()):
                entry.pop(name)
        blob = json.dumps(s, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def shorthand(controls: tuple[ShotControl, ...]) -> bool:
    """Whether an image's guides are the one net of the `controlnet:` shorthand (recorded in its own keys)."""
    return [c.net for c in controls] == [SHORTHAND_NET]


def _control_settings(c: ShotControl, weights: Callable[[dict, str, str | None], None]) -> dict:
    """One net's entry in the settings' `controls` (`weights`: `_put_weights` from the job's folder)."""
    entry = {"net": c.net, "controlnet": c.model, "image": c.file or str(c.image), "scale": c.scale,
             "sha256": _content(c.image)}
    weights(entry, "controlnet_weights", c.model)
    if c.end < 1:
        entry["end"] = c.end
    return entry


def _content(path: Path) -> str:
    try:
        return file_sha256(path)[:SHORT]
    except OSError as e:  # gone since the job was loaded: the render fails this image and names the file
        return f"unreadable: {e.strerror or e.__class__.__name__}"


def _put_weights(settings: dict, key: str, spec: str | None, folder: Path | None) -> None:
    """The digest of the weights a spec names on disk (read as the loaders read it: job_spec), where it names some."""
    digest = weights_digest(job_spec(spec, folder) if folder is not None else spec)
    if digest is not None:
        settings[key] = digest
