"""The contenders of `bcg bench`: the diffusers loop users write (and its torch.compile slice), bcg's render
cold and after capture, the single-shot re-render, the first render on an empty kernel cache, and the LoRA job."""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.bench.fp8 import fp8_ready
from storyboard_cli.engine.base import shape_label
from storyboard_cli.engine.build import graph_runner
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.kernels.artifacts import artifact_path, module_of, targets
from storyboard_cli.engine.variants import AUTO, FP8, choose
from storyboard_cli.job.file import Job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.models.groupnorm import narrow
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.models.vae_attention import unattend
from storyboard_cli.run.batch import BatchRunner, batch_shapes, decode
from storyboard_cli.run.capture import time_shapes
from storyboard_cli.samplers import SAMPLERS


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
        # users load SDXL's VAE in the pipeline's dtype (the pipeline upcasts it around each decode), with torch's
        # GroupNorm and attention (bcg's decoder runs its own on a GPU: models/groupnorm.py, models/vae_attention.py)
        vae = copy.deepcopy(m.vae).to(m.dtype)
        narrow(vae)
        unattend(vae)
        # the very modules bcg runs: neither side changes a weight or a memory layout
        parts = dict(vae=vae, text_encoder=m.text_encoders[0], text_encoder_2=m.text_encoders[1],
                     tokenizer=m.tokenizers[0], tokenizer_2=m.tokenizers[1], unet=m.unet,
                     scheduler=diffusers.EulerDiscreteScheduler.from_config(m.scheduler_config))
        self.parts = parts  # the refine part builds the inpainting pipeline on the same modules
        self.pipe = diffusers.StableDiffusionXLPipeline(**parts)
        self.pipe.set_progress_bar_config(disable=True)
        self.cpipe = None
        if m.controlnets:  # the bench job's one net
            self.cpipe = diffusers.StableDiffusionXLControlNetPipeline(**parts, controlnet=m.controlnets[0])
            self.cpipe.set_progress_bar_config(disable=True)

    def compile_unet(self) -> None:
        """diffusers' documented speed-up."""
        compiled = torch.compile(self.models.unet, mode="reduce-overhead")  # wraps it: bcg's module is untouched
        self.pipe.unet = compiled
        if self.cpipe is not None:
            self.cpipe.unet = compiled

    def shot(self, shot, output_type: str = "pil", step_events: list | None = None):
        from PIL import Image

        pipe = self.cpipe if shot.controls else self.pipe
        pipe.scheduler = getattr(self.diffusers, SAMPLERS[shot.sampler].scheduler).from_config(self.models.scheduler_config)
        kwargs = {}
        if shot.controls:
            guide = shot.controls[0]
            kwargs = dict(image=Image.open(guide.image).convert("RGB"), controlnet_conditioning_scale=guide.scale)
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
                label = shape_label(shot.candidates, shot.width, shot.height, bool(shot.controls))
                per_bucket.setdefault(label, []).append(ms)
        _sync(device)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "images": images, "images_per_s": images / wall, "peak_mb": _peak_mb(device),
                "ms_per_step": {k: round(statistics.mean(v), 2) for k, v in sorted(per_bucket.items())}}


# ---------------------------------------------------------------- (c)/(d): bcg


def bcg_render(job: Job, models: SdxlModels, out_dir: Path, engine=None, compile: str = "off",
               kernels: str = AUTO) -> dict:
    from storyboard_cli.run.render import RenderOptions, render

    _peak_reset(models.device)
    result = render(job, RenderOptions(out_dir=out_dir, force=True, compile=compile, kernels=kernels), models=models,
                    engine=engine)
    r = result.report
    return {"wall_s": result.wall_s, "images": result.rendered, "failed": len(result.failed),
            "failure": result.failed[0]["reason"] if result.failed else None,
            "images_per_s": result.rendered / result.wall_s,
            "peak_mb": _peak_mb(models.device), "engine": result.engine, "stages_s": r.stages_s,
            "hidden_s": r.hidden_s, "outside_denoise_s": round(result.wall_s - r.stages_s["denoise"], 4),
            "ms_per_step": {b["bucket"]: b["ms_per_step"] for b in r.buckets},
            "waited_s": {b["bucket"]: b["waited_s"] for b in r.buckets}, "graphs": r.graphs,
            "lora": r.lora, "notes": r.notes}


