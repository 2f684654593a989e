"""How far a healthy graph's first step is from the references its check can use, by guidance (issue 41).

A compiled graph whose kernels were checked against the eager step at other rows is checked on its batch's first step
against the same kernels outside the graph (engine/graph/check.py). Two references:

  batch   the whole batch's step (`first_step`): the same kernels at the same rows, 0.0 apart when nothing is broken;
          it costs one step of the batch (192.7 ms at 8 x 1024², FP8, on the H200)
  one     the batch's first image alone (`first_step_of_part` at 1 image): a step of one image, but its GEMMs run at
          other rows and round apart; FP8 measured 5.0e-2 to 5.2e-2 (limit 8e-2) at the bench job's guidance 6 and
          its row does not use it (`Variant.alone_rtol` None); fp16 compiled 2.2e-3 (limit 2e-2)
  part    the batch's first N images alone (--parts N,...; `part_N` in the rows): a step of N images, its GEMMs at
          N / batch of the rows, in case the kernels rounded each image's rows as in the batch's step nearer its rows.
          FP8 on the H100: the first 2 and 4 of 8 images come as far off as one (2026-12-05, docs/PERFORMANCE.md)

Classifier-free guidance multiplies the two rows' rounding, so the one-image error should grow with the guidance (a
shot may ask for 0 to 30). Before FP8 may check one image, its healthy error must sit well under a limit at every
guidance a job allows, and that limit must stay far under what a broken capture gives (NaN, or the error of a step
that read the wrong buffers: of order 1). This probe measures the healthy side: for each variant and shape, at each
guidance and seed, both references' errors, and each reference step's time; and, as a scale for the other side, the
one-image error of a replay whose first image's latents were read off by 1%, 10% and 100% (at guidance 6).

    python benchmarks/probes/check_scout.py OUT.json [--variants fp8,compiled] [--shapes 8x0,2x1]
        [--guidance 1.5,3,6,9,12,20,30] [--seeds 0,1] [--side 1024] [--model sdxl-random] [--parts 2,4]
    python benchmarks/probes/check_scout.py /tmp/c.json --model tiny --side 128 --variants plain   # CPU: the plumbing
        (no graph: the "replay" is the step itself, so both errors are 0)
    python benchmarks/probes/check_scout.py /tmp/c.json --model tiny --side 128 --compile on --shapes 4x0
        # CPU: the tiny model's CPU artifacts (built first), the batch's step at its rows against the first image's
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_scout import Record  # noqa: E402

from storyboard_cli.engine.base import Shape  # noqa: E402
from storyboard_cli.engine.build import graph_runner  # noqa: E402
from storyboard_cli.engine.graph.check import first_step, first_step_of_part  # noqa: E402
from storyboard_cli.engine.sampling import draw_noise, schedule  # noqa: E402
from storyboard_cli.engine.variants import VARIANTS  # noqa: E402
from storyboard_cli.models.loader import cuda_allocator, load_sdxl  # noqa: E402
from storyboard_cli.run.capture import synthetic_inputs  # noqa: E402

STEPS = 30  # the bench job's


def timed(fn, reps: int = 5) -> float:
    """Median ms of `fn` to the GPU's end."""
    cuda = torch.cuda.is_available()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(out), 2)


