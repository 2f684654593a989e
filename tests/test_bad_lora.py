"""A LoRA that does not fit the model: what the model's config tells is found at `plan`; what only the
loaded model tells fails the shots that use that LoRA (exit 3, named in the report), never the others."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.cli import app

MEI = ROOT / "jobs" / "loras" / "mei.safetensors"
FC1 = "lora_te1_text_model_encoder_layers_{}_mlp_fc1"


def _kohya(path, key, down, up):
    save_file({f"{key}.lora_down.weight": torch.zeros(down), f"{key}.lora_up.weight": torch.zeros(up)}, str(path))
    return path


def _job(tmp_path, lora):
    return write_job(tmp_path, f"version: 1\nmodel: tiny\nbuckets: [1]\nloras:\n  mei: {MEI}\n  bad: {lora}\n"
                               "shots:\n  - {id: plain, prompt: a hut, steps: 2, size: 64x64}\n"
                               "  - {id: mei, prompt: a girl <lora:mei:0.8>, steps: 2, size: 64x64}\n"
                               "  - {id: bad, prompt: a boat <lora:bad:0.8>, steps: 2, size: 64x64, candidates: 2}\n")


@pytest.mark.parametrize("layer, down, up, message", [
    (0, (4, 33), (37, 4), "text_encoder layer 0 fc1: its down factor is 33 wide, this model's layer 32"),
    (0, (4, 32), (38, 4), "text_encoder layer 0 fc1: its up factor is 38 wide, this model's layer 37"),
    (7, (4, 32), (37, 4), "text_encoder layer 7 fc1: this model's text_encoder has 3 layers"),
])
def test_plan_finds_a_text_encoder_layer_that_does_not_fit(tmp_path, layer, down, up, message):
    lora = _kohya(tmp_path / "bad.safetensors", FC1.format(layer), down, up)
    result = CliRunner().invoke(app, ["plan", str(_job(tmp_path, lora))])
    assert result.exit_code == 2, result.output
    assert f"field 'loras.bad': bad.safetensors: {message}" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_fitting_text_encoder_lora_passes_plan(tmp_path):
    lora = _kohya(tmp_path / "bad.safetensors", FC1.format(2), (4, 32), (37, 4))
    assert CliRunner().invoke(app, ["plan", str(_job(tmp_path, lora))]).exit_code == 0


def test_a_lora_the_loaded_model_rejects_fails_only_its_shots(tmp_path):
    lora = _kohya(tmp_path / "bad.safetensors", "lora_unet_down_blocks_1_attentions_0_proj_in", (4, 999), (64, 4))
    job = _job(tmp_path, lora)
    assert CliRunner().invoke(app, ["plan", str(job)]).exit_code == 0  # only the loaded UNet tells
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"])
    assert result.exit_code == 3, result.output
    pngs = sorted(p.relative_to(out).parts[0] for p in out.rglob("*.png"))
    assert pngs == ["mei", "plain"]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and sorted(f["shot"] for f in report["failures"]) == ["bad", "bad"]
    assert all("LoRA 'bad' (bad.safetensors)" in f["reason"] and "[64, 999]" in f["reason"]
               for f in report["failures"])
    assert any("the shots that use LoRA 'bad' fail" in n for n in report["notes"])
