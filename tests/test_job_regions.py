"""Pure tests for regional prompts: the job syntax (boxes in pixels or fractions, masks, a region's characters and
reference), what an image records of them (settings, fingerprint, A1111 text, report, plan), the files `bcg submit`
uploads, and every bad input as one line at file:line, shot and field (no torch, milliseconds)."""

import json

import pytest
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.cli import app
from storyboard_cli.folder.outputs import png_text
from storyboard_cli.folder.report import job_conditions
from storyboard_cli.job.conditions.region import KIND, REGION_SLOTS
from storyboard_cli.job.file import load_job, named_files
from storyboard_cli.job.plan import make_batches, work_items

TOP = """\
version: 1
model: tiny
ip_adapter: tiny
characters:
  mei: {reference: refs/mei.png, scale: 0.6}
shots:
"""
S1 = "  - id: s1\n    prompt: x\n    size: 128x64\n"
runner = CliRunner()


@pytest.fixture
def folder(tmp_path):
    from PIL import Image, ImageDraw

    (tmp_path / "refs").mkdir()
    Image.new("RGB", (16, 16), (200, 40, 40)).save(tmp_path / "refs/mei.png")
    Image.new("RGB", (16, 16), (40, 200, 40)).save(tmp_path / "refs/kai.png")
    mask = Image.new("L", (64, 32), 0)
    ImageDraw.Draw(mask).rectangle((32, 8, 47, 23), fill=255)  # x 32..47, y 8..23 of 64x32
    mask.save(tmp_path / "mask.png")
    Image.new("L", (64, 32), 100).save(tmp_path / "empty.png")  # grey under 128: no pixel inside
    return tmp_path


def _job(folder, regions: str, top: str = TOP):
    return load_job(write_job(folder, top + S1 + "    regions:\n" + regions))


def test_boxes_in_pixels_and_fractions_masks_characters_and_references(folder):
    job = _job(folder, """      - {box: [0, 0, 0.5, 1], prompt: a woman in red, characters: [mei]}
      - {box: [64, 16, 64, 48], prompt: a man in blue, reference: {image: refs/kai.png, scale: 0.4}}
      - {mask: mask.png, prompt: a lantern}
""")
    a, b, c = job.shots[0].regions
    assert a.box == (0, 0, 64, 64) and a.characters == ("mei",) and a.references[0].scale == 0.6
    assert b.box == (64, 16, 64, 48) and b.references[0].file == "refs/kai.png" and b.references[0].scale == 0.4
    assert c.box == (64, 16, 32, 32) and c.mask == folder / "mask.png"  # the mask at the frame's size: x2
    assert not job.shots[0].references  # a region's references are its own, not the shot's


def test_a_region_prompt_of_77_tokens_fits(folder):
    job = _job(folder, "      - {box: [0, 0, 1, 1], prompt: " + " ".join(["word"] * 18) + " abc}\n")
    assert len(job.shots[0].regions[0].prompt) == 18 * 5 + 3  # 75 letters: 77 tokens with the start and end tokens


def test_rows_with_and_without_regions_share_a_batch(folder):
    text = TOP + S1 + "    regions: [{box: [0, 0, 0.5, 1], prompt: a}]\n  - {id: s2, prompt: x, size: 128x64}\n"
    job = load_job(write_job(folder, text))
    (batch,) = make_batches(work_items(job), (2,))
    assert [len(i.regions) for i in batch.items] == [1, 0]


