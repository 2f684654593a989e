"""The conditioning kinds, one row each (`KINDS`): what a job's images are conditioned on beyond the prompt, the job's
half of each (its engine half is in engine/conditions/, joined by the kind's `name`). A row's module holds all the
job side knows of its kind (job/kind.py's `Kind`): its YAML keys and their checks, the fields it adds to `Job`,
`Shot`, `WorkItem` and `BucketKey`, its bucket key part, what an image records of it (settings, fingerprint, A1111
units), its models, the files `bcg submit` uploads, its report entries and table and its contact-sheet thumbnails.
The rest of the job, the folder and the service read the rows and name none of its fields (tests/test_architecture.py
holds them to it). Adding a kind (regional prompts) is one module here and one row in KINDS, with
its engine half. No torch."""

from __future__ import annotations

from dataclasses import fields

from storyboard_cli.job.conditions import control, reference, source
from storyboard_cli.job.kind import Kind

KINDS: tuple[Kind, ...] = (control.KIND, reference.KIND, source.KIND)  # in the order an image's A1111 units are written
MODULES = {"control": control, "reference": reference, "source": source}  # every module of job/conditions/, by its kind's name


def shown() -> list[Kind]:
    """The kinds in the order the contact sheet and report.md show them."""
    return sorted(KINDS, key=lambda k: k.shown)


def parts(attr: str) -> tuple[type, ...]:
    """Every kind's part of one of the job's dataclasses (`attr`: "JobPart", "ShotPart", "ItemPart", "KeyPart" or
    "SummaryPart"): that dataclass's bases."""
    return tuple(getattr(k, attr) for k in KINDS)


def kind_fields(kind: Kind) -> tuple[str, ...]:
    """Every name that is the kind's own: its parts' fields, its YAML, settings and report keys, its types'. Only its
    module and its engine half spell one (tests/test_architecture.py)."""
    names = [f.name for part in (kind.JobPart, kind.ShotPart, kind.ItemPart, kind.KeyPart, kind.SummaryPart)
             for f in fields(part)]
    return tuple(dict.fromkeys((*names, *kind.job_keys, *kind.shot_keys, *kind.settings_keys, *kind.report_keys,
                                *kind.names)))


def merged(dicts) -> dict:
    """One dict of the kinds' parts, in KINDS order."""
    out: dict = {}
    for d in dicts:
        out.update(d)
    return out
