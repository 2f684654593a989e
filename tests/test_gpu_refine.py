"""Hires passes and refinements on CUDA graphs against the eager engine (skipped without CUDA): a hires job (latent
and Lanczos passes, bases kept) and `bcg refine` of its candidates (a cropped inpainting, a hires pass of a
refinement) give the same pixels through render() on both engines, within fp32 rounding."""

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from storyboard_cli.job.file import load_job
from storyboard_cli.run.refine import refine
from storyboard_cli.run.render import RenderOptions, render

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

JOB = """version: 1
model: tiny
defaults: {size: 128x96, steps: 8, guidance: 5.0}
shots:
  - {id: a, prompt: a lighthouse at dusk, seed: 5, candidates: 2, hires: {scale: 1.5, strength: 0.5, steps: 10}}
  - {id: b, prompt: a boat, seed: 9, hires: {scale: 2, strength: 0.35, steps: 12, upscaler: lanczos}}
"""
REFINES = """refine:
  - shot: a
    candidate: a/a_c1_s6.png
    name: hand
    mask: {box: [40, 30, 48, 40], padding: 8}
    strength: 0.6
    candidates: 2
  - shot: b
    candidate: b/b_c0_s9.png
    strength: 0.4
    hires: {scale: 1.25, strength: 0.5}
"""


def _same(a, b):
    pngs = sorted(p.relative_to(a) for p in a.rglob("*.png") if "thumbs" not in p.parts)
    assert pngs == sorted(p.relative_to(b) for p in b.rglob("*.png") if "thumbs" not in p.parts) and pngs
    for rel in pngs:
        x, y = (np.asarray(Image.open(f / rel), dtype=np.int16) for f in (a, b))
        diff = np.abs(x - y).max(-1)
        at = np.unravel_index(diff.argmax(), diff.shape)
        assert diff.max() <= 2, (str(rel), int(diff.max()), "at (y, x)", at, "over 2:", int((diff > 2).sum()),
                                 "of", diff.size, "mean", float(diff.mean()))


def test_hires_and_refine_on_graphs_match_eager(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "refines.yaml").write_text(REFINES)
    job = load_job(tmp_path / "job.yaml")
    outs = {}
    for engine in ("graph", "eager"):
        opts = RenderOptions(out_dir=tmp_path / engine, device="cuda", dtype="fp32", engine=engine, compile="off")
        done = render(job, opts)
        assert done.status == "done" and done.rendered == 6  # 3 candidates, 3 bases
        refined = refine(tmp_path / engine, tmp_path / "refines.yaml", opts)
        assert refined.status == "done" and refined.rendered == 4  # 3 refinements, 1 base
        if engine == "graph":
            states = [(g["shape"], g["state"], g["reason"]) for g in done.report.graphs + refined.report.graphs]
            assert all(state == "graph" for _, state, _ in states), states  # no graph dropped by a larger pass
        outs[engine] = tmp_path / engine
    _same(outs["graph"], outs["eager"])
    assert Image.open(outs["graph"] / "a/a_c0_s5.png").size == (192, 144)
    assert Image.open(outs["graph"] / "b/b_c0_s9.r1_c0_s9.png").size == (320, 240)
    shutil.rmtree(tmp_path / "eager")
