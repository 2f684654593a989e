"""Draft renders: the job fields, the plan's buckets and estimate, and `bcg render --draft` / `--final` on the tiny
preset (CPU): the draft folder and its marks, the finals with the drafts' seeds, the refusals."""

import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from conftest import write_job
from storyboard_cli.cli import app
from storyboard_cli.folder.layout import read_chunk
from storyboard_cli.job.file import DRAFT_CUTOFF, DRAFT_DEEPCACHE, as_draft, load_job
from storyboard_cli.job.plan import bucket_table, make_batches, work_items
from storyboard_cli.steps import (CONTROLNET_FLOPS, NO_DEEPCACHE, SHALLOW_FLOPS, DeepCache, guided_steps, levers_label,
                                  step_costs, step_plan)

runner = CliRunner()
JOB = """version: 1
model: tiny
controlnet: tiny
defaults: {steps: 4, size: 64x64}
shots:
  - {id: a, prompt: a lighthouse, seed: 1, candidates: 3}
  - {id: b, prompt: a harbour, seed: 7, guidance: 1}
  - {id: c, prompt: a cliff, seed: 9, control: {image: control/hero_pose.png}}
"""


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


# ---------------------------------------------------------------- the job and the plan (no torch)


def test_deepcache_has_one_label_and_one_json_form():
    on = DeepCache(3, 1)
    assert on.label == "deepcache 3/b1" and on.to_json() == {"interval": 3, "branch": 1}
    assert DeepCache.from_json(on.to_json()) == on and DeepCache.from_json({"interval": 2}) == DeepCache(2, 0)
    assert not NO_DEEPCACHE and NO_DEEPCACHE.label == "" and NO_DEEPCACHE.to_json() is None
    assert DeepCache.from_json({"interval": "3"}) == DeepCache.from_json(None) == NO_DEEPCACHE
    assert sorted([on, NO_DEEPCACHE]) == [NO_DEEPCACHE, on]  # a bucket key holding it stays ordered


def test_levers_label_names_each_lever_that_changes_the_loop():
    assert levers_label(30, True) == "" and levers_label(30, False) == "no CFG"
    assert levers_label(30, True, 0.5, True, 0.5, DeepCache(3, 0)) == \
           "cfg_cutoff 0.5 (16/30 guided), control end 0.5 (15/30 steps), deepcache 3/b0"
    assert levers_label(30, True, 0.99, True, 1.0) == ""  # the cut-off and the end at the last step: a full loop


def test_guided_steps_count_as_diffusers_callback():
    assert [guided_steps(30, r) for r in (0.0, 0.5, 0.7, 1.0)] == [1, 16, 22, 30]
    assert guided_steps(4, 0.99) == 4


def test_fields_defaults_and_levers(job_dir):
    job = load_job(write_job(job_dir, JOB.replace("defaults: {", "defaults: {cfg_cutoff: 0.5, deepcache: "
                                                                 "{interval: 3}, ")))
    a, b, c = job.shots
    assert (a.cfg_cutoff, a.deepcache, a.draft) == (0.5, DeepCache(3, 0), False)
    items = {i.shot: i for i in work_items(job)}
    assert (items["a"].cfg_cutoff, items["a"].deepcache) == (0.5, DeepCache(3, 0))
    assert (items["b"].cfg_cutoff, items["b"].deepcache) == (1.0, DeepCache(3, 0))  # guidance 1: nothing to cut
    assert (items["c"].cfg_cutoff, items["c"].deepcache) == (0.5, NO_DEEPCACHE)  # ControlNet: the cut-off only
    keys = {i.shot: i.key for i in items.values()}
    assert keys["a"].guided_steps == 3 and keys["b"].guided_steps == 0 and not keys["b"].guided
    assert "no CFG" in keys["b"].label and "deepcache 3/b0" in keys["a"].label
    assert items["a"].settings("tiny")["deepcache"] == {"interval": 3, "branch": 0}
    assert "draft" not in items["a"].settings("tiny")
    off = load_job(write_job(job_dir, JOB.replace("defaults: {", "defaults: {deepcache: off, cfg_cutoff: 1.0, "),
                             "off.yaml"))
    plain = load_job(write_job(job_dir, JOB, "plain.yaml"))
    # explicit full quality is today's job: the same images (fingerprints), so nothing renders again
    assert [i.fingerprint("tiny") for i in work_items(off)] == \
           [i.fingerprint("tiny") for i in work_items(plain)]