def warm_runner(job: Job, models: SdxlModels):
    """What `bcg capture --warm` does for this job: every shape captured and checked."""
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    t0 = time.perf_counter()
    runner = graph_runner(models, shapes, compile="off")
    time_shapes(models, runner, shapes, steps=2, repeats=1, eager=False)
    return runner, time.perf_counter() - t0


def single_shot(models: SdxlModels, loop: DiffusersLoop, job: Job, log: Callable[[str], None],
                repeats: int = 3) -> dict:
    """The artist's edit-and-rerender loop: 1 image, model loaded; denoise + decode, median of `repeats`."""
    shot = next(s for s in job.shots if not s.controls)
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


def first_render(job: Job, models: SdxlModels, log: Callable[[str], None], kernels: str = AUTO) -> dict:
    """The first render of a job with `--compile auto` (with `--kernels fp8`: its FP8 kernels and scales) on a cache
    without its kernels (they compile in the background while the plain graphs render) against the same render
    with `--compile off`, side by side on the same models; off first, so the builds' CPU load cannot slow it."""
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    cached = [t.label for t in targets(shapes, bool(models.controlnets), choose(kernels, "graph", "auto",
                                                                                     models.device))
              if artifact_path(t, module_of(models, t.module)).is_file()]
    with tempfile.TemporaryDirectory() as tmp:
        off = bcg_render(job, models, Path(tmp) / "off", compile="off")
        auto = bcg_render(job, models, Path(tmp) / "auto", compile="auto", kernels=kernels)
    rec = {"cached_before": cached, "off": off, "auto": auto, "ratio": auto["images_per_s"] / off["images_per_s"],
           "fp8": kernels == FP8}
    asked = f" --kernels {kernels}" if kernels != AUTO else ""
    log(f"first render: auto{asked} {auto['images_per_s']:.3f} images/s, off "
        f"{off['images_per_s']:.3f} = {rec['ratio']:.3f}x (artifacts in the cache before: {cached or 'none'})")
    return rec


def compile_slice(job: Job, models: SdxlModels, loop: DiffusersLoop, log: Callable[[str], None]) -> dict:
    """(b) the diffusers loop with diffusers' regional torch.compile (`compile_repeated_blocks`: each
    BasicTransformerBlock compiled once and reused) on the job's shots at its most common size, side by
    side with (a) and with (e) bcg on its compiled kernels, on that slice (and (f), bcg --kernels fp8, on a GPU with
    FP8).
    Run last: it compiles the shared UNet's blocks (undone at the end)."""
    sizes = [(s.width, s.height) for s in job.shots]
    size = max(set(sizes), key=sizes.count)
    part = replace(job, shots=tuple(s for s in job.shots if (s.width, s.height) == size))
    torch._dynamo.config.recompile_limit = 64  # every block class x row count, until shapes turn dynamic
    with tempfile.TemporaryDirectory() as tmp:
        e = bcg_render(part, models, Path(tmp) / "e", compile="auto")
        f = (bcg_render(part, models, Path(tmp) / "f", compile="auto", kernels=FP8) if fp8_ready(models.device)
             else None)
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
    if f is not None:
        rec.update(f=f, f_vs_b=f["images_per_s"] / steady["images_per_s"], f_vs_a=f["images_per_s"] / a["images_per_s"])
    log(f"slice {size[0]}x{size[1]} ({rec['images']} images): (e) {rec['e_vs_a']:.2f}x (a), (b) steady "
        f"{rec['b_vs_a']:.2f}x (a), (e) {rec['e_vs_b']:.2f}x (b); (b) compile {rec['b_compile_s']:.0f} s"
        + (f"; (f) --fp8 {rec['f_vs_a']:.2f}x (a), {rec['f_vs_b']:.2f}x (b)" if f is not None else ""))
    return rec


# ---------------------------------------------------------------- LoRA


def lora_job(job: Job, models: SdxlModels, folder: Path, count: int = 3, rank: int = 32) -> Job:
    """The bench job with `count` synthetic LoRAs (UNet + both text encoders, `rank`, fp16, Kohya layout)
    given to its shots in turn, at 0.8: a job that swaps weights between its LoRA sets."""
    from storyboard_cli.job.file import LoraFile
    from storyboard_cli.models.lora import inspect_lora
    from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya

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
        plain = bcg_render(job, models, Path(tmp) / "plain")
        loras = bcg_render(with_loras, models, Path(tmp) / "loras")
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
