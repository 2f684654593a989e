"""FP8 compiled UNet and ControlNet kernels (`--fp8`): the Linear layers of the transformer blocks in float8_e4m3fn
with STATIC per-tensor scales, inside the same per-size artifacts as the fp16 recipe (engine/kernels/): the recipe module
of the `fp8` row of engine/variants.py. The UNet and the job's first ControlNet (the one with an artifact) both.

- Which Linears: every Linear of a transformer block that reads image tokens (the fused q/k/v of self-attention,
  the cross-attention's query, the attention outputs, the GEGLU and feed-forward output, proj_in/proj_out). The
  cross-attention's key/value read the 77 text tokens and stay fp16, as do the embeddings. Each feed-forward's first
  Linear, GEGLU and the last Linear's quantisation are one kernel of ours (engine/kernels/geglu.py).
- The UNet's convolutions at its inner levels are FP8 too, a kernel of ours (engine/kernels/conv8.py: input per tensor,
  weight per output channel); the others, and all of the ControlNet's, stay fp16. `quantised` names every module
  whose input is quantised.
- Static scales: an input's scale is a constant, so its quantisation is a pointwise op the compiler fuses into the
  kernel that produces the input (LayerNorm, GEGLU); a dynamic scale needs a reduction first (55 ms per
  image-step measured, slower than fp16). The input scales come from calibration: a few eager calls of the module on
  the base model (`calibrate`; the ControlNet's with a sparse control image, `calibrate_controlnet`), once per
  module's weights, stored in the cache beside the artifacts (`scales`; a stored file that lacks a module the recipe now
  quantises is calibrated again). A Linear weight's scale is its own amax / 448.
- The FP8 weights and their scales are tensors derived from the rendering modules' own weights
  (SdxlModels.derive): an in-place write (a LoRA swap) re-quantises them in place, so the artifact's bound
  pointers stay valid. The input scales stay the base model's: a LoRA that makes an input larger saturates at
  448 x scale.
- FP8 changes the pictures more than compiled fp16 does (docs/PERFORMANCE.md, "FP8"): it is asked for, never
  chosen for the user; its first-replay check has its own limit (its row's `check_rtol`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from storyboard_cli.engine.kernels import conv8, geglu

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
CALIBRATION_T = (999.0, 750.0, 500.0, 250.0, 50.0)  # the sampler's range, noisiest first
CALIBRATION_PROMPTS = ("a storyboard frame, a character in a room, ink and wash",
                       "wide shot of a city street at night, cinematic lighting",
                       "close-up portrait, detailed face, soft light")
# inductor options an FP8 build adds: the FP8 GEMMs on cuBLASLt, as the fp16 ones run on cuBLAS (without it
# inductor's _scaled_mm lowering benchmarks Triton templates on the GPU during the build, which a background
# build must not do while a render runs)
OPTIONS = {"max_autotune_gemm_backends": "ATEN"}
PROJECTIONS = ("to_q", "to_k", "to_v", "to_qkv", "to_kv")


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b with x and W in float8_e4m3fn at static per-tensor scales (float32 scalars). Made without
    values: the artifact is compiled from shapes, and the rendering process binds its own tensors."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight
        kw = {"device": w.device}
        self.register_buffer("weight", torch.empty(w.shape, dtype=FP8, **kw))  # [N, K] row-major
        self.register_buffer("w_scale", torch.ones((), dtype=torch.float32, **kw))
        self.register_buffer("x_scale", torch.ones((), dtype=torch.float32, **kw))
        self.register_buffer("bias", None if linear.bias is None else torch.empty_like(linear.bias))
        self.out_dtype = w.dtype

    def quantise(self, x: torch.Tensor) -> torch.Tensor:
        """The input in float8_e4m3fn at its static scale, saturating at +-448: pointwise, so the compiler fuses it into
        the kernel that makes the input (a LayerNorm). An input already in FP8 was quantised at this scale by the
        kernel that made it (engine/kernels/geglu.py) and is taken as it is."""
        if x.dtype == FP8:
            return x
        return (x / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        lead, k = x.shape[:-1], x.shape[-1]
        xq = self.quantise(x)
        if x.device.type == "cpu":
            # the same arithmetic (FP8 values, float32 products and sums) as a float matmul of the dequantised values:
            # FP8 kernels run on FP8 GPUs only, and on the CPU (the tests') torch's _scaled_mm is a reference loop,
            # 0.14 s for one 512 x 64 x 64 product, which made one tiny UNet call take 30 s
            y = (xq.reshape(-1, k).float() * self.x_scale) @ (self.weight.float() * self.w_scale).t()
            y = (y if self.bias is None else y + self.bias).to(self.out_dtype)
            return y.reshape(*lead, y.shape[-1])
        # mat2 column-major, as _scaled_mm wants it: the transpose of the row-major [N, K] weight
        y = torch._scaled_mm(xq.reshape(-1, k), self.weight.t(), scale_a=self.x_scale, scale_b=self.w_scale,
                             bias=self.bias, out_dtype=self.out_dtype)
        return y.reshape(*lead, y.shape[-1])


def linears(unet: torch.nn.Module) -> dict[str, str]:
    """name of each Linear the FP8 kernels run (in the fused module the export sees) -> the name of the module
    whose input is its input in the rendering process (whose attention processors call to_q, to_k and to_v
    apart). Needs fused projections (kernels/export.py fuse_projections)."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    out = {}
    for prefix, block in unet.named_modules():
        if not isinstance(block, Transformer2DModel):
            continue
        for n, m in block.named_modules():
            name = f"{prefix}.{n}"
            if isinstance(m, Attention):  # the cross-attention's key/value read 77 text tokens: fp16
                out[f"{name}.to_q" if m.is_cross_attention else f"{name}.to_qkv"] = f"{name}.to_q"
            elif isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] not in PROJECTIONS:
                out[name] = name
    return out


