"""`bcg bench`'s record as Markdown, and the contenders' names in it and in the charts."""

from __future__ import annotations

import json


NAMES = {"a_diffusers": "(a) diffusers pipeline loop", "b_compile_first": "(b) + torch.compile, first pass",
         "b_compile_steady": "(b) + torch.compile, steady state", "c_bcg_cold": "(c) bcg render, cold",
         "d_bcg_warm": "(d) bcg render after capture --warm",
         "e_bcg_compiled": "(e) bcg render, compiled kernels from the cache",
         "f_bcg_fp8": "(f) bcg render --fp8, FP8 UNet kernels from the cache"}


def _draft_markdown(rec: dict) -> list[str]:
    out = []
    if "draft_steps" in rec:
        d = rec["draft_steps"]
        out += [f"Draft levers, per image-step ({d['shape']}, {d['steps']}-step loops, {d['engine']}, median of "
                f"{d['repeats']}):", "", "| loop | guided steps | ms per image-step | vs full |", "|---|---:|---:|---:|"]
        out += [f"| {n} | {d['guided_steps'][n]}/{d['steps']} | {m:.2f} | {d['speedup_vs_full'][n]:.2f}x |"
                for n, m in d["ms_per_image_step"].items()] + [""]
    if "draft_capture" in rec and "plain" in rec["draft_capture"]:
        c = rec["draft_capture"]
        out += [f"Capture of the bench job's graphs: today's {c['plain']['graphs']} in {c['plain']['capture_s']:.2f} s, "
                f"pool {c['plain']['pool_mb']:.0f} MB; the draft kinds add {c['extra']['graphs']} graphs, "
                f"{c['extra']['capture_s']:.2f} s, {c['extra']['pool_mb']:.0f} MB of pool (and DeepCache's feature buffer, "
                f"{c['feature_buffer_mb']:.0f} MB, outside the pool); warm-up steps {c['plain']['warmups']} and "
                f"{c['extra']['warmups']}"]
        if "together" in c:
            t = c["together"]
            out += [f"Both in one prepare: today's {t['plain']['capture_s']:.2f} s, {t['plain']['pool_mb']:.0f} MB; "
                    f"the draft kinds {t['extra']['capture_s']:.2f} s, {t['extra']['pool_mb']:.0f} MB"]
            if t.get("against_today_alone", {}).get("pool_ratio") is not None:
                a = t["against_today_alone"]
                out += [f"All {a['graphs']} graphs in one prepare against today's alone: capture {a['capture_s']:.2f} s "
                        f"({a['capture_ratio']:+.0%}), pool {a['pool_mb']:.0f} MB ({a['pool_ratio']:+.1%})"]
        out += [""]
    if "draft_job" in rec:
        j = rec["draft_job"]
        out += [f"Bench job with `--draft`: {j['draft']['images_per_s']:.3f} images/s against "
                f"{j['full']['images_per_s']:.3f} without = **{j['ratio']:.3f}x** (denoising {j['denoise_ratio']:.3f}x); "
                f"drift of each draft against the full image of its seed: PSNR {json.dumps(j.get('psnr_db'))} dB, "
                f"mean absolute difference {json.dumps(j.get('mad'))} (0-255)", "",
                "| image | PSNR dB | MAD |", "|---|---:|---:|"]
        out += [f"| {d['image']} | {d['psnr_db']:.2f} | {d['mad']:.2f} |" for d in j["drift"]] + [""]
    return out


