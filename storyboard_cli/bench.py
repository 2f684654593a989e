"""`make bench`: the same job through the plain diffusers loop, diffusers + torch.compile, and bcg,
in one process, one run, with the same weights, dtype and seeds. Ratios, not absolute claims.

Model loading is done once and excluded from every contender's wall time; everything after it
(graph capture for bcg, compilation for torch.compile) is counted.
"""

from __future__ import annotations

import copy
import gc
import json
import traceback
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.engine.base import Shape, shape_label
from storyboard_cli.engine.build import compiled_kernels, graph_runner
from storyboard_cli.engine.compiled import artifact_path, module_of, targets
from storyboard_cli.engine.device import device_name, dtype_name
from storyboard_cli.engine.eager import EagerEngine, StepCalls, denoise
from storyboard_cli.engine.sampling import FULL, schedule, step_plan
from storyboard_cli.errors import BadInput
from storyboard_cli.job.file import DRAFT_CUTOFF, DRAFT_DEEPCACHE, Job, as_draft, load_job
from storyboard_cli.job.plan import guided_steps, make_batches, work_items
from storyboard_cli.models.loader import SdxlModels, load_sdxl
from storyboard_cli.run.batch import BatchRunner, batch_kinds, batch_shapes, decode
from storyboard_cli.run.capture import synthetic_inputs, time_shapes
from storyboard_cli.samplers import SAMPLERS


def quick_job(job: Job) -> Job:
    """The bench job at 1/8 of its size and 4 steps: a CPU smoke run of the whole harness."""
    shots = tuple(replace(s, width=max(64, s.width // 8 // 8 * 8), height=max(64, s.height // 8 // 8 * 8),
                          steps=4) for s in job.shots[:8])
    return replace(job, model="tiny", controlnet="tiny" if job.controlnet else None, shots=shots)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


# ---------------------------------------------------------------- (a)/(b): what users would write


class DiffusersLoop:
    """One pipeline call per shot with num_images_per_prompt=candidates: the loop users write."""

    def __init__(self, models: SdxlModels):
        import diffusers

        self.models, self.diffusers = models, diffusers
        m = models
        # users load SDXL's VAE in the pipeline's dtype; the pipeline upcasts it around each decode
        vae = m.vae if m.vae.dtype == m.dtype else copy.deepcopy(m.vae).to(m.dtype)
        # the very modules bcg runs: neither side changes a weight or a memory layout
        parts = dict(vae=vae, text_encoder=m.text_encoders[0], text_encoder_2=m.text_encoders[1],
                     tokenizer=m.tokenizers[0], tokenizer_2=m.tokenizers[1], unet=m.unet,
                     scheduler=diffusers.EulerDiscreteScheduler.from_config(m.scheduler_config))
        self.pipe = diffusers.StableDiffusionXLPipeline(**parts)
        self.pipe.set_progress_bar_config(disable=True)
        self.cpipe = None
        if m.controlnet is not None:
            self.cpipe = diffusers.StableDiffusionXLControlNetPipeline(**parts, controlnet=m.controlnet)
            self.cpipe.set_progress_bar_config(disable=True)

    def compile_unet(self) -> None:
        """diffusers' documented speed-up."""
        compiled = torch.compile(self.models.unet, mode="reduce-overhead")  # wraps it: bcg's module is untouched
        self.pipe.unet = compiled
        if self.cpipe is not None:
            self.cpipe.unet = compiled

    def shot(self, shot, output_type: str = "pil", step_events: list | None = None):
        from PIL import Image

        pipe = self.cpipe if shot.control else self.pipe
        pipe.scheduler = getattr(self.diffusers, SAMPLERS[shot.sampler].scheduler).from_config(self.models.scheduler_config)
        kwargs = {}
        if shot.control:
            kwargs = dict(image=Image.open(shot.control.image).convert("RGB"),
                          controlnet_conditioning_scale=shot.control.scale)
        if step_events is not None and self.models.device.type == "cuda":
            def on_step(p, i, t, kw):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                step_events.append(ev)
                return kw
            kwargs["callback_on_step_end"] = on_step
        generators = [torch.Generator("cpu").manual_seed(shot.seed + k) for k in range(shot.candidates)]
        return pipe(prompt=shot.prompt, negative_prompt=shot.negative or None, height=shot.height,
                    width=shot.width, num_inference_steps=shot.steps, guidance_scale=shot.guidance,
                    num_images_per_prompt=shot.candidates, generator=generators, output_type=output_type,
                    **kwargs).images

    def run_job(self, job: Job, out_dir: Path) -> dict:
        """Every shot, saving its PNGs as the user's loop would (PIL's defaults)."""
        device = self.models.device
        _peak_reset(device)
        per_bucket: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        images = 0
        for shot in job.shots:
            events: list = []
            out = self.shot(shot, step_events=events)
            (out_dir / shot.id).mkdir(parents=True, exist_ok=True)
            for k, image in enumerate(out):
                image.save(out_dir / shot.id / f"{shot.id}_{k}.png")
            images += len(out)
            if len(events) > 1:
                _sync(device)
                ms = events[0].elapsed_time(events[-1]) / (len(events) - 1)
                label = shape_label(shot.candidates, shot.width, shot.height, shot.control is not None)
                per_bucket.setdefault(label, []).append(ms)
        _sync(device)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "images": images, "images_per_s": images / wall, "peak_mb": _peak_mb(device),
                "ms_per_step": {k: round(statistics.mean(v), 2) for k, v in sorted(per_bucket.items())}}


