"""The contracts that keep the modules apart (ARCHITECTURE.md), checked on the source itself."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "storyboard_cli"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports inside functions count)."""
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_checks_see_the_package():
    names = {_rel(p) for p in SOURCES}
    assert {"cli.py", "render.py", "job.py", "plan.py", "engine/graphs.py", "engine/eager.py"} <= names


def test_only_graphs_names_cuda_graphs():
    naming = {_rel(p) for p in SOURCES if "CUDAGraph" in p.read_text(encoding="utf-8")}
    assert naming == {"engine/graphs.py"}


def test_only_the_cli_prints_or_exits():
    offenders = []
    for path in SOURCES:
        if _rel(path) in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
                if name in ("print", "exit", "quit") and owner in ("", "sys", "os") or name == "_exit":
                    offenders.append(f"{_rel(path)}:{node.lineno} {owner + '.' if owner else ''}{name}()")
            elif isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
                offenders.append(f"{_rel(path)}:{node.lineno} raise SystemExit")
            elif isinstance(node, ast.Attribute) and node.attr == "Exit" and ast.unparse(node.value) == "typer":
                offenders.append(f"{_rel(path)}:{node.lineno} typer.Exit")
    assert not offenders, offenders


@pytest.mark.parametrize("path", [p for p in SOURCES if _rel(p).startswith("engine/")], ids=_rel)
def test_the_engine_does_not_import_the_job(path):
    assert not {m for m in _imports(path) if m == "storyboard_cli.job" or m.startswith("storyboard_cli.job.")}


@pytest.mark.parametrize("name", ["job.py", "plan.py", "samplers.py"])
def test_torch_free_modules_do_not_import_it(name):
    assert not {m for m in _imports(PACKAGE / name) if m == "torch" or m.startswith("torch.")}


def test_job_and_plan_import_no_torch_at_run_time():
    import subprocess
    import sys

    # not even through what they import
    code = ("import sys, storyboard_cli.job, storyboard_cli.plan, storyboard_cli.samplers; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_engine_probing_in_render():
    text = (PACKAGE / "render.py").read_text(encoding="utf-8")
    for probe in ("hasattr(", "isinstance(self.engine", "isinstance(engine", "GraphRunner", "EagerEngine"):
        assert probe not in text, probe
