"""`bcg bench`'s refine part: `bcg refine` of picks (a cropped inpainting each, diffusers' `padding_mask_crop`)
against diffusers' StableDiffusionXLInpaintPipeline loop on the same work, and a hires pass's seconds per pick once
its size is built. A GPU run measures the issue's numbers (8 picks at 1024x1024, strength 0.5 of 30 steps; a 1.5x
pass at strength 0.35 of 12 steps); `--quick` runs the same code small on the CPU."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.bench.contenders import DiffusersLoop, _peak_mb, _peak_reset, _sync
from storyboard_cli.job.file import load_job
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.run.refine import refine
from storyboard_cli.run.render import RenderOptions, RenderSession

PROMPT = "a lighthouse keeper on the stairs, lantern light, ink and watercolor"
FIX = "the keeper's hand holding the lantern, detailed fingers"


def sizes(cuda: bool) -> dict:
    """The part's work: the issue's on a GPU, the same shapes small on the CPU."""
    return dict(side=1024, steps=30, picks=8, strength=0.5, padding=32, hires_steps=12, hires_strength=0.35) \
        if cuda else dict(side=64, steps=6, picks=2, strength=0.5, padding=8, hires_steps=6, hires_strength=0.5)


def _job(folder: Path, model: str, side: int, steps: int, picks: int, hires: str = "") -> Path:
    path = folder / "job.yaml"
    path.write_text(f"version: 1\nmodel: {model}\nbuckets: [1, 2, 4, 8]\nshots:\n  - id: pick\n    prompt: {PROMPT}\n"
                    f"    size: {side}x{side}\n    steps: {steps}\n    seed: 11\n    candidates: {picks}\n{hires}")
    return path


def refine_part(models: SdxlModels, model: str, log: Callable[[str], None]) -> dict:
    """Picks rendered once (not timed), then their refinements by `bcg refine` (a fresh engine: capture counted) and
    by diffusers' inpainting pipeline, one call per pick as users write it (same sources, masks, strength, steps,
    seeds); then the hires pass alone, per pick, once its graphs exist."""
    cuda = models.device.type == "cuda"
    w = sizes(cuda)
    side, picks = w["side"], w["picks"]
    box = [side // 4, side // 4, side // 4, side // 4]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        out = tmp / "picks"
        done = RenderSession(load_job(_job(tmp, model, side, w["steps"], picks)), RenderOptions(out_dir=out),
                             models=models).execute()
        sources = sorted(p for p in (out / "pick").glob("pick_c*_s*.png"))
        assert done.status == "done" and len(sources) == picks, done.failed
        refines = tmp / "refines.yaml"
        refines.write_text("refine:\n" + "".join(
            f"  - shot: pick\n    candidate: pick/{p.name}\n    name: hand\n    prompt: {FIX}\n"
            f"    mask: {{box: {box}, padding: {w['padding']}}}\n    strength: {w['strength']}\n" for p in sources))
        _peak_reset(models.device)
        t0 = time.perf_counter()
        result = refine(out, refines, RenderOptions(), models=models)
        _sync(models.device)
        ours = time.perf_counter() - t0
        assert result.status == "done" and result.rendered == picks, result.failed
        rec = {"work": w, "bcg_refine": {"wall_s": ours, "images": picks, "images_per_s": picks / ours,
                                         "peak_mb": _peak_mb(models.device),
                                         "ms_per_step": {b["bucket"]: b["ms_per_step"]
                                                         for b in result.report.buckets}}}
        rec["diffusers_inpaint"] = _diffusers(models, sources, box, w, tmp / "diffusers")
        rec["ratio"] = rec["diffusers_inpaint"]["wall_s"] / ours
        log(f"refine {picks} picks at {side}x{side}: bcg {ours:.2f} s, diffusers {rec['diffusers_inpaint']['wall_s']:.2f}"
            f" s ({rec['ratio']:.2f}x)")
        rec["hires"] = _hires(models, model, w, tmp / "hires", log)
    return rec


def _diffusers(models: SdxlModels, sources: list[Path], box: list[int], w: dict, out: Path) -> dict:
    """diffusers' inpainting pipeline on bcg's modules, one call per pick (as `padding_mask_crop` asks: a list of
    images must share one mask), PNGs saved as the user's loop would."""
    import diffusers
    from PIL import Image, ImageDraw

    loop = DiffusersLoop(models)
    pipe = diffusers.StableDiffusionXLInpaintPipeline(**loop.parts)
    pipe.set_progress_bar_config(disable=True)
    side = w["side"]
    mask = Image.new("L", (side, side), 0)
    x, y, bw, bh = box
    ImageDraw.Draw(mask).rectangle((x, y, x + bw - 1, y + bh - 1), fill=255)
    out.mkdir(parents=True)
    _peak_reset(models.device)
    t0 = time.perf_counter()
    for i, src in enumerate(sources):
        image = Image.open(src).convert("RGB")
        result = pipe(prompt=FIX, negative_prompt=None, image=image, mask_image=mask, height=side, width=side,
                      strength=w["strength"], num_inference_steps=w["steps"], guidance_scale=5.0,
                      padding_mask_crop=w["padding"], generator=torch.Generator("cpu").manual_seed(11 + i)).images[0]
        result.save(out / f"{i}.png")
    _sync(models.device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "images": len(sources), "images_per_s": len(sources) / wall,
            "peak_mb": _peak_mb(models.device)}


def _hires(models: SdxlModels, model: str, w: dict, folder: Path, log: Callable[[str], None]) -> dict:
    """A 1.5x hires pass: the job rendered once (bases and passes: every shape built), the candidates removed, then
    the passes alone on the same engine, from their bases on disk: seconds per pick."""
    folder.mkdir()
    hires = f"    hires: {{scale: 1.5, strength: {w['hires_strength']}, steps: {w['hires_steps']}}}\n"
    job = load_job(_job(folder, model, w["side"], w["steps"], w["picks"], hires))
    out = folder / "out"
    first = RenderSession(job, RenderOptions(out_dir=out), models=models)
    assert first.execute().status == "done"
    times = []
    for _ in range(2):  # the second round: every graph and cache of the pass warm
        for p in (out / "pick").glob("pick_c*_s*.png"):
            if not p.name.endswith(".base.png"):
                p.unlink()
        t0 = time.perf_counter()
        again = RenderSession(job, RenderOptions(out_dir=out), models=models, engine=first.engine).execute()
        _sync(models.device)
        times.append(time.perf_counter() - t0)
        assert again.status == "done" and again.rendered == w["picks"], again.failed
    per_pick = min(times) / w["picks"]
    side = w["side"] * 3 // 2 // 8 * 8
    log(f"hires 1.5x of {w['side']}x{w['side']} -> {side}x{side}, {int(w['hires_steps'] * w['hires_strength'])} of "
        f"{w['hires_steps']} steps: {per_pick:.3f} s per pick")
    shutil.rmtree(out, ignore_errors=True)
    return {"size": f"{side}x{side}", "steps": w["hires_steps"], "strength": w["hires_strength"],
            "rounds_s": times, "s_per_pick": per_pick}