def markdown(rec: dict, charts: dict[str, str] | None = None) -> str:
    """The record as Markdown; `charts`: chart name -> SVG file name, linked at the top."""
    out = [f"# bcg bench: {rec['job']} on {rec['device']} ({rec['dtype']}), {rec['date']}", "",
           f"model `{rec['model']}`, {rec['images']} images, torch {rec['torch']}, diffusers {rec['diffusers']}; "
           "model loading excluded from every wall time"
           + (f"; the host: {rec['launch_us']:.1f} µs per small op" if "launch_us" in rec else ""), ""]
    out += [f"![{name.replace('_', ' ')}]({file})" for name, file in (charts or {}).items()]
    out += [""] if charts else []
    names = NAMES
    rows = [k for k in names if k in rec]
    if rows:
        out += ["| contender | wall s | images/s | vs (a) | peak GPU MB |", "|---|---:|---:|---:|---:|"]
        base = rec.get("a_diffusers", {}).get("images_per_s") or float("nan")
        for k in rows:
            r = rec[k]
            peak = f"{r['peak_mb']:.0f}" if r.get("peak_mb") else "-"
            out.append(f"| {names[k]} | {r['wall_s']:.2f} | {r['images_per_s']:.3f} | "
                       f"{r['images_per_s'] / base:.2f}x | {peak} |")
        out.append("")
        out += ["Mean denoise ms per step, per bucket (diffusers: per call, `images x W x H`; bcg: per bucket):", ""]
        for k in rows:
            steps = rec[k].get("ms_per_step") or {}
            if steps:
                out.append(f"- {names[k]}: " + ", ".join(f"{b} {ms:.1f}" for b, ms in steps.items()))
        out.append("")
        staged = [k for k in rows if rec[k].get("outside_denoise_s") is not None]
        if staged:  # bcg's: each stage's seconds, what the denoising hid of it, the wall outside the denoising
            out += ["Stages, s (hidden by the denoising), and the wall outside the denoising:", ""]
            for k in staged:
                r, hidden = rec[k], rec[k].get("hidden_s") or {}
                out.append(f"- {names[k]}: " + ", ".join(
                    f"{st} {v:.2f}" + (f" ({hidden[st]:.2f})" if st in hidden else "")
                    for st, v in r["stages_s"].items() if st != "load")
                    + f"; outside {r['outside_denoise_s']:.2f} s = {100 * r['outside_denoise_s'] / r['wall_s']:.1f}%")
            out.append("")
    if "lora" in rec:
        lo, sw = rec["lora"], rec["lora"]["swaps"] or {}
        out += [f"LoRA job (3 rank-32 LoRAs over the shots, plain graphs, each render cold): "
                f"{lo['with']['images_per_s']:.3f} images/s against {lo['without']['images_per_s']:.3f} without "
                f"= **{lo['ratio']:.3f}x**; {sw.get('swaps', 0)} swaps, median {sw.get('median_s', float('nan')):.3f} s, "
                f"{sw.get('total_s', float('nan')):.2f} s in all", ""]
    if "single_shot" in rec:
        s = rec["single_shot"]
        out += [f"Single-shot re-render ({s['shape']}, {s['steps']} steps, denoise + decode, median of 3): "
                f"diffusers {s['diffusers_s']:.3f} s, bcg eager {s['bcg_eager_s']:.3f} s, "
                f"bcg graph {s.get('bcg_graph_s', float('nan')):.3f} s "
                f"({s.get('speedup_vs_diffusers', float('nan')):.2f}x); first render with capture "
                f"{s.get('bcg_graph_first_s', float('nan')):.3f} s", ""]
    if "fp8_images" in rec and rec["fp8_images"].get("psnr_db"):
        d = rec["fp8_images"]
        out += [f"(f) FP8 pictures against (e)'s, same seeds: PSNR {json.dumps(d['psnr_db'])} dB, mean absolute "
                f"difference {json.dumps(d['mad'])} (of 255); (f) = **{rec.get('f_vs_e', float('nan')):.3f}x (e)**", ""]
    if "fp8_steps" in rec:
        d = rec["fp8_steps"]
        out += [f"FP8 noise prediction against fp16 compiled, per step ({d['shape']}, guidance {d['guidance']:g}): "
                f"relative error {json.dumps(d['eps_rel'])}", ""]
    for key in ("step_curve", "step_curve_control", "step_curve_compiled", "step_curve_control_compiled",
                "step_curve_fp8", "step_curve_control_fp8"):
        if key in rec:
            out += [f"Step microbenchmark ({key.replace('_', ' ')}), matmul rate {rec['matmul_tflops']:.0f} TFLOP/s:",
                    "", "| shape | eager ms | graph ms | speedup | graph ms/image | TFLOP/step | share of matmul rate |",
                    "|---|---:|---:|---:|---:|---:|---:|"]
            for r in rec[key]:
                f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
                out.append(f"| {r['shape']} | {f(r['eager_ms'], '.1f')} | {f(r['graph_ms'], '.1f')} | "
                           f"{f(r['speedup'], '.2f')}x | {f(r['graph_ms_per_image'], '.1f')} | "
                           f"{r['tflop_per_step']:.2f} | {f(r['matmul_share'] and 100 * r['matmul_share'], '.0f')}% |")
            out.append("")
    for key in ("first_render", "first_render_fp8"):
        if key not in rec:
            continue
        f = rec[key]
        out += [f"First render on a cache without the job's kernels: `--compile auto{' --fp8' if f.get('fp8') else ''}` "
                f"{f['auto']['images_per_s']:.3f} "
                f"images/s, `--compile off` {f['off']['images_per_s']:.3f} = **{f['ratio']:.3f}x** "
                f"(kernels in the cache before: {', '.join(f['cached_before']) or 'none'})", ""]
    out += _draft_markdown(rec)
    if "b_slice" in rec:
        b = rec["b_slice"]
        out += [f"Slice {', '.join(b['shots'])} ({b['images']} images), side by side: (a) diffusers "
                f"{b['a']['images_per_s']:.3f} images/s, (b) + regional torch.compile steady "
                f"{b['b_steady']['images_per_s']:.3f} (first pass {b['b_first']['images_per_s']:.3f}, compile about "
                f"{b['b_compile_s']:.0f} s), (e) bcg compiled {b['e']['images_per_s']:.3f}: (e) = "
                f"**{b['e_vs_a']:.2f}x (a)**, **{b['e_vs_b']:.2f}x (b)**"
                + (f"; (f) bcg --fp8 {b['f']['images_per_s']:.3f}: **{b['f_vs_a']:.2f}x (a)**, **{b['f_vs_b']:.2f}x (b)**"
                   if "f" in b else ""), ""]
    if "profile" in rec:
        pr = rec["profile"]
        out += [f"Compiled against plain, relative error: noise prediction {pr['rel_err_eps']:.1e}, denoised at "
                f"guidance 1 {pr['rel_err_denoised_g1']:.1e}, at guidance 5 {pr['rel_err_denoised_g5']:.1e}", "",
                f"Top kernels of one step, {pr['shape']} (ms per step):", "", "| plain | ms | compiled | ms |",
                "|---|---:|---|---:|"]
        for x, y in zip(pr["plain"], pr["compiled"]):
            out.append(f"| `{x['kernel'][:60]}` | {x['ms_per_step']:.2f} | `{y['kernel'][:60]}` | {y['ms_per_step']:.2f} |")
        out.append("")
    if "refine" in rec:
        r, w = rec["refine"], rec["refine"]["work"]
        h = r["hires"]
        out += [f"Refining {w['picks']} picks at {w['side']}x{w['side']} (cropped inpainting, strength {w['strength']:g} "
                f"of {w['steps']} steps): bcg refine {r['bcg_refine']['wall_s']:.2f} s, diffusers' "
                f"StableDiffusionXLInpaintPipeline loop {r['diffusers_inpaint']['wall_s']:.2f} s: **{r['ratio']:.2f}x**. "
                f"Hires pass to {h['size']} (strength {h['strength']:g} of {h['steps']} steps), once built: "
                f"**{h['s_per_pick']:.3f} s per pick**", ""]
    if rec.get("errors"):
        out += ["Parts that failed:", ""] + [f"- {k}: {v}" for k, v in rec["errors"].items()] + [""]
    return "\n".join(out) + "\n"
