"""What the export sees: the step's UNet and ControlNet calls as modules, their example inputs with the rows dynamic,
and the compiled recipe applied to the module (`export`; engine/kernels/artifacts.py compiles and packages it).

- The recipe: the attention projections fused as diffusers' `fuse_qkv_projections` (one GEMM for q, k and v), every
  convolution weight channels_last (NHWC convolutions, no layout flips), 1x1 convolutions as matmuls (an inductor
  option), then the variant's own rewrite (engine/variants.py: FP8's Linears). The rendering process keeps its own
  attention processors and NCHW weights, so the plain graphs and the eager step are untouched: to_q, to_k and to_v
  become views into the fused weight, and the convolutions' channels_last weights are copies that every in-place
  weight write refreshes (SdxlModels.written). A LoRA swap reaches the compiled kernels as it reaches the plain ones,
  and no pointer a graph holds changes.
- The UNet's up blocks concatenate their hidden states with the skip along the channels, and each resnet normalises
  that and feeds it to two convolutions. Inductor keeps the concatenation NCHW (its channels_last propagation is off
  for convolutions with dynamic rows), so the GroupNorm + SiLU kernel after it read NCHW and wrote two NHWC copies in a
  1D kernel whose stores are C elements apart: about 11 ms of an 8 x 1024² step in six kernels
  (docs/PERFORMANCE.md). `SkipCatNhwc` exports each such concatenation along the last dimension of NHWC views, so
  the buffer is NHWC, and the norm and the 1x1 shortcut read it in place.
- The ControlNet is exported apart from its conditioning embedding (`CONTROLNET_RECIPE`): it takes the guide as the
  embedding made it once per batch (engine/conditions/control.py `embed_guide`), channels_last, where it ran the
  embedding's eight convolutions at every step for every row: 1.6 ms of a 2 x 1024² +control step, 3.0 at 4 images,
  5.3 at 8 (compiled, H100; benchmarks/results/step/2026-12-06-feac414-cn-embed-h100.json).
- The UNet is exported WITH ControlNet residual inputs; a shape without ControlNet feeds it zeros, so one UNet
  artifact per size serves both.
- A UNet with an IP-Adapter's processors (models/ip_adapter.py) is exported with three more inputs, the step's
  reference tokens, per-row scale and slot mask (engine/conditions/reference.py Refs), and keeps those processors (they read
  to_k / to_v, views into the fused weight): `Target.refs`, the width of the tokens, is part of its key.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from storyboard_cli.engine.conditions.control import embedding_apart, guide_channels
from storyboard_cli.engine.eager import controlnet_call, unet_call
from storyboard_cli.engine.variants import COMPILED, PRECISIONS, VARIANTS, Variant
from storyboard_cli.models.tokenizers import CLIP_TOKENS

MIN_ROWS = 2  # rows = 2 x images (CFG) or, for the conditional rows alone, the images
# the most rows an artifact takes: 8 images guided (the default buckets' largest, CFG doubled) or the conditional rows
# of 16; a batch of more rows runs the plain graphs
MAX_ROWS = 16
RECIPE = ("fused-qkv", "channels-last-weights")  # part of the key: what `export` does to the module
PERSISTENT_INNER = 2048  # the most elements of an inner reduction the UNet's kernels make in one pass
# the UNet's own part of it: SkipCatNhwc, and its builds' inductor choices (artifacts.unet_choices)
UNET_RECIPE = ("skip-cat-nhwc", f"persistent-inner-{PERSISTENT_INNER}")
CONTROLNET_RECIPE = ("guide-embedded-apart",)  # the ControlNet's: its embedding outside the artifact (ControlNetCall)


@dataclass(frozen=True, order=True)
class Target:
    """One artifact: a module compiled for one image size (pixels), rows dynamic."""

    module: str  # "unet" | "controlnet"
    height: int
    width: int
    precision: str = VARIANTS[COMPILED].precision  # another compiled row's: the UNet's FP8 kernels ("fp8")
    refs: int = 0  # a UNet with an IP-Adapter: its reference tokens per row (slots x tokens per image); 0 without
    tags: tuple[str, ...] = ()  # a UNet taking further kinds' inputs: each such kind's tag (Export.artifact), in table order

    @property
    def variant(self) -> Variant:
        return PRECISIONS[self.precision]

    @property
    def tag(self) -> str:
        """What sets the artifact apart from the fp16 one in its label and file name ("" for fp16)."""
        return "" if self.variant.name == COMPILED else self.precision

    @property
    def label(self) -> str:
        return (f"{self.module} {self.width}x{self.height}" + (f" {self.tag}" if self.tag else "")
                + (f" +refs {self.refs}" if self.refs else "") + "".join(f" +{t}" for t in self.tags))


class UNetCall(torch.nn.Module):
    """The step's UNet call (engine/eager.py unet_call) as a module to export: down is a tuple; `ref_*` an
    IP-Adapter's tokens, per-row scale and slot mask (engine/conditions/reference.py Refs), or None; `tagged` the
    inputs of the kinds an artifact is tagged with (Target.tags), named by `names`. An artifact reads its inputs as
    one flat list of tensors, in Conditions.attention's order, which is this order."""

    def __init__(self, unet: torch.nn.Module, names: tuple[str, ...] = ()):
        super().__init__()
        self.unet, self.names = unet, names

    # the artifacts' traced signature (prebuilt kernels are keyed by it): these names stay
    def forward(self, latents, t, embeds, pooled, time_ids, mid, down, ref_tokens=None, ref_scale=None, ref_mask=None,
                tagged=()):
        attention = {} if ref_tokens is None else {"ref_tokens": ref_tokens, "ref_scale": ref_scale,
                                                    "ref_mask": ref_mask}
        attention.update(zip(self.names, tagged, strict=True))
        return unet_call(self.unet, latents, t, embeds, pooled, time_ids, mid, list(down), attention or None)


