"""BatchRunner: one batch of work items -> latents -> pixels. Compute only: no files, no policy.

Owns what the batches of one job share: sigma schedules, the prompt cache (bounded), each conditioning kind's reader
(engine/conditions/: its files decoded once, its batch tensors), the LoRA weights (swapped in place before a batch
that needs another set), the engine it denoises with and the eager engine it falls back to when told. It names no
conditioning kind: it reads the table's rows.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from storyboard_cli.engine.base import Engine, Shape, Spare
from storyboard_cli.engine.conditioning import Cond, PromptCache, conditioning, guided_rows
from storyboard_cli.engine.conditions import KINDS
from storyboard_cli.engine.conditions.kind import Conditions, Unreadable
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.sampling import Schedule, draw_image_noise, noise_key, schedule, stack_noise
from storyboard_cli.engine.streams import Lanes, Timer, hand_over
from storyboard_cli.errors import ModelError, StoryboardError
from storyboard_cli.folder.report import Timings
from storyboard_cli.job.conditions import KINDS as JOB_KINDS
from storyboard_cli.job.file import LoraFile
from storyboard_cli.job.lora_files import LoraFileError
from storyboard_cli.job.plan import Batch, BucketKey, WorkItem
from storyboard_cli.models.groupnorm import channels_last
from storyboard_cli.models.loader import SdxlModels, host_decoder
from storyboard_cli.models.lora import LoraApplier, LoraWeights, Swap, read_lora, set_key
from storyboard_cli.steps import StepKind


# how many batches after the next one a loop captures graphs for (`BatchRunner.spare_captures`): the plan puts the
# batches of one bucket key one after another, so a job's new shapes come within a few batches of each other, and a
# loop's end scans up to these for its first spare piece
SPARE_BATCHES = 16


def batch_shapes(batches: list[Batch]) -> list[Shape]:
    """The shape of each batch's denoising loop: what an engine prepares (a graph is captured) for."""
    return [Shape(b.size, b.key.height, b.key.width, b.key.control_mask) for b in batches]


def batch_kinds(batches: list[Batch]) -> dict[Shape, set[StepKind]]:
    """The step kinds each shape's batches run: the graphs an engine captures ahead for draft renders."""
    kinds: dict[Shape, set[StepKind]] = {}
    for shape, batch in zip(batch_shapes(batches), batches):
        kinds.setdefault(shape, set()).update(batch.key.plan)
    return kinds


def chain_pieces(*parts: Iterator[Callable[[], object]] | None) -> Iterator[Callable[[], object]] | None:
    """Engine.sample's `between` pieces of several sources, one after the other; None when there are none."""
    parts = tuple(p for p in parts if p is not None)
    return itertools.chain(*parts) if parts else None


def finished(item: WorkItem, pixels: torch.Tensor) -> torch.Tensor:
    """An image's decoded pixels as they are written: each kind's `finish` (a cropped inpainting pasted back over its
    source, at the source's size)."""
    array = out = pixels.numpy()
    for kind in JOB_KINDS:
        out = kind.finish(item, out)
    return pixels if out is array else torch.from_numpy(out.copy())


def bucket_label(batch: Batch) -> str:
    return f"{batch.size} x {batch.key.label}"


def _vae_input(models: SdxlModels, latents: torch.Tensor) -> torch.Tensor:
    z = (latents / models.vae.config.scaling_factor).to(models.vae_dtype)
    if channels_last(models.vae.decoder):  # a GPU's decoder (models/groupnorm.py fuse): its input in its layout
        z = z.contiguous(memory_format=torch.channels_last)
    return z


