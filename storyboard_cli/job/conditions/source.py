"""The source kind: a shot that starts from an image (`init: {image, strength, resize}`: img2img) and may repaint only
part of it (`mask: {image | box, blur, padding}`: inpainting on the base UNet), with diffusers' semantics
(StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline): of an S-step schedule the last
int(S * strength) steps run; with a mask, after each step the latents outside it are the source's, noised to the next
sigma; with `padding` (diffusers' `padding_mask_crop`, A1111's "Only masked") the masked area plus padding is cropped,
grown to the shot's aspect (`crop_region`, as diffusers' `VaeImageProcessor.get_crop_region`), rendered at the shot's
full size and pasted back over the source (`overlay`, as `apply_overlay`), so pixels outside the mask are the
source's. The engine half is engine/conditions/source.py. No torch (PIL and numpy)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from storyboard_cli.job.digests import SHORT
from storyboard_cli.job.files import check_image
from storyboard_cli.job.kind import Guide, Quiet, ShotSource, Weights
from storyboard_cli.job.values import Context, as_float, as_int, as_str, check_keys, given, line_of, type_name
from storyboard_cli.job.yaml_loader import Located

INIT_KEYS = ("image", "strength", "resize")
MASK_KEYS = ("image", "box", "blur", "padding")
# a source whose aspect is not the shot's: how it becomes the shot's size (diffusers' VaeImageProcessor.resize modes)
# "latent": the source encoded at its own size and its latents resized (A1111's "Latent" hires upscaler: bilinear)
RESIZE = {"stretch": "default", "crop": "crop", "fill": "fill", "latent": "latent"}
# diffusers' defaults: StableDiffusionXLImg2ImgPipeline's strength, and the inpainting pipeline's
STRENGTH, MASK_STRENGTH = 0.3, 0.9999
MAX_BLUR, MAX_PADDING = 256, 4096
SOURCE, MASK = "source", "mask"  # their words on the sheet
Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class SourceInit:
    """The image a shot starts from (`init:`)."""

    image: Path  # the file to read
    file: str  # as the job names it: what the outputs record
    sha256: str
    strength: float  # of an S-step schedule the last int(S * strength) steps run
    width: int  # the source's size
    height: int
    resize: str = ""  # a RESIZE mode, where the source's aspect is not the shot's ("" where it is)

    @property
    def resize_mode(self) -> str:
        """How the source becomes the shot's size, as diffusers' VaeImageProcessor.resize names it."""
        return RESIZE.get(self.resize, "default")


@dataclass(frozen=True)
class SourceMask:
    """What of the source a shot repaints (`mask:`): an image's white area, or a box, in the source's pixels."""

    image: Path | None
    file: str
    sha256: str
    box: Box | None  # (x, y, w, h)
    blur: int = 0  # a Gaussian blur's radius, before the mask is binarised (and as the paste's alpha)
    padding: int | None = None  # None: the whole source at the shot's size; else the cropped area, pasted back
    crop: Box | None = None  # with padding: (x1, y1, x2, y2) in the source's pixels, diffusers' get_crop_region

    def pil(self, size: tuple[int, int]):
        """The mask as a PIL "L" image at the source's `size` (a box drawn white on black), blurred where it asks
        (diffusers' `mask_processor.blur`, which a user applies before the pipeline binarises it): what the crop region
        is found on, what the engine binarises (engine/conditions/source.py) and the paste's alpha."""
        from PIL import Image, ImageDraw, ImageFilter

        if self.box is not None:
            x, y, w, h = self.box
            image = Image.new("L", size, 0)
            ImageDraw.Draw(image).rectangle((x, y, x + w - 1, y + h - 1), fill=255)
        else:
            with Image.open(self.image) as im:
                image = im.convert("L")
        return image.filter(ImageFilter.GaussianBlur(self.blur)) if self.blur else image

    @property
    def crop_size(self) -> tuple[int, int]:
        x1, y1, x2, y2 = self.crop
        return x2 - x1, y2 - y1


@dataclass(frozen=True, kw_only=True)
class JobPart:
    """Nothing at the top level: a shot (or `defaults`) names its source."""


@dataclass(frozen=True, kw_only=True)
class ShotPart:
    init: SourceInit | None = None
    mask: SourceMask | None = None


@dataclass(frozen=True, kw_only=True)
class ItemPart:
    init: SourceInit | None = None
    mask: SourceMask | None = None


@dataclass(frozen=True, kw_only=True)
class KeyPart:
    """The steps a batch skips: its rows share the schedule's tail (rows with and without a mask share a batch)."""

    init_skip: int = 0


@dataclass(frozen=True, kw_only=True)
class SummaryPart:
    init_lines: tuple[str, ...] = ()  # what `bcg plan` says of each shot that starts from a source


def skipped(steps: int, strength: float) -> int:
    """The first steps of an S-step schedule an init at `strength` skips, as diffusers' img2img `get_timesteps`."""
    return steps - min(int(steps * strength), steps)


def recorded(x: Any) -> dict:
    """What an image records of its source and mask (settings, PNG chunk, manifest) and the report lists of a shot's:
    `x` a work item or a shot."""
    s: dict = {}
    if x.init is not None:
        i = x.init
        s["init"] = {"image": i.file, "sha256": i.sha256[:SHORT], "strength": i.strength} \
            | ({"resize": i.resize} if i.resize else {})
    if x.mask is not None:
        m = x.mask
        where = {"box": list(m.box)} if m.box else {"image": m.file, "sha256": m.sha256[:SHORT]}
        s["mask"] = where | ({"blur": m.blur} if m.blur else {}) \
            | ({"padding": m.padding, "crop": list(m.crop)} if m.padding is not None else {})
    return s


def _mask_cell(mask: Any) -> str:
    """A report.md cell: the mask's box or file, and its padding (a cropped inpainting)."""
    if not isinstance(mask, dict):
        return ""
    where = f"box {mask['box']}" if mask.get("box") else str(mask.get("image", ""))
    return where + (f", padding {mask['padding']}" if mask.get("padding") is not None else "")


class Source(Quiet):
    """The kind's row (job/conditions/__init__.py's `Kind`)."""

    name = "source"
    job_keys = ()
    shot_keys = ("init", "mask")
    start_keys = shot_keys  # `init`, `mask`: refinements and hires passes start from an image through them
    settings_keys = ()
    manifest_keys = ("init", "mask")
    report_keys = ("sources",)
    names = ("SourceInit", "SourceMask", "init_lines")
    shown = 2  # after the references and the guides
    JobPart, ShotPart, ItemPart, KeyPart, SummaryPart = JobPart, ShotPart, ItemPart, KeyPart, SummaryPart

    # ------------------------------------------------------------ the YAML

    def resolve_shot(self, ctx: Context, src: ShotSource) -> tuple[dict, dict[str, float]]:
        return resolve_source(ctx, src), src.lora_scales

    def shot_files(self, key: str, value: Any) -> list:
        return [value.get("image")] if key in self.shot_keys and isinstance(value, dict) else []

    # ------------------------------------------------------------ images and batches

    def item(self, shot: Any, job: Any) -> dict:
        return {"init": shot.init, "mask": shot.mask}

    def identity(self, item: Any) -> tuple:
        return item.init, item.mask

    def key(self, item: Any) -> dict:
        return {"init_skip": skipped(item.steps, item.init.strength) if item.init else 0}

    def first(self, key: Any) -> int:
        return key.init_skip

    def label(self, key: Any) -> str:
        return f" from step {key.init_skip + 1}" if key.init_skip else ""

    # ------------------------------------------------------------ what an image records

    def settings(self, item: Any, weights: Weights) -> dict:
        return recorded(item)

    def unplaced(self, settings: dict) -> None:
        for key in self.shot_keys:
            if key in settings:
                settings[key].pop("image", None)

    def a1111(self, settings: dict) -> list[str]:
        """A1111's img2img fields: `Denoising strength`, and an inpainting's `Mask blur`, `Inpaint area: Only
        masked` and `Masked area padding`."""
        init, mask = settings.get("init"), settings.get("mask")
        out = [f"Denoising strength: {init['strength']:g}"] if isinstance(init, dict) else []
        if isinstance(mask, dict):
            out.append(f"Mask blur: {mask.get('blur', 0)}")
            if "padding" in mask:
                out += ["Inpaint area: Only masked", f"Masked area padding: {mask['padding']}"]
        return out

    def finish(self, item: Any, pixels: Any) -> Any:
        """A cropped inpainting's decoded pixels (uint8 [H, W, 3] at the shot's size) pasted back over its source
        (`overlay`): the image written, at the source's size. Others as they are."""
        if item.mask is None or item.mask.padding is None:
            return pixels
        import numpy as np
        from PIL import Image

        with Image.open(item.init.image) as im:
            source = im.convert("RGB")
        mask = item.mask.pil(source.size)
        return np.asarray(overlay(mask, source, Image.fromarray(np.asarray(pixels), "RGB"), item.mask.crop))

    def mix(self, job: Any) -> tuple[list, list]:
        return [], []

    def needs(self, job: Any) -> bool:
        return False

    def loaded(self, models: Any, job: Any) -> bool:
        return True

    # ------------------------------------------------------------ the report, the sheet, `bcg plan`

    def report(self, job: Any) -> dict:
        """`sources`: each shot that starts from an image, its source and mask as its images record them (a hires
        pass's and a refinement's are in their images' settings); None where no shot has one."""
        out = [{"shot": s.id, **recorded(s)} for s in job.shots if s.init is not None]
        return {"sources": out or None}

    def report_md(self, r: dict) -> list[str]:
        rows = [e for e in r.get("sources") or () if isinstance(e, dict) and isinstance(e.get("init"), dict)]
        if not rows:
            return []
        out = ["", "## Sources", "", "| shot | source | strength | mask |", "|---|---|---|---|"]
        return out + [f"| {e.get('shot', '')} | {e['init'].get('image', '')} | {e['init'].get('strength', '')} | "
                      f"{_mask_cell(e.get('mask'))} |" for e in rows]

    def guides(self, shot: Any) -> list[Guide]:
        """Its source (at the strength it keeps) and its mask image, as the sheet shows a shot's guides."""
        out = [Guide(SOURCE, shot.init.image, SOURCE, shot.init.strength, file=shot.init.file)] if shot.init else []
        if shot.mask is not None and shot.mask.image is not None:
            out.append(Guide(MASK, shot.mask.image, MASK, 1.0, file=shot.mask.file))
        return out

    def meta_guides(self, meta: dict, at: Callable[[str], Path]) -> list[Guide]:
        init = meta.get("init")
        if not isinstance(init, dict) or not isinstance(init.get("image"), str) or not init["image"]:
            return []
        strength = init.get("strength")
        return [Guide(SOURCE, at(init["image"]), SOURCE, strength if isinstance(strength, (int, float)) else 1.0,
                      file=init["image"])]

    def summary(self, job: Any) -> dict:
        return {"init_lines": tuple(plan_line(s) for s in job.shots if s.init is not None)}

    def notes(self, summary: Any) -> list[str]:
        return list(summary.init_lines)

    def plan_json(self, job: Any, summary: Any) -> tuple[dict, dict]:
        return {}, {}


KIND = Source()


def plan_line(shot: Any) -> str:
    """What `bcg plan` says of a shot with a source: the steps that run, what is repainted and at what size."""
    i, m = shot.init, shot.mask
    runs = shot.steps - skipped(shot.steps, i.strength)
    what = f"shot {shot.id}: {runs} of {shot.steps} steps from {i.file} ({i.width}x{i.height}, strength {i.strength:g}"
    what += f", {i.resize}" if i.resize else ""
    if m is None:
        return what + ")"
    where = f"box {','.join(map(str, m.box))}" if m.box else m.file
    if m.padding is None:
        return f"{what}), repainting {where}"
    w, h = m.crop_size
    x1, y1, _, _ = m.crop
    return f"{what}), repainting {where}: a {w}x{h} crop at {x1},{y1} rendered at {shot.width}x{shot.height}, pasted back"


# ---------------------------------------------------------------- the pixels (PIL, as diffusers' VaeImageProcessor)


def crop_region(mask, width: int, height: int, pad: int = 0) -> Box:
    """(x1, y1, x2, y2): the box around a mask's non-zero pixels, plus `pad`, grown to width:height within the
    image, exactly as diffusers' VaeImageProcessor.get_crop_region computes it (tests/test_source_parity.py)."""
    import numpy as np

    a = np.array(mask.convert("L"))
    h, w = a.shape
    cols, rows = np.flatnonzero(a.any(axis=0)), np.flatnonzero(a.any(axis=1))
    left, right = (int(cols[0]), w - 1 - int(cols[-1])) if cols.size else (w, w)
    top, bottom = (int(rows[0]), h - 1 - int(rows[-1])) if rows.size else (h, h)
    x1, y1, x2, y2 = int(max(left - pad, 0)), int(max(top - pad, 0)), int(min(w - right + pad, w)), \
        int(min(h - bottom + pad, h))
    if (x2 - x1) / (y2 - y1) > width / height:
        y1, y2 = _grow(y1, y2, int((x2 - x1) / (width / height) - (y2 - y1)), h)
    else:
        x1, x2 = _grow(x1, x2, int((y2 - y1) * (width / height) - (x2 - x1)), w)
    return x1, y1, x2, y2


def _grow(lo: int, hi: int, diff: int, limit: int) -> tuple[int, int]:
    """One axis of get_crop_region's step 3: the span grown by `diff`, half on each side, moved back inside
    [0, limit]."""
    lo, hi = lo - diff // 2, hi + diff - diff // 2
    if hi >= limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)


