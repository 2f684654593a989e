"""The regional prompt kind: a shot's `regions:` (at most REGION_SLOTS), each a part of the frame (`box: [x, y, w, h]`
in pixels, or in fractions of the frame when all four are <= 1; or `mask: IMAGE`, its white pixels) with its own
`prompt` and, optionally, the references drawn there (`characters: [...]` or `reference: {image, scale}`: an IP-Adapter
reference applied inside the region alone). The shot's `prompt` stays the common one, seen everywhere; its negative
prompt and its pooled embedding stay the shot's (SDXL's pooled text cannot be split). No per-region LoRA: a LoRA
changes the weights every token goes through. All an image records of them. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from storyboard_cli.job.conditions.reference import Reference, adapter_settings, shot_references
from storyboard_cli.job.digests import SHORT
from storyboard_cli.job.files import check_image
from storyboard_cli.job.kind import Guide, Quiet, ShotSource, Unit, Weights, entries, number
from storyboard_cli.job.values import Context, as_str, check_keys, line_of, type_name
from storyboard_cli.job.yaml_loader import Located
from storyboard_cli.models.tokenizers import CLIP_TOKENS

REGION_SLOTS = 4  # regions one shot may have; the step's region keys are one prompt of 77 tokens per slot, and a
# job's models take as many slots as its shots have regions at most (`slots`): two regions cost two slots' keys
REGION_REFERENCES = 4  # references all of a shot's regions may use together (the step's regional reference slots)
REGION_KEYS = ("box", "mask", "prompt", "characters", "reference")
MASK_USE = "each shot resizes it to its own size and takes its pixels of 128 and more"  # a very large mask's warning
MASK_LEVEL = 128  # a mask's pixels at this grey level and above are inside the region



def slots(shots: Any) -> int:
    """The region slots a job's models take: the most regions any of `shots` (shots or work items) has; 0 for none.
    Every row's key is this many prompts of 77 tokens after its own (the masked attention costs in proportion)."""
    return max((len(s.regions) for s in shots), default=0)

@dataclass(frozen=True)
class Region:
    """One part of a shot's frame with its own prompt (and references)."""

    prompt: str
    box: tuple[int, int, int, int]  # x, y, w, h in the shot's pixels (a mask's: its white pixels' bounding box)
    mask: Path | None = None  # absolute: the mask image, where the region is one
    mask_file: str = ""  # as seen from the job file's folder: what the outputs record
    mask_sha256: str = ""
    references: tuple[Reference, ...] = ()  # its characters' in the order it names them, then its `reference:`
    characters: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class JobPart:
    """Nothing at the top level: regions are a shot's."""


