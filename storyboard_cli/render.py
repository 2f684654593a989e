"""plan -> engine -> outputs. The only orchestrator. Reports progress through events; never prints."""

from __future__ import annotations

import json
import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.conditioning import PromptCache, conditioning, load_control_image
from storyboard_cli.engine.eager import Control, EagerEngine
from storyboard_cli.errors import BadInput, Interrupted, RenderFailure
from storyboard_cli.job import Job
from storyboard_cli.models.loader import SdxlModels, load_sdxl
from storyboard_cli.outputs import (Manifest, OutputLock, atomic_write, check_output_dir, png_bytes, read_fingerprint,
                                    remove_stale_temps)
from storyboard_cli.plan import Batch, WorkItem, make_batches, work_items
from storyboard_cli.report import Timings, build_report, write_report
from storyboard_cli.sampling import Schedule, draw_noise, schedule

log = logging.getLogger(__name__)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ENGINES = ("auto", "graph", "eager")


@dataclass(frozen=True)
class RenderOptions:
    out_dir: Path | None = None
    force: bool = False
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: fp16 on cuda, fp32 on cpu
    engine: str = "auto"
    retry_failed: bool = False


@dataclass
class Event:
    kind: str  # "start" | "batch" | "image" | "failed" | "note"
    done: int = 0
    total: int = 0
    shot: str = ""
    message: str = ""


@dataclass
class RenderResult:
    status: str  # "done" | "failed" (some images) | "interrupted"
    out_dir: Path
    rendered: int
    skipped: int
    failed: list[dict]
    wall_s: float
    device: str
    engine: str
    report: dict
    report_paths: tuple[Path, Path] | None
    notes: list[str] = field(default_factory=list)


def resolve_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInput(f"--device: unknown device {device!r} (use cpu or cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available here (use --device cpu)")
    if dtype is None:
        dtype = "fp32" if device == "cpu" else "fp16"
    if dtype not in DTYPES:
        raise BadInput(f"--dtype: unknown dtype {dtype!r} (use fp16, bf16 or fp32)")
    if device == "cpu" and dtype == "fp16":
        raise BadInput("--dtype fp16 is not supported on the CPU (use fp32 or bf16)")
    return torch.device(device), DTYPES[dtype]


def make_engine(models: SdxlModels, kind: str, batches: list[Batch], notes: list[str]):
    """The engine for `kind`; a GraphRunner gets its static buffers sized for `batches` and captures
    their shapes up front, largest first (one shared pool)."""
    if kind not in ENGINES:
        raise BadInput(f"--engine: unknown engine {kind!r} (use auto, graph or eager)")
    if models.device.type != "cuda":
        if kind == "graph":
            raise BadInput("--engine graph needs a CUDA device (use --engine eager or auto)")
        if kind == "auto":
            notes.append("engine auto: CPU device, so the eager engine (CUDA graphs need a GPU)")
        return EagerEngine(models)
    if kind == "eager":
        return EagerEngine(models)
    runner, keys = graph_runner(models, batch_shapes(batches))
    runner.prepare(keys)
    return runner


def batch_shapes(batches: list[Batch]) -> list[tuple[int, int, int, bool]]:
    """(bucket size, height, width, control) of each batch: what a graph is captured for."""
    return [(b.size, b.key.height, b.key.width, b.key.control) for b in batches]


def graph_runner(models: SdxlModels, shapes: list[tuple[int, int, int, bool]]):
    """A GraphRunner whose static buffers fit every shape, and the shapes' graph keys."""
    from storyboard_cli.engine.graphs import GraphRunner

    runner = GraphRunner(models, max_batch=max(s[0] for s in shapes),
                         max_hw=(max(s[1] for s in shapes), max(s[2] for s in shapes)))
    return runner, [runner.shape_key(*s) for s in shapes]


@torch.no_grad()
def decode(models: SdxlModels, latents: torch.Tensor) -> torch.Tensor:
    """[B, 4, h, w] latents -> uint8 [B, H, W, 3] on the CPU, as diffusers' VAE decode + postprocess."""
    z = (latents / models.vae.config.scaling_factor).to(models.vae_dtype)
    images = []
    for chunk in z.split(4):  # bounds the VAE's activation memory at large sizes
        images.append(models.vae.decode(chunk, return_dict=False)[0].float())
    image = (torch.cat(images) / 2 + 0.5).clamp(0, 1)
    return image, (image * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


class _StopFlag:
    """First Ctrl-C: finish the image being written, then stop. Second: stop at once."""

    def __init__(self):
        self.requested = False

    def handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


@contextmanager
def _interruptible():
    flag = _StopFlag()
    try:
        old = signal.signal(signal.SIGINT, flag.handler)
    except ValueError:  # not the main thread: no signal handling
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)