# ---------------------------------------------------------------- (c)/(d): bcg


def _bcg(job: Job, models: SdxlModels, out_dir: Path, engine=None, compile: str = "off") -> dict:
    from storyboard_cli.run.render import RenderOptions, render

    _peak_reset(models.device)
    result = render(job, RenderOptions(out_dir=out_dir, force=True, compile=compile), models=models, engine=engine)
    r = result.report
    return {"wall_s": result.wall_s, "images": result.rendered, "failed": len(result.failed),
            "failure": result.failed[0]["reason"] if result.failed else None,
            "images_per_s": result.rendered / result.wall_s,
            "peak_mb": _peak_mb(models.device), "engine": result.engine, "stages_s": r["stages_s"],
            "ms_per_step": {b["bucket"]: b["ms_per_step"] for b in r["buckets"]}, "graphs": r["graphs"],
            "lora": r.get("lora"), "notes": r["notes"]}


def _warm_runner(job: Job, models: SdxlModels):
    """What `bcg capture --warm` does for this job: every shape captured and checked."""
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    t0 = time.perf_counter()
    runner = graph_runner(models, shapes, compile="off")
    time_shapes(models, runner, shapes, steps=2, repeats=1, eager=False)
    return runner, time.perf_counter() - t0


# ---------------------------------------------------------------- microbenchmarks


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) / 1000) / 1e12


def step_flops(models: SdxlModels, batch: int, width: int, height: int, control: bool) -> float:
    """FLOPs of one CFG-batched denoising step (ControlNet + UNet), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    x, cond, ctl, guidance = synthetic_inputs(models, batch, width, height, control)
    one = torch.ones((), device=models.device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        denoise(models, x, one, one * 500, cond, ctl, guidance)
    return float(counter.get_total_flops())


def step_curve(models: SdxlModels, batches: tuple[int, ...], width: int, height: int, control: bool,
               matmul_rate: float, log: Callable[[str], None], compile: str = "off", eager: bool = True) -> list[dict]:
    """Eager vs graph ms/step per batch size, FLOPs per step and the share of the matmul rate reached
    (compile "on": the graphs run the compiled kernels, built first if the cache lacks them)."""
    shapes = [Shape(b, height, width, control) for b in batches]
    rows = []
    runner = graph_runner(models, shapes, compile)
    for t in sorted(time_shapes(models, runner, shapes, steps=10, repeats=3, eager=eager), key=lambda t: t.shape):
        b = int(t.shape.split("x")[0])
        flops = step_flops(models, b, width, height, control)
        row = {"shape": t.shape, "state": t.state, "reason": t.reason, "batch": b, "eager_ms": t.eager_ms,
               "graph_ms": t.graph_ms,
               "speedup": t.speedup, "graph_ms_per_image": t.graph_ms / b if t.graph_ms else None,
               "tflop_per_step": flops / 1e12, "capture_s": t.capture_s, "pool_mb": t.pool_mb,
               "matmul_share": (flops / (t.graph_ms / 1000) / 1e12 / matmul_rate) if t.graph_ms else None}
        rows.append(row)
        log(json.dumps(row))
    return sorted(rows, key=lambda r: r["batch"])


def single_shot(models: SdxlModels, loop: DiffusersLoop, job: Job, log: Callable[[str], None],
                repeats: int = 3) -> dict:
    """The artist's edit-and-rerender loop: 1 image, model loaded; denoise + decode, median of `repeats`."""
    shot = next(s for s in job.shots if not s.control)
    shot = replace(shot, candidates=1)
    one = replace(job, shots=(shot,))
    item = work_items(one)[0]
    batch = make_batches([item], (1,))[0]

    def bcg_once(engine) -> float:
        runner = BatchRunner(models, engine)  # a fresh prompt cache: the prompt is encoded each time
        _sync(models.device)
        t0 = time.perf_counter()
        ((_, latents),) = runner.run_batch(batch)
        decode(models, latents[None])
        _sync(models.device)
        return time.perf_counter() - t0

    def diffusers_once() -> float:
        _sync(models.device)
        t0 = time.perf_counter()
        loop.shot(shot, output_type="np")
        _sync(models.device)
        return time.perf_counter() - t0

    out = {"shape": f"1x{shot.width}x{shot.height}", "steps": shot.steps}
    diffusers_once()  # warm-up
    out["diffusers_s"] = statistics.median(diffusers_once() for _ in range(repeats))
    eager = EagerEngine(models)
    bcg_once(eager)
    out["bcg_eager_s"] = statistics.median(bcg_once(eager) for _ in range(repeats))
    if models.device.type == "cuda":
        runner = graph_runner(models, batch_shapes([batch]), compile="off")
        out["bcg_graph_first_s"] = bcg_once(runner)  # includes capture + the replay check
        out["bcg_graph_s"] = statistics.median(bcg_once(runner) for _ in range(repeats))
        out["speedup_vs_diffusers"] = out["diffusers_s"] / out["bcg_graph_s"]
        out["speedup_first_vs_diffusers"] = out["diffusers_s"] / out["bcg_graph_first_s"]
    log(json.dumps(out))
    return out


