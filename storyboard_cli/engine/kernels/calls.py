"""The step's module calls on compiled kernels (`CompiledKernels`, a `StepCalls`): the artifacts
(engine/kernels/artifacts.py) loaded with their constants bound to the rendering modules' own tensors, one per module
and size, in the variants of one run (engine/variants.py: with --fp8 the FP8 UNets and ControlNets, the fp16 ones beside
them where the cache has them). They run inside GraphRunner's graphs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.conditions import KINDS
from storyboard_cli.engine.eager import StepCalls
from storyboard_cli.engine.kernels.artifacts import (MODULES, Target, artifact_path, fits, loads_here, module_of,
                                                     open_package, targets)
from storyboard_cli.engine.kernels.builds import stage
from storyboard_cli.engine.kernels.export import Residuals, channels_last_weights, fuse_projections, nhwc
from storyboard_cli.engine.variants import COMPILED, VARIANTS, chain
from storyboard_cli.errors import one_line
from storyboard_cli.models.tiny import cache_root


LOAD_CHECK_S = 20.0  # about how long a load check's child takes (it imports torch and loads one artifact)


def load(target: Target, models: Any, path: Path, constants: Any = None) -> Callable:
    """The compiled call, its constants bound to the rendering modules' own tensors (the fused attention
    weights, the channels_last convolution copies, every other parameter as it is) and to what its variant's
    `constants` (prepared once per run) adds: an FP8 artifact's FP8 weights and scales derived from them, and its
    calibrated input scales."""
    model, prefix = module_of(models, target.module), f"{target.module}."
    compiled = open_package(path)
    tensors = {prefix + n: t for n, t in model.state_dict(keep_vars=True).items()}
    tensors.update({prefix + n: t for n, t in channels_last_weights(models, model).items()})
    if constants is not None:
        tensors.update({prefix + n: t for n, t in constants.tensors(models, model).items()})
    wanted = compiled.get_constant_fqns()
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise RuntimeError(f"artifact wants {len(missing)} constants the model lacks, e.g. {missing[0]}")
    constants = {n: tensors[n].detach() for n in wanted}  # the same storages, without autograd state
    compiled.load_constants(constants, check_full_update=True, user_managed=True)
    compiled.bcg_constants = constants  # user-managed: the loader keeps pointers, we keep the tensors alive
    return compiled
def _scalar(t: torch.Tensor) -> torch.Tensor:
    """The exported calls take the timestep as a scalar; the step passes a row of its coefficient table
    expanded to [2B]. Cloned: a view into the table is not 16-byte aligned, which compiled kernels assume."""
    return t.reshape(-1)[0].clone()


class CompiledKernels(StepCalls):
    """The step's module calls on compiled kernels, one artifact per module and size (see StepCalls).

    Holds the artifacts loaded so far; `builds` (engine/kernels/builds.py) makes the missing ones in the
    background, and `poll` (between batches) loads what they finished, so a size switches to its
    compiled graph as soon as its kernels are ready. A shape without ControlNet feeds the UNet's residual
    inputs from one zero buffer (read-only views: the compiled code never writes its inputs)."""

    def __init__(self, models: Any, builds: Any = None, notes: list[str] | None = None, root: Path | None = None,
                 variant: str = COMPILED):
        """`variant`: the best compiled row of engine/variants.py this run uses ("fp8" with --fp8: the UNet's artifacts
        are the FP8 ones); the compiled rows it falls back to are loaded where the cache has them, never built. Each
        row's `constants` are prepared here (FP8's input scales: calibrated once per model, then read from the cache),
        so the UNet must carry no LoRA now."""
        self.models, self.builds, self.root, self.variant = models, builds, root, variant
        self.chain = [v for v in chain(variant) if v.compiled]  # best first
        self.notes = notes if notes is not None else []
        self.residuals = Residuals.of(models.unet)
        # what the UNet's artifacts take from the conditioning kinds (an IP-Adapter's tokens: Target.refs)
        self.refs = sum(row.artifact_width(models) for row in KINDS.values())
        self.tags = tuple(tag for row in KINDS.values() if row.export and (tag := row.export.artifact(models)))
        self.calls: dict[Target, Callable] = {}
        self.built_s: dict[Target, float] = {}  # seconds a build of this run took, per target
        self.load_s: dict[Target, float] = {}  # seconds each load and constant binding took
        # the fallback rows' artifacts the cache has for sizes whose best ones it has too: loaded when a graph of that
        # row is first captured (`bind`: after its best one failed), not before every render
        self.spare: dict[Target, Path] = {}
        self.waiting: list[Target] = []  # missing, handed to the builds at `start`
        super().__init__(self._unet, self._controlnet, StepCalls.eager(models).others)
        self.zeros = torch.zeros(0, dtype=models.dtype, device=models.device)
        for module in MODULES:
            if module_of(models, module) is not None:
                fuse_projections(module_of(models, module))  # before any graph holds a pointer to to_q & co
        if builds is not None and any(v.constants is not None for v in self.chain):
            builds.on_event(stage(f"preparing the {variant} kernels' constants (scales calibrated once per model)"))
        t0 = time.perf_counter()
        self.constants = {v.name: v.constants(models, root or cache_root() / "compiled")
                          for v in self.chain if v.constants is not None}
        self.constants_s = time.perf_counter() - t0  # seconds the rows' constants took (FP8's scales, stored or not)
        self.notes.extend(c.note for c in self.constants.values())

    def targets(self, shapes: Iterable[Shape]) -> list[Target]:
        """What these shapes are built for: the UNet and the ControlNet in this run's precision."""
        return targets(shapes, bool(self.models.controlnets), self.variant, self.refs, self.tags)

    def unet_target(self, height: int, width: int, variant: str | None = None) -> Target:
        """The UNet artifact of a variant ("compiled": fp16, "fp8"; None: this run's best)."""
        return Target("unet", height, width, VARIANTS[variant or self.variant].precision, self.refs, self.tags)

    def controlnet_target(self, height: int, width: int, variant: str | None = None) -> Target:
        """The (first) ControlNet's artifact of a variant (None: this run's best)."""
        return Target("controlnet", height, width, VARIANTS[variant or self.variant].precision)

    def variants(self, batch: int, height: int, width: int, control: bool) -> list[str]:
        """The ShapeKey variants this shape can run on now, best first (the run's compiled rows whose kernels for its
        size, the UNet's and with a control image the ControlNet's, are loaded): with --fp8 its FP8 kernels, then the
        fp16 ones when the cache had them (while the FP8 ones build, or after they failed their check)."""
        if fits(batch, height, width) is not None:
            return []
        return self.loaded(height, width, bool(control & 1), spare=True)

    def loaded(self, height: int, width: int, control: bool = False, spare: bool = False) -> list[str]:
        """The variants whose UNet kernels (and with `control` the ControlNet's) for this size are loaded (`spare`: or
        in the cache, to be loaded at `bind`), best first."""
        def have(t: Target) -> bool:
            return t in self.calls or (spare and t in self.spare)
        return [v.name for v in self.chain if have(self.unet_target(height, width, v.name))
                and (not control or have(self.controlnet_target(height, width, v.name)))]

    def calls_for(self, variant: str) -> StepCalls:
        """The step's module calls on one variant's kernels (what a graph of that variant captures)."""
        return StepCalls(partial(self._unet, variant=variant), partial(self._controlnet, variant=variant), self.others)

    def _best(self, target: Target) -> bool:
        return target.precision == VARIANTS[self.variant].precision

    def path(self, target: Target) -> Path:
        return artifact_path(target, module_of(self.models, target.module), self.root)

    def add(self, target: Target, path: Path) -> bool:
        """Loads one artifact; False (and a note) if it cannot be used, and that size keeps its plain graph."""
        try:
            if not loads_here(path):
                raise RuntimeError("it does not load on this machine")
            t0 = time.perf_counter()
            self.calls[target] = load(target, self.models, path, self.constants.get(target.variant.name))
            self.load_s[target] = time.perf_counter() - t0
            return True
        except Exception as e:  # noqa: BLE001 - any broken artifact: plain graphs, and say why
            self.notes.append(f"compiled kernels for {target.label} not used: {path.name}: {one_line(e, 200)}")
            return False

    def want(self, targets: Iterable[Target], defer: bool = False) -> list[Target]:
        """Loads what the cache has for `targets`; returns the ones it lacks (also kept for `start`). The kernels of the
        rows this run falls back to (with --fp8: the fp16 ones) are never built; where the cache has them they are
        kept `spare`, loaded when a graph first runs on them (`bind`): a size whose best kernels are missing runs on
        them until those land, one whose best kernels fail their check falls back to them. `defer`: the best ones the
        cache has are kept spare too (the checks of copied ones run now, side by side; `add` reads their markers), each
        loaded before its graph's first capture: a render loads the first batch's before it, the others' between the
        replays of the batch before theirs (GraphRunner.ahead), where the GPU is busy; 0.39-0.43 s for the bench job's
        six in one process. One that does not load then is built again (`bind`)."""
        targets = list(targets)
        lower = [replace(t, precision=v.precision) for t in targets if self._best(t) for v in self.chain[1:]]
        self._check_loads([self.path(t) for t in lower + targets if t not in self.calls and t not in self.waiting])
        for fallback in lower:
            path = self.path(fallback)
            if fallback not in self.calls and path.is_file():
                self.spare[fallback] = path
        for t in targets:
            if t in self.calls or t in self.waiting:
                continue
            path = self.path(t)
            if path.is_file() and defer:
                self.spare[t] = path
                continue
            self.spare.pop(t, None)  # deferred by an earlier call: loaded now
            if not (path.is_file() and self.add(t, path)):
                self._rebuild(t)
        return list(self.waiting)

    def _rebuild(self, t: Target) -> None:
        """A best artifact missing or broken: built again (`start`), not tried again (a loaded copy stays mapped)."""
        path = self.path(t)
        for f in (path, path.with_suffix(".ok"), path.with_suffix(".bad")):
            f.unlink(missing_ok=True)
        if t not in self.waiting:
            self.waiting.append(t)

    def bind(self, variant: str, height: int, width: int, control: bool) -> bool:
        """Loads the kernels a graph of `variant` at this size needs (its UNet's, and with `control` its ControlNet's)
        where they are spare, before its capture; False when one does not load (a note says why; it is spare no
        more): the size falls back past `variant`, and a best artifact that did not load is built again in the
        background, as `want` would have."""
        need = [self.unet_target(height, width, variant)]
        need += [self.controlnet_target(height, width, variant)] if control else []
        for t in need:
            if t in self.spare and not self.add(t, self.spare.pop(t)):
                if self._best(t):
                    self._rebuild(t)
                    self.start()
                return False
        return True

    def deferred(self) -> list[Target]:
        """The best artifacts the cache has that are not loaded yet (`want`'s `defer`)."""
        return [t for t in self.spare if self._best(t)]

    def _check_loads(self, paths: list[Path]) -> None:
        """The load checks of the artifacts the cache has without a marker (copied in from elsewhere), side by side:
        each is a child process (artifacts.loads_here) that `add` would otherwise run one after another."""
        fresh = [p for p in paths if p.is_file() and not p.with_suffix(".ok").is_file()
                 and not p.with_suffix(".bad").is_file()]
        if not fresh:
            return
        if self.builds is not None:
            self.builds.on_event(stage(f"checking that {len(fresh)} compiled artifacts load here, side by side",
                                            LOAD_CHECK_S))
        with ThreadPoolExecutor(max_workers=len(fresh)) as pool:  # the checks are processes: threads only wait
            list(pool.map(loads_here, fresh))

    def start(self, background: bool = True) -> None:
        """Hands what is missing to the builds (never waits: `wait` does)."""
        todo = [t for t in self.waiting if self.builds is not None and t not in self.builds.builds]
        if todo:
            self.builds.want([(t, self.path(t), module_of(self.models, t.module)) for t in todo])
            if background:
                self.notes.append(f"compiling kernels for {', '.join(t.label for t in todo)} in the background; "
                                  f"their shapes switch to them as they finish (a build still running at the "
                                  f"end goes on, for the next render)")

    def poll(self) -> None:
        """Loads the artifacts the builds finished since the last call (a few ms when none did)."""
        if self.builds is not None:
            self._take(self.builds.poll())

    def wait(self) -> None:
        """Starts what is missing and loads it when built, side by side (`--compile on`, `capture --warm`)."""
        self.start(background=False)
        if self.builds is not None:
            self._take(self.builds.wait())

    def _take(self, ready: list[tuple[Target, Path, float]]) -> None:
        for t, path, seconds in ready:
            if t in self.waiting and self.add(t, path):
                self.waiting.remove(t)
                self.built_s[t] = seconds
                self.notes.append(f"compiled kernels for {t.label} ready after {seconds:.0f} s")

    def reserve(self, max_batch: int, max_pixels: int) -> None:
        """The zero residuals for the largest shape, allocated before any capture (graphs keep the pointer)."""
        rows, latent = 2 * max_batch, max_pixels // 64
        need = rows * max(c * latent // (d * d) for c, d in (*self.residuals.down, self.residuals.mid))
        if self.zeros.numel() < need:
            self.zeros = torch.zeros(need, dtype=self.models.dtype, device=self.models.device)

    def ready(self, batch: int, height: int, width: int, control: bool) -> str | None:
        """None if this shape can run on this run's best kernels now (FP8 with --fp8), else why not."""
        why = fits(batch, height, width)
        if why:
            return why
        need = [self.unet_target(height, width)] + ([self.controlnet_target(height, width)] if control & 1 else [])
        lacking = [t.label for t in need if t not in self.calls]
        return f"no compiled kernels for {', '.join(lacking)} yet" if lacking else None

    def load_note(self) -> str:
        """A line for the render's notes: the artifacts loaded so far and the seconds they (and the rows' constants)
        took, a part of the capture stage before any graph is captured; the ones deferred to their graphs' captures
        (`want`'s `defer`: each graph's `load_s` in the report says what its load took)."""
        deferred = len(self.deferred())
        parts = [f"{len(self.load_s)} artifacts loaded in {sum(self.load_s.values()):.2f} s"] if self.load_s else []
        if deferred:
            parts.append(f"{deferred} {'more ' * bool(self.load_s)}in the cache, each loaded before its graph's first "
                         f"capture")
        if self.constants:
            parts.append(f"the {self.variant} constants prepared in {self.constants_s:.2f} s")
        spare = len(self.spare) - deferred
        spare = f"; {spare} to fall back on, loaded if a size needs them" if spare else ""
        return f"compiled kernels: {', '.join(parts)}{spare}"

    def compile_s(self, height: int, width: int) -> float:
        return self.built_s.get(self.unet_target(height, width), 0.0)

    def _zero_residuals(self, rows: int, h: int, w: int):
        def view(c: int, d: int) -> torch.Tensor:  # channels_last views, as the artifact reads them
            return self.zeros[: rows * c * (h // d) * (w // d)].view(rows, h // d, w // d, c).permute(0, 3, 1, 2)
        return view(*self.residuals.mid), tuple(view(c, d) for c, d in self.residuals.down)

    def _unet(self, latents, t, embeds, pooled, time_ids, mid, down, attention=None, variant: str | None = None):
        """`variant`: which UNet kernels ("compiled", "fp8"); None: the best loaded for the size. `attention`: the
        attention processors' inputs (Conditions.attention: an IP-Adapter's tokens), which an adapter's artifacts take
        after the residuals, in that order."""
        rows, _, h, w = latents.shape
        if mid is None:
            mid, down = self._zero_residuals(rows, h, w)
        # the artifact reads its inputs with the strides it was compiled for: the compiled ControlNet's
        # residuals are channels_last already (no copy); any other layout is made so
        mid, down = nhwc(mid), tuple(nhwc(d) for d in down)
        call = self.calls[self.unet_target(8 * h, 8 * w, variant or self.loaded(8 * h, 8 * w)[0])]
        return call(latents, _scalar(t), embeds, pooled, time_ids, mid, down, *(attention or {}).values())

    def _controlnet(self, latents, t, embeds, pooled, time_ids, guide, scale, variant: str | None = None):
        """`variant`: which ControlNet kernels ("compiled", "fp8"); None: the best loaded for the size (as `_unet`).
        `guide`: embedded (engine/conditions/control.py `embed_guide`), made channels_last where it is not (a graph's
        buffer is: no copy)."""
        h, w = 8 * latents.shape[2], 8 * latents.shape[3]
        call = self.calls[self.controlnet_target(h, w, variant or self.loaded(h, w, True)[0])]
        return call(latents, _scalar(t), embeds, pooled, time_ids, nhwc(guide), scale)
