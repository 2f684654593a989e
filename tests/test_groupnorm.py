"""The VAE decoder's wide GroupNorm (models/groupnorm.py): the same function as torch's, the same parameters, and on a
GPU the same pixels as torch's kernel, faster; its SiLUs moved into the norms and the decoder channels_last (`fuse`),
the same function, and `narrow` giving diffusers' modules back."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.gpu import timed_decode
from storyboard_cli.models import groupnorm
from storyboard_cli.models.groupnorm import (SiluInNorm, WideGroupNorm, channels_last, fuse, fused_resnet_forward,
                                             group_norm, narrow, residual, widen)


def fused(block: nn.Module) -> bool:
    """Whether `fuse` gave this resnet block the forward that leaves its biases to the norm and the block's end."""
    return getattr(block.__dict__.get("forward"), "__func__", None) is fused_resnet_forward


@pytest.mark.parametrize("shape,groups,affine", [((2, 64, 16, 24), 32, True), ((1, 128, 40), 32, True),
                                                 ((3, 32, 5, 6, 7), 8, False)])
def test_the_same_function_as_torch(shape, groups, affine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 4 + 3  # an offset mean: a one-pass variance would lose digits here
    w = torch.randn(shape[1], generator=g) if affine else None
    b = torch.randn(shape[1], generator=g) if affine else None
    ours, theirs = group_norm(x, groups, w, b, 1e-6), F.group_norm(x, groups, w, b, 1e-6)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert (ours - theirs).abs().max().item() < 2e-5


def test_a_wide_module_keeps_its_parameters_and_takes_torch_path_where_it_should():
    net = nn.Sequential(nn.Conv2d(3, 64, 3), nn.GroupNorm(32, 64), nn.SiLU(), nn.Sequential(nn.GroupNorm(8, 64)))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(1, 3, 12, 12)
    reference = net(x)
    assert widen(net) == 2
    assert [type(m) for m in net.modules() if isinstance(m, nn.GroupNorm)] == [WideGroupNorm, WideGroupNorm]
    assert net.state_dict().keys() == before.keys() and all(torch.equal(net.state_dict()[k], v)
                                                           for k, v in before.items())
    assert (net(x) - reference).abs().max().item() < 2e-5
    assert widen(net) == 0  # once
    twin = copy.deepcopy(net)  # a copy keeps the class; narrow gives torch's back
    assert narrow(twin) == 2
    assert all(type(m) is nn.GroupNorm for m in twin.modules() if isinstance(m, nn.GroupNorm))
    assert torch.equal(twin(x), reference)

    gn = net[1]
    h = torch.randn(1, 64, 10, 10)
    for other in (h.to(torch.bfloat16), h.transpose(2, 3), h.to(memory_format=torch.channels_last)):
        assert torch.equal(gn(other), F.group_norm(other, 32, gn.weight.to(other.dtype), gn.bias.to(other.dtype),
                                                   gn.eps)), (other.dtype, other.stride())


def test_the_cpu_loader_keeps_torch_groupnorm(tiny_cpu):
    assert all(type(m) is nn.GroupNorm for m in tiny_cpu.vae.modules() if isinstance(m, nn.GroupNorm))


@pytest.mark.gpu
def test_on_a_gpu_the_decode_is_faster_with_the_same_pixels():
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    wide = [m for m in models.vae.decoder.modules() if isinstance(m, nn.GroupNorm)]
    assert wide and all(type(m) is WideGroupNorm for m in wide)
    latents = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    native = copy.deepcopy(models.vae)
    narrow(native)
    torch_models = copy.copy(models)
    torch_models.vae = native

    t_wide, ours = timed_decode(models, latents)
    t_torch, theirs = timed_decode(torch_models, latents)
    diff = (ours.int() - theirs.int()).abs()
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.1, (diff.max(), diff.float().mean())
    assert t_wide < 0.85 * t_torch, (t_wide, t_torch)


def test_fuse_moves_each_silu_into_its_norm_goes_channels_last_and_narrow_puts_it_all_back(tiny_cpu, monkeypatch):
    """fuse on a decoder whose device passes the kernels' check (the CPU here, told so: its norms then take torch's
    paths, the same function): the SiLUs that follow a norm move inside it, the weights go channels_last, the decode
    is the same; narrow gives diffusers' modules, layout and decode back exactly."""
    from diffusers.models.resnet import ResnetBlock2D

    vae = copy.deepcopy(tiny_cpu.vae)
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
    norms = widen(vae.decoder)
    monkeypatch.setattr(groupnorm, "works_on", lambda device, shapes: True)
    resnets = [m for m in vae.decoder.modules() if isinstance(m, ResnetBlock2D)]
    assert fuse(vae.decoder) == 2 * len(resnets) + 1 and resnets
    assert all(type(r.nonlinearity) is SiluInNorm and r.norm1.silu and r.norm2.silu for r in resnets)
    # the blocks that neither up- nor downsample (all of a VAE decoder's) end in one pass with their biases
    assert all(fused(r) == (r.upsample is None and r.downsample is None) for r in resnets) and any(map(fused, resnets))
    assert any(r.conv_shortcut is not None for r in resnets if fused(r))  # a shortcut's bias goes to the end too
    assert type(vae.decoder.conv_act) is SiluInNorm and vae.decoder.conv_norm_out.silu
    assert all(m.kernels for m in vae.decoder.modules() if type(m) is WideGroupNorm)
    attention_norms = [m.group_norm for m in vae.decoder.modules() if hasattr(m, "group_norm") and m.group_norm]
    assert attention_norms and not any(n.silu for n in attention_norms)  # no SiLU follows the attention's norm
    assert channels_last(vae.decoder) and not channels_last(vae.encoder)
    assert not any(isinstance(m, nn.SiLU) for r in resnets for m in r.modules())
    with torch.no_grad():
        got = vae.decode(z.contiguous(memory_format=torch.channels_last), return_dict=False)[0]
    assert (got - want).abs().max().item() < 5e-5  # channels_last convolutions sum in another order
    assert vae.state_dict().keys() == before.keys() and all(torch.equal(vae.state_dict()[k], v)
                                                           for k, v in before.items())
    assert fuse(vae.decoder) == 0  # once
    assert narrow(vae) == norms
    assert not any(type(m) in (SiluInNorm, WideGroupNorm) for m in vae.modules())
    assert all(type(r.nonlinearity) is nn.SiLU for r in resnets) and type(vae.decoder.conv_act) is nn.SiLU
    assert not any(map(fused, resnets)) and not any("forward" in r.__dict__ for r in resnets)
    assert not channels_last(vae.decoder) and all(p.is_contiguous() for p in vae.parameters())
    with torch.no_grad():
        assert torch.equal(vae.decode(z, return_dict=False)[0], want)


def test_fuse_leaves_a_decoder_whose_device_fails_the_check_as_it_was(tiny_cpu):
    vae = copy.deepcopy(tiny_cpu.vae)
    widen(vae.decoder)
    assert not groupnorm.works_on(torch.device("cpu")) or os.environ.get("TRITON_INTERPRET") == "1"
    assert fuse(vae.decoder) == 0  # the CPU without Triton's interpreter: the kernels do not run here
    assert not any(type(m) is SiluInNorm for m in vae.modules()) and not channels_last(vae.decoder)
    assert not any(getattr(m, "silu", False) or getattr(m, "kernels", False) for m in vae.modules())


def test_decode_hands_a_channels_last_decoder_its_layout_and_the_pixels_stay(tiny_cpu, monkeypatch):
    from storyboard_cli.run.batch import decode_on_device, decode_pixels

    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    want_f, want = decode_on_device(tiny_cpu, latents)
    models = copy.copy(tiny_cpu)
    models.vae = copy.deepcopy(tiny_cpu.vae)
    widen(models.vae.decoder)
    monkeypatch.setattr(groupnorm, "works_on", lambda device, shapes: True)
    fuse(models.vae.decoder)
    seen = []
    models.vae.decoder.conv_in.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    got_f, got = decode_on_device(models, latents)
    assert seen == [True, True]  # one image at a time, each in the decoder's layout
    assert got_f.is_contiguous() and got.shape == want.shape == (2, 16 * 8, 16 * 8, 3)
    assert (got.int() - want.int()).abs().max().item() <= 1 and (got_f - want_f).abs().max().item() < 5e-5
    finite, pixels = decode_pixels(models, latents)  # a render's decode: the same bytes, image by image
    assert torch.equal(pixels, got) and finite.tolist() == [True, True]


KERNEL_CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from triton.runtime import interpreter
    from storyboard_cli.models import groupnorm as g

    # Triton 3.5's interpreter reads a runtime loop bound with int(array), which NumPy 2 refuses for a 1-element
    # array (later Triton patches the tensor class with a scope argument, and reads the bound itself)
    import inspect
    original = interpreter._patch_lang_tensor
    if len(inspect.signature(original).parameters) == 1:
        def patched(tensor):
            original(tensor)
            tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])
        interpreter._patch_lang_tensor = patched

    assert g.works_on(torch.device("cpu"))
    torch.manual_seed(0)
    # 63 positions: a partial chunk; 20 x 449 at 128 channels: 141 programs of two 32-position chunks, the last
    # program's second chunk past the end; an offset mean: a one-pass variance would lose digits
    for n, c, h, w, groups, affine in ((1, 64, 9, 7, 32, True), (2, 128, 40, 40, 32, True), (1, 32, 5, 13, 8, False),
                                       (1, 128, 20, 449, 32, True)):
        x = torch.randn(n, c, h, w) * 3 + 5
        wt, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
        for silu in (False, True):
            want = F.group_norm(x, groups, wt, b, 1e-6)
            want = F.silu(want) if silu else want
            for layout in (torch.contiguous_format, torch.channels_last):
                xx = x.contiguous(memory_format=layout)
                assert g.kernels_take(xx, c, groups)
                got = g.group_norm_kernels(xx, groups, wt, b, 1e-6, silu)
                assert got.is_contiguous(memory_format=layout)
                err = (got - want).abs().max().item()
                assert err < 2e-5, (n, c, h, w, silu, layout, err)

    # a resnet block fused (its biases in the second norm's kernels and in `residual_kernel`) against diffusers' own,
    # with a shortcut and without; channels_last (the decoder's layout) and NCHW
    from diffusers.models.resnet import ResnetBlock2D
    for out in (128, 64):
        block = ResnetBlock2D(in_channels=64, out_channels=out, temb_channels=None, groups=32).eval()
        for m in block.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.normal_(m.bias, 0.5, 1.0)
        x = torch.randn(1, 64, 9, 7) * 2 + 1
        with torch.no_grad():
            want = block(x, None)
            g.widen(block)
            assert g.fuse(block) == 2 and block.norm2.kernels and "forward" in block.__dict__
            for layout in (torch.contiguous_format, torch.channels_last):
                got = block(x.contiguous(memory_format=layout), None)
                assert layout != torch.channels_last or got.is_contiguous(memory_format=layout)
                err = (got - want).abs().max().item()
                assert err < 5e-5, (out, layout, err)
    print("ok")