def quantised(unet: torch.nn.Module) -> dict[str, str]:
    """`linears`, and a UNet's FP8 convolutions (engine/kernels/conv8.py `convs`: each its own input's module): every
    module whose input the FP8 kernels quantise at a calibrated scale."""
    return {**linears(unet), **{name: name for name in conv8.convs(unet)}}


def swap_in(unet: torch.nn.Module) -> int:
    """Replaces the FP8 Linears of a fused UNet (what the export sees) by Fp8Linear; returns how many."""
    return conv8.replace(unet, list(linears(unet)), Fp8Linear)


def rewrite(unet: torch.nn.Module) -> int:
    """The `fp8` row's change to the module the export sees (a fused UNet or ControlNet): its FP8 Linears swapped in,
    a UNet's inner convolutions too (engine/kernels/conv8.py), then each feed-forward's first Linear, GEGLU and the
    last Linear's quantisation made one kernel (engine/kernels/geglu.py); returns how many Linears are FP8."""
    count = swap_in(unet)
    conv8.swap_in(unet)
    geglu.fuse(unet)
    return count


# ------------------------------------------------------------------ the rendering process's tensors


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (its float8_e4m3fn values, its per-tensor scale amax / 448, float32 [])."""
    scale = w.detach().abs().amax().float().clamp_min(1e-12) / FP8_MAX
    return (w.detach().float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def module_name(models: Any, module: torch.nn.Module) -> str:
    """The artifact module `module` is in `models` ("unet" or "controlnet"): what keeps their derived tensors and
    stored scales apart (both have a `down_blocks.1.attentions.0...`)."""
    return "unet" if module is models.unet else "controlnet"


def weights(models: Any, unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Constant name (without the module prefix) -> tensor, for every FP8 Linear of `unet` (the UNet or a
    ControlNet) and FP8 convolution: its FP8 weight and weight scale (derived from the live weight, re-quantised in
    place after any write to it or to a q/k/v view of it)."""
    out, kind = {}, module_name(models, unet)
    for name in linears(unet):
        linear = unet.get_submodule(name)
        w = linear.weight
        views = [getattr(unet.get_submodule(name.rpartition(".")[0]), p).weight for p in ("to_q", "to_k", "to_v")] \
            if name.endswith(".to_qkv") else []

        def make(w=w):
            return quantize(w)

        def refresh(pair, w=w):
            q, s = quantize(w)
            pair[0].copy_(q)
            pair[1].copy_(s)

        q, s = models.derive(f"fp8:{kind}:{name}", [w, *views], make, refresh)
        out[f"{name}.weight"], out[f"{name}.w_scale"] = q, s
    for name in conv8.convs(unet):  # [N, R, S, C] FP8 and a scale per output channel, re-quantised in place as above
        w = unet.get_submodule(name).weight

        def refresh_conv(pair, w=w):
            q, s = conv8.quantize(w)
            pair[0].copy_(q)
            pair[1].copy_(s)

        q, s = models.derive(f"fp8:{kind}:{name}", [w], partial(conv8.quantize, w), refresh_conv)
        out[f"{name}.weight"], out[f"{name}.w_scale"] = q, s
    return out


