"""Measures AOTInductor-compiled UNet/ControlNet calls inside a CUDA graph against the plain modules
in the same kind of graph, side by side, on sdxl-random (fp16). The numbers in docs/PERFORMANCE.md
("compiled kernels") come from this script.

    python bench/probe_compile.py build unet|controlnet DIR     # export + AOTI compile, one module
    python bench/probe_compile.py time DIR OUT.json [--profile]  # load artifacts, time, check, profile
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from storyboard_cli.engine import compiled as C
from storyboard_cli.models.loader import load_sdxl

SHAPES = [(1, 1024, 1024, False), (2, 1024, 1024, False), (4, 1024, 1024, False), (8, 1024, 1024, False),
          (2, 1216, 832, False), (1, 1024, 1024, True), (2, 1024, 1024, True)]


def models():
    return load_sdxl("sdxl-random", "sdxl-random", "cuda", torch.float16)


def inputs(m, batch, h, w, control):
    rows = 2 * batch
    unet = m.unet
    args = C.example_inputs("unet", unet, rows, h // 8, w // 8, m.dtype, m.device, unet.config.cross_attention_dim,
                            m.text_encoders[1].config.projection_dim)
    cargs = None
    if control:
        cargs = C.example_inputs("controlnet", unet, rows, h // 8, w // 8, m.dtype, m.device,
                                 unet.config.cross_attention_dim, m.text_encoders[1].config.projection_dim)
        cargs = (args[0], args[1], args[2], args[3], args[4], cargs[5], cargs[6])
    return args, cargs


def step_fn(unet_call, control_call, args, cargs, out):
    """eps for 2B rows, CFG-combined into out [B, 4, h, w] (as the engine's step)."""
    latents, t, embeds, pooled, time_ids, mid, down = args

    def step():
        m_, d_ = mid, down
        if cargs is not None:
            res = control_call(*cargs)
            m_, d_ = res[0], tuple(res[1:])
        eps = unet_call(latents, t, embeds, pooled, time_ids, m_, d_).float()
        neg, pos = eps.chunk(2)
        out.copy_(neg + 5.0 * (pos - neg))
    return step


def graph_ms(step, n=8):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / n)
    del g
    return sorted(times)[1]


def build(module, folder):
    m = models()
    path = C.artifact_path(module, m.unet if module == "unet" else m.controlnet, Path(folder))
    s = C.build(module, m, path)
    print(json.dumps({"module": module, "compile_s": round(s, 1), "path": str(path),
                      "mb": round(path.stat().st_size / 2**20, 1)}), flush=True)


def top_kernels(fn, n=3, k=15):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:k]:
        rows.append({"kernel": ev.key[:90], "ms_per_step": round(ev.device_time_total / 1000 / n, 3),
                     "calls": ev.count // n})
    return rows


def time_all(folder, out_path, profile_it=False):
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}

    def save():
        Path(out_path).write_text(json.dumps(rec, indent=1))

    t0 = time.perf_counter()
    m = models()
    rec["load_weights_s"] = round(time.perf_counter() - t0, 1)
    print("weights loaded", rec["load_weights_s"], flush=True)
    t0 = time.perf_counter()
    unet_c = C.load("unet", m, C.artifact_path("unet", m.unet, Path(folder)))
    rec["load_unet_artifact_s"] = round(time.perf_counter() - t0, 2)
    print("unet artifact loaded", rec["load_unet_artifact_s"], flush=True)
    ctl_path = C.artifact_path("controlnet", m.controlnet, Path(folder))
    ctl_c = None
    save()
    eager_unet = C.UNetCall(m.unet)
    eager_ctl = C.ControlNetCall(m.controlnet)
    with torch.no_grad():
        for batch, h, w, control in SHAPES:
            if control and profile_it and "profile_plain_8x1024" not in rec:
                args, cargs = inputs(m, 8, 1024, 1024, False)
                out = torch.zeros(8, 4, 128, 128, device="cuda")
                rec["profile_plain_8x1024"] = top_kernels(step_fn(eager_unet, eager_ctl, args, cargs, out))
                rec["profile_compiled_8x1024"] = top_kernels(step_fn(unet_c, ctl_c, args, cargs, out))
                save()
            if control and ctl_c is None:
                for _ in range(400):  # the ControlNet may still be compiling in another process
                    if ctl_path.exists():
                        break
                    time.sleep(1)
                t0 = time.perf_counter()
                ctl_c = C.load("controlnet", m, ctl_path)
                rec["load_controlnet_artifact_s"] = round(time.perf_counter() - t0, 2)
            args, cargs = inputs(m, batch, h, w, control)
            out_e = torch.zeros(batch, 4, h // 8, w // 8, device="cuda")
            out_c = torch.zeros_like(out_e)
            plain = step_fn(eager_unet, eager_ctl, args, cargs, out_e)
            comp = step_fn(unet_c, ctl_c, args, cargs, out_c)
            row = {"shape": f"{batch}x{w}x{h}{' +control' if control else ''}"}
            row["plain_ms"] = round(graph_ms(plain), 2)
            row["compiled_ms"] = round(graph_ms(comp), 2)
            plain()
            comp()
            torch.cuda.synchronize()
            row["rel_err"] = float((torch.linalg.vector_norm(out_c - out_e) / torch.linalg.vector_norm(out_e)).item())
            row["plain_ms_per_image"] = round(row["plain_ms"] / batch, 2)
            row["compiled_ms_per_image"] = round(row["compiled_ms"] / batch, 2)
            rec["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3])
    else:
        time_all(sys.argv[2], sys.argv[3], "--profile" in sys.argv)
