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
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.errors import BadInput
from storyboard_cli.job import Job, load_job
from storyboard_cli.models.loader import SdxlModels, load_sdxl
from storyboard_cli.plan import make_batches, work_items

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "dpmpp_2m": "DPMSolverMultistepScheduler"}


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
        # own copies of the same weights: bcg changes its modules' memory layout in place
        self.unet = copy.deepcopy(m.unet)
        controlnet = copy.deepcopy(m.controlnet) if m.controlnet is not None else None
        parts = dict(vae=vae, text_encoder=m.text_encoders[0], text_encoder_2=m.text_encoders[1],
                     tokenizer=m.tokenizers[0], tokenizer_2=m.tokenizers[1], unet=self.unet,
                     scheduler=diffusers.EulerDiscreteScheduler.from_config(m.scheduler_config))
        self.pipe = diffusers.StableDiffusionXLPipeline(**parts)
        self.pipe.set_progress_bar_config(disable=True)
        self.cpipe = None
        if m.controlnet is not None:
            self.cpipe = diffusers.StableDiffusionXLControlNetPipeline(**parts, controlnet=controlnet)
            self.cpipe.set_progress_bar_config(disable=True)

    def compile_unet(self) -> None:
        """diffusers' documented speed-up."""
        compiled = torch.compile(self.unet, mode="reduce-overhead")
        self.pipe.unet = compiled
        if self.cpipe is not None:
            self.cpipe.unet = compiled

    def shot(self, shot, output_type: str = "pil", step_events: list | None = None):
        from PIL import Image

        pipe = self.cpipe if shot.control else self.pipe
        pipe.scheduler = getattr(self.diffusers, SCHEDULERS[shot.sampler]).from_config(self.models.scheduler_config)
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
                label = f"{shot.candidates}x{shot.width}x{shot.height}{' +control' if shot.control else ''}"
                per_bucket.setdefault(label, []).append(ms)
        _sync(device)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "images": images, "images_per_s": images / wall, "peak_mb": _peak_mb(device),
                "ms_per_step": {k: round(statistics.mean(v), 2) for k, v in sorted(per_bucket.items())}}


# ---------------------------------------------------------------- (c)/(d): bcg


def _bcg(job: Job, models: SdxlModels, out_dir: Path, engine=None) -> dict:
    from storyboard_cli.render import RenderOptions, render

    _peak_reset(models.device)
    result = render(job, RenderOptions(out_dir=out_dir, force=True), models=models, engine=engine)
    r = result.report
    return {"wall_s": result.wall_s, "images": result.rendered, "images_per_s": result.rendered / result.wall_s,
            "peak_mb": _peak_mb(models.device), "engine": result.engine, "stages_s": r["stages_s"],
            "ms_per_step": {b["bucket"]: b["ms_per_step"] for b in r["buckets"]}, "graphs": r["graphs"]}