def test_control_end_counts_as_diffusers_control_guidance_end():
    """diffusers keeps the ControlNet at step i while (i + 1) / steps <= end: 15 of 30 steps at 0.5."""
    from storyboard_cli.steps import control_steps

    assert [control_steps(30, e) for e in (0.5, 16 / 30, 0.7, 0.99, 1.0)] == [15, 16, 21, 29, 30]
    assert control_steps(7, 3 / 7) == 3  # k / steps is k steps, whatever the float rounding


def test_step_plan_with_a_controlnet_end_runs_deepcache_after_it():
    plan = step_plan(10, 4, 3, 0, control=4)
    assert [k.control for k in plan] == [True] * 4 + [False] * 6
    assert [k.cache for k in plan] == [""] * 4 + ["write", "read", "read", "write", "read", "read"]
    assert [k.guided for k in plan] == [True] * 4 + [False] * 6
    assert all(not k.cache for k in step_plan(10, 4, 3, 0, control=10))  # a ControlNet to the end: no DeepCache
    assert [k.cache for k in step_plan(4, 4, 2, 1)] == ["write", "read", "write", "read"]  # no ControlNet: from 0
    # a step after the end costs the UNet alone; while the ControlNet runs it costs (1 + CONTROLNET_FLOPS) / same
    costs = step_costs(step_plan(2, 2, control=1), with_control=True)
    assert costs == pytest.approx(1 + 1 / (1 + CONTROLNET_FLOPS))


def test_control_end_field_fingerprint_and_draft(job_dir):
    text = JOB.replace("control: {image: control/hero_pose.png}", "control: {image: control/hero_pose.png, end: 0.5}")
    job = load_job(write_job(job_dir, text.replace("defaults: {", "defaults: {deepcache: {interval: 2}, ")))
    c = {i.shot: i for i in work_items(job)}["c"]
    assert c.controls[0].end == 0.5 and c.deepcache == DeepCache(2, 0)  # DeepCache after the ControlNet's end
    assert c.settings("tiny")["control_end"] == 0.5 and "control end 0.5 (2/4 steps)" in c.key.label
    # end 1.0 written out is today's shot: the same fingerprint, nothing renders again
    full = load_job(write_job(job_dir, JOB.replace("hero_pose.png}", "hero_pose.png, end: 1.0}"), "full.yaml"))
    plain = load_job(write_job(job_dir, JOB, "plain.yaml"))
    assert [i.fingerprint("tiny") for i in work_items(full)] == \
           [i.fingerprint("tiny") for i in work_items(plain)]
    # the draft: the ControlNet stops where the guidance stops (3 of 4 steps guided at 0.5), DeepCache after it
    draft = {i.shot: i for i in work_items(as_draft(plain))}["c"]
    assert draft.key.control_steps == draft.key.guided_steps == 3 and draft.deepcache == DRAFT_DEEPCACHE
    assert [k.control for k in draft.key.plan] == [True, True, True, False]


@pytest.mark.parametrize("end, message", [(0, "must be above 0"), (1.5, "control.end"), ("x", "control.end")])
def test_control_end_errors_name_file_line_shot_and_field(job_dir, end, message):
    from storyboard_cli.errors import JobError

    path = write_job(job_dir, JOB.replace("hero_pose.png}", f"hero_pose.png, end: {end}}}"))
    line = path.read_text().splitlines().index(next(x for x in path.read_text().splitlines() if "end:" in x)) + 1
    with pytest.raises(JobError) as info:
        load_job(path)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}") and "'c'" in text and "control.end" in text and message in text, text


def test_guidance_1_images_get_their_own_buckets_with_half_the_rows(job_dir):
    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\ndefaults: {size: 64x64}\nshots:\n"
                                      "  - {id: a, prompt: x, candidates: 2}\n"
                                      "  - {id: b, prompt: y, candidates: 2, guidance: 1}\n"))
    rows = bucket_table(make_batches(work_items(job), job.buckets))
    assert [(r.key.guided, r.images, r.rows) for r in rows] == [(True, 2, 4), (False, 2, 2)]


def test_draft_preset_and_estimate(job_dir):
    job = as_draft(load_job(write_job(job_dir, JOB)))
    assert all(s.draft and s.cfg_cutoff == DRAFT_CUTOFF and s.deepcache == DRAFT_DEEPCACHE for s in job.shots)
    assert all(i.settings("tiny")["draft"] is True for i in work_items(job))
    # 10 steps, 6 guided, full UNet every 3rd step: 4 full (2 guided at 1, 2 at 1/2)... counted step by step
    want = sum((1 if i < 6 else 0.5) * (1 if i % 3 == 0 else SHALLOW_FLOPS[0]) for i in range(10))
    assert step_costs(step_plan(10, 6, 3, 0)) == pytest.approx(want)
    assert step_costs(step_plan(10, 10)) == 10 and step_costs(step_plan(10, 0)) == 5


