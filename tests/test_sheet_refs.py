"""References and several ControlNets in what a render leaves on disk: the contact sheet shows each shot's reference
thumbnails and every control guide, captioned (pure: images written without a model, and in real Chromium);
report.json and report.md list the characters, one-off references and named nets; the PNGs carry the references'
digests and scales (the bcg chunk) and the nets and references as A1111 ControlNet units. Last, the example job
jobs/characters.yaml rendered through the CLI."""

import json
import os
import shutil
from html.parser import HTMLParser
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.folder.outputs import atomic_write, owner, png_bytes
from storyboard_cli.folder.report import CONDITIONS, Report, Timings, job_conditions, markdown, write_report
from storyboard_cli.folder.sheet import write_sheet
from storyboard_cli.folder.sheet_assets import CSP
from storyboard_cli.job.digests import file_sha256
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import work_items

EXAMPLE = ROOT / "jobs" / "characters.yaml"
CHROMIUM = Path("/usr/bin/chromium")  # as tests/test_browser.py runs it
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
C01 = ["mei · scale 0.6", "pose · scale 0.8", "depth · scale 0.5 · end 0.6"]  # its reference, then its nets
CAPTIONS = {"c01-window": C01, "c02-stranger": ["reference · scale 0.5"],
            "c03-meeting": ["mei · scale 0.6", "reference · scale 0.5"], "c04-empty-room": ["depth · scale 0.7"]}
# the fields of sd-webui-controlnet's ControlNetUnit that a unit's infotext may name (its parser passes each as a
# keyword: any other fails the paste)
UNIT_FIELDS = {"module", "model", "weight", "guidance_start", "guidance_end", "resize_mode", "processor_res",
               "threshold_a", "threshold_b", "pixel_perfect", "control_mode"}


class Guides(HTMLParser):
    """Each shot's guide figures: (kind, img attributes or None, caption), and whether it has the one-net block."""

    def __init__(self, text: str):
        super().__init__()
        self.shots: dict[str, list] = {}
        self.control_blocks: list[str] = []
        self._shot = self._fig = None
        self._caption = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "section" and "shot" in classes:
            self._shot = a["data-shot"]
            self.shots[self._shot] = []
        elif tag == "div" and "control" in classes:
            self.control_blocks.append(self._shot)
        elif tag == "figure" and "guide" in classes:
            self._fig = [classes[1], None, "", a.get("title")]
            self.shots[self._shot].append(self._fig)
        elif tag == "img" and self._fig is not None:
            self._fig[1] = a
        elif tag == "figcaption" and self._fig is not None:
            self._caption = True

    def handle_endtag(self, tag):
        if tag == "figcaption":
            self._caption = False
        elif tag == "figure":
            self._fig = None

    def handle_data(self, data):
        if self._caption:
            self._fig[2] += data


def _project(base: Path) -> Path:
    """A copy of the example job with its images and LoRA, in `base/job` (the output folder goes beside it)."""
    job_dir = base / "job"
    job_dir.mkdir(parents=True)
    shutil.copy(EXAMPLE, job_dir)
    for sub in ("refs", "control", "loras"):
        shutil.copytree(ROOT / "jobs" / sub, job_dir / sub)
    return job_dir / EXAMPLE.name


def _fake_render(job, out: Path) -> None:
    """Every output PNG as a render writes it (its text chunks), with noise for pixels: no model."""
    for item in work_items(job):
        pixels = (np.random.default_rng(item.seed).random((item.height, item.width, 3)) * 255).astype(np.uint8)
        for path in item.outputs:
            atomic_write(out / path, png_bytes(pixels, owner(item, path), job.model))


def _one_net_job(folder: Path, shots: str, top: str = ""):
    """A job on the one net of `controlnet:`, the example's control images and references copied beside it."""
    for sub in ("control", "refs"):
        shutil.copytree(ROOT / "jobs" / sub, folder / sub)
    return load_job(write_job(folder, f"""version: 1
name: one-net
model: tiny
controlnet: tiny
{top}defaults: {{steps: 2, size: 64x64}}
shots:
{shots}"""))


@pytest.fixture
def folder(tmp_path):
    job = load_job(_project(tmp_path))
    out = tmp_path / "out"  # the references live in ../job/refs: outside it
    _fake_render(job, out)
    return job, out


def _captions(page: Guides) -> dict[str, list[str]]:
    return {shot: [f[2] for f in figs] for shot, figs in page.shots.items()}