def input_scales(amax: dict[str, float], unet: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Constant name -> the x_scale tensor of each FP8 Linear and convolution, from the calibrated input amax."""
    out = {}
    for name in quantised(unet):
        if name not in amax:
            raise RuntimeError(f"no calibrated FP8 input scale for {name}")
        out[f"{name}.x_scale"] = torch.tensor(max(amax[name], 1e-12) / FP8_MAX, dtype=torch.float32, device=device)
    return out


# ------------------------------------------------------------------ calibration


def fingerprint(models: Any, module: torch.nn.Module | None = None) -> str:
    """A module's identity for its stored scales (the UNet's by default): its name, parameter names and shapes, and a
    sample of every parameter's values (weights from another file, or fine-tuned ones, are another model). A
    ControlNet's is its own, whatever UNet it runs beside (its calibration calls use the model's text encoders)."""
    unet = models.unet if module is None else module
    named = [(n, p) for n, p in unet.named_parameters() if not n.endswith(("to_qkv.weight", "to_kv.weight",
                                                                          "to_qkv.bias", "to_kv.bias"))]
    with torch.no_grad():
        sample = torch.cat([p.detach().reshape(-1)[:: max(1, p.numel() // 16)][:16].float() for _, p in named])
    name = models.name if unet is models.unet else [models.name, module_name(models, unet)]
    h = hashlib.sha256(json.dumps([name, [(n, list(p.shape), str(p.dtype)) for n, p in named]]).encode())
    h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()[:20]


def input_amax(module: torch.nn.Module, run: Callable[[], None]) -> dict[str, float]:
    """name -> the amax of each FP8 module's input in `module` (a fused UNet or ControlNet, `quantised`) over the calls
    `run()` makes, read by hooks on the modules whose input is theirs in the rendering process."""
    seen: dict[str, torch.Tensor] = {}

    def record(names, _module, args):
        amax = args[0].detach().abs().amax().float()
        for name in names:
            seen[name] = amax if name not in seen else torch.maximum(seen[name], amax)

    by_input: dict[str, list[str]] = {}
    for name, source in quantised(module).items():
        by_input.setdefault(source, []).append(name)
    hooks = [module.get_submodule(s).register_forward_pre_hook(partial(record, names))
             for s, names in by_input.items()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n in quantised(module) if n not in seen]
    if missing:
        raise RuntimeError(f"calibration never reached {len(missing)} FP8 modules, e.g. {missing[0]}")
    return {n: a.item() for n, a in seen.items()}


def calibration_steps(models: Any) -> Iterator[tuple[torch.Tensor, ...]]:
    """(latents, t, embeds, pooled, time_ids) of each calibration call: a few prompts against the empty negative,
    unit-normal latents (the sampler's scaled input) at the model's native size, at each of CALIBRATION_T."""
    from storyboard_cli.engine.conditioning import encode_text, time_ids

    unet, dev, dt = models.unet, models.device, models.dtype
    embeds, pooled = encode_text(models, list(CALIBRATION_PROMPTS))
    embeds = torch.cat([torch.zeros_like(embeds), embeds]).to(dt)  # the empty negative's rows are zeros
    pooled = torch.cat([torch.zeros_like(pooled), pooled]).to(dt)
    side = 8 * unet.config.sample_size
    rows = embeds.shape[0]
    ids = time_ids(side, side, rows, dt, dev)
    g = torch.Generator().manual_seed(0)
    for t in CALIBRATION_T:
        latents = torch.randn(rows, unet.config.in_channels, side // 8, side // 8, generator=g).to(dev, dt)
        yield latents, torch.full((rows,), t, device=dev), embeds, pooled, ids


@torch.no_grad()
def calibrate(models: Any) -> dict[str, float]:
    """name -> the amax of each FP8 Linear's input over eager UNet calls on the base model (`calibration_steps`). The
    rendering UNet must carry no LoRA now."""
    from storyboard_cli.engine.eager import unet_call

    def run() -> None:
        for latents, t, embeds, pooled, ids in calibration_steps(models):
            unet_call(models.unet, latents, t, embeds, pooled, ids, None, None)

    return input_amax(models.unet, run)


@torch.no_grad()
def calibrate_controlnet(models: Any) -> dict[str, float]:
    """name -> the amax of each FP8 Linear's input in the first ControlNet (the one with an artifact) over eager calls:
    the UNet's calibration calls (`calibration_steps`) with a sparse random control image (edges, lines and poses are
    mostly black) at full scale."""
    from storyboard_cli.engine.eager import controlnet_call

    net, dev, dt = models.controlnets[0], models.device, models.dtype
    g = torch.Generator().manual_seed(1)

    def run() -> None:
        for latents, t, embeds, pooled, ids in calibration_steps(models):
            rows, side = latents.shape[0], 8 * latents.shape[-1]
            image = (torch.rand(rows, 3, side, side, generator=g) > 0.9).to(dev, dt)
            scale = torch.ones(rows, 1, 1, 1, dtype=dt, device=dev)
            controlnet_call(net, latents, t, embeds, pooled, ids, image, scale)

    return input_amax(net, run)


def scales(models: Any, root: Path, module: str = "unet") -> tuple[dict[str, float], Path, bool]:
    """The base model's calibrated input amax of `module` ("unet", "controlnet": the first net): from `root` when stored
    for these weights, else calibrated now and stored (atomically). Returns (amax by name, the file, whether it was
    calibrated now)."""
    net = models.unet if module == "unet" else models.controlnets[0]
    path = root / f"fp8-scales-{fingerprint(models, net)}.json"
    if path.is_file():
        try:
            amax = json.loads(path.read_text())["amax"]
            if not set(quantised(net)) - set(amax):
                return amax, path, False
            log.warning("stored FP8 scales %s lack modules FP8 now quantises: calibrating again", path.name)
        except (ValueError, KeyError, OSError) as e:
            log.warning("stored FP8 scales %s unreadable (%s): calibrating again", path.name, e)
    amax = calibrate(models) if module == "unet" else calibrate_controlnet(models)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"model": models.name, "calibration_t": CALIBRATION_T,
                               "prompts": CALIBRATION_PROMPTS, "amax": amax}, indent=1) + "\n")
    os.replace(tmp, path)
    return amax, path, True


class InputScales:
    """The FP8 artifacts' constants beyond the modules' own tensors (the `fp8` row's `constants`), prepared once per run
    before any LoRA is applied: the base model's input scales of the UNet and, where the models have one, of the first
    ControlNet, from `root` when stored, else calibrated now; and per artifact the FP8 weights and weight scales derived
    from the live weights (`tensors`)."""

    def __init__(self, models: Any, root: Path):
        self.x_scales: dict[str, dict[str, torch.Tensor]] = {}  # "unet" / "controlnet" -> constant name -> x_scale
        self.files: list[Path] = []
        hows = []
        for module in ("unet", "controlnet")[: 1 + bool(models.controlnets)]:
            t0 = time.perf_counter()
            amax, file, calibrated = scales(models, root, module)
            net = models.unet if module == "unet" else models.controlnets[0]
            self.x_scales[module] = input_scales(amax, net, models.device)
            self.files.append(file)
            hows.append(f"{module} calibrated now in {time.perf_counter() - t0:.1f} s" if calibrated
                        else f"{module} stored")
        self.file = self.files[0]
        what = "UNet and ControlNet" if models.controlnets else "UNet"
        self.note = f"{what} kernels in FP8 (--fp8): input scales {', '.join(hows)}, {', '.join(map(str, self.files))}"

    def tensors(self, models: Any, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {**weights(models, module), **self.x_scales[module_name(models, module)]}