def _warm_runner(job: Job, models: SdxlModels):
    """What `bcg capture --warm` does for this job: every shape captured and checked."""
    from storyboard_cli.render import batch_shapes, graph_runner, time_shapes

    runner, keys = graph_runner(models, batch_shapes(make_batches(work_items(job), job.buckets)))
    t0 = time.perf_counter()
    time_shapes(models, runner, keys, steps=2, repeats=1, eager=False)
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

    from storyboard_cli.engine.eager import denoise
    from storyboard_cli.render import synthetic_inputs

    x, cond, ctl, guidance = synthetic_inputs(models, batch, width, height, control)
    one = torch.ones((), device=models.device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        denoise(models, x, one, one * 500, cond, ctl, guidance)
    return float(counter.get_total_flops())


def step_curve(models: SdxlModels, batches: tuple[int, ...], width: int, height: int, control: bool,
               matmul_rate: float, log: Callable[[str], None]) -> list[dict]:
    """Eager vs graph ms/step per batch size, FLOPs per step and the share of the matmul rate reached."""
    from storyboard_cli.engine.graphs import GraphRunner
    from storyboard_cli.render import time_shapes

    runner = GraphRunner(models, max_batch=max(batches), max_hw=(height, width))
    keys = [runner.shape_key(b, height, width, control) for b in batches]
    rows = []
    for t in sorted(time_shapes(models, runner, keys, steps=10, repeats=3), key=lambda t: t.shape):
        b = int(t.shape.split("x")[0])
        flops = step_flops(models, b, width, height, control)
        row = {"shape": t.shape, "batch": b, "eager_ms": t.eager_ms, "graph_ms": t.graph_ms,
               "speedup": t.speedup, "graph_ms_per_image": t.graph_ms / b if t.graph_ms else None,
               "tflop_per_step": flops / 1e12, "capture_s": t.capture_s, "pool_mb": t.pool_mb,
               "matmul_share": (flops / (t.graph_ms / 1000) / 1e12 / matmul_rate) if t.graph_ms else None}
        rows.append(row)
        log(json.dumps(row))
    return sorted(rows, key=lambda r: r["batch"])


def single_shot(models: SdxlModels, loop: DiffusersLoop, job: Job, log: Callable[[str], None],
                repeats: int = 3) -> dict:
    """The artist's edit-and-rerender loop: 1 image, model loaded; denoise + decode, median of `repeats`."""
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graphs import GraphRunner
    from storyboard_cli.render import Renderer, decode
    from storyboard_cli.report import Timings

    shot = next(s for s in job.shots if not s.control)
    shot = replace(shot, candidates=1)
    one = replace(job, shots=(shot,))
    item = work_items(one)[0]
    batch = make_batches([item], (1,))[0]

    def bcg_once(engine) -> float:
        r = Renderer(one, models, engine, Path("."), Timings(), lambda e: None, None)
        _sync(models.device)
        t0 = time.perf_counter()
        ((_, latents),) = r.run_batch(batch)
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
        runner = GraphRunner(models, max_batch=1, max_hw=(shot.height, shot.width))
        out["bcg_graph_first_s"] = bcg_once(runner)  # includes capture + the replay check
        out["bcg_graph_s"] = statistics.median(bcg_once(runner) for _ in range(repeats))
        out["speedup_vs_diffusers"] = out["diffusers_s"] / out["bcg_graph_s"]
        out["speedup_first_vs_diffusers"] = out["diffusers_s"] / out["bcg_graph_first_s"]
    log(json.dumps(out))
    return out


def layout_variants(models: SdxlModels, log: Callable[[str], None]) -> list[dict]:
    """Graph ms/step at 1024x1024 for UNet layout variants (run last: it changes the loaded UNet)."""
    from storyboard_cli.engine.graphs import GraphRunner
    from storyboard_cli.render import time_shapes

    def cudnn_benchmark(u):
        torch.backends.cudnn.benchmark = True

    rows = []
    for name, change in (("baseline", lambda u: None), ("cudnn.benchmark", cudnn_benchmark),
                         ("cudnn.benchmark + fused QKV", lambda u: u.fuse_qkv_projections())):
        change(models.unet)
        runner = GraphRunner(models, max_batch=4, max_hw=(1024, 1024), channels_last=False)
        keys = [runner.shape_key(b, 1024, 1024, False) for b in (1, 4)]
        for t in time_shapes(models, runner, keys, steps=10, repeats=3, eager=False):
            rows.append({"variant": name, "shape": t.shape, "graph_ms": t.graph_ms, "state": t.state,
                         "reason": t.reason})
            log(json.dumps(rows[-1]))
    return rows


# ---------------------------------------------------------------- the harness


def run(job_path: Path, model: str | None = None, quick: bool = False, parts: tuple[str, ...] = ("job", "micro"),
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
    rec: dict = {"date": date.today().isoformat(), "device": _device_name(device), "dtype": str(dtype)[6:],
                 "torch": torch.__version__, "python": platform.python_version(), "job": str(job_path),
                 "model": job.model, "quick": quick, "load_s": time.perf_counter() - t0,
                 "images": sum(s.candidates for s in job.shots)}
    import diffusers

    rec["diffusers"] = diffusers.__version__
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{rec['date']}-{_slug(rec['device'])}{'-quick' if quick else ''}"

    def save() -> None:
        data = {k: v for k, v in rec.items() if not k.startswith("_")}
        (results_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
        (results_dir / f"{stem}.md").write_text(markdown(data))

    rec["_save"] = save
    loop = DiffusersLoop(models)
    log(f"loaded {job.model} on {rec['device']} in {rec['load_s']:.1f} s")
    if device.type == "cuda":
        rec["matmul_tflops"] = matmul_tflops(device, dtype)
        log(f"fp16 matmul rate: {rec['matmul_tflops']:.0f} TFLOP/s")
    # warm-up outside every contender: CUDA context, cuDNN/cuBLAS handles, first-call lazy inits
    loop.shot(replace(job.shots[0], candidates=1, steps=2), output_type="latent")
    with tempfile.TemporaryDirectory() as tmp:
        if "job" in parts:
            _part(rec, "a_diffusers", log, lambda: loop.run_job(job, Path(tmp) / "a"))
            _part(rec, "c_bcg_cold", log, lambda: _bcg(job, models, Path(tmp) / "c"))
            if device.type == "cuda":
                def warm():
                    runner, warm_s = _warm_runner(job, models)
                    return _bcg(job, models, Path(tmp) / "d", engine=runner) | {"capture_warm_s": warm_s}
                _part(rec, "d_bcg_warm", log, warm)
            if with_compile:
                loop.compile_unet()
                _part(rec, "b_compile_first", log, lambda: loop.run_job(job, Path(tmp) / "b1"))
                _part(rec, "b_compile_steady", log, lambda: loop.run_job(job, Path(tmp) / "b2"))
            for k in ("a_diffusers", "c_bcg_cold", "d_bcg_warm", "b_compile_first", "b_compile_steady"):
                if k in rec:
                    log(f"{k}: {json.dumps(rec[k])}")
            base = rec["a_diffusers"]["images_per_s"] if "a_diffusers" in rec else float("nan")
            rec["ratios_vs_a"] = {k: rec[k]["images_per_s"] / base for k in
                                  ("c_bcg_cold", "d_bcg_warm", "b_compile_first", "b_compile_steady") if k in rec}
            if "b_compile_first" in rec and "d_bcg_warm" in rec:
                rec["d_vs_b_first"] = rec["d_bcg_warm"]["images_per_s"] / rec["b_compile_first"]["images_per_s"]
                rec["d_vs_b_steady"] = rec["d_bcg_warm"]["images_per_s"] / rec["b_compile_steady"]["images_per_s"]
    if "micro" in parts and device.type == "cuda":
        _part(rec, "step_curve", log, lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False,
                                                         rec["matmul_tflops"], log))
        if models.controlnet is not None:
            _part(rec, "step_curve_control", log, lambda: step_curve(models, (1, 2), 1024, 1024, True,
                                                                     rec["matmul_tflops"], log))
        _part(rec, "single_shot", log, lambda: single_shot(models, loop, job, log))
    if "variants" in parts and device.type == "cuda":
        _part(rec, "variants", log, lambda: layout_variants(models, log))
    save()
    del rec["_save"]
    rec["written"] = [str(results_dir / f"{stem}.json"), str(results_dir / f"{stem}.md")]
    return rec


def _part(rec: dict, key: str, log: Callable[[str], None], fn: Callable[[], object]) -> None:
    """Runs one measurement; a failure is recorded with its reason and the others still run.
    The record is written after each part, so a run cut short keeps what it measured."""
    try:
        rec[key] = fn()
        if "_save" in rec:
            rec["_save"]()
        gc.collect()  # drop the part's graphs and pools before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a broken contender must not hide the other results
        rec.setdefault("errors", {})[key] = f"{e.__class__.__name__}: {e}"
        log(f"{key} failed: {traceback.format_exc()}")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def markdown(rec: dict) -> str:
    out = [f"# bcg bench: {rec['job']} on {rec['device']} ({rec['dtype']}), {rec['date']}", "",
           f"model `{rec['model']}`, {rec['images']} images, torch {rec['torch']}, diffusers {rec['diffusers']}; "
           "model loading excluded from every wall time", ""]
    names = {"a_diffusers": "(a) diffusers pipeline loop", "b_compile_first": "(b) + torch.compile, first pass",
             "b_compile_steady": "(b) + torch.compile, steady state", "c_bcg_cold": "(c) bcg render, cold",
             "d_bcg_warm": "(d) bcg render after capture --warm"}
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
    if "single_shot" in rec:
        s = rec["single_shot"]
        out += [f"Single-shot re-render ({s['shape']}, {s['steps']} steps, denoise + decode, median of 3): "
                f"diffusers {s['diffusers_s']:.3f} s, bcg eager {s['bcg_eager_s']:.3f} s, "
                f"bcg graph {s.get('bcg_graph_s', float('nan')):.3f} s "
                f"({s.get('speedup_vs_diffusers', float('nan')):.2f}x); first render with capture "
                f"{s.get('bcg_graph_first_s', float('nan')):.3f} s", ""]
    for key in ("step_curve", "step_curve_control"):
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
    if rec.get("variants"):
        out += ["Engine variants (graph ms/step, 1024x1024, applied cumulatively):", "",
                "| variant | shape | graph ms | state |", "|---|---|---:|---|"]
        out += [f"| {v['variant']} | {v['shape']} | {v['graph_ms'] or float('nan'):.1f} | {v['state']} |"
                for v in rec["variants"]]
        out.append("")
    if rec.get("errors"):
        out += ["Parts that failed:", ""] + [f"- {k}: {v}" for k, v in rec["errors"].items()] + [""]
    return "\n".join(out) + "\n"