# ---------------------------------------------------------------- compiled kernels


def first_render(job: Job, models: SdxlModels, log: Callable[[str], None]) -> dict:
    """The first render of a job with `--compile auto` on a cache without its kernels (they compile in the
    background while the plain graphs render) against the same render with `--compile off`, side by side
    on the same models; off first, so the builds' CPU load cannot slow it."""
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    cached = [t.label for t in targets(shapes, models.controlnet is not None)
              if artifact_path(t, module_of(models, t.module)).is_file()]
    with tempfile.TemporaryDirectory() as tmp:
        off = _bcg(job, models, Path(tmp) / "off", compile="off")
        auto = _bcg(job, models, Path(tmp) / "auto", compile="auto")
    rec = {"cached_before": cached, "off": off, "auto": auto, "ratio": auto["images_per_s"] / off["images_per_s"]}
    log(f"first render: auto {auto['images_per_s']:.3f} images/s, off {off['images_per_s']:.3f} "
        f"= {rec['ratio']:.3f}x (artifacts in the cache before: {cached or 'none'})")
    return rec


def top_kernels(fn: Callable[[], object], n: int = 3, k: int = 15) -> list[dict]:
    """The `k` GPU kernels that take the most time in `fn`, per call (torch.profiler, after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 1000 / n
    return [{"kernel": "all kernels", "ms_per_step": round(total, 2), "calls": sum(e.count for e in events) // n}] + \
        [{"kernel": e.key[:100], "ms_per_step": round(e.device_time_total / 1000 / n, 3), "calls": e.count // n}
         for e in events[:k]]


def kernel_profile(models: SdxlModels, log: Callable[[str], None], batch: int = 8, side: int = 1024) -> dict:
    """Top kernels of one denoising step (CFG batched), plain modules against the compiled kernels from the
    cache, outside any graph (a graph replay hides its kernels from the profiler)."""
    shape = Shape(batch, side, side, False)
    notes: list[str] = []
    kernels = compiled_kernels(models, [shape], "auto", notes)
    kernels.want(targets([shape], False))
    why = kernels.ready(*shape)
    if why:
        raise RuntimeError(f"no compiled kernels to profile: {why} {notes}")
    kernels.reserve(batch, side * side)
    x, cond, _, guidance = synthetic_inputs(models, batch, side, side, False)
    sigma, t = torch.tensor(10.0, device=models.device), torch.tensor(500.0, device=models.device)
    rel = lambda a, b: (torch.linalg.vector_norm((a - b).float()) / torch.linalg.vector_norm(b.float())).item()  # noqa: E731
    with torch.no_grad():
        rec = {"shape": shape.label,
               "plain": top_kernels(lambda: denoise(models, x, sigma, t, cond, None, guidance)),
               "compiled": top_kernels(lambda: denoise(models, x, sigma, t, cond, None, guidance, kernels))}
        # how far the compiled kernels are from the plain modules: the noise prediction itself, and the
        # denoised estimate with and without guidance (CFG amplifies the first where eps+ and eps- are close)
        latents, tt = (x * 0.1).half().repeat(2, 1, 1, 1), t.expand(2 * batch)
        eps = [calls.unet(latents, tt, cond.embeds, cond.pooled, cond.time_ids, None, None)
               for calls in (StepCalls.eager(models), kernels)]
        rec["rel_err_eps"] = rel(eps[1], eps[0])
        for g in (1.0, 5.0):
            full = torch.full_like(guidance, g)
            rec[f"rel_err_denoised_g{g:g}"] = rel(denoise(models, x, sigma, t, cond, None, full, kernels),
                                                 denoise(models, x, sigma, t, cond, None, full))
    log(json.dumps(rec))
    return rec


def compile_slice(job: Job, models: SdxlModels, loop: DiffusersLoop, log: Callable[[str], None]) -> dict:
    """(b) the diffusers loop with diffusers' regional torch.compile (`compile_repeated_blocks`: each
    BasicTransformerBlock compiled once and reused) on the job's shots at its most common size, side by
    side with (a) and with (e) bcg on its compiled kernels, on that slice. Run last: it compiles the shared
    UNet's blocks (undone at the end)."""
    sizes = [(s.width, s.height) for s in job.shots]
    size = max(set(sizes), key=sizes.count)
    part = replace(job, shots=tuple(s for s in job.shots if (s.width, s.height) == size))
    torch._dynamo.config.recompile_limit = 64  # every block class x row count, until shapes turn dynamic
    with tempfile.TemporaryDirectory() as tmp:
        e = _bcg(part, models, Path(tmp) / "e", compile="auto")
        a = loop.run_job(part, Path(tmp) / "a")
        models.unet.compile_repeated_blocks(fullgraph=True)
        try:
            first = loop.run_job(part, Path(tmp) / "b1")
            steady = loop.run_job(part, Path(tmp) / "b2")
        finally:
            for m in models.unet.modules():  # back to the plain blocks for whatever runs next
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
    rec = {"shots": [s.id for s in part.shots], "images": e["images"], "a": a, "e": e, "b_first": first,
           "b_steady": steady, "b_compile_s": first["wall_s"] - steady["wall_s"],
           "e_vs_b": e["images_per_s"] / steady["images_per_s"], "e_vs_a": e["images_per_s"] / a["images_per_s"],
           "b_vs_a": steady["images_per_s"] / a["images_per_s"]}
    log(f"slice {size[0]}x{size[1]} ({rec['images']} images): (e) {rec['e_vs_a']:.2f}x (a), (b) steady "
        f"{rec['b_vs_a']:.2f}x (a), (e) {rec['e_vs_b']:.2f}x (b); (b) compile {rec['b_compile_s']:.0f} s")
    return rec


