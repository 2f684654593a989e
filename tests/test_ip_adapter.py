"""IP-Adapter, the models side (models/ip_adapter.py, job/adapter_files.py, the tiny adapters of models/tiny.py).

Parity is against diffusers' own path (pipe.load_ip_adapter + set_ip_adapter_scale + ip_adapter_image) on a deep
copy of the same tiny models, through the same StableDiffusionXLPipeline loop: only the adapter's path differs (ours:
the tokens encoded once, handed to our processors through cross_attention_kwargs, padded to REFERENCE_SLOTS images
and masked).
"""

import copy
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conftest import ROOT
from storyboard_cli.errors import BadInput, ModelError
from storyboard_cli.job.adapter_files import ADAPTER_PRESETS, adapter_problem, cross_attention_layers
from storyboard_cli.job.unet_layers import unet_layers
from storyboard_cli.job.conditions.reference import REFERENCE_SLOTS
from storyboard_cli.models.ip_adapter import load_ip_adapter
from storyboard_cli.models.tiny import ADAPTER_FILES, UNET, tiny_adapter_folder

from helpers.reference import RTOL, diffusers_pipeline, rel_error

W, H, STEPS, GUIDANCE, SCALE = 64, 64, 4, 6.5, 0.6
PROMPT = "a lighthouse in a storm, ink drawing"
KINDS = {"tiny": "base", "tiny-plus": "plus"}
STEERS = 2.0  # mean levels (0-255) between the pictures of two different references, at least


