"""LoRA swaps under captured graphs (skipped without CUDA): a graph captured before a swap replays with
the new weights, matching the eager step after the swap, and no shape is captured twice."""

import pytest
import torch

from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya

from helpers.gpu import assert_rel_close, loop_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_a_graph_captured_before_a_swap_replays_with_the_new_weights(tmp_path, dtype, rtol):
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.models.loader import load_sdxl
    from storyboard_cli.models.lora import LoraApplier, read_lora

    models = load_sdxl("tiny", "tiny", "cuda", dtype)
    factors = {k: (d.half(), u.half()) for k, (d, u) in random_factors(models, seed=3, rank=4).items()}
    path = save_kohya(tmp_path / "a.safetensors", factors, models.unet.config.layers_per_block, alpha=4.0)
    lora = read_lora("a", path, models.unet.config)
    applier = LoraApplier(models)
    applier.register(lora)
    pointers = [p.data_ptr() for p in models.unet.parameters()]

    runner, eager = GraphRunner(models, max_batch=2, max_hw=(256, 256)), EagerEngine(models)
    args = loop_inputs(models, 2, 256, 256, True, sampler="euler", seed=5)
    before = runner.sample(*args)  # captures and checks
    key = runner.shape_key(2, 256, 256, True)
    captured = runner.stats[key].capture_s
    applier.apply({"a": (lora, 0.9)})
    try:
        after = runner.sample(*args)
        assert runner.stats[key].capture_s == captured and len(runner.graphs) == 1  # no new capture
        assert_rel_close(after, eager.sample(*args), rtol)
        assert not torch.allclose(after, before)
    finally:
        applier.apply({})
    assert [p.data_ptr() for p in models.unet.parameters()] == pointers
    assert_rel_close(runner.sample(*args), before, rtol / 10 if rtol > 1e-3 else 1e-6)