# ---------------------------------------------------------------- the harness


@dataclass(frozen=True)
class Results:
    """Where one run's record goes: written after every part, so a run cut short keeps what it measured."""

    folder: Path
    stem: str

    charts: dict[str, str] = field(default_factory=dict)  # chart name -> SVG file name, as written

    @property
    def paths(self) -> list[Path]:
        return [self.folder / f"{self.stem}.json", self.folder / f"{self.stem}.md",
                *(self.folder / f for f in self.charts.values())]

    def save(self, rec: dict) -> None:
        """The JSON record, the throughput-vs-batch curves and contenders' images/s as SVG, and the Markdown."""
        from storyboard_cli.folder.charts import bench_svgs

        self.folder.joinpath(f"{self.stem}.json").write_text(json.dumps(rec, indent=2) + "\n")
        for name, svg in bench_svgs(rec, NAMES).items():
            self.charts[name] = f"{self.stem}-{name}.svg"
            self.folder.joinpath(self.charts[name]).write_text(svg)
        self.folder.joinpath(f"{self.stem}.md").write_text(markdown(rec, self.charts))


def run(*, job_path: Path, model: str | None = None, quick: bool = False, parts: tuple[str, ...] = ("job", "micro"),
        with_compile: bool = False, results_dir: Path = Path("bench/results"),
        log: Callable[[str], None] = print) -> dict:
    if not quick and not torch.cuda.is_available():
        raise BadInput("bcg bench: the full run measures CUDA graphs and needs a CUDA device; "
                       "use --quick for the CPU smoke run")
    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    job = load_job(job_path)
    if quick:
        job = quick_job(job)
    elif model:
        job = replace(job, model=model)
    t0 = time.perf_counter()
    models = load_sdxl(job.model, job.controlnet, device, dtype)
    import diffusers

    rec: dict = {"date": date.today().isoformat(), "device": device_name(device), "dtype": dtype_name(dtype),
                 "torch": torch.__version__, "diffusers": diffusers.__version__,
                 "python": platform.python_version(), "job": str(job_path), "model": job.model, "quick": quick,
                 "load_s": time.perf_counter() - t0, "images": sum(s.candidates for s in job.shots)}
    results_dir.mkdir(parents=True, exist_ok=True)
    results = Results(results_dir, f"{rec['date']}-{_slug(rec['device'])}{'-quick' if quick else ''}")
    loop = DiffusersLoop(models)
    log(f"loaded {job.model} on {rec['device']} in {rec['load_s']:.1f} s")
    if device.type == "cuda":
        rec["matmul_tflops"] = matmul_tflops(device, dtype)
        log(f"fp16 matmul rate: {rec['matmul_tflops']:.0f} TFLOP/s")
    # warm-up outside every contender: CUDA context, cuDNN/cuBLAS handles, first-call lazy inits
    loop.shot(replace(job.shots[0], candidates=1, steps=2), output_type="latent")
    part = lambda key, fn: _part(rec, key, log, fn, results)  # noqa: E731
    contenders = set(CONTENDERS) if "job" in parts else set(parts) & set(CONTENDERS)
    if contenders:
        _job_parts(job, models, loop, with_compile, part, contenders)
        _ratios(rec, log)
    if "micro" in parts and device.type == "cuda":
        part("step_curve", lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"], log))
        if models.controlnet is not None:
            part("step_curve_control",
                 lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"], log))
        part("single_shot", lambda: single_shot(models, loop, job, log))
    if "lora" in parts:
        part("lora", lambda: lora_part(job, models, log))
    if "curves" in parts and device.type == "cuda":  # plain against compiled graphs, side by side, no eager
        for key, compile in (("step_curve", "off"), ("step_curve_compiled", "on")):
            part(key, lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"], log,
                                         compile, eager=False))
            if models.controlnet is not None:
                part(key.replace("curve", "curve_control"),
                     lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"], log, compile,
                                        eager=False))
    if "micro_compiled" in parts and device.type == "cuda":  # the kernels built first if the cache lacks them
        part("step_curve_compiled",
             lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"], log, "on"))
        if models.controlnet is not None:
            part("step_curve_control_compiled",
                 lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"], log, "on"))
    if "draft" in parts:  # draft mode's levers: step times, the bench job with --draft, capture, drift
        part("draft_steps", lambda: draft_steps(models, log, *((8, 1024, 30) if device.type == "cuda" else (2, 64, 6))))
        part("draft_job", lambda: draft_job(job, models, log))
        part("draft_capture", lambda: draft_capture(job, models, log))
    if "first_render" in parts and device.type == "cuda":
        part("first_render", lambda: first_render(job, models, log))
    if "profile" in parts and device.type == "cuda":
        part("profile", lambda: kernel_profile(models, log))
    if "b_slice" in parts and device.type == "cuda":
        part("b_slice", lambda: compile_slice(job, models, loop, log))
    results.save(rec)
    rec["written"] = [str(p) for p in results.paths]
    return rec


CONTENDERS = ("a_diffusers", "c_bcg_cold", "d_bcg_warm", "e_bcg_compiled")

# ---------------------------------------------------------------- draft renders

# the step loops `draft_steps` times side by side: (cfg_cutoff, DeepCache interval), branch 0
DRAFT_LOOPS = {"full": (1.0, 0), "deepcache_3": (1.0, 3), "cfg_cutoff_0.5": (0.5, 0), "cfg_cutoff_0.7": (0.7, 0),
               "draft_preset": (DRAFT_CUTOFF, DRAFT_DEEPCACHE[0])}


def _loop_s(engine, x, sched, cond, guidance, plan) -> float:
    """One whole loop's seconds: CUDA events on the GPU, the wall clock on the CPU (a smoke run)."""
    cuda = x.device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    engine.sample(x, sched, None, cond, None, guidance, plan)
    if not cuda:
        return time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def draft_steps(models: SdxlModels, log: Callable[[str], None], batch: int = 8, side: int = 1024, steps: int = 30,
                repeats: int = 3) -> dict:
    """ms per image-step of whole `steps`-step loops at `batch` images, full against each lever (DRAFT_LOOPS),
    in one graph runner (plain graphs; the eager engine on the CPU), every graph checked and warmed first, then
    `repeats` rounds taking each loop in turn; medians. Also each graph's own ms per replay."""
    cuda = models.device.type == "cuda"
    shape = Shape(batch, side, side, False)
    sched = schedule("euler", steps, models.scheduler_config)
    plans = {name: step_plan(steps, guided_steps(steps, cutoff), interval, DRAFT_DEEPCACHE[1])
             for name, (cutoff, interval) in DRAFT_LOOPS.items()}
    engine = graph_runner(models, [shape], compile="off") if cuda else EagerEngine(models)
    engine.prepare([shape], {shape: set().union(*plans.values())})
    x, cond, _, guidance = synthetic_inputs(models, batch, side, side, False)
    x = x * sched.init_sigma
    for plan in plans.values():  # first replays (checked against eager) and a warm-up loop each
        engine.sample(x, sched, None, cond, None, guidance, plan)
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():
            times[name].append(_loop_s(engine, x, sched, cond, guidance, plan))
    ms = {name: statistics.median(t) * 1000 / (steps * batch) for name, t in times.items()}
    rec = {"shape": shape.label, "steps": steps, "repeats": repeats, "engine": engine.name,
           "ms_per_image_step": ms, "speedup_vs_full": {name: ms["full"] / m for name, m in ms.items()},
           "guided_steps": {name: sum(k.guided for k in plan) for name, plan in plans.items()},
           "graphs": engine.describe()}
    log("draft steps at " + shape.label + ": " + ", ".join(f"{n} {m:.2f} ms/image-step ({rec['speedup_vs_full'][n]:.2f}x)"
                                                          for n, m in ms.items()))
    return rec


def draft_capture(job: Job, models: SdxlModels, log: Callable[[str], None]) -> dict:
    """The bench job's graphs (plain, --compile off): today's step kinds captured first, then the extra kinds
    its draft render adds (conditional rows, DeepCache full and shallow): capture seconds and pool MB of each
    group, from the runner's per-graph stats. CPU: nothing to capture."""
    if models.device.type != "cuda":
        return {"skipped": "CUDA graphs need a GPU"}
    batches = make_batches(work_items(as_draft(job)), job.buckets)
    shapes = batch_shapes(batches)
    runner = graph_runner(models, shapes, compile="off")
    runner.prepare(shapes)
    runner.prepare(shapes, batch_kinds(batches))
    stats = list(runner.stats.values())
    groups = {"plain": [s for s in stats if s.key.step == FULL], "extra": [s for s in stats if s.key.step != FULL]}
    rec = {name: {"graphs": len(g), "capture_s": sum(s.capture_s for s in g), "pool_mb": sum(s.pool_mb for s in g)}
           for name, g in groups.items()}
    rec["capture_ratio"] = rec["extra"]["capture_s"] / rec["plain"]["capture_s"] if rec["plain"]["capture_s"] else None
    rec["pool_ratio"] = rec["extra"]["pool_mb"] / rec["plain"]["pool_mb"] if rec["plain"]["pool_mb"] else None
    feature = runner.buf.feature
    rec["feature_buffer_mb"] = feature.numel() * feature.element_size() / 2**20 if feature is not None else 0.0
    rec["graphs"] = runner.describe()
    log(f"draft capture: plain {json.dumps(rec['plain'])}, extra {json.dumps(rec['extra'])}")
    runner.release("bench part done")
    return rec


def _drift(draft_dir: Path, full_dir: Path) -> list[dict]:
    """PSNR (dB, 8-bit) and mean absolute difference (0-255) of every draft PNG against the full render's PNG of
    the same path (the same shot, candidate and seed)."""
    import numpy as np
    from PIL import Image

    rows = []
    for draft in sorted(draft_dir.glob("*/*.png")):
        rel = draft.relative_to(draft_dir)
        full = full_dir / rel
        if not full.is_file():
            continue
        a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=np.float64) for p in (draft, full))
        mse = float(((a - b) ** 2).mean())
        rows.append({"image": rel.as_posix(), "psnr_db": 10 * np.log10(255**2 / mse) if mse else float("inf"),
                     "mad": float(np.abs(a - b).mean())})
    return rows


