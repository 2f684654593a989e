"""Real processes, real signals, real locks: SIGTERM / SIGHUP mid-batch, Ctrl-C while loading, the
folder lock held by the kernel (contended, and released when its holder is killed)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.cli import app
from storyboard_cli.folder.layout import LOCK, read_fingerprint

JOB = "version: 1\nmodel: tiny\nbuckets: [1]\nshots:\n  - {id: a, prompt: x, steps: 3, size: 64x64, candidates: 12}\n"

# run in the child before bcg's main(): batches after the third (or loading) take `HANG` seconds, so a
# signal is sure to arrive in the middle of one
PATCH = textwrap.dedent("""
    import os, sys, time
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.run import render
    HANG = float(os.environ.get("HANG", "60"))
    calls = [0]
    real_sample, real_load = EagerEngine.sample, render.load_sdxl
    def sample(self, *a):
        calls[0] += 1
        if calls[0] > 3 and os.environ.get("HANG_AT") == "batch":
            open(os.environ["MARK"], "w").close()
            time.sleep(HANG)
        return real_sample(self, *a)
    def load(*a):
        if os.environ.get("HANG_AT") == "load":
            open(os.environ["MARK"], "w").close()
            time.sleep(float(os.environ.get("LOAD_S", "3")))
        return real_load(*a)
    EagerEngine.sample, render.load_sdxl = sample, load
    from storyboard_cli.cli import main
    main()
""")


def _start(tmp_path, hang_at, *args, **env):
    job = write_job(tmp_path, JOB)
    out, mark = tmp_path / "out", tmp_path / "mark"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HANG_AT": hang_at, "MARK": str(mark), **env}
    proc = subprocess.Popen([sys.executable, "-c", PATCH, "render", str(job), "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.time() + 120
    while not mark.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    return proc, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_mid_batch_with_a_partial_report(tmp_path, sig):
    proc, out = _start(tmp_path, "batch")
    t0 = time.time()
    proc.send_signal(sig)
    while proc.poll() is None and not (out / "report.json").exists():
        time.sleep(0.005)
    # stopped and cleaned up well before the batch in flight (60 s here) ends; then the interpreter exits
    assert time.time() - t0 < 2.0, "took too long to stop"
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert len(pngs) == 3 and all(read_fingerprint(out / p) for p in pngs)  # the batch in flight is dropped
    assert sorted(json.loads(l)["path"] for l in (out / "manifest.jsonl").read_text().splitlines()) == pngs
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and report["stopped_by"] == signal.Signals(sig).name
    assert report["images_rendered"] == 3 and report["run"]["id"]
    assert report["run"]["started"] <= report["run"]["finished"]
    assert not (out / LOCK).exists() and not list(out.rglob("*.tmp"))
    if sig != signal.SIGTERM:
        return
    # the next run renders the rest
    again = CliRunner().invoke(app, ["render", str(tmp_path / "job.yaml"), "--out", str(out), "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["images_skipped"] == 3


@pytest.mark.slow
def test_first_ctrl_c_says_so_at_once_and_is_honoured_during_loading(tmp_path):
    proc, out = _start(tmp_path, "load", LOAD_S="4")
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    # the message comes before loading ends (it takes 4 s here), and loading is where it stops
    line = proc.stderr.readline()
    assert "stopping after this batch; Ctrl-C again to stop now" in line and time.time() - t0 < 2, line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and report["images_rendered"] == 0
    assert report["stopped_by"] == "SIGINT" and not list(out.rglob("*.png"))


def test_a_stop_that_a_library_turns_into_an_error_of_its_own_is_still_a_stop(tmp_path, monkeypatch):
    """Python runs the SIGTERM handler between two bytecodes of whatever runs, and safetensors' read of a file (inside
    diffusers' from_pretrained) swallowed the Stopped it raised: "ValueError: could not determine the shape of object
    type 'torch.storage.UntypedStorage'", which diffusers made an OSError and the loader "cannot load model 'tiny'"
    (a stopped `--gpus 2` run summed up as "error:", tests/test_dist.py). The read here does what theirs did."""
    import safetensors.torch

    real, handlers = safetensors.torch.load_file, []

    def load_file(*args, **kwargs):
        handlers.append(signal.getsignal(signal.SIGTERM))
        try:
            handlers[-1](signal.SIGTERM, None)  # the render's handler, as Python runs it mid-read
        except BaseException:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["render", str(write_job(tmp_path, JOB)), "--out", str(out), "--device", "cpu"])
    assert handlers and all(callable(h) for h in handlers), handlers
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert result.output.startswith("interrupted: 0 rendered") and "error" not in result.output, result.output
    report = json.loads((out / "report.json").read_text())
    assert (report["status"], report["stopped_by"], report["error"]) == ("interrupted", "SIGTERM", None)


# --- the lock ---------------------------------------------------------------------------------------

HOLD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from storyboard_cli.errors import OutputLocked
    from storyboard_cli.folder.lock import OutputLock
    out, go = Path(sys.argv[1]), Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.001)
    try:
        with OutputLock(out):
            print("got", flush=True)
            time.sleep(float(sys.argv[3]))
    except OutputLocked as e:
        print("refused", e, flush=True)
""")


