"""The cost table bcg ships: one NVIDIA H200, `sdxl-random` (SDXL-base's shapes: a kernel's time does not depend on
the weights' values), fp16, torch 2.11.0+cu130. Every figure is one docs/PERFORMANCE.md records, with where it came
from; what it does not record (other sizes, rows, ControlNets at other rows) is extrapolated by FLOPs at run time
(costs.Costs.step). A machine's own renders and `bcg capture --warm` replace these in $BCG_CACHE/costs.json.

The steps were timed in short loops (`loop=True`): a render also pays each shape's first-replay check, added per
shape (`check_s`). In the traced render of issue 41 (call 5, 6b602fb) the loops without their checks took 33.7 s
(fp8) and 39.1 s (compiled) where these figures give 33.2 and 38.6 s for the same batches: no factor for the power
cap is applied."""

from __future__ import annotations

from storyboard_cli.costs import Costs, Measured, StepShape

DEVICE, MODEL = "NVIDIA H200", "sdxl-random"

# (variant, width, height, images, ControlNets, ms per step of the whole batch, where it came from)
_STEPS = (
    # fp16 compiled, format 6: `bcg capture jobs/bench.yaml --warm --compile on --steps 4` on 5194456, 4-step loops
    # ("Format 6 on the GPU", record benchmarks/results/compiled/2026-11-30-5194456-capture.json)
    ("compiled", 1024, 1024, 8, 0, 236.1, "PERFORMANCE.md Format 6 on the GPU (5194456)"),
    ("compiled", 1024, 1024, 1, 0, 31.9, "PERFORMANCE.md Format 6 on the GPU (5194456)"),
    ("compiled", 1024, 1024, 2, 1, 89.4, "PERFORMANCE.md Format 6 on the GPU (5194456)"),
    ("compiled", 1216, 832, 8, 0, 237.9, "PERFORMANCE.md Format 6 on the GPU (5194456)"),
    ("compiled", 832, 1216, 4, 1, 174.0, "PERFORMANCE.md Format 6 on the GPU (5194456)"),
    # fp16 compiled, the step curve `--parts curves` (b9e7be9): 30.7 / 30.6 per image-step at 2 / 4 images, 47.2 with
    # a ControlNet at 1 ("In use on the H200"; the timestep fix of format 5 did not change step times)
    ("compiled", 1024, 1024, 2, 0, 2 * 30.7, "PERFORMANCE.md In use on the H200, step curve (b9e7be9)"),
    ("compiled", 1024, 1024, 4, 0, 4 * 30.6, "PERFORMANCE.md In use on the H200, step curve (b9e7be9)"),
    ("compiled", 1024, 1024, 1, 1, 47.2, "PERFORMANCE.md In use on the H200, step curve (b9e7be9)"),
    # FP8 UNet (fp16 ControlNet), `bcg bench jobs/bench.yaml --parts fp8` on 2531246: 24.8 / 25.2 / 26.6 / 28.6 per
    # image-step at 8 / 4 / 2 / 1 images, 43.5 / 40.7 with a ControlNet at 1 / 2 ("FP8 in the product",
    # benchmarks/results/fp8/2026-11-30-2531246-*.json)
    ("fp8", 1024, 1024, 8, 0, 8 * 24.8, "PERFORMANCE.md FP8 in the product, --parts fp8 (2531246)"),
    ("fp8", 1024, 1024, 4, 0, 4 * 25.2, "PERFORMANCE.md FP8 in the product, --parts fp8 (2531246)"),
    ("fp8", 1024, 1024, 2, 0, 2 * 26.6, "PERFORMANCE.md FP8 in the product, --parts fp8 (2531246)"),
    ("fp8", 1024, 1024, 1, 0, 28.6, "PERFORMANCE.md FP8 in the product, --parts fp8 (2531246)"),
    ("fp8", 1024, 1024, 1, 1, 43.5, "PERFORMANCE.md FP8 in the product, --parts fp8 (2531246)"),
    ("fp8", 1024, 1024, 2, 1, 2 * 40.7, "PERFORMANCE.md FP8 in the product, --parts fp8 (2531246)"),
    # plain CUDA graphs: `bcg capture --warm --buckets 1,2,4 --steps 10` and the step microbenchmark (2026-11-29,
    # "The denoising step" and "`make bench`", benchmarks/results/graphs/2026-11-29-*.json)
    ("plain", 1024, 1024, 8, 0, 283.1, "PERFORMANCE.md make bench, step microbenchmark (2026-11-29)"),
    ("plain", 1024, 1024, 4, 0, 146.5, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1024, 1024, 2, 0, 75.7, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1024, 1024, 1, 0, 41.9, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 832, 1216, 4, 0, 143.0, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 832, 1216, 2, 0, 74.5, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 832, 1216, 1, 0, 41.6, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1216, 832, 4, 0, 142.9, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1216, 832, 2, 0, 74.6, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1216, 832, 1, 0, 41.5, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1344, 768, 4, 0, 147.0, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1344, 768, 2, 0, 76.5, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1344, 768, 1, 0, 42.0, "PERFORMANCE.md The denoising step (2026-11-29)"),
    ("plain", 1024, 1024, 1, 1, 62.0, "PERFORMANCE.md make bench, step microbenchmark (2026-11-29)"),
    ("plain", 1024, 1024, 2, 1, 112.6, "PERFORMANCE.md make bench, step microbenchmark (2026-11-29)"),
)

# issue 41, call 4 (df973ec, record benchmarks/results/overlap/2026-12-02-df973ec-job.json), (f) `--fp8` on
# jobs/bench.yaml (11 batches, 38 images, 39.0 megapixels): encode 1.29 s (hidden 0.00), decode 2.86 s (hidden 2.71),
# save 2.35 s (hidden 2.10); (e) compiled: decode 2.91 (hidden 2.76), save 2.46 (hidden 2.26)
_STAGES = "PERFORMANCE.md Issue 41, Stages (call 4, df973ec)"
_CHECKS = "PERFORMANCE.md 2026-12-02 later: (e) 5.61 s / 11 shapes (call 5, 6b602fb); (f) 4.73 s / 11 (call 6, fb599ee)"
_CAPTURE = ("PERFORMANCE.md Issue 41, Stages: capture (f) 2.12 s, (e) 3.96 s / 11 shapes (call 4, df973ec); plain: "
            "today's 11 graphs 2.20 s (draft renders, 20b790f)")


def table() -> Costs:
    """The shipped H200 table (a fresh copy: renders add to their own)."""
    steps = {StepShape(w, h, 2 * images, nets, 0, variant): Measured(ms / (2 * images), 1, True, source)
             for variant, w, h, images, nets, ms, source in _STEPS}
    return Costs(DEVICE, MODEL, steps, encode_ms=1290 / 11, decode_ms=2860 / 39.0, save_ms=2350 / 39.0,
                 hidden={"encode": 0.0, "decode": 2.71 / 2.86, "save": 2.10 / 2.35},
                 load_s=11.7, capture_s={"fp8": 2.12 / 11, "compiled": 3.96 / 11, "plain": 2.20 / 11},
                 check_s={"fp8": 4.73 / 11, "compiled": 5.61 / 11, "plain": 5.61 / 11},
                 sources={"steps": "short loops; each entry names its run", "encode": _STAGES, "decode": _STAGES,
                          "save": _STAGES, "hidden": _STAGES, "capture": _CAPTURE, "check": _CHECKS + "; plain: "
                          "the compiled figure (not measured apart)",
                          "load": "PERFORMANCE.md make bench: model loading 11.7 s"})