def draft_job(job: Job, models: SdxlModels, log: Callable[[str], None]) -> dict:
    """The bench job rendered without and with the draft preset (ControlNet shots included), side by side,
    each render capturing its own graphs (--compile off): images/s and their ratio; then every draft image
    against the full image of the same seed (PSNR, mean absolute difference)."""
    with tempfile.TemporaryDirectory() as tmp:
        full = _bcg(job, models, Path(tmp) / "full")
        draft = _bcg(as_draft(job), models, Path(tmp) / "draft")
        drift = _drift(Path(tmp) / "draft", Path(tmp) / "full")
    rec = {"full": full, "draft": draft, "ratio": draft["images_per_s"] / full["images_per_s"],
           "denoise_ratio": full["stages_s"]["denoise"] / draft["stages_s"]["denoise"], "drift": drift}
    if drift:
        finite = [d["psnr_db"] for d in drift if d["psnr_db"] != float("inf")]
        rec["psnr_db"] = {"median": statistics.median(finite) if finite else None, "min": min(finite, default=None)}
        rec["mad"] = {"median": statistics.median(d["mad"] for d in drift), "max": max(d["mad"] for d in drift)}
    for name, r in (("full", full), ("draft", draft)):
        if r["failed"]:  # a ratio over failed images measures nothing
            log(f"draft job ({name}): {r['failed']} images failed ({r['failure']})")
            rec["ratio"] = float("nan")
    log(f"draft job: {rec['ratio']:.3f}x the images/s of the full render (denoise {rec['denoise_ratio']:.3f}x); "
        f"PSNR {json.dumps(rec.get('psnr_db'))} dB, MAD {json.dumps(rec.get('mad'))}")
    return rec


