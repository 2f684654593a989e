"""LoRA: inspection without torch, reading through diffusers' converters, in-place application.

Parity is against diffusers' own PEFT path (load_lora_weights + set_adapters) on deep copies of the
same tiny models, through the same StableDiffusionXLPipeline loop: only the LoRA path differs.
"""

import copy
import hashlib
import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT
from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya, save_peft
from storyboard_cli.errors import ModelError
from storyboard_cli.job.lora_files import (LoraFileError, a1111_lora_hashes, architecture_mismatch, inspect_lora,
                                           lora_problem, lora_tags, split_lora_tags)
from storyboard_cli.models.lora import LoraApplier, read_lora, set_key

from helpers.reference import RTOL, diffusers_pipeline, rel_error

W, H, STEPS, GUIDANCE = 64, 64, 4, 6.5
PROMPT, NEGATIVE = "a lighthouse in a storm, ink drawing", "blurry"


@pytest.fixture(scope="module")
def files(lora_models, tmp_path_factory):
    """Two LoRAs in each format: A on the UNet + both text encoders, B on the UNet only (LoCon in Kohya)."""
    folder = tmp_path_factory.mktemp("loras")
    lpb = lora_models.unet.config.layers_per_block
    a = random_factors(lora_models, seed=1, rank=4, text_encoders=True)
    b = random_factors(lora_models, seed=2, rank=2, text_encoders=False, convs=True)
    return {
        ("kohya", "a"): save_kohya(folder / "kohya_a.safetensors", a, lpb, alpha=2.0),
        ("kohya", "b"): save_kohya(folder / "kohya_b.safetensors", b, lpb, alpha=2.0, conv_alpha=1.0),
        ("peft", "a"): save_peft(folder / "peft_a.safetensors", a),
        ("peft", "b"): save_peft(folder / "peft_b.safetensors", b, lora_alpha=3.0),
        "factors": {"a": a, "b": b},
    }


def _latents(pipe):
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(7),
                output_type="latent").images


def _reference(lora_models, loras):
    """diffusers' own path: PEFT adapters on a deep copy, weighted with set_adapters."""
    ref = copy.deepcopy(lora_models)
    pipe = diffusers_pipeline(ref)
    for name, (path, _) in loras.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(list(loras), [scale for _, scale in loras.values()])
    return _latents(pipe)


def _ours(lora_models, loras):
    applier = LoraApplier(lora_models)
    active = {name: (read_lora(name, path, lora_models.unet.config), scale) for name, (path, scale) in loras.items()}
    applier.apply(active)
    try:
        return _latents(diffusers_pipeline(lora_models))
    finally:
        applier.apply({})


@pytest.fixture(scope="module")
def base_latents(lora_models):
    return _latents(diffusers_pipeline(lora_models))


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
@pytest.mark.parametrize("which", ["a", "b", "a+b"], ids=["unet+te", "unet-only", "two-loras"])
def test_same_latents_as_diffusers(lora_models, files, base_latents, fmt, which):
    scales = {"a": 0.8, "b": -1.3}
    loras = {n: (files[(fmt, n)], scales[n]) for n in which.split("+")}
    want = _reference(lora_models, loras)
    got = _ours(lora_models, loras)
    assert rel_error(want, base_latents) > 50 * RTOL, "the LoRA must change the picture for this test to mean anything"
    err = rel_error(got, want)
    assert err < RTOL, f"{fmt} {which}: relative error {err:.2e}"


def test_layers_land_where_the_factors_were_made_for(lora_models, files):
    """Placement, independent of diffusers: W - W0 == scale * alpha/r * up @ down on every layer."""
    factors = files["factors"]["b"]  # rank 2, alpha 2 on linears, 1 on the LoCon convolutions
    applier = LoraApplier(lora_models)
    weights = read_lora("b", files[("kohya", "b")], lora_models.unet.config)
    before = {n: p.detach().clone() for n, p in lora_models.unet.named_parameters()}
    applier.apply({"b": (weights, 0.5)})
    try:
        for (component, module), (down, up) in factors.items():
            alpha = 1.0 if down.dim() == 4 else 2.0
            want = 0.5 * alpha / 2 * (up.flatten(1) @ down.flatten(1)).view(before[f"{module}.weight"].shape)
            got = lora_models.unet.get_submodule(module).weight - before[f"{module}.weight"]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=module)
        touched = {f"{m}.weight" for _, m in factors}
        for n, p in lora_models.unet.named_parameters():
            if n not in touched:
                assert torch.equal(p, before[n]), n
    finally:
        applier.apply({})


def _all_params(lora_models):
    return [(f"{c}.{n}", p) for c, root in (("unet", lora_models.unet), ("te1", lora_models.text_encoders[0]),
                                            ("te2", lora_models.text_encoders[1])) for n, p in root.named_parameters()]