@pytest.fixture(scope="module")
def models(tiny_cpu):
    """This module's own copy of the tiny models: the adapter's processors go into its UNet."""
    m = copy.deepcopy(tiny_cpu)
    m.controlnets = ()
    return m


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Three reference images, by sha256: the two line drawings of jobs/control/ and a red square."""
    folder = tmp_path_factory.mktemp("refs")
    Image.new("RGB", (64, 48), (200, 40, 40)).save(folder / "red.png")
    paths = [ROOT / "jobs" / "control" / "hero_pose.png", ROOT / "jobs" / "control" / "valley_layout.png",
             folder / "red.png"]
    return {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in paths}  # real digests: the disk cache is shared


def _rows(adapter, per_row, slots=None, scales=None):
    """cross_attention_kwargs for rows of references (each a list of [T, C] tokens): unpadded (every row the same
    count, no mask), or padded to `slots` images with noise in the empty slots, masked -inf (none masked for a row
    without references)."""
    t, c = adapter.negative.shape
    if slots is None:
        tokens, mask = torch.stack([torch.cat(row) for row in per_row]), None
    else:
        tokens = torch.randn(len(per_row), slots * t, c, generator=torch.Generator().manual_seed(5))
        mask = torch.zeros(len(per_row), 1, 1, slots * t)
        for i, row in enumerate(per_row):
            if row:
                tokens[i, : len(row) * t] = torch.cat(row)
                mask[i, ..., len(row) * t:] = float("-inf")
    scale = torch.tensor(scales if scales is not None else [SCALE] * len(per_row)).view(-1, 1, 1)
    return dict(ref_tokens=tokens, ref_scale=scale, ref_mask=mask)


def _latents(pipe, **kwargs):
    return pipe(prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                generator=torch.Generator("cpu").manual_seed(7), output_type="latent", **kwargs).images


@pytest.mark.parametrize("spec", KINDS)
def test_same_latents_as_diffusers_ip_adapter(tiny_cpu, models, images, spec):
    folder = tiny_adapter_folder(KINDS[spec])
    reference = copy.deepcopy(tiny_cpu)
    reference.controlnets = ()
    pipe = diffusers_pipeline(reference)
    pipe.load_ip_adapter(str(folder), subfolder="", weight_name=ADAPTER_FILES[KINDS[spec]],
                         image_encoder_folder="image_encoder")
    pipe.set_ip_adapter_scale(SCALE)

    adapter = load_ip_adapter(spec, None, models.unet, "cpu", torch.float32)
    assert models.unet.encoder_hid_proj is None and models.unet.config.encoder_hid_dim_type is None
    ours = diffusers_pipeline(models)
    shas = list(images)[:2]
    tokens = [adapter.encode(images[s], s) for s in shas]
    pil = [Image.open(images[s]).convert("RGB") for s in shas]
    for n in (1, 2):
        want = _latents(pipe, ip_adapter_image=[pil[:n]])
        negative = [adapter.negative] * n  # diffusers' unconditional half: one negative per image
        for slots in (None, REFERENCE_SLOTS):
            got = _latents(ours, cross_attention_kwargs=_rows(adapter, [negative, tokens[:n]], slots))
            err = rel_error(got, want)
            assert err < RTOL, f"{spec}, {n} references, slots {slots}: relative error {err:.2e}"


def test_rows_are_independent_and_a_row_without_references_is_the_plain_unet(tiny_cpu, models, images):
    """Rows of other references, counts and scales in one call equal each row alone; a row at scale 0 with nothing
    masked equals the UNet without an adapter (and stays finite)."""
    adapter = load_ip_adapter("tiny-plus", None, models.unet, "cpu", torch.float32)
    tok = {s: adapter.encode(p, s) for s, p in images.items()}
    a, b, c = tok.values()
    per_row, scales = [[a], [b, c, a], []], [1.0, 0.4, 0.0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, H // 8, W // 8, generator=g)
    text = torch.randn(3, 77, UNET["cross_attention_dim"], generator=g)
    added = {"text_embeds": torch.randn(3, 32, generator=g), "time_ids": torch.tensor([[H, W, 0, 0, H, W]] * 3, dtype=torch.float32)}

    def unet(rows, unet=models.unet, **kwargs):
        return unet(x[rows], 500, text[rows], added_cond_kwargs={k: v[rows] for k, v in added.items()},
                    **kwargs).sample

    together = unet(slice(None), cross_attention_kwargs=_rows(adapter, per_row, REFERENCE_SLOTS, scales))
    assert torch.isfinite(together).all()
    for i in range(3):
        alone = unet(slice(i, i + 1), cross_attention_kwargs=_rows(adapter, per_row[i:i + 1], REFERENCE_SLOTS,
                                                                   scales[i:i + 1]))
        torch.testing.assert_close(together[i:i + 1], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[2:], unet(slice(2, 3), unet=tiny_cpu.unet), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unet(slice(None)), unet(slice(None), unet=tiny_cpu.unet), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", KINDS)
def test_the_tiny_reference_steers_the_picture(models, images, spec):
    """Two different references (the line drawings of jobs/control/) at scale 1 move a 6-step 64x64 render by
    STEERS levels at least: a test can tell which reference a row got."""
    adapter = load_ip_adapter(spec, None, models.unet, "cpu", torch.float32)
    pipe = diffusers_pipeline(models)
    pictures = []
    for sha in list(images)[:2]:
        kwargs = _rows(adapter, [[adapter.negative], [adapter.encode(images[sha], sha)]], scales=[1.0, 1.0])
        pictures.append(pipe(prompt=PROMPT, height=64, width=64, num_inference_steps=6, guidance_scale=5.0,
                             generator=torch.Generator("cpu").manual_seed(3), output_type="np",
                             cross_attention_kwargs=kwargs).images[0] * 255)
    apart = float(np.abs(pictures[0] - pictures[1]).mean())
    assert apart >= STEERS, f"{spec}: two references are {apart:.3f} levels apart"


def test_encoding_is_cached_in_memory_and_on_disk(models, images, tmp_path, monkeypatch):
    folder = str(tiny_adapter_folder("base"))
    adapter = load_ip_adapter("tiny", None, models.unet, "cpu", torch.float32)
    monkeypatch.setenv("BCG_CACHE", str(tmp_path))  # the references' cache only: the adapter's folder stays
    sha, path = next(iter(images.items()))
    first = adapter.encode(path, sha)
    assert adapter.encoded == 1 and adapter.encode_ms > 0 and first.shape == (adapter.tokens, adapter.dim)
    assert adapter.encode(path, sha) is first and adapter.encoded == 1
    stored = tmp_path / "references" / adapter.digest / f"{sha}.safetensors"
    assert list(load_file(stored)) == ["float32"]
    again = load_ip_adapter(folder, None, models.unet, "cpu", torch.float32)  # the same files, named by their folder
    assert again.digest == adapter.digest
    torch.testing.assert_close(again.encode(path, sha), first, rtol=0, atol=0)
    assert again.encoded == 0
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    with pytest.raises(BadInput, match="broken.png: cannot read the reference image"):
        again.encode(tmp_path / "broken.png", "b" * 64)


def test_a_pickled_adapter_loads_as_its_safetensors_twin(models, tmp_path):
    """h94's .bin files: {"image_proj": ..., "ip_adapter": ...}, read with weights_only (not checked before loading)."""
    source = tiny_adapter_folder("base")
    flat = load_file(source / ADAPTER_FILES["base"])
    torch.save({part: {k.removeprefix(f"{part}."): v for k, v in flat.items() if k.startswith(f"{part}.")}
                for part in ("image_proj", "ip_adapter")}, tmp_path / "ip-adapter_sdxl.bin")
    shutil.copytree(source / "image_encoder", tmp_path / "image_encoder")
    assert adapter_problem(str(tmp_path), None, "tiny") is None
    pickled = load_ip_adapter(str(tmp_path), None, models.unet, "cpu", torch.float32)
    proc = models.unet.down_blocks[1].attentions[0].transformer_blocks[0].attn2.processor
    torch.testing.assert_close(proc.to_k_ip.weight, flat["ip_adapter.1.to_k_ip.weight"], rtol=0, atol=0)
    plain = load_ip_adapter("tiny", None, models.unet, "cpu", torch.float32)
    torch.testing.assert_close(pickled.negative, plain.negative, rtol=0, atol=0)


