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


BASES = ("a/a_c0_s5.base.png", "a/a_c1_s6.base.png", "b/b_c0_s9.base.png")  # the first phase, from the prompts
# what a graph render starts again from eager's files: a hires pass (a's latent one), the cropped inpaintings of a
# hires candidate and the hires pass of a refinement (from eager's base of it)
AGAIN = ("a/a_c0_s5.png", "a/a_c1_s6.hand_c0_s6.png", "a/a_c1_s6.hand_c1_s7.png", "b/b_c0_s9.r1_c0_s9.png")


def _same(a, b, only=None):
    pngs = sorted(p.relative_to(a) for p in a.rglob("*.png") if "thumbs" not in p.parts)
    assert pngs == sorted(p.relative_to(b) for p in b.rglob("*.png") if "thumbs" not in p.parts) and pngs
    for rel in pngs if only is None else [r for r in pngs if str(r) in only]:
        x, y = (np.asarray(Image.open(f / rel), dtype=np.int16) for f in (a, b))
        diff = np.abs(x - y).max(-1)
        at = np.unravel_index(diff.argmax(), diff.shape)
        assert diff.max() <= 2, (str(rel), int(diff.max()), "at (y, x)", at, "over 2:", int((diff > 2).sum()),
                                 "of", diff.size, "mean", float(diff.mean()))


def _run(folder, engine, job, refines):
    opts = RenderOptions(out_dir=folder, device="cuda", dtype="fp32", engine=engine, compile="off")
    return render(job, opts), refine(folder, refines, opts)


def test_hires_and_refine_on_graphs_match_eager(tmp_path):
    """Each picture that starts from another is compared given the same picture: the tiny model's random weights
    amplify a last-level difference of a source many-fold through a pass (a base changed by +-1 level moves its hires
    pass by up to 67 levels over most pixels, on the CPU's eager engine alone), so the graph engine's passes start
    from the eager render's files."""
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "refines.yaml").write_text(REFINES)
    job, refines = load_job(tmp_path / "job.yaml"), tmp_path / "refines.yaml"
    eager, graph, again = tmp_path / "eager", tmp_path / "graph", tmp_path / "again"
    done, refined = _run(eager, "eager", job, refines)
    assert done.status == refined.status == "done" and (done.rendered, refined.rendered) == (6, 4)
    done, refined = _run(graph, "graph", job, refines)  # 3 candidates, 3 bases; 3 refinements, 1 base
    assert done.status == refined.status == "done" and (done.rendered, refined.rendered) == (6, 4)
    states = [(g["shape"], g["state"], g["reason"]) for g in done.report.graphs + refined.report.graphs]
    assert all(state == "graph" for _, state, _ in states), states  # no graph dropped by a larger pass
    assert Image.open(graph / "a/a_c0_s5.png").size == (192, 144)
    assert Image.open(graph / "b/b_c0_s9.r1_c0_s9.png").size == (320, 240)
    _same(graph, eager, only=BASES)
    shutil.copytree(eager, again)
    for rel in AGAIN:
        (again / rel).unlink()
    done, refined = _run(again, "graph", job, refines)
    assert (done.rendered, refined.rendered) == (1, 3)
    _same(again, eager)
    shutil.rmtree(eager)
