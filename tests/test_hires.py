"""The hires pass's job half: `hires:` read and checked (one located line, exit 2), the size it makes, the steps it
runs, what an image records of it (settings, fingerprint, A1111 fields, manifest) and what `bcg plan` shows."""

import json

import numpy as np

import pytest
from typer.testing import CliRunner

from conftest import write_job
from storyboard_cli.cli import app
from storyboard_cli.errors import JobError
from storyboard_cli.folder.layout import MANIFEST
from storyboard_cli.folder.outputs import manifest_record, parameters_text
from storyboard_cli.job.file import load_job
from storyboard_cli.job.hires import Hires, hires_size
from storyboard_cli.job.plan import summary, work_items

runner = CliRunner()

JOB = """version: 1
model: tiny
defaults:
  size: 64x96
  steps: 8
  hires: {{scale: 1.5, strength: 0.35, steps: 12, upscaler: lanczos}}
shots:
  - id: a
    prompt: a lighthouse at dusk
    candidates: 2
{a}
  - id: b
    prompt: a boat
    hires: off
"""


def job(tmp_path, a: str = ""):
    return load_job(write_job(tmp_path, JOB.format(a=a)))


def test_a_shot_takes_the_defaults_pass_and_off_drops_it(tmp_path):
    j = job(tmp_path)
    a, b = j.shots
    assert a.hires == Hires(1.5, 0.35, 12, "lanczos") and b.hires is None
    assert hires_size(64, 96, 1.5) == (96, 144)
    assert a.hires.steps_run(a.steps) == 4  # diffusers' int(12 * 0.35)
    c = job(tmp_path, "    hires: {scale: 2}").shots[0]
    assert c.hires == Hires(2.0) and c.hires.schedule(c.steps) == 8 and c.hires.steps_run(8) == 4


def test_settings_record_the_pass_and_an_image_without_one_keeps_its_fingerprint(tmp_path):
    j = job(tmp_path)
    with_pass, without = work_items(j)[0], work_items(j)[-1]
    s = with_pass.settings(j.model)
    assert s["hires"] == {"scale": 1.5, "strength": 0.35, "steps": 12, "upscaler": "lanczos", "width": 96,
                          "height": 144}
    assert "hires" not in without.settings(j.model)
    text = JOB.format(a="").replace("  hires: {scale: 1.5, strength: 0.35, steps: 12, upscaler: lanczos}\n", "")
    assert "lanczos" not in text
    plain = load_job(write_job(tmp_path, text, "plain.yaml"))
    assert work_items(plain)[-1].fingerprint(j.model) == without.fingerprint(j.model)
    assert work_items(plain)[0].fingerprint(j.model) != with_pass.fingerprint(j.model)
    other = job(tmp_path, "    hires: {scale: 1.5, strength: 0.4, steps: 12, upscaler: lanczos}")
    assert work_items(other)[0].fingerprint(j.model) != with_pass.fingerprint(j.model)


def test_a1111_fields_and_the_manifest(tmp_path):
    j = job(tmp_path)
    item = work_items(j)[0]
    s = item.settings(j.model)
    text = parameters_text(item, s, j.model).splitlines()[-1]
    for field in ("Denoising strength: 0.35", "Hires upscale: 1.5", "Hires steps: 12", "Hires upscaler: Lanczos",
                  "Hires resize: 96x144", "Size: 64x96"):
        assert field in text
    assert manifest_record(item, item.outputs[0], "f" * 16, settings=s)["hires"]["width"] == 96


def test_plan_shows_the_sizes_and_the_steps_that_run(tmp_path):
    path = write_job(tmp_path, JOB.format(a=""))
    s = summary(load_job(path))
    assert s.hires == ({"shot": "a", "size": "64x96", "hires_size": "96x144", "scale": 1.5, "strength": 0.35,
                        "steps": 12, "steps_run": 4, "upscaler": "lanczos", "images": 2},)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0 and "hires a: 64x96 -> 96x144 (lanczos x1.5), 4 of 12 steps at strength 0.35" \
        in result.output
    assert json.loads(runner.invoke(app, ["plan", str(path), "--json"]).output)["hires"] == list(s.hires)
    plain = write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n", "plain.yaml")
    assert "hires" not in json.loads(runner.invoke(app, ["plan", str(plain), "--json"]).output)


