"""IP-Adapter references and two ControlNets under captured CUDA graphs (skipped without CUDA): the tokens, per-row
scales, slot masks and each net's keep live in the static buffers, so one graph replays batches with other references
and matches the eager loop."""

import pytest
import torch

from helpers.gpu import assert_rel_close, loop_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("adapter", ["tiny", "tiny-plus"])
def test_one_graph_replays_other_references_and_two_nets(adapter, dtype, rtol):
    from dataclasses import replace

    from storyboard_cli.engine.conditions.kind import Conditions
    from storyboard_cli.engine.conditions.reference import references
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("tiny", ("tiny", "tiny"), "cuda", dtype, adapter)
    runner, eager = GraphRunner(models, max_batch=3, max_hw=(256, 256)), EagerEngine(models)
    x, sched, noise, cond, conds, guidance = loop_inputs(models, 3, 256, 256, 0b11, sampler="euler", seed=4)
    keep = (torch.arange(sched.steps)[:, None] < torch.tensor([[sched.steps, 3]])).float().cuda()
    ctl = replace(conds.get("control"), keep=keep)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randn(models.ip_adapter.tokens, models.ip_adapter.dim, generator=gen).to("cuda", dtype)
              for _ in range(3)]
    for rows, scales in (([[tokens[0]], [], tokens[1:]], [0.6, 0.0, 1.0]), ([[tokens[2]], tokens[:2], []], [1.0, 0.4, 0.0])):
        conds = Conditions.of(ctl, references(rows, models.ip_adapter.negative, scales, 4))
        want = eager.sample(x, sched, noise, cond, conds, guidance)
        assert_rel_close(runner.sample(x, sched, noise, cond, conds, guidance), want, rtol)
    (row,) = runner.describe()
    assert row["state"] == "graph" and row["replays"] == 2 * sched.steps
