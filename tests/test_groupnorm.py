"""The VAE decoder's wide GroupNorm (models/groupnorm.py): the same function as torch's, the same parameters, and on a
GPU the same pixels as torch's kernel, faster."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from storyboard_cli.models.groupnorm import WideGroupNorm, group_norm, narrow, widen


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
    from storyboard_cli.run.batch import decode

    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    wide = [m for m in models.vae.decoder.modules() if isinstance(m, nn.GroupNorm)]
    assert wide and all(type(m) is WideGroupNorm for m in wide)
    latents = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    native = copy.deepcopy(models.vae)
    narrow(native)
    torch_models = copy.copy(models)
    torch_models.vae = native

    def timed(m):
        decode(m, latents)
        torch.cuda.synchronize()
        start = time.perf_counter()
        pixels = [decode(m, latents)[1] for _ in range(3)][-1]
        return (time.perf_counter() - start) / 3, pixels

    t_wide, ours = timed(models)
    t_torch, theirs = timed(torch_models)
    diff = (ours.int() - theirs.int()).abs()
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.1, (diff.max(), diff.float().mean())
    assert t_wide < 0.85 * t_torch, (t_wide, t_torch)
