"""The loader: the tiny preset on disk through the folder path, and clean errors for bad weights."""

import pytest
import torch
from typer.testing import CliRunner

from conftest import write_job
from storyboard_cli.cli import app
from storyboard_cli.errors import ModelError
from storyboard_cli.models import tiny
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.models.tiny import TINY_VERSION, tiny_folder


def test_tiny_preset_is_a_diffusers_folder_loaded_by_from_pretrained(tiny_cpu):
    folder = tiny_folder()
    for part in ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler",
                 "controlnet"):
        assert (folder / part).is_dir(), part
    assert (folder / "model_index.json").is_file()
    by_path = load_sdxl(str(folder), str(folder / "controlnet"), "cpu", torch.float32)
    for a, b in zip(by_path.unet.parameters(), tiny_cpu.unet.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(by_path.controlnets) == 1
    assert by_path.tokenizers[0]("a castle").input_ids == tiny_cpu.tokenizers[0]("a castle").input_ids


def test_tiny_build_is_deterministic(tmp_path, monkeypatch, tiny_cpu):
    monkeypatch.setenv("BCG_CACHE", str(tmp_path))
    again = load_sdxl("tiny", None, "cpu", torch.float32)
    for a, b in zip(again.unet.parameters(), tiny_cpu.unet.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_tiny_preset_appears_in_the_cache_whole_or_not_at_all(tmp_path, monkeypatch):
    """Processes share the cache (torchrun's workers, xdist's): the preset is written beside its folder and renamed
    into place, so no reader sees it half-written, and a builder that loses the race leaves nothing behind."""
    monkeypatch.setenv("BCG_CACHE", str(tmp_path))
    folder = tmp_path / TINY_VERSION

    def build(into, by: str) -> None:
        (into / "model_index.json").write_text(by)
        assert not folder.exists()  # half-written: not at its path
        (into / "controlnet").mkdir()

    def loser(into) -> None:  # another process builds and renames while this one writes
        build(into, "loser")
        monkeypatch.setattr(tiny, "_build", lambda theirs: build(theirs, "winner"))
        assert tiny_folder() == folder and (folder / "model_index.json").read_text() == "winner"

    monkeypatch.setattr(tiny, "_build", loser)
    assert tiny_folder() == folder and (folder / "model_index.json").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [TINY_VERSION]


@pytest.mark.parametrize("model,message", [
    ("./missing/folder", "no such file or folder"),
    ("broken.safetensors", "cannot load model"),
    ("emptydir", "not a diffusers SDXL folder"),
    ("someone/not-on-this-machine", "not in the local hub cache"),
])
def test_bad_weights_give_one_clean_line(job_dir, tmp_path, monkeypatch, model, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (job_dir / "broken.safetensors").write_bytes(b"not a checkpoint")
    (job_dir / "emptydir").mkdir()
    monkeypatch.chdir(job_dir)
    path = write_job(job_dir, f"version: 1\nmodel: {model}\nshots:\n  - {{id: a, prompt: x, steps: 2, size: 64x64}}\n")
    result = CliRunner().invoke(app, ["render", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output


def test_a_missing_controlnet_is_a_model_error_and_exits_2(job_dir, tmp_path):
    with pytest.raises(ModelError, match="controlnet: no such file or folder"):
        load_sdxl("tiny", "./no/such/controlnet", "cpu", torch.float32)
    path = write_job(job_dir, "version: 1\nmodel: tiny\ncontrolnet: ./no/such/controlnet\nshots:\n"
                              "  - {id: a, prompt: x, steps: 2, size: 64x64, control: {image: control/hero_pose.png, "
                              "scale: 1.0}}\n")
    result = CliRunner().invoke(app, ["render", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "job.yaml:3 field 'controlnet': no such file or folder" in result.output, \
        result.output
    assert len(result.output.strip().splitlines()) == 1


def test_packaged_sdxl_configs_and_real_clip_tokenizer():
    """What single files and sdxl-random are built from: SDXL-base shapes and CLIP's own BPE."""
    from diffusers import ControlNetModel, UNet2DConditionModel
    from transformers import CLIPTokenizer

    from storyboard_cli.models.loader import sdxl_config_folder

    folder = sdxl_config_folder()
    tok = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    assert len(tok) == 49408
    assert tok("a photograph of an astronaut riding a horse").input_ids == [
        49406, 320, 8853, 539, 550, 18376, 6765, 320, 4558, 49407]
    assert CLIPTokenizer.from_pretrained(folder / "tokenizer_2").pad_token == "!"
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        controlnet = ControlNetModel.from_unet(unet, load_weights_from_unet=False)
    assert abs(sum(p.numel() for p in unet.parameters()) / 1e9 - 2.567) < 0.01
    assert 1.2 < sum(p.numel() for p in controlnet.parameters()) / 1e9 < 1.3


def test_single_safetensors_file_loads_through_from_single_file(tiny_cpu, tmp_path, monkeypatch):
    """The tiny preset written as one original-layout checkpoint comes back weight for weight.

    The packaged configs describe SDXL-base; for the tiny file the loader is pointed at the tiny
    preset's configs instead, so the same from_single_file path runs on a model this machine can hold."""
    from ldm_format import save_single_file

    from storyboard_cli.models import loader

    path = tmp_path / "tiny-sdxl.safetensors"
    save_single_file(tiny_cpu, path)
    monkeypatch.setattr(loader, "sdxl_config_folder", tiny_folder)
    single = load_sdxl(str(path), None, "cpu", torch.float32)
    for name in ("unet", "vae"):
        want = getattr(tiny_cpu, name).state_dict()
        got = getattr(single, name).state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), f"{name}.{k}"
    for a, b in zip(single.text_encoders, tiny_cpu.text_encoders, strict=True):
        want, got = b.state_dict(), a.state_dict()
        for k in want:
            if "position_ids" not in k:
                assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("env", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_cuda_allocator_gets_expandable_segments_unless_the_user_set_it(monkeypatch, env):
    from storyboard_cli.models import loader

    for name in loader.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv(env, "max_split_size_mb:256")
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    got = loader.cuda_allocator()
    assert calls == ([] if env else ["expandable_segments:True"])
    assert got == ("max_split_size_mb:256" if env else "expandable_segments:True")