@pytest.fixture
def bad_adapter(tmp_path):
    """The tiny base adapter with its first to_k_ip weight 96 wide instead of 80, beside its image encoder."""
    source = tiny_adapter_folder("base")
    shutil.copytree(source / "image_encoder", tmp_path / "image_encoder")
    weights = load_file(source / ADAPTER_FILES["base"])
    weights["ip_adapter.1.to_k_ip.weight"] = torch.zeros(64, 96)
    save_file(weights, tmp_path / "ip-adapter_sdxl.safetensors")
    return tmp_path


WANT = ("ip-adapter_sdxl.safetensors: ip_adapter.1.to_k_ip.weight is [64, 96], the model's "
        "down_blocks.1.attentions.0.transformer_blocks.0.attn2 needs [64, 80]")


def test_a_weight_that_does_not_fit_is_one_line_naming_the_layer_and_shapes(models, bad_adapter):
    assert adapter_problem(str(bad_adapter), None, "tiny") == WANT
    with pytest.raises(ModelError) as e:
        load_ip_adapter(str(bad_adapter), None, models.unet, "cpu", torch.float32)
    assert str(e.value) == f"ip_adapter: {WANT}"


def test_adapter_problem_finds_files_encoders_and_models_before_loading(tmp_path):
    base = tiny_adapter_folder("base")
    assert adapter_problem(str(base), None, "tiny") is None
    assert adapter_problem(str(base / ADAPTER_FILES["base"]), None, "tiny") is None
    assert adapter_problem(str(tiny_adapter_folder("plus")), None, "tiny") is None
    assert all(adapter_problem(p, None, "tiny") is None for p in ADAPTER_PRESETS)
    assert adapter_problem("tiny-plus", None, "sdxl-random") == ("tiny-plus is made for the tiny model's UNet, not this "
                                                                 "model's; use sdxl-random-plus or an adapter folder")
    assert adapter_problem("sdxl-random-plus", None, "sdxl-random") is None
    # the tiny adapter on SDXL's UNet: its first layer is SDXL's down_blocks.1 (640 wide, context 2048)
    assert adapter_problem(str(base), None, "sdxl-random").startswith(
        "ip-adapter_sdxl.safetensors: it has 4 cross-attention layers, the model's UNet has 70")
    assert "no such file or folder" in adapter_problem(str(tmp_path / "nothing"), None, "tiny")
    # several adapter files in one folder; one without an encoder beside it; the plus encoder for the base adapter
    shutil.copy(base / ADAPTER_FILES["base"], tmp_path / "ip-adapter_sdxl.safetensors")
    assert "no image_encoder/" in adapter_problem(str(tmp_path), None, "tiny")
    plus = tiny_adapter_folder("plus")
    problem = adapter_problem(str(tmp_path), str(plus / "image_encoder"), "tiny")
    assert problem == ("ip-adapter_sdxl.safetensors: image_proj.proj.weight is [320, 24], its image encoder's "
                       "projection_dim is 16 (another image encoder)")
    shutil.copy(plus / ADAPTER_FILES["plus"], tmp_path / ADAPTER_FILES["plus"])
    problem = adapter_problem(str(tmp_path), None, "tiny")
    assert problem.endswith("several IP-Adapter files (ip-adapter-plus_sdxl.safetensors, ip-adapter_sdxl.safetensors): "
                            "name the one to use")
    assert all("\n" not in p for p in (problem, WANT))


def test_h94s_vit_h_files_find_the_encoder_of_models(tmp_path):
    """h94/IP-Adapter: sdxl_models/ip-adapter_sdxl_vit-h.safetensors reads models/image_encoder (ViT-H), not the bigG
    encoder of sdxl_models/image_encoder."""
    base = tiny_adapter_folder("base")
    (tmp_path / "sdxl_models").mkdir()
    shutil.copy(base / ADAPTER_FILES["base"], tmp_path / "sdxl_models" / "ip-adapter_sdxl_vit-h.safetensors")
    shutil.copytree(base / "image_encoder", tmp_path / "models" / "image_encoder")
    shutil.copytree(tiny_adapter_folder("plus") / "image_encoder", tmp_path / "sdxl_models" / "image_encoder")
    assert adapter_problem(str(tmp_path / "sdxl_models"), None, "tiny") is None


