"""The source kind (img2img, inpainting) through a render on the tiny preset (CPU, fp32): a batch mixing inpainting,
img2img and plain rows equals their solo renders, pixels outside a cropped mask are the source's, the graph runner's
replays equal eager, a LoRA swap and references with a mask, resume by the source's settings, `bcg render` of the
example job, and bad input refused at `bcg plan`."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.cli import app
from storyboard_cli.engine.conditioning import PromptCache, conditioning
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.conditions.source import Reader
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.folder.report import Timings
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.run.render import RenderOptions, render

from helpers.graphs import cpu_replays

HEAD = """version: 1
name: s
model: tiny
ip_adapter: tiny
loras: {mei: loras/mei.safetensors}
characters:
  mei: {reference: refs/mei.png, scale: 0.8}
defaults: {steps: 5, guidance: 5.0, size: 64x64, sampler: euler_a}
"""
MASK = "finishing/face_mask.png"  # 128x128, the source's size: a white ellipse


@pytest.fixture(scope="module")
def src_models():
    """The tiny models with the tiny adapter (their own copy: the adapter's processors go into the UNet)."""
    from storyboard_cli.models.loader import load_sdxl

    return load_sdxl("tiny", None, "cpu", torch.float32, "tiny")


@pytest.fixture
def folder(tmp_path):
    for sub in ("refs", "loras", "finishing"):
        shutil.copytree(ROOT / "jobs" / sub, tmp_path / sub)
    return tmp_path


def _job(folder, shots: str, buckets="[4]", name="job.yaml"):
    return load_job(write_job(folder, HEAD + f"buckets: {buckets}\nshots:\n" + shots, name))


def _only_png(out, shot):
    (png,) = (out / shot).glob("*.png")
    return np.asarray(Image.open(png), dtype=np.int16)


MIXED = f"""  - {{id: paint, prompt: a keeper, seed: 1, init: {{image: refs/mei.png, strength: 1.0}}, mask: {{image: {MASK}}}}}
  - {{id: redo, prompt: a keeper, seed: 2, init: {{image: refs/stranger.png, strength: 1.0}}}}
  - {{id: plain, prompt: a keeper, seed: 3}}
  - {{id: boxed, prompt: a keeper, seed: 4, init: {{image: refs/mei.png, strength: 0.6}}, mask: {{box: [0, 0, 64, 32]}}}}
  - {{id: tail, prompt: a keeper, seed: 5, init: {{image: refs/stranger.png, strength: 0.6}}}}
  - {{id: crop, prompt: a keeper, seed: 6, init: {{image: refs/mei.png, strength: 0.6}},
      mask: {{image: {MASK}, blur: 2, padding: 8}}}}
"""


def test_a_mixed_batch_equals_the_solo_renders(folder, tmp_path, src_models):
    """Inpainting, img2img and plain rows of one schedule share a batch (and those of the tail at strength 0.6 theirs);
    each image equals its render alone: a source's encode is seeded by its own content, not by its batch."""
    together = render(_job(folder, MIXED), RenderOptions(out_dir=tmp_path / "b"), models=src_models)
    assert together.rendered == 6 and len(together.report.buckets) == 2
    alone = render(_job(folder, MIXED, "[1]", "alone.yaml"), RenderOptions(out_dir=tmp_path / "a"), models=src_models)
    assert alone.rendered == 6
    for shot in ("paint", "redo", "plain", "boxed", "tail", "crop"):
        assert np.abs(_only_png(tmp_path / "b", shot) - _only_png(tmp_path / "a", shot)).max() <= 1, shot
    # each starts from its own source: the img2img rows differ from the plain one
    assert np.abs(_only_png(tmp_path / "b", "redo") - _only_png(tmp_path / "b", "plain")).mean() > 1


def test_pixels_outside_a_cropped_mask_are_the_sources(folder, tmp_path, src_models):
    render(_job(folder, MIXED.splitlines()[-2] + "\n" + MIXED.splitlines()[-1] + "\n"),
           RenderOptions(out_dir=tmp_path / "o"), models=src_models)
    (png,) = (tmp_path / "o" / "crop").glob("*.png")
    with Image.open(png) as im:
        got, text = np.asarray(im.convert("RGB")), im.text["parameters"]
    source = np.asarray(Image.open(folder / "refs/mei.png").convert("RGB"))
    assert got.shape == source.shape  # pasted back at the source's size (128x128), rendered at the shot's (64x64)
    outside = np.asarray(Image.open(folder / MASK).filter(ImageFilter.GaussianBlur(2))) == 0
    assert np.array_equal(got[outside], source[outside])
    assert np.abs(got[~outside].astype(int) - source[~outside]).mean() > 5  # and the face was repainted
    assert "Denoising strength: 0.6, Mask blur: 2, Inpaint area: Only masked, Masked area padding: 8" in text


def test_graph_replays_equal_eager_with_sources(folder, src_models):
    """The static buffers carry the sources, noise, masks and next sigmas: a mixed batch replayed equals the eager
    loop; a batch without sources through the same graph leaves its blend a no-op (idle)."""
    job = _job(folder, MIXED)
    batches = make_batches(work_items(job), (4,))
    assert len(batches) == 2
    runner = GraphRunner(src_models, max_batch=4, max_hw=(64, 64))
    captured = cpu_replays(runner)
    reader = Reader(src_models)
    for b in batches:
        rows = list(b.items) + [b.items[-1]] * (b.size - len(b.items))
        for it in rows:
            reader.check(it, Timings())
        blend = reader.batch(rows, b.key)
        conds = Conditions.of(blend)
        sched = schedule(b.key.sampler, b.key.steps, src_models.scheduler_config, b.key.first)
        x, noise = draw_noise([r.seed for r in rows], sched.steps, (4, 8, 8), sched)
        x = conds.begin(x)
        cond = conditioning(PromptCache(src_models), ["a"] * len(rows), [""] * len(rows), 64, 64)
        guidance = torch.full((len(rows),), 5.0)
        want = EagerEngine(src_models).sample(x, sched, noise, cond, conds, guidance, b.key.plan)
        torch.testing.assert_close(runner.sample(x, sched, noise, cond, conds, guidance, b.key.plan), want,
                                   rtol=1e-5, atol=1e-5)
    sched = schedule("euler", 5, src_models.scheduler_config)
    x, _ = draw_noise([9, 8, 7, 6], 5, (4, 8, 8), sched)
    cond = conditioning(PromptCache(src_models), ["a"] * 4, [""] * 4, 64, 64)
    want = EagerEngine(src_models).sample(x, sched, None, cond, None, torch.full((4,), 5.0))
    torch.testing.assert_close(runner.sample(x, sched, None, cond, None, torch.full((4,), 5.0)), want,
                               rtol=1e-5, atol=1e-5)
    assert len({k for k in captured}) == 1  # one shape, one graph: sources change no graph's identity


def test_a_lora_swap_and_references_with_a_mask(folder, tmp_path, src_models):
    crop = f"init: {{image: refs/mei.png, strength: 0.8}}, mask: {{image: {MASK}, padding: 8}}"
    shots = (f"  - {{id: a, prompt: a keeper, seed: 1, characters: [mei], lora: {{mei: 0.9}}, {crop}}}\n"
             f"  - {{id: b, prompt: a keeper, seed: 1, characters: [mei], {crop}}}\n")
    before = {n: p.clone() for n, p in src_models.unet.named_parameters()}
    render(_job(folder, shots, "[1]"), RenderOptions(out_dir=tmp_path / "o"), models=src_models)
    a, b = _only_png(tmp_path / "o", "a"), _only_png(tmp_path / "o", "b")
    source = np.asarray(Image.open(folder / "refs/mei.png").convert("RGB"), dtype=np.int16)
    outside = np.asarray(Image.open(folder / MASK)) == 0
    assert np.array_equal(a[outside], source[outside]) and np.array_equal(b[outside], source[outside])
    assert np.abs(a - b)[~outside].mean() > 0.5  # the LoRA was applied to a's batch, not b's
    alone = render(_job(folder, shots.splitlines()[0] + "\n", "[1]", "alone.yaml"),
                   RenderOptions(out_dir=tmp_path / "alone"), models=src_models)
    assert alone.rendered == 1 and np.abs(a - _only_png(tmp_path / "alone", "a")).max() <= 1
    assert all(torch.equal(p, before[n]) for n, p in src_models.unet.named_parameters())


def test_resume_follows_the_sources_settings(folder, tmp_path, src_models):
    shots = MIXED.splitlines()
    job = _job(folder, "\n".join(shots[:2]) + "\n")
    out = tmp_path / "o"
    assert render(job, RenderOptions(out_dir=out), models=src_models).rendered == 2
    again = render(job, RenderOptions(out_dir=out), models=src_models)
    assert (again.rendered, again.skipped) == (0, 2)
    # another strength for `redo` re-renders it alone
    edited = _job(folder, shots[0] + "\n" + shots[1].replace("strength: 1.0", "strength: 0.7") + "\n")
    assert (lambda r: (r.rendered, r.skipped))(render(edited, RenderOptions(out_dir=out), models=src_models)) == (1, 1)


def test_bcg_render_of_the_example_job(tmp_path):
    for sub in ("refs", "finishing"):
        shutil.copytree(ROOT / "jobs" / sub, tmp_path / sub)
    job = tmp_path / "finishing.yaml"
    job.write_text((ROOT / "jobs" / "finishing.yaml").read_text().replace("steps: 8", "steps: 4")
                   .replace("candidates: 2", "candidates: 1"))
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(tmp_path / "out"), "--device", "cpu",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    pngs = sorted((tmp_path / "out").glob("f0[123]-*/*.png"))  # f04-final is the hires example: tests/test_refine.py
    assert len(pngs) == 3 and all(Image.open(p).size == (128, 128) for p in pngs)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    shots = [s["shot"] for s in report["sources"]]  # each shot that starts from an image, as its images record it
    assert shots and all(isinstance(s["init"]["strength"], float) for s in report["sources"])
    assert any("mask" in s for s in report["sources"]) and "references" not in report
    assert "## Sources" in (tmp_path / "out" / "report.md").read_text()
    plan = CliRunner().invoke(app, ["plan", str(job)])
    assert plan.exit_code == 0 and "2 of 4" in plan.output and "crop at" in plan.output


BAD = [
    ("init: {image: refs/missing.png}", "init.image", "missing.png"),
    ("init: {image: finishing.txt}", "init.image", "not a readable image"),
    ("init: {image: refs/mei.png, strength: 0}", "init.strength", "above 0"),
    ("init: {image: refs/mei.png, strength: 1.5}", "init.strength", "between 0 and 1"),
    ("init: {image: refs/mei.png, strength: 0.1}", "init.strength", "runs no step"),
    ("init: {image: refs/mei.png}, size: 96x64", "init.image", "not the shot's aspect"),
    ("init: {image: refs/mei.png, resize: squash}", "init.resize", "stretch, crop, fill"),
    ("mask: {box: [0, 0, 8, 8]}", "mask", "needs an `init:`"),
    ("init: {image: refs/mei.png}, mask: {box: [100, 0, 40, 8]}", "mask.box", "outside the source"),
    ("init: {image: refs/mei.png}, mask: {box: [0, 0, 0, 8]}", "mask.box", "nothing to repaint"),
    ("init: {image: refs/mei.png}, mask: {image: black.png}", "mask.image", "nothing to repaint"),
    ("init: {image: refs/mei.png}, mask: {image: small.png}", "mask.image", "its source's size"),
    ("init: {image: refs/mei.png}, mask: {box: [0, 0, 8, 8], image: black.png}", "mask", "one of them"),
    ("init: {image: refs/mei.png}, mask: {box: [0, 0, 8, 8], blur: -1}", "mask.blur", "between"),
]


@pytest.mark.parametrize("extra,field,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_sources_are_refused_at_plan(folder, extra, field, words):
    (folder / "finishing.txt").write_text("not an image")
    Image.new("L", (128, 128)).save(folder / "black.png")
    Image.new("L", (64, 64), 255).save(folder / "small.png")
    job = write_job(folder, "version: 1\nmodel: tiny\ndefaults: {steps: 8, size: 64x64}\nshots:\n"
                            f"  - {{id: s1, prompt: a keeper, {extra}}}\n")
    result = CliRunner().invoke(app, ["plan", str(job)])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert f"job.yaml:5 shot 's1' field '{field}':" in line and words in line, line


def test_a_resize_mode_lets_another_aspect_through(folder):
    job = write_job(folder, "version: 1\nmodel: tiny\nshots:\n  - {id: s1, prompt: a, size: 96x64, steps: 4,\n"
                            "     init: {image: refs/mei.png, resize: crop}}\n")
    result = CliRunner().invoke(app, ["plan", str(job)])
    assert result.exit_code == 0, result.output


def test_the_bench_part_times_the_three_loops_side_by_side(tiny_cpu):
    """`bcg bench --parts source` (its CPU smoke run): text-to-image, img2img and inpainting loops, their ratios."""
    from storyboard_cli.bench.source import source_steps

    rec = source_steps(tiny_cpu, lambda line: None, 2, 64, 6, repeats=1, compile="off")
    assert rec["tail_steps"] == 3 and set(rec["ratio_vs_text_to_image"]) == {"text_to_image", "img2img", "inpaint"}
    assert rec["ratio_vs_text_to_image"]["text_to_image"] == 1.0 and all(m > 0 for m in rec["ms_per_image_step"].values())


def test_bcg_submit_uploads_the_sources_and_masks(folder):
    """`bcg submit` uploads what `named_files` lists: each shot's (and the defaults') source and mask image."""
    from storyboard_cli.job.file import named_files

    job = write_job(folder, "version: 1\nmodel: tiny\ndefaults: {init: {image: refs/stranger.png}}\nshots:\n"
                            f"  - {{id: a, prompt: x, init: {{image: refs/mei.png}}, mask: {{image: {MASK}}}}}\n"
                            "  - {id: b, prompt: x, mask: {box: [0, 0, 8, 8]}}\n")
    assert named_files(job) == ["refs/stranger.png", "refs/mei.png", MASK]


def test_a_source_that_breaks_after_plan_fails_only_its_images(folder, tmp_path, src_models):
    shots = MIXED.splitlines()
    job = _job(folder, shots[1] + "\n" + shots[2] + "\n")
    (folder / "refs/stranger.png").write_bytes(b"broken")
    result = render(job, RenderOptions(out_dir=tmp_path / "o"), models=src_models)
    assert result.rendered == 1 and [f["shot"] for f in result.report.failures] == ["redo"]
    assert "source image refs/stranger.png cannot be read" in result.report.failures[0]["reason"]


def test_the_services_work_estimate_counts_the_steps_an_init_runs(folder):
    """An image that starts from a source runs the last int(S x strength) steps of its schedule: the service orders
    and estimates it by those, not by S."""
    from storyboard_cli.serve.intake import work

    plain, half, whole = work_items(_job(folder, """  - {id: plain, prompt: a keeper, seed: 1}
  - {id: half, prompt: a keeper, seed: 2, init: {image: refs/mei.png, strength: 0.6}}
  - {id: whole, prompt: a keeper, seed: 3, init: {image: refs/mei.png, strength: 1.0}}
"""))
    megapixels = 64 * 64 / 1e6
    assert work(plain) == work(whole) == round(megapixels * 5, 4)
    assert half.key.runs == 3 and work(half) == round(megapixels * 3, 4)
