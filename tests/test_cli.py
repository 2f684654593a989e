"""The command line: exit codes, one-line errors, no tracebacks (typer.testing.CliRunner)."""

import json
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import DATA, ROOT, write_job
from storyboard_cli.cli import app

runner = CliRunner()
BAD = sorted((DATA / "bad_jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
@pytest.mark.parametrize("command", ["plan", "render"])
def test_bad_job_exit_2_one_line_no_traceback(path, command):
    result = runner.invoke(app, [command, str(path)])
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {path}:")
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def test_plan_prints_the_bucket_table():
    result = runner.invoke(app, ["plan", str(ROOT / "jobs" / "episode1.yaml")])
    assert result.exit_code == 0, result.output
    assert "320x192" in result.output and "total" in result.output and "UNet rows" in result.output


def test_plan_json():
    result = runner.invoke(app, ["plan", str(ROOT / "jobs" / "episode1.yaml"), "--json"])
    data = json.loads(result.stdout)
    assert data["images"] == 23 and sum(b["images"] for b in data["buckets"]) == 23
    assert all(b["rows"] == 2 * sum(b["batches"]) for b in data["buckets"])


def test_plan_loads_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv("BCG_CACHE", str(tmp_path / "empty-cache"))
    assert runner.invoke(app, ["plan", str(ROOT / "jobs" / "bench.yaml")]).exit_code == 0
    assert not (tmp_path / "empty-cache").exists()


def test_render_json_summary_and_exit_codes(job_dir, tmp_path):
    path = write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64, candidates: 2}\n")
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["status"] == "done" and summary["images_rendered"] == 2 and summary["engine"] == "eager"
    again = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o"), "--json"])
    assert json.loads(again.stdout)["images_skipped"] == 2


@pytest.mark.parametrize("args,message", [
    (["--device", "tpu"], "unknown device"),
    (["--dtype", "fp8"], "unknown dtype"),
    (["--device", "cpu", "--dtype", "fp16"], "not supported on the CPU"),
    (["--device", "cpu", "--engine", "graph"], "needs a CUDA device"),
    (["--device", "cpu", "--engine", "warp"], "unknown engine"),
])
def test_bad_options_exit_2(job_dir, tmp_path, args, message):
    path = write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_missing_model_folder_is_a_clean_error(job_dir, tmp_path):
    path = write_job(job_dir, "version: 1\nmodel: ./no/such/model\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no such file or folder" in result.output
    assert not list((tmp_path / "o").rglob("*.png"))


def test_capture_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    listed = runner.invoke(app, ["capture", str(ROOT / "jobs" / "episode1.yaml")])
    assert listed.exit_code == 0 and "8x320x192" in listed.output
    warm = runner.invoke(app, ["capture", "--warm", "--model", "tiny"])
    assert warm.exit_code == 2 and "needs a CUDA device" in warm.output


def test_capture_times_the_eager_step_only_when_asked(monkeypatch):
    """`bcg capture --warm` captures, checks and times the graphs; the uncompiled step's timing beside each (the
    speedup column) is `--eager`'s: a warm-up of a copied cache does not wait for it."""
    from storyboard_cli.run import capture as capturing

    asked = []

    def fake(**kw):
        asked.append(kw["eager"])
        row = capturing.ShapeTiming("8x1024x1024 float16 compiled", "graph", "checked", 0.5, 100.0,
                                    282.0 if kw["eager"] else None, 200.0)
        return ["8x1024x1024"], [], [row]

    monkeypatch.setattr(capturing, "capture", fake)
    plain, timed = (runner.invoke(app, ["capture", "--warm", *extra], terminal_width=200)
                    for extra in ([], ["--eager"]))
    assert asked == [False, True] and plain.exit_code == timed.exit_code == 0
    assert "282.0" in timed.output and "1.41x" in timed.output
    assert "282.0" not in plain.output and "1.41x" not in plain.output and "200.0" in plain.output


def test_capture_lists_a_jobs_draft_loops():
    """`bcg capture JOB --draft` lists the draft render's loops on the job's shapes (its --warm captures, checks and
    times them); without a job it is refused."""
    job = str(ROOT / "jobs" / "bench.yaml")
    plain, draft = (runner.invoke(app, ["capture", job, *extra], terminal_width=200) for extra in ([], ["--draft"]))
    assert plain.exit_code == 0 and "draft loops" not in plain.output
    assert draft.exit_code == 0 and "8 draft loops on them:" in draft.output
    assert "8x1024x1024 16/30 guided, deepcache 10 full + 20 shallow b0" in draft.output
    assert "7x832x1216 +control 16/30 guided, deepcache 5 full + 9 shallow b0, ControlNet 16/30" in draft.output
    alone = runner.invoke(app, ["capture", "--draft"])
    assert alone.exit_code == 2 and "--draft needs a job" in alone.output


def test_version_and_flags_shown_as_flags():
    from storyboard_cli import __version__

    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"bcg {__version__}"
    help_text = runner.invoke(app, ["render", "--help"], terminal_width=200).output
    for flag in ("--force", "--retry-failed", "--json"):
        (line,) = [l for l in help_text.splitlines() if f" {flag} " in l]
        assert "<bool>" not in line, line
    assert "--compile" in help_text


def test_compile_on_without_cuda_is_bad_input(job_dir, tmp_path):
    path = write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o"), "--device", "cpu",
                                 "--compile", "on"])
    assert result.exit_code == 2 and "--compile on needs a CUDA device" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    listed = runner.invoke(app, ["capture", str(ROOT / "jobs" / "episode1.yaml"), "--device", "cpu",
                                 "--compile", "on"])
    assert listed.exit_code == 2 and "--compile on needs a CUDA device" in listed.output, listed.output


