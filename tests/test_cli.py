"""The command line: exit codes, one-line errors, no tracebacks (typer.testing.CliRunner)."""

import json
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
