"""What a render does to a folder people also work in: edited images, deduplicated images, other jobs'
manifest lines, subsets of shots, LoRA metadata, the contact sheet."""

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from conftest import write_job
from storyboard_cli.errors import BadInput
from storyboard_cli.folder.layout import REPLACED
from storyboard_cli.folder.outputs import parameters_text, png_bytes
from storyboard_cli.folder.report import Report, markdown, Timings
from storyboard_cli.job.file import LoraFile, load_job
from storyboard_cli.job.plan import WorkItem
from storyboard_cli.models.lora import Swap
from storyboard_cli.run.render import RenderOptions, render

JOB = """version: 1
name: t
model: tiny
defaults: {steps: 2, guidance: 5.0, size: 64x64}
shots:
  - {id: a, prompt: a castle on a hill, seed: 7, candidates: 2}
  - {id: b, prompt: a boat at sea, seed: 20}
"""


def _lines(out: Path) -> dict[str, dict]:
    return {r["path"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}


def _meta(path: Path) -> dict:
    with Image.open(path) as im:
        return json.loads(im.info["bcg"])


def _edit(path: Path) -> bytes:
    """What an image editor does: new pixels, and the bcg chunk dropped."""
    with Image.open(path) as im:
        im.convert("RGB").point(lambda v: 255 - v).save(path)
    return path.read_bytes()


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


def test_manifest_records_the_sha256_of_each_written_file(job_dir, out, tiny_cpu):
    render(load_job(write_job(job_dir, JOB)), RenderOptions(out_dir=out), models=tiny_cpu)
    lines = _lines(out)
    assert len(lines) == 3
    for path, rec in lines.items():
        assert rec["sha256"] == hashlib.sha256((out / path).read_bytes()).hexdigest()
        assert rec["run"] and rec["finished"]


def test_an_edited_image_is_kept_and_reported_once(job_dir, out, tiny_cpu):
    render(load_job(write_job(job_dir, JOB)), RenderOptions(out_dir=out), models=tiny_cpu)
    edited = _edit(out / "a/a_c0_s7.png")
    # the job changes too: the file is stale for bcg, but someone painted over it: it stays
    changed = load_job(write_job(job_dir, JOB.replace("a castle on a hill", "a castle in the rain")))
    result = render(changed, RenderOptions(out_dir=out), models=tiny_cpu)
    assert (out / "a/a_c0_s7.png").read_bytes() == edited
    assert result.rendered == 1  # a_c1: bcg's own stale file, replaced
    kept = [n for n in result.notes if n.startswith("kept")]
    assert len(kept) == 1 and kept[0].startswith("kept 1 edited image; --force re-renders them, moving the edited "
                                                 f"files to {out / REPLACED}/")
    assert "a/a_c0_s7.png" in _lines(out)  # still on disk: still in the manifest


def test_force_moves_edited_images_aside_never_deletes(job_dir, out, tiny_cpu):
    job = load_job(write_job(job_dir, JOB))
    render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    edited = _edit(out / "b/b_c0_s20.png")
    result = render(job, RenderOptions(out_dir=out, force=True), models=tiny_cpu)
    assert result.rendered == 3
    (moved,) = (out / REPLACED).rglob("*.png")
    assert moved.read_bytes() == edited and moved.relative_to(out / REPLACED).parts[1:] == ("b", "b_c0_s20.png")
    assert _meta(out / "b/b_c0_s20.png")["shot"] == "b"
    assert any("1 edited image rendered again" in n for n in result.notes)


def test_deduplicated_images_carry_their_own_shot(job_dir, out, tiny_cpu):
    twins = JOB + "  - {id: c, prompt: a boat at sea, seed: 20}\n"
    result = render(load_job(write_job(job_dir, twins)), RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.rendered == 4
    assert _meta(out / "c/c_c0_s20.png")["shot"] == "c" and _meta(out / "b/b_c0_s20.png")["shot"] == "b"
    lines = _lines(out)
    assert lines["c/c_c0_s20.png"]["shot"] == "c" and lines["b/b_c0_s20.png"]["shot"] == "b"
    with Image.open(out / "c/c_c0_s20.png") as c, Image.open(out / "b/b_c0_s20.png") as b:
        assert c.tobytes() == b.tobytes()  # one image, denoised once


def test_manifest_keeps_other_jobs_lines_and_is_never_emptied(job_dir, out, tiny_cpu):
    render(load_job(write_job(job_dir, JOB)), RenderOptions(out_dir=out), models=tiny_cpu)
    other = load_job(write_job(job_dir, JOB.replace("id: a,", "id: x,").replace("id: b,", "id: y,"), "other.yaml"))
    render(other, RenderOptions(out_dir=out), models=tiny_cpu)
    assert len(_lines(out)) == 6

    seen = []

    def on_event(event):  # the manifest as a --force run starts rendering: nothing dropped yet
        if event.kind == "start":
            seen.append(len(_lines(out)))

    render(other, RenderOptions(out_dir=out, force=True), on_event, models=tiny_cpu)
    assert seen == [6] and len(_lines(out)) == 6
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 6  # compacted: one line per file


def test_shot_filter_with_globs(job_dir, out, tiny_cpu):
    job = load_job(write_job(job_dir, JOB + "  - {id: a2, prompt: a tower, seed: 3}\n"))
    result = render(job, RenderOptions(out_dir=out, shots=("a*",)), models=tiny_cpu)
    assert result.rendered == 3 and not (out / "b").exists()
    assert render(job, RenderOptions(out_dir=out, shots=("b",)), models=tiny_cpu).rendered == 1
    assert len(_lines(out)) == 4
    with pytest.raises(BadInput, match="--shot zz: no shot"):
        render(job, RenderOptions(out_dir=out, shots=("zz",)), models=tiny_cpu)


def test_render_writes_the_contact_sheet_and_a_sheet_failure_fails_nothing(job_dir, out, tiny_cpu, monkeypatch):
    job = load_job(write_job(job_dir, JOB))
    result = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.sheet == out / "index.html" and "a_c1_s8" in result.sheet.read_text()
    from storyboard_cli.folder import sheet

    def broken(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sheet.SheetWriter, "update", broken)
    again = render(job, RenderOptions(out_dir=out / "2"), models=tiny_cpu)
    assert again.status == "done" and again.rendered == 3 and again.sheet is None
    assert [n for n in again.notes if n.startswith("contact sheet not updated")] == [
        "contact sheet not updated: [Errno 28] No space left on device"]


def test_two_threads_writing_one_file_at_once_each_land_a_whole_file(tmp_path):
    """A thumbnail may be written by the encoder that wrote its PNG and by the sheet's update at once: each writer's
    temp file is its own, so neither fails and the file is always one writer's whole bytes."""
    import threading

    from storyboard_cli.folder.outputs import atomic_write

    path = tmp_path / "thumbs" / "a.jpg"
    payloads = [bytes([i]) * 65536 for i in (1, 2)]
    errors, start = [], threading.Barrier(2)

    def write(data):
        start.wait()
        try:
            for _ in range(200):
                atomic_write(path, data, durable=False)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(d,)) for d in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and path.read_bytes() in payloads and not list(path.parent.glob(".*.tmp"))


def _item(**kw) -> WorkItem:
    base = dict(shot="a", k=0, seed=7, prompt="a castle", negative="", width=64, height=64, steps=2,
                guidance=5.0, sampler="euler", outputs=("a/a_c0_s7.png",))
    return WorkItem(**(base | kw))


def test_lora_tags_and_hashes_in_the_a1111_parameters():
    mei = LoraFile("mei", Path("/x/mei.safetensors"), "loras/mei.safetensors", "f" * 64, "0123456789ab", False)
    ink = LoraFile("ink", Path("/x/ink.safetensors"), "loras/ink.safetensors", "e" * 64, "ba9876543210", True)
    item = _item(loras=((ink, 0.4), (mei, 0.8)))
    settings = item.settings("tiny")
    text = parameters_text(item, settings, "tiny")
    assert text.splitlines()[0] == "a castle <lora:ink:0.4> <lora:mei:0.8>"
    assert text.splitlines()[-1].endswith(', Lora hashes: "ink: ba9876543210, mei: 0123456789ab"')
    import numpy as np

    data = png_bytes(np.zeros((64, 64, 3), np.uint8), item, "tiny")
    from io import BytesIO

    with Image.open(BytesIO(data)) as im:
        assert json.loads(im.info["bcg"])["loras"] == settings["loras"]
    assert "Lora" not in parameters_text(_item(), _item().settings("tiny"), "tiny")


def test_report_lora_section():
    mei, both = (("mei", "h" * 64, 0.8),), (("ink", "g" * 64, 0.4), ("mei", "h" * 64, 0.8))
    swaps = [Swap((), mei, 120, 0.5), Swap(mei, (), 120, 0.25), Swap((), both, 60, 0.1)]
    common = dict(job="j", out_dir=Path("o"), device="cpu", dtype="float32", engine="eager", model="tiny",
                  timings=Timings(), wall_s=1.0, rendered=1, skipped=0, failed=[], peak_mem_mb=None, graphs=[],
                  status="done", notes=[])
    report = Report.build(**common, lora_swaps=swaps).to_json()
    assert report["lora"] == {"swaps": 3, "total_s": 0.85, "median_s": 0.25, "layers": [120, 120, 60],
                              "sets": [["none", "mei 0.8"], ["mei 0.8", "none"], ["none", "ink 0.4, mei 0.8"]]}
    md = markdown(report)
    assert "## LoRA" in md and "3 swaps, 0.850 s in all, median 0.250 s" in md
    assert "| none | mei 0.8 | 120 |\n| mei 0.8 | none | 120 |\n| none | ink 0.4, mei 0.8 | 60 |" in md
    assert "h" * 12 not in json.dumps(report) + md  # no hashes, no tuples
    assert Report.build(**common).lora is None and "## LoRA" not in markdown(Report.build(**common).to_json())


def test_a_render_with_a_lora_writes_its_tags_hashes_and_swaps(job_dir, out, tiny_cpu):
    import shutil

    from conftest import ROOT

    shutil.copytree(ROOT / "jobs" / "loras", job_dir / "loras")
    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\nloras: {mei: loras/mei.safetensors}\n"
                                      "defaults: {steps: 2, size: 64x64}\nshots:\n"
                                      "  - {id: a, prompt: a keeper, lora: {mei: 0.8}}\n"
                                      "  - {id: b, prompt: a boat}\n"))
    result = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 2
    mei = job.loras["mei"]
    with Image.open(out / f"a/{next((out / 'a').glob('*.png')).name}") as im:
        params, meta = im.info["parameters"], json.loads(im.info["bcg"])
    assert params.splitlines()[0] == "a keeper <lora:mei:0.8>"
    assert f'Lora hashes: "mei: {mei.shorthash}"' in params
    assert meta["loras"] == [{"name": "mei", "scale": 0.8, "file": "loras/mei.safetensors", "sha256": mei.sha256,
                              "shorthash": mei.shorthash}]
    (rec,) = [r for r in _lines(out).values() if r["shot"] == "a"]
    assert rec["loras"] == meta["loras"]
    assert result.report.lora["swaps"] >= 1 and "## LoRA" in (out / "report.md").read_text()


