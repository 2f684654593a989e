"""A conditioning kind's job half, as every row of job/conditions/ (`KINDS`) holds it: the `Kind` protocol and the
values the rows hand the rest of the job, the folder and the service (`ShotSource`, `Guide`, `Unit`). No torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from storyboard_cli.job.values import Context
    from storyboard_cli.job.yaml_loader import Located

Unit = tuple[str, Any, float, float]  # an A1111 ControlNet unit: (module, model spec, weight, guidance end)
Weights = Callable[[dict, str, "str | None"], None]  # puts the digest of the weights a spec names into a settings dict


@dataclass(frozen=True)
class ShotSource:
    """What a kind's `resolve_shot` reads: a shot's (or its defaults') keys through `get(key) -> (value, line)`, the
    job so far (its kinds' job parts resolved), and the shot's LoRA scales (its `lora:` and its prompt's tags) that a
    kind may add to."""

    get: Callable[[str], tuple[Any, "int | None"]]
    shot_id: str
    size: tuple[int, int]  # the shot's (width, height)
    job_dir: Path
    job: Any  # job/file.py's Job, without the shots
    lora_scales: dict[str, float]
    lora_raw: Any  # the shot's `lora:` as written (a message names where a LoRA's scale came from)
    lora_line: int | None
    prompt_line: int | None


@dataclass(frozen=True)
class Guide:
    """One image a shot's pictures are conditioned on, as the contact sheet shows it (folder/sheet_refs.py makes its
    thumbnail and caption)."""

    kind: str  # the figure's class and the first word of its alt text ("reference", "control")
    image: Path  # the file the thumbnail is made from
    name: str  # the character's, the one-off's word, or the net's
    scale: float
    end: float = 1.0  # the fraction of the steps its network runs
    file: str = ""  # the image as the job names it (the figure's tooltip)


class Kind(Protocol):
    """A conditioning kind's job half. `job`, `shot`, `item` and `key` are job/file.py's `Job` and `Shot` and
    job/items.py's `WorkItem` and `BucketKey`, which inherit the kind's parts."""

    name: str  # joins the row with its engine half (engine/conditions/)
    job_keys: tuple[str, ...]  # its top-level YAML keys
    shot_keys: tuple[str, ...]  # its keys in a shot and in `defaults`
    settings_keys: tuple[str, ...]  # the keys its `settings` write besides its parts' field names
    manifest_keys: tuple[str, ...]  # of those, the ones a manifest line carries
    report_keys: tuple[str, ...]  # its keys in report.json (`report`)
    names: tuple[str, ...]  # its other names (types, constants) that only its module and the engine's spell
    shown: int  # where its thumbnails and tables come on the sheet and in report.md, lowest first
    # (the key naming the image a picture starts from, the key of the area it repaints) where the kind is what a
    # picture starts from (`bcg refine` and a hires pass start theirs from a candidate through it); else ()
    start_keys: tuple[str, ...]
    # whether its models, loaded for an earlier job, stay loaded for a job that names none of them: that job's images
    # render on those models as on models without them (a service's worker then loads nothing for it)
    kept_unused: bool
    JobPart: type  # the frozen, keyword-only dataclasses whose fields Job, Shot, WorkItem and BucketKey inherit
    ShotPart: type
    ItemPart: type
    KeyPart: type
    SummaryPart: type  # and PlanSummary (`bcg plan`)

    def resolve_job(self, ctx: Context, doc: Located, model: str, job_dir: Path, loras: dict) -> dict:
        """Its top-level keys, checked: its JobPart's fields."""

    def resolve_shot(self, ctx: Context, src: ShotSource) -> tuple[dict, dict[str, float]]:
        """A shot's keys, checked: (its ShotPart's fields, the shot's LoRA scales with what the kind adds)."""

    def draft(self, shot: Any, end: float) -> dict:
        """Its ShotPart's fields as `bcg render --draft` renders the shot, the guidance ending at `end`."""

    def job_files(self, doc: dict) -> list:
        """The files its top-level keys name, unvalidated (`bcg submit` uploads them)."""

    def shot_files(self, key: str, value: Any) -> list:
        """The files a shot's (or the defaults') `key` names, unvalidated; [] for a key not its own."""

    def item(self, shot: Any, job: Any) -> dict:
        """Its ItemPart's fields for each image of the shot."""

    def identity(self, item: Any) -> tuple:
        """What of it tells two otherwise identical requests apart."""

    def key(self, item: Any) -> dict:
        """Its KeyPart's fields: what the images of a batch share."""

    def first(self, key: Any) -> int:
        """The steps of the schedule a batch skips for it (an init image's strength: the rows run its tail); 0."""

    def side(self, key: Any) -> tuple[int, float]:
        """(the side networks a batch runs for it at each step, the fraction of the steps until the last ends)."""

    def side_ends(self, item: Any) -> list[float]:
        """The fraction of the steps each of an image's side networks runs (the service's work estimate)."""

    def shot_side(self, shot: Any) -> tuple[int, float]:
        """The same for a shot's images, as it applies (1.0 where they run every step)."""

    def label(self, key: Any) -> str:
        """Its part of a bucket's label ("" where the key has none of it)."""

    def settings(self, item: Any, weights: Weights) -> dict:
        """What of it decides an image's pixels, in the order written: the PNG chunk, the manifest, the fingerprint."""

    def unplaced(self, settings: dict) -> None:
        """Takes out of `settings` where its files live (the fingerprint: a moved project keeps its images)."""

    def units(self, settings: dict) -> list[Unit]:
        """Its A1111 ControlNet units, from an image's settings."""

    def plain(self, settings: dict) -> str | None:
        """The A1111 field that stands for its units where they are an image's only unit (else None)."""

    def a1111(self, settings: dict) -> list[str]:
        """Its A1111 infotext fields besides its units (`Denoising strength: 0.5`), from an image's settings."""

    def finish(self, item: Any, pixels: Any) -> Any:
        """An image's decoded pixels (uint8 [H, W, 3], numpy) as they are written (a cropped inpainting pasted back
        over its source); `pixels` itself where the kind leaves them."""

    def boxes(self, meta: dict) -> list[Any]:
        """The parts of the frame it draws on a candidate on the contact sheet (job/conditions/region.py Box: in
        fractions of the frame, with a caption), from the image's settings."""

    def meta_side(self, meta: dict) -> tuple[bool, float]:
        """`side` from an image's settings: (whether it runs a side network, where the last ends)."""

    def models(self, job: Any) -> list[tuple[str, str | None]]:
        """(field, spec) of each model it names, as `check_models` and the service's model checks read them."""

    def mix(self, job: Any) -> tuple[list, list]:
        """Its models in the service's mix key: (those beside the job's model, those after the rest)."""

    def used_models(self, job: Any, items: list) -> tuple:
        """Its arguments to the loader (models/loader.py's load_sdxl, in KINDS order, after the model) for these
        items: nothing loads where none uses the kind. A tuple in it is a list of specs."""

    def needs(self, job: Any) -> bool:
        """Whether the job's images may need the kind's models."""

    def loaded(self, models: Any, job: Any) -> bool:
        """Whether loaded models (models/loader.py's SdxlModels) hold what the job's images need of the kind."""

    def report(self, job: Any) -> dict:
        """Its report.json entries (each None where the job has none)."""

    def report_md(self, report: dict) -> list[str]:
        """Its tables in report.md, from report.json's entries."""

    def guides(self, shot: Any) -> list[Guide]:
        """Its images on the contact sheet, from the job."""

    def meta_guides(self, meta: dict, at: Callable[[str], Path]) -> list[Guide]:
        """The same from an image's settings (`at`: a recorded file's path)."""

    def summary(self, job: Any) -> dict:
        """Its SummaryPart's fields: what `bcg plan` says of it."""

    def notes(self, summary: Any) -> list[str]:
        """What `bcg plan` and its --json say of it, once (from its summary part)."""

    def plan_json(self, job: Any, summary: Any) -> tuple[dict, dict]:
        """Its keys in `bcg plan --json`: (those beside the model, those at the end)."""


def entries(raw: object, key: str) -> list[dict]:
    """The entries of a settings list that name their file at `key` (a damaged chunk's others are left out)."""
    return [e for e in raw if isinstance(e, dict) and isinstance(e.get(key), str) and e[key]] \
        if isinstance(raw, list) else []


def number(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def sortable(value: object) -> float:
    """A recorded number as max() compares it (a damaged one lowest)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0


class Quiet:
    """The no-op answers a kind's row inherits for what it does not take part in (no job keys, no side network, no
    steps skipped, no A1111 fields, no boxes on the sheet...): a row overrides what it does."""

    start_keys: tuple[str, ...] = ()
    kept_unused: bool = True  # a kind without models has none to drop

    def resolve_job(self, ctx: Any, doc: Any, model: str, job_dir: Path, loras: dict) -> dict:
        return {}

    def draft(self, shot: Any, end: float) -> dict:
        return {}

    def job_files(self, doc: dict) -> list:
        return []

    def key(self, item: Any) -> dict:
        return {}

    def first(self, key: Any) -> int:
        return 0

    def side(self, key: Any) -> tuple[int, float]:
        return 0, 1.0

    def side_ends(self, item: Any) -> list[float]:
        return []

    def shot_side(self, shot: Any) -> tuple[int, float]:
        return 0, 1.0

    def label(self, key: Any) -> str:
        return ""

    def units(self, settings: dict) -> list:
        return []

    def plain(self, settings: dict) -> str | None:
        return None

    def a1111(self, settings: dict) -> list[str]:
        return []

    def finish(self, item: Any, pixels: Any) -> Any:
        return pixels

    def boxes(self, meta: dict) -> list:
        return []

    def meta_side(self, meta: dict) -> tuple[bool, float]:
        return False, 1.0

    def models(self, job: Any) -> list[tuple[str, str | None]]:
        return []

    def used_models(self, job: Any, items: list) -> tuple:
        return ()

    def notes(self, summary: Any) -> list[str]:
        return []
