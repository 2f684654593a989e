"""What a job file refers to, checked as it loads: its LoRA files (the top-level `loras:`, each read and held against
the job's model; a shot's `lora:` and its prompt's `<lora:name:scale>` tags), its control images (every pixel
decoded, the bytes hashed) and the files it names by sha256 (`inputs:`). No torch."""

from __future__ import annotations

import io
import logging
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyboard_cli.errors import JobError, did_you_mean, one_line
from storyboard_cli.job.digests import remember_sha256
from storyboard_cli.job.inputs import DIGEST_RULE, INPUTS_KEY, Inputs, is_digest
from storyboard_cli.job.lora_files import SCALE_RANGE, inspect_lora, lora_problem, split_lora_tags
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, as_str, check_keys, line_of,
                                       type_name, unicode_text)
from storyboard_cli.job.yaml_loader import MESSAGE_VALUE, Located, clip, short_repr

log = logging.getLogger(__name__)

CONTROL_KEYS = ("image", "scale", "end")


@dataclass(frozen=True)
class ShotControl:
    """A shot's `control:` (the tensors a batch is conditioned on are conditioning.Control)."""

    image: Path  # absolute, resolved against the job file's folder
    scale: float
    file: str = ""  # the image as seen from the job file's folder: what the outputs record
    end: float = 1.0  # the fraction of the steps the ControlNet runs, as diffusers' control_guidance_end


@dataclass(frozen=True)
class LoraFile:
    """One entry of the job's `loras:`, checked (format, architecture) and hashed at load time."""

    name: str
    path: Path  # absolute, resolved against the job file's folder
    file: str  # as seen from the job file's folder: what the outputs record
    sha256: str  # of the tensor bytes (A1111's addnet hash): a changed file re-renders its shots
    shorthash: str  # what A1111 writes in `Lora hashes`
    text_encoders: bool  # whether it changes the prompt embeddings



def _known_lora(ctx: Context, name: Any, line: int | None, shot_id: str, field: str, loras: dict[str, LoraFile]) -> str:
    if isinstance(name, str) and name in loras:
        return name
    if not loras:
        raise ctx.fail(line, shot_id, field, f"unknown LoRA {short_repr(name)}: the job has no top-level 'loras:' "
                       f"(name: file.safetensors)")
    raise ctx.fail(line, shot_id, field, f"unknown LoRA {short_repr(name)} (the job's loras: {clip(', '.join(loras))})"
                   f"{did_you_mean(str(name), loras)}")


def shot_loras(ctx: Context, prompt: str, prompt_line: int | None, raw: Any, line: int | None, shot_id: str,
                loras: dict[str, LoraFile]) -> tuple[str, tuple[tuple[str, float], ...]]:
    """The shot's `lora:` mapping and the prompt's A1111 `<lora:name:scale>` tags, merged: (the prompt
    without its tags, ((name, scale), ...) sorted, zero scales left out). Both ways give the same image."""
    lo, hi = SCALE_RANGE
    scales: dict[str, float] = {}
    if raw is not None:
        if not isinstance(raw, dict):
            raise ctx.fail(line, shot_id, "lora", f"must be a mapping of LoRA name: scale, like {{mei: 0.8}}, "
                           f"got {type_name(raw)}")
        for name, scale in raw.items():
            name_line = line_of(raw, name, line)
            name = _known_lora(ctx, name, name_line, shot_id, "lora", loras)
            scales[name] = as_float(ctx, scale, name_line, shot_id, f"lora.{name}", lo, hi)
    try:
        text, tags = split_lora_tags(prompt)
    except ValueError as e:  # it quotes the tag, which may be most of a long prompt
        raise ctx.fail(prompt_line, shot_id, "prompt", clip(str(e), 2 * MESSAGE_VALUE)) from None
    for name, scale in tags:
        tag = f"<lora:{name}:{scale:g}>"
        _known_lora(ctx, name, prompt_line, shot_id, "prompt", loras)
        if not lo <= scale <= hi:
            raise ctx.fail(prompt_line, shot_id, "prompt", f"{tag}: the weight must be between {lo:g} and {hi:g}")
        if scales.get(name, scale) != scale:
            raise ctx.fail(prompt_line, shot_id, "prompt", f"{tag} disagrees with the scale {scales[name]:g} "
                           f"given for '{name}' (in 'lora:' or another tag); give it once")
        scales[name] = scale
    if tags and not text.strip():
        raise ctx.fail(prompt_line, shot_id, "prompt", "nothing is left once its <lora:...> tags are removed")
    return text, tuple(sorted((n, s) for n, s in scales.items() if s != 0))


