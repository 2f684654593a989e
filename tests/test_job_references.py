"""Pure tests for IP-Adapter references, characters and several ControlNets per shot: the job syntax, the plan's items,
bucket keys and settings, and every bad input as one line at file:line, shot and field (no torch, milliseconds)."""

import hashlib
import json
import shutil

import pytest
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.cli import app
from storyboard_cli.job.conditions.reference import REFERENCE_SLOTS
from storyboard_cli.job.file import DRAFT_CUTOFF, as_draft, load_job, named_files
from storyboard_cli.job.plan import levers, make_batches, shot_levers, shot_levers_label, summary, work_items
from storyboard_cli.steps import guided_steps

MEI = ROOT / "jobs" / "loras" / "mei.safetensors"
IMAGES = {"refs/mei.png": (200, 40, 40), "refs/stranger.png": (40, 200, 40), "refs/kai.png": (40, 40, 200),
          "refs/ren.png": (90, 90, 90), "refs/yu.png": (10, 120, 60), "pose/s1.png": (255, 255, 255),
          "depth/s1.png": (0, 0, 0)}
BRIEF = f"""\
version: 1
model: tiny
ip_adapter: tiny
loras: {{mei: {MEI}}}
controlnets:
  pose: tiny
  depth: tiny
characters:
  mei: {{reference: refs/mei.png, scale: 0.6, lora: {{mei: 0.8}}}}
shots:
  - id: s1
    prompt: "mei at the window, rain"
    characters: [mei]
    control:
      - {{net: pose, image: pose/s1.png, scale: 0.8}}
      - {{net: depth, image: depth/s1.png, scale: 0.5, end: 0.6}}
  - id: s2
    prompt: "a stranger in the doorway"
    reference: {{image: refs/stranger.png, scale: 0.5}}
"""
runner = CliRunner()


@pytest.fixture
def folder(tmp_path):
    """A job folder holding small reference and control images, each of its own colour."""
    from PIL import Image

    for name, colour in IMAGES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (16, 16), colour).save(tmp_path / name)
    return tmp_path


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(folder, text, name="job.yaml"):
    return load_job(write_job(folder, text, name))


# ---------------------------------------------------------------- the syntax


def test_the_documented_job_loads_as_the_data_model_says(folder):
    job = _load(folder, BRIEF)
    assert job.controlnets == (("pose", "tiny"), ("depth", "tiny"))
    assert (job.ip_adapter, job.image_encoder) == ("tiny", None)
    mei = job.characters["mei"]
    assert (mei.name, mei.loras, mei.line) == ("mei", (("mei", 0.8),), 9)
    assert mei.reference.image == folder / "refs/mei.png" and mei.reference.file == "refs/mei.png"
    assert (mei.reference.scale, mei.reference.character) == (0.6, "mei")
    assert mei.reference.sha256 == _sha(folder / "refs/mei.png")
    s1, s2 = job.shots
    assert s1.characters == ("mei",) and s1.references == (mei.reference,) and s1.loras == (("mei", 0.8),)
    assert [(c.net, c.model, c.index, c.file, c.scale, c.end) for c in s1.controls] == [
        ("pose", "tiny", 0, "pose/s1.png", 0.8, 1.0), ("depth", "tiny", 1, "depth/s1.png", 0.5, 0.6)]
    (stranger,) = s2.references
    assert (stranger.file, stranger.scale, stranger.character, s2.characters, s2.controls) == (
        "refs/stranger.png", 0.5, None, (), ())
    assert stranger.sha256 == _sha(folder / "refs/stranger.png")


def test_controls_follow_the_jobs_net_order_not_the_shots(folder):
    job = _load(folder, BRIEF.replace("      - {net: pose, image: pose/s1.png, scale: 0.8}\n", "") +
                "  - id: s3\n    prompt: x\n    control:\n      - {net: depth, image: depth/s1.png}\n"
                "      - {net: pose, image: pose/s1.png}\n")
    assert [c.net for c in job.shots[0].controls] == ["depth"]
    assert [c.net for c in job.shots[2].controls] == ["pose", "depth"] 