def test_cross_attention_layers_come_in_diffusers_order():
    """The order diffusers numbers ip_adapter.{1 + 2k} by (attn_processors: down, up, mid), from the config alone."""
    from diffusers import UNet2DConditionModel

    from storyboard_cli.job.lora_files import model_configs

    for config in (UNET, model_configs("sdxl-random")["unet"]):
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(dict(config))
        real = [(n.removesuffix(".processor"), tuple(unet.get_submodule(n.removesuffix(".processor")).to_k.weight.shape))
                for n in unet.attn_processors if not n.endswith("attn1.processor")]
        assert cross_attention_layers(unet_layers(config).shapes) == real


def test_the_tiny_adapters_are_h94s_layout():
    for kind, name in ADAPTER_FILES.items():
        folder = tiny_adapter_folder(kind)
        config = json.loads((folder / "image_encoder" / "config.json").read_text())
        assert config["architectures"] == ["CLIPVisionModelWithProjection"]
        keys = set(load_file(folder / name))
        assert {"ip_adapter.1.to_k_ip.weight", "ip_adapter.7.to_v_ip.weight"} <= keys
        assert ("image_proj.latents" in keys) == (kind == "plus")
        assert ("image_proj.layers.3.0.to_kv.weight" in keys) == (kind == "plus")


@pytest.mark.parametrize("ndim", [3, 4])
def test_the_processor_is_diffusers_ip_adapter_processor_on_random_inputs(ndim):
    """RowScaledIpProcessor copies AttnProcessor2_0 and the image part of IPAdapterAttnProcessor2_0: on random inputs
    and weights (tiny shapes) it gives what diffusers' own processors give, for one image, two images in one softmax,
    an empty slot masked, a row at scale 0 (the text attention alone) and no references; a diffusers change to either
    processor that ours does not follow fails here."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0, IPAdapterAttnProcessor2_0

    from storyboard_cli.models.ip_adapter import RowScaledIpProcessor

    torch.manual_seed(0)
    hidden, cross, heads, t, rows = 32, 24, 2, 4, 3
    attn = Attention(query_dim=hidden, cross_attention_dim=cross, heads=heads, dim_head=hidden // heads).eval()
    ours = RowScaledIpProcessor(hidden, cross, torch.device("cpu"), torch.float32)
    torch.nn.init.normal_(ours.to_k_ip.weight)
    torch.nn.init.normal_(ours.to_v_ip.weight)
    x = torch.randn(rows, hidden, 4, 5) if ndim == 4 else torch.randn(rows, 20, hidden)
    text = torch.randn(rows, 7, cross)
    one, two = torch.randn(rows, t, cross), torch.randn(rows, t, cross)
    scale = 0.7

    def theirs(tokens: torch.Tensor) -> torch.Tensor:
        proc = IPAdapterAttnProcessor2_0(hidden, cross, num_tokens=(tokens.shape[1],), scale=scale)
        proc.to_k_ip[0].weight.data.copy_(ours.to_k_ip.weight)
        proc.to_v_ip[0].weight.data.copy_(ours.to_v_ip.weight)
        return proc(attn, x, (text, [tokens]))

    def mine(tokens, row_scale=scale, mask=None):
        return ours(attn, x, text, ref_tokens=tokens, ref_scale=torch.full((rows, 1, 1), row_scale), ref_mask=mask)

    with torch.no_grad():
        close = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine(one), theirs(one), **close)
        both = torch.cat([one, two], dim=1)  # two images of one adapter: their tokens in one softmax
        torch.testing.assert_close(mine(both), theirs(both), **close)
        empty = torch.zeros(rows, 1, 1, 2 * t)
        empty[..., t:] = float("-inf")  # the second slot empty: noise there, masked
        torch.testing.assert_close(mine(torch.cat([one, torch.randn(rows, t, cross)], dim=1), mask=empty),
                                   theirs(one), **close)
        plain = AttnProcessor2_0()(attn, x, text)
        torch.testing.assert_close(mine(one, 0.0), plain, **close)
        torch.testing.assert_close(ours(attn, x, text), plain, **close)
        assert not torch.allclose(mine(one), plain, **close)  # the image part is in the comparison
