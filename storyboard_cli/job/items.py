"""What one image is and what a batch of them shares, without torch: `WorkItem` (one image's request, its identity,
the settings that decide its pixels and their fingerprint) and `BucketKey` (what changes a denoising loop's shape
or schedule, and its LoRA set; job/plan.py groups the items by it). Both inherit each conditioning kind's part
(job/conditions/: `item.controls`, `key.nets`) and ask the kinds for their share of the identity, the key, the
step plan and the settings."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from storyboard_cli.job.conditions import KINDS, merged, parts
from storyboard_cli.job.digests import weights_digest
from storyboard_cli.job.files import LoraFile
from storyboard_cli.job.hires import Hires
from storyboard_cli.job.refinement import Refinement
from storyboard_cli.job.lora_files import lora_set_label
from storyboard_cli.job.preflight import job_spec
from storyboard_cli.steps import (NO_DEEPCACHE, DeepCache, StepPlan, control_steps, guided_steps, levers_label,
                                  step_costs, step_plan)

LoraScales = tuple[tuple[str, float], ...]  # ((name, scale), ...) sorted by name: one LoRA set


@dataclass(frozen=True, order=True)
class BucketKey(*parts("KeyPart")):
    """Everything that changes the shape or the schedule of a denoising loop, and the LoRA set (a batch
    runs under one set of weights); each conditioning kind's part (`Kind.key`: a ControlNet's nets; rows with and
    without references share a batch)."""

    width: int
    height: int
    steps: int
    sampler: str
    loras: LoraScales = ()
    guided: bool = True  # False: every image's guidance <= 1, the conditional rows alone at every step
    cfg_cutoff: float = 1.0
    deepcache: DeepCache = NO_DEEPCACHE  # with a side network (a ControlNet): after the last one's end

    @property
    def sides(self) -> tuple[int, float]:
        """(the side networks the batch runs at each step, the fraction of the steps until the last one ends): the
        kinds' (`Kind.side`)."""
        sides = [kind.side(self) for kind in KINDS]
        return sum(n for n, _ in sides), max((end for n, end in sides if n), default=1.0)

    @property
    def first(self) -> int:
        """The schedule's first step the batch runs: the steps before it are skipped (an init image's strength, the
        kinds' `Kind.first`); its rows run the last `runs` of the `steps`."""
        return max((kind.first(self) for kind in KINDS), default=0)

    @property
    def runs(self) -> int:
        """The steps the batch runs: the step plan, the cut-off and the side networks' ends count over them."""
        return self.steps - self.first

    @property
    def control(self) -> bool:
        """Whether the batch's steps run a side network (steps.StepKind.control)."""
        return self.sides[0] > 0

    @property
    def guided_steps(self) -> int:
        return guided_steps(self.runs, self.cfg_cutoff) if self.guided else 0

    @property
    def control_steps(self) -> int | None:
        """The steps the side networks run (the first ones, until the last of them ends); None without one."""
        n, end = self.sides
        return control_steps(self.runs, end) if n else None

    @property
    def plan(self) -> StepPlan:
        """Each step's kind (steps.step_plan): one plan per batch."""
        return step_plan(self.runs, self.guided_steps, self.deepcache.interval, self.deepcache.branch,
                         self.control_steps)

    @property
    def levers(self) -> str:
        """What the batches do differently from a full render ("" when nothing): the label's tail."""
        n, end = self.sides
        return levers_label(self.runs, self.guided, self.cfg_cutoff, n > 0, end, self.deepcache)

    @property
    def label(self) -> str:
        conditioned = "".join(kind.label(self) for kind in KINDS)
        lora = f" lora {lora_set_label(self.loras)}" if self.loras else ""
        levers = f" [{self.levers}]" if self.levers else ""
        return f"{self.width}x{self.height} {self.steps} steps {self.sampler}{conditioned}{lora}{levers}"

    @property
    def flops_saved(self) -> float:
        """The fraction of the UNet's FLOPs a batch of this key saves against the same batch with every step
        guided and whole, the side networks included (step_costs): the estimate `bcg plan` shows per bucket."""
        return 1 - step_costs(self.plan, self.sides[0]) / self.runs


