"""Several ControlNets per shot in the engine, on the tiny preset (CPU, fp32): against diffusers' MultiControlNetModel
with per-net scales and `control_guidance_end`, and the graph runner's replays against the eager engine."""

import copy
from dataclasses import replace

import pytest
import torch
from PIL import Image

from storyboard_cli.engine.conditioning import PromptCache, conditioning, control_pixels, guided_rows
from storyboard_cli.engine.conditioning import read_control_image
from storyboard_cli.engine.conditions.control import control
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.steps import control_steps, step_plan

from helpers.graphs import cpu_replays
from helpers.reference import RTOL, diffusers_pipeline, rel_error

W, H, STEPS, GUIDANCE = 64, 48, 8, 6.0
PROMPT, NEGATIVE = "two figures on a bridge, ink", "blurry"
SCALES, ENDS = (0.8, 0.5), (1.0, 0.6)


@pytest.fixture(scope="module")
def two_nets(tiny_cpu):
    """The tiny models with two ControlNets: the preset's, and a copy whose weights differ (so that which guide goes
    to which net shows)."""
    models = copy.copy(tiny_cpu)
    other = copy.deepcopy(tiny_cpu.controlnets[0])
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    models.controlnets = (tiny_cpu.controlnets[0], other)
    return models


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guides")
    gen = torch.Generator().manual_seed(3)
    paths = []
    for i in range(2):
        pixels = (torch.rand(H, W, 3, generator=gen) * 255).to(torch.uint8).numpy()
        paths.append(folder / f"g{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def _inputs(models, seeds):
    sched = schedule("euler", STEPS, models.scheduler_config)
    x, noise = draw_noise(seeds, STEPS, (4, H // 8, W // 8), sched)
    negatives, guidance = guided_rows([PROMPT] * len(seeds), [NEGATIVE] * len(seeds), [GUIDANCE] * len(seeds))
    cond = conditioning(PromptCache(models), [PROMPT] * len(seeds), negatives, W, H)
    return sched, x, noise, cond, torch.tensor(guidance)


def _control(models, paths, rows=1, scales=SCALES, ends=ENDS):
    images = [control_pixels(read_control_image(p, W, H))[None].repeat(rows, 1, 1, 1) for p in paths]
    runs = torch.tensor([control_steps(STEPS, e) for e in ends])
    keep = (torch.arange(STEPS)[:, None] < runs[None, :]).float()
    return control(models, images, [[s] * rows for s in scales], (0, 1), keep)


def _plan():
    return step_plan(STEPS, STEPS, control=max(control_steps(STEPS, e) for e in ENDS))


def test_two_nets_match_diffusers_multicontrolnet(two_nets, guides):
    from diffusers import StableDiffusionXLControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    plain = diffusers_pipeline(two_nets, "euler")
    pipe = StableDiffusionXLControlNetPipeline(**plain.components, controlnet=MultiControlNetModel(
        list(two_nets.controlnets)))
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(5), output_type="latent",
                image=[Image.open(p).convert("RGB") for p in guides], controlnet_conditioning_scale=list(SCALES),
                control_guidance_end=list(ENDS)).images
    sched, x, noise, cond, guidance = _inputs(two_nets, [5])
    got = EagerEngine(two_nets).sample(x, sched, noise, cond, Conditions.of(_control(two_nets, guides)), guidance,
                                       _plan())
    assert rel_error(got, want) < RTOL
    # each net gets its own guide: swapping the guides changes the picture
    swapped = EagerEngine(two_nets).sample(x, sched, noise, cond, Conditions.of(_control(two_nets, guides[::-1])),
                                           guidance, _plan())
    assert rel_error(swapped, got) > 1e-3


def test_graph_replays_equal_eager_with_two_nets(two_nets, guides):
    runner = GraphRunner(two_nets, max_batch=2, max_hw=(H, W))
    cpu_replays(runner)
    sched, x, noise, cond, guidance = _inputs(two_nets, [1, 2])
    ctl = _control(two_nets, guides, rows=2)
    want = EagerEngine(two_nets).sample(x, sched, noise, cond, Conditions.of(ctl), guidance, _plan())
    got = runner.sample(x, sched, noise, cond, Conditions.of(ctl), guidance, _plan())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert runner.describe()[0]["shape"].startswith("2x64x48 +control 0+1")
    # the same graph with every net to the end (no keep): the buffers' keep is reset to ones
    ends = Conditions.of(replace(ctl, keep=None))
    want = EagerEngine(two_nets).sample(x, sched, noise, cond, ends, guidance, _plan())
    torch.testing.assert_close(runner.sample(x, sched, noise, cond, ends, guidance, _plan()), want, rtol=1e-5,
                               atol=1e-5)


def test_each_guide_is_embedded_once_per_batch_and_never_in_a_step(two_nets, guides):
    """A batch's guides are embedded once, by their own nets, when its inputs are made (`control`): the steps, eager
    and replayed, run no embedding. The nets apart from their embeddings (`embedding_apart`) on those guides give each
    whole net's residuals on the images, bit for bit, a "bgr" net's too (diffusers flips its image first)."""
    from storyboard_cli.engine.conditions.control import embed_guide, embedding_apart
    from storyboard_cli.engine.eager import controlnet_call
    from storyboard_cli.engine.kernels.export import example_inputs

    calls = []
    hooks = [net.controlnet_cond_embedding.register_forward_hook(lambda m, a, o, i=i: calls.append((i, a[0].shape[0])))
             for i, net in enumerate(two_nets.controlnets)]
    try:
        sched, x, noise, cond, guidance = _inputs(two_nets, [1, 2])
        ctl = _control(two_nets, guides, rows=2)
        assert calls == [(0, 2), (1, 2)]  # each net once, on the batch's 2 images (not the 4 guided rows)
        EagerEngine(two_nets).sample(x, sched, noise, cond, Conditions.of(ctl), guidance, _plan())
        runner = GraphRunner(two_nets, max_batch=2, max_hw=(H, W))
        cpu_replays(runner)
        runner.sample(x, sched, noise, cond, Conditions.of(ctl), guidance, _plan())
        assert calls == [(0, 2), (1, 2)]
    finally:
        for h in hooks:
            h.remove()

    bgr = copy.deepcopy(two_nets.controlnets[1])
    bgr.register_to_config(controlnet_conditioning_channel_order="bgr")
    latents, t, embeds, pooled, time_ids, _, scale = example_inputs("controlnet", bgr, 4, H // 8, W // 8)
    t = t.expand(4)
    image = torch.rand(4, 3, H, W, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for net in (two_nets.controlnets[0], bgr):
            whole = controlnet_call(net, latents, t, embeds, pooled, time_ids, image, scale)
            apart = controlnet_call(embedding_apart(net), latents, t, embeds, pooled, time_ids,
                                    embed_guide(net, image), scale)
            assert all(torch.equal(a, w) for a, w in zip(apart, whole))
        flipped = controlnet_call(embedding_apart(bgr), latents, t, embeds, pooled, time_ids,
                                  embed_guide(two_nets.controlnets[1], image), scale)  # the guide not flipped
        assert not torch.equal(flipped[0], whole[0])