@dataclass(frozen=True, kw_only=True)
class ShotPart:
    regions: tuple[Region, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ItemPart:
    regions: tuple[Region, ...] = ()
    region_adapter: tuple[str, str | None] | None = None  # the job's (ip_adapter, image_encoder) where a region has
    # a reference


@dataclass(frozen=True, kw_only=True)
class KeyPart:
    """Nothing: rows with and without regions share a batch (and a graph: a row's unused slots are masked)."""


@dataclass(frozen=True, kw_only=True)
class SummaryPart:
    regions: tuple[tuple[str, int], ...] = ()  # (shot, its regions) for each shot with regions, in shot order


@dataclass(frozen=True)
class Box:
    """A region as the contact sheet draws it on a candidate: in fractions of the frame, with its caption."""

    x: float
    y: float
    w: float
    h: float
    caption: str


class Regions(Quiet):
    """The kind's row (job/kind.py's `Kind`)."""

    name = "region"
    job_keys = ()
    shot_keys = ("regions",)
    settings_keys = ()
    manifest_keys = ("regions",)
    report_keys = ("regions",)
    names = ("Region", "REGION_SLOTS", "REGION_REFERENCES")
    shown = 2  # after the references and the guides
    JobPart, ShotPart, ItemPart, KeyPart, SummaryPart = JobPart, ShotPart, ItemPart, KeyPart, SummaryPart

    # ------------------------------------------------------------ the YAML

    def resolve_shot(self, ctx: Context, src: ShotSource) -> tuple[dict, dict[str, float]]:
        raw, line = src.get("regions")
        return {"regions": resolve_regions(ctx, raw, line, src)}, src.lora_scales

    def shot_files(self, key: str, value: Any) -> list:
        """Each region's mask and reference image, unvalidated (a character's reference is the job's)."""
        if key != "regions" or not isinstance(value, list):
            return []
        out = []
        for r in value:
            if isinstance(r, dict):
                out.append(r.get("mask"))
                ref = r.get("reference")
                out.append(ref.get("image") if isinstance(ref, dict) else ref)
        return out

    # ------------------------------------------------------------ images and batches

    def item(self, shot: Any, job: Any) -> dict:
        refs = any(r.references for r in shot.regions)
        return {"regions": shot.regions, "region_adapter": (job.ip_adapter, job.image_encoder) if refs else None}

    def identity(self, item: Any) -> tuple:
        return tuple((r.prompt, r.box, r.mask_sha256, tuple((x.sha256, x.scale) for x in r.references))
                     for r in item.regions)

    # ------------------------------------------------------------ what an image records

    def settings(self, item: Any, weights: Weights) -> dict:
        """`regions`, only where the image has some: a job without regions keeps its fingerprints."""
        if not item.regions:
            return {}
        s = adapter_settings(*item.region_adapter, weights) if item.region_adapter else {}  # as a reference's
        return s | {"regions": [region_settings(r) for r in item.regions]}

    def unplaced(self, settings: dict) -> None:
        for entry in settings.get("regions", ()):
            entry.pop("mask", None)
            for ref in entry.get("references", ()):
                ref.pop("file")

    def units(self, settings: dict) -> list[Unit]:
        """One IP-Adapter unit per regional reference, at its own scale (sd-webui-controlnet's units have no
        region: the `Regions:` field says where each goes)."""
        return [("ip-adapter-auto", settings.get("ip_adapter"), number(ref.get("scale"), 0.0), 1.0)
                for r in _regions(settings) for ref in entries(r.get("references"), "file")]

    def a1111(self, settings: dict) -> list[str]:
        """The A1111 `Regions:` field: each region's place and prompt (`box x,y,w,h` or `mask FILE`), JSON-quoted
        as A1111's infotext_utils.quote does a value that holds ':' and ','."""
        shown = [f"{_where(r)}: {r.get('prompt', '')}" for r in _regions(settings)]
        return [f"Regions: {json.dumps('; '.join(shown))}"] if shown else []

    def needs(self, job: Any) -> bool:
        return any(s.regions for s in job.shots)

    def loaded(self, models: Any, job: Any) -> bool:
        """Whether loaded models (models/loader.py's SdxlModels) were made for the job's regions: their attention, with
        as many region slots as its shots have regions at most."""
        layout = models.region_layout
        return layout is not None and layout.slots >= slots(job.shots)

    def mix(self, job: Any) -> tuple[list, list]:
        """A job with regions is its own mix, by its slots (its worker's UNet takes the regions' attention with that
        many region keys); a job without keeps its key."""
        return [], [f"regions {slots(job.shots)}"] if self.needs(job) else []

    def used_models(self, job: Any, items: list) -> tuple:
        """(the region slots the UNet's attention takes: the most regions an item has, 0 for none,)."""
        return (slots(items),)

    # ------------------------------------------------------------ the report, the sheet, `bcg plan`

    def report(self, job: Any) -> dict:
        """`regions`: each shot's, as its images record them; None where no shot has any (report.json leaves it out)."""
        out = [{"shot": s.id, "regions": [region_settings(r) for r in s.regions]} for s in job.shots if s.regions]
        return {"regions": out or None}

    def report_md(self, r: dict) -> list[str]:
        rows = [(e.get("shot", ""), x) for e in r.get("regions") or () if isinstance(e, dict)
                for x in _regions(e)]
        if not rows:
            return []
        out = ["", "## Regions", "", "| shot | where | prompt | references |", "|---|---|---|---|"]
        return out + [f"| {shot} | {_where(x)} | {x.get('prompt', '')} | "
                      f"{', '.join(_ref_name(ref) for ref in entries(x.get('references'), 'file'))} |"
                      for shot, x in rows]

    def guides(self, shot: Any) -> list[Guide]:
        """Its masks and regional references, each captioned with its region."""
        out = []
        for i, r in enumerate(shot.regions):
            if r.mask is not None:
                out.append(Guide(REGION, r.mask, f"region {i + 1}", 1.0, file=r.mask_file))
            out += [Guide(REFERENCE, x.image, f"region {i + 1}: {x.character or 'reference'}", x.scale, file=x.file)
                    for x in r.references]
        return out

    def meta_guides(self, meta: dict, at: Callable[[str], Path]) -> list[Guide]:
        out = []
        for i, r in enumerate(_regions(meta)):
            if isinstance(r.get("mask"), str) and r["mask"]:
                out.append(Guide(REGION, at(r["mask"]), f"region {i + 1}", 1.0, file=r["mask"]))
            out += [Guide(REFERENCE, at(x["file"]), f"region {i + 1}: {x.get('character') or 'reference'}",
                          number(x.get("scale"), 0.0), file=x["file"]) for x in entries(r.get("references"), "file")]
        return out

    def boxes(self, meta: dict) -> list[Box]:
        """Each region's box on a candidate (from its image's settings), captioned with its number and prompt."""
        w, h = number(meta.get("width"), 0.0), number(meta.get("height"), 0.0)
        if w <= 0 or h <= 0:
            return []
        out = []
        for i, r in enumerate(_regions(meta)):
            box = r.get("box")
            if isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box):
                out.append(Box(box[0] / w, box[1] / h, box[2] / w, box[3] / h, f"{i + 1}: {r.get('prompt', '')}"))
        return out

    def summary(self, job: Any) -> dict:
        return {"regions": tuple((s.id, len(s.regions)) for s in job.shots if s.regions)}

    def notes(self, summary: Any) -> list[str]:
        """`bcg plan`'s line: the regions per shot."""
        if not summary.regions:
            return []
        listed = ", ".join(f"{shot} {n}" for shot, n in summary.regions[:8])
        more = f" and {len(summary.regions) - 8} more shots" if len(summary.regions) > 8 else ""
        return [f"regions per shot: {listed}{more}"]

    def plan_json(self, job: Any, summary: Any) -> tuple[dict, dict]:
        if not summary.regions:
            return {}, {}
        return {}, {"regions": {shot: n for shot, n in summary.regions}}