def test_swaps_keep_storages_and_restore_w0_bit_exactly(lora_models, files):
    params = _all_params(lora_models)
    pointers = {n: p.data_ptr() for n, p in params}
    base = {n: p.detach().clone() for n, p in params}
    a = read_lora("a", files[("kohya", "a")], lora_models.unet.config)
    b = read_lora("b", files[("peft", "b")], lora_models.unet.config)
    applier = LoraApplier(lora_models)

    applier.apply({"a": (a, 1.0)})
    with_a = {n: p.detach().clone() for n, p in params}
    assert any(not torch.equal(with_a[n], base[n]) for n in base)
    for _ in range(20):  # no drift: every set is computed from W0
        applier.apply({"b": (b, 0.7)})
        applier.apply({"a": (a, 0.3), "b": (b, -1.0)})
        applier.apply({"a": (a, 1.0)})
    assert all(torch.equal(p, with_a[n]) for n, p in params)
    applier.apply({"b": (b, 0.7)})
    applier.apply({})
    for n, p in params:
        assert p.data_ptr() == pointers[n], f"{n} moved to another storage"
        assert torch.equal(p, base[n]), f"{n} is not W0 again"
    assert len(applier.swaps) == 63 and all(s.seconds >= 0 for s in applier.swaps)
    assert applier.apply({}) == 0.0 and len(applier.swaps) == 63, "the same set again is no swap"


def test_prompt_cache_key_only_names_text_encoder_loras(lora_models, files):
    a = read_lora("a", files[("kohya", "a")], lora_models.unet.config)
    b = read_lora("b", files[("kohya", "b")], lora_models.unet.config)
    assert a.text_encoders and not b.text_encoders
    active = {"a": (a, 0.5), "b": (b, 1.0)}
    assert [k[0] for k in set_key(active)] == ["a", "b"]
    assert [k[0] for k in set_key(active, text_only=True)] == ["a"]
    assert set_key({"a": (a, 0.0)}) == ()


def test_a_lora_for_other_layers_is_refused_by_name(lora_models, tmp_path):
    path = tmp_path / "wide.safetensors"
    save_file({"lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 999),
               "lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight": torch.zeros(64, 4)}, str(path))
    weights = read_lora("wide", path, lora_models.unet.config)
    with pytest.raises(ModelError, match=r"LoRA 'wide' \(wide.safetensors\): unet.down_blocks.1.attentions.0"
                                         r".proj_in is \[64, 64\] in this model, the LoRA makes \[64, 999\]"):
        LoraApplier(lora_models).register(weights)


# --- inspection (no torch needed) -------------------------------------------------------------


def _fake(path, shapes, metadata=None):
    """A LoRA-shaped safetensors file of zeros."""
    save_file({k: torch.zeros(s, dtype=torch.float16) for k, s in shapes.items()}, str(path), metadata=metadata)
    return path


def _sd15(tmp_path):
    k = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
    return _fake(tmp_path / "sd15.safetensors", {f"{k}.lora_down.weight": (4, 768), f"{k}.lora_up.weight": (640, 4),
                                                 "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down"
                                                 ".weight": (4, 768)})


def _sdxl(tmp_path):
    k = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_v"
    return _fake(tmp_path / "sdxl.safetensors", {f"{k}.lora_down.weight": (4, 2048), f"{k}.lora_up.weight": (640, 4),
                                                 f"{k}.alpha": ()})


def test_inspect_tells_format_architecture_and_rank(files, tmp_path):
    kohya, peft = inspect_lora(files[("kohya", "a")]), inspect_lora(files[("peft", "b")])
    assert (kohya.format, kohya.architecture, kohya.rank) == ("kohya", "tiny", 4)
    assert kohya.components == ("unet", "text_encoder", "text_encoder_2") and kohya.text_encoders
    assert (peft.format, peft.architecture, peft.rank, peft.components) == ("peft", "tiny", 2, ("unet",))
    assert inspect_lora(_sd15(tmp_path)).architecture == "SD 1.5"
    assert inspect_lora(_sdxl(tmp_path)).architecture == "SDXL"
    assert architecture_mismatch(kohya, "tiny") is None


def test_a_lora_for_another_architecture_is_named(tmp_path):
    sd15, sdxl = inspect_lora(_sd15(tmp_path)), inspect_lora(_sdxl(tmp_path))
    assert architecture_mismatch(sd15, "sdxl-random") == "a LoRA for SD 1.5, this job's model is SDXL"
    assert architecture_mismatch(sd15, "stabilityai/stable-diffusion-xl-base-1.0") == \
        "a LoRA for SD 1.5, this job's model is SDXL"
    assert architecture_mismatch(sdxl, "sdxl-random") is None
    assert architecture_mismatch(sdxl, "tiny") == "a LoRA for SDXL, this job's model is tiny"
    # shapes say nothing (UNet-only, no cross-attention): the trainer's metadata does, as A1111 reads it
    k = "lora_unet_input_blocks_4_1_proj_in"
    meta = _fake(tmp_path / "meta.safetensors", {f"{k}.lora_down.weight": (4, 640)}, {"ss_base_model_version": "sd_v1"})
    assert lora_problem(meta, "sdxl-random") == "a LoRA for SD 1.5, this job's model is SDXL"


