"""Hand-written SVG charts: horizontal bars and lines, no library. The contact sheet draws a render's
figures with them (`report_svgs`), the bench its records (`bench_svgs`)."""

from __future__ import annotations

import html
import math

PALETTE = ("#3b6ea5", "#d0703a", "#4f9a5b", "#9b59b6", "#c0392b", "#7f8c8d")


def esc(value: object) -> str:
    """Text or attribute value, HTML-escaped (quotes too)."""
    return html.escape(str(value), quote=True)


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
    return f"{v:,.{min(digits, 4)}f}"


def _svg(title: str, width: int, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="{esc(title)}" '
            f'font-family="system-ui, sans-serif" font-size="12"><title>{esc(title)}</title>'
            f'<text x="0" y="14" font-weight="bold" font-size="13">{esc(title)}</text>' + "".join(body) + "</svg>")


def hbar_svg(title: str, rows: list[tuple[str, float, str]], width: int = 560) -> str:
    """Horizontal bars: (label, value, value text) per row, scaled to the largest value."""
    bar, gap, top = 16, 6, 26
    label_w = min(480, 12 + 7 * max((len(r[0]) for r in rows), default=4))
    width = max(width, label_w + 260)  # long labels (bucket names with LoRA sets) widen the chart, never clip
    room = width - label_w - 70
    vmax = max((r[1] for r in rows if r[1] > 0), default=1.0)
    body = []
    for i, (label, value, text) in enumerate(rows):
        y = top + i * (bar + gap)
        w = room * max(value, 0) / vmax
        body.append(f'<text x="{label_w - 6}" y="{_num(y + 12)}" text-anchor="end">{esc(label)}</text>'
                    f'<rect x="{label_w}" y="{y}" width="{_num(w)}" height="{bar}" fill="{PALETTE[0]}"/>'
                    f'<text x="{_num(label_w + w + 4)}" y="{_num(y + 12)}">{esc(text)}</text>')
    return _svg(title, width, top + len(rows) * (bar + gap) + 4, body)


def line_svg(title: str, xs: list[str], series: list[tuple[str, list[float | None]]], y_label: str,
             width: int = 560, height: int = 260) -> str:
    """One line per series over categorical x positions; a None point is left out."""
    left, right, top, bottom = 64, 16, 40, 36
    values = [v for _, vs in series for v in vs if v is not None]
    vmax = max(values, default=1.0) * 1.1 or 1.0
    pw, ph = width - left - right, height - top - bottom

    def px(i: int) -> float:
        return left + (pw * (i + 0.5) / max(len(xs), 1))

    def py(v: float) -> float:
        return top + ph * (1 - v / vmax)

    body = [f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#444"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#444"/>',
            f'<text x="12" y="{_num(top + ph / 2)}" transform="rotate(-90 12 {_num(top + ph / 2)})" '
            f'text-anchor="middle">{esc(y_label)}</text>']
    for t in range(5):
        v = vmax * t / 4
        body.append(f'<line x1="{left - 4}" y1="{_num(py(v))}" x2="{left + pw}" y2="{_num(py(v))}" '
                    f'stroke="#ddd"/><text x="{left - 6}" y="{_num(py(v) + 4)}" text-anchor="end">{_fmt(v)}</text>')
    for i, x in enumerate(xs):
        body.append(f'<text x="{_num(px(i))}" y="{top + ph + 16}" text-anchor="middle">{esc(x)}</text>')
    for n, (name, vs) in enumerate(series):
        color = PALETTE[n % len(PALETTE)]
        pts = [(px(i), py(v), v) for i, v in enumerate(vs) if v is not None]
        if pts:
            body.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                        + " ".join(f"{_num(x)},{_num(y)}" for x, y, _ in pts) + '"/>')
        for x, y, v in pts:
            body.append(f'<circle cx="{_num(x)}" cy="{_num(y)}" r="3" fill="{color}"/>'
                        f'<text x="{_num(x)}" y="{_num(y - 7)}" text-anchor="middle" fill="{color}">{_fmt(v)}</text>')
        lx = left + 8 + n * 150
        body.append(f'<rect x="{lx}" y="22" width="10" height="10" fill="{color}"/>'
                    f'<text x="{lx + 14}" y="31">{esc(name)}</text>')
    return _svg(title, width, height, body)


def report_svgs(report: dict) -> list[str]:
    """The run's figures: images/s (the run and each bucket's denoising), stage seconds, ms/step per bucket."""
    charts = []
    buckets = [b for b in report.get("buckets", []) if isinstance(b, dict)]
    rate = [("whole run (wall)", float(report.get("images_per_s") or 0), f"{report.get('images_per_s', 0):.3g}")]
    rate += [(str(b.get("bucket")), b["images"] / b["denoise_s"], f"{b['images'] / b['denoise_s']:.3g}")
             for b in buckets if b.get("denoise_s") and b.get("images")]
    charts.append(hbar_svg("images/s (buckets: while denoising)", rate))
    stages = report.get("stages_s") or {}
    if stages:
        charts.append(hbar_svg(f"stages, s (wall {report.get('wall_s', 0):.1f} s)",
                               [(str(k), float(v or 0), f"{float(v or 0):.2f}") for k, v in stages.items()]))
    if buckets:
        charts.append(hbar_svg("denoise ms/step per bucket",
                               [(str(b.get("bucket")), float(b.get("ms_per_step") or 0),
                                 f"{float(b.get('ms_per_step') or 0):.1f}") for b in buckets]))
    return charts


def bench_svgs(rec: dict, names: dict[str, str] | None = None) -> dict[str, str]:
    """SVGs for a bench record: `contenders` (images/s of every contender in the record) and, per step
    curve measured (`step_curve`, `step_curve_control`), throughput against batch size."""
    names = names or {}
    out = {}
    contenders = sorted(k for k, v in rec.items() if isinstance(v, dict) and isinstance(v.get("images_per_s"),
                                                                                         (int, float)))
    if contenders:
        out["contenders"] = hbar_svg(f"images/s on {rec.get('device', '?')}, {rec.get('images', '?')} images",
                                     [(names.get(k, k.replace("_", " ")), float(rec[k]["images_per_s"]),
                                       f"{rec[k]['images_per_s']:.3f}") for k in contenders])
    for key in ("step_curve", "step_curve_control"):
        rows = [r for r in rec.get(key) or [] if isinstance(r, dict) and r.get("batch")]
        if not rows:
            continue

        def per_s(ms, b):  # image-steps per second: images in the batch over the step's time
            return 1000 * b / ms if ms else None

        out[key] = line_svg(f"UNet throughput vs batch ({key.replace('_', ' ')})", [str(r["batch"]) for r in rows],
                            [("graph", [per_s(r.get("graph_ms"), r["batch"]) for r in rows]),
                             ("eager", [per_s(r.get("eager_ms"), r["batch"]) for r in rows])],
                            "image-steps/s")
    return out
