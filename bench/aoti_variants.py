"""Which AOTInductor option or load condition makes a CUDA package crash at load? Small conv/linear
models are compiled with each option set (dynamic batch, as bcg's), and every package (these and the
SDXL ones in DIR) is loaded in a child process under each load condition; prints one JSON line each.

    python bench/aoti_variants.py DIR OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from storyboard_cli.engine.compiled import INDUCTOR_OPTIONS

VARIANTS = {
    "defaults": {},
    "constants_outside": {"aot_inductor.package_constants_in_so": False},
    "outside_keep": {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True},
    "bcg": dict(INDUCTOR_OPTIONS),
}
LOADS = {  # child-process code for each load condition; argv[1] is the package
    "plain_single": "i.aoti_load_package(p, run_single_threaded=True)",
    "cuda_first_single": "torch.zeros(1, device='cuda'); i.aoti_load_package(p, run_single_threaded=True)",
    "cuda_first_multi": "torch.zeros(1, device='cuda'); i.aoti_load_package(p)",
    "cuda_first_device0": "torch.zeros(1, device='cuda'); i.aoti_load_package(p, run_single_threaded=True, device_index=0)",
}


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 32, 3, padding=1)
        self.proj = torch.nn.Conv2d(32, 32, 1)
        self.lin = torch.nn.Linear(32, 32)
        self.out = torch.nn.Conv2d(32, 4, 3, padding=1)

    def forward(self, x, t):
        h = self.proj(torch.nn.functional.silu(self.conv(x)))
        h = self.lin(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.out(h) * t


def build_toy(name: str, folder: Path) -> Path:
    from torch._inductor import aoti_compile_and_package
    from torch.export import Dim

    model = Toy().half().cuda()
    args = (torch.randn(2, 4, 32, 32, dtype=torch.half, device="cuda"), torch.tensor(0.5, device="cuda"))
    ep = torch.export.export(model, args, dynamic_shapes=({0: Dim("rows", min=2, max=16)}, None), strict=False)
    path = folder / f"toy-{name}.pt2"
    aoti_compile_and_package(ep, package_path=str(path), inductor_configs=dict(VARIANTS[name]))
    return path


def try_load(path: Path, how: str) -> dict:
    code = f"import sys, torch, torch._inductor as i; p = sys.argv[1]; {LOADS[how]}; print('loaded')"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=240)
    err = (done.stderr.strip().splitlines() or [""])[-1][:200]
    return {"package": path.name, "load": how, "rc": done.returncode, "s": round(time.perf_counter() - t0, 1),
            "err": "" if done.returncode == 0 else err}


if __name__ == "__main__":
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    rows = []
    sdxl = sorted(folder.glob("unet-*.pt2"))[:1] + sorted(folder.glob("controlnet-*.pt2"))[:1]
    with ThreadPoolExecutor(8) as pool:  # the SDXL packages first: their verdict matters most
        for row in pool.map(lambda a: try_load(*a), [(p, h) for p in sdxl for h in LOADS]):
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(rows, indent=1))
    toys = Path("/tmp/toys")
    toys.mkdir(exist_ok=True)
    for name in VARIANTS:
        t0 = time.perf_counter()
        try:
            path = build_toy(name, toys)
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(json.dumps({"variant": name, "build_error": str(e)[:300]}), flush=True)
            continue
        print(json.dumps({"variant": name, "build_s": round(time.perf_counter() - t0, 1)}), flush=True)
        for how in LOADS:
            rows.append(row := try_load(path, how))
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(rows, indent=1))
    if any(r["rc"] == 0 and r["package"].startswith("unet") for r in rows):
        print("SDXL_LOADS")