CUT = b'{"a.lora_down.weight":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}'  # 8 bytes listed, 4 there


@pytest.mark.parametrize("content, message", [
    (b"", "not a safetensors file"),
    (b"\xff" * 64, "not a safetensors file"),
    (struct.pack("<Q", 5) + b"nojsn", "header is not JSON"),
    (struct.pack("<Q", 2) + b"[]", "header is not a JSON object"),
    (struct.pack("<Q", len(CUT)) + CUT + b"\0" * 4, "truncated"),
])
def test_garbage_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(LoraFileError, match=message) as e:
        inspect_lora(path)
    assert "\n" not in str(e.value)


def test_other_files_are_refused(tmp_path):
    assert "no such file" in lora_problem(tmp_path / "gone.safetensors", "tiny")
    (tmp_path / "x.ckpt").write_bytes(b"PK")
    assert "only .safetensors" in lora_problem(tmp_path / "x.ckpt", "tiny")
    assert "is a folder" in lora_problem(_folder(tmp_path), "tiny")
    unet = _fake(tmp_path / "unet.safetensors", {"conv_in.weight": (4, 4, 3, 3)})
    assert "not a LoRA file" in lora_problem(unet, "tiny")
    loha = _fake(tmp_path / "loha.safetensors", {"lora_unet_x.hada_w1_a": (4, 4)})
    assert "LoHa" in lora_problem(loha, "tiny")
    flux = _fake(tmp_path / "flux.safetensors", {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": (4, 8)})
    assert "transformer model" in lora_problem(flux, "tiny")


def _folder(tmp_path):
    d = tmp_path / "dir.safetensors"
    d.mkdir()
    return d


def test_hash_is_a1111s_addnet_hash(files, tmp_path):
    path = files[("kohya", "a")]
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    want = hashlib.sha256(data[8 + n:]).hexdigest()
    info = inspect_lora(path)
    assert (info.hash, info.shorthash) == (want, want[:12])
    # the metadata is in the header: changing it keeps the hash; changing a tensor does not
    from safetensors.torch import load_file

    state = load_file(str(path))
    same = save_file(state, str(tmp_path / "m.safetensors"), metadata={"ss_output_name": "other"})
    assert same is None and inspect_lora(tmp_path / "m.safetensors").hash == want
    key = next(k for k in state if k.endswith("lora_up.weight"))
    state[key] = state[key] + 1
    save_file(state, str(tmp_path / "c.safetensors"))
    assert inspect_lora(tmp_path / "c.safetensors").hash != want
    # as A1111: a trainer's sshs_model_hash in the metadata is the short hash it shows
    save_file(load_file(str(path)), str(tmp_path / "s.safetensors"), metadata={"sshs_model_hash": "abcdef0123456789"})
    assert inspect_lora(tmp_path / "s.safetensors").shorthash == "abcdef012345"


def test_inspection_does_not_import_torch(files):
    code = ("import sys; from storyboard_cli.job.lora_files import lora_problem; "
            f"p = lora_problem({str(files[('kohya', 'a')])!r}, 'tiny'); "
            "sys.exit(2 if p else int('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_loras_of_every_format_fit_the_model_they_were_made_for(files, tmp_path):
    for made in (("kohya", "a"), ("kohya", "b"), ("peft", "a"), ("peft", "b")):
        assert lora_problem(files[made], "tiny") is None, made
    assert lora_problem(_sdxl(tmp_path), "sdxl-random") is None


def test_committed_example_lora_fits_tiny():
    assert lora_problem(ROOT / "jobs" / "loras" / "mei.safetensors", "tiny") is None
    info = inspect_lora(ROOT / "jobs" / "loras" / "mei.safetensors")
    assert (info.format, info.architecture, info.rank, info.text_encoders) == ("kohya", "tiny", 4, True)
    assert (ROOT / "jobs" / "loras" / "mei.safetensors").stat().st_size < 200_000


# --- the A1111 prompt syntax -------------------------------------------------------------------


def test_lora_tags_leave_the_prompt():
    assert split_lora_tags("mei walking <lora:mei:0.8> at night, <lora:ink>") == \
        ("mei walking at night,", [("mei", 0.8), ("ink", 1.0)])
    assert split_lora_tags("no tags  here") == ("no tags  here", [])
    with pytest.raises(ValueError, match="not a number"):
        split_lora_tags("<lora:mei:lots>")
    with pytest.raises(ValueError, match="separate text-encoder"):
        split_lora_tags("<lora:mei:0.5:1>")


def test_infotext_pieces():
    assert lora_tags({"mei": 0.8, "ink": -0.25}) == "<lora:mei:0.8> <lora:ink:-0.25>"
    assert a1111_lora_hashes({"mei": "0123456789ab", "a:b,c": "ba9876543210"}) == \
        "mei: 0123456789ab, abc: ba9876543210"
    assert json.dumps(a1111_lora_hashes({"mei": "0123456789ab"})) == '"mei: 0123456789ab"'
