"""A disk that fills mid-render (a fault-injected writer raising ENOSPC): exit 2, one line, no traceback,
stderr and report.json naming the same file; the contact sheet failing too is a note, not the exit code."""

import errno
import json

from typer.testing import CliRunner

from conftest import write_job
from storyboard_cli.cli import app
from storyboard_cli.folder import sheet, sink
from storyboard_cli.folder.outputs import atomic_write

JOB = "version: 1\nmodel: tiny\nbuckets: [1]\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64, candidates: 6}\n"


def _full(path):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def test_disk_full_mid_render_is_one_line_exit_2_and_the_report_names_the_file(tmp_path, monkeypatch):
    job = write_job(tmp_path, JOB)
    out = tmp_path / "out"
    written = []

    def pngs_then_full(path, data):
        if len(written) >= 2:
            _full(path)
        written.append(path)
        atomic_write(path, data)

    monkeypatch.setattr(sink, "atomic_write", pngs_then_full)
    monkeypatch.setattr(sheet, "atomic_write", lambda path, data: _full(path))
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: disk full: cannot write "), result.output
    named = lines[0].split("cannot write ", 1)[1].split(" (", 1)[0]
    assert named.endswith(".png") and named not in map(str, written)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "error" and named in report["error"]
    assert any(n.startswith("contact sheet not updated: [Errno 28]") for n in report["notes"])
    manifest = (out / "manifest.jsonl").read_text().splitlines()
    assert len(manifest) == 2 == len(list(out.rglob("*.png"))) and not list(out.rglob("*.tmp"))


def test_a_folder_turned_read_only_mid_render_is_one_line_exit_2_and_keeps_what_landed(tmp_path, monkeypatch):
    """The output folder's file system remounted read-only mid-render (EROFS): exit 2 as a destination that cannot
    be written, one line naming the file and what to do, the PNGs written before kept with their manifest lines."""
    job = write_job(tmp_path, JOB)
    out = tmp_path / "out"
    written = []

    def pngs_then_read_only(path, data):
        if len(written) >= 2:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        written.append(path)
        atomic_write(path, data)

    monkeypatch.setattr(sink, "atomic_write", pngs_then_read_only)
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"])
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write "), result.output
    assert lines[0].endswith("(Read-only file system); make its folder writable and run again"), lines[0]
    manifest = (out / "manifest.jsonl").read_text().splitlines()
    assert len(manifest) == 2 == len(list(out.rglob("*.png")))
