"""The FP8 kernels' convolutions (engine/kernels/conv8.py) on the CPU: which of the UNet's convolutions go FP8 (SDXL's
own config, and the test model's), the module computing the FP8 arithmetic exactly, the weights' layout and scales,
re-quantised in place after a write, and a cache's stored scales without them calibrated again. The CPU artifact with
them is tests/test_fp8.py's; the Triton kernel runs on a GPU only (tests/test_gpu_fp8_kernels.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from storyboard_cli.engine.kernels import conv8
from storyboard_cli.engine.kernels import fp8
from storyboard_cli.models.loader import load_sdxl


def _sdxl_unet():
    from diffusers import UNet2DConditionModel

    from storyboard_cli.models.loader import sdxl_config_folder

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(sdxl_config_folder() / "unet"))


def _rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(fp8.FP8).float() * scale


def test_sdxls_inner_resnet_and_upsampler_convolutions_go_fp8_and_nothing_at_the_latents_resolution():
    unet = _sdxl_unet()
    names = conv8.convs(unet)
    assert len(names) == 25  # 4 + 4 down, 4 mid, 6 + 1 and 6 up
    assert "up_blocks.0.upsamplers.0.conv" in names and "up_blocks.1.upsamplers.0.conv" not in names
    for kept in ("conv_in", "conv_out", "down_blocks.0.resnets.0.conv1", "up_blocks.2.resnets.0.conv1",
                 "down_blocks.1.resnets.0.conv_shortcut", "down_blocks.1.downsamplers.0.conv",
                 "down_blocks.0.downsamplers.0.conv"):
        assert kept not in names
    assert all(unet.get_submodule(n).kernel_size == (3, 3) for n in names)
    levels = {conv8.level(n, 3) for n in names}
    assert levels == {1, 2}
    from diffusers import ControlNetModel

    with torch.device("meta"):
        net = ControlNetModel.from_unet(unet, load_weights_from_unet=False)
    assert conv8.convs(net) == []  # the ControlNet's stay fp16: their cost in pictures is not measured


def test_the_fp8_convolution_computes_the_rounded_arithmetic_and_stays_near_the_float_one():
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(64, 96, 3, padding=1)
    x = torch.randn(2, 64, 12, 10, generator=g)
    m = conv8.Fp8Conv2d(conv)
    q, ws = conv8.quantize(conv.weight)
    amax = x.abs().amax().item()
    with torch.no_grad():
        m.weight.copy_(q)
        m.w_scale.copy_(ws)
        m.x_scale.fill_(amax / 448)
        m.bias.copy_(conv.bias)
        got = m(x)
        w_rounded = _rounded(conv.weight.float(), conv.weight.abs().amax(dim=(1, 2, 3), keepdim=True) / 448)
        want = F.conv2d(_rounded(x, torch.tensor(amax / 448)), w_rounded, conv.bias, 1, 1)
        full = conv(x)
    assert got.shape == full.shape == (2, 96, 12, 10) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    err = ((got - full).norm() / full.norm()).item()
    assert 1e-3 < err < 6e-2, err  # FP8's rounding, per element about 3.7e-2


def test_the_weights_are_laid_out_for_the_kernel_with_a_scale_per_output_channel():
    w = torch.randn(8, 4, 3, 3)
    w[3] *= 100  # one channel's range does not squeeze the others'
    q, scale = conv8.quantize(w)
    assert q.shape == (8, 3, 3, 4) and q.dtype == fp8.FP8 and q.is_contiguous() and scale.shape == (8,)
    assert torch.allclose(scale, w.abs().amax(dim=(1, 2, 3)) / 448)
    back = (q.float() * scale[:, None, None, None]).permute(0, 3, 1, 2)
    assert ((back - w).norm() / w.norm()).item() < 5e-2
    assert ((back[0] - w[0]).norm() / w[0].norm()).item() < 5e-2


def test_tiles_take_the_channels_the_unet_has():
    assert conv8.tiles(1280, 1280) == conv8.TILES
    assert conv8.tiles(640, 640)[:3] == (128, 256, 128)
    assert conv8.tiles(32, 64)[:3] == (128, 64, 32)
    assert conv8.tiles(96, 48)[:3] == (128, 64, 32)


def test_a_write_to_a_convolution_weight_requantises_its_fp8_copy_in_place():
    from storyboard_cli.engine.kernels.export import fuse_projections

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    fuse_projections(models.unet)  # as the rendering process's FP8 kernels have it
    name = conv8.convs(models.unet)[0]
    tensors = fp8.weights(models, models.unet)
    q, scale = tensors[f"{name}.weight"], tensors[f"{name}.w_scale"]
    pointer, before = q.data_ptr(), q.float().clone()
    w = models.unet.get_submodule(name).weight
    with torch.no_grad():
        w.mul_(-2.0)
    models.written(w)
    again = fp8.weights(models, models.unet)
    assert again[f"{name}.weight"].data_ptr() == pointer and q.data_ptr() == pointer
    assert torch.equal(q.float(), -before)  # the same values negated: the scale doubled with the weight
    assert torch.allclose(scale, w.detach().abs().amax(dim=(1, 2, 3)) / 448)


def test_stored_scales_without_the_convolutions_are_calibrated_again(tmp_path, caplog):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    amax, path, calibrated = fp8.scales(models, tmp_path)
    assert calibrated and set(conv8.convs(models.unet)) <= set(amax)
    stored = json.loads(path.read_text())
    stored["amax"] = {n: a for n, a in stored["amax"].items() if n in fp8.linears(models.unet)}  # a cache from before
    path.write_text(json.dumps(stored))
    again, _, calibrated = fp8.scales(models, tmp_path)
    assert calibrated and again == pytest.approx(amax)
    assert "lack modules" in caplog.text
    assert fp8.scales(models, tmp_path)[2] is False  # stored whole now
