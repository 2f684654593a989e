"""How far one render's pictures are from another's of the same seeds: PSNR and mean absolute difference per image
(a draft against the full render, `--fp8` against fp16 compiled), and their summary. No torch: PNGs on disk."""

from __future__ import annotations

import statistics
from pathlib import Path


def picture_drift(renders: Path, reference: Path) -> list[dict]:
    """PSNR (dB, 8-bit) and mean absolute difference (0-255) of every PNG under `renders` against the reference
    render's PNG of the same path (the same shot, candidate and seed)."""
    import numpy as np
    from PIL import Image

    rows = []
    for png in sorted(renders.glob("*/*.png")):
        rel = png.relative_to(renders)
        ref = reference / rel
        if not ref.is_file():
            continue
        a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=np.float64) for p in (png, ref))
        mse = float(((a - b) ** 2).mean())
        rows.append({"image": rel.as_posix(), "psnr_db": 10 * np.log10(255**2 / mse) if mse else float("inf"),
                     "mad": float(np.abs(a - b).mean())})
    return rows


def drift_summary(rows: list[dict]) -> dict:
    """PSNR (median, min over the finite ones) and mean absolute difference (median, max) of `picture_drift`'s
    rows."""
    if not rows:
        return {}
    finite = [d["psnr_db"] for d in rows if d["psnr_db"] != float("inf")]
    return {"psnr_db": {"median": statistics.median(finite) if finite else None, "min": min(finite, default=None)},
            "mad": {"median": statistics.median(d["mad"] for d in rows), "max": max(d["mad"] for d in rows)}}