def test_settings_fingerprint_and_a1111_text(folder):
    job = _job(folder, "      - {box: [0, 0, 0.5, 1], prompt: a woman in red, characters: [mei]}\n")
    item = work_items(job)[0]
    settings = item.settings(job.model)
    assert settings["regions"] == [{"prompt": "a woman in red", "box": [0, 0, 64, 64], "references": [
        {"file": "refs/mei.png", "sha256": settings["regions"][0]["references"][0]["sha256"], "scale": 0.6,
         "character": "mei"}]}]
    assert settings["ip_adapter"] == "tiny"  # the adapter the region's reference goes through
    text = png_text(item, job.model)["parameters"]
    assert 'Regions: "box 0,0,64,64: a woman in red"' in text
    assert '"Module: ip-adapter-auto, Model: tiny, Weight: 0.6' in text
    # what decides the pixels: another prompt, box or reference changes the fingerprint; the reference's path does not
    fp = item.fingerprint(job.model)
    other = _job(folder, "      - {box: [0, 0, 0.5, 1], prompt: a woman in blue, characters: [mei]}\n")
    moved = _job(folder, "      - {box: [0, 0, 64, 64], prompt: a woman in red, characters: [mei]}\n")
    assert work_items(other)[0].fingerprint(job.model) != fp
    assert work_items(moved)[0].fingerprint(job.model) == fp  # the same box in pixels


def test_a_shot_without_regions_keeps_its_settings(folder):
    job = load_job(write_job(folder, TOP + S1))
    assert "regions" not in work_items(job)[0].settings(job.model)
    assert "Regions:" not in png_text(work_items(job)[0], job.model)["parameters"]
    assert job_conditions(job)["regions"] is None


def test_report_plan_sheet_boxes_and_uploads(folder):
    text = TOP + S1 + """    regions:
      - {box: [0, 0, 0.5, 1], prompt: a woman, characters: [mei]}
      - {mask: mask.png, prompt: a lantern, reference: refs/kai.png}
  - {id: s2, prompt: y, size: 128x64}
"""
    path = write_job(folder, text)
    job = load_job(path)
    report = job_conditions(job)["regions"]
    assert [r["shot"] for r in report] == ["s1"] and report[0]["regions"][1]["mask"] == "mask.png"
    md = KIND.report_md({"regions": report})
    assert "| s1 | mask mask.png | a lantern | kai.png 1 |" in md
    boxes = KIND.boxes(work_items(job)[0].settings(job.model))
    assert [(b.x, b.y, b.w, b.h) for b in boxes] == [(0, 0, 0.5, 1), (0.5, 0.25, 0.25, 0.5)]
    assert boxes[0].caption == "1: a woman"
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0 and "regions per shot: s1 2" in result.output, result.output
    shown = json.loads(runner.invoke(app, ["plan", str(path), "--json"]).output)
    assert shown["regions"] == {"s1": 2}
    assert named_files(path) == ["refs/mei.png", "mask.png", "refs/kai.png"]


def test_a_job_with_regions_is_a_mix_of_its_own(folder):
    from storyboard_cli.serve.intake import mix_key

    plain = load_job(write_job(folder, TOP + S1, "plain.yaml"))
    regional = _job(folder, "      - {box: [0, 0, 0.5, 1], prompt: a}\n")
    assert mix_key(plain, work_items(plain)[0]) != mix_key(regional, work_items(regional)[0])


def test_a_jobs_models_take_as_many_region_slots_as_its_shots_have_regions_at_most(folder):
    """Each slot is 77 more keys in every cross-attention (the masked attention costs in proportion): a job's models
    take its most regions per shot (`used_models`, what the loader gets), its mix says so, and models loaded for fewer
    slots do not serve it (a worker loads them again)."""
    from types import SimpleNamespace

    from storyboard_cli.models.regions import Layout
    from storyboard_cli.serve.intake import mix_key

    two = _job(folder, "      - {box: [0, 0, 0.5, 1], prompt: a}\n      - {box: [0.5, 0, 0.5, 1], prompt: b}\n")
    items = work_items(two)
    assert KIND.used_models(two, items) == (2,) and KIND.mix(two) == ([], ["regions 2"])
    assert KIND.used_models(two, []) == (0,)  # nothing pending: no regions' attention loaded
    three = load_job(write_job(folder, TOP + S1 + "    regions:\n" + "      - {box: [0, 0, 0.25, 1], prompt: a}\n" * 3
                               + "  - id: s2\n    prompt: y\n", "three.yaml"))
    assert KIND.used_models(three, work_items(three)) == (3,)
    assert mix_key(two, items[0]) != mix_key(three, work_items(three)[0])
    models = lambda n: SimpleNamespace(region_layout=Layout((1,), n, 4) if n else None)  # noqa: E731
    assert KIND.loaded(models(2), two) and KIND.loaded(models(4), two)
    assert not KIND.loaded(models(2), three) and not KIND.loaded(models(0), two)


