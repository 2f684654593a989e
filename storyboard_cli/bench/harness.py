"""`make bench`: the same job through the plain diffusers loop, diffusers + torch.compile, and bcg,
in one process, one run, with the same weights, dtype and seeds. Ratios, not absolute claims.

Model loading is done once and excluded from every contender's wall time; everything after it
(graph capture for bcg, compilation for torch.compile) is counted.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.bench.contenders import (DiffusersLoop, bcg_render, compile_slice, first_render, lora_part,
                                             single_shot, warm_runner)
from storyboard_cli.bench.draft import draft_capture, draft_job, draft_steps
from storyboard_cli.bench.fp8 import fp8_ready, image_drift, step_drift
from storyboard_cli.bench.refine import refine_part
from storyboard_cli.bench.report import NAMES, markdown
from storyboard_cli.bench.source import source_steps
from storyboard_cli.bench.steps import kernel_profile, launch_us, matmul_tflops, step_curve
from storyboard_cli.cuda_env import LAUNCH_QUEUES_ENV
from storyboard_cli.engine.device import device_name, dtype_name
from storyboard_cli.engine.variants import FP8
from storyboard_cli.errors import BadInput
from storyboard_cli.job.file import Job, load_job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.models.loader import SdxlModels, cuda_allocator, load_sdxl

CONTENDERS = ("a_diffusers", "c_bcg_cold", "d_bcg_warm", "e_bcg_compiled", "f_bcg_fp8")


def quick_job(job: Job) -> Job:
    """The bench job at 1/8 of its size and 4 steps: a CPU smoke run of the whole harness."""
    shots = tuple(replace(s, width=max(64, s.width // 8 // 8 * 8), height=max(64, s.height // 8 // 8 * 8),
                          steps=4, controls=tuple(replace(c, model="tiny") for c in s.controls))
                  for s in job.shots[:8])
    return replace(job, model="tiny", controlnets=tuple((name, "tiny") for name, _ in job.controlnets), shots=shots)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


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
        with_compile: bool = False, results_dir: Path = Path("benchmarks/runs"),
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
    models = load_sdxl(job.model, tuple(spec for _, spec in job.controlnets), device, dtype)
    import diffusers

    rec: dict = {"date": date.today().isoformat(), "device": device_name(device), "dtype": dtype_name(dtype),
                 "torch": torch.__version__, "diffusers": diffusers.__version__,
                 "python": platform.python_version(), "job": str(job_path), "model": job.model, "quick": quick,
                 "load_s": time.perf_counter() - t0, "images": sum(s.candidates for s in job.shots)}
    results_dir.mkdir(parents=True, exist_ok=True)
    results = Results(results_dir, f"{rec['date']}-{_slug(rec['device'])}{'-quick' if quick else ''}")
    loop = DiffusersLoop(models)
    log(f"loaded {job.model} on {rec['device']} in {rec['load_s']:.1f} s")
    rec["launch_us"] = launch_us(device)  # the host's pace, which the plain loop's small batches follow
    log(f"host: {rec['launch_us']:.1f} us per small op")
    if device.type == "cuda":
        rec["cuda_allocator"] = cuda_allocator()  # what load_sdxl set, or the user's PYTORCH_CUDA_ALLOC_CONF
        rec["launch_queues"] = os.environ.get(LAUNCH_QUEUES_ENV, "default")  # bcg's main set it, or the user did
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
        if models.controlnets:
            part("step_curve_control",
                 lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"], log))
        part("single_shot", lambda: single_shot(models, loop, job, log))
    if "lora" in parts:
        part("lora", lambda: lora_part(job, models, log))
    if "curves" in parts and device.type == "cuda":  # plain against compiled graphs, side by side, no eager
        for key, compile in (("step_curve", "off"), ("step_curve_compiled", "on")):
            part(key, lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"], log,
                                         compile, eager=False))
            if models.controlnets:
                part(key.replace("curve", "curve_control"),
                     lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"], log, compile,
                                        eager=False))
    if "fp8" in parts and fp8_ready(device):  # FP8 against fp16 compiled: step curves, drift per step
        part("step_curve_fp8", lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"], log,
                                                  "on", eager=False, kernels=FP8))
        part("step_curve_compiled", lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"],
                                                       log, "on", eager=False))
        if models.controlnets:
            part("step_curve_control_fp8", lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"],
                                                              log, "on", eager=False, kernels=FP8))
        part("fp8_steps", lambda: step_drift(models, log))
    if "micro_compiled" in parts and device.type == "cuda":  # the kernels built first if the cache lacks them
        part("step_curve_compiled",
             lambda: step_curve(models, (1, 2, 4, 8), 1024, 1024, False, rec["matmul_tflops"], log, "on"))
        if models.controlnets:
            part("step_curve_control_compiled",
                 lambda: step_curve(models, (1, 2), 1024, 1024, True, rec["matmul_tflops"], log, "on"))
    if "draft" in parts:  # draft mode's levers: step times, the bench job with --draft, capture, drift
        part("draft_steps", lambda: draft_steps(models, log, *((8, 1024, 30) if device.type == "cuda" else (2, 64, 6))))
        part("draft_job", lambda: draft_job(job, models, log))
        part("draft_capture", lambda: draft_capture(job, models, log))
    elif "draft_capture" in parts:  # the capture part alone
        part("draft_capture", lambda: draft_capture(job, models, log))
    if "refine" in parts:  # bcg refine against diffusers' inpainting loop; the hires pass per pick
        part("refine", lambda: refine_part(models, job.model, log))
    if "source" in parts:  # text-to-image against img2img and inpainting steps, compiled, side by side
        part("source_steps", lambda: source_steps(models, log, *((8, 1024, 30) if device.type == "cuda" else (2, 64, 6)),
                                                  compile="on" if device.type == "cuda" else "off"))
    if "first_render" in parts and device.type == "cuda":
        part("first_render", lambda: first_render(job, models, log))
    if "first_render_fp8" in parts and fp8_ready(device):
        part("first_render_fp8", lambda: first_render(job, models, log, kernels=FP8))
    if "profile" in parts and device.type == "cuda":
        part("profile", lambda: kernel_profile(models, log))
    if "b_slice" in parts and device.type == "cuda":
        part("b_slice", lambda: compile_slice(job, models, loop, log))
    results.save(rec)
    rec["written"] = [str(p) for p in results.paths]
    return rec


def _job_parts(job: Job, models: SdxlModels, loop: DiffusersLoop, with_compile: bool,
               part: Callable[[str, Callable[[], object]], None], contenders: set[str]) -> None:
    """(a) diffusers, (c) bcg cold, (d) bcg after capture, (e) bcg with the compiled kernels from the
    cache (a new render: loading them, checking and capturing is counted), (b) diffusers +
    torch.compile, in that order."""
    cuda = models.device.type == "cuda"
    # `bcg plan`'s estimate of (e) and (f), from the cost table before any render here adds to it (docs/PERFORMANCE.md
    # compares it with their walls)
    est = {kernels: estimated(job, models.device, kernels) for kernels in ("compiled", FP8)}
    with tempfile.TemporaryDirectory() as tmp:
        if "a_diffusers" in contenders:
            part("a_diffusers", lambda: loop.run_job(job, Path(tmp) / "a"))
        if "c_bcg_cold" in contenders:
            part("c_bcg_cold", lambda: bcg_render(job, models, Path(tmp) / "c"))
        if cuda and "d_bcg_warm" in contenders:
            def warm():
                runner, warm_s = warm_runner(job, models)
                return bcg_render(job, models, Path(tmp) / "d", engine=runner) | {"capture_warm_s": warm_s}
            part("d_bcg_warm", warm)
        if cuda and "e_bcg_compiled" in contenders:
            part("e_bcg_compiled", lambda: against(bcg_render(job, models, Path(tmp) / "e", compile="auto"),
                                                   est["compiled"]))
        if "f_bcg_fp8" in contenders and fp8_ready(models.device):  # (e) with the UNet's FP8 kernels
            part("f_bcg_fp8", lambda: against(bcg_render(job, models, Path(tmp) / "f", compile="auto", kernels=FP8),
                                              est[FP8]))
            if (Path(tmp) / "e").is_dir():  # the pictures against (e)'s, same seeds
                part("fp8_images", lambda: image_drift(Path(tmp) / "f", Path(tmp) / "e"))
        if with_compile:
            loop.compile_unet()
            part("b_compile_first", lambda: loop.run_job(job, Path(tmp) / "b1"))
            part("b_compile_steady", lambda: loop.run_job(job, Path(tmp) / "b2"))


def estimated(job: Job, device, kernels: str) -> dict:
    """`bcg plan JOB --gpus 1 --kernels KERNELS --json`'s estimate on this machine's cost table."""
    from storyboard_cli.costs import device_of
    from storyboard_cli.engine.build import device_name
    from storyboard_cli.job.estimate import adapted, estimate

    batches = make_batches(work_items(job), job.buckets)
    return estimate(batches, job.model, device_of(device_name(device)), kernels, 1, adapted(job)).to_json()


def against(result: dict, est: dict) -> dict:
    """A render's record with the estimate made before it: the batches and each shape's graphs (the bench loads the
    weights once, outside every contender's wall) over the wall."""
    if est["seconds"] is None:
        return result | {"estimate": est}
    ratio = (est["seconds"] + est["prepare_s"]) / result["wall_s"]
    return result | {"estimate": est, "estimate_ratio": round(ratio, 4)}


def _ratios(rec: dict, log: Callable[[str], None]) -> None:
    ours = ("c_bcg_cold", "d_bcg_warm", "e_bcg_compiled", "f_bcg_fp8")
    for k in ("a_diffusers", *ours, "b_compile_first", "b_compile_steady"):
        if k in rec:
            log(f"{k}: {json.dumps(rec[k])}")
    base = rec["a_diffusers"]["images_per_s"] if "a_diffusers" in rec else float("nan")
    rec["ratios_vs_a"] = {k: rec[k]["images_per_s"] / base for k in
                          (*ours, "b_compile_first", "b_compile_steady") if k in rec}
    if "e_bcg_compiled" in rec and "f_bcg_fp8" in rec:
        rec["f_vs_e"] = rec["f_bcg_fp8"]["images_per_s"] / rec["e_bcg_compiled"]["images_per_s"]
    for k in ("d_bcg_warm", "e_bcg_compiled", "f_bcg_fp8"):
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
