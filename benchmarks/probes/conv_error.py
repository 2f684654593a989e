"""Conv error probe: the FP8 UNet's noise prediction against the float UNet's, emulated (values rounded through FP8),
with the FP8 Linears alone and with the product's FP8 convolutions too (engine/kernels/conv8.py `convs`), at
t = 999, 500 and 50 (issue 41). FP8's first-replay check fails a graph whose step is more than its row's `check_rtol`
(8e-2) from the eager step's; this says, before any GPU time, how near the convolutions take the prediction to it.

Input scales static per tensor, calibrated as the product calibrates them (the input amax over calls on other
inputs, / 448); a Linear's weight per tensor, a convolution's per output channel. The variants are cumulative (the
Linears' weights rounded in place, then the convolutions'), so the UNet is held once: sdxl-random in float32 fits a
24 GB CPU machine without its text encoders and VAE.

    python benchmarks/probes/conv_error.py --out err.json --side 512          # CPU: sdxl-random fp32, about 4 minutes
    python benchmarks/probes/conv_error.py --out /tmp/e.json --model tiny --side 128     # the tiny model: seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conv_psnr import fp8_linears, rounded  # noqa: E402

from storyboard_cli.engine.kernels import conv8  # noqa: E402
from storyboard_cli.engine.kernels.export import example_inputs  # noqa: E402
from storyboard_cli.engine.kernels.fp8 import FP8_MAX  # noqa: E402
from storyboard_cli.models.loader import load_sdxl  # noqa: E402

TIMESTEPS = (999.0, 500.0, 50.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="sdxl-random")
    p.add_argument("--side", type=int, default=512)
    p.add_argument("--rows", type=int, default=1)
    a = p.parse_args()
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = load_sdxl(a.model, None, device, torch.float32)
    unet = models.unet
    models.text_encoders = models.vae = None  # the UNet alone is called
    linears, convs = fp8_linears(unet), conv8.convs(unet)

    def call(t: float, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        x = example_inputs("unet", unet, a.rows, a.side // 8, a.side // 8)
        with torch.no_grad():
            return unet(x[0], torch.full((a.rows,), t, device=device), encoder_hidden_states=x[2],
                        added_cond_kwargs={"text_embeds": x[3], "time_ids": x[4]}, return_dict=False)[0].float()

    amax: dict[str, float] = {}

    def record(name, _module, args):
        amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().amax().item())

    hooks = [unet.get_submodule(n).register_forward_pre_hook(lambda m, args, n=n: record(n, m, args))
             for n in linears + convs]
    for t in TIMESTEPS:  # calibration: other inputs than the measured ones
        call(t, 100 + int(t))
    for h in hooks:
        h.remove()
    base = {t: call(t, int(t)) for t in TIMESTEPS}

    def to_fp8(names: list[str], per_channel: bool) -> None:
        with torch.no_grad():
            for n in names:
                m = unet.get_submodule(n)
                w = m.weight.data
                top = w.abs().amax(dim=(1, 2, 3), keepdim=True) if per_channel else w.abs().amax()
                m.weight.data = rounded(w, top.clamp_min(1e-12) / FP8_MAX)
                scale = torch.tensor(max(amax[n], 1e-12) / FP8_MAX, device=device)
                m.register_forward_pre_hook(lambda _m, args, s=scale: (rounded(args[0], s), *args[1:]))

    def errors() -> dict[str, float]:
        return {f"t{t:g}": round(((call(t, int(t)) - base[t]).norm() / base[t].norm()).item(), 5) for t in TIMESTEPS}

    record_ = {"model": a.model, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "side": a.side, "rows": a.rows, "linears": len(linears),
               "convs": len(convs)}
    to_fp8(linears, False)
    record_["lin"] = errors()
    print("lin", record_["lin"], flush=True)
    to_fp8(convs, True)
    record_["lin_conv_inner"] = errors()
    print("lin_conv_inner", record_["lin_conv_inner"], flush=True)
    record_["elapsed_s"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(record_, indent=1) + "\n")


if __name__ == "__main__":
    main()