class ControlNetCall(torch.nn.Module):
    """The step's ControlNet call (engine/eager.py controlnet_call) as a module to export: the net apart from its
    conditioning embedding (engine/conditions/control.py `embedding_apart`), which takes the guide embedded once per
    batch."""

    def __init__(self, controlnet: torch.nn.Module):
        super().__init__()
        self.controlnet = embedding_apart(controlnet)

    def forward(self, latents, t, embeds, pooled, time_ids, guide, scale):
        return controlnet_call(self.controlnet, latents, t, embeds, pooled, time_ids, guide, scale)


@dataclass(frozen=True)
class Residuals:
    """Shapes of the UNet's ControlNet residual inputs, as multiples of the latent side: (channels, divisor)."""

    down: tuple[tuple[int, int], ...]
    mid: tuple[int, int]

    @classmethod
    def of(cls, unet: torch.nn.Module) -> Residuals:
        # as diffusers' ControlNetModel: conv_in, then each down block's resnets and downsampler
        cfg = unet.config
        chans, divisor = [(cfg.block_out_channels[0], 1)], 1
        for i, c in enumerate(cfg.block_out_channels):
            chans += [(c, divisor)] * cfg.layers_per_block
            if i < len(cfg.block_out_channels) - 1:
                divisor *= 2
                chans.append((c, divisor))
        return cls(tuple(chans), (cfg.block_out_channels[-1], divisor))

    def zeros(self, rows: int, h: int, w: int, dtype: torch.dtype, device: torch.device):
        mid = torch.zeros(rows, self.mid[0], h // self.mid[1], w // self.mid[1], dtype=dtype, device=device)
        return mid, [torch.zeros(rows, c, h // d, w // d, dtype=dtype, device=device) for c, d in self.down]


def text_dims(model: torch.nn.Module) -> tuple[int, int]:
    """(token embedding width, pooled embedding width) from a UNet's or ControlNet's own config (SDXL's
    text_time embedding: the pooled text plus 6 time ids of addition_time_embed_dim each)."""
    cfg = model.config
    return cfg.cross_attention_dim, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim


def example_inputs(module: str, model: torch.nn.Module, rows: int, h: int, w: int, refs: int = 0,
                   tagged: dict[str, torch.Tensor] | None = None) -> tuple:
    """Inputs of the exported call for `model` at latent size h x w (values do not matter); `refs`: Target.refs;
    `tagged`: the tagged kinds' inputs (`tagged_inputs`), a UNet's last input (UNetCall)."""
    dtype, device = model.dtype, model.device
    text_dim, pooled_dim = text_dims(model)
    latents = torch.randn(rows, 4, h, w, dtype=dtype, device=device)
    # float32 whatever the default dtype (a build child sets the model's): the step passes its float32 timestep,
    # and an artifact reads its inputs as the dtypes it was exported with, unchecked
    t = torch.tensor(500.0, dtype=torch.float32, device=device)
    embeds = torch.randn(rows, CLIP_TOKENS, text_dim, dtype=dtype, device=device)
    pooled = torch.randn(rows, pooled_dim, dtype=dtype, device=device)
    time_ids = torch.tensor([8 * h, 8 * w, 0, 0, 8 * h, 8 * w], dtype=dtype, device=device).expand(rows, 6).clone()
    if module == "controlnet":  # the embedded guide, channels_last as `embed_guide` makes it
        guide = nhwc(torch.randn(rows, guide_channels(model), h, w, dtype=dtype, device=device))
        return latents, t, embeds, pooled, time_ids, guide, torch.ones(rows, 1, 1, 1, dtype=dtype, device=device)
    mid, down = Residuals.of(model).zeros(rows, h, w, dtype, device)
    # channels_last, as the compiled ControlNet (channels_last convolutions) hands them over
    mid, down = nhwc(mid), tuple(nhwc(d) for d in down)
    args = (latents, t, embeds, pooled, time_ids, mid, down)
    if refs:  # the IP-Adapter's tokens, per-row scale and additive slot mask, as the step's static buffers hold them
        args += (torch.randn(rows, refs, text_dim, dtype=dtype, device=device),
                 torch.ones(rows, 1, 1, dtype=dtype, device=device),
                 torch.zeros(rows, 1, 1, refs, dtype=dtype, device=device))
    if tagged:
        args += (() if refs else (None, None, None)) + (tuple(tagged.values()),)  # after the IP-Adapter's three
    return args


def tagged_inputs(model: torch.nn.Module, rows: int, h: int, w: int, tags: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The inputs of the kinds an artifact is tagged with, by name, in table order (each kind's Export hooks)."""
    out = {}
    for row, tag in tagged(tags):
        out.update(row.export.inputs(model, tag, rows, 8 * h, 8 * w))
    return out


def tagged(tags: tuple[str, ...]) -> list[tuple[Any, str]]:
    """(the kind's row, its tag) for each of an artifact's tags: the row whose `artifact` tag starts the same."""
    from storyboard_cli.engine.conditions import KINDS

    out = []
    for tag in tags:
        rows = [row for row in KINDS.values() if row.export is not None and tag.startswith(row.export.tag)]
        if len(rows) != 1:
            raise ValueError(f"an artifact tag no conditioning kind names: {tag!r}")
        out.append((rows[0], tag))
    return out


def nhwc(t: torch.Tensor) -> torch.Tensor:
    """channels_last, as the artifacts' convolutions read their inputs."""
    return t.contiguous(memory_format=torch.channels_last)


def dynamic_shapes(args: tuple) -> tuple:
    """torch.export Dims: the rows of every batched input dynamic (2..MAX_ROWS), everything else static."""
    from torch.export import Dim

    rows = Dim("rows", min=MIN_ROWS, max=MAX_ROWS)

    def spec(a):
        if a is None:
            return None
        return tuple(spec(x) for x in a) if isinstance(a, tuple) else (None if a.dim() == 0 else {0: rows})
    return tuple(spec(a) for a in args)


def fuse_projections(model: torch.nn.Module, processor: bool = False) -> None:
    """Attention projections fused as diffusers' fuse_qkv_projections (q, k, v of self-attention; k, v of
    cross-attention), with to_q/to_k/to_v left as views into the fused weight: one storage, so a write
    to either (a LoRA swap) is seen by both. `processor`: also switch to diffusers' fused processor (the
    export does; the rendering process keeps its processors, and with them the plain step's numbers)."""
    from diffusers.models.attention_processor import Attention, FusedAttnProcessor2_0

    with torch.no_grad():
        for attn in model.modules():
            if not isinstance(attn, Attention) or getattr(attn, "bcg_fused", False):
                continue
            attn.fuse_projections()
            fused, parts = ((attn.to_kv, (attn.to_k, attn.to_v)) if attn.is_cross_attention
                            else (attn.to_qkv, (attn.to_q, attn.to_k, attn.to_v)))
            fused.requires_grad_(False)
            start = 0
            for part in parts:
                n = part.weight.shape[0]
                part.weight.data = fused.weight.data[start:start + n]  # a row slice: contiguous
                if part.bias is not None:
                    part.bias.data = fused.bias.data[start:start + n]
                start += n
            attn.bcg_fused = True
    if processor:
        model.set_attn_processor(FusedAttnProcessor2_0())


def channels_last_weights(models: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> a channels_last copy of each 4-d weight of `model` (what the artifact's convolutions read),
    made once and registered with `models`, whose `written` refreshes a copy after an in-place write."""
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 4:
            out[name] = models.copy_of(p, lambda t: t.contiguous(memory_format=torch.channels_last))
    return out


class SkipCatNhwc(torch.overrides.TorchFunctionMode):
    """While exporting the UNet: `torch.cat` of 4-d tensors along the channels (the up blocks' hidden states and skip)
    as the concatenation of their NHWC views along the last dimension, viewed back as NCHW. The same values; the buffer
    inductor makes for it is laid out NHWC, as the convolutions after it read."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat:
            tensors = args[0] if args else kwargs["tensors"]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if dim in (1, -3) and len(tensors) > 1 and all(t.dim() == 4 for t in tensors):
                return torch.cat([t.permute(0, 2, 3, 1) for t in tensors], dim=3).permute(0, 3, 1, 2)
        return func(*args, **kwargs)


def export(target: Target, model: torch.nn.Module) -> torch.export.ExportedProgram:
    """`model` (a UNet or ControlNet: its values do not matter) with the recipe applied, its call exported for
    `target`'s image size, the rows dynamic."""
    # an IP-Adapter's processors (modules: they hold its weights) and a kind's in the cross-attentions (the regions')
    # stay: they read to_k / to_v, views into the fused weight; the self-attentions take diffusers' fused processor
    kept = {n: p for n, p in model.attn_processors.items()
            if isinstance(p, torch.nn.Module) or (".attn2." in n and target.tags)}
    fuse_projections(model, processor=True)
    if kept:
        model.set_attn_processor({**model.attn_processors, **kept})
    model.to(memory_format=torch.channels_last)
    rewrite = target.variant.rewrite
    if rewrite is not None:
        rewrite(model)
    h, w = target.height // 8, target.width // 8
    tagged = tagged_inputs(model, MIN_ROWS, h, w, target.tags)
    args = example_inputs(target.module, model, MIN_ROWS, h, w, target.refs, tagged)
    wrapper = UNetCall(model, tuple(tagged)) if target.module == "unet" else ControlNetCall(model)
    with torch.no_grad(), SkipCatNhwc() if target.module == "unet" else contextlib.nullcontext():
        return torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes(args), strict=False)
