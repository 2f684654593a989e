"""The VAE decoder's attention on the matrix units (models/vae_attention.py): the same function as diffusers' float32
attention, within TF32's rounding, at any magnitude; on a GPU the same pixels, faster."""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.gpu import timed_decode
from storyboard_cli.models import vae_attention
from storyboard_cli.models.vae_attention import DecoderAttention, attend, attention, unattend


def reference(q, k, v, heads):
    b, n, inner = q.shape
    split = lambda t: t.view(b, -1, heads, inner // heads).transpose(1, 2)  # noqa: E731
    return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(b, n, inner)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("b,n,heads,d,chunk,magnitude", [(1, 300, 1, 64, 128, 1.0), (2, 257, 2, 32, 100, 1.0),
                                                          (1, 200, 1, 64, 64, 1e6), (1, 200, 1, 64, 4096, 1e-4)])
def test_the_same_function_as_float32_attention_within_tf32s_rounding(b, n, heads, d, chunk, magnitude):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, heads * d, generator=g) * magnitude for _ in range(3))
    k[:, 7] += 3 * magnitude  # one position that draws the attention, beside a diffuse rest
    ours, theirs = attention(q, k, v, heads, chunk=chunk), reference(q, k, v, heads)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    # fp16 inputs scaled by their own maximum: fp16's 11 bits, whatever the magnitude (1e6 overflows fp16 unscaled)
    assert torch.isfinite(ours).all() and rel(ours, theirs) < 2e-3, rel(ours, theirs)


def decoder_attention_blocks(vae):
    from diffusers.models.attention_processor import Attention

    return [m for m in vae.decoder.modules() if isinstance(m, Attention)]


def test_the_processor_computes_the_block_as_diffusers_does(tiny_cpu, monkeypatch):
    """The processor's own path (taken on a GPU in float32), run on the CPU: the block's norm, projections, residual
    and rescale wired as diffusers' processor wires them."""
    vae = copy.deepcopy(tiny_cpu.vae)
    blocks = decoder_attention_blocks(vae)
    assert blocks, "the tiny VAE's decoder has its attention block"
    block = blocks[0]
    c = block.to_q.in_features
    x = torch.randn(2, c, 6, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = block(x)
        assert attend(vae.decoder) == len(blocks) and isinstance(block.processor, DecoderAttention)
        assert torch.equal(block(x), theirs)  # on the CPU: diffusers' processor, untouched
        monkeypatch.setattr(vae_attention, "takes", lambda h: True)
        ours = block(x)
        # a channels_last decoder's input (models/groupnorm.py fuse): the same function, its output channels_last
        ours_cl = block(x.contiguous(memory_format=torch.channels_last))
    assert ours.shape == theirs.shape and rel(ours, theirs) < 2e-3, rel(ours, theirs)
    assert ours_cl.is_contiguous(memory_format=torch.channels_last) and rel(ours_cl, theirs) < 2e-3
    assert attend(vae.decoder) == 0  # once
    assert unattend(vae.decoder) == len(blocks) and not isinstance(block.processor, DecoderAttention)


def test_the_cpu_loader_keeps_diffusers_attention(tiny_cpu):
    assert not any(isinstance(b.processor, DecoderAttention) for b in decoder_attention_blocks(tiny_cpu.vae))


@pytest.mark.gpu
def test_on_a_gpu_the_decode_is_faster_with_the_same_pixels():
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    assert all(isinstance(b.processor, DecoderAttention) for b in decoder_attention_blocks(models.vae))
    plain = copy.copy(models)
    plain.vae = copy.deepcopy(models.vae)
    assert unattend(plain.vae) == 1

    for h, w in ((128, 128), (152, 104)):  # 1024x1024, 832x1216
        latents = torch.randn(1, 4, h, w, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        t_ours, ours = timed_decode(models, latents)
        t_plain, theirs = timed_decode(plain, latents)
        diff = (ours.int() - theirs.int()).abs()
        assert diff.max().item() <= 1 and diff.float().mean().item() < 0.05, (diff.max(), diff.float().mean())
        assert t_ours < 0.95 * t_plain, (h, w, t_ours, t_plain)


def test_attend_leaves_a_decoder_whose_device_fails_the_check_as_it_was(tiny_cpu, monkeypatch):
    vae = copy.deepcopy(tiny_cpu.vae)
    monkeypatch.setattr(vae_attention, "works_on", lambda device: False)
    assert attend(vae.decoder) == 0
    assert not any(isinstance(b.processor, DecoderAttention) for b in decoder_attention_blocks(vae))