def test_sheet_shows_each_shots_references_and_every_guide_from_inside_the_folder(folder):
    job, out = folder
    page = Guides(write_sheet(out, job).read_text(encoding="utf-8"))
    assert _captions(page) == CAPTIONS
    assert page.control_blocks == []  # the guides show the control images: no one-net block beside them
    figs = page.shots["c01-window"]
    assert [f[0] for f in figs] == ["reference", "control", "control"]
    assert [f[3] for f in figs] == ["refs/mei.png", "control/mei_pose.png", "control/window_depth.png"]
    assert [f[1]["alt"] for f in figs] == ["reference of c01-window: mei", "control of c01-window: pose",
                                           "control of c01-window: depth"]
    assert page.shots["c02-stranger"][0][1]["alt"] == "reference of c02-stranger"
    sources = {"refs/mei.png": [], "refs/stranger.png": [], "control/mei_pose.png": [], "control/window_depth.png": []}
    for figs in page.shots.values():
        for _, img, _, file in figs:
            src = img["src"]
            assert not src.startswith(("/", "file:", "..")) and (out / src).is_file()  # CSP: img-src 'self' file:
            assert src.startswith(src.split("/")[0] + "/thumbs/input-")
            sources[file].append(out / src)
    assert "img-src 'self' file: data:" in CSP
    for file, thumbs in sources.items():
        with Image.open(job.path.parent / file) as original:
            want = np.asarray(original.convert("RGB"), dtype=float)
        for thumb in thumbs:
            with Image.open(thumb) as im:
                assert im.format == "JPEG" and im.size == original.size  # 128x128: under the box, kept whole
                assert np.abs(np.asarray(im, dtype=float) - want).mean() < 8  # its image, not another
        assert len({t.name for t in thumbs}) == 1  # one name per image, in every shot that uses it


def test_a_reference_replaced_by_an_older_file_gets_its_own_thumbnail(folder):
    job, out = folder
    write_sheet(out, job)
    mei, stranger = job.path.parent / "refs/mei.png", job.path.parent / "refs/stranger.png"
    shutil.copy(stranger, mei)
    os.utime(mei, ns=(1, 1))  # older than the thumbnail made from the file before
    page = Guides(write_sheet(out, job).read_text(encoding="utf-8"))
    src = page.shots["c01-window"][0][1]["src"]
    assert src == f"c01-window/thumbs/input-{file_sha256(stranger)[:16]}.jpg"
    with Image.open(out / src) as im, Image.open(stranger) as want:
        assert np.abs(np.asarray(im, dtype=float) - np.asarray(want.convert("RGB"), dtype=float)).mean() < 8


def test_a_missing_reference_is_a_note_under_its_caption(folder):
    job, out = folder
    (job.path.parent / "refs/stranger.png").unlink()
    text = write_sheet(out, job).read_text(encoding="utf-8")
    figs = Guides(text).shots["c02-stranger"]
    assert figs[0][1] is None and figs[0][2] == "reference · scale 0.5"
    assert f"not found: {job.path.parent / 'refs/stranger.png'}" in text


def test_sheet_from_the_images_settings_when_the_job_no_longer_loads(folder):
    job, out = folder
    write_report(out, Report.build(**_report_args(job)))
    job.path.write_text("shots: [", encoding="utf-8")  # broken: the sheet reads each image's bcg chunk
    page = Guides(write_sheet(out).read_text(encoding="utf-8"))
    assert _captions(page) == CAPTIONS
    assert all(img is not None for figs in page.shots.values() for _, img, _, _ in figs)  # found from its folder


def test_the_one_net_of_controlnet_is_a_guide_like_any_other(tmp_path):
    job = _one_net_job(tmp_path, """  - {id: a, prompt: a lighthouse, seed: 1}
  - {id: b, prompt: a keeper, seed: 2, control: {image: control/hero_pose.png, scale: 0.8}}
""")
    out = tmp_path / "out"
    _fake_render(job, out)
    page = Guides(write_sheet(out, job).read_text(encoding="utf-8"))
    assert _captions(page) == {"a": [], "b": ["controlnet · scale 0.8"]} and page.control_blocks == []
    ((kind, img, _, file),) = page.shots["b"]
    assert (kind, file, img["alt"]) == ("control", "control/hero_pose.png", "control of b: controlnet")
    assert img["src"].startswith("b/thumbs/input-") and (out / img["src"]).is_file()
    job.path.write_text("shots: [", encoding="utf-8")  # broken: the sheet reads each image's bcg chunk
    assert _captions(Guides(write_sheet(out).read_text(encoding="utf-8"))) == {"a": [], "b": ["controlnet · scale 0.8"]}


