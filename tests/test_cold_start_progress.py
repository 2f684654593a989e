"""A cold start's progress into a pipe or a log file (cli_progress.compile_progress): a line per stage, and whenever
the heartbeat's interval passes without one, a line saying what it still waits for and the time left."""

import time

from rich.console import Console

import storyboard_cli.cli_progress as progress
from storyboard_cli.engine.kernels.builds import CompileEvent, stage


class Log:
    """A log file: each line with the time it was written."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines += [(time.perf_counter(), line) for line in text.splitlines() if line]
        return len(text)

    def flush(self) -> None:
        pass


def test_a_slow_build_and_a_slow_stage_print_a_line_at_least_every_interval(monkeypatch):
    log = Log()
    monkeypatch.setattr(progress, "err", Console(file=log, force_terminal=False, width=200))
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    t0 = time.perf_counter()
    with progress.compile_progress(quiet=False) as on_event:
        on_event(stage("loading the weights of tiny"))
        time.sleep(0.5)  # a stage with nothing to say
        for i in range(8):  # a build, as Builds.wait reports it: an event per poll, no line of its own
            on_event(CompileEvent("unet 1024x1024", "compiling", 0.1 * i, 300.0))
            time.sleep(0.1)
        on_event(CompileEvent("unet 1024x1024", "done", 0.8, 300.0))
        on_event(stage("shape 1/3 8x1024x1024: timing the eager step", 10.0))
        time.sleep(0.5)
    text = [line for _, line in log.lines]
    assert text[0] == "bcg: loading the weights of tiny"
    assert any(line.endswith("still loading the weights of tiny (0 s so far)") for line in text)
    assert any("compiling 1 kernels side by side (unet 1024x1024" in line and "s left" in line for line in text)
    assert "bcg: unet 1024x1024 done in 1 s" in text
    assert any("still shape 1/3 8x1024x1024: timing the eager step" in line and "about 10 s left" in line
               for line in text)
    times = [t0] + [t for t, _ in log.lines]
    assert max(b - a for a, b in zip(times, times[1:])) < 0.2 + 0.3  # the interval, and the ticker's own step


def test_the_imports_before_the_first_stage_are_said_and_covered_by_the_heartbeat(monkeypatch):
    """`first`: the stage said at once, before the seconds of imports a process's start spends, and said again while
    they last."""
    log = Log()
    monkeypatch.setattr(progress, "err", Console(file=log, force_terminal=False, width=200))
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    with progress.compile_progress(quiet=False, first="loading torch and the engine") as on_event:
        time.sleep(0.5)  # the imports
        on_event(stage("loading the weights of tiny"))
    text = [line for _, line in log.lines]
    assert text[0] == "bcg: loading torch and the engine"
    assert text[1].endswith("still loading torch and the engine (0 s so far)"), text
    assert text[-1] == "bcg: loading the weights of tiny"


def test_bcg_capture_warm_says_its_first_line_before_it_imports_the_engine(tmp_path):
    """The real command into a pipe: its first stderr line comes before the engine's modules are imported (on the CPU
    it then stops at its device check, exit 2, one line)."""
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).resolve().parent.parent / "jobs" / "episode1.yaml"
    # the child marks each stderr line with whether torch was imported when it was written
    code = ("import sys, runpy\n"
            "class Err:\n"
            "    def __init__(self, s): self.s = s\n"
            "    def write(self, t):\n"
            "        if t.strip(): self.s.write(f\"[torch {'torch' in sys.modules}] \")\n"
            "        return self.s.write(t)\n"
            "    def flush(self): self.s.flush()\n"
            "    def __getattr__(self, n): return getattr(self.s, n)\n"
            "sys.stderr = Err(sys.stderr)\n"
            "sys.argv = ['bcg', 'capture', sys.argv[1], '--warm']\n"
            "runpy.run_module('storyboard_cli', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert lines[0] == "[torch False] bcg: loading torch and the engine", lines
    assert lines[-1].endswith("error: bcg capture --warm needs a CUDA device: CUDA graphs do not exist on the CPU")
    assert len(lines) == 2, lines


def _record(folder, name: str, label: str, compile_s: float, mtime: float | None = None) -> None:
    import json
    import os

    f = folder / f"{name}.build.json"
    f.write_text(json.dumps({"target": label, "make_module_s": 5.0, "export_s": 20.0, "compile_s": compile_s,
                             "load_s": 0.5, "mb": 10.0}) + "\n")
    if mtime is not None:
        os.utime(f, (mtime, mtime))


def test_a_builds_time_left_is_this_caches_record_of_its_kind_at_any_size(tmp_path):
    from storyboard_cli.engine.kernels.builds import ESTIMATE_S, estimate_s
    from storyboard_cli.engine.kernels.export import Target

    _record(tmp_path, "unet-fp8-1024x1024-a", "unet 1024x1024 fp8", 300.0)
    _record(tmp_path, "unet-fp8-832x1216-b", "unet 1216x832 fp8", 320.0)
    _record(tmp_path, "unet-1024x1024-c", "unet 1024x1024", 150.0)
    _record(tmp_path, "unet-refs16-1024x1024-d", "unet 1024x1024 +refs 16", 999.0)
    (tmp_path / "unet-fp8-1216x832-e.build.json").write_text('{"target": "unet 1216x832 fp8", "comp')  # being written
    assert estimate_s(Target("unet", 832, 1216, "fp8"), tmp_path) == (325.5 + 345.5) / 2
    assert estimate_s(Target("unet", 1024, 1024), tmp_path) == 175.5
    assert estimate_s(Target("unet", 1024, 1024, refs=16), tmp_path) == 1024.5
    # no record of its kind: the figure measured on the device image
    assert estimate_s(Target("controlnet", 1024, 1024, "fp8"), tmp_path) == ESTIMATE_S[("controlnet", "fp8")]
    assert estimate_s(Target("unet", 1024, 1024, tags=("regions2",)), tmp_path) == ESTIMATE_S[("unet", "fp16")]
    assert estimate_s(Target("unet", 1024, 1024), tmp_path / "none") == ESTIMATE_S[("unet", "fp16")]


def test_a_builds_estimate_takes_the_latest_records_of_its_kind(tmp_path):
    from storyboard_cli.engine.kernels.builds import RECORDS, estimate_s
    from storyboard_cli.engine.kernels.export import Target

    for i, compile_s in enumerate([900.0, 900.0, 100.0, 110.0, 120.0, 130.0, 140.0]):  # the oldest two: a slower recipe
        _record(tmp_path, f"controlnet-1024x1024-{i}", "controlnet 1024x1024", compile_s, mtime=1e9 + i)
    assert RECORDS == 5 and estimate_s(Target("controlnet", 1024, 1024), tmp_path) == 145.5


def test_the_progress_of_a_build_says_its_kinds_recorded_time(tmp_path):
    """Builds' events carry the estimate: a build another process holds, as `bcg capture --warm` reports it."""
    import fcntl

    import torch

    from storyboard_cli.engine.kernels.builds import Builds
    from storyboard_cli.engine.kernels.export import Target

    _record(tmp_path, "unet-fp8-1024x1024-a", "unet 1024x1024 fp8", 300.0)
    path = tmp_path / "unet-fp8-832x1216-b.pt2"
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's build of it
        events = []
        builds = Builds(torch.device("cpu"), events.append)
        builds.want([(Target("unet", 1216, 832, "fp8"), path, torch.nn.Linear(1, 1))])
    assert [(e.module, e.state, e.estimate_s) for e in events] == [("unet 832x1216 fp8", "compiling", 325.5)]
