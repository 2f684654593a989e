"""The VAE decoder's GroupNorm, computed with the whole GPU.

bcg decodes one image at a time (run/batch.py decode), and torch's GroupNorm kernel reduces each (image, group) pair
in one thread block: 32 blocks for SDXL's 32 groups, each reading 4-16 million elements at the decoder's largest
sizes, on a GPU with 132 multiprocessors. On the H200 its moments kernel was 45 of the 116 ms of a 1024x1024 fp32
decode (docs/PERFORMANCE.md, "The VAE decode"). `WideGroupNorm` computes the same function: the statistics are one
`torch.var_mean` over the same rows (torch's reductions spread a long row over many blocks), and the normalisation and
affine one `addcmul` per element. Only in float32, SDXL's decode dtype: in fp16 or bf16 the affine would round twice
where torch's kernel rounds once (2x its error against float32 in bf16), so those keep torch's kernel.
"""

from __future__ import annotations

import torch
from torch import nn


class WideGroupNorm(nn.GroupNorm):
    """nn.GroupNorm with the same parameters and state dict; a contiguous float32 input of 3 or more dimensions takes
    the wide path, anything else torch's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or not x.is_contiguous() or x.dtype != torch.float32:
            return super().forward(x)
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """F.group_norm(x, groups, weight, bias, eps) for a contiguous float32 [N, C, ...] x."""
    n, c = x.shape[:2]
    var, mean = torch.var_mean(x.view(n * groups, -1), dim=1, correction=0)
    rstd = torch.rsqrt(var + eps).view(n, groups, 1)
    # per channel: y = x * a + b, a = rstd * weight, b = bias - mean * rstd * weight
    a = rstd.expand(n, groups, c // groups).reshape(n, c)
    if weight is not None:
        a = a * weight
    b = -mean.view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c) * a
    if bias is not None:
        b = b + bias
    shape = (n, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(b.view(shape), x, a.view(shape))


def widen(module: nn.Module) -> int:
    """Every nn.GroupNorm under `module` computes through WideGroupNorm from now on (same parameters, same
    state dict). Returns how many."""
    return _swap(module, nn.GroupNorm, WideGroupNorm)


def narrow(module: nn.Module) -> int:
    """The inverse of `widen`: torch's GroupNorm again (for a copy of the VAE that is to run as users run it)."""
    return _swap(module, WideGroupNorm, nn.GroupNorm)


def _swap(module: nn.Module, old: type, new: type) -> int:
    found = [m for m in module.modules() if type(m) is old]
    for m in found:
        m.__class__ = new
    return len(found)