def test_shallow_flops_are_the_sdxl_unets():
    """SHALLOW_FLOPS and CONTROLNET_FLOPS recounted: SDXL-base's UNet (the preset's config) and a ControlNet
    made from it, on the meta device, at 1024x1024."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    from storyboard_cli.engine.deepcache import feature_shape, shallow_unet
    from storyboard_cli.models.loader import SDXL_CONFIGS

    config = json.loads((SDXL_CONFIGS / "unet" / "config.json").read_text())
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
        x, t = torch.zeros(2, 4, 128, 128), torch.zeros(2)
        embeds, pooled, time_ids = torch.zeros(2, 77, 2048), torch.zeros(2, 1280), torch.zeros(2, 6)

        def flops(fn) -> int:
            with FlopCounterMode(display=False) as counter:
                fn()
            return counter.get_total_flops()

        full = flops(lambda: unet(x, t, encoder_hidden_states=embeds,
                                  added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}))
        for branch, share in enumerate(SHALLOW_FLOPS):
            feature = torch.zeros(feature_shape(unet, 2, 128, 128, branch))
            got = flops(lambda: shallow_unet(unet, x, t, embeds, pooled, time_ids, feature, branch)) / full
            assert got == pytest.approx(share, abs=5e-4)
        controlnet = ControlNetModel.from_unet(unet, load_weights_from_unet=False)  # as sdxl-random builds it
        got = flops(lambda: controlnet(x, t, encoder_hidden_states=embeds, controlnet_cond=torch.zeros(2, 3, 1024, 1024),
                                       added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids})) / full
        assert got == pytest.approx(CONTROLNET_FLOPS, abs=5e-4)


# ---------------------------------------------------------------- the command line


def test_plan_shows_levers_saving_and_the_controlnet_note(job_dir):
    path = write_job(job_dir, JOB.replace("defaults: {", "defaults: {cfg_cutoff: 0.5, deepcache: {interval: 3}, "))
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    assert "saving (est.)" in result.output and "cfg_cutoff 0.5 (3/4 guided), deepcache 3/b0" in result.output
    assert result.output.count("DeepCache is off for the ControlNet shots (c)") == 1
    data = json.loads(runner.invoke(app, ["plan", str(path), "--json"]).stdout)
    by = {b["bucket"]: b for b in data["buckets"]}
    a = next(b for b in by.values() if b["images"] == 3)
    assert a["guided_steps"] == 3 and a["deepcache"] == {"interval": 3, "branch": 0}
    assert a["flops_saved_estimate"] == pytest.approx(1 - step_costs(step_plan(4, 3, 3, 0)) / 4, abs=1e-4)
    assert len(data["notes"]) == 1
    plain = write_job(job_dir, JOB.replace(", guidance: 1", ""), "plain.yaml")
    result = runner.invoke(app, ["plan", str(plain)])
    assert "saving" not in result.output and "DeepCache" not in result.output
    drafted = json.loads(runner.invoke(app, ["plan", str(plain), "--draft", "--json"]).stdout)
    # a draft's ControlNet ends where its guidance does, and DeepCache runs after it: no shot loses DeepCache
    assert all(b["flops_saved_estimate"] > 0 for b in drafted["buckets"]) and drafted["notes"] == []
    assert any("control end" in b["bucket"] and "deepcache 3/b0" in b["bucket"] for b in drafted["buckets"])


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """One draft render of JOB, and the same job rendered at full quality for comparison."""
    import shutil

    from conftest import ROOT

    folder = tmp_path_factory.mktemp("draft")
    shutil.copytree(ROOT / "jobs" / "control", folder / "control")
    path = write_job(folder, JOB)
    out = folder / "o"
    result = runner.invoke(app, ["render", str(path), "--out", str(out), "--draft", "--json"])
    assert result.exit_code == 0, result.output
    full = folder / "full"
    assert runner.invoke(app, ["render", str(path), "--out", str(full)]).exit_code == 0
    return path, out, full, json.loads(result.stdout)


def test_draft_render_writes_marked_drafts_to_the_draft_folder(drafted):
    path, out, full, summary = drafted
    draft = out / "draft"
    assert summary["output_dir"] == str(draft) and summary["images_rendered"] == 5
    assert not list(out.glob("a/*.png"))  # nothing in the normal folder
    chunk = read_chunk(draft / "a" / "a_c0_s1.png")
    assert chunk["draft"] is True and chunk["cfg_cutoff"] == DRAFT_CUTOFF and chunk["deepcache"]["interval"] == 3
    params = Image.open(draft / "a" / "a_c0_s1.png").text["parameters"]
    assert "Draft: true" in params and "CFG cutoff: 0.5" in params and "DeepCache: interval 3 branch 0" in params
    c = read_chunk(draft / "c" / "c_c0_s9.png")  # the ControlNet ends with the guidance (3 of 4), DeepCache after
    assert c["control_end"] == 0.75 and c["deepcache"]["interval"] == 3
    assert "(scale 1, end 0.75)" in Image.open(draft / "c" / "c_c0_s9.png").text["parameters"]
    lines = [json.loads(line) for line in (draft / "manifest.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and all(line["draft"] is True for line in lines)
    report = json.loads((draft / "report.json").read_text())
    assert report["draft"] is True and {s["shot"]: s["guided_steps"] for s in report["shots"]} == \
           {"a": 3, "b": 0, "c": 3}
    c = next(s for s in report["shots"] if s["shot"] == "c")  # its ControlNet ends with its guidance
    assert c["control_steps"] == 3 and c["deepcache"] == {"interval": 3, "branch": 0}
    assert not any("DeepCache is off" in n for n in report["notes"])
    assert "## Draft levers (a draft render)" in (draft / "report.md").read_text()
    assert "| c | draft | 3/4 | 0.5 | 3/4 | interval 3, branch 0 |" in (draft / "report.md").read_text()
    page = (draft / "index.html").read_text()
    assert page.count('class="draft-mark"') == 1 + 5 and "--final picks.yaml" in page
    assert 'class="draft-mark"' not in (full / "index.html").read_text()
    # a draft differs from the full render of the same seed, but not by everything (same noise)
    d, f = _pixels(draft / "a" / "a_c0_s1.png"), _pixels(full / "a" / "a_c0_s1.png")
    assert (d != f).any() and np.abs(d.astype(int) - f.astype(int)).mean() < 64


def test_a_rebuilt_draft_sheet_keeps_the_drafts_current(drafted):
    path, out, _, _ = drafted
    result = runner.invoke(app, ["sheet", str(out / "draft")])  # the job from report.json, as --draft ran it
    assert result.exit_code == 0, result.output
    assert "settings changed" not in (out / "draft" / "index.html").read_text()


A_LEVERS = "cfg_cutoff 0.5 (3/4 guided), deepcache 3/b0"
C_LEVERS = "cfg_cutoff 0.5 (3/4 guided), control end 0.75 (3/4 steps), deepcache 3/b0"


def test_the_sheet_names_the_levers_as_bcg_plan_does(drafted, tmp_path):
    import shutil

    path, out, _, _ = drafted
    plan = json.loads(runner.invoke(app, ["plan", str(path), "--draft", "--json"]).stdout)
    assert {A_LEVERS, C_LEVERS, "no CFG, deepcache 3/b0"} == {b["levers"] for b in plan["buckets"]}
    page = (out / "draft" / "index.html").read_text()  # from the job
    assert f"<dt>levers</dt><dd>{A_LEVERS}</dd>" in page and f"<dt>levers</dt><dd>{C_LEVERS}</dd>" in page
    alone = tmp_path / "draft"  # a folder whose job is gone: the levers from its PNGs' settings
    shutil.copytree(out / "draft", alone)
    report = json.loads((alone / "report.json").read_text())
    (alone / "report.json").write_text(json.dumps(report | {"job": str(tmp_path / "gone.yaml")}))
    assert runner.invoke(app, ["sheet", str(alone)]).exit_code == 0
    page = (alone / "index.html").read_text()
    assert f"<dt>levers</dt><dd>{A_LEVERS}</dd>" in page and f"<dt>levers</dt><dd>{C_LEVERS}</dd>" in page


def test_final_renders_the_picks_at_full_quality_with_their_seeds(drafted, tmp_path):
    import shutil

    path, out, full, _ = drafted
    work = tmp_path / "o"
    shutil.copytree(out, work)
    picks = write_job(tmp_path, 'picks:\n  a: "a/a_c2_s3.png"\n  c: "c/c_c0_s9.png"\n', "picks.yaml")
    result = runner.invoke(app, ["render", str(path), "--out", str(work), "--final", str(picks), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["images_rendered"] == 2
    assert sorted(p.relative_to(work).as_posix() for p in work.glob("[abc]/*.png")) == ["a/a_c2_s3.png",
                                                                                       "c/c_c0_s9.png"]
    for rel in ("a/a_c2_s3.png", "c/c_c0_s9.png"):  # exactly the full render's image of that seed
        assert np.array_equal(_pixels(work / rel), _pixels(full / rel))
        assert "draft" not in read_chunk(work / rel)
    again = runner.invoke(app, ["render", str(path), "--out", str(work), "--final", str(picks), "--json"])
    assert json.loads(again.stdout)["images_rendered"] == 0


@pytest.mark.parametrize("args,message", [
    (["--draft", "--final", "PICKS"], "--draft and --final: choose one"),
    (["--final", "PICKS", "--reroll", "PICKS"], "--final renders the picks, --reroll new candidates"),
    (["--draft-out", "elsewhere"], "--draft-out names the draft folder"),
    (["--final", "EMPTY"], "--final: the file picks no candidate"),
    (["--final", "WRONG"], "is not a candidate image bcg rendered for this shot"),
])
def test_bad_draft_options_exit_2_in_one_line(drafted, tmp_path, args, message):
    path, out, _, _ = drafted
    files = {"PICKS": write_job(tmp_path, 'picks:\n  a: "a/a_c2_s3.png"\n', "p.yaml"),
             "EMPTY": write_job(tmp_path, "picks: {}\nreroll: []\n", "e.yaml"),
             "WRONG": write_job(tmp_path, 'picks:\n  b: "a/a_c2_s3.png"\n', "w.yaml")}
    argv = ["render", str(path), "--out", str(out)] + [str(files.get(a, tmp_path / a if a == "elsewhere" else a))
                                                       for a in args]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


# ---------------------------------------------------------------- a draft render through the graph runner


def _graph_render(job, out, models, capturer=None):
    """A render on the graph runner with CPU replays (tests/test_draft_engine.py) instead of CUDA graphs."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.run.render import RenderOptions, render
    from helpers.graphs import cpu_replays

    runner = GraphRunner(models, max_batch=1, max_hw=(64, 64))
    cpu_replays(runner)
    if capturer is not None:
        runner.capturer = capturer(runner.capturer)
    return render(job, RenderOptions(out_dir=out), models=models, engine=runner), runner


