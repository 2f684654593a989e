"""Decode scout: where the VAE decode's time goes, and what each way of running it costs and changes.

The render decodes one image at a time through SDXL's VAE in fp32 (its config asks for the upcast). This times, per
image at one size, in one process, variants interleaved loop by loop (median of the loops):
  fp32        the VAE's decode with torch's own GroupNorm: fp32, NCHW, cuDNN's heuristics (the reference)
  wide        the same with the decoder's GroupNorms wide (models/groupnorm.py widen)
  fast        wide, and the attention block on the matrix units (models/vae_attention.py): bcg's decoder before fuse
  product     run/batch.py decode itself (the decoder as bcg loads it on a GPU, with the pixels' copy to the CPU)
  fp32_bench  the same with torch.backends.cudnn.benchmark on
  fp32_cl     fp32, weights and input channels_last
  fast_cl     fast, weights and input channels_last, its wide GroupNorm reading channels_last (`group_norm_cl`)
  fused       fast, each GroupNorm and the SiLU after it one pass of Triton (models/groupnorm.py fuse), NCHW
  fused_cl    fused, channels_last: the statistics and the pass over NHWC, cuDNN's convolutions without conversions
              (as bcg loads the decoder on a GPU since the twenty-second session)
  fp32_graph  fp32, the decoder call captured in a CUDA graph
  fused_cl_apart  fused_cl with diffusers' resnet block forward back (each convolution's bias a pass of its own, the
              block's end an addition and a division): bcg's decoder before `fused_resnet_forward`
  fused_cl_h  fused_cl with every convolution of the decoder in fp16: its input divided by the input's largest
              magnitude (nothing can overflow, whatever the weights), rounded to fp16, the output back in fp32 times
              that scale plus the bias (`half_convs`)
  fused_cl_h_raw  the same without the scale: the input rounded to fp16 as it is (the scale's cost, an fp16 bound)
  bf16 / bf16_cl / fp16   a copy of the VAE in that dtype (NCHW / channels_last)
  compiled    torch.compile(decoder) in fp32 (its compile time is reported)
  compiled_bf16   the same on the bf16 copy
  compiled_fast   torch.compile of the fast decoder (what a compiled decoder per size would add to bcg's)
and the pixels of each against fp32's (uint8 max and mean absolute difference, PSNR), a torch.profiler table of the
fp32 decode's top kernels, and what decoding beside the UNet costs: 30 replays of a plain 8 x size UNet graph followed
by 8 decodes, against the decodes run on a second stream while the replays run.

    python benchmarks/probes/vae_scout.py --out vae.json [--size 1024x1024] [--variants ...] [--budget 400]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from storyboard_cli.models.groupnorm import channels_last, fuse, narrow, widen
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.models.vae_attention import attend, unattend
from storyboard_cli.run.batch import decode

VARIANTS = ("fp32", "wide", "fast", "product", "fp32_bench", "fp32_cl", "fast_cl", "fused", "fused_cl", "fp32_graph",
            "fused_cl_apart", "fused_cl_h", "fused_cl_h_raw", "bf16", "bf16_cl", "fp16", "compiled", "compiled_bf16",
            "compiled_fast")


def timed(fn, n: int) -> float:
    if not torch.cuda.is_available():
        c0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - c0) * 1000 / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / n


def group_norm_cl(x: torch.Tensor, groups: int, weight, bias, eps: float) -> torch.Tensor:
    """models/groupnorm.py group_norm for a channels_last [N, C, H, W] x (the statistics over each group's channels of
    every position), its output channels_last."""
    n, c, h, w = x.shape
    var, mean = torch.var_mean(x.permute(0, 2, 3, 1).reshape(n, h * w, groups, c // groups), dim=(1, 3), correction=0)
    a = torch.rsqrt(var + eps).view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
    a = a * weight if weight is not None else a
    b = -mean.view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c) * a
    b = b + bias if bias is not None else b
    return torch.addcmul(b.view(n, c, 1, 1), x, a.view(n, c, 1, 1))


def half_convs(module: torch.nn.Module, scaled: bool = True) -> int:
    """Every Conv2d of `module` computed in fp16 with float32 in and out: the input divided by its largest magnitude
    (`scaled`; so |input| <= 1 and each output is at most the sum of its weights' magnitudes), rounded to fp16, the
    fp16 output times the scale plus the bias in float32. The number of convolutions changed."""
    n = 0
    for conv in module.modules():
        if not isinstance(conv, torch.nn.Conv2d):
            continue
        w16 = conv.weight.detach().half().contiguous(memory_format=torch.channels_last)
        bias = None if conv.bias is None else conv.bias.detach().view(1, -1, 1, 1)

        def forward(x, conv=conv, w16=w16, bias=bias):
            s = x.abs().amax().clamp_min(1e-30) if scaled else None
            y = torch.nn.functional.conv2d((x / s if scaled else x).half(), w16, None, conv.stride, conv.padding,
                                           conv.dilation, conv.groups).float()
            y = y * s if scaled else y
            return y + bias if bias is not None else y
        conv.forward = forward
        n += 1
    return n


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """A decoder's output [B, 3, H, W] in [-1, 1] (or the product's uint8 [B, H, W, 3]) -> uint8 [B, 3, H, W] on the
    CPU."""
    if image.dtype == torch.uint8:
        return image.permute(0, 3, 1, 2).cpu()
    return ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--budget", type=float, default=400.0)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--model", default="sdxl-random", help="tiny on a CPU: a smoke test of this script")
    args = ap.parse_args()
    t0 = time.perf_counter()
    w, h = (int(v) for v in args.size.split("x"))
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    result: dict = {"size": args.size, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "cudnn_tf32": torch.backends.cudnn.allow_tf32, "ms_per_image": {}, "pixels": {}}
    out = Path(args.out)

    def save() -> None:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1))

    models = load_sdxl(args.model, None, dev, torch.float16 if cuda else torch.float32)
    assert models.vae.dtype == torch.float32, models.vae.dtype
    vae = copy.deepcopy(models.vae)  # torch's GroupNorm and diffusers' attention: the reference
    narrow(vae)
    unattend(vae)
    wide = copy.deepcopy(vae)  # the wide GroupNorm, NCHW
    widen(wide.decoder)
    fast = copy.deepcopy(wide)  # and the attention on the matrix units: bcg's decoder before `fuse`
    attend(fast.decoder)
    g = torch.Generator(dev).manual_seed(0)
    latents = torch.randn(1, 4, h // 8, w // 8, device=dev, generator=g)
    z = latents / vae.config.scaling_factor

    copies = {}

    def vae_in(dtype, cl: bool):
        key = (dtype, cl)
        if key not in copies:
            m = vae if (dtype == torch.float32 and not cl) else copy.deepcopy(vae).to(dtype)
            if cl:
                m = m.to(memory_format=torch.channels_last)
            copies[key] = m
        return copies[key]

    fns = {}
    # fp32 first: every variant's pixels are compared with its
    wanted = ["fp32"] + [v for v in args.variants.split(",") if v and v != "fp32"]
    for v in wanted:
        if v == "fp32":
            fns[v] = lambda: vae.decode(z, return_dict=False)[0]
        elif v == "wide":
            fns[v] = lambda: wide.decode(z, return_dict=False)[0]
        elif v == "fast":
            fns[v] = lambda: fast.decode(z, return_dict=False)[0]
        elif v == "fast_cl":
            from storyboard_cli.models.groupnorm import WideGroupNorm
            cl = copy.deepcopy(fast).to(memory_format=torch.channels_last)
            for m in cl.modules():
                if isinstance(m, WideGroupNorm):
                    m.forward = (lambda x, m=m: group_norm_cl(x, m.num_groups, m.weight, m.bias, m.eps)
                                 if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
                                 else WideGroupNorm.forward(m, x))
            zc = z.contiguous(memory_format=torch.channels_last)
            fns[v] = lambda: cl.decode(zc, return_dict=False)[0]
        elif v in ("fused", "fused_cl", "fused_cl_apart"):
            m = copy.deepcopy(fast)
            result.setdefault("silus_fused", {})[v] = fuse(m.decoder)  # 0 where the kernels do not run
            if v == "fused":
                m.decoder.to(memory_format=torch.contiguous_format)
            if v == "fused_cl_apart":
                result.setdefault("blocks_apart", {})[v] = sum(b.__dict__.pop("forward", None) is not None
                                                               for b in m.decoder.modules())
            zz = z.contiguous(memory_format=torch.channels_last) if channels_last(m.decoder) else z
            fns[v] = (lambda m=m, zz=zz: m.decode(zz, return_dict=False)[0])
        elif v in ("fused_cl_h", "fused_cl_h_raw"):
            m = copy.deepcopy(fast)
            fuse(m.decoder)
            result.setdefault("half_convs", {})[v] = half_convs(m.decoder, scaled=v == "fused_cl_h")
            zz = z.contiguous(memory_format=torch.channels_last) if channels_last(m.decoder) else z
            fns[v] = (lambda m=m, zz=zz: m.decode(zz, return_dict=False)[0])
        elif v == "product":
            fns[v] = lambda: decode(models, latents)  # uint8 [B, H, W, 3] on the CPU
        elif v == "fp32_bench":
            def f():
                torch.backends.cudnn.benchmark = True
                try:
                    return vae.decode(z, return_dict=False)[0]
                finally:
                    torch.backends.cudnn.benchmark = False
            fns[v] = f
        elif v in ("fp32_cl", "bf16", "bf16_cl", "fp16"):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[v.split("_")[0]]
            cl = v.endswith("_cl")
            m = vae_in(dtype, cl)
            zz = z.to(dtype)
            zz = zz.to(memory_format=torch.channels_last) if cl else zz
            fns[v] = (lambda m=m, zz=zz: m.decode(zz, return_dict=False)[0])
        elif v == "fp32_graph" and cuda:
            static = z.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    vae.decode(static, return_dict=False)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = vae.decode(static, return_dict=False)[0]

            def f(graph=graph, static_out=static_out):
                graph.replay()
                return static_out
            fns[v] = f
        elif v in ("compiled", "compiled_bf16", "compiled_fast"):
            dtype = torch.bfloat16 if v == "compiled_bf16" else torch.float32
            dec = torch.compile(fast.decode if v == "compiled_fast" else vae_in(dtype, False).decode)
            zz = z.to(dtype)
            c0 = time.perf_counter()
            with torch.no_grad():
                dec(zz, return_dict=False)
            sync()
            result.setdefault("compile_s", {})[v] = round(time.perf_counter() - c0, 1)
            save()
            fns[v] = (lambda dec=dec, zz=zz: dec(zz, return_dict=False)[0])
        if time.perf_counter() - t0 > args.budget * 0.6:
            result.setdefault("skipped", []).extend(x for x in wanted if x not in fns and x != v)
            break

    with torch.no_grad():
        ref = None  # fp32's pixels
        for v, f in fns.items():
            for _ in range(2):
                img = f()
            sync()
            px = to_uint8(img)
            if ref is None:
                ref = px
            d = (px.int() - ref.int()).abs()
            mse = (d.float() ** 2).mean().item()
            result["pixels"][v] = {"max_abs": int(d.max()), "mean_abs": round(d.float().mean().item(), 4),
                                   "psnr_db": (round(10 * torch.log10(torch.tensor(255.0 ** 2 / mse)).item(), 2)
                                               if mse else None)}
        save()
        runs = {v: [] for v in fns}
        for _ in range(args.loops):
            for v, f in fns.items():
                runs[v].append(timed(f, 3))
        result["ms_per_image"] = {v: round(statistics.median(r), 2) for v, r in runs.items()}
        result["runs"] = {v: [round(x, 2) for x in r] for v, r in runs.items()}
        save()

        if not cuda:
            save()
            print(json.dumps(result, indent=1))
            return
        from torch.profiler import ProfilerActivity, profile
        for v in ("fp32", "wide", "fast", "fused", "fused_cl", "fused_cl_apart", "fused_cl_h"):
            if v not in fns:
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fns[v]()
                sync()
            rows = []
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:15]:
                rows.append([e.key[:90], round(e.device_time_total / 1000, 2), e.count])
            result[f"profile_{v}_ms"] = rows
            save()

        if not args.no_overlap and time.perf_counter() - t0 < args.budget * 0.8:
            unet = models.unet
            rows_n = 16
            x = torch.randn(rows_n, 4, h // 8, w // 8, device="cuda", dtype=torch.float16)
            t = torch.tensor(500.0, device="cuda")
            enc = torch.randn(rows_n, 77, 2048, device="cuda", dtype=torch.float16)
            added = {"text_embeds": torch.randn(rows_n, 1280, device="cuda", dtype=torch.float16),
                     "time_ids": torch.tensor([[h, w, 0, 0, h, w]] * rows_n, device="cuda", dtype=torch.float16)}
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    unet(x, t, enc, added_cond_kwargs=added, return_dict=False)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                unet(x, t, enc, added_cond_kwargs=added, return_dict=False)
            eight = torch.randn(8, 4, h // 8, w // 8, device="cuda") / vae.config.scaling_factor
            side = torch.cuda.Stream()

            def decodes():  # as the product, one image at a time, without the copy to the CPU (it would wait)
                for one in eight.split(1):
                    wide.decode(one, return_dict=False)

            def serial():
                for _ in range(30):
                    graph.replay()
                decodes()

            def overlapped():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    decodes()
                for _ in range(30):
                    graph.replay()
                torch.cuda.current_stream().wait_stream(side)

            def unet_only():
                for _ in range(30):
                    graph.replay()

            serial(), overlapped()
            sync()
            ov = {"serial": [], "overlapped": [], "unet_only": []}
            for _ in range(3):
                for k, f in (("serial", serial), ("overlapped", overlapped), ("unet_only", unet_only)):
                    c0 = time.perf_counter()
                    f()
                    sync()
                    ov[k].append(round((time.perf_counter() - c0) * 1000, 1))
            result["overlap_ms"] = {k: statistics.median(v) for k, v in ov.items()}
            result["overlap_runs"] = ov
            save()
    save()
    print(json.dumps({k: result[k] for k in result if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