@dataclass(frozen=True, kw_only=True)
class WorkItem(*parts("ItemPart")):
    """One image to render. Identical requests share one item with several outputs. What it is conditioned on are its
    kinds' fields (job/conditions/: `item.controls`, `item.references`)."""

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
    hires: Hires | None = None  # a hires pass: its settings record the size it makes (job/hires.py)
    refine: Refinement | None = None  # a refinement of a candidate (`bcg refine`)
    final: WorkItem | None = None  # a hires pass's item: the planned image whose settings and name it writes
    folder: Path | None = None  # the job file's folder, which the model fields' relative paths are read from

    @property
    def recorded(self) -> WorkItem:
        """The item an image's metadata speaks of: a hires pass writes its planned image's (job/plan.py
        `second_pass`)."""
        return self.final if self.final is not None else self

    @property
    def lora_scales(self) -> LoraScales:
        return tuple((f.name, scale) for f, scale in self.loras)

    @property
    def key(self) -> BucketKey:
        return BucketKey(self.width, self.height, self.steps, self.sampler, self.lora_scales, self.guidance > 1,
                         self.cfg_cutoff, self.deepcache, **merged(kind.key(self) for kind in KINDS))

    @property
    def identity(self) -> tuple:
        return (self.prompt, self.negative, self.width, self.height, self.seed, self.steps, self.guidance,
                self.sampler, tuple((f.sha256, scale) for f, scale in self.loras), self.cfg_cutoff, self.deepcache,
                self.draft, self.hires, self.refine, *(kind.identity(self) for kind in KINDS))

    def settings(self, model: str) -> dict:
        """What decides the pixels: written into each PNG and the manifest, and used to tell a stale file
        from a done one. Files are recorded by content (a control image's sha256, a LoRA's hash, weights
        given as a path by size + mtime + header); keys appear only where they apply, so an image without
        them keeps its fingerprint. Each conditioning kind writes its own (`Kind.settings`). A hires pass writes
        the planned image's (`recorded`): its fingerprint is known before its first pass has run."""
        if self.final is not None:
            return self.final.settings(model)
        s = {"prompt": self.prompt, "negative": self.negative, "width": self.width, "height": self.height,
             "seed": self.seed, "steps": self.steps, "guidance": self.guidance, "sampler": self.sampler,
             "model": model}
        weights = partial(_put_weights, folder=self.folder)
        weights(s, "model_weights", model)
        for kind in KINDS:
            s.update(kind.settings(self, weights))
        if self.loras:
            s["loras"] = [{"name": f.name, "scale": scale, "file": f.file, "sha256": f.sha256,
                           "shorthash": f.shorthash} for f, scale in self.loras]
        if self.cfg_cutoff < 1:
            s["cfg_cutoff"] = self.cfg_cutoff
        if self.deepcache:
            s["deepcache"] = self.deepcache.to_json()
        if self.draft:
            s["draft"] = True
        if self.hires is not None:
            s["hires"] = self.hires.settings(self.width, self.height, self.steps)
        if self.refine is not None:
            s["refine"] = self.refine.settings()
        return s

    def fingerprint(self, model: str) -> str:
        if self.final is not None:
            return self.final.fingerprint(model)
        s = self.settings(model)
        # where the files live does not decide the pixels: a moved project folder keeps its images
        for kind in KINDS:
            kind.unplaced(s)
        for entry in s.get("loras", ()):
            entry.pop("file")
        blob = json.dumps(s, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _put_weights(settings: dict, key: str, spec: str | None, folder: Path | None) -> None:
    """The digest of the weights a spec names on disk (read as the loaders read it: job_spec), where it names some."""
    digest = weights_digest(job_spec(spec, folder) if folder is not None else spec)
    if digest is not None:
        settings[key] = digest
