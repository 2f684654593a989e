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


def pytest_collection_modifyitems(config, items):
    import torch

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


@pytest.fixture(scope="module")
def lora_models(tiny_cpu):
    """A module's own copy of the tiny models, without ControlNet: its tests write LoRA weights into them (and put
    them back, but other modules share tiny_cpu)."""
    import copy

    models = copy.deepcopy(tiny_cpu)
    models.controlnet = None
    return models


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
# g++ that puts a static copy of libstdc++ into every shared library it makes, as the H200 image's does
case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; *) exec g++ "$@" ;; esac
"""


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """A tiny UNet and ControlNet artifact built the way `bcg capture --warm` builds them: child
    processes, side by side, with a compiler that links libstdc++ statically. A library with its own
    copy of libstdc++ crashed at load on the GPU image (AOTInductor's loader parses the device string
    with std::regex, which reads the copy's never-initialised locale); bcg's link options must keep it
    loadable."""
    import torch

    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.kernels.artifacts import targets
    from storyboard_cli.engine.kernels.builds import Builds
    from storyboard_cli.engine.kernels.calls import CompiledKernels
    from storyboard_cli.models.loader import load_sdxl

    root = tmp_path_factory.mktemp("compiled")
    cxx = root / "g++"
    cxx.write_text(STATIC_CXX)
    cxx.chmod(0o755)
    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    events, notes = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", str(cxx))  # the build children inherit it
        builds = Builds(models.device, events.append, notes=notes)
        k = CompiledKernels(models, builds, root=root)
        k.want(targets([Shape(4, 128, 128, True)], True))
        assert [t.label for t in k.waiting] == ["unet 128x128", "controlnet 128x128"]
        k.start()
        builds.wait()
    assert notes == []
    assert {e.module for e in events if e.state == "done"} == {"unet 128x128", "controlnet 128x128"}
    return root