def resolve_loras(ctx: Context, raw: Any, line: int | None, job_dir: Path, model: str) -> dict[str, LoraFile]:
    """The top-level `loras: {name: file.safetensors}`: every file read (header and hash, no torch) and
    checked against the job's model, so `bcg plan` finds a bad one before any model loads."""
    if raw is None:
        return {}
    if not isinstance(raw, Located):
        raise ctx.fail(line, None, "loras", f"must be a mapping of name: file.safetensors, got {type_name(raw)}")
    out = {}
    for name, rel in raw.items():
        name_line = line_of(raw, name, line)
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ctx.fail(name_line, None, f"loras.{name}", f"a LoRA name {SAFE_NAME_RULE}")
        field_name = f"loras.{name}"
        rel = as_str(ctx, rel, name_line, None, field_name, empty_ok=False)
        path, shown = ctx.input_file(rel, job_dir, name_line, None, field_name, is_file=False)
        problem = lora_problem(path, model)
        if problem:
            raise ctx.fail(name_line, None, field_name, problem.replace(path.name, Path(shown).name))
        info = inspect_lora(path)
        out[name] = LoraFile(name, path, shown, info.hash, info.shorthash, info.text_encoders)
    return out


def declared_inputs(ctx: Context, raw: Any, line: int | None) -> None:
    """The job's `inputs: {name as the job writes it: sha256}` (what `bcg submit` uploaded), added to what the
    caller knows; the caller's digest wins where both name a file."""
    if raw is None:
        return
    if not isinstance(raw, Located):
        raise ctx.fail(line, None, INPUTS_KEY, f"must be a mapping of file name: sha256, got {type_name(raw)}")
    if ctx.inputs is None:
        ctx.inputs = Inputs()
    for name, digest in raw.items():
        name_line = line_of(raw, name, line)
        if not isinstance(name, str) or not name.strip() or unicode_text(name) is None:
            raise ctx.fail(name_line, None, INPUTS_KEY, "each key must be a file name as the job writes it")
        name = unicode_text(name)
        if not is_digest(digest):
            raise ctx.fail(name_line, None, f"{INPUTS_KEY}.{name[:80]}", f"must be {DIGEST_RULE}")
        ctx.inputs.digests.setdefault(name, digest)


def resolve_control(ctx: Context, raw: Any, line: int | None, shot_id: str, job_dir: Path,
                     has_controlnet: bool) -> ShotControl:
    if not isinstance(raw, Located):
        raise ctx.fail(line, shot_id, "control", f"must be a mapping with 'image' and 'scale', got {type_name(raw)}")
    check_keys(ctx, raw, CONTROL_KEYS, shot_id, prefix="control.")
    if not has_controlnet:
        raise ctx.fail(line, shot_id, "control", "the job sets no top-level 'controlnet' model")
    image_line = line_of(raw, "image", line)
    if "image" not in raw:
        raise ctx.fail(raw.line, shot_id, "control.image", "missing")
    rel = as_str(ctx, raw["image"], image_line, shot_id, "control.image", empty_ok=False)
    path, shown = ctx.input_file(rel, job_dir, image_line, shot_id, "control.image")
    if path not in ctx.images_checked:
        _check_image(ctx, path, image_line, shot_id, shown)
        ctx.images_checked.add(path)
    scale = as_float(ctx, raw.get("scale", 1.0), line_of(raw, "scale", line), shot_id, "control.scale", 0.0, 2.0)
    end_line = line_of(raw, "end", line)
    end = as_float(ctx, raw.get("end", 1.0), end_line, shot_id, "control.end", 0.0, 1.0)
    if end <= 0:
        raise ctx.fail(end_line, shot_id, "control.end", "must be above 0 (the fraction of the steps the ControlNet "
                                                         "runs; leave out `control` for none)")
    return ShotControl(path, scale, shown, end)


def _check_image(ctx: Context, path: Path, line: int | None, shot_id: str, shown: str) -> None:
    """Decodes every pixel, so a truncated file or a broken PNG stream fails here, before any model loads,
    not in the middle of a render; the bytes read are hashed for the skip check on the way."""
    from PIL import Image, UnidentifiedImageError

    def bad(why: str) -> JobError:
        return ctx.fail(line, shot_id, "control.image", f"not a readable image: {shown} ({why})")

    try:
        data = path.read_bytes()
    except OSError as e:
        raise bad(e.strerror or e.__class__.__name__) from None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                pixels = im.width * im.height
        if any(issubclass(w.category, Image.DecompressionBombWarning) for w in caught):
            # said once, in our words (the process ignores PIL's own warning: cli.main)
            log.warning("control image %s is %.0f megapixels: each shot resizes it to its own size; a smaller "
                        "file loads faster", shown, pixels / 1e6)
    except Image.DecompressionBombError as e:
        raise bad(f"too many pixels: {e}") from None
    except UnidentifiedImageError:
        raise bad("empty file" if not data else "not a PNG, JPEG, WebP or other image file this can read") from None
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error) as e:
        raise bad(one_line(e, 120)) from None
    remember_sha256(path, data)