def test_python_dash_m_works_like_bcg():
    proc = subprocess.run([sys.executable, "-m", "storyboard_cli", "plan", str(DATA / "bad_jobs" / "unknown_sampler.yaml")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "did you mean 'euler'" in proc.stderr and "Traceback" not in proc.stderr


def test_failed_images_exit_3_and_are_listed(job_dir, tmp_path, monkeypatch):
    from storyboard_cli.engine.eager import EagerEngine

    real = EagerEngine.sample

    def poisoned(self, x, *args):
        latents = real(self, x, *args)
        latents[0] = float("inf")
        return latents

    monkeypatch.setattr(EagerEngine, "sample", poisoned)
    path = write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 3, result.output
    assert "failed: a/a_c0_s" in result.output and "NaN/inf" in result.output
    assert not list((tmp_path / "o").rglob("*.png"))


# --- the output folder, the console, progress (issue: artist-safe outputs) --------------------------

ONE = "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64, candidates: 2}\n"


def _one_error_line(result, code=2):
    assert result.exit_code == code, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_output_folder_under_a_regular_file(job_dir, tmp_path):
    path = write_job(job_dir, ONE)
    (tmp_path / "file").write_text("x")
    line = _one_error_line(runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "file" / "o")]))
    assert str(tmp_path / "file" / "o") in line and "is a file, not a folder" in line
    line = _one_error_line(runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "file")]))
    assert "exists and is not a folder" in line


@pytest.mark.parametrize("errno_name", ["EROFS", "EACCES"])
def test_read_only_output_folder(job_dir, tmp_path, monkeypatch, errno_name):
    """As the kernel answers for a read-only mount or a folder without write permission (simulated: the
    tests may run as root, for whom permissions do not apply)."""
    import errno
    import os

    import storyboard_cli.folder.lock as lock

    path = write_job(job_dir, ONE)
    out = tmp_path / "ro"
    out.mkdir()
    real_open = os.open

    def refusing(p, *a, **k):
        if str(p).startswith(str(out)):
            raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)), str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(lock.os, "open", refusing)
    line = _one_error_line(runner.invoke(app, ["render", str(path), "--out", str(out)]))
    assert f"output folder {out}: cannot write here" in line
    assert list(out.iterdir()) == []


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes into read-only folders")
def test_read_only_output_folder_for_real(job_dir, tmp_path):
    path = write_job(job_dir, ONE)
    out = tmp_path / "ro"
    out.mkdir(mode=0o555)
    assert "cannot write here" in _one_error_line(runner.invoke(app, ["render", str(path), "--out", str(out)]))
    assert "cannot write here" in _one_error_line(runner.invoke(app, ["render", str(path), "--out",
                                                                      str(out / "sub")]))


