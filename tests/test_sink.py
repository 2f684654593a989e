"""The output sink on its own threads: what a stop now (a second Ctrl-C, or an error) leaves on disk."""

import json
import threading

import numpy as np

from conftest import write_job
from storyboard_cli.folder import sink
from storyboard_cli.folder.outputs import Manifest, pending_items
from storyboard_cli.folder.report import Timings
from storyboard_cli.folder.sink import ContactSheet, OutputSink
from storyboard_cli.job.file import load_job

JOB = "version: 1\nmodel: tiny\nbuckets: [1]\nshots:\n  - {id: a, prompt: x, seed: 1, steps: 2, size: 64x64, candidates: 4}\n"


def _on_disk(out):
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    manifest = out / "manifest.jsonl"
    lines = sorted(json.loads(line)["path"] for line in manifest.read_text().splitlines()) if manifest.exists() else []
    return pngs, lines


def test_a_stop_now_leaves_no_png_without_its_manifest_line(tmp_path, monkeypatch):
    """The first image's encode is slow, so its manifest line holds the writer thread while the second image lands
    on another encoder; a stop now then drops what is still queued, and every file that landed keeps its line (a
    line dropped after its file landed left a PNG no manifest names)."""
    monkeypatch.setattr(sink, "ENCODERS", 2)
    job = load_job(write_job(tmp_path, JOB))
    out = tmp_path / "out"
    out.mkdir()
    pending = pending_items(job, out, force=False)
    assert [len(i.outputs) for i in pending.items] == [1, 1, 1, 1]
    release, landed = threading.Event(), threading.Event()
    real = sink._encoded

    def encoded(pixels, item, model):
        if item.k == 0:
            assert release.wait(30)
        data = real(pixels, item, model)
        if item.k == 1:
            landed.set()
        return data

    monkeypatch.setattr(sink, "_encoded", encoded)
    s = OutputSink(job, out, Manifest(out), pending, "run", ContactSheet(out, job, []), Timings(), lambda *a: None)
    pixels = np.zeros((64, 64, 3), np.uint8)
    for item in pending.items:
        s.submit(item, pixels, "1 x 64x64")
    assert landed.wait(30)
    threading.Timer(0.2, release.set).start()  # the first image lands while the sink closes
    s.close(cancel=True)
    pngs, lines = _on_disk(out)
    assert pngs == lines, (pngs, lines)
    assert {"a/a_c0_s1.png", "a/a_c1_s2.png"} <= set(pngs) and s.rendered == len(pngs)
