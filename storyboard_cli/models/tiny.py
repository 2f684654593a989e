"""The `tiny` preset: an SDXL-shaped model with random weights, small enough for a laptop CPU.

It has every part SDXL has (two CLIP text encoders with the penultimate-layer/pooled split,
a text_time-conditioned UNet, an 8x VAE, an SDXL ControlNet) at toy widths. It is built
deterministically from a fixed seed, saved as a diffusers folder in the cache, and loaded
back through the same `from_pretrained` path that real weights take. Its pictures are noise.

Its IP-Adapters (`ip_adapter: tiny` / `tiny-plus`) are built the same way into a folder of their own
(`tiny_adapter_folder`), in h94/IP-Adapter's layout: the adapter file next to `image_encoder/`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from storyboard_cli.models.tokenizers import CLIP_TOKENS

TINY_VERSION = "tiny-v3"  # v3: a ControlNet guide steers the picture
TOKENIZER_MERGES: list[str] = []  # byte-level only: 514 tokens, no hub needed

UNET = dict(
    block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
    addition_time_embed_dim=8, transformer_layers_per_block=(1, 1),
    projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 time ids x 8 + pooled text (32)
    cross_attention_dim=32 + 48, norm_num_groups=8,  # both text encoders' hidden states, concatenated
)
VAE = dict(
    block_out_channels=(8, 16, 16, 16), in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
    norm_num_groups=8, sample_size=128, scaling_factor=0.13025, force_upcast=True,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
TEXT = dict(
    bos_token_id=512, eos_token_id=2, pad_token_id=513, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-5,
    num_attention_heads=4, num_hidden_layers=3, vocab_size=514, hidden_act="quick_gelu", projection_dim=32,
    max_position_embeddings=CLIP_TOKENS,
)
# the second encoder is wider, as OpenCLIP-bigG is wider than CLIP-L: single-file loading tells them apart by width
TEXT_2 = {**TEXT, "hidden_size": 48, "intermediate_size": 53, "hidden_act": "gelu"}
CONTROLNET_EMBEDDING = (8, 16, 16, 32)  # four stages: the control image enters at 1/8 size, like the latents
# the guide's path (the conditioning embedding's convolutions, the zero convolutions that hand the residuals to the
# UNet) drawn at this gain over fan-in: from_unet leaves them zero, and a small perturbation made every guide give
# the same picture (0.0002 levels apart); at 4 a blank guide, a colour ramp, noise and a pose differ by 6.7-10.7 levels
# in a 6-step 128x128 render
GUIDE_GAIN = 4.0
GUIDE_PATH = ("controlnet_cond_embedding.", "controlnet_down_blocks.", "controlnet_mid_block.")

SCHEDULER_CONFIG = Path(__file__).parent / "configs" / "sdxl-base" / "scheduler" / "scheduler_config.json"


def cache_root() -> Path:
    return Path(os.environ.get("BCG_CACHE") or Path.home() / ".cache" / "storyboard-cli")


def _build(folder: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, ControlNetModel, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from storyboard_cli.models.tokenizers import make_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**UNET)
    torch.manual_seed(1)
    vae = AutoencoderKL(**VAE)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**TEXT))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**TEXT_2))
    torch.manual_seed(4)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=CONTROLNET_EMBEDDING)
    # from_unet copies the UNet's weights; perturb so the control branch is not a no-op copy, and draw the guide's
    # path so that the guide image steers the picture
    with torch.no_grad():
        for p in controlnet.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, p in controlnet.named_parameters():
            if name.startswith(GUIDE_PATH) and p.dim() == 4:
                fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                p.copy_(torch.randn_like(p) * (GUIDE_GAIN / fan_in) ** 0.5)

    unet.save_pretrained(folder / "unet")
    vae.save_pretrained(folder / "vae")
    text_encoder.save_pretrained(folder / "text_encoder")
    text_encoder_2.save_pretrained(folder / "text_encoder_2")
    make_tokenizer(TOKENIZER_MERGES).save_pretrained(folder / "tokenizer")
    make_tokenizer(TOKENIZER_MERGES, pad_token="!").save_pretrained(folder / "tokenizer_2")
    (folder / "scheduler").mkdir()
    shutil.copy(SCHEDULER_CONFIG, folder / "scheduler" / "scheduler_config.json")
    index = json.loads((SCHEDULER_CONFIG.parent.parent / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    controlnet.save_pretrained(folder / "controlnet")


def _built(folder: Path, build) -> Path:
    """`folder`, built by `build(tmp)` into a temporary folder beside it and renamed into place (atomic)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    try:
        build(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first: theirs is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def tiny_folder() -> Path:
    """The tiny preset as a diffusers folder (built once, atomically, into the cache)."""
    folder = cache_root() / TINY_VERSION
    if (folder / "model_index.json").is_file() and (folder / "controlnet").is_dir():
        return folder
    return _built(folder, _build)


# ---------------------------------------------------------------------------------------------
# The tiny IP-Adapters, in h94/IP-Adapter's layout

TINY_IP_VERSION = "tiny-ip-v1"
ADAPTER_FILES = {"base": "ip-adapter_sdxl.safetensors", "plus": "ip-adapter-plus_sdxl.safetensors"}  # kind -> file
IMAGE_ENCODER_FOLDER = "image_encoder"  # beside the adapter file, as in h94's sdxl_models/
# CLIP vision towers at toy widths; the plus one another width, as h94's plus adapters read ViT-H, not bigG (base
# reads the projected image embedding: projection_dim wide; plus the penultimate hidden states: hidden_size wide).
# initializer_factor 10: at CLIP's own init (weights of std 0.02) the layers barely touch the residual stream, and
# the class token came out the same for any picture (two line drawings 0.055 apart, relative); at 10, 0.2
ENCODER = dict(intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8,
               hidden_act="gelu", layer_norm_eps=1e-5, initializer_factor=10.0)
IMAGE_ENCODERS = {"base": dict(ENCODER, hidden_size=32, projection_dim=24),
                  "plus": dict(ENCODER, hidden_size=40, intermediate_size=45, projection_dim=16)}
IP_TOKENS = {"base": 4, "plus": 16}  # image tokens per reference: h94's SDXL adapters'
RESAMPLER_DEPTH, RESAMPLER_HEAD = 4, 64  # what diffusers' converter assumes of a plus adapter's Resampler
TINY_RESAMPLER_WIDTH = 64  # one head
# the adapter's key / value projections (to_k_ip, to_v_ip) drawn at this gain over fan-in, so that a reference
# steers the picture: at 1 (a plain variance-keeping draw) the two line drawings of jobs/control/ moved a 6-step 64x64
# render at scale 1 by 1.8 levels (base) and 4.1 (plus); at 4, by 4.4 and 6.5 (a red square against either: 16, 13)
IP_GAIN = 4.0


def h94_adapter(kind: str, layers: list[tuple[int, int]], embed: int, dim: int, resampler: int = 1280,
                gain: float = 1.0) -> dict:
    """Random IP-Adapter weights in h94's layout, from torch's RNG on its default device: `image_proj.*` (base:
    ImageProjection's `proj` and `norm` from an `embed`-wide image embedding to IP_TOKENS tokens `dim` wide; plus:
    the Resampler from `embed`-wide hidden states through `resampler`-wide latents) and, for the k-th of `layers`
    ((hidden, cross) of each cross-attention layer, in the UNet's attn_processors order), `ip_adapter.{2k+1}.to_k_ip`
    / `to_v_ip` [hidden, cross] (as diffusers numbers them: h94 counts self- and cross-attention alike)."""
    import torch

    def linear(out: int, inp: int, g: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp) * (g / inp) ** 0.5

    def norm(prefix: str, n: int) -> dict:
        return {f"{prefix}.weight": torch.ones(n), f"{prefix}.bias": torch.zeros(n)}

    tokens = IP_TOKENS[kind]
    if kind == "base":
        proj = {"proj.weight": linear(tokens * dim, embed), "proj.bias": torch.zeros(tokens * dim), **norm("norm", dim)}
    else:  # as the Resampler of h94's IP-Adapter (resampler.py): PerceiverAttention, then a FeedForward, per layer
        w, inner = resampler, resampler // RESAMPLER_HEAD * RESAMPLER_HEAD
        proj = {"latents": torch.randn(1, tokens, w) / w ** 0.5, "proj_in.weight": linear(w, embed),
                "proj_in.bias": torch.zeros(w), "proj_out.weight": linear(dim, w), "proj_out.bias": torch.zeros(dim),
                **norm("norm_out", dim)}
        for i in range(RESAMPLER_DEPTH):
            proj |= {**norm(f"layers.{i}.0.norm1", w), **norm(f"layers.{i}.0.norm2", w),
                     f"layers.{i}.0.to_q.weight": linear(inner, w), f"layers.{i}.0.to_kv.weight": linear(2 * inner, w),
                     f"layers.{i}.0.to_out.weight": linear(w, inner), **norm(f"layers.{i}.1.0", w),
                     f"layers.{i}.1.1.weight": linear(4 * w, w), f"layers.{i}.1.3.weight": linear(w, 4 * w)}
    out = {f"image_proj.{k}": v for k, v in proj.items()}
    for k, (hidden, cross) in enumerate(layers):
        for name in ("to_k_ip", "to_v_ip"):
            out[f"ip_adapter.{2 * k + 1}.{name}.weight"] = linear(hidden, cross, gain)
    return out


def _build_adapters(folder: Path) -> None:
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    from transformers.utils import logging

    logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    with torch.device("meta"):
        unet = UNet2DConditionModel(**UNET)
    attentions = [unet.get_submodule(n.removesuffix(".processor")) for n in unet.attn_processors
                  if not n.endswith("attn1.processor")]
    layers = [(a.to_k.out_features, a.to_k.in_features) for a in attentions]
    for seed, (kind, name) in enumerate(ADAPTER_FILES.items(), start=10):
        config = IMAGE_ENCODERS[kind]
        torch.manual_seed(seed)
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**config))
        embed = config["projection_dim"] if kind == "base" else config["hidden_size"]
        weights = h94_adapter(kind, layers, embed, UNET["cross_attention_dim"], TINY_RESAMPLER_WIDTH, IP_GAIN)
        (folder / kind).mkdir()
        encoder.save_pretrained(folder / kind / IMAGE_ENCODER_FOLDER)
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / kind / name)


def tiny_adapter_folder(kind: str) -> Path:
    """The tiny IP-Adapter of `kind` ("base", "plus") as a folder in h94's layout: ADAPTER_FILES[kind] next to
    image_encoder/ (both kinds built once, atomically, into the cache)."""
    folder = cache_root() / TINY_IP_VERSION
    if not all((folder / k / name).is_file() for k, name in ADAPTER_FILES.items()):
        _built(folder, _build_adapters)
    return folder / kind