KIND = Regions()
REGION = "region"  # a mask's word on the sheet
REFERENCE = "reference"


def region_settings(r: Region) -> dict:
    s: dict = {"prompt": r.prompt, "box": list(r.box)}
    if r.mask is not None:
        s["mask"] = r.mask_file
        s["mask_sha256"] = r.mask_sha256[:SHORT]
    if r.references:
        s["references"] = [{"file": x.file, "sha256": x.sha256[:SHORT], "scale": x.scale}
                           | ({"character": x.character} if x.character else {}) for x in r.references]
    return s


def _regions(settings: dict) -> list[dict]:
    raw = settings.get("regions")
    return [r for r in raw if isinstance(r, dict)] if isinstance(raw, list) else []


def _where(r: dict) -> str:
    if isinstance(r.get("mask"), str) and r["mask"]:
        return f"mask {r['mask']}"
    box = r.get("box")
    return "box " + ",".join(f"{v:g}" for v in box) if isinstance(box, list) else "box ?"


def _ref_name(ref: dict) -> str:
    return f"{ref.get('character') or Path(ref['file']).name} {number(ref.get('scale'), 0.0):g}"


# ---------------------------------------------------------------- checks

def resolve_regions(ctx: Context, raw: Any, line: int | None, src: ShotSource) -> tuple[Region, ...]:
    """A shot's `regions:` list, checked: each at `regions[i]`, its box inside the frame, its prompt within CLIP's
    77 tokens, its characters known, its references given an IP-Adapter."""
    shot_id = src.shot_id
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ctx.fail(line, shot_id, "regions", f"must be a list of regions like [{{box: [0, 0, 0.5, 1], prompt: "
                       f"...}}], got {type_name(raw)}")
    if len(raw) > REGION_SLOTS:
        raise ctx.fail(line, shot_id, "regions", f"{len(raw)} regions; a shot may have at most {REGION_SLOTS}")
    regions = [_region(ctx, r, line, i, src) for i, r in enumerate(raw)]
    used = sum(len(r.references) for r in regions)
    if used > REGION_REFERENCES:
        raise ctx.fail(line, shot_id, "regions", f"{used} references in its regions; a shot's regions may use at "
                       f"most {REGION_REFERENCES}")
    return tuple(regions)