""")


def test_the_kernels_compute_torchs_groupnorm_and_silu_in_tritons_interpreter():
    """The Triton kernels themselves, NCHW and channels_last, with and without the SiLU, against torch's GroupNorm, in
    Triton's interpreter on the CPU (where Triton is installed; torch's CPU builds come without it)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.gpu
def test_on_a_gpu_the_fused_channels_last_decoder_beats_the_wide_one_with_the_same_pixels():
    """What `fuse` adds on a GPU, against the decoder it replaced (the wide GroupNorm and the attention, NCHW): at
    least 5% faster at 1024x1024 and 832x1216, pixels within 1 level; and the same pixels at 2048x2048 (a hires
    pass's frame: more position blocks than a grid's second axis takes)."""
    from storyboard_cli.models.loader import load_sdxl
    from storyboard_cli.run.batch import decode

    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    assert channels_last(models.vae.decoder)
    assert sum(m.silu for m in models.vae.decoder.modules() if type(m) is WideGroupNorm) > 20
    wide = copy.copy(models)
    wide.vae = copy.deepcopy(models.vae)
    narrow(wide.vae.decoder)
    widen(wide.vae.decoder)  # the decoder as it was loaded before: wide norms, the SiLUs apart, NCHW

    for h, w in ((128, 128), (152, 104)):  # 1024x1024, 832x1216
        latents = torch.randn(1, 4, h, w, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        t_fused, ours = timed_decode(models, latents)
        t_wide, theirs = timed_decode(wide, latents)
        diff = (ours.int() - theirs.int()).abs()
        assert diff.max().item() <= 1 and diff.float().mean().item() < 0.05, (diff.max(), diff.float().mean())
        assert t_fused < 0.95 * t_wide, (h, w, t_fused, t_wide)
    latents = torch.randn(1, 4, 256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    diff = (decode(models, latents).int() - decode(wide, latents).int()).abs()
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.05, (diff.max(), diff.float().mean())


@pytest.mark.gpu
def test_on_a_gpu_the_blocks_with_their_biases_at_the_norm_and_the_end_give_the_same_bits_faster():
    """The decoder's resnet blocks with their convolutions' biases added in the second norm's kernels and at the
    block's end (`fused_resnet_forward`) against the same decoder with diffusers' block forward, where torch's
    convolution adds each bias in a pass of its own after cuDNN's output: the same floats bit for bit (the same
    additions in the same order) at 1024x1024 and 832x1216, and at 1024x1024 at least 3% faster (the kinds of pass
    the blocks drop, the bias additions and the divisions, were 7.0 and 2.0 of the 53 ms of a decode on an H100,
    benchmarks/results/decode/2026-12-07-5f2fe19-vae-h100.json, `profile_fused_cl_ms`)."""
    from storyboard_cli.models.loader import load_sdxl
    from storyboard_cli.run.batch import decode_on_device

    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    blocks = [m for m in models.vae.decoder.modules() if fused(m)]
    assert len(blocks) == 14  # SDXL's decoder: two in the middle, three in each of four up blocks
    apart = copy.copy(models)
    apart.vae = copy.deepcopy(models.vae)
    for m in apart.vae.decoder.modules():
        if fused(m):
            del m.forward
    assert not any(map(fused, apart.vae.decoder.modules()))
    for h, w in ((128, 128), (152, 104)):
        latents = torch.randn(1, 4, h, w, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        ours, theirs = decode_on_device(models, latents)[0], decode_on_device(apart, latents)[0]
        assert torch.equal(ours, theirs), (h, w, (ours - theirs).abs().max())
    latents = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    times = {"fused": [], "apart": []}
    for _ in range(3):  # alternating, the best of each
        times["fused"].append(timed_decode(models, latents)[0])
        times["apart"].append(timed_decode(apart, latents)[0])
    assert min(times["fused"]) < 0.97 * min(times["apart"]), times


def test_fuse_moves_no_silu_that_also_acts_on_a_time_embedding(monkeypatch):
    """A resnet block with a time embedding applies its SiLU to the embedding too: its SiLU and norms stay as they
    are; the block without one takes its SiLU into both norms, and both compute as before."""
    from diffusers.models.resnet import ResnetBlock2D

    timed_block = ResnetBlock2D(in_channels=64, out_channels=64, temb_channels=32, groups=32)
    plain_block = ResnetBlock2D(in_channels=64, out_channels=64, temb_channels=None, groups=32)
    net = nn.ModuleDict({"timed": timed_block, "plain": plain_block}).eval()
    x, temb = torch.randn(1, 64, 8, 8), torch.randn(1, 32)
    with torch.no_grad():
        want = timed_block(x, temb), plain_block(x, None)
    widen(net)
    monkeypatch.setattr(groupnorm, "works_on", lambda device, shapes: True)
    assert fuse(net) == 2
    assert type(timed_block.nonlinearity) is nn.SiLU and not timed_block.norm1.silu and not timed_block.norm2.silu
    assert type(plain_block.nonlinearity) is SiluInNorm and plain_block.norm1.silu and plain_block.norm2.silu
    assert fused(plain_block) and not fused(timed_block)
    with torch.no_grad():
        got = timed_block(x, temb), plain_block(x.contiguous(memory_format=torch.channels_last), None)
    assert all((g - w).abs().max().item() < 5e-5 for g, w in zip(got, want))


@pytest.mark.parametrize("shortcut", [False, True])
def test_a_fused_block_computes_diffusers_block(monkeypatch, shortcut):
    """`fused_resnet_forward` (the first convolution's bias added in the second norm, the second's and the shortcut's
    at the block's end, with the input) against diffusers' own forward, channels_last and NCHW, on the torch paths
    (the CPU without Triton); `residual` alone against its formula, with and without biases. A block with another
    output scale than 1 keeps diffusers' forward (the kernel has no division)."""
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    scaled = ResnetBlock2D(in_channels=64, out_channels=64, temb_channels=None, groups=32, output_scale_factor=2.0)
    widen(scaled)
    monkeypatch.setattr(groupnorm, "works_on", lambda device, shapes: True)
    assert fuse(scaled) == 2 and scaled.norm2.silu and not fused(scaled)
    block = ResnetBlock2D(in_channels=64, out_channels=128 if shortcut else 64, temb_channels=None, groups=32).eval()
    for m in block.modules():  # biases far from 0: a bias dropped or added twice shows
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.bias, 0.5, 1.0)
    x = torch.randn(2, 64, 10, 12)
    with torch.no_grad():
        want = block(x, None)
    widen(block)
    fuse(block)
    assert fused(block) and (block.conv_shortcut is not None) == shortcut
    with torch.no_grad():
        for layout in (torch.contiguous_format, torch.channels_last):
            assert (block(x.contiguous(memory_format=layout), None) - want).abs().max().item() < 5e-5
    a, h, b1, b2 = torch.randn(1, 8, 3, 4), torch.randn(1, 8, 3, 4), torch.randn(8), torch.randn(8)
    view = (1, 8, 1, 1)
    assert torch.equal(residual(a, b1, h, b2), (a + b1.view(view)) + (h + b2.view(view)))
    assert torch.equal(residual(a, None, h, None), a + h)
