"""Regional prompts and regional references on the tiny preset (CPU, fp32): the attention against a plain-PyTorch
reference and diffusers' IPAdapterAttnProcessor2_0 with ip_adapter_masks, the exactness a region must keep (a region
over the whole frame with the shot's own prompt, regions in another order, an all-masked slot), locality, the graph
runner's replays against eager, a batch of shots with 0, 1 and 3 regions against their solo renders, and the sheet's
boxes in a real browser."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT, write_job
from storyboard_cli.engine.conditioning import PromptCache, conditioning
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.conditions.region import level_masks, regions_value
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.job.conditions.region import REGION_SLOTS
from storyboard_cli.job.file import load_job
from storyboard_cli.models.ip_adapter import RowScaledIpProcessor
from storyboard_cli.models.regions import RegionProcessor
from storyboard_cli.models.tokenizers import CLIP_TOKENS
from storyboard_cli.run.render import RenderOptions, render

from helpers.graphs import cpu_replays

HEAD = """version: 1
name: g
model: tiny
ip_adapter: tiny
characters:
  mei: {reference: refs/mei.png, scale: 0.8}
defaults: {steps: 4, guidance: 5.0, size: 64x64, seed: 11}
"""
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def region_models():
    """The tiny models with the tiny adapter, made for regions (their own copy: the processors go into the UNet)."""
    from storyboard_cli.models.loader import load_sdxl

    return load_sdxl("tiny", None, "cpu", torch.float32, "tiny", None, regions=REGION_SLOTS)


@pytest.fixture
def folder(tmp_path):
    shutil.copytree(ROOT / "jobs" / "refs", tmp_path / "refs")
    return tmp_path


def _job(folder, shots: str, buckets="[4]", name="job.yaml"):
    return load_job(write_job(folder, HEAD + f"buckets: {buckets}\nshots:\n" + shots, name))


def _png(out, shot) -> np.ndarray:
    (png,) = (out / shot).glob("*.png")
    return np.asarray(Image.open(png), dtype=np.int16)


def _cross_attention(models):
    """A cross-attention layer of the tiny UNet and its processor (the adapter's, which takes regions too)."""
    (name,) = [n for n in models.unet.attn_processors if n.endswith("attn2.processor")][:1]
    return models.unet.get_submodule(name.removesuffix(".processor")), models.unet.attn_processors[name]


# ---------------------------------------------------------------- the attention itself

def test_text_regions_match_a_plain_pytorch_masked_attention(region_models):
    """Each query token sees the shot's 77 keys and the keys of the regions it lies in, nothing else."""
    attn, _ = _cross_attention(region_models)
    g = torch.Generator().manual_seed(0)
    rows, length, slots = 3, 16, 4
    hidden = torch.randn(rows, length, attn.to_q.in_features, generator=g)
    text = torch.randn(rows, CLIP_TOKENS, attn.to_k.in_features, generator=g)
    regions = torch.randn(rows, slots * CLIP_TOKENS, attn.to_k.in_features, generator=g)
    inside = torch.rand(rows, slots, length, generator=g) > 0.5  # which query tokens each slot's region holds
    inside[0] = False  # a row without regions: every slot masked
    inside[1, 2:] = False  # two unused slots
    sees = torch.cat([torch.ones(rows, length, CLIP_TOKENS, dtype=torch.bool),
                      inside.transpose(1, 2).repeat_interleave(CLIP_TOKENS, -1)], -1)  # [R, L, 77 * 5]
    bias = torch.zeros(rows, 1, length, sees.shape[-1]).masked_fill(~sees[:, None], float("-inf"))
    ours = RegionProcessor()(attn, hidden, text, region_embeds=regions, region_bias_1=bias)

    keys = torch.cat([text, regions], 1).double()
    heads, d = attn.heads, attn.to_q.out_features // attn.heads
    q = (hidden.double() @ attn.to_q.weight.double().T).view(rows, length, heads, d).transpose(1, 2)
    k = (keys @ attn.to_k.weight.double().T).view(rows, -1, heads, d).transpose(1, 2)
    v = (keys @ attn.to_v.weight.double().T).view(rows, -1, heads, d).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    probs = scores.masked_fill(~sees[:, None], float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(rows, length, heads * d)
    want = out @ attn.to_out[0].weight.double().T + attn.to_out[0].bias.double()
    torch.testing.assert_close(ours, want.float(), rtol=1e-5, atol=1e-5)
    # without regions the processor is diffusers' AttnProcessor2_0
    plain = RegionProcessor()(attn, hidden, text)
    from diffusers.models.attention_processor import AttnProcessor2_0

    torch.testing.assert_close(plain, AttnProcessor2_0()(attn, hidden, text), rtol=0, atol=0)


def test_regional_references_match_diffusers_ip_adapter_masks(region_models):
    """Two references, each inside its own region's mask at its own scale, as IPAdapterAttnProcessor2_0 applies
    ip_adapter_masks (one SDPA per image, times its downsampled mask and scale)."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    attn, _ = _cross_attention(region_models)
    hidden_size, cross = attn.to_k.out_features, attn.to_k.in_features
    g = torch.Generator().manual_seed(1)
    rows, side, tokens = 2, 8, 4
    theirs = IPAdapterAttnProcessor2_0(hidden_size, cross, num_tokens=(tokens,), scale=[[0.7, 0.4]])
    ours = RowScaledIpProcessor(hidden_size, cross, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for w in (*theirs.to_k_ip.parameters(), *theirs.to_v_ip.parameters()):
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
        ours.to_k_ip.weight.copy_(theirs.to_k_ip[0].weight)
        ours.to_v_ip.weight.copy_(theirs.to_v_ip[0].weight)
    hidden = torch.randn(rows, side * side, hidden_size, generator=g)
    text = torch.randn(rows, CLIP_TOKENS, cross, generator=g)
    images = torch.randn(rows, 2, tokens, cross, generator=g)  # [B, images, T, C]
    masks = torch.zeros(1, 2, side, side)
    masks[0, 0, :, :3] = 1  # the first reference on the left, the second on the right, overlapping in a column
    masks[0, 1, :, 2:] = 1
    want = theirs(attn, hidden, (text, [images]), ip_adapter_masks=[masks])
    weight = torch.stack([masks[0, 0].flatten() * 0.7, masks[0, 1].flatten() * 0.4], -1).expand(rows, -1, -1)
    refs = torch.cat([images[:, 0], images[:, 1], torch.zeros(rows, 2 * tokens, cross)], 1)  # two slots empty
    weight = torch.cat([weight, torch.zeros(rows, side * side, 2)], -1)
    got = ours(attn, hidden, text, region_ref_tokens=refs, region_ref_weight_1=weight)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- exactness, through the loop

def _loop(models, seeds, prompts, regions, boxes, size=64):
    """The eager loop of one batch: each row's region prompts and boxes (x, y, w, h in pixels)."""
    sched = schedule("euler", 4, models.scheduler_config)
    x, noise = draw_noise(seeds, 4, (4, size // 8, size // 8), sched)
    cond = conditioning(PromptCache(models), prompts, ["blurry"] * len(prompts), size, size)
    cache = PromptCache(models)
    embeds = [list(cache.get(r)[0]) if r else [] for r in regions]
    pixels = []
    for row in boxes:
        p = torch.zeros(len(row), size, size)
        for k, (x0, y0, w, h) in enumerate(row):
            p[k, y0:y0 + h, x0:x0 + w] = 1
        pixels.append(p)
    value = regions_value(models.region_layout, models.unet.config.cross_attention_dim, embeds, pixels, None, None,
                          models.dtype, models.device)
    return x, sched, noise, cond, Conditions.of(value), torch.full((len(seeds),), 5.0)


def test_one_region_over_the_frame_with_the_shots_prompt_is_the_plain_render(region_models):
    prompt = "a lighthouse keeper on the stairs"
    x, sched, noise, cond, conds, guidance = _loop(region_models, [3], [prompt], [[prompt]], [[(0, 0, 64, 64)]])
    regional = EagerEngine(region_models).sample(x, sched, noise, cond, conds, guidance)
    plain = EagerEngine(region_models).sample(x, sched, noise, cond, None, guidance)
    # duplicated keys leave the softmax unchanged, up to float32's summation order: the two sums run over other key
    # counts, and the CPU's GEMM kernels round by the batch's memory layout (1.2e-5 seen in a full run, 0 alone); a
    # wrong region moves the latents by more than 1e-3 on average (below)
    torch.testing.assert_close(regional, plain, rtol=1e-4, atol=1e-4)
    other = _loop(region_models, [3], [prompt], [["a storm over the sea"]], [[(0, 0, 64, 64)]])[4]
    assert (EagerEngine(region_models).sample(x, sched, noise, cond, other, guidance) - plain).abs().mean() > 1e-3


def test_an_all_masked_slot_changes_nothing(region_models):
    """A row without regions in a models made for regions (every slot masked) is the row without the kind."""
    x, sched, noise, cond, conds, guidance = _loop(region_models, [5, 6], ["a", "b"], [[], ["a storm"]],
                                                   [[], [(0, 0, 32, 64)]])
    both = EagerEngine(region_models).sample(x, sched, noise, cond, conds, guidance)
    plain = EagerEngine(region_models).sample(x, sched, noise, cond, None, guidance)
    # masked keys weigh exactly 0: what is left is the rounding of longer matrix products (1.3e-5 measured)
    torch.testing.assert_close(both[0], plain[0], rtol=1e-4, atol=1e-4)
    assert (both[1] - plain[1]).abs().mean() > 1e-2


def test_models_with_more_slots_than_a_batch_needs_give_the_same_picture(folder, tmp_path, region_models):
    """A job's models take its most regions per shot in slots (job/conditions/region.py `slots`): two regions
    rendered on models of two slots and of four (two masked everywhere) give the same picture."""
    from storyboard_cli.models.loader import load_sdxl

    shot = ("  - id: s\n    prompt: two figures\n    regions:\n      - {box: [0, 0, 32, 64], prompt: a red coat}\n"
            "      - {box: [32, 0, 32, 64], prompt: a blue coat}\n")
    job = _job(folder, shot)
    two = load_sdxl("tiny", None, "cpu", torch.float32, "tiny", None, regions=2)
    assert two.region_layout.slots == 2 and region_models.region_layout.slots == REGION_SLOTS
    render(job, RenderOptions(out_dir=tmp_path / "two"), models=two)
    render(job, RenderOptions(out_dir=tmp_path / "four"), models=region_models)
    assert np.abs(_png(tmp_path / "two", "s") - _png(tmp_path / "four", "s")).max() <= 1


def test_regions_listed_in_another_order_give_the_same_picture(folder, tmp_path, region_models):
    a = "      - {box: [0, 0, 32, 64], prompt: a red coat, characters: [mei]}\n"
    b = "      - {box: [32, 0, 32, 64], prompt: a blue coat}\n"
    c = "      - {box: [16, 16, 32, 32], prompt: a lantern}\n"
    shot = "  - id: s\n    prompt: two figures\n    regions:\n"
    render(_job(folder, shot + a + b + c), RenderOptions(out_dir=tmp_path / "one"), models=region_models)
    render(_job(folder, shot + c + a + b, name="two.yaml"), RenderOptions(out_dir=tmp_path / "two"),
           models=region_models)
    assert np.abs(_png(tmp_path / "one", "s") - _png(tmp_path / "two", "s")).max() <= 1


MARGIN = 1.7  # how much more a region's prompt moves the latents inside its box than outside


def test_a_regions_prompt_moves_the_pixels_inside_its_box_more_than_outside(region_models):
    """Locality, on the latents of the left half's box: the region's prompt changes them inside far more than outside
    (convolutions carry some across the edge); with the mask dropped (the same region over the whole frame) the
    change is even."""
    size, box = 128, (0, 0, 64, 128)
    whole = (0, 0, size, size)
    base = "a quiet room"

    def latents(region_prompt, where):
        inputs = _loop(region_models, [9], [base], [[region_prompt]], [[where]], size)
        return EagerEngine(region_models).sample(*inputs)[0]

    def ratio(where):
        moved = (latents("a burning ship in a storm", where) - latents(base, where)).abs().mean(0)  # [h, w]
        return float(moved[:, :6].mean() / moved[:, 10:].mean())  # inside vs outside, a band at the edge left out

    masked, dropped = ratio(box), ratio(whole)  # 2.2 and 1.2 measured (the tiny UNet's 4 steps, random weights)
    assert masked > MARGIN, masked
    assert dropped < MARGIN, dropped  # the margin fails without the mask


def test_graph_replays_equal_eager_with_regions(region_models):
    """The static buffers carry the region embeddings and masks: batches with other regions replay one graph and equal
    the eager loop."""
    runner = GraphRunner(region_models, max_batch=3, max_hw=(64, 64))
    captured = cpu_replays(runner)
    for regions, boxes in (([["a red coat"], [], ["a", "b", "c"]], [[(0, 0, 32, 64)], [], [(0, 0, 64, 16)] * 3]),
                           ([[], ["a lantern", "rain"], []], [[], [(8, 8, 16, 16), (32, 0, 32, 64)], []])):
        x, sched, noise, cond, conds, guidance = _loop(region_models, [1, 2, 3], ["a", "b", "c"], regions, boxes)
        want = EagerEngine(region_models).sample(x, sched, noise, cond, conds, guidance)
        torch.testing.assert_close(runner.sample(x, sched, noise, cond, conds, guidance), want, rtol=1e-5, atol=1e-5)
    assert len(captured) == 1


MIXED = """  - {id: none, prompt: a harbour at night}
  - id: one
    prompt: a harbour at night
    regions: [{box: [0, 0, 0.5, 1], prompt: a lighthouse, characters: [mei]}]
  - id: three
    prompt: a harbour at night
    regions:
      - {box: [0, 0, 0.5, 0.5], prompt: a boat}
      - {box: [0.5, 0, 0.5, 0.5], prompt: a gull, reference: {image: refs/stranger.png, scale: 0.5}}
      - {box: [0, 0.5, 1, 0.5], prompt: waves}
"""


def test_a_batch_of_shots_with_0_1_and_3_regions_equals_their_solo_renders(folder, tmp_path, region_models):
    together = render(_job(folder, MIXED), RenderOptions(out_dir=tmp_path / "four"), models=region_models)
    assert together.rendered == 3 and len(together.report.buckets) == 1
    alone = render(_job(folder, MIXED, "[1]", "alone.yaml"), RenderOptions(out_dir=tmp_path / "one"),
                   models=region_models)
    assert alone.report.buckets[0]["batches"] == 3
    for shot in ("none", "one", "three"):
        assert np.abs(_png(tmp_path / "four", shot) - _png(tmp_path / "one", shot)).max() <= 1
    none, one, three = (_png(tmp_path / "four", s) for s in ("none", "one", "three"))
    assert np.abs(none - one).mean() >= 1 and np.abs(none - three).mean() >= 1


def test_the_masks_level_keeps_a_token_covered_at_least_half():
    pixels = torch.zeros(1, 64, 64)
    pixels[0, :, :24] = 1  # 1.5 tokens of 16 pixels at level 1: the second token half covered
    assert level_masks(pixels, 1).view(4, 4)[0].tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_the_sheet_draws_each_regions_box_on_its_candidates(folder, tmp_path, region_models):
    from playwright.sync_api import sync_playwright

    from storyboard_cli.folder.sheet import write_sheet

    shots = """  - id: s
    prompt: two figures
    size: 128x64
    steps: 2
    regions:
      - {box: [0, 0, 0.5, 1], prompt: a red coat}
      - {box: [64, 16, 32, 32], prompt: a lantern}
"""
    job = _job(folder, shots)
    out = tmp_path / "out"
    render(job, RenderOptions(out_dir=out), models=region_models)
    write_sheet(out, job)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox",
                                                                         "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.goto((out / "index.html").as_uri())
        img = page.locator("figure.cand img").first
        img.scroll_into_view_if_needed()
        page.wait_for_function("document.querySelector('figure.cand img').complete")
        frame = img.bounding_box()
        rects = [r.bounding_box() for r in page.locator("figure.cand svg.boxes rect").all()]
        captions = page.locator("figure.cand svg.boxes text").all_text_contents()
        shot = page.screenshot(clip=frame)  # the candidate's thumbnail with the boxes over it
        browser.close()
    assert captions == ["1: a red coat", "2: a lantern"]
    (left, lantern) = rects
    stroke = 2  # half of it outside the rectangle on each side
    assert abs(left["x"] - frame["x"]) <= stroke and abs(left["width"] - frame["width"] / 2) <= stroke
    assert abs(left["height"] - frame["height"]) <= stroke
    assert abs(lantern["x"] - (frame["x"] + frame["width"] / 2)) <= stroke
    assert abs(lantern["y"] - (frame["y"] + frame["height"] / 4)) <= stroke
    import io

    drawn = np.asarray(Image.open(io.BytesIO(shot)).convert("RGB"), dtype=np.int16)
    yellow = (np.abs(drawn - np.array([255, 210, 63])).sum(-1) < 60)
    assert yellow[:, drawn.shape[1] // 2].mean() > 0.5  # the first box's right edge runs down the middle