def lora_job(job: Job, models: SdxlModels, folder: Path, count: int = 3, rank: int = 32) -> Job:
    """The bench job with `count` synthetic LoRAs (UNet + both text encoders, `rank`, fp16, Kohya layout)
    given to its shots in turn, at 0.8: a job that swaps weights between its LoRA sets."""
    from storyboard_cli.job.file import LoraFile
    from storyboard_cli.models.lora import inspect_lora
    from storyboard_cli.models.synthetic_lora import random_factors, save_kohya

    loras = {}
    for i in range(count):
        factors = {k: (d.half(), u.half()) for k, (d, u) in random_factors(models, 100 + i, rank, relative=0.1).items()}
        path = save_kohya(folder / f"lora{i}.safetensors", factors, models.unet.config.layers_per_block, alpha=rank)
        info = inspect_lora(path)
        loras[f"lora{i}"] = LoraFile(f"lora{i}", path, path.name, info.hash, info.shorthash, info.text_encoders)
    shots = tuple(replace(s, loras=((f"lora{i % count}", 0.8),)) for i, s in enumerate(job.shots))
    return replace(job, loras=loras, shots=shots)


def lora_part(job: Job, models: SdxlModels, log: Callable[[str], None]) -> dict:
    """The same job without and with 3 rank-32 LoRAs spread over its shots, side by side (plain graphs,
    each render capturing its own): images/s, their ratio, and the swaps' seconds from the report."""
    with tempfile.TemporaryDirectory() as tmp:
        with_loras = lora_job(job, models, Path(tmp))
        plain = _bcg(job, models, Path(tmp) / "plain")
        loras = _bcg(with_loras, models, Path(tmp) / "loras")
    swaps = loras.pop("lora", None) or {}
    plain.pop("lora", None)
    rec = {"without": plain, "with": loras, "swaps": swaps,
           "ratio": loras["images_per_s"] / plain["images_per_s"]}
    for name, r in (("without", plain), ("with", loras)):
        if r["failed"]:  # a ratio over failed images measures nothing
            log(f"LoRA job {name} LoRAs: {r['failed']} images failed ({r['failure']})")
            rec["ratio"] = float("nan")
    log(f"LoRA job: {rec['ratio']:.3f}x the images/s without LoRAs; swaps {json.dumps(swaps)}")
    return rec