def _holders(out, go, hold_s, n):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(go), str(hold_s)], stdout=subprocess.PIPE,
                             text=True, env=env) for _ in range(n)]


@pytest.mark.slow
def test_exactly_one_of_many_racing_processes_gets_the_lock(tmp_path):
    for trial in range(4):
        out, go = tmp_path / f"out{trial}", tmp_path / f"go{trial}"
        # the holder keeps it long enough that every other one tries while it is held, however late the loaded
        # machine wakes it (a racer that first tries after the holder let go takes the lock in turn, rightly)
        procs = _holders(out, go, 2.5, 6)
        time.sleep(0.5)  # all started and waiting
        go.touch()
        results = [p.communicate(timeout=30)[0].strip() for p in procs]
        assert sum(r == "got" for r in results) == 1, results
        assert all(r == "got" or (r.startswith("refused") and "another render" in r) for r in results), results
        assert not (out / LOCK).exists()


@pytest.mark.slow
def test_a_killed_holder_releases_the_lock_and_a_stale_file_is_no_lock(job_dir, tmp_path):
    job = write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    out, go = tmp_path / "out", tmp_path / "go"
    go.touch()
    (holder,) = _holders(out, go, 60, 1)
    assert holder.stdout.readline().strip() == "got"
    refused = CliRunner().invoke(app, ["render", str(job), "--out", str(out)])
    assert refused.exit_code == 2 and f"another render (pid {holder.pid} on " in refused.output, refused.output
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / LOCK).exists()  # left behind by the kill: a file, but nobody's lock
    (out / LOCK).write_text(f"pid {os.getppid()} on this host\n")  # even naming a live process
    assert CliRunner().invoke(app, ["render", str(job), "--out", str(out)]).exit_code == 0
    assert not (out / LOCK).exists()


def test_stop_flag_rules():
    from storyboard_cli.run.signals import SOFT_STOP, StopFlag, Stopped

    said = []
    flag = StopFlag(said.append)
    flag.handler(signal.SIGINT, None)  # first Ctrl-C: a word, no exception
    assert said == [SOFT_STOP] and flag.requested
    with pytest.raises(Stopped) as stopped:  # a SIGTERM after it still stops at once
        flag.handler(signal.SIGTERM, None)
    assert stopped.value.signum == signal.SIGTERM and flag.signum == signal.SIGTERM
    assert flag.cause(OSError("what a library made of it")) is stopped.value  # the stop, however it came up
    assert flag.cause(stopped.value) is stopped.value
    flag.handler(signal.SIGINT, None)  # already stopping: nothing raised while cleaning up
    twice = StopFlag()
    twice.handler(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        twice.handler(signal.SIGINT, None)
    done = StopFlag()
    done.finishing = True
    done.handler(signal.SIGHUP, None)  # while the report is written: recorded only
    with pytest.raises(Stopped):
        done.check()


def test_a_second_ctrl_c_while_the_first_is_announced_waits_for_the_message():
    """Python runs a handler between bytecodes, so a second Ctrl-C can land inside the first one's print: the
    message still goes out whole, then the second press stops at once."""
    from storyboard_cli.run.signals import SOFT_STOP, StopFlag

    said = []

    def slow_print(message):
        flag.handler(signal.SIGINT, None)  # the second press, mid-print
        said.append(message)

    flag = StopFlag(slow_print)
    with pytest.raises(KeyboardInterrupt):
        flag.handler(signal.SIGINT, None)
    assert said == [SOFT_STOP] and flag.hard


@pytest.mark.parametrize("ending, sig, code", [("SystemExit(130)", "SIGINT", 130), ("KeyboardInterrupt()", "SIGINT", 130),
                                               ("SystemExit(143)", "SIGTERM", 143), ("SystemExit(129)", "SIGHUP", 129)])
def test_a_stop_signal_while_a_stopped_process_exits_changes_nothing(ending, sig, code):
    """`bcg`'s main, ending on a stop, then a second stop signal while the interpreter runs its exit handlers (torch
    registers one; a second Ctrl-C 10 ms after the first landed there once, when the render had stopped at a batch's
    end): the same exit status, no traceback."""
    script = textwrap.dedent(f"""
        import atexit, os, signal, time
        import storyboard_cli.cli as cli

        def app():
            atexit.register(lambda: (os.kill(os.getpid(), signal.{sig}), time.sleep(0.2)))
            raise {ending}

        cli.app = app
        cli.main()
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == code and "Traceback" not in run.stderr, (run.returncode, run.stderr)
