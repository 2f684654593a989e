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


def _imports(path: Path, run_time: bool = False) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports inside functions count);
    `run_time`: not those under `if TYPE_CHECKING:` (annotations only)."""
    tree = _tree(path)
    if run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_checks_see_the_package():
    names = {_rel(p) for p in SOURCES}
    assert {"cli.py", "run/render.py", "job/file.py", "job/plan.py", "engine/graph/runner.py", "engine/eager.py"} <= names
    named = {n for members in STAGES.values() for n in members} | set(TORCH_FREE) | ENGINE_DRIVERS
    assert not {n for n in named if not n.endswith("/*") and n not in names}, "a table names a module that moved"


def test_every_package_is_a_stage_and_its_init_imports_nothing():
    """A package's __init__.py runs whenever one of its modules is imported: it must not pull in a higher stage
    (job/file.py imports folder/layout.py, job/lora_files.py imports models/tiny.py)."""
    packages = {p.parent.relative_to(PACKAGE).as_posix() for p in SOURCES if p.parent != PACKAGE}
    assert packages == set(FOLDERS)
    for name in FOLDERS:
        init = PACKAGE / name / "__init__.py"
        assert init.is_file(), init
        assert not {m for m in _imports(init) if m.startswith("storyboard_cli.") and m not in REEXPORTS.get(name, ())}


def test_only_the_graph_runner_names_cuda_graphs():
    naming = {_rel(p) for p in SOURCES if "CUDAGraph" in p.read_text(encoding="utf-8")}
    assert naming == {"engine/graph/runner.py"}


# the command line: the only modules that print or exit (cli.py and the modules it is cut into)
CLI = ("cli.py", "cli_common.py", "cli_progress.py", "cli_engine.py", "__main__.py")


def test_only_the_cli_prints_or_exits():
    offenders = []
    for path in SOURCES:
        if _rel(path) in CLI:
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


# docs/ARCHITECTURE.md, "The rooms": one folder per stage, lowest first. A module imports only from its own
# stage or a lower one (lazy imports count; annotations under TYPE_CHECKING do not). `folder/*`: every module of
# that folder; a module named on its own is placed before any folder (the base modules that live in a higher
# stage's folder because that is what they describe).
STAGES = {
    "base": {"errors.py", "samplers.py", "steps.py", "folder/layout.py", "models/tiny.py", "models/tokenizers.py",
             "models/__init__.py"},
    "job": {"job/*"},
    "models": {"models/*"},
    "engine": {"engine/*", "engine/kernels/*", "engine/graph/*"},
    "folder": {"folder/*"},
    "run": {"run/*"},
    "serve": {"serve/*"},
    "top": {*CLI, "__init__.py", "bench/*"},
}
ORDER = list(STAGES)
FOLDERS = [m.removesuffix("/*") for members in STAGES.values() for m in members if m.endswith("/*")]
# what a package's __init__.py may import: the engine's protocol (`from storyboard_cli.engine import Engine`)
REEXPORTS = {"engine": {"storyboard_cli.engine.base", "storyboard_cli.engine.base.Engine",
                        "storyboard_cli.engine.base.Shape"}}
# torch-free at run time, through everything they import: `bcg plan`, job validation, the folder's readers and
# writers, `bcg sheet`, `bcg pick`. A folder: every module in it.
TORCH_FREE = ["errors.py", "samplers.py", "steps.py", "job/*", "folder/*", "run/signals.py", "serve/schedule.py",
              "serve/intake.py", "serve/store.py", "serve/queue_file.py", "serve/queue_workers.py",
              "serve/queue_stats.py", "serve/metrics.py", "serve/api.py", "serve/client.py", "serve/lease_client.py",
              "serve/server.py", "serve/folders.py", "serve/blobs.py", "serve/blob_routes.py", "serve/edge.py",
              "serve/wire.py", "serve/nvml.py", "serve/settings.py", "serve/inputs_cache.py",
              "serve/worker_options.py", "serve/openapi.py", "serve/api_state.py", "serve/job_routes.py",
              "serve/lease_routes.py", "serve/ops_routes.py", "serve/disk.py"]
# who drives an engine (builds one, prepares it, samples with it): the batch runner and the render that
# builds one; capture and bench's parts, which time them
ENGINE_DRIVERS = {"run/batch.py", "run/render.py", "run/capture.py", "bench/contenders.py", "bench/steps.py",
                  "bench/draft.py", "bench/harness.py", "bench/fp8.py"}


def _expand(names: list[str]) -> list[str]:
    """'job/*' -> every module of job/, in file order."""
    return [_rel(p) for n in names for p in SOURCES if _rel(p) == n or n.endswith("/*") and _rel(p).startswith(n[:-1])]


def _stage(rel: str) -> str:
    for stage, members in STAGES.items():
        if rel in members:
            return stage
    for stage, members in STAGES.items():
        if any(m.endswith("/*") and rel.startswith(m[:-1]) for m in members):
            return stage
    raise AssertionError(f"{rel} is in no stage: add it to STAGES and to docs/ARCHITECTURE.md")


def _module_file(name: str) -> str | None:
    """'storyboard_cli.engine.graph.runner' -> 'engine/graph/runner.py' (a package: its __init__.py); None outside."""
    if not name.startswith("storyboard_cli."):
        return None
    rel = name.removeprefix("storyboard_cli.").replace(".", "/")
    for candidate in (f"{rel}.py", f"{rel}/__init__.py", f"{rel.rsplit('/', 1)[0]}.py"):
        if (PACKAGE / candidate).is_file():
            return candidate
    return None


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_no_module_imports_up_a_stage(path):
    mine = ORDER.index(_stage(_rel(path)))
    up = {m for m in _imports(path, run_time=True) if (f := _module_file(m)) and ORDER.index(_stage(f)) > mine}
    assert not up, f"{_rel(path)} ({_stage(_rel(path))}) imports {sorted(up)}"


@pytest.mark.parametrize("name", _expand(TORCH_FREE))
def test_torch_free_modules_do_not_import_it(name):
    assert not {m for m in _imports(PACKAGE / name) if m == "torch" or m.startswith("torch.")}


def test_torch_free_modules_import_no_torch_at_run_time():
    import subprocess
    import sys

    # not even through what they import
    modules = ", ".join(f"storyboard_cli.{n.removesuffix('.py').removesuffix('/__init__').replace('/', '.')}"
                        for n in _expand(TORCH_FREE))
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# the serve modules that render, and so import torch: the worker loop and the lease render it calls
SERVE_RENDER = {"serve/worker.py", "serve/lease_session.py"}


def test_every_serve_module_but_the_workers_render_is_torch_free():
    """The API process never loads a model: a new serve module is torch-free (in TORCH_FREE) unless it renders."""
    serve = {_rel(p) for p in SOURCES if _rel(p).startswith("serve/") and p.name != "__init__.py"}
    assert serve - set(_expand(TORCH_FREE)) == SERVE_RENDER


def test_only_the_drivers_import_the_engine():
    importing = {_rel(p) for p in SOURCES if not _rel(p).startswith("engine/")
                 and any(m == "storyboard_cli.engine" or m.startswith("storyboard_cli.engine.") for m in _imports(p))}
    assert importing == ENGINE_DRIVERS


def test_only_folder_names_the_output_folders_files():
    """report.json, manifest.jsonl, ... are names defined once (docstrings and comments may mention them)."""
    names = ("report.json", "report.md", "manifest.jsonl", "index.html", "picks.json", ".bcg.lock", ".shards",
             ".replaced")
    spelled = set()
    for path in SOURCES:
        tree = _tree(path)
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef,
                ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and any(n in node.value for n in names)):
                spelled.add(_rel(path))
    assert spelled == {"folder/layout.py"}


def test_picks_reads_the_folder_through_folder_not_the_sheet():
    assert "storyboard_cli.folder.sheet" not in _imports(PACKAGE / "folder/picks.py")


def test_no_engine_probing_in_render():
    text = (PACKAGE / "run/render.py").read_text(encoding="utf-8")
    for probe in ("hasattr(", "isinstance(self.engine", "isinstance(engine", "GraphRunner", "EagerEngine"):
        assert probe not in text, probe


# Import circles not yet cut, each the set of modules that import one another (issue 32). No other circle may form and
# none may grow; an entry that is no longer a circle fails the test too: take it out.
CIRCLES_TO_CUT: list[set[str]] = []  # none left


def _circles() -> list[set[str]]:
    """The import graph's strongly connected sets of more than one module, as the code reads: lazy imports and those
    under TYPE_CHECKING count (a module's annotations name the other's types: the two are one room)."""
    graph = {_rel(p): {f for m in _imports(p) if (f := _module_file(m)) and f != _rel(p)} for p in SOURCES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while v not in members:
                members.add(stack.pop())
            if len(members) > 1:
                circles.append(members)

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    circles = _circles()
    assert [c for c in circles if c not in CIRCLES_TO_CUT] == [], "modules that import one another"
    assert [c for c in CIRCLES_TO_CUT if c not in circles] == [], "no longer a circle: take it out of CIRCLES_TO_CUT"


TESTS = Path(__file__).resolve().parent


def test_test_modules_share_through_conftest_and_helpers_and_mark_slow_per_test():
    """A test module imports no other test module: shared fixtures are in conftest.py, shared functions in
    tests/helpers/. `slow` marks a test, not a module: a module-wide mark would drop its fast tests from `make
    test-fast`."""
    modules = sorted(TESTS.glob("test_*.py"))
    assert len(modules) > 40
    names = {p.stem for p in modules}
    imports = [f"{p.name} imports {m}" for p in modules for m in sorted({n.split(".")[0] for n in _imports(p)} & names)]
    assert imports == []
    whole = {p.name for p in modules for node in _tree(p).body if isinstance(node, ast.Assign)
             and [ast.unparse(t) for t in node.targets] == ["pytestmark"] and "mark.slow" in ast.unparse(node.value)}
    assert not whole, f"mark these modules' slow tests one by one: {sorted(whole)}"
