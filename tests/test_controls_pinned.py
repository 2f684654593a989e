"""What a job's guides and references leave in every output, pinned as recorded before the one-net `controlnet:`
shorthand became a net named by convention (tests/data/controls_pinned.json): each image's fingerprint, settings,
PNG chunks, A1111 infotext, manifest line, bucket label and mix key, `bcg plan` (text and --json) and the report's
conditioning keys, for the shorthand (a mapping, a one-entry list, beside references), one named net and two named
nets. None of them may change: a changed fingerprint re-renders a finished folder. Pure, no torch."""

import base64
import json

import pytest
from typer.testing import CliRunner

from conftest import DATA, write_job
from storyboard_cli.cli import app
from storyboard_cli.folder.outputs import manifest_record, parameters_text, png_text
from storyboard_cli.folder.report import job_conditions
from storyboard_cli.job.file import as_draft, load_job
from storyboard_cli.job.plan import work_items
from storyboard_cli.serve.intake import mix_key, work

from helpers.plan_output import without_estimate

PINNED = DATA / "controls_pinned.json"
RECORDED_KINDS_KEYS = ("characters", "references", "controlnets")  # report.json's conditioning keys in the record
IMAGES = {  # PNG bytes as written, so no encoder's version can change a digest
    "pose.png": "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGUlEQVR4nGP8//8/AymAiSTVoxpGNQwpDQBVbQMdPVIhQwAAAABJRU5ErkJggg==",
    "depth.png": "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAEElEQVR4nGNgGAWjYBTAAAADEAABPywr7AAAAABJRU5ErkJggg==",
    "mei.png": "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGUlEQVR4nGM8oaHBQApgIkn1qIZRDUNKAwCMLQE4ZidSiAAAAABJRU5ErkJggg==",
}
SHOTS = """\
shots:
  - {id: a, prompt: x, steps: 10, control: {image: pose.png, scale: 0.7, end: 0.5}}
  - {id: b, prompt: x, seed: 3, steps: 10, control: [{image: depth.png}]}
  - {id: c, prompt: y, steps: 10}
"""
JOBS = {
    "shorthand": "version: 1\nmodel: tiny\ncontrolnet: tiny\n" + SHOTS,
    "shorthand_references": "version: 1\nmodel: tiny\ncontrolnet: tiny\nip_adapter: tiny\n" + SHOTS
    + "  - {id: d, prompt: z, steps: 10, reference: {image: mei.png, scale: 0.5}, control: {image: pose.png}}\n",
    "one_named": "version: 1\nmodel: tiny\ncontrolnets: {pose: tiny}\n" + SHOTS,
    "two_named": "version: 1\nmodel: tiny\ncontrolnets: {pose: tiny, depth: tiny}\nshots:\n"
    "  - {id: a, prompt: x, steps: 10, control: [{net: pose, image: pose.png, scale: 0.8},"
    " {net: depth, image: depth.png, end: 0.6}]}\n"
    "  - {id: b, prompt: x, steps: 10, control: {net: depth, image: depth.png, scale: 0.5}}\n"
    "  - {id: c, prompt: y, steps: 10}\n",
}


def record(job) -> dict:
    """Everything an output records of the job's images, by output path."""
    out = {}
    for item in work_items(job):
        path = item.outputs[0]
        fp = item.fingerprint(job.model)
        settings = item.settings(job.model)
        out[path] = {"fingerprint": fp, "settings": settings, "png": png_text(item, job.model),
                     "parameters": parameters_text(item, settings, job.model), "bucket": item.key.label,
                     "flops_saved": round(item.key.flops_saved, 6), "mix": mix_key(job, item),
                     "manifest": manifest_record(item, path, fp, "0" * 64, settings=settings)}
        out[path]["manifest"].pop("finished")  # the clock's
    return out


def recorded(folder, monkeypatch) -> dict:
    """The record of every job in JOBS and its draft, and `bcg plan`'s output (text and --json) for each."""
    for name, data in IMAGES.items():
        (folder / name).write_bytes(base64.b64decode(data))
    monkeypatch.chdir(folder)  # the job's path as given: `bcg plan` prints it
    runner = CliRunner()
    found = {}
    for name, text in JOBS.items():
        write_job(folder, text, f"{name}.yaml")
        job = load_job(f"{name}.yaml")
        plans = {}
        for args in ([], ["--json"], ["--draft", "--json"]):
            result = runner.invoke(app, ["plan", f"{name}.yaml", *args])
            assert result.exit_code == 0, result.output
            plans[" ".join(args) or "text"] = without_estimate(result.stdout)
        # the report's conditioning keys of the kinds the record was made with; a later kind's key only where it
        # has an entry (none for these jobs: report.json leaves a None key out)
        report = {k: v for k, v in job_conditions(job).items() if k in RECORDED_KINDS_KEYS or v is not None}
        found[name] = {"images": record(job), "draft": record(as_draft(job)), "plan": plans, "report": report}
    return json.loads(json.dumps(found))  # tuples as lists, as the file holds them


def test_every_output_of_guides_is_as_recorded(tmp_path, monkeypatch):
    assert recorded(tmp_path, monkeypatch) == json.loads(PINNED.read_text())


def test_the_work_estimate_counts_every_net_as_the_flops_estimate_does(tmp_path, monkeypatch):
    """The scheduler's work (megapixel-steps) counts each net an image runs at half a UNet step while it runs, as
    BucketKey.flops_saved counts each net's FLOPs: an image with two nets is more work than one with its first."""
    recorded(tmp_path, monkeypatch)
    two, one, none = work_items(load_job("two_named.yaml"))  # pose + depth (end 0.6), depth alone, no net
    megapixels = two.width * two.height / 1e6
    assert [c.end for c in two.controls] == [1.0, 0.6]
    assert work(two) == round(megapixels * (10 + 0.5 * 10 * (1.0 + 0.6)), 4)
    assert work(none) < work(one) < work(two)
    assert len(two.key.nets) == 2 and two.key.flops_saved == 0 == one.key.flops_saved


if __name__ == "__main__":  # writes the record: only where a change of what outputs hold is meant
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        PINNED.write_text(json.dumps(recorded(Path(tmp), mp), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