@pytest.mark.parametrize("hires, line, field, message", [
    ("{scale: 24}", 11, "hires.scale", "must be between 1 and 4"),
    ("{strength: 0.5}", 11, "hires.scale", "missing"),
    ("{scale: 1.5, strength: 0}", 11, "hires.strength", "must be in (0, 1]"),
    ("{scale: 1.5, strength: 1.5}", 11, "hires.strength", "must be between 0 and 1"),
    ("{scale: 1.5, strength: 0.05, steps: 10}", 11, "hires.strength", "0.05 of 10 steps runs no step"),
    ("{scale: 1.5, upscaler: esrgan}", 11, "hires.upscaler", "must be one of latent, lanczos"),
    ("{scale: 1.5, steps: 0}", 11, "hires.steps", "must be between 1"),
    ("{scale: 1.5, denoise: 0.3}", 11, "hires.denoise", "unknown key"),
    ("1.5", 11, "hires", "must be a mapping"),
])
def test_bad_input_is_one_located_line(tmp_path, hires, line, field, message):
    with pytest.raises(JobError) as e:
        job(tmp_path, f"    hires: {hires}")
    text = str(e.value)
    assert f"job.yaml:{line} shot 'a' field '{field}'" in text and message in text and "\n" not in text


def test_a_result_over_2048_px_names_the_size_at_plan_exit_2(tmp_path):
    path = write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - id: wide\n    prompt: x\n    size: 1344x768\n"
                               "    hires: {scale: 2}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and "job.yaml:7 shot 'wide' field 'hires.scale'" in line
    assert "1344x768 x 2 is 2688x1536: over 2048 px a side" in line


RENDER = """version: 1
model: tiny
defaults: {size: 64x96, steps: 4, guidance: 5.0}
shots:
  - {id: a, prompt: a lighthouse at dusk, seed: 5, candidates: 2,
     hires: {scale: 1.5, strength: 0.5, steps: 6}}
  - {id: b, prompt: a boat, seed: 9, hires: {scale: 2, strength: 0.5, upscaler: lanczos}}
  - {id: c, prompt: a gull, seed: 3}
"""


def _png(path):
    from PIL import Image

    with Image.open(path) as im:
        return im.size, json.loads(im.info["bcg"]), im.info["parameters"], np.asarray(im.convert("RGB"))


def test_a_hires_render_keeps_the_base_writes_the_candidate_at_the_new_size_and_resumes(tmp_path, tiny_cpu):
    from storyboard_cli.folder.layout import candidate_files
    from storyboard_cli.run.render import RenderOptions, render

    job = load_job(write_job(tmp_path, RENDER))
    out = tmp_path / "out"
    result = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 7  # 4 candidates and 3 bases
    planned = {p: i for i in work_items(job) for p in i.outputs}
    for path, (w, h), base in [("a/a_c0_s5.png", (96, 144), True), ("a/a_c1_s6.png", (96, 144), True),
                               ("b/b_c0_s9.png", (128, 192), True), ("c/c_c0_s3.png", (64, 96), False)]:
        size, meta, text, _ = _png(out / path)
        assert size == (w, h) and meta["fingerprint"] == planned[path].fingerprint(job.model)
        assert (out / path.replace(".png", ".base.png")).exists() == base
        if base:
            assert _png(out / path.replace(".png", ".base.png"))[0] == (64, 96)
            assert "Size: 64x96" in text and f"Hires resize: {w}x{h}" in text and "Denoising strength: 0.5" in text
    assert "Hires upscaler: Latent" in _png(out / "a/a_c0_s5.png")[2]
    assert "Hires upscaler: Lanczos, " in _png(out / "b/b_c0_s9.png")[2] + ", "
    assert [c[0] for c in candidate_files(out, "a")] == ["a/a_c0_s5.png", "a/a_c1_s6.png"]  # the base is no candidate
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert {r["path"]: r.get("hires", {}).get("width") for r in records}["a/a_c0_s5.png"] == 96
    # the hires pass denoised the tail of its schedule: 3 of 6 steps from step 4, at the new size
    buckets = {b["bucket"]: b for b in result.report.to_json()["buckets"]}
    assert buckets["2 x 96x144 6 steps euler from step 4"]["steps"] == 3
    # resume: everything on disk is skipped; a lost candidate runs its hires pass alone, from its base
    again = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert (again.rendered, again.skipped) == (0, 4)
    before = _png(out / "a/a_c1_s6.png")[3]
    (out / "a/a_c1_s6.png").unlink()
    redo = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert (redo.rendered, redo.skipped) == (1, 3)
    assert [b["bucket"] for b in redo.report.to_json()["buckets"]] == ["1 x 96x144 6 steps euler from step 4"]
    # the same picture, alone in its batch now (a CPU's kernels round by the batch's rows: a level at most)
    assert np.abs(_png(out / "a/a_c1_s6.png")[3].astype(int) - before).max() <= 1
    # a lost base is rendered again, and its candidate with it (the candidate starts from it)
    (out / "b/b_c0_s9.base.png").unlink()
    (out / "b/b_c0_s9.png").unlink()
    assert render(job, RenderOptions(out_dir=out), models=tiny_cpu).rendered == 2


