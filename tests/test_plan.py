"""Pure tests for planning: bucket choice, padding, dedup, seeds."""

import pytest
from typer.testing import CliRunner

from conftest import DATA, ROOT, write_job
from helpers.plan_output import without_estimate
from storyboard_cli.cli import app
from storyboard_cli.job.file import as_draft, load_job
from storyboard_cli.job.plan import bucket_table, cut, make_batches, summary, work_items


@pytest.mark.parametrize("n,buckets,sizes", [
    (1, (1, 2, 4, 8), [1]), (7, (1, 2, 4, 8), [4, 2, 1]), (8, (1, 2, 4, 8), [8]), (13, (1, 2, 4, 8), [8, 4, 1]),
    (3, (2, 4), [2, 2]), (5, (4,), [4, 4]), (1, (4,), [4]), (9, (1, 8), [8, 1]),
])
def test_cut(n, buckets, sizes):
    assert cut(n, buckets) == sizes
    assert sum(sizes) >= n


def _job(tmp_path, shots: str, buckets: str = ""):
    return load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\n{buckets}shots:\n{shots}"))


def test_items_get_seed_plus_k_and_their_own_files(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 10, candidates: 3}\n")
    items = work_items(job)
    assert [(i.k, i.seed) for i in items] == [(0, 10), (1, 11), (2, 12)]
    assert items[2].outputs == ("a/a_c2_s12.png",)


def test_identical_requests_render_once(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 10, candidates: 2}\n  - {id: b, prompt: x, seed: 11}\n")
    items = work_items(job)
    assert len(items) == 2
    assert items[1].outputs == ("a/a_c1_s11.png", "b/b_c0_s11.png")


def test_groups_by_bucket_key_and_pads_the_last_batch(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, candidates: 3, size: 512x512}\n"
                         "  - {id: b, prompt: y, candidates: 2, size: 512x512, steps: 20}\n"
                         "  - {id: c, prompt: z, candidates: 2, size: 512x512}\n", "buckets: [4]\n")
    batches = make_batches(work_items(job), job.buckets)
    assert [(b.key.steps, len(b.items), b.size) for b in batches] == [(30, 4, 4), (30, 1, 4), (20, 2, 4)]
    rows = bucket_table(batches)
    first = rows[0]
    assert (first.images, first.batches, first.rows, first.padded_rows) == (5, (4, 4), 16, 6)
    assert first.row_steps == 16 * 30
    assert abs(first.waste - 6 / 16) < 1e-9


def test_control_is_part_of_the_bucket_key(tmp_path, job_dir):
    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
                                      "  - {id: a, prompt: x, candidates: 2}\n"
                                      "  - {id: b, prompt: y, control: {image: control/hero_pose.png}}\n"))
    keys = {b.key for b in make_batches(work_items(job), job.buckets)}
    assert {k.control for k in keys} == {False, True}


# ---------------------------------------------------------------- LoRA sets, fingerprints by content

import shutil
from dataclasses import replace
from pathlib import Path

from conftest import ROOT
from storyboard_cli.job.digests import weights_digest
from storyboard_cli.job.plan import lora_swaps, lora_table

MEI = ROOT / "jobs" / "loras" / "mei.safetensors"


def _lora_job(folder, shots: str, lora_path=MEI):
    return load_job(write_job(folder, f"version: 1\nmodel: tiny\nloras:\n  mei: {lora_path}\n  ink: {MEI}\n"
                                      f"defaults: {{size: 64x64, steps: 4}}\nshots:\n{shots}"))


def test_batches_are_gathered_by_lora_set_for_the_fewest_swaps(tmp_path):
    job = _lora_job(tmp_path, "  - {id: a, prompt: x, lora: {mei: 1}}\n"
                              "  - {id: b, prompt: y}\n"
                              "  - {id: c, prompt: z, lora: {ink: 0.5}, size: 128x64}\n"
                              "  - {id: d, prompt: w, lora: {mei: 1}, size: 128x64}\n"
                              "  - {id: e, prompt: v, lora: {ink: 0.5}}\n"
                              "  - {id: f, prompt: u, size: 128x64}\n", )
    batches = make_batches(work_items(job), job.buckets)
    order = [b.key.loras for b in batches]
    assert order == [(), (), (("mei", 1.0),), (("mei", 1.0),), (("ink", 0.5),), (("ink", 0.5),)]
    assert lora_swaps(batches) == 2  # one per distinct set: the fewest possible
    assert [(r.label, r.images, r.batches) for r in lora_table(batches)] == \
        [("none", 2, 2), ("mei 1", 2, 2), ("ink 0.5", 2, 2)]
    assert all(len({i.key for i in b.items}) == 1 for b in batches)
    assert "lora mei 1" in batches[2].key.label
    # in the order the shots came, a set would be entered again and again
    assert lora_swaps(sorted(batches, key=lambda b: [i.shot for i in b.items])) == 6


