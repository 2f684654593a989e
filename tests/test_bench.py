"""The bench harness runs end to end (quick mode: tiny model, CPU) so it cannot rot."""

import json

import pytest
from typer.testing import CliRunner

from conftest import ROOT
from storyboard_cli.cli import app

# the quick benches run in this process and start no server: an xdist group of their own, not the process
# tests' (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("bench")


@pytest.mark.slow
def test_bench_quick(tmp_path):
    result = CliRunner().invoke(app, ["bench", str(ROOT / "jobs" / "bench.yaml"), "--quick", "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (record,) = tmp_path.glob("*.json")
    rec = json.loads(record.read_text())
    assert rec["quick"] and rec["model"] == "tiny"
    assert rec["a_diffusers"]["images"] == rec["c_bcg_cold"]["images"] == rec["images"] > 0
    assert rec["ratios_vs_a"]["c_bcg_cold"] > 0
    md = (tmp_path / record.name.replace(".json", ".md")).read_text()
    assert "(a) diffusers pipeline loop" in md
    assert 0 < rec["launch_us"] < 1e4 and f"the host: {rec['launch_us']:.1f} µs per small op" in md
    (svg,) = tmp_path.glob("*-contenders.svg")  # the contenders' images/s as a chart, linked from the Markdown
    assert f"]({svg.name})" in md
    text = svg.read_text()
    assert text.startswith("<svg") and "(a) diffusers pipeline loop" in text and "(c) bcg render, cold" in text


def test_full_bench_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(app, ["bench", str(ROOT / "jobs" / "bench.yaml")])
    assert result.exit_code == 2 and "--quick" in result.output


@pytest.mark.slow
def test_bench_quick_lora_part(tmp_path):
    """3 synthetic LoRAs spread over the bench job: the job renders with them, swaps are timed."""
    result = CliRunner().invoke(app, ["bench", str(ROOT / "jobs" / "bench.yaml"), "--quick", "--parts", "lora",
                                      "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (record,) = tmp_path.glob("*.json")
    lo = json.loads(record.read_text())["lora"]
    assert lo["with"]["images"] == lo["without"]["images"] > 0 and lo["ratio"] > 0
    assert lo["swaps"]["swaps"] == 3 and lo["swaps"]["median_s"] > 0
    assert "LoRA job" in (tmp_path / record.name.replace(".json", ".md")).read_text()


@pytest.mark.slow
def test_bench_quick_draft_part(tmp_path):
    """The draft part end to end on tiny (what `benchmarks/gpu.sh draft` runs on a GPU): the loops side by side, the
    bench job with and without --draft, the drift of every draft against its full render."""
    result = CliRunner().invoke(app, ["bench", str(ROOT / "jobs" / "bench.yaml"), "--quick", "--parts", "draft",
                                      "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (record,) = tmp_path.glob("*.json")
    rec = json.loads(record.read_text())
    assert "errors" not in rec, rec.get("errors")
    steps = rec["draft_steps"]
    assert set(steps["ms_per_image_step"]) == {"full", "deepcache_3", "cfg_cutoff_0.5", "cfg_cutoff_0.7",
                                               "draft_preset"} and steps["guided_steps"]["cfg_cutoff_0.5"] == 4
    job = rec["draft_job"]
    assert job["full"]["images"] == job["draft"]["images"] == rec["images"] and job["ratio"] > 0
    assert len(job["drift"]) == rec["images"] and all(d["mad"] >= 0 for d in job["drift"])
    assert any(d["mad"] > 0 for d in job["drift"])  # the levers changed the pixels
    assert "Bench job with `--draft`" in (tmp_path / record.name.replace(".json", ".md")).read_text()


def test_the_draft_capture_groups_are_todays_keys_and_the_rest(tiny_cpu):
    """bench part draft_capture: today's group is the graphs a render without the draft levers replays (DeepCache's full
    step where a shape shares it), the rest is what draft mode adds; seconds, warm-ups and pool summed per group."""
    from types import SimpleNamespace

    from storyboard_cli.bench.draft import _groups
    from storyboard_cli.engine.graph.keys import GraphStats
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.steps import StepKind

    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(64, 64))
    write, read, cond = (runner.shape_key(2, 64, 64, False, k)
                         for k in (StepKind(True, "write"), StepKind(True, "read"), StepKind(False)))
    stats = {write: GraphStats(write, capture_s=0.5, warmup=True, warmup_s=0.3, pool_mb=100.0),
             read: GraphStats(read, capture_s=0.01, pool_mb=2.0), cond: GraphStats(cond, capture_s=0.1, warmup=True)}
    rec = _groups(SimpleNamespace(stats=stats), {write})
    assert rec["plain"] == {"graphs": 1, "warmups": 1, "capture_s": 0.5, "warmup_s": 0.3, "end_s": 0.0, "pool_mb": 100.0}
    assert rec["extra"]["graphs"] == 2 and rec["extra"]["warmups"] == 1 and rec["extra"]["pool_mb"] == 2.0
    assert abs(rec["capture_ratio"] - 0.11 / 0.5) < 1e-9 and rec["pool_ratio"] == 0.02


@pytest.mark.slow
def test_bench_quick_refine_part(tmp_path):
    """The refine part on tiny (what a GPU run measures at 8 x 1024x1024): bcg refine against diffusers'
    inpainting pipeline on the same picks, and the hires pass per pick once built."""
    result = CliRunner().invoke(app, ["bench", str(ROOT / "jobs" / "bench.yaml"), "--quick", "--parts", "refine",
                                      "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (record,) = tmp_path.glob("*.json")
    rec = json.loads(record.read_text())
    assert "errors" not in rec, rec.get("errors")
    r = rec["refine"]
    assert r["bcg_refine"]["images"] == r["diffusers_inpaint"]["images"] == r["work"]["picks"] == 2
    assert r["ratio"] > 0 and r["hires"]["s_per_pick"] > 0 and r["hires"]["size"] == "96x96"
    assert len(r["hires"]["rounds_s"]) == 2