@pytest.mark.slow
@pytest.mark.parametrize("remote", [False, True], ids=["shared", "upload"])
def test_a_hires_job_served_lands_in_one_lease_as_bcg_render_writes_it(tmp_path, remote):
    """`bcg serve` + `bcg worker` (on the server's folders, or `--upload --root elsewhere`): the candidates land in
    the server's folder at the pass's size with the planned fingerprints, their first passes beside them and in the
    manifest as `bcg render` writes them, each lease completed at once (the first pass was refused as not the
    lease's: the lease expired and its images were rendered again)."""
    import httpx

    from storyboard_cli.run.render import RenderOptions, render

    from helpers.serve import Server, free_port, metric, start_worker, stop

    path = write_job(tmp_path, RENDER)
    job = load_job(path)
    server = Server(tmp_path / "root", free_port()).start(lease_s=10, gpus="none")
    worker = start_worker(server.url, "w", *(("--upload", "--root", str(tmp_path / "elsewhere")) if remote else ()))
    try:
        job_id = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(),
                            headers={"Content-Type": "application/yaml"}).json()["id"]
        state = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"))
        assert state["state"] == "succeeded", state
        assert metric(server.url, "bcg_lease_expiries_total") == 0 and all(i["attempts"] == 1 for i in state["images"])
        served = server.root / "jobs" / job_id / "out"
        for item in work_items(job):
            size, meta, _, _ = _png(served / item.outputs[0])
            assert meta["fingerprint"] == item.fingerprint(job.model)
            assert size == ((96, 144) if item.shot == "a" else (128, 192) if item.shot == "b" else (64, 96))
        alone = render(job, RenderOptions(out_dir=tmp_path / "alone")).out_dir
        lines = [sorted(json.loads(x)["path"] for x in (out / MANIFEST).read_text().splitlines())
                 for out in (served, alone)]
        assert lines[0] == lines[1] and len([p for p in lines[0] if p.endswith(".base.png")]) == 3
        assert all((served / p).is_file() for p in lines[0])
    finally:
        stop(worker)
        server.kill_everything()


def test_the_services_work_estimate_counts_the_pass(tmp_path):
    from storyboard_cli.serve.intake import work

    a, *_, c = work_items(load_job(write_job(tmp_path, RENDER)))
    assert work(c) == round(64 * 96 / 1e6 * 4, 4)
    assert work(a) == round(64 * 96 / 1e6 * 4 + 96 * 144 / 1e6 * 3, 4)  # and 3 of 6 steps at 96x144


def test_the_planned_passes_size_the_graphs_so_a_pass_drops_none(tmp_path, tiny_cpu):
    """The hires passes' shapes are known before their bases exist (`planned_passes`: at the pass's size, over the
    steps it runs): a graph runner prepared with them as `later` fits every pass that runs, so its first capture does
    not grow the buffers and drop the first phase's graphs."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.job.plan import first_pass, make_batches, planned_passes
    from storyboard_cli.run.batch import batch_shapes

    job = load_job(write_job(tmp_path, RENDER))
    items = work_items(job)
    passes = planned_passes(job, items)
    assert [(i.shot, i.width, i.height, i.steps) for i in passes] == [
        ("a", 96, 144, 3), ("a", 96, 144, 3), ("b", 128, 192, 2)]  # int(S * strength) of the pass's schedule run
    first = batch_shapes(make_batches(first_pass(items), job.buckets))
    later = batch_shapes(make_batches(passes, job.buckets))
    without, runner = GraphRunner(tiny_cpu, max_batch=1, max_hw=(8, 8)), GraphRunner(tiny_cpu, max_batch=1, max_hw=(8, 8))
    without.ensure_capacity(first)
    runner.ensure_capacity(first)
    runner.prepare([], later=later)
    assert all(runner.buf.fits(s) for s in first + later) and not runner.graphs
    assert not all(without.buf.fits(s) for s in later)  # the passes are larger: without them the buffers would grow


def test_plan_and_the_server_price_the_passes(tmp_path):
    """`bcg plan`'s estimate counts the hires passes' UNet row-steps (guided: 2 rows an image): the first phase's
    4 images x 4 steps in one batch of 4 = 32, a's two passes 2 x 3 steps at 96x144 = 12, b's 1 x 2 steps at 128x192
    = 4; and the server's per-image seconds give a hires image its pass's share on top of its base's."""
    from storyboard_cli.job.plan import phases
    from storyboard_cli.serve.intake import item_seconds

    path = write_job(tmp_path, RENDER)
    result = runner.invoke(app, ["plan", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["estimate"]["row_steps"] == 2 * (4 * 4 + 2 * 3 + 1 * 2)
    job = load_job(path)
    items = work_items(job)
    firsts, passes = phases(job, items)
    assert [i.outputs for i in firsts] == [(o.replace(".png", ".base.png"),) if i.hires else i.outputs
                                           for i in items for o in i.outputs]
    est = item_seconds(job, items)
    a, _, b, c = items
    assert est[id(a)] > est[id(c)] > 0 and est[id(b)] > est[id(c)]