def _decoded(models: SdxlModels, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """Each image's float pixels [1, 3, H, W] in [0, 1], one image at a time: batched, the VAE's kernels (and their
    rounding: 1 level in 255 on a CPU) depend on the batch's size and its other images, and an image's pixels must not
    (a served batch mixes jobs)."""
    for one in z.split(1):
        yield (models.vae.decode(one, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)


def _uint8(image: torch.Tensor) -> torch.Tensor:
    return (image * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


@torch.no_grad()
def decode_on_device(models: SdxlModels, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 4, h, w] latents -> (float pixels [B, 3, H, W] in [0, 1], uint8 [B, H, W, 3]), both on the device, as
    diffusers' VAE decode + postprocess: the float pixels too, for comparing decoders by them (a render runs
    `decode_pixels`)."""
    image = torch.cat(list(_decoded(models, _vae_input(models, latents)))).contiguous()
    return image, _uint8(image)


@torch.no_grad()
def decode_pixels(models: SdxlModels, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 4, h, w] latents -> (bool [B]: each image's float pixels free of NaN, uint8 [B, H, W, 3]), on the device:
    `decode_on_device`'s pixels, each image's made uint8 before the next is decoded. A render's decode runs beside the
    next batch's loop, and so holds one image's float pixels, not the batch's several copies of them (8 x 1024²:
    100 MB a copy)."""
    finite, pixels = [], []
    for image in _decoded(models, _vae_input(models, latents)):
        finite.append(torch.isfinite(image).flatten(1).all(1))
        pixels.append(_uint8(image))
    return torch.cat(finite), torch.cat(pixels)


def _checked_decode(models: SdxlModels, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A render's decode of a batch's latents: (bool [2, B]: each image's latents, then its pixels, free of NaN/inf;
    uint8 pixels [B, H, W, 3]), where `models` are (the GPU's, or `BatchRunner.decode_on_host`'s host copy)."""
    finite_pixels, pixels = decode_pixels(models, latents)
    return torch.stack([torch.isfinite(latents).flatten(1).all(1), finite_pixels]), pixels


def decode(models: SdxlModels, latents: torch.Tensor) -> torch.Tensor:
    """A render's decode (`decode_pixels`): the uint8 pixels [B, H, W, 3] on the CPU."""
    return decode_pixels(models, latents)[1].cpu()


@dataclass
class Decoded:
    item: WorkItem
    pixels: torch.Tensor | None  # uint8 [H, W, 3] on the CPU; None when the image failed
    failure: str = ""


class Denoised(list):
    """run_batch's result: (item, latents [4, h, w]) for each row that was denoised, and in `failed` the
    images that could not be (a file of theirs broke since `plan`), each with its reason. On a GPU the latents
    may still be being computed: `BatchRunner.start_decode` queues the decode after them."""

    def __init__(self, done: Iterable[tuple[WorkItem, torch.Tensor]] = (), failed: Iterable[Decoded] = (),
                 timing: BatchTiming | None = None):
        super().__init__(done)
        self.failed = list(failed)
        self.timing = timing


@dataclass
class BatchTiming:
    """Where a batch's inputs and loop began and ended, read once they are reached (`BatchRunner.finish`)."""

    bucket: str
    inputs_s: float  # host seconds spent making the inputs
    ready: Timer  # the inputs made (on their stream)
    start: Timer  # the loop's first step queued (on the UNet's stream), and its end
    end: Timer
    before: Timer | None  # the end of the batch before's loop, when this batch's inputs were made beside it
    counted: bool = False


@dataclass
class Inputs:
    """What a batch's loop reads, made on the inputs' stream (`BatchRunner.make_inputs`): the readable items (the
    others in `failed`), and for those the schedule, text conditioning, kinds' values, first latents, noise and
    guidance; `ready` once they are made there, `seconds` of the host's time."""

    items: list[WorkItem]
    failed: list[Decoded]
    sched: Schedule | None = None
    cond: Cond | None = None
    conds: Conditions | None = None
    x: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    guidance: torch.Tensor | None = None
    ready: Timer | None = None
    seconds: float = 0.0


@dataclass
class Decoding:
    """A batch's decode in flight on the decode stream (`BatchRunner.start_decode`); `finish` waits for it."""

    done: Denoised
    pixels: torch.Tensor | None = None  # uint8 [B, H, W, 3] in host memory, once `end` is reached
    finite: torch.Tensor | None = None  # bool [2, B] in host memory: latents, pixels
    start: Timer | None = None
    end: Timer | None = None
    queued: Future | None = None  # done once the decode thread has queued it (engine/streams.py `Lanes.on_decode`)
    host: bool = False  # decoded on the CPU (`BatchRunner.decode_on_host`): its timers are the host's

    @property
    def items(self) -> list[WorkItem]:
        return [item for item, _ in self.done] + [d.item for d in self.done.failed]


class BatchRunner:
    """`loras`: every LoRA file the job uses, read and registered now (before the engine captures or
    compiles anything, where the caller creates the runner first), and the pristine weights are copied
    before any write. A file the models reject is set aside in `unusable`: the batches that use it fail,
    the others render. A file not given here is read when first needed."""

    def __init__(self, models: SdxlModels, engine: Engine, timings: Timings | None = None,
                 loras: Iterable[LoraFile] = (), overlap: bool = True, ahead: bool = True):
        self.models, self.engine = models, engine
        # `overlap`: a batch's decode is waited for once the next batch denoises (the caller's `finish`), not at once
        self.overlap = overlap
        self.lanes = Lanes(models.device)
        # `ahead`: the next batch's prompts are encoded between this batch's first steps (`encode_ahead`)
        self.ahead = ahead
        self._last: Denoised | None = None  # the latest batch denoised: where the next batch's inputs are measured from
        self.fallback: Engine = EagerEngine(models)  # for the out-of-memory policy's last retry
        self._host: SdxlModels | None = None  # a host copy of the VAE, for `decode_on_host`
        self.prompts = PromptCache(models)
        self.schedules: dict[tuple[str, int, int], Schedule] = {}
        # the next batch's images' noise, drawn beside the loop before it (`noise_ahead`): noise_key -> its parts
        self.drawn: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.made: tuple[Batch, Inputs] | None = None  # the next batch's inputs, made beside the loop before it
        # each kind's reader, where the models run the kind (its caches: decoded images, encoded references)
        self.readers = [r for row in KINDS.values() if (r := row.reader(models)) is not None]
        self.lora = LoraApplier(models)
        self._lora_weights: dict[tuple[Path, str], LoraWeights] = {}
        self.unusable: dict[str, str] = {}  # LoRA name -> why these models reject it
        self.adopt(timings or Timings(), loras)

    def adopt(self, timings: Timings, loras: Iterable[LoraFile]) -> None:
        """The runner kept for another render on the same models (a render service's worker: its prompt, schedule,
        conditioning kinds' and LoRA caches and the LoRA set applied stay): that render's timings, its LoRA files."""
        self.timings, self.unusable = timings, {}
        self.drawn, self.made = {}, None  # what an earlier render drew or made ahead for a batch it did not run
        for f in loras:
            try:
                self.lora_weights(f)
            except StoryboardError as e:
                self.unusable[f.name] = str(e)

    def lora_problem(self, batch: Batch) -> str | None:
        """Why the batch's LoRA set cannot be applied (a file these models reject), or None."""
        return next((self.unusable[f.name] for f, _ in batch.items[0].loras if f.name in self.unusable), None)

    def lora_weights(self, f: LoraFile) -> LoraWeights:
        """The LoRA's layers, read through diffusers' converters once and registered with the applier."""
        key = (f.path, f.sha256)
        if key not in self._lora_weights:
            try:
                weights = read_lora(f.name, f.path, self.models.unet.config)
                if weights.hash != f.sha256:  # the outputs would record the other file's hash
                    raise ModelError(f"LoRA '{f.name}' ({f.path.name}) changed since the job was read; run again")
                self.lora.register(weights)
            except (ModelError, LoraFileError) as e:  # named as the job names it (a served job's file is a blob)
                raise type(e)(str(e).replace(f.path.name, f.file or f.path.name)) from e
            self._lora_weights[key] = weights
        return self._lora_weights[key]

    def apply_loras(self, item: WorkItem) -> tuple:
        """Puts the item's LoRA set into the weights (in place; nothing when it is already there). Returns
        the prompt cache's part of the set: the LoRAs that change the text encoders."""
        active = {f.name: (self.lora_weights(f), scale) for f, scale in item.loras}
        if set_key(active) != self.lora.active_key:
            with self.timings.stage("lora"):
                self.lora.apply(active)
        return set_key(active, text_only=True)

    def lora_swaps(self) -> list[Swap]:
        """Every change of LoRA set so far (the first one from the model's own weights included)."""
        return list(self.lora.swaps)

    def close(self) -> None:
        """The models' own weights back (bit for bit), so whoever holds the models next sees them unchanged."""
        self.lora.restore()

    def schedule(self, sampler: str, steps: int, start: int = 0) -> Schedule:
        """The `steps`-step schedule's tail from `start` (the whole of it from 0)."""
        key = (sampler, steps, start)
        if key not in self.schedules:
            self.schedules[key] = schedule(sampler, steps, self.models.scheduler_config, start)
        return self.schedules[key]

    def readable(self, items: Iterable[WorkItem]) -> tuple[list[WorkItem], list[Decoded]]:
        """The items whose files (every kind's: control images, references) decode, and a failure naming the file for
        each other one: a file that broke after `plan` fails only the images that use it."""
        ok, failed = [], []
        for it in items:
            try:
                for reader in self.readers:
                    reader.check(it, self.timings)
                ok.append(it)
            except Unreadable as e:
                failed.append(Decoded(it, None, str(e)))
        return ok, failed

    def conditions(self, rows: list[WorkItem], key: BucketKey) -> Conditions:
        """The batch's values of every kind it uses, in the table's order."""
        return Conditions.of(*(reader.batch(rows, key) for reader in self.readers))

    def run_batch(self, batch: Batch, fallback: bool = False, upcoming: Sequence[Batch] = ()) -> Denoised:
        """Denoises one batch (on the fallback engine if told); returns (item, latents [4, h, w]) for its
        real rows, and the rows it could not run in `.failed`. On a GPU nothing here waits for the GPU: the inputs
        are made on their own stream while the batch before still denoises (`inputs_ahead`, or here), and the loop is
        queued behind it. `upcoming`: the batches that run after it, in order, where the caller knows them: the next
        one's graphs are captured, its prompts encoded, its noise drawn and its inputs made between this batch's steps
        (`capture_ahead`, `encode_ahead`, `noise_ahead`, `inputs_ahead`); after those, while the loop has room, the
        graphs of the batches after it (`spare_captures`)."""
        key = batch.key
        made, self.made = self.made, None
        if made is not None and made[0] is batch:  # made beside the loop before, under the text encoders' LoRAs now
            inputs = made[1]
            with self.lanes.inputs():  # the UNet's stream waits for them, before a LoRA swap writes the weights
                pass
            text_loras = self.apply_loras(inputs.items[0]) if inputs.items else ()
        else:
            inputs, text_loras = self.make_inputs(batch)
        if not inputs.items:
            return Denoised((), inputs.failed)
        engine = self.fallback if fallback else self.engine
        bt = self.timings.bucket(bucket_label(batch))
        bt.batches += 1
        bt.rows += (2 if key.guided else 1) * batch.size
        bt.steps += key.runs
        last = self._last.timing if self._last is not None else None
        before = last.end if last is not None and not last.counted else None  # that loop still ran, or was not read
        start = self.lanes.timer()
        between = None
        if upcoming and self.ahead:
            after = upcoming[0]
            between = chain_pieces(None if fallback else self.capture_ahead(after),
                                   self.encode_ahead(after, text_loras), self.noise_ahead(after),
                                   self.inputs_ahead(after, text_loras),
                                   None if fallback else self.spare_captures(upcoming[1:]))
        latents = engine.sample(inputs.x, inputs.sched, inputs.noise, inputs.cond, inputs.conds, inputs.guidance,
                                key.plan, between)
        timing = BatchTiming(bucket_label(batch), inputs.seconds, inputs.ready, start, self.lanes.timer(), before)
        self._last = Denoised(zip(inputs.items, latents[: len(inputs.items)]), inputs.failed, timing)
        return self._last

    def make_inputs(self, batch: Batch, text_loras: tuple | None = None) -> tuple[Inputs, tuple]:
        """`batch`'s inputs, made on the inputs' stream, and the text encoders' LoRA set they were made under. With
        `text_loras` None, its LoRA set is applied first (its run_batch: the inputs' stream waits for a swap's
        writes); else made under the set applied now, which is `text_loras` (`inputs_ahead`: nothing waits for them
        here, the batch's run_batch makes the UNet's stream wait)."""
        m, key = self.models, batch.key
        ahead = text_loras is not None
        t0 = time.perf_counter()
        with self.lanes.aside() if ahead else self.lanes.inputs():  # every kind's files read: decoded once each
            items, failed = self.readable(batch.items)
        readable_s = time.perf_counter() - t0
        if not items:
            self.timings.add("encode", readable_s)
            return Inputs(items, failed, seconds=readable_s), ()
        rows = items + [items[-1]] * (batch.size - len(items))  # a padded row copies a real row
        sched = self.schedule(key.sampler, key.steps, key.first)  # its tail, where the kinds skip steps
        swaps = len(self.lora.swaps)
        if not ahead:
            text_loras = self.apply_loras(items[0])  # one set per batch: it is in the bucket key (on the UNet's stream)
        t1 = time.perf_counter()
        with self.lanes.aside() if ahead else self.lanes.inputs(after_unet=len(self.lora.swaps) != swaps):
            prompts = [r.prompt for r in rows]
            negatives, guidance = guided_rows(prompts, [r.negative for r in rows], [r.guidance for r in rows])
            cond = conditioning(self.prompts, prompts, negatives, key.width, key.height, text_loras)
            conds = self.conditions(rows, key)
            x, noise = self.noise([r.seed for r in rows], sched, (4, key.height // 8, key.width // 8))
            x = conds.begin(x.to(m.device))  # a source's rows start from it, noised
            noise = None if noise is None else noise.to(m.device)
            guidance = torch.tensor(guidance, device=m.device, dtype=torch.float32)
            ready = self.lanes.timer()
        hand_over((cond, conds, x, noise, guidance))  # read on the UNet's stream from here on
        seconds = readable_s + time.perf_counter() - t1
        self.timings.add("encode", seconds)
        return Inputs(items, failed, sched, cond, conds, x, noise, guidance, ready, seconds), text_loras

    def inputs_ahead(self, batch: Batch, text_loras: tuple) -> Iterator[Callable[[], None]] | None:
        """A piece of work that makes `batch`'s inputs (`make_inputs`: its files read, its text conditioning put
        together from the prompt cache, its kinds' tensors, its noise and guidance on the device) into `made`, run by
        the engine between the steps of the loop before `batch`'s, after the pieces that encode its prompts and draw
        its noise; `batch`'s run_batch takes them. The host's work between two loops is then the loop's own: a loop
        whose queueing returns with about one replay left on the GPU (engine/streams.py) no longer waits for the next
        batch's inputs to be made. Only under the text encoders' LoRA set applied now (`encode_ahead`'s rule)."""
        if self.lora_problem(batch) or not self._same_text_loras(batch, text_loras):
            return None

        def make() -> None:
            self.made = (batch, self.make_inputs(batch, text_loras)[0])

        return iter([make])

    def _same_text_loras(self, batch: Batch, text_loras: tuple) -> bool:
        """Whether `batch`'s text-encoder LoRA set is `text_loras` (the set applied now)."""
        try:
            active = {f.name: (self.lora_weights(f), scale) for f, scale in batch.items[0].loras}
        except StoryboardError:  # its own run_batch says why
            return False
        return set_key(active, text_only=True) == text_loras

    def capture_ahead(self, batch: Batch, spare: bool = False) -> Iterator[Callable[[], None]] | None:
        """The engine's pieces of work that capture `batch`'s graphs beside the loop before it (Engine.ahead), each
        one's host seconds counted as capture, hidden (the captures before the first batch: exposed). `spare`: for a
        loop further before it (Engine.ahead's `spare`)."""
        pieces = self.engine.ahead(batch_shapes([batch])[0], set(batch.key.plan), spare)
        if pieces is None:
            return None

        def timed(piece: Callable[[], object]) -> None:
            if "capture" not in self.timings.exposed:  # the captures so far ran before a batch, the GPU idle
                self.timings.expose("capture", self.timings.stages.get("capture", 0.0))
            t0 = time.perf_counter()
            piece()
            self.timings.add("capture", time.perf_counter() - t0)

        return (partial(timed, piece) for piece in pieces)

    def spare_captures(self, later: Sequence[Batch]) -> Iterator[Callable[[], None]] | None:
        """`Spare` pieces (engine/base.py) that capture the graphs of the batches after the next one beside this
        loop, each shape once, in their order, asked of the engine only as the loop reaches them: the setup of a new
        size (its kernels' load, its warm-up, its capture: 0.1-1.0 s of host time each) runs beside a long loop of
        heavy steps, not only beside the one loop before its batch, which may be a one-image loop of 30 ms steps whose
        queue holds less than such a piece. The loop drops what it has no room for; the next loop offers it again.
        The next SPARE_BATCHES batches: a loop's end looks for its first spare piece, past the shapes captured."""
        if not later:
            return None

        def pieces() -> Iterator[Callable[[], None]]:
            seen = set()
            for batch in later[:SPARE_BATCHES]:
                shape, kinds = batch_shapes([batch])[0], frozenset(batch.key.plan)
                if (shape, kinds) in seen:
                    continue
                seen.add((shape, kinds))
                for piece in self.capture_ahead(batch, spare=True) or ():
                    yield Spare(piece)

        return pieces()

    def encode_ahead(self, batch: Batch, text_loras: tuple) -> Iterator[Callable[[], None]] | None:
        """The pieces of work that encode `batch`'s prompts and negative prompts into the prompt cache, one prompt
        each, on the inputs' stream (engine/streams.py `aside`): the engine runs them between the steps of the loop
        before `batch`'s (Engine.sample `between`), and `batch`'s own `run_batch` finds them there. Only where `batch`
        uses the text-encoder LoRAs applied now (`text_loras`): another set is written into the encoders at its own
        `run_batch`, which encodes its prompts after that. Its regions' prompts are encoded in their own cache at its
        `run_batch` (engine/conditions/region.py). The host's seconds count as encoding."""
        if self.lora_problem(batch) or not self._same_text_loras(batch, text_loras):
            return None
        prompts = [it.prompt for it in batch.items]
        negatives, _ = guided_rows(prompts, [it.negative for it in batch.items], [it.guidance for it in batch.items])

        def encode(prompt: str) -> None:
            t0 = time.perf_counter()
            with self.lanes.aside():
                self.prompts.fill([prompt], text_loras)
            self.timings.add("encode", time.perf_counter() - t0)

        missing = self.prompts.missing([*negatives, *prompts], text_loras)
        return iter([partial(encode, p) for p in missing]) if missing else None

    def noise(self, seeds: list[int], sched: Schedule, shape: tuple[int, int, int]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's `draw_noise`: each image's parts as `noise_ahead` drew them, the others drawn now. What was
        drawn ahead for another batch (a batch that failed before its loop) is dropped."""
        drawn, self.drawn = self.drawn, {}
        parts = []
        for seed in seeds:
            k = noise_key(seed, sched.steps, shape, sched)
            parts.append(drawn[k] if k in drawn else drawn.setdefault(k, draw_image_noise(seed, sched.steps, shape,
                                                                                          sched)))
        return stack_noise(parts)

    def noise_ahead(self, batch: Batch) -> Iterator[Callable[[], None]] | None:
        """The pieces of work that draw `batch`'s images' noise, one image each, into `drawn`: the engine runs them
        between the steps of the loop before `batch`'s (Engine.sample `between`), where the GPU runs the replays queued
        so far; `batch`'s own `run_batch` takes them from there. An ancestral sampler's noise for 8 images at 1024x1024
        and 30 steps is about 0.2 s of the host's time, more than the last replay the host is ahead by when a loop's
        queueing returns (engine/streams.py). The host's seconds count as encoding."""
        key = batch.key
        sched = self.schedule(key.sampler, key.steps, key.first)
        shape = (4, key.height // 8, key.width // 8)

        def draw(seed: int, k: tuple) -> None:
            t0 = time.perf_counter()
            self.drawn[k] = draw_image_noise(seed, sched.steps, shape, sched)
            self.timings.add("encode", time.perf_counter() - t0)

        keys = {noise_key(it.seed, sched.steps, shape, sched): it.seed for it in batch.items}
        return iter([partial(draw, seed, k) for k, seed in keys.items()]) if keys else None

    def start_decode(self, done: Denoised) -> Decoding:
        """Queues the decode of `done`'s latents after their denoising, on the decode stream from the decode thread (so
        it runs beside the next batch's inputs, check and loop), and their copy to host memory; `finish` waits for it.
        On the CPU it is done here."""
        out = Decoding(done)
        if done:
            out.queued = self.lanes.on_decode(lambda: self._decode(out))
        return out

    @torch.no_grad()
    def _decode(self, out: Decoding) -> None:
        """`out`'s decode on the current (decode) stream: its pixels and what is finite, copied to host memory."""
        out.start = self.lanes.timer()
        hand_over([lat for _, lat in out.done])
        finite, pixels = _checked_decode(self.models, torch.stack([lat for _, lat in out.done]))
        out.pixels, out.finite = self.lanes.to_host(pixels), self.lanes.to_host(finite)
        out.end = self.lanes.timer()

    @torch.no_grad()
    def decode_on_host(self, d: Decoding) -> None:
        """`d` decoded again, on the CPU, by a float32 copy of the VAE in host memory (models/loader.py
        `host_decoder`, made at the first such decode): the last resort of a decode still out of GPU memory after the
        engine freed its graphs (run/oom.py), so that images already denoised are not lost. The same decode, one image
        at a time, in float32 (seconds an image at 1024², with the host waiting for it); `finish` then delivers it."""
        if self._host is None:
            self._host = host_decoder(self.models)
        d.queued, d.host, d.start = Future(), True, Timer(False)
        d.finite, d.pixels = _checked_decode(self._host, torch.stack([lat.cpu() for _, lat in d.done]))
        d.end = Timer(False)
        d.queued.set_result(None)

    def decoded(self, d: Decoding) -> bool:
        """Whether `finish` returns `d`'s images without waiting for the GPU: its decode queued and ended (or it
        failed, or it had nothing to decode)."""
        if d.queued is None:
            return True
        if not d.queued.done():
            return False
        return d.queued.exception() is not None or d.end is None or d.end.reached()

    def finish(self, d: Decoding) -> list[Decoded]:
        """Waits for a decode `start_decode` queued: PNG-ready pixels; an image with NaN/inf in its latents or pixels
        is a failure, and so is every image run_batch could not run (`Denoised.failed`). Adds the batch's denoising
        and decode seconds to the timings, and what of its inputs and decode the denoising did not hide."""
        done = d.done
        failure = d.queued.exception() if d.queued is not None else None  # waits for the decode to be queued
        if isinstance(failure, torch.cuda.OutOfMemoryError):  # the batch after took its memory: once more, alone
            failure.with_traceback(None)  # its frames hold the failed decode's tensors (the future keeps it)
            torch.cuda.empty_cache()
            failure = self.lanes.on_decode(lambda: self._decode(d), here=True).exception()
            if isinstance(failure, torch.cuda.OutOfMemoryError):
                failure.with_traceback(None)
        if failure is not None:
            raise failure
        t = done.timing
        if t is not None and not t.counted:
            t.end.wait()
            seconds = t.start.seconds_to(t.end)
            self.timings.add("denoise", seconds)
            self.timings.bucket(t.bucket).denoise_s += seconds
            # the UNet's stream waited for the inputs from the end of the batch before's loop (all of the inputs'
            # time for the first batch, or one made after the batch before was read: nothing ran beside them)
            waited = t.inputs_s if t.before is None else max(0.0, t.before.seconds_to(t.ready))
            self.timings.expose("encode", waited)
            self.timings.bucket(t.bucket).waited_s += waited
            t.counted = True
        if d.end is None:
            return list(done.failed)
        d.end.wait()
        self.timings.add("decode", d.start.seconds_to(d.end))
        # the decode ran beside the next batch's loop where that was queued: exposed for as long as it ran on after
        # that loop's end (none while that loop still runs); else for as long as it ran after its own batch's loop
        later = self._last.timing if self._last is not None and self._last is not done else None
        if d.host:  # the host waited for all of it
            self.timings.expose("decode", d.start.seconds_to(d.end))
        elif later is None:
            self.timings.expose("decode", max(0.0, t.end.seconds_to(d.end)))
        elif later.end.reached():
            self.timings.expose("decode", max(0.0, later.end.seconds_to(d.end)))
        out = []
        for i, (item, _) in enumerate(done):
            if not d.finite[0, i]:
                out.append(Decoded(item, None, "NaN/inf in the denoised latents"))
            elif not d.finite[1, i]:
                out.append(Decoded(item, None, "NaN/inf in the decoded pixels"))
            else:
                out.append(Decoded(item, finished(item, d.pixels[i])))
        return out + done.failed

    def decode(self, done: Denoised) -> list[Decoded]:
        """`start_decode` and `finish` at once."""
        return self.finish(self.start_decode(done))

    def release(self) -> None:
        """After an out-of-memory: the engine gives back what it holds for speed."""
        self.engine.release()