def test_the_one_net_of_controlnet_beside_a_reference_is_a_guide(tmp_path):
    job = _one_net_job(tmp_path, """  - {id: a, prompt: mei, seed: 1, reference: refs/mei.png,
     control: {image: control/hero_pose.png, scale: 0.8}}
""", top="ip_adapter: tiny\n")
    out = tmp_path / "out"
    _fake_render(job, out)
    page = Guides(write_sheet(out, job).read_text(encoding="utf-8"))
    assert _captions(page) == {"a": ["reference · scale 1", "controlnet · scale 0.8"]}
    assert page.control_blocks == []


# ---------------------------------------------------------------- report


def _report_args(job) -> dict:
    return dict(job=str(job.path), out_dir=Path("o"), device="cpu", dtype="float32", engine="eager", model="tiny",
                timings=Timings(), wall_s=1.0, rendered=6, skipped=0, failed=[], peak_mem_mb=None, graphs=[],
                status="done", notes=[], conditions=job_conditions(job))


def test_report_lists_the_characters_one_off_references_and_named_nets(tmp_path):
    job = load_job(_project(tmp_path))
    mei, stranger = (file_sha256(job.path.parent / f"refs/{n}.png")[:16] for n in ("mei", "stranger"))
    report = Report.build(**_report_args(job))
    data = report.to_json()
    assert data["characters"] == [{"name": "mei", "file": "refs/mei.png", "sha256": mei, "scale": 0.6,
                                   "shots": ["c01-window", "c03-meeting"]}]
    assert data["references"] == [{"file": "refs/stranger.png", "sha256": stranger, "scale": 0.5,
                                   "shots": ["c02-stranger", "c03-meeting"]}]
    assert data["controlnets"] == [{"name": "pose", "model": "tiny", "shots": ["c01-window"]},
                                   {"name": "depth", "model": "tiny", "shots": ["c01-window", "c04-empty-room"]}]
    assert Report.from_json(json.loads(json.dumps(data))) == report  # through the file and back
    md = markdown(data)
    assert "## References" in md and "## ControlNets" in md
    assert f"| mei | refs/mei.png | `{mei}` | 0.6 | c01-window, c03-meeting |" in md
    assert f"| (one-off) | refs/stranger.png | `{stranger}` | 0.5 | c02-stranger, c03-meeting |" in md
    assert "| depth | `tiny` | c01-window, c04-empty-room |" in md


def test_report_of_a_job_without_them_keeps_its_keys_and_old_reports_load(tmp_path):
    job = _one_net_job(tmp_path, "  - {id: b, prompt: a keeper, control: {image: control/hero_pose.png, scale: 0.8}}\n")
    assert job_conditions(job) == dict.fromkeys(CONDITIONS)  # the one net of `controlnet:` is no named net
    data = Report.build(**_report_args(job)).to_json()
    assert not set(CONDITIONS) & set(data)
    assert Report.from_json(dict(data)).to_json() == data  # a report.json from before these keys
    assert "## References" not in markdown(data) and "## ControlNets" not in markdown(data)


# ---------------------------------------------------------------- PNG metadata


def _text(path: Path) -> tuple[dict, str]:
    with Image.open(path) as im:
        return json.loads(im.info["bcg"]), im.info["parameters"]


def _units(parameters: str) -> list[dict]:
    """The ControlNet units of an A1111 parameters line, parsed as sd-webui-controlnet parses them."""
    line = parameters.splitlines()[-1]
    units = []
    for i in range(8):
        head = f'ControlNet {i}: "'
        if head not in line:
            break
        value = line.split(head, 1)[1].split('"', 1)[0]
        pairs = (item.strip().split(": ") for item in value.split(","))
        units.append({key.lower().replace(" ", "_"): v for key, v in pairs})
    return units