class Renderer:
    """Holds the loaded models, prompt cache and engine for one job."""

    def __init__(self, job: Job, models: SdxlModels, engine, out_dir: Path, timings: Timings,
                 on_event: Callable[[Event], None], manifest: Manifest):
        self.job, self.models, self.engine, self.out_dir = job, models, engine, out_dir
        self.timings, self.on_event, self.manifest = timings, on_event, manifest
        self.prompts = PromptCache(models)
        self.schedules: dict[tuple[str, int], Schedule] = {}
        self.controls: dict[tuple[Path, int, int], torch.Tensor] = {}
        self.failed: list[dict] = []
        self.notes: list[str] = []
        self.rendered = 0
        self.oom_at = 1 << 30  # the smallest batch size that ran out of memory
        self.eager = engine if isinstance(engine, EagerEngine) else EagerEngine(models)
        self.writer = _Writer()

    def schedule(self, sampler: str, steps: int) -> Schedule:
        key = (sampler, steps)
        if key not in self.schedules:
            self.schedules[key] = schedule(sampler, steps, self.models.scheduler_config)
        return self.schedules[key]

    def control(self, items: list[WorkItem]) -> Control | None:
        if items[0].control_image is None:
            return None
        m = self.models
        images = []
        for it in items:
            key = (it.control_image, it.width, it.height)
            if key not in self.controls:
                self.controls[key] = load_control_image(it.control_image, it.width, it.height)
            images.append(self.controls[key])
        image = torch.stack(images).to(m.device, m.dtype).repeat(2, 1, 1, 1)  # [2B, 3, H, W]
        scale = torch.tensor([it.control_scale for it in items] * 2, device=m.device, dtype=m.dtype)
        return Control(image, scale.view(-1, 1, 1, 1))

    def run_batch(self, batch: Batch) -> list[tuple[WorkItem, torch.Tensor]]:
        """Denoises one batch; returns (item, latents [4, h, w]) for its real rows."""
        m, key = self.models, batch.key
        rows = list(batch.items) + [batch.items[-1]] * batch.padding  # a padded row copies a real row
        sched = self.schedule(key.sampler, key.steps)
        with self.timings.stage("encode"):
            cond = conditioning(self.prompts, [r.prompt for r in rows], [r.negative for r in rows],
                                key.width, key.height)
            control = self.control(rows)
            x, noise = draw_noise([r.seed for r in rows], key.steps, (4, key.height // 8, key.width // 8), sched)
            x = x.to(m.device)
            noise = None if noise is None else noise.to(m.device)
            guidance = torch.tensor([r.guidance for r in rows], device=m.device, dtype=torch.float32)
        t0 = time.perf_counter()
        with self.timings.stage("denoise"):
            latents = self.engine.sample(x, sched, noise, cond, control, guidance)
        bt = self.timings.bucket(self.bucket_label(batch))
        bt.batches += 1
        bt.rows += 2 * batch.size
        bt.steps += key.steps
        bt.denoise_s += time.perf_counter() - t0
        return list(zip(batch.items, latents[: len(batch.items)]))

    @staticmethod
    def bucket_label(batch: Batch) -> str:
        return f"{batch.size} x {batch.key.label}"

    def fail(self, items, reason: str, total: int) -> None:
        for item in items:
            for path in item.outputs:
                self.failed.append({"path": path, "shot": item.shot, "reason": reason})
            self.on_event(Event("failed", self.rendered, total, item.shot, f"{item.outputs[0]}: {reason}"))

    def finish(self, done: list[tuple[WorkItem, torch.Tensor]], total: int, label: str) -> None:
        """Decodes, then hands the PNGs to the writer thread (which overlaps them with the next batch's
        denoising). An image with NaN/inf is recorded as failed, never saved."""
        m = self.models
        with self.timings.stage("decode"):
            latents = torch.stack([lat for _, lat in done])
            finite_latents = torch.isfinite(latents).flatten(1).all(1)
            pixels_f, pixels = decode(m, latents)
            finite_pixels = torch.isfinite(pixels_f).flatten(1).all(1).cpu()
            finite_latents = finite_latents.cpu()
        for i, (item, _) in enumerate(done):
            if not finite_latents[i]:
                self.fail([item], "NaN/inf in the denoised latents", total)
            elif not finite_pixels[i]:
                self.fail([item], "NaN/inf in the decoded pixels", total)
            else:
                self.writer.submit(self._save, item, pixels[i], total, label)

    def _save(self, item: WorkItem, pixels: torch.Tensor, total: int, label: str) -> None:
        """Runs on the writer thread: atomic PNG writes, then their manifest lines."""
        t0 = time.perf_counter()
        data = png_bytes(pixels, item, self.job.model, self.job.controlnet)
        for path in item.outputs:
            try:
                atomic_write(self.out_dir / path, data)
            except OSError as e:
                raise RenderFailure(f"cannot write {self.out_dir / path}: {e.strerror or e}") from e
            self.manifest.append({"path": path, "shot": item.shot, "candidate": item.k, "seed": item.seed,
                                  "fingerprint": item.fingerprint(self.job.model, self.job.controlnet),
                                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
            self.rendered += 1
            self.timings.bucket(label).images += 1
            self.on_event(Event("image", self.rendered, total, item.shot, path))
        self.timings.stages["save"] += time.perf_counter() - t0

    def process(self, batch: Batch, total: int, buckets: tuple[int, ...]) -> None:
        """One batch, end to end. Out of GPU memory: free the captured graphs, split the batch into
        smaller buckets (down to 1, then eager), and remember the size that failed so later batches
        are split before they run. Any other failure of this batch is recorded against its images
        and the job goes on."""
        smaller = tuple(b for b in buckets if b < min(batch.size, self.oom_at))
        if batch.size >= self.oom_at and smaller:
            for sub in make_batches(list(batch.items), smaller):
                self.process(sub, total, smaller)
            return
        try:
            self.finish(self.run_batch(batch), total, self.bucket_label(batch))
        except torch.cuda.OutOfMemoryError:
            self.oom_at = min(self.oom_at, batch.size)
            if hasattr(self.engine, "release"):
                self.engine.release()
            elif torch.cuda.is_available():
                torch.cuda.empty_cache()
            smaller = tuple(b for b in buckets if b < batch.size)
            if batch.size > 1 and smaller:
                self.notes.append(f"out of GPU memory at {batch.size} x {batch.key.label}: retried in buckets "
                                  f"of at most {max(smaller)}")
                for sub in make_batches(list(batch.items), smaller):
                    self.process(sub, total, smaller)
            elif not isinstance(self.engine, EagerEngine):
                self.notes.append(f"out of GPU memory at {batch.size} x {batch.key.label}: retried eager")
                graph_engine, self.engine = self.engine, self.eager
                try:
                    self.process(batch, total, (1,))
                finally:
                    self.engine = graph_engine
            else:
                self.fail(batch.items, "out of GPU memory even for one image", total)
        except (Interrupted, RenderFailure):
            raise
        except Exception as e:  # noqa: BLE001 - one bad batch (unreadable control image, decode error) must not stop the job
            log.exception("batch %s failed", batch.key.label)
            self.fail(batch.items, f"{e.__class__.__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}",
                      total)


class _Writer:
    """One background thread that writes PNGs in order; errors surface on the next submit or at close."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcg-writer")
        self.futures: list = []

    def submit(self, fn, *args) -> None:
        self._reap()
        if len(self.futures) > 16:  # bound the pixels held in memory
            self.futures[0].result()
        self.futures.append(self.pool.submit(fn, *args))

    def _reap(self) -> None:
        while self.futures and self.futures[0].done():
            self.futures.pop(0).result()

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        for f in self.futures:
            if not f.cancelled():
                f.result()
        self.futures = []


def _pending(job: Job, out_dir: Path, force: bool, only: set[str] | None) -> tuple[list[WorkItem], int, dict]:
    """Items that still need rendering, how many outputs are already done, and manifest records for them."""
    pending, skipped, found = [], 0, {}
    for item in work_items(job):
        fp = item.fingerprint(job.model, job.controlnet)
        todo = []
        for path in item.outputs:
            if not force and read_fingerprint(out_dir / path) == fp:
                skipped += 1
                found[path] = {"path": path, "shot": item.shot, "candidate": item.k, "seed": item.seed,
                               "fingerprint": fp}
            elif only is None or path in only:
                todo.append(path)
        if todo:
            pending.append(replace(item, outputs=tuple(todo)))
    return pending, skipped, found


def _previous_failures(out_dir: Path) -> set[str]:
    try:
        report = json.loads((out_dir / "report.json").read_text())
        return {f["path"] for f in report.get("failures", [])}
    except (OSError, ValueError, TypeError, KeyError):
        return set()


def render(job: Job, opts: RenderOptions = RenderOptions(), on_event: Callable[[Event], None] | None = None,
           models: SdxlModels | None = None, engine=None) -> RenderResult:
    """Renders every image of `job` that is not already done.

    `models` and `engine` may be passed in to reuse loaded weights and captured graphs (bench, tests)."""
    on_event = on_event or (lambda e: None)
    t_start = time.perf_counter()
    device, dtype = (models.device, models.dtype) if models else resolve_device(opts.device, opts.dtype)
    out_dir = Path(opts.out_dir) if opts.out_dir else job.output_dir
    check_output_dir(out_dir)
    notes: list[str] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    timings = Timings(sync=sync)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    only = _previous_failures(out_dir) if opts.retry_failed else None
    if only is not None and not only:
        notes.append("--retry-failed: the last report lists no failed images")

    with OutputLock(out_dir), _interruptible() as stop:
        remove_stale_temps(out_dir)
        manifest = Manifest(out_dir)
        pending, skipped, found = _pending(job, out_dir, opts.force, only)
        manifest.reconcile(found)
        total = sum(len(i.outputs) for i in pending)
        on_event(Event("start", 0, total, "", f"{total} to render, {skipped} already done"))
        engine_name = "none"
        status = "done"
        r = None
        try:
            if pending:
                with timings.stage("load"):
                    if models is None:
                        models = load_sdxl(job.model, job.controlnet if any(i.control_image for i in pending)
                                           else None, device, dtype)
                batches = make_batches(pending, job.buckets)
                with timings.stage("capture"):
                    if engine is None:
                        engine = make_engine(models, opts.engine, batches, notes)
                    elif hasattr(engine, "prepare"):
                        engine.prepare([engine.shape_key(*shape) for shape in batch_shapes(batches)])
                engine_name = engine.name
                r = Renderer(job, models, engine, out_dir, timings, on_event, manifest)
                for batch in batches:
                    on_event(Event("batch", r.rendered, total, batch.items[0].shot, batch.key.label))
                    r.process(batch, total, job.buckets)
                    if stop.requested:
                        raise Interrupted("stopped by Ctrl-C")
                r.writer.close()
        except (Interrupted, KeyboardInterrupt) as e:
            status = "interrupted"
            if r:  # finished images are written out; a second Ctrl-C drops the queued ones
                try:
                    r.writer.close(cancel=isinstance(e, KeyboardInterrupt))
                except KeyboardInterrupt:
                    pass
        except BaseException:
            status = "error"
            if r:
                r.writer.close(cancel=True)
            raise
        finally:
            if r:
                notes.extend(r.notes)
            failed = r.failed if r else []
            rendered = r.rendered if r else 0
            if status == "done" and failed:
                status = "failed"
            graphs = r.engine.describe() if r else []
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            wall = time.perf_counter() - t_start
            report = build_report(job=str(job.path), out_dir=out_dir, device=_device_name(device),
                                  dtype=str(dtype).removeprefix("torch."), engine=engine_name, model=job.model,
                                  timings=timings, wall_s=wall, rendered=rendered, skipped=skipped,
                                  failed=failed, peak_mem_mb=peak, graphs=graphs, status=status, notes=notes)
            # a run that rendered nothing keeps the last report (and its failure list for --retry-failed)
            keep_last = (r is None or (status == "error" and not rendered)) and (out_dir / "report.json").exists()
            paths = None if keep_last else write_report(out_dir, report)
    return RenderResult(status, out_dir, rendered, skipped, failed, wall, _device_name(device), engine_name,
                        report, paths, notes)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


# ---------------------------------------------------------------- ahead-of-time capture and step timing


@dataclass
class ShapeTiming:
    shape: str
    state: str
    reason: str
    capture_s: float
    pool_mb: float
    eager_ms: float | None  # per denoising step (CFG batched), median of `repeats` timed loops
    graph_ms: float | None

    @property
    def speedup(self) -> float | None:
        return self.eager_ms / self.graph_ms if self.eager_ms and self.graph_ms else None


def _timed_loop(engine, x, sched, cond, control, guidance, repeats: int) -> float:
    """Median ms per step over `repeats` loops of sched.steps steps, timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.sample(x, sched, None, cond, control, guidance)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / sched.steps)
    return sorted(times)[len(times) // 2]


def synthetic_inputs(models: SdxlModels, batch: int, width: int, height: int, control: bool,
                     cache: PromptCache | None = None):
    """Inputs of the right shapes for timing (values do not change kernel times)."""
    cache = cache or PromptCache(models)
    cond = conditioning(cache, ["a storyboard frame, ink"] * batch, [""] * batch, width, height)
    ctl = None
    if control:
        g = torch.Generator("cpu").manual_seed(0)
        image = torch.rand((batch, 3, height, width), generator=g).to(models.device, models.dtype).repeat(2, 1, 1, 1)
        ctl = Control(image, torch.ones(2 * batch, 1, 1, 1, device=models.device, dtype=models.dtype))
    x = torch.randn((batch, 4, height // 8, width // 8), generator=torch.Generator("cpu").manual_seed(0))
    guidance = torch.full((batch,), 5.0, device=models.device)
    return x.to(models.device), cond, ctl, guidance


def time_shapes(models: SdxlModels, runner, keys: list, steps: int = 10, repeats: int = 2,
                eager: bool = True, on_row: Callable[[ShapeTiming], None] | None = None) -> list[ShapeTiming]:
    """Captures `keys` (largest first), checks each, and times eager vs graph ms/step side by side."""
    runner.prepare(keys)
    cache = PromptCache(models)
    sched = schedule("euler", steps, models.scheduler_config)
    warm = schedule("euler", 2, models.scheduler_config)
    eager_engine = EagerEngine(models)
    rows = []
    for key in sorted(set(keys), reverse=True):
        x, cond, ctl, guidance = synthetic_inputs(models, key.batch, key.width, key.height, key.control, cache)
        x = x * sched.init_sigma
        eager_ms = None
        if eager:
            eager_engine.sample(x, warm, None, cond, ctl, guidance)  # warm-up
            eager_ms = _timed_loop(eager_engine, x, sched, cond, ctl, guidance, repeats)
        runner.sample(x, sched, None, cond, ctl, guidance)  # first replay: checked against eager
        st = runner.stats[key]
        graph_ms = _timed_loop(runner, x, sched, cond, ctl, guidance, repeats) if st.state == "graph" else None
        rows.append(ShapeTiming(key.label, st.state, st.reason, st.capture_s, st.pool_mb, eager_ms, graph_ms))
        if on_row:
            on_row(rows[-1])
    return rows


def capture(job: Job | None, model: str, controlnet: str | None, buckets: tuple[int, ...], device: str | None,
            dtype: str | None, warm: bool, steps: int = 10) -> tuple[list[str], list[ShapeTiming]]:
    """The shapes a job (or the named sizes x buckets) needs; with `warm`, captures, checks and times them."""
    from storyboard_cli.job import NAMED_SIZES

    dev, dt = resolve_device(device, dtype)
    if job is not None:
        model, controlnet = job.model, job.controlnet
        shapes = sorted(set(batch_shapes(make_batches(work_items(job), job.buckets))), reverse=True)
    else:
        flags = (False, True) if controlnet else (False,)
        shapes = sorted({(n, h, w, c) for (w, h) in NAMED_SIZES.values() for n in buckets for c in flags},
                        reverse=True)
    labels = [f"{n}x{w}x{h}{' +control' if c else ''}" for n, h, w, c in shapes]
    if not warm:
        return labels, []
    if dev.type != "cuda":
        raise BadInput("bcg capture --warm needs a CUDA device: CUDA graphs do not exist on the CPU")
    models = load_sdxl(model, controlnet, dev, dt)
    runner, keys = graph_runner(models, shapes)
    return labels, time_shapes(models, runner, keys, steps=steps)
