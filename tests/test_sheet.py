"""The contact sheet, picks and reroll, on a real tiny render (CPU): rows, thumbnails, escaping, failed
images, atomic rewrites, picks.yaml validation, selects, new candidates for rerolled shots."""

import json
import os
import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from conftest import ROOT, write_job
from storyboard_cli.errors import BadInput
from storyboard_cli.folder import outputs, sheet
from storyboard_cli.folder.charts import bench_svgs
from storyboard_cli.folder.picks import apply_picks, load_picks, reroll_shots, rerolled, with_rerolls
from storyboard_cli.folder.sheet import SheetWriter, write_sheet
from storyboard_cli.folder.sheet_assets import SCRIPT, csp_hash
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render

EVIL = "<script>alert(\"x\")</script> & \"double\" 'single' é 雪"
JOB = f"""version: 1
name: sheet
model: tiny
controlnet: tiny
defaults: {{steps: 2, guidance: 5.0, size: 64x64}}
shots:
  - {{id: a, prompt: {json.dumps(EVIL)}, negative: "<b>no</b>", seed: 7, candidates: 2}}
  - {{id: b, prompt: a keeper with a lantern, seed: 30, control: {{image: control/hero_pose.png, scale: 0.8}}}}
  - {{id: c, prompt: a boat at sea, seed: 20, size: 96x64, candidates: 2}}
"""


