"""Seconds a copied artifact's load check takes (the child process `artifacts.loads_here` starts when an
artifact has no marker naming its digest), and its load into a process, for each artifact given.

    python benchmarks/probes/load_check.py CACHE/compiled/*.pt2
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from storyboard_cli.engine.kernels.artifacts import loads_here

for src in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / Path(src).name
        shutil.copy(src, path)  # without its marker
        t0 = time.perf_counter()
        ok = loads_here(path)
        print(f"{path.name}: loads_here={ok} in {time.perf_counter() - t0:.1f} s", flush=True)
