"""IP-Adapter references and several ControlNets through a render, on the tiny preset (CPU, fp32): rows with and
without a reference share one batch and equal their solo renders, swapped references swap the pictures, the graph
runner's replays equal eager, a LoRA swap with the adapter loaded, resume and dedup by reference content."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT, write_job
from storyboard_cli.engine.conditioning import PromptCache, conditioning
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.conditions.reference import references
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render

from helpers.graphs import cpu_replays

REFS = ROOT / "jobs" / "refs"
HEAD = """version: 1
name: r
model: tiny
ip_adapter: tiny
controlnets: {pose: tiny, depth: tiny}
loras: {mei: loras/mei.safetensors}
characters:
  mei: {reference: refs/mei.png, scale: 0.8}
  kai: {reference: refs/stranger.png, scale: 0.8}
defaults: {steps: 4, guidance: 5.0, size: 64x64, seed: 11}
"""


@pytest.fixture(scope="module")
def ref_models():
    """The tiny models with the tiny adapter and two ControlNets (their own copy: the adapter's processors go into the
    UNet)."""
    from storyboard_cli.models.loader import load_sdxl

    return load_sdxl("tiny", ("tiny", "tiny"), "cpu", torch.float32, "tiny")


@pytest.fixture
def folder(tmp_path):
    for sub in ("refs", "control", "loras"):
        shutil.copytree(ROOT / "jobs" / sub, tmp_path / sub)
    return tmp_path


def _job(folder, shots: str, buckets="[4]", name="job.yaml"):
    return load_job(write_job(folder, HEAD + f"buckets: {buckets}\nshots:\n" + shots, name))


def _pixels(path):
    return np.asarray(Image.open(path), dtype=np.int16)


def _only_png(out, shot):
    (png,) = (out / shot).glob("*.png")
    return _pixels(png)


MIXED = """  - {id: a, prompt: a figure at a window, characters: [mei]}
  - {id: b, prompt: a figure at a window}
  - {id: c, prompt: a figure at a window, characters: [kai, mei]}
"""


def test_rows_with_and_without_references_share_a_batch_and_equal_their_solo_renders(folder, tmp_path, ref_models):
    together = render(_job(folder, MIXED), RenderOptions(out_dir=tmp_path / "four"), models=ref_models)
    assert together.rendered == 3 and len(together.report.buckets) == 1  # one bucket: the references are per row
    alone = render(_job(folder, MIXED, "[1]", "alone.yaml"), RenderOptions(out_dir=tmp_path / "one"), models=ref_models)
    assert len(alone.report.buckets) == 1 and alone.report.buckets[0]["batches"] == 3
    for shot in "abc":
        assert np.abs(_only_png(tmp_path / "four", shot) - _only_png(tmp_path / "one", shot)).max() <= 1
    # the references steer: the same prompt and seed with no, one and two references are different pictures
    a, b, c = (_only_png(tmp_path / "four", s) for s in "abc")
    assert np.abs(a - b).mean() >= 2 and np.abs(a - c).mean() >= 2
    # the model without the adapter's attention (tiny_cpu's UNet) renders b's picture too: a row at scale 0 is exact
    meta = json.loads(Image.open(next((tmp_path / "four/a").glob("*.png"))).info["bcg"])
    assert meta["references"][0]["character"] == "mei" and meta["reference_scale"] == 0.8


def test_swapping_two_rows_references_in_one_batch_swaps_their_pictures(folder, tmp_path, ref_models):
    one = "  - {id: a, prompt: two figures, characters: [mei]}\n  - {id: b, prompt: two figures, characters: [kai]}\n"
    two = one.replace("[mei]", "[x]").replace("[kai]", "[mei]").replace("[x]", "[kai]")
    render(_job(folder, one), RenderOptions(out_dir=tmp_path / "one"), models=ref_models)
    render(_job(folder, two, name="two.yaml"), RenderOptions(out_dir=tmp_path / "two"), models=ref_models)
    a1, b1 = _only_png(tmp_path / "one", "a"), _only_png(tmp_path / "one", "b")
    a2, b2 = _only_png(tmp_path / "two", "a"), _only_png(tmp_path / "two", "b")
    assert np.abs(a1 - b1).mean() >= 2  # two references, two pictures
    assert np.abs(a1 - b2).max() <= 1 and np.abs(b1 - a2).max() <= 1


def test_two_nets_a_net_alone_and_their_guides_in_one_render(folder, tmp_path, ref_models):
    shots = """  - {id: a, prompt: a room, control: [{net: pose, image: control/mei_pose.png, scale: 0.8},
                                       {net: depth, image: control/window_depth.png, scale: 0.5, end: 0.5}]}
  - {id: b, prompt: a room, control: [{net: depth, image: control/window_depth.png, scale: 0.5, end: 0.5},
                                       {net: pose, image: control/mei_pose.png, scale: 0.8}]}
  - {id: c, prompt: a room, control: {net: depth, image: control/window_depth.png, scale: 0.5}}
  - {id: d, prompt: a room}
