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


@pytest.fixture
def job_dir(tmp_path):
    """A scratch folder holding copies of the example job's control images."""
    shutil.copytree(ROOT / "jobs" / "control", tmp_path / "control")
    return tmp_path


def write_job(folder: Path, text: str, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path