def _job_parts(job: Job, models: SdxlModels, loop: DiffusersLoop, with_compile: bool,
               part: Callable[[str, Callable[[], object]], None], contenders: set[str]) -> None:
    """(a) diffusers, (c) bcg cold, (d) bcg after capture, (e) bcg with the compiled kernels from the
    cache (a new render: loading them, checking and capturing is counted), (b) diffusers +
    torch.compile, in that order."""
    cuda = models.device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        if "a_diffusers" in contenders:
            part("a_diffusers", lambda: loop.run_job(job, Path(tmp) / "a"))
        if "c_bcg_cold" in contenders:
            part("c_bcg_cold", lambda: _bcg(job, models, Path(tmp) / "c"))
        if cuda and "d_bcg_warm" in contenders:
            def warm():
                runner, warm_s = _warm_runner(job, models)
                return _bcg(job, models, Path(tmp) / "d", engine=runner) | {"capture_warm_s": warm_s}
            part("d_bcg_warm", warm)
        if cuda and "e_bcg_compiled" in contenders:
            part("e_bcg_compiled", lambda: _bcg(job, models, Path(tmp) / "e", compile="auto"))
        if with_compile:
            loop.compile_unet()
            part("b_compile_first", lambda: loop.run_job(job, Path(tmp) / "b1"))
            part("b_compile_steady", lambda: loop.run_job(job, Path(tmp) / "b2"))


def _ratios(rec: dict, log: Callable[[str], None]) -> None:
    ours = ("c_bcg_cold", "d_bcg_warm", "e_bcg_compiled")
    for k in ("a_diffusers", *ours, "b_compile_first", "b_compile_steady"):
        if k in rec:
            log(f"{k}: {json.dumps(rec[k])}")
    base = rec["a_diffusers"]["images_per_s"] if "a_diffusers" in rec else float("nan")
    rec["ratios_vs_a"] = {k: rec[k]["images_per_s"] / base for k in
                          (*ours, "b_compile_first", "b_compile_steady") if k in rec}
    for k in ("d_bcg_warm", "e_bcg_compiled"):
        for b in ("b_compile_first", "b_compile_steady"):
            if k in rec and b in rec:
                rec[f"{k[:1]}_vs_{b[0]}_{b.rsplit('_', 1)[1]}"] = rec[k]["images_per_s"] / rec[b]["images_per_s"]


def _part(rec: dict, key: str, log: Callable[[str], None], fn: Callable[[], object], results: Results) -> None:
    """Runs one measurement; a failure is recorded with its reason and the others still run.
    The record is written after each part, so a run cut short keeps what it measured."""
    try:
        rec[key] = fn()
        results.save(rec)
        gc.collect()  # drop the part's graphs and pools before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a broken contender must not hide the other results
        rec.setdefault("errors", {})[key] = f"{e.__class__.__name__}: {e}"
        log(f"{key} failed: {traceback.format_exc()}")


def _draft_markdown(rec: dict) -> list[str]:
    out = []
    if "draft_steps" in rec:
        d = rec["draft_steps"]
        out += [f"Draft levers, per image-step ({d['shape']}, {d['steps']}-step loops, {d['engine']}, median of "
                f"{d['repeats']}):", "", "| loop | guided steps | ms per image-step | vs full |", "|---|---:|---:|---:|"]
        out += [f"| {n} | {d['guided_steps'][n]}/{d['steps']} | {m:.2f} | {d['speedup_vs_full'][n]:.2f}x |"
                for n, m in d["ms_per_image_step"].items()] + [""]
    if "draft_capture" in rec and "plain" in rec["draft_capture"]:
        c = rec["draft_capture"]
        out += [f"Capture of the bench job's graphs: today's {c['plain']['graphs']} in {c['plain']['capture_s']:.2f} s, "
                f"pool {c['plain']['pool_mb']:.0f} MB; the draft kinds add {c['extra']['graphs']} graphs, "
                f"{c['extra']['capture_s']:.2f} s, {c['extra']['pool_mb']:.0f} MB of pool (and DeepCache's feature buffer, "
                f"{c['feature_buffer_mb']:.0f} MB, outside the pool)", ""]
    if "draft_job" in rec:
        j = rec["draft_job"]
        out += [f"Bench job with `--draft`: {j['draft']['images_per_s']:.3f} images/s against "
                f"{j['full']['images_per_s']:.3f} without = **{j['ratio']:.3f}x** (denoising {j['denoise_ratio']:.3f}x); "
                f"drift of each draft against the full image of its seed: PSNR {json.dumps(j.get('psnr_db'))} dB, "
                f"mean absolute difference {json.dumps(j.get('mad'))} (0-255)", "",
                "| image | PSNR dB | MAD |", "|---|---:|---:|"]
        out += [f"| {d['image']} | {d['psnr_db']:.2f} | {d['mad']:.2f} |" for d in j["drift"]] + [""]
    return out


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


NAMES = {"a_diffusers": "(a) diffusers pipeline loop", "b_compile_first": "(b) + torch.compile, first pass",
         "b_compile_steady": "(b) + torch.compile, steady state", "c_bcg_cold": "(c) bcg render, cold",
         "d_bcg_warm": "(d) bcg render after capture --warm",
         "e_bcg_compiled": "(e) bcg render, compiled kernels from the cache"}