def test_png_metadata_carries_reference_digests_and_scales_and_the_nets_as_a1111_units(folder):
    job, out = folder
    mei, stranger = (file_sha256(job.path.parent / f"refs/{n}.png")[:16] for n in ("mei", "stranger"))
    meta, parameters = _text(out / "c03-meeting/c03-meeting_c0_s3003.png")
    assert meta["references"] == [{"file": "refs/mei.png", "sha256": mei, "scale": 0.6, "character": "mei"},
                                  {"file": "refs/stranger.png", "sha256": stranger, "scale": 0.5}]
    assert meta["reference_scale"] == 0.6 and meta["ip_adapter"] == "tiny"  # the largest: the one applied
    assert _units(parameters) == [{"module": "ip-adapter-auto", "model": "tiny", "weight": "0.6",
                                   "guidance_start": "0", "guidance_end": "1"}] * 2

    meta, parameters = _text(out / "c01-window/c01-window_c0_s3001.png")
    assert [(c["net"], c["scale"], c.get("end", 1.0)) for c in meta["controls"]] == [("pose", 0.8, 1.0),
                                                                                    ("depth", 0.5, 0.6)]
    units = _units(parameters)
    assert [(u["module"], u["weight"], u["guidance_end"]) for u in units] == [
        ("none", "0.8", "1"), ("none", "0.5", "0.6"), ("ip-adapter-auto", "0.6", "1")]
    assert all(set(u) <= UNIT_FIELDS for u in units)
    assert "ControlNet: " not in parameters  # the one-net field is for `controlnet:` jobs only
    assert "<lora:mei:0.8>" in parameters.splitlines()[0]  # the character's LoRA


def test_png_parameters_of_a_one_net_job_are_as_before(tmp_path):
    job = _one_net_job(tmp_path, "  - {id: b, prompt: a keeper, seed: 2, control: {image: control/hero_pose.png, "
                                 "scale: 0.8, end: 0.5}}\n")
    item = work_items(job)[0]
    data = png_bytes(np.zeros((64, 64, 3), np.uint8), item, job.model)
    with Image.open(BytesIO(data)) as im:
        assert im.info["parameters"] == ("a keeper\nSteps: 2, Sampler: Euler, CFG scale: 5, Seed: 2, Size: 64x64, "
                                         "Model: tiny, ControlNet: hero_pose.png (scale 0.8, end 0.5)")


# ---------------------------------------------------------------- in a browser


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                  "(apt-get install chromium)")
def test_chromium_shows_the_reference_thumbnails_from_the_file_system(folder):
    from playwright.sync_api import sync_playwright

    job, out = folder
    path = write_sheet(out, job)
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)  # a CSP violation is a console error
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(path.as_uri())
            page.wait_for_load_state("load")
            shown = page.evaluate("""() => Array.from(document.querySelectorAll("figure.guide")).map(f => {
                const img = f.querySelector("img");
                return [f.closest("section.shot").dataset.shot, f.querySelector("figcaption").textContent,
                        img.naturalWidth, img.getBoundingClientRect().height];
            })""")
            refs = page.locator("figure.guide.reference img").count()
        finally:
            browser.close()
    assert [(s, c) for s, c, _, _ in shown] == [(s, c) for s, cs in CAPTIONS.items() for c in cs]
    assert all(width == 128 and height > 90 for _, _, width, height in shown)  # decoded and laid out
    assert refs == 4
    assert problems == []


# ---------------------------------------------------------------- the example job, rendered


def test_the_example_job_renders_through_the_cli(tmp_path):
    from storyboard_cli.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["render", str(EXAMPLE), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(list(out.rglob("*_c*_s*.png"))) == 6
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(line["shot"] for line in lines) == ["c01-window", "c01-window", "c02-stranger", "c02-stranger",
                                                      "c03-meeting", "c04-empty-room"]
    refs = {line["path"]: [r["file"] for r in line.get("references", ())] for line in lines}
    assert refs["c03-meeting/c03-meeting_c0_s3003.png"] == ["refs/mei.png", "refs/stranger.png"]
    assert refs["c04-empty-room/c04-empty-room_c0_s3004.png"] == []
    meta, _ = _text(out / "c03-meeting/c03-meeting_c0_s3003.png")
    assert [r.get("character") for r in meta["references"]] == ["mei", None]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "done"
    assert [c["name"] for c in report["characters"]] == ["mei"]
    assert "| mei | refs/mei.png |" in (out / "report.md").read_text()
    page = Guides((out / "index.html").read_text(encoding="utf-8"))
    assert _captions(page) == CAPTIONS
    assert all((out / img["src"]).is_file() for figs in page.shots.values() for _, img, _, _ in figs)