def test_the_same_request_with_and_without_a_lora_is_two_images(tmp_path):
    job = _lora_job(tmp_path, "  - {id: a, prompt: x, seed: 1}\n  - {id: b, prompt: x, seed: 1, lora: {mei: 1}}\n"
                              "  - {id: c, prompt: 'x <lora:mei:1>', seed: 1}\n")
    items = work_items(job)
    assert len(items) == 2 and items[1].outputs == ("b/b_c0_s1.png", "c/c_c0_s1.png")


def test_settings_record_each_lora_by_name_scale_file_and_hash(tmp_path):
    job = _lora_job(tmp_path, "  - {id: a, prompt: x, lora: {mei: 0.8, ink: -1}}\n")
    s = work_items(job)[0].settings(job.model)
    mei = job.loras["mei"]
    assert s["loras"][1] == {"name": "mei", "scale": 0.8, "file": mei.file, "sha256": mei.sha256,
                             "shorthash": mei.shorthash}
    assert [l["name"] for l in s["loras"]] == ["ink", "mei"]
    plain = _lora_job(tmp_path, "  - {id: a, prompt: x}\n")
    assert "loras" not in work_items(plain)[0].settings("tiny")


def test_a_changed_lora_file_changes_the_fingerprint_a_moved_one_does_not(tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "mine.safetensors"
    shutil.copy(MEI, copy)
    shots = "  - {id: a, prompt: x, lora: {mei: 0.8}}\n  - {id: b, prompt: y}\n"
    before = [i.fingerprint("tiny") for i in work_items(_lora_job(tmp_path, shots, copy))]
    moved = tmp_path / "elsewhere" / "mei.safetensors"
    moved.parent.mkdir()
    shutil.copy(copy, moved)
    assert [i.fingerprint("tiny") for i in work_items(_lora_job(tmp_path, shots, moved))] == before
    state = load_file(str(copy))
    key = sorted(state)[0]
    state[key] = state[key] + 0.01  # retrained: other weights in the same file
    save_file(state, str(copy))
    after = [i.fingerprint("tiny") for i in work_items(_lora_job(tmp_path, shots, copy))]
    assert after[0] != before[0] and after[1] == before[1]


def test_control_images_count_by_content_not_by_path(job_dir, tmp_path):
    from PIL import Image

    text = ("version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
            "  - {id: a, prompt: x, control: {image: control/hero_pose.png}}\n")
    first = work_items(load_job(write_job(job_dir, text)))[0]
    s = first.settings("tiny")
    assert s["control_image"] == "control/hero_pose.png" and len(s["control_sha256"]) == 16
    moved = tmp_path / "moved project"
    shutil.copytree(job_dir, moved)
    again = work_items(load_job(moved / "job.yaml"))[0]
    assert again.fingerprint("tiny") == first.fingerprint("tiny")
    with Image.open(moved / "control/hero_pose.png") as im:  # the pose guide redrawn, same name
        im.convert("RGB").rotate(90).save(moved / "control/hero_pose.png")
    redrawn = work_items(load_job(moved / "job.yaml"))[0]
    assert redrawn.fingerprint("tiny") != first.fingerprint("tiny")


def test_weights_given_as_a_path_count_by_size_mtime_and_header(tmp_path):
    import os

    folder = tmp_path / "model"
    (folder / "unet").mkdir(parents=True)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"h" * 100 + b"w" * (2 << 20))
    (folder / "unet" / "config.json").write_text("{}")
    one = weights_digest(str(folder))
    assert one == weights_digest(str(folder)) and len(one) == 16
    assert weights_digest("tiny") is None and weights_digest("stabilityai/sdxl-base") is None
    job = load_job(write_job(tmp_path, f"version: 1\nmodel: {folder}\nshots:\n  - {{id: a, prompt: x}}\n"))
    item = work_items(job)[0]
    assert item.settings(job.model)["model_weights"] == one
    fp = item.fingerprint(job.model)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # replaced (same bytes, new time)
    assert weights_digest(str(folder)) != one and item.fingerprint(job.model) != fp


