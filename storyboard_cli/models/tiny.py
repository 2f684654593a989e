"""The `tiny` preset: an SDXL-shaped model with random weights, small enough for a laptop CPU.

It has every part SDXL has (two CLIP text encoders with the penultimate-layer/pooled split,
a text_time-conditioned UNet, an 8x VAE, an SDXL ControlNet) at toy widths. It is built
deterministically from a fixed seed, saved as a diffusers folder in the cache, and loaded
back through the same `from_pretrained` path that real weights take. Its pictures are noise.
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


def tiny_folder() -> Path:
    """The tiny preset as a diffusers folder (built once, atomically, into the cache)."""
    folder = cache_root() / TINY_VERSION
    if (folder / "model_index.json").is_file() and (folder / "controlnet").is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    try:
        _build(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first: theirs is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
