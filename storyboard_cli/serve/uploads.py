"""What a worker without the server's filesystem sends back with a lease: its PNGs, their manifest lines
and its report, written into the job's folder where a worker on a shared filesystem would have written
them (PNGs atomically, each manifest line after its file, the contact sheet brought up to date). Only the
lease's own outputs and the report are accepted. Torch-free."""

from __future__ import annotations

from pathlib import Path

from storyboard_cli.errors import BadInput
from storyboard_cli.folder.layout import REPORT_JSON, REPORT_MD
from storyboard_cli.folder.lock import OutputLock
from storyboard_cli.folder.outputs import Manifest, atomic_write
from storyboard_cli.folder.sink import ContactSheet
from storyboard_cli.serve.intake import served_job

REPORTS = (REPORT_JSON, REPORT_MD)


def store_file(out_dir: Path, outputs: set[str], path: str, data: bytes) -> None:
    """One uploaded file: one of the lease's outputs, or the report. Raises BadInput for any other path."""
    if path not in outputs and path not in REPORTS:
        raise BadInput(f"{path!r} is not an output of this lease nor its report")
    atomic_write(out_dir / path, data)


def record(out_dir: Path, job_file: Path, outputs: set[str], lines: list[dict]) -> None:
    """The uploaded images' manifest lines (each for an output of the lease already stored), then the
    contact sheet, under the folder's lock as a render takes it."""
    for line in lines:
        path = line.get("path") if isinstance(line, dict) else None
        if path not in outputs or not (out_dir / path).is_file():
            raise BadInput(f"manifest line for {path!r}: not an uploaded output of this lease")
    if not lines:
        return
    with OutputLock(out_dir):
        manifest = Manifest(out_dir)
        for line in lines:
            manifest.append(line)
        notes: list[str] = []
        ContactSheet(out_dir, served_job(job_file), notes).update([])  # its files from the blob store