def test_disk_full_at_start_leaves_no_lock_file(job_dir, tmp_path, monkeypatch):
    import errno

    import storyboard_cli.folder.lock as lock

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock, "_write_all", full)
    path = write_job(job_dir, ONE)
    line = _one_error_line(runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o")]))
    assert f"output folder {tmp_path / 'o'}: No space left on device" in line
    assert not (tmp_path / "o" / ".bcg.lock").exists()


def test_markup_in_paths_is_printed_as_is(tmp_path):
    folder = tmp_path / "[wip] ep1 [/]"  # '/' inside: two folders, and '[/]' in every path printed
    folder.mkdir(parents=True)
    path = write_job(folder, "version: 1\nname: t\nmodel: tiny\noutput_dir: out [b]x[/b]\nshots:\n"
                             "  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    planned = runner.invoke(app, ["plan", str(path)])
    assert planned.exit_code == 0 and "out [b]x[/b]" in planned.output, planned.output
    out = folder / "o [/] [wip]"
    result = runner.invoke(app, ["render", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"-> {out}" in result.output
    bad = runner.invoke(app, ["plan", str(folder / "[red]missing[/].yaml")])
    assert bad.exit_code == 2 and "[red]missing[/].yaml" in bad.output, bad.output


def test_plan_checks_the_output_folder_and_the_model_path(job_dir, tmp_path):
    (job_dir / "file").write_text("x")
    path = write_job(job_dir, f"version: 1\nmodel: tiny\noutput_dir: {job_dir}/file/out\nshots:\n"
                              "  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    assert "is a file, not a folder" in _one_error_line(runner.invoke(app, ["plan", str(path)]))
    path = write_job(job_dir, "version: 1\nmodel: ./no/such/model.safetensors\nshots:\n"
                              "  - {id: a, prompt: x, steps: 2, size: 64x64}\n")
    assert "no such file or folder" in _one_error_line(runner.invoke(app, ["plan", str(path)]))


def test_unknown_engine_is_refused_when_nothing_is_pending(job_dir, tmp_path):
    path = write_job(job_dir, ONE)
    assert runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o")]).exit_code == 0
    line = _one_error_line(runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o"), "--engine", "foo"]))
    assert "unknown engine 'foo'" in line


@pytest.mark.parametrize("buckets", ["0,-1", "0", "2,x", "", "65"])
def test_capture_rejects_bad_bucket_sizes(buckets):
    line = _one_error_line(runner.invoke(app, ["capture", "--buckets", buckets]))
    assert "--buckets" in line


def test_an_error_report_records_the_error(job_dir, tmp_path, monkeypatch):
    from storyboard_cli.engine.eager import EagerEngine

    def buggy(self, x, *args):
        raise TypeError("simulated bug")

    monkeypatch.setattr(EagerEngine, "sample", buggy)
    path = write_job(job_dir, ONE)
    runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o")])
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["status"] == "error" and report["error"] == "TypeError: simulated bug"
    assert "(TypeError: simulated bug)" in (tmp_path / "o" / "report.md").read_text()


def test_progress_lines_when_stderr_is_not_a_terminal(job_dir, tmp_path):
    path = write_job(job_dir, ONE.replace("candidates: 2", "candidates: 3").replace("model: tiny",
                                                                                  "model: tiny\nbuckets: [1]"))
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o")])
    lines = [l for l in result.output.splitlines() if l.startswith("bcg: ")]
    assert [l.split(",")[0] for l in lines] == ["bcg: 1/3 images", "bcg: 2/3 images", "bcg: 3/3 images"], result.output
    assert all(" images/s, ETA " in l for l in lines)
    quiet = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "q"), "--quiet"])
    assert quiet.exit_code == 0 and "bcg: " not in quiet.output


def test_shot_option_is_repeatable_and_takes_globs(job_dir, tmp_path):
    path = write_job(job_dir, "version: 1\nmodel: tiny\ndefaults: {steps: 2, size: 64x64}\nshots:\n"
                              "  - {id: ep1_a, prompt: x}\n  - {id: ep1_b, prompt: y}\n  - {id: ep2_a, prompt: z}\n")
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "o"), "--shot", "ep1_*",
                                 "--shot", "ep2_a", "--json"])
    assert json.loads(result.stdout)["images_rendered"] == 3
    result = runner.invoke(app, ["render", str(path), "--out", str(tmp_path / "p"), "--shot", "ep1_b", "--json"])
    assert json.loads(result.stdout)["images_rendered"] == 1 and not (tmp_path / "p" / "ep1_a").exists()
    assert "--shot ep3*: no shot" in _one_error_line(runner.invoke(app, ["render", str(path), "--shot", "ep3*"]))


