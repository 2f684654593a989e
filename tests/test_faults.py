"""Real processes, real signals: kill -9 and Ctrl-C mid-render lose nothing and leave no broken file."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.cli import app
from storyboard_cli.folder.outputs import read_fingerprint

# enough images, and steps, that a render stopped after its third image is stopped mid-job even when the refused
# second render (in this process, between its first and third image) is slow to start on a loaded machine
N = 16
JOB = f"version: 1\nmodel: tiny\nbuckets: [1]\nshots:\n  - {{id: a, prompt: x, steps: 12, size: 64x64, candidates: {N}}}\n"


def _start(job_path, out, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "storyboard_cli", "render", str(job_path), "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _wait_for_images(out, n, proc, timeout=120):
    manifest = out / "manifest.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if manifest.exists() and len(manifest.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("render made no progress")


def _check_consistent(out):
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert all(read_fingerprint(out / p) for p in pngs), "a broken PNG"
    lines = [json.loads(l) for l in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(l["path"] for l in lines) == pngs  # no duplicate line, no line without its file
    return pngs


@pytest.mark.slow
def test_kill_9_then_rerun_finishes_what_is_missing(tmp_path):
    """Also: while the first render runs, a second one into the same folder is refused, naming its holder."""
    # the refused render's modules imported first: their 2 s of imports in this process, on an idle machine, let the
    # first render finish all its images before the refusal looked at the folder
    importlib.import_module("storyboard_cli.run.render")
    job = write_job(tmp_path, JOB)
    out = tmp_path / "out"
    proc = _start(job, out)
    _wait_for_images(out, 1, proc)
    refused = CliRunner().invoke(app, ["render", str(job), "--out", str(out)])
    assert refused.exit_code == 2 and f"(pid {proc.pid} on " in refused.output, refused.output
    _wait_for_images(out, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = {p: p.stat().st_mtime_ns for p in out.rglob("*.png") if read_fingerprint(p)}
    assert 3 <= len(done_before) < N
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["images_rendered"] + summary["images_skipped"] == N
    assert summary["images_skipped"] >= len(done_before) - 1  # at most the one being renamed at the kill
    assert len(_check_consistent(out)) == N
    assert not list(out.rglob("*.tmp")) and not (out / ".bcg.lock").exists()
    assert all(p.stat().st_mtime_ns == t for p, t in done_before.items())  # nothing finished was redone


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_keeps_finished_images_and_exits_130(tmp_path, presses):
    job = write_job(tmp_path, JOB)
    out = tmp_path / "out"
    proc = _start(job, out)
    _wait_for_images(out, 2, proc)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.01)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.count("stopping after this batch; Ctrl-C again to stop now") == 1
    pngs = _check_consistent(out)
    assert 2 <= len(pngs) < N
    assert json.loads((out / "report.json").read_text())["status"] == "interrupted"
    assert not list(out.rglob("*.tmp")) and not (out / ".bcg.lock").exists()



@pytest.mark.slow
def test_a_huge_control_image_is_one_line_of_ours_not_pils_warning(tmp_path):
    from PIL import Image

    Image.new("L", (10000, 9000)).save(tmp_path / "huge.png")  # 90 megapixels: past PIL's warning limit
    job = write_job(tmp_path, "version: 1\nmodel: tiny\ncontrolnet: tiny\nbuckets: [1]\nshots:\n"
                              "  - {id: a, prompt: x, steps: 2, size: 64x64, control: {image: huge.png}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["plan", str(job)], ["render", str(job), "--out", str(tmp_path / "out"), "--quiet"]):
        proc = subprocess.run([sys.executable, "-m", "storyboard_cli", *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "DecompressionBomb" not in proc.stderr and "could be decompression bomb" not in proc.stderr
        assert proc.stderr.count("huge.png is 90 megapixels") == 1, proc.stderr  # named as the job names it


@pytest.mark.slow
def test_a_killed_force_run_leaves_one_manifest_line_per_image_on_disk(tmp_path):
    n = 6
    job = write_job(tmp_path, JOB.replace(f"candidates: {N}", f"candidates: {n}"))
    out = tmp_path / "out"
    first = _start(job, out)
    assert first.wait(timeout=300) == 0, first.communicate()
    edited = sorted((out / "a").glob("a_c0_*.png"))[0]
    edited.write_bytes(edited.read_bytes() + b"painted over")  # bcg did not write these bytes
    proc = _start(job, out, "--force")

    def runs() -> set:
        return {json.loads(line).get("run") for line in (out / "manifest.jsonl").read_text().splitlines()
                if line.endswith("}")}

    deadline = time.time() + 120
    while len(runs()) < 2:  # the forced run's first image has landed
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines = [json.loads(line)["path"] for line in (out / "manifest.jsonl").read_text().splitlines()]
    pngs = sorted(p.relative_to(out).as_posix() for p in (out / "a").glob("*.png"))
    assert sorted(lines) == pngs and len(pngs) == n  # one line per image, each on disk (before: n + the new lines)
    kept = [p.read_bytes() for p in out.rglob(edited.name)]
    assert any(data.endswith(b"painted over") for data in kept)  # the edited file, in place or set aside
