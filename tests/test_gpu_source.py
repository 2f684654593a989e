"""The source kind under captured CUDA graphs (skipped without CUDA): the sources, noise, masks and next sigmas live in
the static buffers, so one graph replays inpainting, img2img and plain rows and a batch without sources, each equal to
the eager loop; and the claim that an inpainting or img2img step costs at most 3% more than a text-to-image step (the
`source` part of `bcg bench`, at 8 x 1024x1024 compiled: the command docs/PERFORMANCE.md cites)."""

import pytest
import torch

from helpers.gpu import assert_rel_close, loop_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_one_graph_replays_sources_and_a_batch_without(dtype, rtol):
    from storyboard_cli.engine.conditions.kind import Conditions
    from storyboard_cli.engine.conditions.source import Blend, synthetic
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("tiny", None, "cuda", dtype)
    runner, eager = GraphRunner(models, max_batch=3, max_hw=(256, 256)), EagerEngine(models)
    tail = schedule("euler_a", 10, models.scheduler_config, 4)  # strength 0.6: the last 6 steps
    x, _, noise, cond, conds, guidance = loop_inputs(models, 3, 256, 256, 0, "euler_a", tail.steps, seed=4)
    value = synthetic(models, 3, 256, 256, 0, repaint=0.5)
    value = Blend(value.source_latents, value.source_noise, value.source_mask, tail.sigmas[1:].float().cuda())
    with_source = Conditions((*(c for c in conds if c.kind != "source"), value))
    x = x * tail.sigmas[0].item()
    want = eager.sample(x, tail, noise, cond, with_source, guidance)
    assert_rel_close(runner.sample(x, tail, noise, cond, with_source, guidance), want, rtol)
    without = Conditions(tuple(c for c in conds if c.kind != "source"))
    want = eager.sample(x, tail, noise, cond, without, guidance)
    assert_rel_close(runner.sample(x, tail, noise, cond, without, guidance), want, rtol)
    (row,) = runner.describe()
    assert row["state"] == "graph" and row["replays"] == 2 * tail.steps


@pytest.mark.slow
def test_an_inpainting_step_costs_at_most_3_percent_more_than_text_to_image():
    """8 x 1024x1024 on sdxl-random, compiled kernels (built first where the cache lacks them)."""
    from storyboard_cli.bench.source import source_steps
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    rec = source_steps(models, print, 8, 1024, 30, repeats=5, compile="on")
    assert rec["ratio_vs_text_to_image"]["img2img"] <= 1.03, rec
    assert rec["ratio_vs_text_to_image"]["inpaint"] <= 1.03, rec