# --- the contact sheet and picks ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered_once(tmp_path_factory):
    """One render for the module; each test gets a copy of its folder (they pick, reroll, rebuild)."""
    folder = tmp_path_factory.mktemp("rendered")
    path = write_job(folder, "version: 1\nmodel: tiny\ndefaults: {steps: 2, size: 64x64}\nshots:\n"
                             "  - {id: a, prompt: x, seed: 1, candidates: 2}\n  - {id: b, prompt: y, seed: 5}\n")
    out = folder / "o"
    assert runner.invoke(app, ["render", str(path), "--out", str(out)]).exit_code == 0
    return path, out


@pytest.fixture
def rendered(rendered_once, tmp_path):
    path, out = rendered_once
    copy = tmp_path / "o"
    shutil.copytree(out, copy)
    return path, copy


def test_sheet_and_pick_commands(rendered, tmp_path):
    path, out = rendered
    (out / "index.html").unlink()
    result = runner.invoke(app, ["sheet", str(out), "--job", str(path)])
    assert result.exit_code == 0 and (out / "index.html").is_file(), result.output
    picks = write_job(tmp_path, "picks:\n  a: a/a_c1_s2.png\n  b: b/b_c0_s5.png\n", "picks.yaml")
    result = runner.invoke(app, ["pick", str(out), str(picks), "--job", str(path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "selects").iterdir() if p.suffix == ".png") == ["001_a.png", "002_b.png"]
    assert (out / "selects" / "001_a.png").read_bytes() == (out / "a/a_c1_s2.png").read_bytes()


@pytest.mark.parametrize("text,message", [
    ("picks:\n  zz: a/a_c0_s1.png\n", "zz"),
    ("picks:\n  a: a/a_c7_s8.png\n", "a_c7_s8.png"),
    ("picks:\n  a: a/a_c0_s1.png\n  a: a/a_c1_s2.png\n", "'a'"),
])
def test_bad_picks_are_one_line_errors(rendered, tmp_path, text, message):
    path, out = rendered
    picks = write_job(tmp_path, text, "picks.yaml")
    for args in (["pick", str(out), str(picks), "--job", str(path)],
                 ["render", str(path), "--out", str(out), "--reroll", str(picks)]):
        line = _one_error_line(runner.invoke(app, args))
        assert str(picks) in line and message in line, line
    assert not (out / "selects").exists()


def test_reroll_renders_new_candidates_and_keeps_every_image(rendered, tmp_path):
    path, out = rendered
    before = {p: p.read_bytes() for p in out.rglob("*.png")}
    picks = write_job(tmp_path, "picks:\n  b: b/b_c0_s5.png\nreroll: [a]\n", "picks.yaml")
    result = runner.invoke(app, ["render", str(path), "--out", str(out), "--reroll", str(picks), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["images_rendered"] == 2
    assert all(p.read_bytes() == data for p, data in before.items())
    assert sorted(p.name for p in (out / "a").glob("*.png")) == ["a_c0_s1.png", "a_c1_s2.png", "a_c2_s3.png",
                                                                "a_c3_s4.png"]


def test_compile_progress_off_a_terminal_is_one_line_per_module_state(capsys):
    from storyboard_cli.cli_progress import compile_progress
    from storyboard_cli.engine.kernels.builds import CompileEvent

    with compile_progress(quiet=False) as on_event:
        on_event(CompileEvent("unet 1024x1024", "compiling", 1.0, 300.0))
        on_event(CompileEvent("controlnet 1024x1024", "compiling", 1.0, 200.0))
        on_event(CompileEvent("unet 1024x1024", "compiling", 2.0, 300.0))
        on_event("compiled kernels for unet 832x1216 not used: unet-x.pt2: it does not load on this machine")
        on_event(CompileEvent("unet 1024x1024", "done", 290.0, 300.0))
        on_event(CompileEvent("controlnet 1024x1024", "failed", 100.0, 200.0, "the compiler said no"))
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["bcg: compiling unet 1024x1024 (about 300 s)",
                     "bcg: compiling controlnet 1024x1024 (about 200 s)",
                     "compiled kernels for unet 832x1216 not used: unet-x.pt2: it does not load on this machine",
                     "bcg: unet 1024x1024 done in 290 s",
                     "bcg: controlnet 1024x1024 failed in 100 s the compiler said no"]


def test_the_same_reroll_request_gives_the_same_candidates_a_new_round_new_ones(rendered, tmp_path):
    path, out = rendered
    picks = write_job(tmp_path, "reroll: [a]\n", "picks.yaml")
    args = ["render", str(path), "--out", str(out), "--reroll", str(picks), "--json"]
    rendered_by = [json.loads(runner.invoke(app, args).stdout)["images_rendered"] for _ in range(3)]
    assert rendered_by == [2, 0, 0]  # a retried reroll step finds its candidates done
    names = sorted(p.name for p in (out / "a").glob("*.png"))
    assert names == ["a_c0_s1.png", "a_c1_s2.png", "a_c2_s3.png", "a_c3_s4.png"]
    (picks).write_text("reroll: [a]\nround: 2\n")
    assert json.loads(runner.invoke(app, args).stdout)["images_rendered"] == 2
    assert sorted(p.name for p in (out / "a").glob("*.png"))[4:] == ["a_c4_s5.png", "a_c5_s6.png"]
    (out / "a" / "a_c5_s6.png").unlink()  # a killed round resumed: the same candidates, only the missing one
    assert json.loads(runner.invoke(app, args).stdout)["images_rendered"] == 1
    assert len(list((out / "a").glob("*.png"))) == 6


def test_tilde_is_expanded_in_cli_paths_and_job_fields(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    (home / "ctl").mkdir(parents=True)
    cwd.mkdir()
    shutil.copy(ROOT / "jobs" / "control" / "hero_pose.png", home / "ctl" / "pose.png")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    write_job(home, "version: 1\nmodel: tiny\ncontrolnet: tiny\noutput_dir: ~/from-job\nbuckets: [1]\nshots:\n"
                    "  - {id: a, prompt: x, steps: 2, size: 64x64, control: {image: ~/ctl/pose.png}}\n")
    result = runner.invoke(app, ["render", "~/job.yaml", "--out=~/renders", "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, result.output
    assert len(list((home / "renders" / "a").glob("*.png"))) == 1
    assert not (cwd / "~").exists()
    assert runner.invoke(app, ["sheet", "~/renders", "--job", "~/job.yaml"]).exit_code == 0
    assert runner.invoke(app, ["plan", "~/job.yaml", "--json"]).stdout.count(str(home / "from-job")) == 1


@pytest.fixture
def read_only(rendered):
    """The rendered folder, read-only for real: a read-only tmpfs where root may mount one, else chmod."""
    import os

    path, out = rendered
    if os.geteuid() != 0:
        for d in [out, *(p for p in out.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
        yield path, out
        for d in [out, *(p for p in out.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
        return
    mnt = out.parent / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        shutil.copytree(out, mnt, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield path, mnt
    finally:
        subprocess.run(["umount", str(mnt)])


def test_sheet_and_pick_on_a_read_only_folder_are_one_line_exit_2(read_only, tmp_path):
    path, out = read_only
    for args in (["sheet", str(out)], ["pick", str(out), str(write_job(tmp_path, "picks:\n  b: b/b_c0_s5.png\n",
                                                                      "picks.yaml"))]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert _one_error_line(result).startswith(f"error: output folder {out}: cannot write here"), result.output


@pytest.mark.parametrize("model, hint", [("Tiny", "tiny"), ("sdxl_random", "sdxl-random")])
def test_a_misspelt_preset_gets_a_did_you_mean(tmp_path, model, hint):
    path = write_job(tmp_path, f"version: 1\nmodel: {model}\nshots:\n  - {{id: a, prompt: x}}\n")
    line = _one_error_line(runner.invoke(app, ["plan", str(path)]))
    assert line == f"error: {path}:2 field 'model': unknown model '{model}'; did you mean '{hint}'?"


def test_plan_counts_in_the_singular_where_there_is_one(tmp_path):
    lora = ROOT / "jobs" / "loras" / "mei.safetensors"
    path = write_job(tmp_path, f"version: 1\nmodel: tiny\nloras: {{mei: {lora}}}\n"
                               "shots:\n  - {id: a, prompt: x, lora: {mei: 0.5}}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    assert ": 1 shot, 1 image (1 distinct)" in result.output
    assert "mei 0.5 (1 image); 1 swap" in result.output


def test_a_shot_run_counts_only_its_shots_as_skipped(job_dir, tmp_path):
    path = write_job(job_dir, "version: 1\nmodel: tiny\ndefaults: {steps: 2, size: 64x64}\nshots:\n"
                              "  - {id: a, prompt: x, candidates: 2}\n  - {id: b, prompt: y, candidates: 3}\n")
    out = str(tmp_path / "o")
    assert runner.invoke(app, ["render", str(path), "--out", out]).exit_code == 0
    summary = json.loads(runner.invoke(app, ["render", str(path), "--out", out, "--shot", "a", "--json"]).stdout)
    assert (summary["images_rendered"], summary["images_skipped"]) == (0, 2)


def test_sheet_of_an_empty_folder_or_with_another_job_says_so(rendered, tmp_path):
    path, out = rendered
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["sheet", str(empty)])
    assert result.exit_code == 0 and f"warning: {empty}: no image of a render is here; is it a render's output " \
                                      "folder?" in result.output
    other = write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - {id: zz, prompt: x, candidates: 49}\n",
                      "other.yaml")
    result = runner.invoke(app, ["sheet", str(out), "--job", str(other)])
    assert result.exit_code == 0 and f"is {other} the job that rendered this folder?" in result.output
    assert "warning" not in runner.invoke(app, ["sheet", str(out)]).output


def test_plan_estimates_the_disk_and_warns_when_it_will_not_fit(tmp_path, monkeypatch):
    from storyboard_cli.job import plan

    shots = "".join(f"  - {{id: s{i}, prompt: x, size: 1024x1024, candidates: 50}}\n" for i in range(20))
    path = write_job(tmp_path, f"version: 1\nmodel: tiny\nshots:\n{shots}")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0 and "(about 1.6 GB of PNGs)" in result.output and "warning" not in result.output
    assert json.loads(runner.invoke(app, ["plan", str(path), "--json"]).stdout)["disk_bytes_estimate"] == 1572864000
    monkeypatch.setattr(plan, "free_bytes", lambda folder: 10**9)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0
    assert "warning: the images need about 1.6 GB on disk, " in result.output and "has 1.0 GB free" in result.output
