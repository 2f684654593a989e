"""The FP8 kernels' fused feed-forwards (engine/kernels/geglu.py) on the CPU: which feed-forwards fuse, the fused call
computing exactly what the unfused FP8 feed-forward computes, the tiles the kernel takes at each width, and the FP8
artifact's key naming the fusion. The Triton kernel itself runs on a GPU only (tests/test_gpu_fp8_kernels.py); the CPU
artifacts run `reference`, which tests/test_fp8.py checks against the eager module."""

from __future__ import annotations

import copy

import torch

from storyboard_cli.engine.kernels import fp8 as F
from storyboard_cli.engine.kernels import geglu
from storyboard_cli.engine.kernels.artifacts import Target, artifact_key
from storyboard_cli.engine.kernels.export import fuse_projections
from storyboard_cli.engine.variants import VARIANTS
from storyboard_cli.models.loader import load_sdxl


def _feed_forwards(model):
    from diffusers.models.attention import FeedForward

    return [m for m in model.modules() if isinstance(m, FeedForward)]


def _fp8_copy(module, scale: float = 0.05):
    """A fused copy of `module` with its FP8 Linears swapped in, their weights quantised from the module's and every
    input scale `scale` (the values an artifact's constants would hold)."""
    net = copy.deepcopy(module)
    live = copy.deepcopy(module)
    fuse_projections(net, processor=True)
    fuse_projections(live)
    F.swap_in(net)
    with torch.no_grad():
        for name in F.linears(live):
            m = net.get_submodule(name)
            q, s = F.quantize(live.get_submodule(name).weight)
            m.weight.copy_(q)
            m.w_scale.copy_(s)
            m.x_scale.fill_(scale)
            if m.bias is not None:
                m.bias.copy_(live.get_submodule(name).bias)
    return net


def test_every_geglu_feed_forward_of_the_unet_and_controlnet_fuses_and_only_between_fp8_linears():
    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    for module in (models.unet, models.controlnets[0]):
        plain = copy.deepcopy(module)
        assert geglu.fuse(plain) == 0  # fp16 Linears: nothing to fuse
        net = _fp8_copy(module)
        count = len(_feed_forwards(net))
        assert count > 0 and geglu.fuse(net) == count
        assert all(ff.forward.__func__ is geglu.fused_forward for ff in _feed_forwards(net))
    fresh = copy.deepcopy(models.unet)  # the export's change, as the `fp8` row makes it
    fuse_projections(fresh, processor=True)
    assert F.rewrite(fresh) == len(F.linears(_fused(models.unet)))
    assert all(ff.forward.__func__ is geglu.fused_forward for ff in _feed_forwards(fresh))


def _fused(module):
    out = copy.deepcopy(module)
    fuse_projections(out)
    return out


def test_the_fused_feed_forward_computes_exactly_the_unfused_fp8_one():
    """On the CPU in float32 the fused call is the same arithmetic as the FP8 Linear, GEGLU and the last Linear's
    quantisation one after another: equal to the bit. Its output is the last Linear's, in the model's dtype."""
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    net = _fp8_copy(models.unet)
    g = torch.Generator().manual_seed(0)
    for ff in _feed_forwards(net):
        width = ff.net[0].proj.weight.shape[1]
        x = torch.randn(2, 37, width, generator=g)
        with torch.no_grad():
            want = ff(x)
            ff.forward = geglu.fused_forward.__get__(ff)
            got = ff(x)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want)


def test_the_reference_quantises_the_geglu_of_the_float32_product_at_the_output_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    w = torch.randn(2 * 32, 64, generator=g) * 0.1
    b = torch.randn(2 * 32, generator=g) * 0.1
    xq, xs = F.quantize(x)
    wq, ws = F.quantize(w)
    y = (xq.float() * xs) @ (wq.float() * ws).t() + b
    h, gate = y[:, :32], y[:, 32:]
    want = h * 0.5 * gate * (1 + torch.erf(gate / 2**0.5))
    os = want.abs().amax() / 448 / 4  # the largest quarter of the outputs saturate
    got = geglu.reference(xq, wq, b, xs, ws, os)
    assert got.dtype == F.FP8 and got.shape == (5, 32)
    assert torch.equal(got, (want / os).clamp(-448, 448).to(F.FP8))
    assert got.float().abs().max() == 448 and torch.isfinite(got.float()).all()  # saturated, never NaN


def test_the_tiles_fit_sdxls_widths_and_the_test_models_and_refuse_what_no_tile_divides():
    assert geglu.tiles(1280, 5120) == geglu.TILES and geglu.tiles(640, 2560) == geglu.TILES
    bm, bn, bk, *_ = geglu.tiles(64, 256)
    assert (bm, bn, bk) == (128, 128, 64)
    assert geglu.tiles(32, 48)[1:3] == (16, 32)
    assert geglu.tiles(40, 256) is None  # K not a multiple of an FP8 product's depth (32)
    assert geglu.tiles(64, 100) is None


def test_the_fp8_artifacts_key_names_the_fusion():
    """An FP8 artifact built before the fusion is another recipe: a cache's old FP8 UNet is never looked up."""
    assert VARIANTS["fp8"].recipe == ("fp8-linears", "fused-geglu", "fp8-convs-inner") and VARIANTS["fp8"].rewrite is F.rewrite
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    target = Target("unet", 128, 128, "fp8")
    key = artifact_key(target, models.unet)
    old = VARIANTS["fp8"]
    try:
        from dataclasses import replace

        VARIANTS["fp8"] = replace(old, recipe=("fp8-linears",))
        from storyboard_cli.engine import variants

        variants.PRECISIONS["fp8"] = VARIANTS["fp8"]
        assert artifact_key(target, models.unet) != key
    finally:
        VARIANTS["fp8"] = old
        variants.PRECISIONS["fp8"] = old