def _region(ctx: Context, raw: Any, list_line: int | None, i: int, src: ShotSource) -> Region:
    shot_id, field = src.shot_id, f"regions[{i}]"
    if not isinstance(raw, Located):
        raise ctx.fail(list_line, shot_id, field, f"must be a mapping like {{box: [0, 0, 0.5, 1], prompt: ...}}, "
                       f"got {type_name(raw)}")
    check_keys(ctx, raw, REGION_KEYS, shot_id, prefix=f"{field}.")
    at = raw.line
    if "prompt" not in raw:
        raise ctx.fail(at, shot_id, f"{field}.prompt", "missing (what the region shows)")
    prompt_line = line_of(raw, "prompt", at)
    prompt = as_str(ctx, raw["prompt"], prompt_line, shot_id, f"{field}.prompt", empty_ok=False)
    _check_tokens(ctx, prompt, prompt_line, shot_id, f"{field}.prompt", src)
    if ("box" in raw) == ("mask" in raw):
        raise ctx.fail(at, shot_id, field, "give one of 'box: [x, y, w, h]' or 'mask: IMAGE'")
    mask = mask_file = mask_sha256 = None
    if "box" in raw:
        box = _box(ctx, raw["box"], line_of(raw, "box", at), shot_id, f"{field}.box", *src.size)
    else:
        mask_line = line_of(raw, "mask", at)
        mask, mask_file, mask_sha256 = check_image(ctx, raw["mask"], mask_line, shot_id, f"{field}.mask",
                                                   src.job_dir, MASK_USE)
        box = mask_box(mask, *src.size)
        if box is None:
            raise ctx.fail(mask_line, shot_id, f"{field}.mask", f"an empty mask: {mask_file} has no pixel of grey "
                           f"level {MASK_LEVEL} or more at the shot's size {src.size[0]}x{src.size[1]}")
    names_raw, names_line = raw.get("characters"), line_of(raw, "characters", at)
    ref_raw, ref_line = raw.get("reference"), line_of(raw, "reference", at)
    names, references = shot_references(ctx, names_raw, names_line, ref_raw, ref_line, shot_id, src.job_dir,
                                        src.job.characters, src.job.ip_adapter, f"{field}.")
    return Region(prompt, box, mask, mask_file or "", mask_sha256 or "", references, names)


def _box(ctx: Context, raw: Any, line: int | None, shot_id: str, field: str, width: int,
         height: int) -> tuple[int, int, int, int]:
    """[x, y, w, h] in pixels, or fractions of the frame when all four are <= 1 -> pixels inside the frame."""
    if (not isinstance(raw, list) or len(raw) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw)):
        raise ctx.fail(line, shot_id, field, f"must be four numbers [x, y, w, h] (pixels, or fractions of the frame "
                       f"when all are <= 1), got {json.dumps(raw) if isinstance(raw, list) else type_name(raw)}")
    if any(v != v or v in (float("inf"), float("-inf")) for v in raw):
        raise ctx.fail(line, shot_id, field, "must be finite numbers")
    if all(abs(v) <= 1 for v in raw):
        x, y, w, h = raw[0] * width, raw[1] * height, raw[2] * width, raw[3] * height
    else:
        x, y, w, h = raw
    px = tuple(int(round(v)) for v in (x, y, w, h))
    if px[2] <= 0 or px[3] <= 0:
        raise ctx.fail(line, shot_id, field, f"a box of zero area ({px[2]}x{px[3]} pixels)")
    if px[0] < 0 or px[1] < 0 or px[0] + px[2] > width or px[1] + px[3] > height:
        raise ctx.fail(line, shot_id, field, f"the box {list(px)} (x, y, w, h in pixels) lies outside the "
                       f"{width}x{height} frame")
    return px  # type: ignore[return-value]


def mask_box(path: Path, width: int, height: int) -> tuple[int, int, int, int] | None:
    """The bounding box (x, y, w, h) of a mask's pixels at MASK_LEVEL and above once resized to the frame, as the
    engine reads it (engine/conditions/region.py); None for an empty mask."""
    from PIL import Image

    with Image.open(path) as im:
        grey = im.convert("L").resize((width, height), Image.Resampling.BILINEAR)
    bbox = grey.point(lambda v: 255 if v >= MASK_LEVEL else 0).getbbox()
    return None if bbox is None else (bbox[0], bbox[1], bbox[2] - bbox[0], bbox[3] - bbox[1])


def _check_tokens(ctx: Context, prompt: str, line: int | None, shot_id: str, field: str, src: ShotSource) -> None:
    """A region's prompt is one slot of CLIP_TOKENS tokens: longer is refused (the shot's own prompt is cut with a
    warning; a region's words past the slot would be lost without one)."""
    if len(prompt) <= CLIP_TOKENS - 2 or len("".join(prompt.split()).encode()) <= CLIP_TOKENS - 2:
        return  # a token is at least one byte of a word: this fits without asking the tokenizer
    from storyboard_cli.job.preflight import job_spec
    from storyboard_cli.job.tokens import token_count, tokenizer_for

    tokens = token_count(tokenizer_for(job_spec(src.job.model, src.job.folder)), prompt)
    if tokens > CLIP_TOKENS:
        raise ctx.fail(line, shot_id, field, f"{tokens} tokens; a region's prompt is one slot of {CLIP_TOKENS} "
                       f"(with the start and end tokens): shorten it")

