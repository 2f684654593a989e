"""The contact sheet's guides of a shot: what its pictures are conditioned on, each kind's (job/conditions/:
`Kind.guides`, from the job, or `Kind.meta_guides`, from an image's settings: its references, then its control guides),
shown beside its candidates, each with its caption (the character's name or "reference", the net's name; the scale;
a net's end when it stops early). No torch.

The images may live anywhere (a shared refs/ folder, another drive): each is shown through a thumbnail the sheet
writes into the shot's `thumbs/` folder, so the page links only to files under the output folder, which its content
security policy (`img-src 'self' file:`) and any static server serve. A thumbnail is named by its image's content, so
a guide swapped for another file never shows the old one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from storyboard_cli.folder.charts import esc
from storyboard_cli.job import kind
from storyboard_cli.job.conditions import shown
from storyboard_cli.job.digests import file_sha256

if TYPE_CHECKING:
    from storyboard_cli.job.file import Shot

GUIDE_PX = 96  # the height a guide is shown at, as the one control image
THUMB_PREFIX = "input-"  # <shot>/thumbs/input-<content digest>.jpg: apart from the candidates' <shot>_c<k>_s<seed>


def href(rel: str) -> str:
    """A relative file path as an escaped URL: works from file:// and through any static server."""
    return esc(quote(rel, safe="/"))


@dataclass
class Guide:
    """One image a shot's pictures are conditioned on, as the sheet shows it."""

    kind: str  # its figure's class, the first word of its alt text (job/kind.py's Guide.kind)
    image: Path  # the file the thumbnail is made from
    name: str  # the character's, the one-off's word, or the net's
    scale: float
    end: float = 1.0  # a control guide's: the fraction of the steps its net runs
    file: str = ""  # the image as the job names it (the figure's tooltip)
    thumb: str | None = None  # relative to the output folder, once made
    thumb_size: tuple[int, int] = (0, 0)
    note: str = ""  # why there is no thumbnail

    @property
    def caption(self) -> str:
        end = f" · end {self.end:g}" if self.end < 1 else ""
        return f"{self.name} · scale {self.scale:g}{end}"

    @property
    def thumb_file(self) -> str:
        """Its thumbnail's file name: by the image's bytes (cached per path, size and mtime: one stat when
        unchanged); an image that cannot be read is named by its path (it gets a note, not a thumbnail)."""
        try:
            digest = file_sha256(self.image)
        except OSError:
            digest = hashlib.sha256(str(self.image).encode()).hexdigest()
        return f"{THUMB_PREFIX}{digest[:16]}.jpg"


def _sheet(g: kind.Guide) -> Guide:
    return Guide(g.kind, g.image, g.name, g.scale, g.end, g.file)


def shot_guides(shot: Shot) -> list[Guide]:
    """A shot's guides, kind by kind in the order the sheet shows them (its references in the order it names them,
    its one-off last, then its control guides in the job's net order)."""
    return [_sheet(g) for k in shown() for g in k.guides(shot)]


def meta_guides(meta: dict, job_dir: Path | None) -> list[Guide]:
    """The same from an image's settings (its `bcg` chunk), for a folder whose job does not load. The files are
    recorded as the job names them, from its folder: `job_dir` (report.json's job file's folder) when known."""
    def at(name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() or job_dir is None else job_dir / path

    return [_sheet(g) for k in shown() for g in k.meta_guides(meta, at)]


def guides_html(shot: str, guides: list[Guide]) -> str:
    """The shot's guides as a row of captioned thumbnails (a note in place of one that could not be made), each
    linking its thumbnail."""
    h = ['<div class="guides">']
    for g in guides:
        head = f'<figure class="guide {g.kind}" title="{esc(g.file)}">'
        caption = f"<figcaption>{esc(g.caption)}</figcaption></figure>"
        if g.thumb:
            w, ht = g.thumb_size
            width = max(1, round(w * GUIDE_PX / max(ht, 1)))
            h.append(f'{head}<a href="{href(g.thumb)}"><img src="{href(g.thumb)}" width="{width}" height="{GUIDE_PX}" '
                     f'alt="{g.kind} of {esc(shot)}{"" if g.name == g.kind else f": {esc(g.name)}"}"></a>{caption}')
        else:
            h.append(f'{head}<div class="hole">{esc(g.note)}</div>{caption}')
    h.append("</div>")
    return "".join(h)