def _same_images(a, b):
    for png in sorted(a.glob("*/*.png")):
        assert np.abs(_pixels(png).astype(int) - _pixels(b / png.relative_to(a)).astype(int)).max() <= 1, png


def test_draft_render_on_the_graph_runner_with_a_lora_equals_eager(job_dir, tmp_path, tiny_cpu):
    """Every step kind through the graph runner's buffers, with a LoRA swapped in place between batches."""
    from conftest import ROOT
    from storyboard_cli.run.render import RenderOptions, render

    mei = ROOT / "jobs" / "loras" / "mei.safetensors"
    text = JOB.replace("controlnet: tiny\n", f"controlnet: tiny\nloras:\n  mei: {mei}\n").replace(
        "prompt: a harbour", "prompt: a harbour <lora:mei:0.8>")
    job = as_draft(load_job(write_job(job_dir, text)))
    result, runner = _graph_render(job, tmp_path / "graph", tiny_cpu)
    assert result.status == "done" and result.rendered == 5 and result.engine == "graph"
    labels = {g["shape"] for g in result.report.graphs}
    # the ControlNet shot's steps after its end run the graphs of a shot without one (cond, DeepCache full)
    assert {"3x64x64 float32 deepcache full b0", "1x64x64 float32 cond deepcache shallow b0",
            "1x64x64 +control float32", "1x64x64 float32 cond deepcache full b0"} <= labels
    assert not any("+control" in label and "cond" in label for label in labels)
    assert all(g["state"] == "graph" for g in result.report.graphs)
    eager = render(job, RenderOptions(out_dir=tmp_path / "eager"), models=tiny_cpu)
    assert eager.engine == "eager" and eager.rendered == 5
    _same_images(tmp_path / "graph", tmp_path / "eager")


def test_out_of_memory_capturing_a_draft_kind_splits_then_runs_the_same_draft_eager(job_dir, tmp_path, tiny_cpu):
    import torch

    from storyboard_cli.run.render import RenderOptions, render

    job = as_draft(load_job(write_job(job_dir, JOB.replace("candidates: 3", "candidates: 2"))))

    def short_of_memory(capture):
        def capturer(key):
            if key.step.cache == "read":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return capture(key)
        return capturer

    result, _ = _graph_render(replace_buckets(job, (1, 2)), tmp_path / "graph", tiny_cpu, short_of_memory)
    assert result.status == "done" and result.rendered == 4
    assert any("retried eager" in n for n in result.notes)
    eager = render(job, RenderOptions(out_dir=tmp_path / "eager"), models=tiny_cpu)
    _same_images(tmp_path / "graph", tmp_path / "eager")


def replace_buckets(job, buckets):
    from dataclasses import replace

    return replace(job, buckets=buckets)
