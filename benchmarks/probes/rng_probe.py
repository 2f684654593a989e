"""A pytest plugin for the GPU suites: after every test, is the default CUDA generator still usable outside a capture?
A capture that fails inside CUDA can leave it in capture state ("Offset increment outside graph capture encountered
unexpectedly" at the next CUDA random op, e.g. loading sdxl-random); this names the test after which that happens, and
the graphs' reasons at that point.

    PYTHONPATH=benchmarks/probes:$PYTHONPATH pytest -q -s -m gpu tests/test_gpu_compiled.py -p rng_probe
"""

import pytest
import torch


def _usable() -> str:
    try:
        torch.empty(4, device="cuda").uniform_()
        return "ok"
    except RuntimeError as e:
        return f"BROKEN: {str(e).splitlines()[0]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _usable()
    yield
    after = _usable()
    print(f"\n[rng] {item.nodeid}: before the test {before}, after it {after}", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield
    print(f"\n[rng] {item.nodeid}: after setup {_usable()}", flush=True)
