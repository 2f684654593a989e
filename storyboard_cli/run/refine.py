"""`bcg refine`: the refinements of a render's candidates rendered into its folder (folder/refines.py makes their
job). A `RenderSession` whose folder stays the render's: its report.json is the render's (a refinement run's report
is returned, not written), and its contact sheet is built from the folder's own job, each refinement shown after its
source."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from storyboard_cli.folder.refines import load_refines, refine_job
from storyboard_cli.folder.report import Report, job_of_folder
from storyboard_cli.folder.sink import ContactSheet
from storyboard_cli.errors import BadInput
from storyboard_cli.job.file import Job
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.run.render import Event, RenderOptions, RenderResult, RenderSession


class RefineSession(RenderSession):
    def __init__(self, job: Job, folder_job: Job, opts: RenderOptions, on_event: Callable[[Event], None] | None = None,
                 models: SdxlModels | None = None):
        super().__init__(job, opts, on_event, models)
        self.sheet = ContactSheet(self.out_dir, folder_job, self.notes)  # the folder's rows, not the refinements'

    def publish(self, report: Report, keep_last: bool) -> tuple[Report, None]:
        return report, None  # the folder's report stays the render's


def refine(out_dir: Path, refines: Path, opts: RenderOptions, draft: bool = False,
           on_event: Callable[[Event], None] | None = None, models: SdxlModels | None = None) -> RenderResult:
    """Reads REFINES.yaml against the folder and its job, then renders what is not on disk yet."""
    folder_job = job_of_folder(out_dir)
    if folder_job is None:
        raise BadInput(f"{out_dir}: no job to refine (its report names none that loads); render it first")
    job = refine_job(folder_job, out_dir, load_refines(refines, out_dir, folder_job), refines, draft)
    return RefineSession(job, folder_job, RenderOptions(**{**opts.__dict__, "out_dir": out_dir}), on_event,
                         models).execute()