def resized(image, width: int, height: int, mode: str):
    """`image` at width x height in a RESIZE mode, as diffusers' VaeImageProcessor.resize (its default resample,
    Lanczos): stretched, or its aspect kept and cropped or filled."""
    from PIL import Image

    lanczos = Image.Resampling.LANCZOS
    if mode == "default":
        return image.resize((width, height), resample=lanczos, reducing_gap=None)
    ratio, src_ratio = width / height, image.width / image.height
    if mode == "crop":  # as _resize_and_crop
        src_w = width if ratio > src_ratio else image.width * height // image.height
        src_h = height if ratio <= src_ratio else image.height * width // image.width
        res = Image.new("RGB", (width, height))
        res.paste(image.resize((src_w, src_h), resample=lanczos), box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
        return res
    # fill, as _resize_and_fill: the edges stretched into the margins
    src_w = width if ratio < src_ratio else image.width * height // image.height
    src_h = height if ratio >= src_ratio else image.height * width // image.width
    small = image.resize((src_w, src_h), resample=lanczos)
    res = Image.new("RGB", (width, height))
    res.paste(small, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if ratio < src_ratio and (fill := height // 2 - src_h // 2) > 0:
        res.paste(small.resize((width, fill), box=(0, 0, width, 0)), box=(0, 0))
        res.paste(small.resize((width, fill), box=(0, small.height, width, small.height)), box=(0, fill + src_h))
    elif ratio > src_ratio and (fill := width // 2 - src_w // 2) > 0:
        res.paste(small.resize((fill, height), box=(0, 0, 0, height)), box=(0, 0))
        res.paste(small.resize((fill, height), box=(small.width, 0, small.width, height)), box=(fill + src_w, 0))
    return res


def overlay(mask, source, image, crop: Box):
    """The rendered crop pasted back over the source, as diffusers' VaeImageProcessor.apply_overlay: `image` resized
    into the crop box (mode "crop"), then the source composited over it where the mask is black (the mask's grey
    edge, a blur's, blends them). Pixels where the mask is 0 are the source's exactly."""
    from PIL import Image, ImageOps

    width, height = source.size
    kept = Image.new("RGBa", (width, height))
    kept.paste(source.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    kept = kept.convert("RGBA")
    x1, y1, x2, y2 = crop
    base = Image.new("RGBA", (width, height))
    base.paste(resized(image, x2 - x1, y2 - y1, "crop"), (x1, y1))
    out = base.convert("RGB").convert("RGBA")
    out.alpha_composite(kept)
    return out.convert("RGB")


# ---------------------------------------------------------------- reading the YAML


def resolve_source(ctx: Context, src: ShotSource) -> dict:
    """A shot's `init:` and `mask:`, checked: the files decoded, the strength, the aspect, the mask's area."""
    raw_init, init_line = src.get("init")
    raw_mask, mask_line = src.get("mask")
    if raw_init is None:
        if raw_mask is not None:
            raise ctx.fail(mask_line, src.shot_id, "mask", "needs an `init:` image: the source it repaints")
        return {}
    sid = src.shot_id
    if not isinstance(raw_init, Located):
        raise ctx.fail(init_line, sid, "init", f"must be a mapping with 'image' and 'strength', got "
                       f"{type_name(raw_init)}")
    check_keys(ctx, raw_init, INIT_KEYS, sid, prefix="init.")
    if "image" not in raw_init:
        raise ctx.fail(raw_init.line, sid, "init.image", "missing")
    path, shown, sha = check_image(ctx, raw_init["image"], line_of(raw_init, "image", init_line), sid, "init.image",
                                   src.job_dir, "it is resized to the shot's size")
    width, height = _size(path)
    strength_line = line_of(raw_init, "strength", init_line)
    strength = as_float(ctx, raw_init.get("strength", MASK_STRENGTH if raw_mask is not None else STRENGTH),
                        strength_line, sid, "init.strength", 0.0, 1.0)
    if strength <= 0:
        raise ctx.fail(strength_line, sid, "init.strength", "must be above 0 and at most 1 (the fraction of the steps "
                       "that run), got 0")
    steps = src.get("steps")[0]
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 and int(steps * strength) < 1:
        raise ctx.fail(strength_line, sid, "init.strength", f"{strength:g} of {steps} steps runs no step "
                       f"(int({steps} x {strength:g}) = 0); raise it to at least {1 / steps:.3g}")
    resize = ""
    if "resize" in raw_init:
        resize_line = line_of(raw_init, "resize", init_line)
        resize = as_str(ctx, raw_init["resize"], resize_line, sid, "init.resize", empty_ok=False)
        if resize not in RESIZE:
            raise ctx.fail(resize_line, sid, "init.resize", f"must be one of {', '.join(RESIZE)}, got {given(resize)}")
    init = SourceInit(path, shown, sha, strength, width, height, resize)
    mask = None if raw_mask is None else resolve_mask(ctx, raw_mask, mask_line, src, init)
    shot_w, shot_h = src.size
    if (mask is None or mask.padding is None) and width * shot_h != height * shot_w and not resize:
        raise ctx.fail(line_of(raw_init, "image", init_line), sid, "init.image", f"{shown} is {width}x{height}, not the "
                       f"shot's aspect ({shot_w}x{shot_h}); give `init.resize`: crop, fill or stretch")
    return {"init": init, "mask": mask}


def resolve_mask(ctx: Context, raw: Any, line: int | None, src: ShotSource, init: SourceInit) -> SourceMask:
    """`mask: {image | box: [x, y, w, h], blur, padding}` over the source `init`."""
    sid = src.shot_id
    if not isinstance(raw, Located):
        raise ctx.fail(line, sid, "mask", f"must be a mapping with 'image' or 'box', got {type_name(raw)}")
    check_keys(ctx, raw, MASK_KEYS, sid, prefix="mask.")
    if ("image" in raw) == ("box" in raw):
        raise ctx.fail(raw.line, sid, "mask", "give 'image' (white repaints) or 'box: [x, y, w, h]', one of them")
    blur = as_int(ctx, raw.get("blur", 0), line_of(raw, "blur", line), sid, "mask.blur", 0, MAX_BLUR)
    padding = raw.get("padding")
    if padding is not None:
        padding = as_int(ctx, padding, line_of(raw, "padding", line), sid, "mask.padding", 0, MAX_PADDING)
    path, shown, sha, box = None, "", "", None
    if "box" in raw:
        box_line = line_of(raw, "box", line)
        box = raw["box"]
        if not isinstance(box, list) or len(box) != 4 or any(isinstance(v, bool) or not isinstance(v, int)
                                                             for v in box):
            raise ctx.fail(box_line, sid, "mask.box", f"must be [x, y, width, height] in the source's pixels, got "
                           f"{given(box)}")
        x, y, w, h = box
        if w <= 0 or h <= 0:
            raise ctx.fail(box_line, sid, "mask.box", f"{w}x{h}: nothing to repaint")
        if x < 0 or y < 0 or x + w > init.width or y + h > init.height:
            raise ctx.fail(box_line, sid, "mask.box", f"[{x}, {y}, {w}, {h}] reaches outside the source "
                           f"({init.width}x{init.height})")
        box = (x, y, w, h)
    else:
        image_line = line_of(raw, "image", line)
        path, shown, sha = check_image(ctx, raw["image"], image_line, sid, "mask.image", src.job_dir,
                                       "it is resized to the shot's size")
        size = _size(path)
        if size != (init.width, init.height):
            raise ctx.fail(image_line, sid, "mask.image", f"{shown} is {size[0]}x{size[1]}; a mask is its source's "
                           f"size ({init.width}x{init.height})")
        if not _paints(path):
            raise ctx.fail(image_line, sid, "mask.image", f"{shown} has no white area: nothing to repaint")
    mask = SourceMask(path, shown, sha, box, blur, padding)
    if padding is None:
        return mask
    return replace(mask, crop=crop_region(mask.pil((init.width, init.height)), *src.size, padding))


def _size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def _paints(path: Path) -> bool:
    """Whether a mask image has a pixel that binarises to white (diffusers' binarize: >= 0.5)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("L").getextrema()[1] >= 128