def markdown(rec: dict, charts: dict[str, str] | None = None) -> str:
    """The record as Markdown; `charts`: chart name -> SVG file name, linked at the top."""
    out = [f"# bcg bench: {rec['job']} on {rec['device']} ({rec['dtype']}), {rec['date']}", "",
           f"model `{rec['model']}`, {rec['images']} images, torch {rec['torch']}, diffusers {rec['diffusers']}; "
           "model loading excluded from every wall time", ""]
    out += [f"![{name.replace('_', ' ')}]({file})" for name, file in (charts or {}).items()]
    out += [""] if charts else []
    names = NAMES
    rows = [k for k in names if k in rec]
    if rows:
        out += ["| contender | wall s | images/s | vs (a) | peak GPU MB |", "|---|---:|---:|---:|---:|"]
        base = rec.get("a_diffusers", {}).get("images_per_s") or float("nan")
        for k in rows:
            r = rec[k]
            peak = f"{r['peak_mb']:.0f}" if r.get("peak_mb") else "-"
            out.append(f"| {names[k]} | {r['wall_s']:.2f} | {r['images_per_s']:.3f} | "
                       f"{r['images_per_s'] / base:.2f}x | {peak} |")
        out.append("")
        out += ["Mean denoise ms per step, per bucket (diffusers: per call, `images x W x H`; bcg: per bucket):", ""]
        for k in rows:
            steps = rec[k].get("ms_per_step") or {}
            if steps:
                out.append(f"- {names[k]}: " + ", ".join(f"{b} {ms:.1f}" for b, ms in steps.items()))
        out.append("")
    if "lora" in rec:
        lo, sw = rec["lora"], rec["lora"]["swaps"] or {}
        out += [f"LoRA job (3 rank-32 LoRAs over the shots, plain graphs, each render cold): "
                f"{lo['with']['images_per_s']:.3f} images/s against {lo['without']['images_per_s']:.3f} without "
                f"= **{lo['ratio']:.3f}x**; {sw.get('swaps', 0)} swaps, median {sw.get('median_s', float('nan')):.3f} s, "
                f"{sw.get('total_s', float('nan')):.2f} s in all", ""]
    if "single_shot" in rec:
        s = rec["single_shot"]
        out += [f"Single-shot re-render ({s['shape']}, {s['steps']} steps, denoise + decode, median of 3): "
                f"diffusers {s['diffusers_s']:.3f} s, bcg eager {s['bcg_eager_s']:.3f} s, "
                f"bcg graph {s.get('bcg_graph_s', float('nan')):.3f} s "
                f"({s.get('speedup_vs_diffusers', float('nan')):.2f}x); first render with capture "
                f"{s.get('bcg_graph_first_s', float('nan')):.3f} s", ""]
    for key in ("step_curve", "step_curve_control", "step_curve_compiled", "step_curve_control_compiled"):
        if key in rec:
            out += [f"Step microbenchmark ({key.replace('_', ' ')}), matmul rate {rec['matmul_tflops']:.0f} TFLOP/s:",
                    "", "| shape | eager ms | graph ms | speedup | graph ms/image | TFLOP/step | share of matmul rate |",
                    "|---|---:|---:|---:|---:|---:|---:|"]
            for r in rec[key]:
                f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
                out.append(f"| {r['shape']} | {f(r['eager_ms'], '.1f')} | {f(r['graph_ms'], '.1f')} | "
                           f"{f(r['speedup'], '.2f')}x | {f(r['graph_ms_per_image'], '.1f')} | "
                           f"{r['tflop_per_step']:.2f} | {f(r['matmul_share'] and 100 * r['matmul_share'], '.0f')}% |")
            out.append("")
    if "first_render" in rec:
        f = rec["first_render"]
        out += [f"First render on a cache without the job's kernels: `--compile auto` {f['auto']['images_per_s']:.3f} "
                f"images/s, `--compile off` {f['off']['images_per_s']:.3f} = **{f['ratio']:.3f}x** "
                f"(kernels in the cache before: {', '.join(f['cached_before']) or 'none'})", ""]
    out += _draft_markdown(rec)
    if "b_slice" in rec:
        b = rec["b_slice"]
        out += [f"Slice {', '.join(b['shots'])} ({b['images']} images), side by side: (a) diffusers "
                f"{b['a']['images_per_s']:.3f} images/s, (b) + regional torch.compile steady "
                f"{b['b_steady']['images_per_s']:.3f} (first pass {b['b_first']['images_per_s']:.3f}, compile about "
                f"{b['b_compile_s']:.0f} s), (e) bcg compiled {b['e']['images_per_s']:.3f}: (e) = "
                f"**{b['e_vs_a']:.2f}x (a)**, **{b['e_vs_b']:.2f}x (b)**", ""]
    if "profile" in rec:
        pr = rec["profile"]
        out += [f"Compiled against plain, relative error: noise prediction {pr['rel_err_eps']:.1e}, denoised at "
                f"guidance 1 {pr['rel_err_denoised_g1']:.1e}, at guidance 5 {pr['rel_err_denoised_g5']:.1e}", "",
                f"Top kernels of one step, {pr['shape']} (ms per step):", "", "| plain | ms | compiled | ms |",
                "|---|---:|---|---:|"]
        for x, y in zip(pr["plain"], pr["compiled"]):
            out.append(f"| `{x['kernel'][:60]}` | {x['ms_per_step']:.2f} | `{y['kernel'][:60]}` | {y['ms_per_step']:.2f} |")
        out.append("")
    if rec.get("errors"):
        out += ["Parts that failed:", ""] + [f"- {k}: {v}" for k, v in rec["errors"].items()] + [""]
    return "\n".join(out) + "\n"
