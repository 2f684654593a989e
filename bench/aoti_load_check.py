"""Does a compiled artifact build and load with this torch on this machine? Builds the tiny preset's
UNet artifact with the options bcg uses (engine/compiled.py), then loads it in a child process, as a
render would. A quick check of a torch build on a CPU (29-41 s); on a GPU the tiny model's compile
took over 200 s (as many kernels as SDXL), so there bench/h200_build.sh checks the SDXL artifacts.

    python bench/aoti_load_check.py DIR [cpu|cuda]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from storyboard_cli.engine import compiled as C
from storyboard_cli.models.loader import load_sdxl

if __name__ == "__main__":
    root, device = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"
    models = load_sdxl("tiny", None, device, torch.float32)
    path = C.artifact_path("unet", models.unet, root)
    if not path.exists():
        t0 = time.perf_counter()
        C.build("unet", models, path)
        print(f"built {path.name} in {time.perf_counter() - t0:.1f} s with torch {torch.__version__}", flush=True)
    print(f"loads in a child process: {C.loads_here(path)}")
