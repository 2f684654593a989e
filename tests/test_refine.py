"""Refinements (`bcg refine`) on a real tiny render (CPU): their names beside the candidates, REFINES.yaml read and
checked (one located line, exit 2), the sheet showing each refinement after its source with the repainted area
outlined, and `bcg pick` of a refinement."""

import json
import shutil
from dataclasses import replace
from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from conftest import write_job
from storyboard_cli.cli import app
from storyboard_cli.errors import BadInput
from storyboard_cli.folder import outputs
from storyboard_cli.folder.layout import (candidate_files, parse_output_name, parse_refine_name, refine_name,
                                          refinement_files)
from storyboard_cli.folder.picks import apply_picks, load_picks
from storyboard_cli.folder.refines import load_refines
from storyboard_cli.folder.sheet import write_sheet
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import work_items
from storyboard_cli.job.refinement import Refinement
from storyboard_cli.run.render import RenderOptions, render

runner = CliRunner()
JOB = """version: 1
name: refine
model: tiny
defaults: {steps: 2, guidance: 5.0, size: 64x64}
shots:
  - {id: a, prompt: a lighthouse keeper, seed: 7, candidates: 2}
  - {id: b, prompt: a boat at sea, seed: 30}
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, tiny_cpu):
    base = tmp_path_factory.mktemp("refine")
    job = load_job(write_job(base, JOB))
    result = render(job, RenderOptions(out_dir=base / "out"), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 3
    return job, base / "out"


@pytest.fixture
def out(rendered, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(rendered[1], copy)
    return copy


@pytest.fixture
def job(rendered):
    return rendered[0]


def _refines(tmp_path, text: str, name: str = "refines.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _refinement(job, out, source: str, tag: str, outline, j: int = 0):
    """A refinement file as bcg writes one: the source's pixels, flipped, under the refinement's settings."""
    shot_id, k, seed = parse_output_name(source)
    shot = next(s for s in job.shots if s.id == shot_id)
    refined = replace(shot, candidates=1, first_candidate=j, seed=seed - j, refine=Refinement(source, tag, outline))
    item = work_items(replace(job, shots=(refined,)))[0]
    pixels = np.asarray(Image.open(out / source).convert("RGB"))[::-1].copy()
    (out / item.outputs[0]).write_bytes(outputs.png_bytes(pixels, item, job.model))
    return item.outputs[0]


def test_names_never_collide_with_candidates():
    name = refine_name("a/a_c1_s8.png", "hand", 0, 8)
    assert name == "a/a_c1_s8.hand_c0_s8.png"
    assert parse_output_name(name) is None and parse_refine_name(name) == ("a", "a/a_c1_s8.png", "hand", 0, 8)
    assert parse_refine_name("a/a_c1_s8.png") is None and parse_refine_name("b/a_c1_s8.hand_c0_s8.png") is None
    dotted = refine_name("s.1/s.1_c0_s3.png", "r2", 1, 4)  # a shot id may hold '.': the name still parses one way
    assert parse_refine_name(dotted) == ("s.1", "s.1/s.1_c0_s3.png", "r2", 1, 4)


def test_entries_take_the_pick_the_shot_and_a_tag_by_position(job, out, tmp_path):
    mask = Image.new("L", (64, 64))
    mask.paste(255, (10, 20, 30, 44))
    mask.save(tmp_path / "hand.png")
    path = _refines(tmp_path, "picks:\n  a: a/a_c1_s8.png\nrefine:\n"
                              "  - shot: a\n    mask: {box: [8, 8, 16, 24], padding: 8}\n    strength: 0.5\n"
                              "  - shot: a\n    mask: {image: hand.png, blur: 4}\n    prompt: a hand\n"
                              "    candidates: 2\n    seed: 99\n    hires: {scale: 1.5}\n"
                              "  - shot: b\n    candidate: b/b_c0_s30.png\n    name: sky\n")
    a1, a2, b = load_refines(path, out, job)
    assert (a1.source, a1.tag, a1.outline, a1.strength, a1.seed, a1.prompt) == (
        "a/a_c1_s8.png", "r1", (8, 8, 16, 24), 0.5, 8, "a lighthouse keeper")
    assert (a2.tag, a2.outline, a2.prompt, a2.candidates, a2.seed, a2.hires.scale) == (
        "r2", (10, 20, 20, 24), "a hand", 2, 99, 1.5)
    assert (b.source, b.tag, b.area, b.outline, b.strength) == ("b/b_c0_s30.png", "sky", None, None, 0.75)
    # without this file's picks: picks.json's (`bcg pick`); without a job: the folder's report's
    apply_picks(out, load_picks(_refines(tmp_path, "picks:\n  b: b/b_c0_s30.png\n", "picks.yaml"), out, job), job)
    assert load_refines(_refines(tmp_path, "refine:\n  - {shot: b}\n"), out)[0].source == "b/b_c0_s30.png"


@pytest.mark.parametrize("text, line, where, message", [
    ("refine:\n  - {shot: c}\n", 2, "shot 'c' field 'shot'", "unknown shot (not in the folder's job)"),
    ("refine:\n  - {shot: a}\n", 2, "shot 'a' field 'candidate'", "the shot has no pick"),
    ("refine:\n  - shot: a\n    candidate: a/a_c5_s12.png\n", 3, "shot 'a' field 'candidate'", "missing file"),
    ("refine:\n  - shot: a\n    candidate: b/b_c0_s30.png\n", 3, "shot 'a' field 'candidate'",
     "b/b_c0_s30.png is not an image bcg rendered for this shot"),
    ("refine:\n  - shot: a\n    candidate: ../out/a/a_c0_s7.png\n", 3, "shot 'a' field 'candidate'",
     "give the path relative to the output folder"),
    ("refine:\n  - shot: b\n    candidate: b/b_c0_s30.png\n    mask: {box: [40, 40, 32, 8]}\n", 4,
     "shot 'b' field 'mask.box'", "[40, 40, 32, 8] is outside the 64x64 image"),
    ("refine:\n  - shot: b\n    candidate: b/b_c0_s30.png\n    mask: {box: [1, 2]}\n", 4,
     "shot 'b' field 'mask.box'", "must be [x, y, w, h]"),
    ("refine:\n  - shot: b\n    candidate: b/b_c0_s30.png\n    strength: 0\n", 4, "shot 'b' field 'strength'",
     "must be in (0, 1]"),
    ("refine:\n  - shot: b\n    candidate: b/b_c0_s30.png\n    strenght: 0.5\n", 4, "shot 'b' field 'strenght'",
     "unknown key; did you mean 'strength'?"),
    ("refine:\n  - {shot: b, candidate: b/b_c0_s30.png, name: x}\n  - {shot: b, candidate: b/b_c0_s30.png, "
     "name: x}\n", 3, "shot 'b' field 'name'", "'x' names two refinements"),
    ("refine:\n  - {shot: b, candidate: b/b_c0_s30.png, name: a_b}\n", 2, "shot 'b' field 'name'",
     "must be 1-32 letters, digits or '-'"),
    ("refine:\n  - shot: b\n    candidate: b/b_c0_s30.png\n    hires: {scale: 40}\n", 4,
     "shot 'b' field 'hires.scale'", "must be between 1 and 4"),
    ("refine: []\n", 1, "field 'refine'", "must be a list of refinements"),
    ("refine:\n  - just a string\n", 1, "shot '#1'", "a refinement must be a mapping"),
])
def test_bad_input_is_one_located_line_exit_2(job, out, tmp_path, text, line, where, message):
    path = _refines(tmp_path, text)
    with pytest.raises(BadInput) as e:
        load_refines(path, out, job)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line} {where}") and message in msg and "\n" not in msg
    result = runner.invoke(app, ["refine", str(out), str(path)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_folder_without_a_job_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    path = _refines(tmp_path, "refine:\n  - {shot: a}\n")
    result = runner.invoke(app, ["refine", str(tmp_path / "empty"), str(path)])
    assert result.exit_code == 2 and "no job to refine" in result.output


def test_the_sheet_shows_each_refinement_after_its_source_outlined(job, out):
    second = _refinement(job, out, "a/a_c0_s7.png", "hand", (8, 16, 24, 12), j=1)
    first = _refinement(job, out, "a/a_c0_s7.png", "hand", (8, 16, 24, 12))
    other = _refinement(job, out, "a/a_c1_s8.png", "sky", None)
    assert [c[0] for c in candidate_files(out, "a")] == ["a/a_c0_s7.png", "a/a_c1_s8.png"]  # still two candidates
    assert [r[0] for r in refinement_files(out, "a")] == [first, second, other]
    write_sheet(out, job)
    page = Figures((out / "index.html").read_text())
    assert page.figures["a"] == [("a/a_c0_s7.png", ""), (first, "a/a_c0_s7.png"), (second, "a/a_c0_s7.png"),
                                 ("a/a_c1_s8.png", ""), (other, "a/a_c1_s8.png")]
    assert page.rects == [{"x": "8", "y": "16", "width": "24", "height": "12"}] * 2  # the sky one repainted all
    assert page.radios.count(first) == 1  # a refinement is pickable


def test_pick_a_refinement(job, out, tmp_path):
    refined = _refinement(job, out, "a/a_c1_s8.png", "hand", (0, 0, 8, 8), j=2)
    picks = load_picks(_refines(tmp_path, f"picks:\n  a: {refined}\n", "picks.yaml"), out, job)
    written = apply_picks(out, picks, job)
    assert [p.name for p in written] == ["001_a.png"] and written[0].read_bytes() == (out / refined).read_bytes()
    record = json.loads((out / "picks.json").read_text())["picks"][0]
    assert (record["path"], record["candidate"], record["seed"]) == (refined, 2, 8)
    assert runner.invoke(app, ["pick", str(out), str(tmp_path / "picks.yaml")]).exit_code == 0


class Figures(HTMLParser):
    """Each shot's figures in order as (image, the candidate it refines), the outlines' rects, the pick radios."""

    def __init__(self, text: str):
        super().__init__()
        self.figures, self.rects, self.radios, self.shot, self.outline = {}, [], [], None, False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "shot" in (a.get("class") or "").split():
            self.shot = a["data-shot"]
            self.figures[self.shot] = []
        elif tag == "figure":
            self.figures[self.shot].append(["", a.get("data-source", "")])
        elif tag == "a" and self.figures.get(self.shot) and not self.figures[self.shot][-1][0]:
            self.figures[self.shot][-1][0] = a["href"]
        elif tag == "svg":
            self.outline = "mask-outline" in (a.get("class") or "")
        elif tag == "rect" and self.outline:
            self.rects.append({k: a[k] for k in ("x", "y", "width", "height")})
        elif tag == "input" and "pick" in (a.get("class") or "").split():
            self.radios.append(a["value"])

    def handle_endtag(self, tag):
        if tag == "section" and self.shot:
            self.figures[self.shot] = [tuple(f) for f in self.figures[self.shot]]
            self.shot = None


def test_bcg_refine_end_to_end_beside_the_candidates_resumes_and_picks(job, out, tmp_path):
    """Through the CLI on tiny: a cropped inpainting (pixels outside its mask the source's, exactly), an img2img with
    a hires pass, a draft; the sheet rebuilt from the folder's job; re-running skips what exists; a pick."""
    report = (out / "report.json").read_bytes()
    path = _refines(tmp_path, "refine:\n"
                              "  - shot: a\n    candidate: a/a_c1_s8.png\n    name: hand\n"
                              "    mask: {box: [8, 16, 24, 20], padding: 4}\n    prompt: a keeper's hand\n"
                              "    strength: 0.6\n    candidates: 2\n"
                              "  - shot: b\n    candidate: b/b_c0_s30.png\n    strength: 0.5\n"
                              "    hires: {scale: 1.5, strength: 0.5}\n")
    result = runner.invoke(app, ["refine", str(out), str(path), "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "done: 4 rendered" in result.output  # two refinements, one img2img, its base
    hand = ["a/a_c1_s8.hand_c0_s8.png", "a/a_c1_s8.hand_c1_s9.png"]
    assert [r[0] for r in refinement_files(out, "a")] == hand
    assert [r[0] for r in refinement_files(out, "b")] == ["b/b_c0_s30.r1_c0_s30.png"]
    assert (out / "b/b_c0_s30.r1_c0_s30.base.png").is_file()
    source = np.asarray(Image.open(out / "a/a_c1_s8.png").convert("RGB"))
    for rel in hand:
        with Image.open(out / rel) as im:
            meta, pixels = json.loads(im.info["bcg"]), np.asarray(im.convert("RGB"))
        assert meta["shot"] == "a" and meta["prompt"] == "a keeper's hand" and meta["refine"] == {
            "source": "a/a_c1_s8.png", "tag": "hand", "outline": [8, 16, 24, 20]}
        outside = np.ones(source.shape[:2], bool)
        outside[16:36, 8:32] = False
        np.testing.assert_array_equal(pixels[outside], source[outside])  # only the masked area is repainted
        assert not np.array_equal(pixels, source)
    with Image.open(out / "b/b_c0_s30.r1_c0_s30.png") as im:
        assert im.size == (96, 96) and "Hires upscale: 1.5" in im.info["parameters"]
    assert (out / "report.json").read_bytes() == report  # the folder's report stays the render's
    page = Figures((out / "index.html").read_text())
    assert page.figures["a"][2:] == [(hand[0], "a/a_c1_s8.png"), (hand[1], "a/a_c1_s8.png")]
    assert page.rects == [{"x": "8", "y": "16", "width": "24", "height": "20"}] * 2
    assert [c[0] for c in candidate_files(out, "a")] == ["a/a_c0_s7.png", "a/a_c1_s8.png"]

    again = runner.invoke(app, ["refine", str(out), str(path), "--device", "cpu", "--quiet"])
    assert again.exit_code == 0 and "0 rendered, 3 skipped" in again.output
    draft = runner.invoke(app, ["refine", str(out), str(path), "--device", "cpu", "--quiet", "--draft"])
    assert draft.exit_code == 0 and "skipped" in draft.output
    with Image.open(out / hand[0]) as im:
        assert json.loads(im.info["bcg"])["draft"] is True and "Draft: true" in im.info["parameters"]

    picks = _refines(tmp_path, f"picks:\n  a: {hand[1]}\n", "picks.yaml")
    assert runner.invoke(app, ["pick", str(out), str(picks)]).exit_code == 0
    assert (out / "selects/001_a.png").read_bytes() == (out / hand[1]).read_bytes()


@pytest.mark.slow
def test_a_refine_submitted_renders_on_a_worker_without_the_servers_files(job, out, tmp_path):
    """`bcg refine --job-out` writes the refinements as a job; `bcg submit` uploads its sources and masks as blobs;
    a worker with a root of its own renders them after the render's folder has gone from where the job names it."""
    import subprocess
    import sys

    from conftest import ROOT
    from helpers.serve import Server, free_port, start_worker, stop

    mask = Image.new("L", (64, 64))
    mask.paste(255, (40, 8, 60, 30))
    mask.save(tmp_path / "sky.png")
    refines = _refines(tmp_path, "refine:\n  - shot: a\n    candidate: a/a_c1_s8.png\n    name: hand\n"
                                 "    mask: {box: [8, 16, 24, 20], padding: 4}\n    strength: 0.6\n"
                                 "  - shot: b\n    candidate: b/b_c0_s30.png\n    mask: {image: sky.png}\n")
    job_file = tmp_path / "refine.yaml"
    made = runner.invoke(app, ["refine", str(out), str(refines), "--job-out", str(job_file)])
    assert made.exit_code == 0, made.output
    sources = {name: np.asarray(Image.open(out / rel).convert("RGB"))
               for name, rel in (("a.hand", "a/a_c1_s8.png"), ("b.r1", "b/b_c0_s30.png"))}
    server = Server(tmp_path / "root", free_port()).start(lease_s=10, gpus="none")
    worker = None
    try:
        sent = subprocess.run([sys.executable, "-m", "storyboard_cli", "submit", str(job_file), "--server",
                               server.url, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert sent.returncode == 0, sent.stderr
        job_id = json.loads(sent.stdout)["id"]
        out.rename(tmp_path / "moved")  # the worker reads the sources from the blobs, not the paths
        (tmp_path / "sky.png").unlink()
        worker = start_worker(server.url, "remote", "--upload", "--root", str(tmp_path / "elsewhere"))
        state = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"))
        assert state["state"] == "succeeded", state
        served = server.root / "jobs" / job_id / "out"
        hand = np.asarray(Image.open(served / "a.hand/a.hand_c0_s8.png").convert("RGB"))
        outside = np.ones((64, 64), bool)
        outside[16:36, 8:32] = False
        np.testing.assert_array_equal(hand[outside], sources["a.hand"][outside])
        assert not np.array_equal(hand, sources["a.hand"])
        sky = np.asarray(Image.open(served / "b.r1/b.r1_c0_s30.png").convert("RGB"))
        assert not np.array_equal(sky, sources["b.r1"])
    finally:
        if worker is not None:
            stop(worker)
        server.kill_everything()


def test_the_example_files_as_written(tmp_path):
    """jobs/finishing.yaml's hires shot and jobs/finishing-refines.yaml, as the README runs them (fewer steps)."""
    from conftest import ROOT

    for sub in ("refs", "finishing"):
        shutil.copytree(ROOT / "jobs" / sub, tmp_path / sub)
    job = tmp_path / "finishing.yaml"
    job.write_text((ROOT / "jobs" / "finishing.yaml").read_text().replace("steps: 8", "steps: 4"))
    shutil.copy(ROOT / "jobs" / "finishing-refines.yaml", tmp_path / "finishing-refines.yaml")
    out = tmp_path / "out"
    assert runner.invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"]).exit_code == 0
    assert Image.open(out / "f04-final/f04-final_c0_s4004.png").size == (192, 192)
    assert Image.open(out / "f04-final/f04-final_c0_s4004.base.png").size == (128, 128)
    result = runner.invoke(app, ["refine", str(out), str(tmp_path / "finishing-refines.yaml"), "--device", "cpu",
                                 "--quiet"])
    assert result.exit_code == 0, result.output
    assert [r[0] for r in refinement_files(out, "f04-final")] == [
        "f04-final/f04-final_c0_s4004.hand_c0_s4004.png", "f04-final/f04-final_c0_s4004.hand_c1_s4005.png"]
    assert Image.open(out / "f01-retouch/f01-retouch_c1_s4002.r1_c0_s4002.png").size == (256, 256)
