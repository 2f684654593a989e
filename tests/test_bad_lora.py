"""A LoRA that does not fit the model: what the model's config tells is found at `plan`; what only the
loaded model tells fails the shots that use that LoRA (exit 3, named in the report), never the others."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from conftest import ROOT, write_job
from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya, save_peft
from storyboard_cli.cli import app
from storyboard_cli.job.lora_files import SDXL_CONFIGS, lora_problem

MEI = ROOT / "jobs" / "loras" / "mei.safetensors"
FC1 = "lora_te1_text_model_encoder_layers_{}_mlp_fc1"
CONV1 = "lora_unet_input_blocks_1_0_in_layers_2"  # down_blocks.0.resnets.0.conv1: [32, 32, 3, 3] in tiny
TO_K = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k"  # [64, 80]


def _kohya(path, key, down, up):
    save_file({f"{key}.lora_down.weight": torch.zeros(down), f"{key}.lora_up.weight": torch.zeros(up)}, str(path))
    return path


def _peft(path, key, down, up):
    save_file({f"{key}.lora_A.weight": torch.zeros(down), f"{key}.lora_B.weight": torch.zeros(up)}, str(path))
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


@pytest.mark.parametrize("save, key, down, up, message", [
    (_kohya, CONV1, (4, 33, 3, 3), (32, 4, 1, 1), f"{CONV1}: its down factor is 33 wide, this model's layer 32"),
    (_kohya, CONV1, (4, 32, 1, 1), (32, 4, 1, 1),
     f"{CONV1}: its down factor is [4, 32, 1, 1], this model's layer is a 3x3 convolution"),
    (_kohya, CONV1, (4, 32, 3, 3), (32, 4, 3, 3),
     f"{CONV1}: its up factor is [32, 4, 3, 3], only [out, rank] or [out, rank, 1, 1] is read"),
    (_peft, TO_K, (4, 80), (65, 4), f"{TO_K}: its up factor is 65 wide, this model's layer 64"),
    (_kohya, "lora_unet_down_blocks_1_attentions_1_proj_in", (4, 64), (64, 4),
     "lora_unet_down_blocks_1_attentions_1_proj_in: this model's UNet has no such layer"),
    (_kohya, "lora_unet_input_blocks_4_1_proj_in", (4, 64), (64, 4),
     "lora_unet_input_blocks_4_1_proj_in: this model's UNet has no such layer"),
], ids=["wide-down", "down-kernel", "up-kernel", "wide-up", "no-layer", "no-sgm-layer"])
def test_plan_finds_a_unet_layer_that_does_not_fit(tmp_path, save, key, down, up, message):
    lora = save(tmp_path / "bad.safetensors", key, down, up)
    job = _job(tmp_path, lora)
    line = f"error: {job}:6 field 'loras.bad': bad.safetensors: {message}"  # the file, the line, the field
    result = CliRunner().invoke(app, ["plan", str(job)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == line
    # render refuses it the same way, before any model loads: not one image of the job is rendered
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"])
    assert result.exit_code == 2 and result.output.strip() == line, result.output
    assert not list(out.rglob("*.png"))


def test_fitting_unet_loras_pass_plan_and_render(tmp_path, tiny_cpu):
    """LoRAs on every linear layer of the transformer blocks and every resnet convolution (LoCon), in Kohya's
    SGM naming and in diffusers' PEFT naming, from the real tiny UNet's modules."""
    factors = random_factors(tiny_cpu, seed=3, rank=2, text_encoders=False, convs=True)
    kohya = save_kohya(tmp_path / "locon.safetensors", factors, tiny_cpu.unet.config.layers_per_block, alpha=2.0)
    peft = save_peft(tmp_path / "peft.safetensors", factors)
    assert lora_problem(kohya, "tiny") is None and lora_problem(peft, "tiny") is None
    job = write_job(tmp_path, f"version: 1\nmodel: tiny\nbuckets: [1]\nloras:\n  locon: {kohya}\n  peft: {peft}\n"
                              "shots:\n  - {id: a, prompt: a boat <lora:locon:0.8>, steps: 2, size: 64x64}\n"
                              "  - {id: b, prompt: a hut <lora:peft:0.5>, steps: 2, size: 64x64}\n")
    result = CliRunner().invoke(app, ["plan", str(job)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, result.output
    assert sorted(p.relative_to(out).parts[0] for p in out.rglob("*.png")) == ["a", "b"]


def _sdxl_lora(path, wrong: str | None = None):
    """A rank-1 Kohya LoRA (SGM naming) on every linear and convolution layer of the real SDXL-base UNet,
    built on the meta device; `wrong`: one layer whose down factor is one wider than the layer."""
    from diffusers import UNet2DConditionModel

    from storyboard_cli.job.unet_layers import sgm_name

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SDXL_CONFIGS / "unet"))
    state = {}
    for name, m in unet.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            out, inp, *kernel = m.weight.shape
            key = "lora_unet_" + sgm_name(name, unet.config.layers_per_block).replace(".", "_")
            state[f"{key}.lora_down.weight"] = torch.zeros(1, inp + (name == wrong), *kernel, dtype=torch.float16)
            state[f"{key}.lora_up.weight"] = torch.zeros(out, 1, *(1 for _ in kernel), dtype=torch.float16)
    save_file(state, str(path))
    return path


def test_an_sdxl_unet_lora_is_checked_against_the_shipped_config(tmp_path):
    """sdxl-random, a single file and a diffusers folder: the UNet config the loader builds each from."""
    folder = tmp_path / "model"
    shutil.copytree(SDXL_CONFIGS, folder)
    single = tmp_path / "model.safetensors"
    single.write_bytes(b"")
    good = _sdxl_lora(tmp_path / "good.safetensors")
    bad = _sdxl_lora(tmp_path / "bad.safetensors", wrong="mid_block.attentions.0.transformer_blocks.9.ff.net.2")
    for model in ("sdxl-random", str(single), str(folder)):
        assert lora_problem(good, model) is None
        assert lora_problem(bad, model) == ("bad.safetensors: lora_unet_middle_block_1_transformer_blocks_9_ff_net_2: "
                                            "its down factor is 5121 wide, this model's layer 5120")


def test_a_fitting_text_encoder_lora_passes_plan(tmp_path):
    lora = _kohya(tmp_path / "bad.safetensors", FC1.format(2), (4, 32), (37, 4))
    assert CliRunner().invoke(app, ["plan", str(_job(tmp_path, lora))]).exit_code == 0


def test_a_lora_the_loaded_model_rejects_fails_only_its_shots(tmp_path):
    # factors of ranks 4 and 5: the model's config says nothing against it, the loaded layer does
    lora = _kohya(tmp_path / "bad.safetensors", "lora_unet_down_blocks_1_attentions_0_proj_in", (4, 64), (64, 5))
    job = _job(tmp_path, lora)
    assert CliRunner().invoke(app, ["plan", str(job)]).exit_code == 0
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["render", str(job), "--out", str(out), "--device", "cpu", "--quiet"])
    assert result.exit_code == 3, result.output
    pngs = sorted(p.relative_to(out).parts[0] for p in out.rglob("*.png"))
    assert pngs == ["mei", "plain"]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and sorted(f["shot"] for f in report["failures"]) == ["bad", "bad"]
    assert all("LoRA 'bad' (bad.safetensors)" in f["reason"] and "rank 5, its down factor 4" in f["reason"]
               for f in report["failures"])
    assert any("the shots that use LoRA 'bad' fail" in n for n in report["notes"])
