"""The contact sheet's lock probe (`held()`, a shared flock for a moment) never makes a render give up:
a process probing in a tight loop while this one takes the folder's lock again and again."""

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from storyboard_cli.errors import OutputLocked
from storyboard_cli.folder.lock import OutputLock, held

PROBE = "import sys\nfrom storyboard_cli.folder.lock import held\nprint('ready', flush=True)\nwhile True: held(sys.argv[1])\n"


@pytest.mark.slow  # a real process, a few seconds
def test_a_probe_in_a_tight_loop_never_makes_a_render_refuse(tmp_path):
    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline() == "ready\n"
        refused, t0 = 0, time.monotonic()
        for _ in range(1500):
            try:
                with OutputLock(tmp_path):
                    pass
            except OutputLocked:
                refused += 1
        assert refused == 0, f"{refused} of 1500 refused in {time.monotonic() - t0:.1f} s"
        with OutputLock(tmp_path):
            assert held(tmp_path)  # a probe still sees a live render
    finally:
        probe.kill()
        probe.wait()