class Page(HTMLParser):
    """The elements a test looks at: shot sections in order, images, links, radios, scripts."""

    def __init__(self, text: str):
        super().__init__()
        self.shots, self.imgs, self.links, self.radios, self.scripts = [], [], [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "shot" in (a.get("class") or "").split():
            self.shots.append(a["data-shot"])
        elif tag == "img":
            self.imgs.append(a)
        elif tag == "a":
            self.links.append(a["href"])
        elif tag == "input" and a.get("type") == "radio":
            self.radios.append(a)
        elif tag == "script":
            self.scripts.append(a)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, tiny_cpu):
    """One tiny render: the job and its output folder (tests work on copies of the folder)."""
    base = tmp_path_factory.mktemp("sheet")
    shutil.copytree(ROOT / "jobs" / "control", base / "control")
    job = load_job(write_job(base, JOB))
    result = render(job, RenderOptions(out_dir=base / "out"), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 5
    return job, base / "out"


@pytest.fixture
def out(rendered, tmp_path):
    job, folder = rendered
    copy = tmp_path / "out"
    shutil.copytree(folder, copy)
    return copy


@pytest.fixture
def job(rendered):
    return rendered[0]


def _page(out: Path) -> str:
    return (out / "index.html").read_text(encoding="utf-8")


def test_one_row_per_shot_in_job_order_with_thumbnails_linking_the_pngs(job, out):
    path = write_sheet(out, job)
    assert path == out / "index.html"
    page = Page(_page(out))
    assert page.shots == ["a", "b", "c"]
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert sorted(h for h in page.links if h.endswith(".png")) == pngs
    thumbs = [i for i in page.imgs if "control" not in i["alt"]]
    assert len(thumbs) == 5
    for img in thumbs:
        with Image.open(out / img["src"]) as im:
            assert im.format == "JPEG" and im.size == (int(img["width"]), int(img["height"]))
    assert (out / "c/thumbs/c_c1_s21.jpg").is_file()
    with Image.open(out / "c/thumbs/c_c1_s21.jpg") as im:
        assert im.size == (96, 64)  # smaller than the box: kept at its size
    control = [i for i in page.imgs if "control" in i["alt"]]  # the one net's guide
    assert [i["alt"] for i in control] == ["control of b: controlnet"] and (out / control[0]["src"]).is_file()
    assert control[0]["src"].startswith("b/thumbs/input-")
    text = _page(out)
    for fact in ("64x64", "96x64", "controlnet · scale 0.8", "c1 · seed 8"):
        assert fact in text
    picks = [r["value"] for r in page.radios if r.get("class") == "pick"]
    assert sorted(picks) == pngs  # one pick button per image


def test_user_text_is_escaped_and_only_our_script_runs(job, out):
    write_sheet(out, job)
    text = _page(out)
    assert "<script>alert" not in text and "<b>no</b>" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &quot;double&quot; &#x27;single&#x27; é 雪" in text
    page = Page(text)
    assert [s.get("type") for s in page.scripts] == ["application/json", None]
    assert text.count("</script>") == 2
    # the content security policy lets only the script with our hash run
    assert sheet.esc(csp_hash(SCRIPT)) in text and "unsafe-inline" not in text
    for svg in text.split("<svg")[1:]:  # the charts are well-formed XML
        ET.fromstring("<svg" + svg.split("</svg>")[0] + "</svg>")


def test_failed_and_missing_images_are_shown_with_their_reason(job, out):
    report = json.loads((out / "report.json").read_text())
    report["failures"] = [{"path": "c/c_c1_s21.png", "shot": "c", "reason": "NaN/inf in the decoded <pixels>"}]
    (out / "report.json").write_text(json.dumps(report))
    (out / "c/c_c1_s21.png").unlink()
    (out / "a/a_c0_s7.png").unlink()
    write_sheet(out, job)
    text = _page(out)
    assert "failed: NaN/inf in the decoded &lt;pixels&gt;" in text
    assert "missing: not on disk" in text and "missing: missing" not in text
    page = Page(text)
    picks = sorted(r["value"] for r in page.radios if r.get("class") == "pick")
    assert picks == ["a/a_c1_s8.png", "b/b_c0_s30.png", "c/c_c0_s20.png"]  # nothing to pick where nothing is
    # while a render runs, a missing image is one not rendered yet
    SheetWriter(out, job).update(failures=[], running=True)
    text = _page(out)
    assert "not rendered yet" in text and "render in progress" in text and "NaN/inf" not in text


def test_loras_in_the_png_chunk_are_listed(job, out):
    from PIL import PngImagePlugin

    png = out / "b/b_c0_s30.png"
    with Image.open(png) as im:
        meta = json.loads(im.info["bcg"]) | {"loras": [{"name": "ink<style>", "scale": 0.7}, {"path": "/l/pose.safetensors"}]}
        info = PngImagePlugin.PngInfo()
        info.add_text("bcg", json.dumps(meta))
        im.save(png, pnginfo=info)
    write_sheet(out, job)
    assert "<dt>LoRAs</dt><dd>ink&lt;style&gt; 0.7, pose.safetensors</dd>" in _page(out)


def test_without_the_job_order_comes_from_the_report_then_the_manifest(job, out):
    write_sheet(out)  # report.json names the job file, which still loads
    assert Page(_page(out)).shots == ["a", "b", "c"]
    report = json.loads((out / "report.json").read_text())
    report["job"] = str(out / "gone.yaml")
    (out / "report.json").write_text(json.dumps(report))
    manifest_order = list(dict.fromkeys(json.loads(l)["shot"] for l in (out / "manifest.jsonl").read_text().splitlines()))
    write_sheet(out)
    assert Page(_page(out)).shots == manifest_order
    assert "a keeper with a lantern" in _page(out)  # settings then come from the PNG's bcg chunk


def test_thumbnails_are_made_once_and_again_only_when_stale(job, out):
    SheetWriter(out, job).update()
    thumbs = sorted(out.glob("*/thumbs/*.jpg"))
    before = {t: t.stat().st_mtime_ns for t in thumbs}
    SheetWriter(out, job).update()  # a new process: reads them back, writes none
    assert {t: t.stat().st_mtime_ns for t in thumbs} == before
    png = out / "a/a_c1_s8.png"
    later = (out / "a/thumbs/a_c1_s8.jpg").stat().st_mtime_ns + 10**9
    os.utime(png, ns=(later, later))  # as a re-render would
    SheetWriter(out, job).update()
    after = {t: t.stat().st_mtime_ns for t in thumbs}
    changed = [t.name for t in thumbs if after[t] != before[t]]
    assert changed == ["a_c1_s8.jpg"]


def test_a_renders_thumbnails_are_made_beside_it_from_the_pixels_as_the_sheet_makes_them(tmp_path, tiny_cpu,
                                                                                            monkeypatch):
    """Each candidate's thumbnail is made by the encoder that wrote its PNG, from the same pixels, so no sheet update
    reads a PNG back to make one (after the last batch that would run with the GPU done); the bytes are those the
    sheet makes from the PNG."""
    made = []  # the thumbnails the sheet made itself
    real = sheet.make_thumb

    def spy(src, dst, src_mtime_ns):
        if not dst.exists() or dst.stat().st_mtime_ns < src_mtime_ns:
            made.append(dst.name)
        return real(src, dst, src_mtime_ns)

    monkeypatch.setattr(sheet, "make_thumb", spy)
    shutil.copytree(ROOT / "jobs" / "control", tmp_path / "control")
    job = load_job(write_job(tmp_path, JOB))
    result = render(job, RenderOptions(out_dir=tmp_path / "out"), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 5 and result.sheet is not None
    pngs = sorted((tmp_path / "out").glob("*/*.png"))
    assert len(pngs) == 5
    assert not [m for m in made if m in {p.with_suffix(".jpg").name for p in pngs}], made  # only the guides'
    for png in pngs:
        thumb = png.parent / "thumbs" / png.with_suffix(".jpg").name
        again = tmp_path / "again.jpg"
        again.unlink(missing_ok=True)
        real(png, again, 0)
        assert thumb.read_bytes() == again.read_bytes(), png.name


def test_a_thumbnail_in_the_way_of_a_render_is_left_and_the_images_land(tmp_path, tiny_cpu):
    """A file bcg did not write where a candidate's thumbnail goes: the render's encoders leave it, every image lands,
    and the sheet's note says why it was not updated, as before the thumbnails were made beside the render."""
    shutil.copytree(ROOT / "jobs" / "control", tmp_path / "control")
    job = load_job(write_job(tmp_path, JOB))
    theirs = tmp_path / "out" / "a" / "thumbs" / "a_c0_s7.jpg"
    theirs.parent.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(theirs, format="JPEG")
    data = theirs.read_bytes()
    result = render(job, RenderOptions(out_dir=tmp_path / "out"), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 5
    assert theirs.read_bytes() == data
    assert [n for n in result.notes if "a_c0_s7.jpg: exists and was not written by bcg" in n], result.notes
    assert (tmp_path / "out" / "c" / "thumbs" / "c_c1_s21.jpg").is_file()  # the others' thumbnails are there


def test_a_file_bcg_did_not_write_is_never_replaced(job, out):
    (out / "index.html").write_text("<html>my own page</html>")
    with pytest.raises(BadInput, match="index.html: exists and was not written by bcg"):
        write_sheet(out, job)
    assert (out / "index.html").read_text() == "<html>my own page</html>"
    (out / "index.html").unlink()
    thumb = out / "a/thumbs/a_c0_s7.jpg"
    thumb.parent.mkdir(parents=True, exist_ok=True)  # the render may have made thumbnails
    Image.new("RGB", (8, 8)).save(thumb, format="JPEG")  # replaced by someone's JPEG, older than the PNG
    os.utime(thumb, ns=(0, 0))
    with pytest.raises(BadInput, match="a_c0_s7.jpg: exists and was not written by bcg"):
        write_sheet(out, job)
    with Image.open(thumb) as im:
        assert im.size == (8, 8)


def test_the_page_is_replaced_atomically(job, out, monkeypatch):
    writer = SheetWriter(out, job)
    writer.update()
    old = _page(out)
    (out / "c/c_c1_s21.png").unlink()

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "replace", broken)
    with pytest.raises(OSError):
        writer.update()
    monkeypatch.undo()
    assert _page(out) == old  # the reader still sees the whole old page
    assert not list(out.glob(".index.html.*.tmp"))
    writer.update()
    assert "c/c_c1_s21.png" in old and "c/c_c1_s21.png" not in _page(out)
    assert "missing: not on disk" in _page(out)


def test_an_update_opens_only_new_files(job, out, monkeypatch):
    writer = SheetWriter(out, job)
    writer.update()
    calls = []
    real = sheet.read_chunk
    monkeypatch.setattr(sheet, "read_chunk", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(sheet, "make_thumb", lambda *a: pytest.fail("thumbnail remade"))
    writer.update()
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setattr(sheet, "read_chunk", lambda p: calls.append(p) or real(p))
    shutil.copy(out / "a/a_c1_s8.png", out / "a/a_c5_s12.png")  # a new image lands
    writer.update()
    assert calls == [out / "a/a_c5_s12.png"]
    assert (out / "a/thumbs/a_c5_s12.jpg").is_file() and "a_c5_s12.png" in _page(out)


# ---------------------------------------------------------------- picks.yaml


def _picks(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "picks.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, line, message", [
    ('picks:\n  "a": "a/a_c1_s8.png"\n  "zz": "a/a_c0_s7.png"\n', 3, "shot 'zz' field 'picks': unknown shot"),
    ('picks:\n  a: a/a_c9_s99.png\n', 2, "shot 'a' field 'picks': missing file"),
    ('picks:\n  a: a/a_c0_s7.png\n  b: b/b_c0_s30.png\n  a: a/a_c1_s8.png\n', 4,
     "shot 'a' field 'picks': two picks for one shot (first on line 2)"),
    ('picks:\n  a: [a/a_c0_s7.png, a/a_c1_s8.png]\n', 2, "shot 'a' field 'picks': must be one candidate file"),
    ('picks:\n  a: "a/a_c0_s7.png\n', 3, "YAML syntax error"),
    ('picks:\n  a: c/c_c0_s20.png\n', 2, "shot 'a' field 'picks': c/c_c0_s20.png is not a candidate image"),
    ('picks:\n  a: ../out/a/a_c0_s7.png\n', 2, "give the path relative to the output folder"),
    ('picks:\n  a: a/a_c0_s7.png\nreroll: [b, a]\n', 3, "shot 'a' field 'reroll': both picked (line 2)"),
    ('reroll:\n  - c\n  - ccc\n', 3, "shot 'ccc' field 'reroll': unknown shot"),
    ('picked:\n  a: a/a_c0_s7.png\n', 1, "field 'picked': unknown key; did you mean 'picks'?"),
])
def test_bad_picks_files_give_one_located_line(job, out, tmp_path, text, line, message):
    path = _picks(tmp_path, text)
    for j in (job, None):  # with the job, and from the output folder alone
        with pytest.raises(BadInput) as e:
            load_picks(path, out, j)
        msg = str(e.value)
        assert msg.startswith((f"{path}:{line}: ", f"{path}:{line} shot", f"{path}:{line} field")) and message in msg and "\n" not in msg


def test_picks_apply_in_shot_order_and_are_recorded(job, out, tmp_path):
    path = _picks(tmp_path, '# from the sheet\npicks:\n  "c": "c/c_c1_s21.png"\n  "a": "a/a_c0_s7.png"\n'
                            'reroll:\n  - "b"\n')
    picks = load_picks(path, out, job)
    assert picks.picks == {"c": "c/c_c1_s21.png", "a": "a/a_c0_s7.png"} and picks.reroll == ("b",)
    written = apply_picks(out, picks, job)
    assert [p.relative_to(out).as_posix() for p in written] == ["selects/001_a.png", "selects/003_c.png"]
    assert (out / "selects/001_a.png").read_bytes() == (out / "a/a_c0_s7.png").read_bytes()
    assert (out / "selects/003_c.png").read_bytes() == (out / "c/c_c1_s21.png").read_bytes()
    record = json.loads((out / "picks.json").read_text())
    assert [(r["shot"], r["path"], r["select"], r["seed"]) for r in record["picks"]] == [
        ("a", "a/a_c0_s7.png", "selects/001_a.png", 7), ("c", "c/c_c1_s21.png", "selects/003_c.png", 21)]
    assert record["reroll"] == ["b"]
    # the sheet shows the recorded picks and starts from them
    write_sheet(out, job)
    state = json.loads(_page(out).split('id="bcg-state">')[1].split("</script>")[0])
    assert state["picks"] == {"a": "a/a_c0_s7.png", "c": "c/c_c1_s21.png"} and state["reroll"] == ["b"]
    # picking again: the select no longer picked goes, a foreign file in selects/ stays
    (out / "selects/notes.txt").write_text("mine")
    again = load_picks(_picks(tmp_path, 'picks:\n  b: b/b_c0_s30.png\n  c: c/c_c0_s20.png\n'), out)
    apply_picks(out, again)
    assert sorted(p.name for p in (out / "selects").iterdir()) == ["002_b.png", "003_c.png", "notes.txt"]
    assert (out / "selects/003_c.png").read_bytes() == (out / "c/c_c0_s20.png").read_bytes()


def test_picking_never_replaces_a_file_bcg_did_not_write(job, out, tmp_path):
    (out / "selects").mkdir()
    (out / "selects/003_c.png").write_bytes(b"someone's frame")
    picks = load_picks(_picks(tmp_path, "picks:\n  a: a/a_c0_s7.png\n  c: c/c_c0_s20.png\n"), out, job)
    with pytest.raises(BadInput, match="003_c.png: exists and was not written by bcg"):
        apply_picks(out, picks, job)
    assert (out / "selects/003_c.png").read_bytes() == b"someone's frame"
    assert not (out / "selects/001_a.png").exists() and not (out / "picks.json").exists()  # checked first


# ---------------------------------------------------------------- reroll

def test_reroll_adds_candidates_after_the_existing_ones_with_new_seeds(job, out):
    from storyboard_cli.job.plan import work_items

    (extra,) = reroll_shots(job, out, ["c"])
    assert (extra.id, extra.first_candidate, extra.candidates, extra.seed) == ("c", 2, 2, 20)
    new = [p for i in work_items(with_rerolls(job, out, ["c"])) for p in i.outputs if p not in
           {q for j in work_items(job) for q in j.outputs}]
    assert new == ["c/c_c2_s22.png", "c/c_c3_s23.png"]
    # a candidate left on disk from an earlier run counts as taken, and so does its seed
    shutil.copy(out / "c/c_c1_s21.png", out / "c/c_c4_s23.png")
    (extra,) = reroll_shots(job, out, ["c"])
    assert extra.first_candidate == 5 and [extra.seed + k for k in (5, 6)] == [25, 26]
    # the job's seed changed since (seed + 5 = 23 is taken): new seeds start after every seed used
    moved = replace(job, shots=tuple(replace(s, seed=18) if s.id == "c" else s for s in job.shots))
    (extra,) = reroll_shots(moved, out, ["c"])
    assert [extra.seed + k for k in (5, 6)] == [24, 25]
    with pytest.raises(BadInput, match="shot 'cc' is not in"):
        reroll_shots(job, out, ["cc"])


def test_reroll_render_keeps_every_image_and_the_sheet_shows_the_new_ones(job, out, tiny_cpu, tmp_path):
    before = {p: p.read_bytes() for p in out.rglob("*.png")}
    with pytest.raises(BadInput, match="marks no shot to reroll"):
        rerolled(job, out, _picks(tmp_path, "picks:\n  a: a/a_c0_s7.png\n"))
    again = rerolled(job, out, _picks(tmp_path, "picks:\n  c: c/c_c0_s20.png\nreroll: [a]\n"))
    result = render(again, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.rendered == 2 and result.skipped == 5
    assert all(p.read_bytes() == data for p, data in before.items())
    assert (out / "a/a_c2_s9.png").is_file() and (out / "a/a_c3_s10.png").is_file()
    write_sheet(out, job)
    picks = [r["value"] for r in Page(_page(out)).radios if r.get("class") == "pick"]
    assert [p for p in picks if p.startswith("a/")] == ["a/a_c0_s7.png", "a/a_c1_s8.png", "a/a_c2_s9.png",
                                                      "a/a_c3_s10.png"]


# ---------------------------------------------------------------- bench charts


def test_bench_svgs_from_a_real_record():
    rec = json.loads((ROOT / "tests/data/bench_record.json").read_text())  # benchmarks/results/graphs/2026-11-29-bench.json
    svgs = bench_svgs(rec, {"a_diffusers": "(a) diffusers <loop>"})
    assert set(svgs) == {"contenders", "step_curve", "step_curve_control"}
    for text in svgs.values():
        ET.fromstring(text)
    labels = [t.text for t in ET.fromstring(svgs["contenders"]).iter("{http://www.w3.org/2000/svg}text")]
    assert "(a) diffusers <loop>" in labels and "d bcg warm" in labels and "0.716" in labels
    curve = ET.fromstring(svgs["step_curve"])
    lines = curve.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 and len(lines[0].get("points").split()) == len(rec["step_curve"])
    assert bench_svgs({"device": "cpu"}) == {}


def test_the_banner_says_a_render_is_running_only_while_one_holds_the_lock(job, out):
    from storyboard_cli.folder.layout import LOCK
    from storyboard_cli.folder.lock import OutputLock

    assert "render in progress" not in _page(out)  # as the finished render left it
    write_sheet(out, job)
    assert "render in progress" not in _page(out)
    with OutputLock(out):  # a live render
        write_sheet(out, job)
        assert "render in progress" in _page(out)
    (out / LOCK).write_text("pid 1 on elsewhere\n")  # left behind by a killed render: not held
    write_sheet(out, job)
    assert "render in progress" not in _page(out)


def test_the_artists_edited_frame_is_shown_marked_pickable_and_copied_as_it_is(job, out, tmp_path):
    from storyboard_cli.folder.sheet import EDITED

    edited = out / "a/a_c1_s8.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(edited)  # painted over: the editor drops bcg's chunk
    data = edited.read_bytes()
    write_sheet(out, job)
    text = _page(out)
    page = Page(text)
    assert "a/a_c1_s8.png" in {r["value"] for r in page.radios if r.get("class") == "pick"}
    assert 'class="cand edited"' in text and sheet.esc(EDITED) in text and "missing" not in text
    assert any("a_c1_s8" in img["src"] and "thumbs" in img["src"] for img in page.imgs)
    picks = _picks(tmp_path, "picks:\n  a: a/a_c1_s8.png\n")
    for _ in range(2):  # a second pick replaces its own select (it has no bcg chunk either)
        (select,) = [p for p in apply_picks(out, load_picks(picks, out, job), job) if "_a" in p.name]
        assert select.read_bytes() == data
    record = json.loads((out / "picks.json").read_text())
    assert record["picks"][0]["edited"] is True and record["picks"][0]["candidate"] == 1
