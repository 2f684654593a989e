"""The UNet's layers a LoRA can change, from its config.json, without torch: what `bcg plan` checks a
LoRA's UNet keys against (names and widths) before any model loads.

- `unet_layers(config)` -> `UnetLayers`: every Linear and Conv2d of diffusers' UNet2DConditionModel built
  from that config, by name, with its weight's shape, as diffusers builds them (unets/unet_2d_condition.py,
  unet_2d_blocks.py, transformer_2d.py, attention.py, resnet.py); None for a config outside the SDXL family
  it describes. tests/test_unet_layers.py holds it equal to the real module's layers.
- `UnetLayers.module(name)`: the layer a LoRA key names, in the key forms diffusers' SDXL LoRA loader
  reads: diffusers / PEFT (`down_blocks.1.attentions.0.proj_in`), Kohya with diffusers' block names
  (`down_blocks_1_attentions_0_proj_in`) and Kohya with the original SGM blocks sd-scripts trains SDXL on
  (`input_blocks_4_1_proj_in`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

Shape = tuple[int, ...]  # a layer's weight: [out, in] (Linear) or [out, in, kh, kw] (Conv2d)

# UNet2DConditionModel.__init__'s defaults for the keys read here (a config.json may leave any out)
DEFAULTS: dict[str, Any] = dict(
    in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    mid_block_type="UNetMidBlock2DCrossAttn", up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    only_cross_attention=False, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
    cross_attention_dim=1280, transformer_layers_per_block=1, reverse_transformer_layers_per_block=None,
    encoder_hid_dim=None, encoder_hid_dim_type=None, attention_head_dim=8, num_attention_heads=None,
    dual_cross_attention=False, use_linear_projection=False, class_embed_type=None, addition_embed_type=None,
    num_class_embeds=None, resnet_time_scale_shift="default", time_embedding_type="positional",
    time_embedding_dim=None, time_cond_proj_dim=None, conv_in_kernel=3, conv_out_kernel=3,
    projection_class_embeddings_input_dim=None, attention_type="default", class_embeddings_concat=False,
    mid_block_only_cross_attention=None, _class_name="UNet2DConditionModel",
)
DOWN_BLOCKS = {"DownBlock2D": False, "CrossAttnDownBlock2D": True}  # block type -> has attentions
UP_BLOCKS = {"UpBlock2D": False, "CrossAttnUpBlock2D": True}
# a config with any of these set builds modules this table does not describe (class and image embeddings,
# GLIGEN, dual attention, a timestep condition): the UNet's layers are then checked at render only
UNDESCRIBED = ("class_embed_type", "num_class_embeds", "encoder_hid_dim", "encoder_hid_dim_type",
               "time_cond_proj_dim", "dual_cross_attention", "mid_block_only_cross_attention")

# the SGM (original SDXL) names sd-scripts gives the layers outside the block structure, and a resnet's
# layers; as diffusers' _convert_unet_lora_key reads them back
SGM_TOP = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
           "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
           "add_embedding.linear_2": "label_emb.0.2"}
SGM_RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
              "conv_shortcut": "skip_connection"}
# diffusers' key converter maps a Kohya key with diffusers' block names back to these only through their
# SGM spelling: `add_embedding_linear_1` becomes `add.embedding.linear` (its index dropped as an SDXL `emb`)
NO_DIFFUSERS_KOHYA = ("add_embedding.",)


def sgm_name(module: str, layers_per_block: int) -> str:
    """A diffusers UNet layer's name as sd-scripts' SDXL UNet (SGM / LDM layout) names it."""
    if module in SGM_TOP:
        return SGM_TOP[module]
    per = layers_per_block + 1  # an SGM input/output block per resnet, and one per down/upsampler
    m = re.fullmatch(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)", module)
    if m:
        side, b, kind, j, rest = m[1], int(m[2]), m[3], int(m[4]), m[5]
        if kind == "downsamplers":
            return f"input_blocks.{(b + 1) * per}.0.op"
        if kind == "upsamplers":  # the third module of SDXL's output block (after resnet, attention)
            return f"output_blocks.{b * per + layers_per_block}.2.conv"
        index = 1 + b * per + j if side == "down" else b * per + j
        inner = f"0.{SGM_RESNET[rest]}" if kind == "resnets" else f"1.{rest}"
        return f"{'input' if side == 'down' else 'output'}_blocks.{index}.{inner}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", module)
    if m:
        kind, j, rest = m[1], int(m[2]), m[3]
        return f"middle_block.1.{rest}" if kind == "attentions" else f"middle_block.{2 * j}.{SGM_RESNET[rest]}"
    raise ValueError(f"no SGM name for {module}")


@dataclass(frozen=True)
class UnetLayers:
    shapes: dict[str, Shape]  # diffusers module name -> weight shape
    kohya: dict[str, str]  # a Kohya key's layer part (after `lora_unet_`) -> diffusers module name

    def module(self, name: str) -> str | None:
        """The diffusers module a LoRA key's layer part names (the key without its factor's ending:
        `lora_unet_...` as Kohya writes it, else `unet.` and the dotted name), or None where this UNet has
        no such layer."""
        if name.startswith("lora_unet_"):
            return self.kohya.get(name.removeprefix("lora_unet_"))
        # as diffusers' convert_unet_state_dict_to_peft: KEYS_TO_ALWAYS_REPLACE, then UNET_TO_DIFFUSERS
        name = name.removeprefix("unet.").replace(".processor.", ".")
        name = re.sub(r"\.to_(q|k|v|out)_lora$", lambda m: f".to_{m[1]}" + (".0" if m[1] == "out" else ""), name)
        return name if name in self.shapes else None


def _per_block(value: Any, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _per_layer(value: Any, n: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * n


def _build(c: dict[str, Any]) -> dict[str, Shape]:
    """name -> weight shape, as UNet2DConditionModel.__init__ builds its layers."""
    out: dict[str, Shape] = {}
    boc = [int(x) for x in c["block_out_channels"]]
    n = len(c["down_block_types"])
    linear_proj, scale_shift = bool(c["use_linear_projection"]), c["resnet_time_scale_shift"] == "scale_shift"
    # as UNet2DConditionModel._set_time_proj, positional: TimestepEmbedding(block_out_channels[0], time_embed_dim)
    temb = c["time_embedding_dim"] or boc[0] * 4
    blocks_temb = temb * 2 if c["class_embeddings_concat"] else temb
    heads = _per_block(c["num_attention_heads"] or c["attention_head_dim"], n)  # as diffusers: the naming issue
    cross = _per_block(c["cross_attention_dim"], n)
    lpb = [int(x) for x in _per_block(c["layers_per_block"], n)]
    tlpb = _per_block(c["transformer_layers_per_block"], n)
    rev_tlpb = c["reverse_transformer_layers_per_block"] or list(reversed(tlpb))

    def add(name: str, shape: Shape) -> None:
        out[name] = tuple(int(s) for s in shape)

    def resnet(name: str, cin: int, cout: int) -> None:  # ResnetBlock2D
        add(f"{name}.conv1", (cout, cin, 3, 3))
        add(f"{name}.time_emb_proj", (cout * 2 if scale_shift else cout, blocks_temb))
        add(f"{name}.conv2", (cout, cout, 3, 3))
        if cin != cout:
            add(f"{name}.conv_shortcut", (cout, cin, 1, 1))

    def transformer(name: str, ch: int, n_heads: int, context: int | None, layers: int) -> None:
        inner = int(n_heads) * (ch // int(n_heads))  # Transformer2DModel(heads, ch // heads, in_channels=ch)
        proj = (1, 1) if not linear_proj else ()
        add(f"{name}.proj_in", (inner, ch, *proj))
        for k in range(layers):  # BasicTransformerBlock: self-attention, cross-attention, GEGLU feed-forward
            block = f"{name}.transformer_blocks.{k}"
            for attn, kv in (("attn1", inner), ("attn2", context or inner)):
                add(f"{block}.{attn}.to_q", (inner, inner))
                add(f"{block}.{attn}.to_k", (inner, kv))
                add(f"{block}.{attn}.to_v", (inner, kv))
                add(f"{block}.{attn}.to_out.0", (inner, inner))
            add(f"{block}.ff.net.0.proj", (inner * 4 * 2, inner))
            add(f"{block}.ff.net.2", (inner, inner * 4))
        add(f"{name}.proj_out", (ch, inner, *proj))

    add("conv_in", (boc[0], c["in_channels"], c["conv_in_kernel"], c["conv_in_kernel"]))
    add("time_embedding.linear_1", (temb, boc[0]))
    add("time_embedding.linear_2", (temb, temb))
    if c["addition_embed_type"] == "text_time":
        add("add_embedding.linear_1", (temb, c["projection_class_embeddings_input_dim"]))
        add("add_embedding.linear_2", (temb, temb))

    ch = boc[0]
    for i, kind in enumerate(c["down_block_types"]):
        cin, ch = ch, boc[i]
        layers = _per_layer(tlpb[i], lpb[i])
        for j in range(lpb[i]):
            resnet(f"down_blocks.{i}.resnets.{j}", cin if j == 0 else ch, ch)
            if DOWN_BLOCKS[kind]:
                transformer(f"down_blocks.{i}.attentions.{j}", ch, heads[i], cross[i], layers[j])
        if i != len(boc) - 1:
            add(f"down_blocks.{i}.downsamplers.0.conv", (ch, ch, 3, 3))

    if c["mid_block_type"] == "UNetMidBlock2DCrossAttn":
        ch = boc[-1]
        resnet("mid_block.resnets.0", ch, ch)
        transformer("mid_block.attentions.0", ch, heads[-1], cross[-1], _per_layer(tlpb[-1], 1)[0])
        resnet("mid_block.resnets.1", ch, ch)

    rev, rev_heads, rev_cross, rev_lpb = boc[::-1], heads[::-1], cross[::-1], lpb[::-1]
    ch = rev[0]
    for i, kind in enumerate(c["up_block_types"]):
        prev, ch, skip_in = ch, rev[i], rev[min(i + 1, len(boc) - 1)]
        n_layers, attentions = rev_lpb[i] + 1, UP_BLOCKS[kind]
        layers = _per_layer(rev_tlpb[i], n_layers)
        for j in range(n_layers):
            skip = skip_in if j == n_layers - 1 else ch  # the down path's output this resnet concatenates
            resnet(f"up_blocks.{i}.resnets.{j}", (prev if j == 0 else ch) + skip, ch)
            if attentions:
                transformer(f"up_blocks.{i}.attentions.{j}", ch, rev_heads[i], rev_cross[i], layers[j])
        if i != len(boc) - 1:
            add(f"up_blocks.{i}.upsamplers.0.conv", (ch, ch, 3, 3))

    add("conv_out", (c["out_channels"], boc[0], c["conv_out_kernel"], c["conv_out_kernel"]))
    return out


def _describes(c: dict[str, Any]) -> bool:
    only_cross = c["only_cross_attention"]
    return (c["_class_name"] == "UNet2DConditionModel" and not any(c[k] for k in UNDESCRIBED)
            and not any(_per_block(only_cross, 1)) and c["attention_type"] == "default"
            and c["time_embedding_type"] == "positional" and c["addition_embed_type"] in (None, "text_time")
            and c["resnet_time_scale_shift"] in ("default", "scale_shift")
            and c["mid_block_type"] in (None, "UNetMidBlock2DCrossAttn")
            and set(c["down_block_types"]) <= DOWN_BLOCKS.keys() and set(c["up_block_types"]) <= UP_BLOCKS.keys()
            and len(c["down_block_types"]) == len(c["up_block_types"]) == len(c["block_out_channels"]))


@lru_cache(maxsize=8)
def _cached(config_json: str) -> UnetLayers | None:
    c = {**DEFAULTS, **json.loads(config_json)}
    try:
        if not _describes(c):
            return None
        built = _build(c)
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError):
        return None  # a config diffusers would not build either: its load says why
    kohya = {}
    lpb = c["layers_per_block"]
    for name in built:
        if not name.startswith(NO_DIFFUSERS_KOHYA):
            kohya[name.replace(".", "_")] = name
        if isinstance(lpb, int):  # diffusers maps SGM blocks with an int layers_per_block only
            kohya[sgm_name(name, lpb).replace(".", "_")] = name
    return UnetLayers(built, kohya)


def unet_layers(config: Mapping[str, Any]) -> UnetLayers | None:
    """The LoRA-targetable layers of the UNet2DConditionModel `config` builds (config.json's keys; the
    missing ones take diffusers' defaults), or None for a config this table does not describe."""
    try:
        key = json.dumps(dict(config), sort_keys=True)
    except (TypeError, ValueError):
        return None
    return _cached(key)
