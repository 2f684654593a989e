"""Where a process's first compiled-artifact load spends its time: each stage timed, every thread's Python
stack dumped every 5 s while it runs (stderr).

    python benchmarks/probes/load_probe.py ARTIFACT.pt2 [ARTIFACT.pt2 ...]
"""

from __future__ import annotations

import faulthandler
import sys
import time

t0 = time.perf_counter()


def mark(what: str) -> None:
    print(f"{time.perf_counter() - t0:7.2f} s  {what}", flush=True)


import torch  # noqa: E402

mark("import torch")
torch.cuda.init()
torch.empty(1, device="cuda")
mark("CUDA context")
import triton  # noqa: E402,F401

mark("import triton")
from torch._inductor import aoti_load_package  # noqa: E402

mark("import torch._inductor")
faulthandler.dump_traceback_later(5, repeat=True)
for path in sys.argv[1:]:
    compiled = aoti_load_package(path, run_single_threaded=True)
    mark(f"aoti_load_package {path.rsplit('/', 1)[-1]}")
    compiled.get_constant_fqns()
    mark("get_constant_fqns")
faulthandler.cancel_dump_traceback_later()
