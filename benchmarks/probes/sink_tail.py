"""What a render's end waits for once its last batch is decoded: the sink's close (the report's exposed `save`), and
inside it the contact sheet's updates and the thumbnails made there, on the render's own path in this process.

    python benchmarks/probes/sink_tail.py OUT_DIR [JOB.yaml] [--device cpu|cuda]

Without a job: two shots of eight 1024x1024 candidates of the tiny model, two steps, buckets of eight (the size whose
PNGs and thumbnails the bench job writes). Prints one JSON line: the close's seconds, the thumbnails made inside it
(count, seconds), the sheet updates inside it, the save stage and what of it the denoising hid.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from storyboard_cli.folder import sheet, sink
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render

JOB = """version: 1
model: tiny
buckets: [8]
defaults: {steps: 2, size: 1024x1024}
shots:
  - {id: a, prompt: a castle on a hill, seed: 1, candidates: 8}
  - {id: b, prompt: a tower by the sea, seed: 7, candidates: 8}
"""
SPANS: list[tuple[str, float, float]] = []


def timed(owner, name: str, label: str, made=None) -> None:
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        what = label if made is None or made(*args) else None
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            if what is not None:
                SPANS.append((what, t0, time.perf_counter()))

    setattr(owner, name, wrapper)


def _stale(src: Path, dst: Path, src_mtime_ns: int) -> bool:
    """Whether make_thumb makes the thumbnail (rather than reading a fresh one's size)."""
    return not dst.exists() or dst.stat().st_mtime_ns < src_mtime_ns


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    device = argv[argv.index("--device") + 1] if "--device" in argv else None
    rest = [a for a in argv[1:] if a != "--device" and a != device]
    if rest:
        job_path = Path(rest[0])
    else:
        job_path = Path(tempfile.mkdtemp()) / "tail.yaml"
        job_path.write_text(JOB)
    timed(sheet, "make_thumb", "thumbnail", made=_stale)
    timed(sheet.SheetWriter, "update", "sheet update")
    timed(sink.OutputSink, "close", "close")
    result = render(load_job(job_path), RenderOptions(out_dir=out, force=True, device=device))
    close = [s for s in SPANS if s[0] == "close"][-1]
    inside = [s for s in SPANS if s[1] >= close[1] and s[2] <= close[2]]
    thumbs = [s for s in inside if s[0] == "thumbnail"]
    report = result.report
    print(json.dumps({"images": result.rendered, "wall_s": round(result.wall_s, 3),
                      "close_s": round(close[2] - close[1], 3), "thumbnails_in_close": len(thumbs),
                      "thumbnails_in_close_s": round(sum(e - s for _, s, e in thumbs), 3),
                      "sheet_updates_in_close": sum(1 for s in inside if s[0] == "sheet update"),
                      "save_s": round(report.stages_s["save"], 3), "save_hidden_s": round(report.hidden_s["save"], 3)}))


if __name__ == "__main__":
    main(sys.argv[1:])
