"""Which GraphRunner step leaves the default CUDA generator unusable outside a capture, in the path of the GPU test
`test_a_check_failure_falls_back_to_the_plain_graph` (every first-replay check fails: compiled -> plain -> eager); then
whether an empty capture puts it right. Needs the 1024x1024 compiled kernels in $BCG_CACHE.

    PYTHONPATH=tests:$PYTHONPATH python benchmarks/probes/rng_trace.py
"""

import functools
from dataclasses import replace

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import graph_runner
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.variants import VARIANTS
from storyboard_cli.models.loader import load_sdxl
from helpers.gpu import loop_inputs

SIDE = 1024


def usable() -> str:
    try:
        torch.empty(4, device="cuda").uniform_()
        return "ok"
    except RuntimeError as e:
        return "BROKEN: " + str(e).splitlines()[0]


def traced(cls, name):
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(self, *a, **k):
        try:
            return orig(self, *a, **k)
        finally:
            print(f"after {cls.__name__}.{name}: {usable()}", flush=True)
    setattr(cls, name, wrapper)


def main() -> None:
    models = load_sdxl("sdxl-random", "sdxl-random", "cuda", torch.float16)
    print("loaded:", usable())
    runner = graph_runner(models, [Shape(1, SIDE, SIDE, False)], compile="on")
    for name in ("_record", "_after_failed_capture", "_check", "_fall_back", "_settle", "release"):
        traced(GraphRunner, name)
    traced(EagerEngine, "sample")
    VARIANTS.update({n: replace(VARIANTS[n], check_rtol=-1.0) for n in ("plain", "compiled")})
    fresh = GraphRunner(models, max_batch=1, max_hw=(SIDE, SIDE), compiled=runner.compiled)
    x, sched, noise, cond, ctl, guidance = loop_inputs(models, 1, SIDE, SIDE, False, "euler", steps=3)
    fresh.sample(x, sched, noise, cond, ctl, torch.ones_like(guidance))
    print("after the sample:", usable(), [(s.key.label, s.state, s.reason) for s in fresh.stats.values()])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pass
    print("after an empty capture:", usable())


if __name__ == "__main__":
    main()