def test_the_shorthand_and_the_one_mapping_form_mean_what_they_meant(folder):
    one = _load(folder, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
                        "  - {id: a, prompt: x, control: {image: pose/s1.png, scale: 0.7, end: 0.5}}\n"
                        "  - {id: b, prompt: x, control: [{image: pose/s1.png, scale: 0.7, end: 0.5}]}\n"
                        "  - {id: c, prompt: x, control: [{net: controlnet, image: pose/s1.png, scale: 0.7, "
                        "end: 0.5}]}\n")
    assert one.controlnets == (("controlnet", "tiny"),)  # the one net, named by convention (SHORTHAND_NET)
    a, b, c = one.shots
    assert len(a.controls) == 1 and a.controls == b.controls == c.controls
    assert (a.controls[0].net, a.controls[0].model, a.controls[0].index) == ("controlnet", "tiny", 0)
    named = _load(folder, "version: 1\nmodel: tiny\ncontrolnets: {pose: tiny}\nshots:\n"
                          "  - {id: a, prompt: x, control: {image: pose/s1.png}}\n", "named.yaml")
    assert [c.net for c in named.shots[0].controls] == ["pose"]  # one net: `net` may be left out
    assert named.controlnets == (("pose", "tiny"),)
    none = _load(folder, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n", "none.yaml")
    assert (none.controlnets, none.ip_adapter, none.characters) == ((), None, {})


def test_characters_references_and_controls_come_from_defaults(folder):
    job = _load(folder, BRIEF.replace("shots:\n", "defaults:\n  characters: [mei]\n  reference: refs/stranger.png\n"
                                      "  control: [{net: depth, image: depth/s1.png}]\nshots:\n", 1)
                .replace("    reference: {image: refs/stranger.png, scale: 0.5}\n", "    characters: []\n"))
    s1, s2 = job.shots
    assert [(r.character, r.file, r.scale) for r in s1.references] == [("mei", "refs/mei.png", 0.6),
                                                                        (None, "refs/stranger.png", 1.0)]
    assert [c.net for c in s1.controls] == ["pose", "depth"]  # its own list replaces the default's
    assert [(r.character, r.file) for r in s2.references] == [(None, "refs/stranger.png")]
    assert [c.net for c in s2.controls] == ["depth"] and s2.loras == ()


def test_a_characters_loras_merge_with_the_shots(folder):
    job = _load(folder, BRIEF.replace('prompt: "mei at the window, rain"', 'prompt: "mei <lora:mei:0.8> at the window"')
                .replace("    reference: {image:", "    lora: {mei: 0.3}\n    reference: {image:"))
    assert job.shots[0].loras == (("mei", 0.8),) and job.shots[0].prompt == "mei at the window"
    assert job.shots[1].loras == (("mei", 0.3),)


def test_as_draft_caps_every_nets_end_and_keeps_the_references(folder):
    job = _load(folder, BRIEF)
    draft = as_draft(job).shots[0]
    end = guided_steps(30, DRAFT_CUTOFF) / 30  # where the draft's guidance stops, before the depth net's 0.6
    assert [c.end for c in draft.controls] == [end, end]
    assert draft.references == job.shots[0].references and draft.characters == ("mei",)


# ---------------------------------------------------------------- items, bucket keys, levers


def test_rows_with_and_without_a_reference_share_a_batch(folder):
    job = _load(folder, "version: 1\nmodel: tiny\nip_adapter: tiny\nshots:\n  - {id: a, prompt: x, reference: "
                        "{image: refs/mei.png, scale: 0.6}}\n  - {id: b, prompt: y}\n")
    items = work_items(job)
    assert [(i.reference_scale, i.ip_adapter) for i in items] == [(0.6, "tiny"), (0.0, None)]
    assert items[0].key == items[1].key and len(make_batches(items, job.buckets)) == 1


def test_a_reference_tells_two_otherwise_identical_requests_apart(folder):
    shots = ("  - {id: a, prompt: x, seed: 1}\n  - {id: b, prompt: x, seed: 1, reference: refs/mei.png}\n"
             "  - {id: c, prompt: x, seed: 1, reference: refs/kai.png}\n"
             "  - {id: d, prompt: x, seed: 1, reference: {image: refs/kai.png, scale: 0.5}}\n"
             "  - {id: e, prompt: x, seed: 1, reference: refs/mei.png}\n")
    items = work_items(_load(folder, f"version: 1\nmodel: tiny\nip_adapter: tiny\nshots:\n{shots}"))
    assert [i.outputs for i in items] == [("a/a_c0_s1.png",), ("b/b_c0_s1.png", "e/e_c0_s1.png"), ("c/c_c0_s1.png",),
                                          ("d/d_c0_s1.png",)]


def test_the_bucket_key_names_the_nets_and_their_ends(folder):
    job = _load(folder, BRIEF + "  - id: s3\n    prompt: y\n    control: [{net: depth, image: depth/s1.png}]\n"
                                "  - id: s4\n    prompt: z\n    control:\n      - {net: depth, image: depth/s1.png}\n"
                                "      - {net: pose, image: pose/s1.png, end: 0.5}\n")
    s1, s2, s3, s4 = (i.key for i in work_items(job))
    assert (s1.nets, s1.control_ends, s1.control_end, s1.control_mask, s1.control) == ((0, 1), (1.0, 0.6), 1.0, 3,
                                                                                        True)
    assert (s2.nets, s2.control_ends, s2.control_mask, s2.control) == ((), (), 0, False)
    assert (s3.nets, s3.control_ends, s3.control_end, s3.control_mask) == ((1,), (), 1.0, 2)
    assert (s4.nets, s4.control_ends, s4.control_end) == ((0, 1), (0.5, 1.0), 1.0)
    assert "+2 controls" in s1.label and "+control" in s3.label and "control" not in s2.label
    short = _load(folder, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
                          "  - {id: a, prompt: x, control: {image: pose/s1.png}}\n", "short.yaml")
    key = work_items(short)[0].key
    assert (key.nets, key.control_mask, key.control_ends) == ((0,), 1, ())
    assert key.control and key.label == work_items(_load(folder, "version: 1\nmodel: tiny\ncontrolnets: {pose: tiny}\n"
                                                               "shots:\n  - {id: a, prompt: x, control: {image: "
                                                               "pose/s1.png}}\n", "one.yaml"))[0].key.label


def test_deepcache_and_the_step_plan_wait_for_the_last_net(folder):
    text = BRIEF.replace("    characters: [mei]\n", "    characters: [mei]\n    steps: 10\n"
                                                    "    deepcache: {interval: 3}\n")
    runs = _load(folder, text)  # the pose net runs every step: no DeepCache
    assert not levers(runs.shots[0])[1] and shot_levers(runs)[0]["deepcache_dropped"]
    ended = _load(folder, text.replace("scale: 0.8}", "scale: 0.8, end: 0.4}"), "ended.yaml")
    _, deepcache, _, end = levers(ended.shots[0])
    assert deepcache and end == 0.6 and "control end 0.6 (6/10 steps)" in shot_levers_label(ended.shots[0])
    item = work_items(ended)[0]
    assert item.controls[0].end == 0.4  # the pose net's
    assert item.key.control_end == 0.6 and item.key.control_ends == (0.4, 0.6)
    assert item.key.control_steps == 6 and item.key.deepcache
    assert shot_levers(ended)[0]["control_steps"] == 6


# ---------------------------------------------------------------- settings and fingerprints


def test_the_shorthands_settings_are_todays(folder):
    job = _load(folder, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
                        "  - {id: a, prompt: x, control: {image: pose/s1.png, scale: 0.7, end: 0.5}}\n"
                        "  - {id: b, prompt: x, seed: 3, control: [{image: depth/s1.png}]}\n")
    for item in work_items(job):  # the fingerprints as recorded before: tests/test_controls_pinned.py
        assert not {"controls", "references", "ip_adapter", "reference_scale"} & set(item.settings("tiny"))
    a, b = (item.settings(job.model) for item in work_items(job))
    assert {k: v for k, v in a.items() if k.startswith("control")} == {
        "controlnet": "tiny", "control_image": "pose/s1.png", "control_scale": 0.7,
        "control_sha256": _sha(folder / "pose/s1.png")[:16], "control_end": 0.5}
    assert {k: v for k, v in b.items() if k.startswith("control")} == {
        "controlnet": "tiny", "control_image": "depth/s1.png", "control_scale": 1.0,
        "control_sha256": _sha(folder / "depth/s1.png")[:16]}


def test_named_nets_are_recorded_each_with_its_model_image_and_end(folder):
    job = _load(folder, BRIEF)
    item = work_items(job)[0]
    s = item.settings(job.model)
    assert not {"controlnet", "control_image", "control_scale", "control_sha256"} & set(s)
    assert s["controls"] == [
        {"net": "pose", "controlnet": "tiny", "image": "pose/s1.png", "scale": 0.8,
         "sha256": _sha(folder / "pose/s1.png")[:16]},
        {"net": "depth", "controlnet": "tiny", "image": "depth/s1.png", "scale": 0.5,
         "sha256": _sha(folder / "depth/s1.png")[:16], "end": 0.6}]
    assert s["references"] == [{"file": "refs/mei.png", "sha256": _sha(folder / "refs/mei.png")[:16], "scale": 0.6,
                                "character": "mei"}]
    assert (s["ip_adapter"], s["reference_scale"]) == ("tiny", 0.6) and "image_encoder" not in s


def test_weights_given_as_paths_are_recorded_by_digest(folder):
    from storyboard_cli.job.digests import weights_digest

    net = folder / "nets" / "pose.safetensors"
    net.parent.mkdir()
    net.write_bytes(b"pose weights")
    job = _load(folder, BRIEF.replace("  pose: tiny\n", f"  pose: {net}\n"))
    s = work_items(job)[0].settings(job.model)
    assert s["controls"][0]["controlnet_weights"] == weights_digest(str(net))
    assert "controlnet_weights" not in s["controls"][1]


def test_fingerprints_follow_the_references_bytes_and_scales_not_their_paths(folder, tmp_path_factory):
    from PIL import Image

    fingerprints = lambda job: [i.fingerprint(job.model) for i in work_items(job)]
    first = fingerprints(_load(folder, BRIEF))
    moved = tmp_path_factory.mktemp("moved") / "project"
    shutil.copytree(folder, moved)
    (moved / "refs/mei.png").rename(moved / "refs/mei-v1.png")  # renamed, same bytes
    (moved / "pose/s1.png").rename(moved / "pose/one.png")
    assert fingerprints(_load(moved, BRIEF.replace("refs/mei.png", "refs/mei-v1.png")
                              .replace("pose/s1.png", "pose/one.png"))) == first
    assert fingerprints(_load(folder, BRIEF.replace("scale: 0.6", "scale: 0.7"), "scaled.yaml"))[0] != first[0]
    assert fingerprints(_load(folder, BRIEF.replace("scale: 0.5}\n", "scale: 0.4}\n"), "one-off.yaml"))[1] != first[1]
    Image.new("RGB", (16, 16), (1, 2, 3)).save(folder / "refs/mei.png")  # redrawn, same name
    redrawn = fingerprints(_load(folder, BRIEF, "redrawn.yaml"))
    assert redrawn[0] != first[0] and redrawn[1] == first[1]


# ---------------------------------------------------------------- what bcg submit uploads, what bcg plan shows


def test_named_files_lists_every_control_and_reference_image(folder):
    path = write_job(folder, BRIEF.replace("shots:\n", "defaults:\n  reference: refs/kai.png\n"
                                                       "  control: [{net: pose, image: refs/ren.png}]\nshots:\n", 1)
                     + "  - {id: s3, prompt: y, control: {net: pose, image: refs/yu.png}, reference: refs/ren.png}\n")
    assert named_files(path) == [str(MEI), "refs/mei.png", "refs/kai.png", "refs/ren.png", "pose/s1.png",
                                 "depth/s1.png", "refs/stranger.png", "refs/yu.png"]


def test_plan_counts_the_references_once_and_notes_differing_scales(folder):
    text = BRIEF.replace("    characters: [mei]\n", "    characters: [mei]\n    reference: refs/mei.png\n") + (
        "  - {id: s3, prompt: y, characters: [mei]}\n")
    s = summary(_load(folder, text))
    assert (s.references, s.characters) == (2, ("mei",))
    assert s.reference_note == ("references at different scales in one shot: s1 (mei 0.6, mei.png 1); each image "
                                "gets their largest")
    assert work_items(s.job)[0].reference_scale == 1.0
    data = s.to_json()
    assert (data["references"], data["characters"], data["ip_adapter"]) == (2, ["mei"], "tiny")
    assert data["controlnets"] == {"pose": "tiny", "depth": "tiny"} and s.reference_note in data["notes"]
    shown = runner.invoke(app, ["plan", str(folder / "job.yaml")])
    assert shown.exit_code == 0, shown.output
    assert "references: 2 references, encoded once (ip_adapter tiny); characters: mei" in shown.output
    assert "2 nets" in shown.output and "s1 (mei 0.6, mei.png 1)" in shown.output
    plain = summary(_load(folder, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n", "plain.yaml"))
    assert (plain.references, plain.characters, plain.reference_note) == (0, (), None)
    assert not {"references", "characters", "ip_adapter", "controlnets"} & set(plain.to_json())


# ---------------------------------------------------------------- bad input: one line, file:line, shot, field

S1 = "shots:\n  - id: s1\n    prompt: x\n"  # after TOP's four lines, the shot's next key is on line 8
TOP = "version: 1\nmodel: tiny\nip_adapter: tiny\ncontrolnets: {pose: tiny, depth: tiny}\n"
BAD = [
    ("reference_missing", TOP + S1 + "    reference: refs/nope.png\n",
     "8 shot 's1' field 'reference': file not found: refs/nope.png"),
    ("reference_unreadable", TOP + S1 + "    reference: {image: refs/junk.png}\n",
     "8 shot 's1' field 'reference.image': not a readable image: refs/junk.png (not a PNG, JPEG, WebP or other image "
     "file this can read)"),
    ("reference_without_adapter", TOP.replace("ip_adapter: tiny\n", "") + S1 + "    reference: refs/mei.png\n",
     "7 shot 's1' field 'reference': the job sets no top-level 'ip_adapter' model"),
    ("shot_characters_without_adapter", TOP.replace("ip_adapter: tiny\n", "") + S1 + "    characters: [mei]\n",
     "7 shot 's1' field 'characters': the job sets no top-level 'ip_adapter' model"),
    ("characters_without_adapter", TOP.replace("ip_adapter: tiny\n", "characters: {mei: {reference: refs/mei.png}}\n")
     + S1, "3 field 'characters': the job sets no top-level 'ip_adapter' model"),
    ("unknown_character", TOP + "characters: {mei: {reference: refs/mei.png}}\n" + S1 + "    characters: [me]\n",
     "9 shot 's1' field 'characters': unknown character 'me' (the job's characters: mei); did you mean 'mei'?"),
    ("unknown_net", TOP + S1 + "    control: [{net: poze, image: pose/s1.png}]\n",
     "8 shot 's1' field 'control[0].net': unknown net 'poze' (the job's controlnets: pose, depth); did you mean "
     "'pose'?"),
    ("net_left_out", TOP + S1 + "    control: {image: pose/s1.png}\n",
     "8 shot 's1' field 'control.net': missing: the job has 2 ControlNets (pose, depth); name the one this image is "
     "for"),
    ("more_controls_than_nets", TOP + S1 + "    control:\n      - {net: pose, image: pose/s1.png}\n"
     "      - {net: depth, image: pose/s1.png}\n      - {net: depth, image: pose/s1.png}\n",
     "8 shot 's1' field 'control': 3 entries, but the job defines 2 ControlNets (pose, depth): one entry per net"),
    ("net_twice", TOP + S1 + "    control:\n      - {net: pose, image: pose/s1.png}\n"
     "      - {net: pose, image: depth/s1.png}\n",
     "10 shot 's1' field 'control[1].net': the net 'pose' is named twice (control[0] too); one entry per net"),
    ("reference_scale", TOP + S1 + "    reference: {image: refs/mei.png, scale: 3}\n",
     "8 shot 's1' field 'reference.scale': must be between 0 and 2, got 3"),
    ("character_scale", TOP + "characters: {mei: {reference: refs/mei.png, scale: -1}}\n" + S1,
     "5 field 'characters.mei.scale': must be between 0 and 2, got -1"),
    ("control_scale", TOP + S1 + "    control: [{net: depth, image: depth/s1.png, scale: 2.5}]\n",
     "8 shot 's1' field 'control[0].scale': must be between 0 and 2, got 2.5"),
    ("too_many_references", TOP + "characters:\n" + "".join(f"  {n}: {{reference: refs/{n}.png}}\n" for n in
                                                            ("mei", "kai", "ren", "yu"))
     + S1 + "    characters: [mei, kai, ren, yu]\n    reference: refs/stranger.png\n",
     f"13 shot 's1' field 'characters': 5 references (its characters' and its 'reference:'); a shot may use at most "
     f"{REFERENCE_SLOTS}"),
    ("both_controlnet_keys", TOP.replace("ip_adapter: tiny\n", "controlnet: tiny\n") + S1,
     "4 field 'controlnets': give 'controlnet:' (one model) or 'controlnets:' (named models), not both "
     "('controlnet:' is on line 3)"),
    ("character_without_reference", TOP + "characters: {mei: {scale: 0.5}}\n" + S1,
     "5 field 'characters.mei.reference': missing (the image the character is drawn after)"),
    ("character_unknown_key", TOP + "characters: {mei: {reference: refs/mei.png, lora_scale: 1}}\n" + S1,
     "5 field 'characters.mei.lora_scale': unknown key; did you mean 'scale'?"),
    ("control_unknown_key", TOP + S1 + "    control: [{net: pose, image: pose/s1.png, weight: 1}]\n",
     "8 shot 's1' field 'control[0].weight': unknown key; known: image, scale, end, net"),
    ("reference_unknown_key", TOP + S1 + "    reference: {image: refs/mei.png, scael: 1}\n",
     "8 shot 's1' field 'reference.scael': unknown key; did you mean 'scale'?"),
    ("lora_at_two_scales", TOP.replace("version: 1\n", f"version: 1\nloras: {{mei: {MEI}}}\n")
     + "characters: {mei: {reference: refs/mei.png, lora: {mei: 0.8}}}\n" + S1
     + "    lora: {mei: 0.5}\n    characters: [mei]\n",
     "11 shot 's1' field 'characters': LoRA 'mei' at 0.8 from character 'mei' (line 6) and at 0.5 from the shot's "
     "'lora:' (line 10); give it one scale"),
    ("lora_tag_at_another_scale", TOP.replace("version: 1\n", f"version: 1\nloras: {{mei: {MEI}}}\n")
     + "characters:\n  kai: {reference: refs/kai.png}\n  mei: {reference: refs/mei.png, lora: {mei: 0.8}}\n"
     + S1.replace("prompt: x", "prompt: 'x <lora:mei:0.5>'") + "    characters: [kai, mei]\n",
     "12 shot 's1' field 'characters': LoRA 'mei' at 0.8 from character 'mei' (line 8) and at 0.5 from a <lora:...> "
     "tag in the shot's prompt (line 11); give it one scale"),
    ("two_characters_one_lora", TOP.replace("version: 1\n", f"version: 1\nloras: {{mei: {MEI}}}\n")
     + "characters:\n  kai: {reference: refs/kai.png, lora: {mei: 0.2}}\n"
     "  mei: {reference: refs/mei.png, lora: {mei: 0.8}}\n" + S1 + "    characters: [kai, mei]\n",
     "12 shot 's1' field 'characters': LoRA 'mei' at 0.8 from character 'mei' (line 8) and at 0.2 from character "
     "'kai' (line 7); give it one scale"),
    ("image_encoder_without_adapter", TOP.replace("ip_adapter: tiny\n", "image_encoder: enc\n") + S1,
     "3 field 'image_encoder': the job sets no top-level 'ip_adapter' for it to serve"),
    ("image_encoder_missing", TOP.replace("ip_adapter: tiny\n", "ip_adapter: adapters\nimage_encoder: enc\n") + S1,
     "4 field 'image_encoder': enc: no such folder (image_encoder: names the CLIP vision encoder's folder)"),
    ("image_encoder_not_an_encoder", TOP.replace("ip_adapter: tiny\n", "ip_adapter: adapters\nimage_encoder: refs\n")
     + S1, "4 field 'image_encoder': refs: not an image encoder folder (no config.json in it)"),
    ("image_encoder_beside_a_preset", TOP.replace("ip_adapter: tiny\n", "ip_adapter: tiny\nimage_encoder: refs\n")
     + S1, "4 field 'image_encoder': the preset ip_adapter 'tiny' brings its own image encoder; leave image_encoder "
           "out"),
    ("controlnet_path_missing", TOP.replace("{pose: tiny,", "{pose: ./nets/pose,") + S1,
     "4 field 'controlnets.pose': no such file or folder: ./nets/pose"),
    ("shorthand_controlnet_path_missing", TOP.replace("controlnets: {pose: tiny, depth: tiny}", "controlnet: nets/cn."
                                                      "safetensors") + S1,
     "4 field 'controlnet': no such file or folder: nets/cn.safetensors"),
    ("model_not_a_hub_id", TOP.replace("model: tiny", "model: sdxl") + S1,
     "2 field 'model': 'sdxl' is not a preset (tiny, sdxl-random), a path or a hub id (owner/name)"),
    ("model_a_file_url", TOP.replace("model: tiny", "model: file:///models/sd%20xl") + S1,
     "2 field 'model': 'file:///models/sd%20xl' is a URL; give the path itself (/models/sd xl)"),
    ("adapter_preset_misspelt", TOP.replace("ip_adapter: tiny", "ip_adapter: tiny-pluss") + S1,
     "3 field 'ip_adapter': tiny-pluss: no such file or folder (ip_adapter: names a preset (tiny, tiny-plus, "
     "sdxl-random, sdxl-random-plus), a folder or a file)"),
]


@pytest.mark.parametrize("name,text,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_references_and_controls_are_one_line_at_file_line_shot_and_field(folder, name, text, expected):
    (folder / "refs/junk.png").write_bytes(b"not an image")
    path = write_job(folder, text)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {path}:{expected}", result.output


def test_an_adapter_that_does_not_fit_the_model_is_a_located_error(folder, monkeypatch):
    from storyboard_cli.job.conditions import reference as adapter

    calls = []
    monkeypatch.setattr(adapter, "_adapter_problem", lambda *a: calls.append(a) or "made for SD 1.5, not SDXL")
    (folder / "adapters").mkdir()
    (folder / "enc").mkdir()
    (folder / "enc" / "config.json").write_text("{}")
    path = write_job(folder, TOP.replace("ip_adapter: tiny", "ip_adapter: adapters\nimage_encoder: enc") + S1)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2 and calls == [(str(folder / "adapters"), str(folder / "enc"), "tiny")]
    assert result.output.strip() == f"error: {path}:3 field 'ip_adapter': made for SD 1.5, not SDXL"


@pytest.mark.parametrize("adapter,model", [("tiny", "tiny"), ("tiny-plus", "tiny"), ("sdxl-random", "sdxl-random"),
                                           ("sdxl-random-plus", "sdxl-random")])
def test_plan_takes_every_adapter_preset_render_and_serve_take(folder, adapter, model):
    from storyboard_cli.job.preflight import ADAPTER_PRESETS, presets_of
    from storyboard_cli.serve import intake

    assert intake.presets_of is presets_of and presets_of("ip_adapter") == tuple(ADAPTER_PRESETS)  # one table
    assert adapter in ADAPTER_PRESETS
    path = write_job(folder, f"version: 1\nmodel: {model}\nip_adapter: {adapter}\n" + S1
                     + "    reference: refs/mei.png\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    assert f"references: 1 reference, encoded once (ip_adapter {adapter})" in result.output


def test_plan_json_of_the_documented_job(folder):
    result = runner.invoke(app, ["plan", str(write_job(folder, BRIEF)), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [b["bucket"] for b in data["buckets"]] == ["1024x1024 30 steps euler",  # no LoRA first
                                                      "1024x1024 30 steps euler +2 controls lora mei 0.8"]


# ---------------------------------------------------------------- paths and warnings


def test_a_very_large_reference_is_warned_of_in_its_own_words_without_a_logger_prefix(folder, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200)  # the 16x16 images pass PIL's warning limit, not its error
    path = write_job(folder, TOP + S1 + "    reference: refs/mei.png\n    control: {net: pose, image: pose/s1.png}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if "megapixels" in line]
    assert warned == [
        f"warning: {path}:9 shot 's1' field 'control.image': pose/s1.png is 0 megapixels: each shot resizes it to its "
        f"own size; a smaller file loads faster",
        f"warning: {path}:8 shot 's1' field 'reference': refs/mei.png is 0 megapixels: the IP-Adapter's image encoder "
        f"sees it at 224x224 (its short side resized to 224, its centre cropped), so its extra pixels add nothing; a "
        f"smaller file loads faster"], result.output
    data = json.loads(runner.invoke(app, ["plan", str(path), "--json"]).stdout)
    assert [w.split(": ", 1)[0] for w in data["warnings"]] == [f"{path}:9 shot 's1' field 'control.image'",
                                                               f"{path}:8 shot 's1' field 'reference'"]


@pytest.fixture
def project(tmp_path):
    """A project whose job file sits in jobs/, with an IP-Adapter file, its image encoder and a model folder beside
    it, and a working folder elsewhere (the user runs bcg from the project's root)."""
    from PIL import Image

    from storyboard_cli.models.tiny import ADAPTER_FILES, tiny_adapter_folder

    jobs = tmp_path / "jobs"
    (jobs / "adapters").mkdir(parents=True)
    (jobs / "refs").mkdir()
    source = tiny_adapter_folder("base")
    shutil.copy(source / ADAPTER_FILES["base"], jobs / "adapters" / ADAPTER_FILES["base"])
    shutil.copytree(source / "image_encoder", jobs / "encoder")
    shutil.copytree(source / "image_encoder", jobs / "models" / "cn")  # any folder: plan checks that it exists
    Image.new("RGB", (16, 16), (200, 40, 40)).save(jobs / "refs" / "mei.png")
    return tmp_path


def test_every_relative_path_in_a_job_is_read_from_the_job_files_folder(project, monkeypatch):
    from storyboard_cli.models.tiny import ADAPTER_FILES
    from storyboard_cli.run.render import model_specs

    monkeypatch.chdir(project)  # not the job's folder
    jobs = project / "jobs"
    adapter = f"adapters/{ADAPTER_FILES['base']}"
    path = write_job(jobs, f"version: 1\nmodel: tiny\ncontrolnet: models/cn\nip_adapter: {adapter}\n"
                           f"image_encoder: encoder\nshots:\n  - {{id: s1, prompt: x, reference: refs/mei.png}}\n")
    result = runner.invoke(app, ["plan", "jobs/job.yaml"])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    job = load_job("jobs/job.yaml")
    assert (job.controlnets, job.ip_adapter, job.image_encoder) == ((("controlnet", "models/cn"),), adapter,
                                                                    "encoder")  # as written
    (item,) = work_items(job)
    assert model_specs(job, [item])[2:4] == (str(jobs / adapter), str(jobs / "encoder"))  # what the loader opens
    settings = item.settings(job.model)
    assert (settings["ip_adapter"], settings["image_encoder"]) == (adapter, "encoder")  # recorded as written
    assert settings["ip_adapter_weights"] and settings["image_encoder_weights"]  # by the files' digests
    monkeypatch.chdir(jobs)  # run from the job's folder: the same images, not new ones
    assert work_items(load_job(path))[0].fingerprint("tiny") == item.fingerprint("tiny")


def test_a_path_found_only_from_the_working_folder_is_read_from_there_and_said_once(project, monkeypatch):
    from storyboard_cli.models.tiny import ADAPTER_FILES

    monkeypatch.chdir(project)
    adapter = f"jobs/adapters/{ADAPTER_FILES['base']}"  # written from the working folder, as older versions read it
    path = write_job(project / "jobs", f"version: 1\nmodel: tiny\nip_adapter: {adapter}\nimage_encoder: jobs/encoder\n"
                                       f"shots:\n  - {{id: s1, prompt: x, reference: refs/mei.png}}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: {path}:{line} field '{field}': {spec} is not in the job file's folder "
                      f"({project / 'jobs'}) but in the working folder, where it is read from; relative paths in a job "
                      f"are read from the job file's folder: write it from there or as an absolute path"
                      for line, field, spec in ((3, "ip_adapter", adapter), (4, "image_encoder", "jobs/encoder"))]
    monkeypatch.chdir(project / "jobs")  # from the job's folder that path names nothing
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert result.output.strip().startswith(f"error: {path}:4 field 'image_encoder': jobs/encoder: no such folder")


def test_an_image_encoder_of_another_width_is_named_at_image_encoder(project):
    from storyboard_cli.models.tiny import ADAPTER_FILES, tiny_adapter_folder

    jobs = project / "jobs"
    shutil.copytree(tiny_adapter_folder("plus") / "image_encoder", jobs / "plus_encoder")  # the plus adapter's
    path = write_job(jobs, f"version: 1\nmodel: tiny\nip_adapter: adapters/{ADAPTER_FILES['base']}\n"
                           f"image_encoder: plus_encoder\nshots:\n  - {{id: s1, prompt: x, reference: refs/mei.png}}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: {path}:4 field 'image_encoder': ip-adapter_sdxl.safetensors: "
                                     f"image_proj.proj.weight is [320, 24], its image encoder's projection_dim is 16 "
                                     f"(another image encoder)")