def test_first_candidate_continues_a_shots_candidates(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 10, candidates: 2}\n")
    more = replace(job, shots=(replace(job.shots[0], first_candidate=2),))
    assert [(i.k, i.seed, i.outputs) for i in work_items(more)] == [
        (2, 12, ("a/a_c2_s12.png",)), (3, 13, ("a/a_c3_s13.png",))]


@pytest.mark.parametrize("args,expected", [(["--json"], "levers.json"), (["--draft", "--json"], "levers-draft.json"),
                                           ([], "levers.txt")])
def test_bcg_plan_prints_what_it_always_printed(args, expected, monkeypatch):
    """`bcg plan` byte for byte as recorded in tests/data/plan (a job with every lever, LoRA sets, a prompt CLIP cuts);
    the time estimate it prints since depends on the machine (tests/test_estimate.py)."""
    monkeypatch.chdir(ROOT)  # the job's path as given, its LoRA file's path under ROOT
    result = CliRunner().invoke(app, ["plan", "tests/data/plan/levers.yaml", *args])
    assert result.exit_code == 0, result.output
    assert "time: " in result.stdout or '"estimate"' in result.stdout
    assert without_estimate(result.stdout).replace(str(ROOT), "<ROOT>") == (DATA / "plan" / expected).read_text()


def test_the_plan_summary_holds_what_bcg_plan_shows():
    job = load_job(DATA / "plan" / "levers.yaml")
    s = summary(job)
    assert (s.images, s.unique_images, s.lora_swaps, s.levered) == (12, 12, 2, True)
    assert [r.label for r in s.lora_sets] == ["none", "mei 0.5", "mei 0.3"] and s.disk_bytes == 1671168
    assert len(s.warnings) == 1 and "CLIP reads 77" in s.warnings[0] and "DeepCache is off" in s.note
    assert s.to_json()["buckets"] == [r.to_json() for r in s.buckets]
    assert 0 < s.flops_saved < 1 and summary(as_draft(job)).note is None  # a draft's ControlNet ends: DeepCache after


def _aliased_prompt_job(tmp_path, shots: int, prompt_kb: int = 900):
    """A job whose one long prompt (about `prompt_kb` KB of words) every shot reuses through a YAML alias."""
    words = " ".join(f"detail{i % 5000}" for i in range(prompt_kb * 1000 // 11))
    lines = ["version: 1", "model: tiny", "defaults: {steps: 2, size: 64x64}", "shots:",
             f"  - id: s0\n    prompt: &long \"{words}\""]
    lines += [f"  - id: s{i}\n    prompt: *long" for i in range(1, shots)]
    return write_job(tmp_path, "\n".join(lines) + "\n")


def test_a_prompt_many_shots_share_is_tokenized_once(tmp_path, monkeypatch):
    from storyboard_cli.job import prompts

    calls = []
    monkeypatch.setattr(prompts, "dropped_text", lambda text, tokenizer: calls.append(len(text)) or (900, "b c"))
    s = summary(load_job(_aliased_prompt_job(tmp_path, 200, prompt_kb=9)))
    assert len(calls) == 1 and len(s.warnings) == 200  # still said for every shot it cuts
    assert s.warnings[199] == ("shot 's199' (line 403): the prompt is 900 tokens, CLIP reads 77; dropped: \"b c\"")


def test_a_900_kb_prompt_reused_by_200_shots_plans_in_seconds(tmp_path):
    import time

    path = _aliased_prompt_job(tmp_path, 200)
    cpu = time.process_time()
    result = CliRunner().invoke(app, ["plan", str(path)])
    cpu = time.process_time() - cpu
    assert result.exit_code == 0, result.output
    assert result.output.count("the prompt is") == 200
    assert cpu < 20, cpu  # this process's own time: 2.4 s a shot before (the prompt tokenized ~18 times per shot)
