"""A refinement (`bcg refine`): a shot rendered again from one of its candidates, written beside it under a name of
its own (folder/layout.py `refine_name`). What a shot and its images carry of it (`Refinement`) and what an image
records of it (`settings`: the source, the tag, the outline of the area repainted, which the contact sheet draws).
How the pixels start from the source and where they are repainted is the init and mask kinds' (job/conditions/).
No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Refinement:
    source: str  # the candidate refined, relative to the output folder (posix)
    tag: str  # the entry's name: its files are `<source stem>.<tag>_c<j>_s<seed>.png`
    outline: tuple[int, int, int, int] | None = None  # the repainted area's box in the source's pixels (x, y, w, h)

    def settings(self) -> dict:
        out: dict = {"source": self.source, "tag": self.tag}
        if self.outline is not None:
            out["outline"] = list(self.outline)
        return out