def shape_rows(models, runner, variant: str, batch: int, control: bool, side: int, guidance: list[float],
               seeds: list[int], parts: list[int] = ()) -> list[dict]:
    """Both references' errors for one shape at each guidance and seed (and each of `parts`' first N images'), and
    their steps' ms."""
    sched = schedule("euler_a", STEPS, models.scheduler_config)
    _, cond, conds, _ = synthetic_inputs(models, batch, side, side, int(control))
    cuda = models.device.type == "cuda"
    key = runner.shape_key(batch, side, side, control)
    rows = []
    for seed in seeds:
        x, noise = draw_noise([seed * 100 + i for i in range(batch)], STEPS, (4, side // 8, side // 8), sched)
        x, noise = x.to(models.device), None if noise is None else noise.to(models.device)
        first = None if noise is None else noise[0]
        for g in guidance:
            scale = torch.full((batch,), g, device=models.device)
            if cuda and key not in runner.graphs:  # captured and checked as a render's first batch does
                runner.sample(x, sched, noise, cond, conds, scale)
                key = runner.shape_key(batch, side, side, control)  # a graph that failed moved a row down
            v = runner.buf.view(key)
            replay = runner.graphs[key].replay if cuda else (lambda: runner.step(v))
            v.load(runner.buf, x, sched, cond, conds, scale)
            one, why_one = first_step_of_part(v, replay, lambda: runner.part_step(v, x, first, 1), first, 1)
            v.load(runner.buf, x, sched, cond, conds, scale)
            whole, why_whole = first_step(runner.buf, v, replay, runner.step, x, sched, first, cond, conds, scale)
            row = {"variant": key.variant, "asked": variant, "batch": batch, "control": control, "guidance": g,
                   "seed": seed, "one": one, "batch_err": whole, "fails_one": why_one, "fails_batch": why_whole}
            for n in (n for n in parts if 1 < n < batch):
                v.load(runner.buf, x, sched, cond, conds, scale)
                row[f"part_{n}"], _ = first_step_of_part(v, replay, lambda: runner.part_step(v, x, first, n), first, n)
            rows.append(row)
    # what the check sees of a replay that read its first image's latents off by a relative `size` (a stand-in for
    # a capture that reads a buffer it should not): the one-image error at each size, at guidance 6
    v = runner.buf.view(key)
    six = torch.full((batch,), 6.0, device=models.device)
    replay = runner.graphs[key].replay if cuda else (lambda: runner.step(v))
    for size in (1e-2, 1e-1, 1.0):
        v.load(runner.buf, x, sched, cond, conds, six)
        off = torch.randn(v.x[:1].shape, generator=torch.Generator().manual_seed(7)).to(v.x)
        v.x[:1] += off * (size * v.x[:1].float().norm() / off.float().norm()).to(v.x.dtype)
        one, why = first_step_of_part(v, replay, lambda: runner.part_step(v, x, first, 1), first, 1)
        rows.append({"variant": key.variant, "asked": variant, "batch": batch, "control": control, "guidance": 6.0,
                     "seed": seeds[-1], "fault": f"first latents off by {size:g}", "one": one, "fails_one": why})
    v.load(runner.buf, x, sched, cond, conds, six)
    ms_one = timed(lambda: runner.part_step(v, x, first, 1))
    ms_batch = timed(lambda: (v.buf.index.zero_(), runner.step(v)))
    ms_parts = {f"part_{n}_ms": timed(lambda: runner.part_step(v, x, first, n)) for n in parts if 1 < n < batch}
    for r in rows:
        r["one_ms"], r["batch_ms"] = ms_one, ms_batch
        r.update(ms_parts)
    return rows


def cpu_runner(models, shapes: list, variant: str, notes: list):
    """On the CPU: a runner over `variant`'s CPU artifacts (built first, loaded now: no capture will load them), as the
    CPU tests make one. `compiled_kernels` would refuse FP8 here (its row needs an FP8 GPU)."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels.builds import Builds
    from storyboard_cli.engine.kernels.calls import CompiledKernels

    compiled = CompiledKernels(models, Builds(models.device, None, retry_failed=True, notes=notes), notes,
                               variant=variant)
    if compiled.want(compiled.targets(shapes), defer=False):
        compiled.wait()
    runner = GraphRunner(models, compiled=compiled)
    runner.ensure_capacity(shapes)
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--variants", default="fp8,compiled")
    ap.add_argument("--shapes", default="8x0,2x1", help="BATCHxCONTROL, comma-separated")
    ap.add_argument("--guidance", default="1.5,3,6,9,12,20,30")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--parts", default="", help="N,...: also each batch's first N images stepped alone")
    ap.add_argument("--compile", default=None, help="on or off (default: on with CUDA; on the CPU the artifacts are "
                    "the CPU's, with no graphs: the replay is the step at the batch's rows)")
    a = ap.parse_args()
    allocator = cuda_allocator()  # the product's settings, before CUDA starts
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    shapes = [(int(b), bool(int(c))) for b, c in (s.split("x") for s in a.shapes.split(","))]
    guidance = [float(g) for g in a.guidance.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    rec = Record(a.out, model=a.model, side=a.side, torch=torch.__version__, allocator=allocator,
                 gpu=torch.cuda.get_device_name() if cuda else None,
                 limits={name: v.check_rtol for name, v in VARIANTS.items()})
    models = load_sdxl(a.model, a.model, device, dtype)
    every = []
    for variant in a.variants.split(","):
        notes: list[str] = []
        wanted = [Shape(b, a.side, a.side, c) for b, c in shapes]
        if not cuda and a.compile == "on":
            runner = cpu_runner(models, wanted, variant, notes)
        else:
            runner = graph_runner(models, wanted, compile=a.compile or ("on" if cuda else "off"), notes=notes,
                                  kernels=variant)
        with torch.no_grad():
            for batch, control in shapes:
                every += shape_rows(models, runner, variant, batch, control, a.side, guidance, seeds,
                                    [int(n) for n in a.parts.split(",") if n])
                rec.put("rows", every)
        rec.put(f"notes_{variant}", notes)
        del runner
        if cuda:
            torch.cuda.empty_cache()
    summary = {}
    for r in every:
        if "fault" in r:
            summary[f"{r['variant']} {r['batch']}x{int(r['control'])} {r['fault']}"] = {"one": r["one"]}
            continue
        s = summary.setdefault(f"{r['variant']} {r['batch']}x{int(r['control'])} g{r['guidance']:g}",
                               {"one_max": 0.0, "batch_max": 0.0, "one_ms": r["one_ms"], "batch_ms": r["batch_ms"]})
        s["one_max"] = max(s["one_max"], r["one"])
        s["batch_max"] = max(s["batch_max"], r["batch_err"])
        for k in (k for k in r if k.startswith("part_") and not k.endswith("_ms")):
            s[f"{k}_max"] = max(s.get(f"{k}_max", 0.0), r[k])
            s[f"{k}_ms"] = r[f"{k}_ms"]
    rec.put("summary", summary)
    rec.put("done", True)


if __name__ == "__main__":
    main()