def test_the_example_job_loads_as_the_readme_says():
    job = load_job(ROOT / "jobs" / "regions.yaml")
    meeting = job.shots[0]
    assert len(meeting.regions) == 2 and meeting.regions[0].characters == ("mei",)
    assert not meeting.regions[1].references and job.model == "tiny"


BAD = [
    ("box_outside", "      - {box: [100, 0, 64, 64], prompt: a}\n",
     "11 shot 's1' field 'regions[0].box': the box [100, 0, 64, 64] (x, y, w, h in pixels) lies outside the 128x64 "
     "frame"),
    ("box_zero_area", "      - {box: [0, 0, 0, 0.5], prompt: a}\n",
     "11 shot 's1' field 'regions[0].box': a box of zero area (0x32 pixels)"),
    ("box_not_four", "      - {box: [0, 0, 1], prompt: a}\n",
     "11 shot 's1' field 'regions[0].box': must be four numbers [x, y, w, h] (pixels, or fractions of the frame when "
     "all are <= 1), got [0, 0, 1]"),
    ("too_many", "".join(f"      - {{box: [0, 0, 1, 1], prompt: r{i}}}\n" for i in range(REGION_SLOTS + 1)),
     f"10 shot 's1' field 'regions': {REGION_SLOTS + 1} regions; a shot may have at most {REGION_SLOTS}"),
    ("empty_mask", "      - {mask: empty.png, prompt: a}\n",
     "11 shot 's1' field 'regions[0].mask': an empty mask: empty.png has no pixel of grey level 128 or more at the "
     "shot's size 128x64"),
    # the tiny preset's byte-level tokenizer: a token per letter, with the start and end tokens
    ("long_prompt", "      - {box: [0, 0, 1, 1], prompt: " + " ".join(["word"] * 19) + "}\n",
     "11 shot 's1' field 'regions[0].prompt': 78 tokens; a region's prompt is one slot of 77 (with the start and end "
     "tokens): shorten it"),
    ("unknown_character", "      - {box: [0, 0, 1, 1], prompt: a, characters: [kai]}\n",
     "11 shot 's1' field 'regions[0].characters': unknown character 'kai' (the job's characters: mei)"),
    ("box_and_mask", "      - {box: [0, 0, 1, 1], mask: mask.png, prompt: a}\n",
     "11 shot 's1' field 'regions[0]': give one of 'box: [x, y, w, h]' or 'mask: IMAGE'"),
    ("no_prompt", "      - {box: [0, 0, 1, 1]}\n", "11 shot 's1' field 'regions[0].prompt': missing (what the region "
                                                  "shows)"),
    ("unknown_key", "      - {box: [0, 0, 1, 1], prompt: a, lora: {mei: 1}}\n",
     "11 shot 's1' field 'regions[0].lora': unknown key; known: box, mask, prompt, characters, reference"),
]


@pytest.mark.parametrize("name,regions,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_regions_are_one_line_at_file_line_shot_and_field(folder, name, regions, expected):
    path = write_job(folder, TOP + S1 + "    regions:\n" + regions)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {path}:{expected}", result.output


def test_a_regions_reference_without_an_adapter_is_a_located_error(folder):
    top = "version: 1\nmodel: tiny\nshots:\n"
    path = write_job(folder, top + S1 + "    regions:\n      - {box: [0, 0, 1, 1], prompt: a, reference: "
                                        "refs/kai.png}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: {path}:8 shot 's1' field 'regions[0].reference': the job sets no "
                                     "top-level 'ip_adapter' model")
