import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

# One model cache for the whole test session (the tiny preset is built once, then loaded from disk).
os.environ.setdefault("BCG_CACHE", str(Path(os.environ.get("PYTEST_BCG_CACHE", "/tmp/bcg-test-cache"))))


def pytest_ignore_collect(collection_path, config):
    """`pytest -m gpu` (`make gpu-test`) leaves out the render service's tests: they hold no GPU test, and
    their modules import FastAPI, which a render-only install (a GPU box without the `serve` extra) lacks."""
    if config.getoption("markexpr") == "gpu" and collection_path.name.startswith("test_serve_"):
        return True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest -m gpu` runs in one process (pyproject's addopts ask for two xdist workers): the GPU tests share one
    device and build one set of kernels. Under xdist every test process (the workers, and the servers, workers and
    renders that tests start) computes on one thread: two xdist workers fill two cores, where each process's own
    OpenMP threads would spin against the others' (tests/test_draft_engine.py: 61 s with two threads a process,
    18 s with one). OMP_NUM_THREADS set by the caller wins."""
    if config.getoption("markexpr") == "gpu" and getattr(config.option, "numprocesses", None):
        config.option.numprocesses, config.option.dist = None, "no"
    if getattr(config.option, "numprocesses", None):
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # before xdist starts its workers: they and their children inherit it


KERNELS, PROCESSES = "kernels", "processes:"  # xdist groups: the kernel artifacts' tests; a module's process tests
# The long units' seconds in one run (`--durations`, a fresh BCG_CACHE, two cores shared with other work, 2026-12-02),
# for their order only: xdist hands the units out as conftest orders them (`--no-loadscope-reorder`, pyproject's
# addopts), longest first, so that no long unit starts while the other worker is running out of short tests. A unit
# not listed counts UNLISTED_SLOW_S per slow test (one at least: a group goes before the short tests). The kernels'
# unit goes first whatever its figure (900 s in that run).
UNIT_S = {"processes:test_dist": 480, "processes:test_serve_inputs": 315, "processes:test_serve_fuzz": 260,
          "processes:test_faults": 250, "processes:test_signals": 215, "processes:test_serve_e2e": 180,
          "processes:test_serve_scale": 155,
          # 150 in that run; its full-disk test, 18 s alone (2026-12-07); its clock test, 20 s, its full server
          # disk test, 11 s, and its quota test, 12 s, alone (2026-12-08); 132 s in a run (2026-12-08), and its
          # hung worker's test, 15 s alone, and its stalled local worker's, 11 s alone
          "processes:test_serve_worker_faults": 245,
          "processes:test_serve_load": 130,
          # 34.5 s in a run (2026-12-08, five slow tests); 64 s alone with its read-only and last-byte tests
          "processes:test_serve_disk": 90, "bench": 110, "processes:test_serve_workers": 90,
          # its first two tests measured alone on the loaded cores (2026-12-02): 45 s; the third, 9 s alone (2026-12-07)
          "processes:test_serve_mix": 65,
          "processes:test_serve_ui": 75}  # the queue page in Chromium: measured alone on the loaded cores, not in a run
UNLISTED_SLOW_S = 10


def _group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return (mark.args[0] if mark.args else mark.kwargs.get("name", "")) if mark else None


def _longest_first(items) -> None:
    """Sorts `items` in place: the kernels' unit, then the other xdist groups longest first, then the short tests in
    their order (a module's tests keep theirs)."""
    slow: dict[str, int] = {}
    for item in items:
        if (group := _group(item)) is not None:
            slow[group] = slow.get(group, 0) + ("slow" in item.keywords)
    cost = {g: float("inf") if g == KERNELS else UNIT_S.get(g, UNLISTED_SLOW_S * max(n, 1))
            for g, n in slow.items()}
    items.sort(key=lambda item: -cost[g] if (g := _group(item)) is not None else 0.0)  # stable


def _starts_servers(item) -> bool:
    """Whether the test's module starts `bcg serve` or `bcg worker` processes (tests/helpers/serve.py), marked slow
    or not: its tests run one after another, so that no two of its servers compete for the cores."""
    module = getattr(item, "module", None)
    helpers = [getattr(getattr(module, name, None), "__module__", None) for name in ("Server", "start_worker")]
    return "server" in item.fixturenames or "helpers.serve" in helpers


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the kernel tests are `slow` by their fixture
def pytest_collection_modifyitems(config, items):
    """A test that asks for the kernel artifacts is `slow` (their build takes minutes on two cores). The xdist
    groups (`-n 2 --dist loadgroup`, pyproject's addopts): the tests of the kernel artifacts go to one worker, which
    builds them once; the tests that start processes (`slow`: servers, workers, renders, signals; and every test of a
    module that starts servers) go by module, a module's tests on one worker one after another (its server fixture
    serves them all), two modules at once. The long units run first (the kernels, then the process modules), and
    the many short tests fill in beside them. Without CUDA, the GPU tests are skipped."""
    import torch

    for item in items:
        if item.get_closest_marker("xdist_group"):  # the module chose its own
            continue
        if "artifacts" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group(KERNELS))
        elif "slow" in item.keywords or _starts_servers(item):
            item.add_marker(pytest.mark.xdist_group(PROCESSES + item.module.__name__))
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cpu():
    import torch

    from storyboard_cli.models.loader import load_sdxl

    return load_sdxl("tiny", "tiny", "cpu", torch.float32)


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def tiny_cuda(request):
    """The GPU tests' tiny models on CUDA in fp32 and fp16, one graph runner over them (up to 8 images of 320x320),
    the eager engine, and the relative error allowed between the two. Each module that asks gets its own."""
    import torch

    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.models.loader import load_sdxl

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[request.param]
    models = load_sdxl("tiny", "tiny", "cuda", dtype)
    runner = GraphRunner(models, max_batch=8, max_hw=(320, 320))
    return models, runner, EagerEngine(models), (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.fixture(scope="module")
def lora_models(tiny_cpu):
    """A module's own copy of the tiny models, without ControlNet: its tests write LoRA weights into them (and put
    them back, but other modules share tiny_cpu)."""
    import copy

    models = copy.deepcopy(tiny_cpu)
    models.controlnets = ()
    return models


@pytest.fixture
def server(tmp_path):
    """A `bcg serve` on a free port (tests/helpers/serve.py's Server, not started), killed after the test."""
    from helpers.serve import Server, free_port

    s = Server(tmp_path / "root", free_port())
    yield s
    if s.proc and s.proc.poll() is None:
        s.kill_everything()


@pytest.fixture
def job_dir(tmp_path):
    """A scratch folder holding copies of the example job's control images."""
    shutil.copytree(ROOT / "jobs" / "control", tmp_path / "control")
    return tmp_path


def write_job(folder: Path, text: str, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


STATIC_CXX = """#!/bin/sh
# g++ that puts a static copy of libstdc++ into every shared library it makes, as the H200 image's does, at -O1 (the
# last -O wins over inductor's -O3): the tiny model's code runs for milliseconds, and a cold build of its UNet takes
# 70 s of CPU at -O1 against 82 s at -O3 (one process, a fresh inductor cache, 2026-12-02). The wrapper (the launch
# code around the kernels, the largest object) at -O0: the compiler's share of a tiny UNet build goes from 19.7-21.3
# to 13.3-16.3 s of CPU (scalar kernels, a fresh inductor cache each, 2026-12-03)
case " $* " in *"wrapper.cpp"*) O=-O0 ;; *) O=-O1 ;; esac
case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ $O ;; *) exec g++ "$@" $O ;; esac
"""


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """The CPU kernel artifacts of the compiled and FP8 tests, built once a session into one folder the way `bcg
    capture --warm` (and `--fp8`) builds them, child processes side by side: a tiny UNet and ControlNet at 128x128,
    the UNet's and the ControlNet's FP8 twins, the UNet with the tiny IP-Adapter's processors, the UNet with two region slots, and with both
    (regional references). The compiler links libstdc++ statically: a library with its own copy of libstdc++
    crashed at load on the GPU image (AOTInductor's loader parses the device string with std::regex, which reads
    the copy's never-initialised locale); bcg's link options must keep it loadable."""
    import torch

    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.kernels.builds import Builds
    from storyboard_cli.engine.kernels.calls import CompiledKernels
    from storyboard_cli.models.loader import load_sdxl

    from helpers.kernels import SIDE

    root = tmp_path_factory.mktemp("compiled")
    cxx = root / "g++"
    cxx.write_text(STATIC_CXX)
    cxx.chmod(0o755)
    events, notes = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", str(cxx))  # the build children inherit it
        # and scalar C++ kernels: the CPU artifacts stand in for the GPU's Triton ones, and a build of the tiny UNet
        # without inductor's vectorised kernel variants takes 49.6 s of CPU against 58.1 s (warm caches, 2026-12-03)
        mp.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")
        # and one compile worker each: on two cores the builds run one at a time (`slots`), where a second compile
        # worker costs more CPU than it saves: the seven builds took 151, 158 and 165 CPU-seconds with one against
        # 159, 160 and 171 with two (alternating runs, 2026-12-05)
        mp.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        builds = Builds(torch.device("cpu"), events.append, notes=notes)
        fp16 = CompiledKernels(load_sdxl("tiny", "tiny", "cpu", torch.float32), builds, notes, root=root)
        fp8 = CompiledKernels(load_sdxl("tiny", "tiny", "cpu", torch.float32), builds, notes, root=root, variant="fp8")
        ip = CompiledKernels(load_sdxl("tiny", None, "cpu", torch.float32, "tiny"), builds, notes, root=root)
        regions = CompiledKernels(load_sdxl("tiny", None, "cpu", torch.float32, regions=2), builds, notes, root=root)
        both = CompiledKernels(load_sdxl("tiny", None, "cpu", torch.float32, "tiny", regions=2), builds, notes,
                               root=root)
        wanted = [k.want(k.targets([Shape(4, SIDE, SIDE, control)])) for k, control in
                  ((fp16, True), (fp8, True), (ip, False), (regions, False), (both, False))]
        labels = [["unet 128x128", "controlnet 128x128"], ["unet 128x128 fp8", "controlnet 128x128 fp8"],
                  ["unet 128x128 +refs 16"],
                  ["unet 128x128 +regions2"], ["unet 128x128 +refs 16 +regions2x4x4"]]
        assert [[t.label for t in w] for w in wanted] == labels
        for k in (fp16, fp8, ip, regions, both):
            k.start(background=False)
        builds.wait()
    assert not [n for n in notes if "fail" in n or "not used" in n], notes
    assert {e.module for e in events if e.state == "done"} == {label for w in labels for label in w}
    return root