def test_a_replaced_image_rewrites_its_manifest_line_instead_of_adding_one(tmp_path):
    from storyboard_cli.folder.outputs import Manifest

    manifest = Manifest(tmp_path)
    for path, run in (("a/1.png", "r1"), ("a/2.png", "r1"), ("a/1.png", "r2")):  # a/1.png rendered again
        manifest.append({"path": path, "run": run})
        lines = [json.loads(line) for line in manifest.path.read_text().splitlines()]
        assert len(lines) == len({r["path"] for r in lines})  # one line per image at every moment
    assert lines == [{"path": "a/1.png", "run": "r2"}, {"path": "a/2.png", "run": "r1"}]
    assert Manifest(tmp_path).records == manifest.records


def test_an_edited_image_stays_at_its_path_until_its_replacement_lands(tmp_path):
    from storyboard_cli.folder.outputs import set_aside

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.png").write_bytes(b"painted over")
    kept = set_aside(tmp_path, "a/1.png", "run1")
    assert kept == tmp_path / REPLACED / "run1" / "a" / "1.png" and kept.read_bytes() == b"painted over"
    assert (tmp_path / "a" / "1.png").read_bytes() == b"painted over"  # a kill here leaves no line without its file
    assert set_aside(tmp_path, "a/1.png", "run1") == kept  # asked again: kept once