"""
    result = render(_job(folder, shots), RenderOptions(out_dir=tmp_path / "o"), models=ref_models)
    labels = sorted(b["bucket"] for b in result.report.buckets)
    assert len(labels) == 3 and any("+2 controls" in l for l in labels), labels
    a, b, c, d = (_only_png(tmp_path / "o", s) for s in "abcd")
    assert np.abs(a - b).max() <= 1  # listed in either order: summed in the job's order of nets
    assert np.abs(a - c).mean() >= 2 and np.abs(c - d).mean() >= 2


def test_graph_replays_equal_eager_with_references(ref_models):
    """The static buffers carry the tokens, scales and masks: a mixed batch replayed equals the eager loop, and a second
    batch with other references reuses the graph."""
    runner = GraphRunner(ref_models, max_batch=3, max_hw=(64, 64))
    captured = cpu_replays(runner)
    adapter = ref_models.ip_adapter
    sched = schedule("euler", 4, ref_models.scheduler_config)
    x, noise = draw_noise([1, 2, 3], 4, (4, 8, 8), sched)
    cond = conditioning(PromptCache(ref_models), ["a"] * 3, [""] * 3, 64, 64)
    mei, stranger = (adapter.encode(p, hashlib.sha256(p.read_bytes()).hexdigest())
                     for p in (REFS / "mei.png", REFS / "stranger.png"))
    guidance = torch.full((3,), 5.0)
    for rows in ([[mei], [], [stranger, mei]], [[stranger], [mei], []]):
        refs = Conditions.of(references(rows, adapter.negative, [0.7, 0.0, 0.9], 4))
        want = EagerEngine(ref_models).sample(x, sched, None, cond, refs, guidance)
        torch.testing.assert_close(runner.sample(x, sched, None, cond, refs, guidance), want, rtol=1e-5, atol=1e-5)
    assert len(captured) == 1


def test_a_lora_swap_with_the_adapter_loaded(folder, tmp_path, ref_models):
    shots = ("  - {id: a, prompt: a keeper, characters: [mei], lora: {mei: 0.9}}\n"
             "  - {id: b, prompt: a keeper, characters: [mei]}\n")
    before = {n: p.clone() for n, p in ref_models.unet.named_parameters()}
    render(_job(folder, shots, "[1]"), RenderOptions(out_dir=tmp_path / "o"), models=ref_models)
    a, b = _only_png(tmp_path / "o", "a"), _only_png(tmp_path / "o", "b")
    assert np.abs(a - b).mean() > 0.5  # the LoRA was applied to a's batch, not b's
    alone = render(_job(folder, shots.splitlines()[0] + "\n", "[1]", "alone.yaml"),
                   RenderOptions(out_dir=tmp_path / "alone"), models=ref_models)
    assert alone.rendered == 1 and np.abs(a - _only_png(tmp_path / "alone", "a")).max() <= 1
    # the adapter's own layers are not LoRA targets, and the weights are back bit for bit
    assert all(torch.equal(p, before[n]) for n, p in ref_models.unet.named_parameters())


def test_resume_and_dedup_follow_the_references_content(folder, tmp_path, ref_models):
    shots = MIXED + "  - {id: d, prompt: a figure at a window, characters: [kai]}\n"
    job = _job(folder, shots)
    out = tmp_path / "o"
    first = render(job, RenderOptions(out_dir=out), models=ref_models)
    assert first.rendered == 4
    again = render(job, RenderOptions(out_dir=out), models=ref_models)
    assert (again.rendered, again.skipped) == (0, 4)
    # the stranger's picture is redrawn: the shots that use it (c, d) render again, a and b are kept
    with Image.open(folder / "refs/stranger.png") as im:
        im.transpose(Image.FLIP_LEFT_RIGHT).save(folder / "refs/stranger.png")
    edited = render(_job(folder, shots), RenderOptions(out_dir=out), models=ref_models)
    assert (edited.rendered, edited.skipped) == (2, 2)
    # two shots alike but for their references are two images; alike with the same ones, one image in two places
    twins = ("  - {id: e, prompt: x, characters: [mei]}\n  - {id: f, prompt: x, characters: [mei]}\n"
             "  - {id: g, prompt: x, characters: [kai]}\n")
    result = render(_job(folder, twins, name="twins.yaml"), RenderOptions(out_dir=tmp_path / "t"), models=ref_models)
    assert result.rendered == 3 and result.report.buckets[0]["rows"] == 2 * 4  # e and f share one row


def test_references_and_two_nets_together_match_diffusers(tiny_cpu, ref_models, tmp_path):
    """StableDiffusionXLControlNetPipeline with a MultiControlNetModel (per-net scale and control_guidance_end) after
    load_ip_adapter, two reference images: bcg's eager loop gives the same latents."""
    import copy

    from diffusers import StableDiffusionXLControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    from helpers.reference import RTOL, diffusers_pipeline, rel_error
    from storyboard_cli.engine.conditioning import control_pixels, guided_rows, read_control_image
    from storyboard_cli.engine.conditions.control import control
    from storyboard_cli.models.tiny import ADAPTER_FILES, tiny_adapter_folder
    from storyboard_cli.steps import control_steps, step_plan

    w, h, steps, guidance, seed = 64, 64, 6, 6.0, 9
    scales, ends = [0.8, 0.5], [1.0, 0.5]
    guides = []
    for name in ("mei_pose", "window_depth"):
        with Image.open(ROOT / "jobs" / "control" / f"{name}.png") as im:
            im.convert("RGB").resize((w, h), Image.LANCZOS).save(tmp_path / f"{name}.png")
        guides.append(tmp_path / f"{name}.png")
    refs = [REFS / "mei.png", REFS / "stranger.png"]

    theirs = copy.deepcopy(tiny_cpu)  # the plain UNet: diffusers puts its own adapter processors in
    plain = diffusers_pipeline(theirs)
    pipe = StableDiffusionXLControlNetPipeline(**plain.components,
                                               controlnet=MultiControlNetModel([theirs.controlnets[0]] * 2))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(str(tiny_adapter_folder("base")), subfolder="", weight_name=ADAPTER_FILES["base"],
                         image_encoder_folder="image_encoder")
    pipe.set_ip_adapter_scale(0.6)
    want = pipe(prompt="two figures on the stairs", negative_prompt="blurry", height=h, width=w,
                num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent", image=[Image.open(g).convert("RGB") for g in guides],
                controlnet_conditioning_scale=scales, control_guidance_end=ends,
                ip_adapter_image=[[Image.open(r).convert("RGB") for r in refs]]).images

    m = ref_models
    sched = schedule("euler", steps, m.scheduler_config)
    x, noise = draw_noise([seed], steps, (4, h // 8, w // 8), sched)
    negatives, g = guided_rows(["two figures on the stairs"], ["blurry"], [guidance])
    cond = conditioning(PromptCache(m), ["two figures on the stairs"], negatives, w, h)
    tokens = [m.ip_adapter.encode(r, hashlib.sha256(r.read_bytes()).hexdigest()) for r in refs]
    runs = torch.tensor([control_steps(steps, e) for e in ends])
    keep = (torch.arange(steps)[:, None] < runs[None, :]).float()
    ctl = control(m, [control_pixels(read_control_image(p, w, h))[None] for p in guides], [[s] for s in scales], (0, 1),
                  keep)
    plan = step_plan(steps, steps, control=max(runs).item())
    conds = Conditions.of(ctl, references([tokens], m.ip_adapter.negative, [0.6], 4))
    got = EagerEngine(m).sample(x, sched, noise, cond, conds, torch.tensor(g), plan)
    assert rel_error(got, want) < RTOL
