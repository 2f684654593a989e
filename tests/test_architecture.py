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
    "base": {"errors.py", "samplers.py", "steps.py", "costs.py", "costs_h200.py", "cuda_env.py", "folder/layout.py", "models/tiny.py", "models/tokenizers.py",
             "models/__init__.py"},
    "job": {"job/*", "job/conditions/*"},
    "models": {"models/*"},
    "engine": {"engine/*", "engine/kernels/*", "engine/graph/*", "engine/conditions/*"},
    "folder": {"folder/*"},
    "run": {"run/*"},
    "serve": {"serve/*"},
    "top": {*CLI, "__init__.py", "bench/*"},
}
ORDER = list(STAGES)
FOLDERS = [m.removesuffix("/*") for members in STAGES.values() for m in members if m.endswith("/*")]
# what a package's __init__.py may import: the engine's protocol (`from storyboard_cli.engine import Engine`)
# and the conditioning kinds' table, its rows (`from storyboard_cli.engine.conditions import KINDS`)
REEXPORTS = {"engine": {"storyboard_cli.engine.base", "storyboard_cli.engine.base.Engine",
                        "storyboard_cli.engine.base.Shape"},
             "engine/conditions": {"storyboard_cli.engine.conditions", "storyboard_cli.engine.conditions.control",
                                   "storyboard_cli.engine.conditions.reference", "storyboard_cli.engine.conditions.source",
                                   "storyboard_cli.engine.conditions.region",
                                   "storyboard_cli.engine.conditions.kind", "storyboard_cli.engine.conditions.kind.Kind"},
             # the table of conditioning kinds: one row per module of the folder
             "job/conditions": {"storyboard_cli.job.conditions", "storyboard_cli.job.conditions.control",
                                "storyboard_cli.job.conditions.reference", "storyboard_cli.job.conditions.source",
                                "storyboard_cli.job.conditions.region", "storyboard_cli.job.kind",
                                "storyboard_cli.job.kind.Kind"}}
# torch-free at run time, through everything they import: `bcg plan`, job validation, the folder's readers and
# writers, `bcg sheet`, `bcg pick`. A folder: every module in it.
TORCH_FREE = ["errors.py", "samplers.py", "steps.py", "costs.py", "costs_h200.py", "cuda_env.py", "job/*", "folder/*", "run/signals.py", "serve/schedule.py",
              "serve/intake.py", "serve/store.py", "serve/queue_file.py", "serve/queue_workers.py",
              "serve/queue_stats.py", "serve/metrics.py", "serve/api.py", "serve/client.py", "serve/lease_client.py",
              "serve/server.py", "serve/folders.py", "serve/blobs.py", "serve/blob_routes.py", "serve/edge.py",
              "serve/wire.py", "serve/nvml.py", "serve/settings.py", "serve/inputs_cache.py",
              "serve/worker_options.py", "serve/openapi.py", "serve/api_state.py", "serve/job_routes.py",
              "serve/lease_routes.py", "serve/ops_routes.py", "serve/disk.py", "serve/queue_control.py",
              "serve/queue_views.py", "serve/queue_routes.py", "serve/ui_routes.py", "serve/estimates.py"]
# who drives an engine (builds one, prepares it, samples with it): the batch runner and the render that
# builds one; capture and bench's parts, which time them
ENGINE_DRIVERS = {"run/batch.py", "run/render.py", "run/capture.py", "bench/contenders.py", "bench/steps.py",
                  "bench/draft.py", "bench/harness.py", "bench/fp8.py",
                  "bench/source.py"}


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


# ---------------------------------------------------------------- conditioning kinds (job/conditions/)


def test_the_table_of_kinds_lists_every_module_of_job_conditions_once():
    from storyboard_cli.job import conditions

    modules = {p.stem for p in (PACKAGE / "job" / "conditions").glob("*.py") if p.stem != "__init__"}
    assert set(conditions.MODULES) == modules
    assert [k.name for k in conditions.KINDS] == list(conditions.MODULES)
    assert all(conditions.MODULES[k.name].KIND is k for k in conditions.KINDS)
    fields = [f for k in conditions.KINDS for f in conditions.kind_fields(k) if f not in STEP_WORDS]
    assert len(fields) == len(set(fields)), "two kinds share a field's name: which one a module means is unclear"


def test_every_kind_holds_the_whole_protocol_and_keyword_only_parts():
    import dataclasses

    from storyboard_cli.job import conditions
    from storyboard_cli.job.kind import Kind

    members = {n for n in vars(Kind) if not n.startswith("_")} | set(Kind.__annotations__)
    for kind in conditions.KINDS:
        assert not {m for m in members if not hasattr(kind, m)}, kind.name
        for attr in ("JobPart", "ShotPart", "ItemPart", "KeyPart", "SummaryPart"):
            part = getattr(kind, attr)
            params = getattr(part, "__dataclass_params__")
            assert params.frozen and all(f.kw_only for f in dataclasses.fields(part)), f"{kind.name}.{attr}"


KIND_ROOMS = ("job/", "folder/", "serve/")  # where only a `conditions/` folder names a kind's fields
# the step plan's word (steps.StepKind.control: a step runs the side networks), which bucket keys, `bcg plan` and
# the control kind's `control:` share
STEP_WORDS = {"control"}
# Modules that still name a kind's fields, each with the names it may (none may be added, an entry or a name it no
# longer spells fails the test: take it out). The wire's job body schema is pydantic, so it stays in serve/ (job/ does
# not import pydantic), checked against the rows through TOP_KEYS and SHOT_KEYS (tests/test_serve_api.py's
# test_the_openapi_schema_says_every_answer_and_describes_the_job); the IP-Adapter's files and presets are read by the
# loader too.
KIND_FIELDS_TO_CUT = {
    "serve/wire.py": {"controlnet", "controlnets", "characters", "reference", "ip_adapter", "image_encoder",
                      "REFERENCE_SLOTS", "init", "mask", "regions", "REGION_SLOTS"},
    "job/adapter_files.py": {"image_encoder"},
    "job/preflight.py": {"ip_adapter", "image_encoder"},
}


def _kind_fields() -> set[str]:
    from storyboard_cli.job import conditions

    return {f for k in conditions.KINDS for f in conditions.kind_fields(k)} - STEP_WORDS


def _spelled(path: Path, names: set[str]) -> set[str]:
    """The names a module spells as an identifier (a name, an attribute, a keyword, a parameter, a definition, an
    import) or as a whole string (a dict key, a field's name in a message's f-string does not count)."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.keyword, ast.arg)):
            found.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found & names


@pytest.mark.parametrize("path", [p for p in SOURCES if _rel(p).startswith(KIND_ROOMS)
                                  and "/conditions/" not in f"/{_rel(p)}"], ids=_rel)
def test_no_module_outside_conditions_names_a_kinds_fields(path):
    spelled = _spelled(path, _kind_fields())
    allowed = KIND_FIELDS_TO_CUT.get(_rel(path), set())
    assert spelled <= allowed, f"{_rel(path)} names {sorted(spelled - allowed)}: read them through job/conditions/"
    assert allowed <= spelled, f"{_rel(path)} no longer names {sorted(allowed - spelled)}: cut them from the ratchet"


# Conditioning kinds (engine/conditions/): one row each in the engine's table, one module each, joined to the job
# half's rows (job/conditions/) by name. A kind's module exports the names that are its alone (`FIELDS`: the WorkItem
# fields it reads, its tensors' names); outside */conditions/ no module of engine/ or run/ spells one (an identifier,
# an attribute, an argument or a string; docstrings and comments may mention them), so the step, the buffers, the
# graph runner and the batch runner read the rows and name no kind.
KIND_SCOPE = ("engine/", "run/")
# the exported UNet call's inputs are the compiled artifacts' traced signature (prebuilt kernels are keyed by it)
PINNED_FIELDS = {"engine/kernels/export.py": {"ref_tokens", "ref_scale", "ref_mask"}}
# what still names a kind's fields, to move behind the rows; none may be added, an entry that is gone fails too
FIELDS_TO_MOVE: dict[str, set[str]] = {}  # none left


def _kind_modules() -> list[str]:
    return sorted(p.stem for p in (PACKAGE / "engine" / "conditions").glob("*.py") if p.stem not in ("__init__", "kind"))


def test_every_kind_has_a_row_and_its_module_exports_its_fields():
    import importlib

    from storyboard_cli.engine.conditions import KINDS

    assert sorted(KINDS) == sorted(row.name for row in KINDS.values()) and len(KINDS) >= 2
    modules = {m: importlib.import_module(f"storyboard_cli.engine.conditions.{m}") for m in _kind_modules()}
    # every kind module is a row, and every row is a module's
    assert sorted(m.KIND.name for m in modules.values()) == sorted(KINDS)
    for name, module in modules.items():
        row = KINDS[module.KIND.name]
        assert row is module.KIND and row.fields == module.FIELDS and row.fields, name
        text = (PACKAGE / "engine" / "conditions" / f"{name}.py").read_text(encoding="utf-8")
        assert all(f in text for f in row.fields), f"{name}.py exports a field it never spells"
    fields = [f for row in KINDS.values() for f in row.fields]
    assert len(fields) == len(set(fields)), "a field belongs to two kinds"


def test_every_kind_has_a_row_in_both_halves():
    """The job half (job/conditions/) and the engine half (engine/conditions/) are joined by the kind's name."""
    import importlib

    from storyboard_cli.engine.conditions import KINDS

    job = importlib.import_module("storyboard_cli.job.conditions")
    assert sorted(k.name for k in job.KINDS) == sorted(KINDS)


def _spelled_at(path: Path, names: set[str]) -> dict[str, int]:
    """name -> the first line where `path` spells it as code (not in a docstring or a comment)."""
    tree = _tree(path)
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
            ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            spelled = node.id
        elif isinstance(node, ast.Attribute):
            spelled = node.attr
        elif isinstance(node, ast.arg):
            spelled = node.arg
        elif isinstance(node, ast.keyword):
            spelled = node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            spelled = node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            spelled = node.value
        else:
            continue
        if spelled in names:
            found.setdefault(spelled, node.lineno)
    return found


def test_no_module_outside_the_kinds_names_their_fields():
    from storyboard_cli.engine.conditions import KINDS

    fields = {f for row in KINDS.values() for f in row.fields}
    naming = {}
    for path in SOURCES:
        rel = _rel(path)
        if rel.startswith(KIND_SCOPE) and "/conditions/" not in rel:
            found = {n: line for n, line in _spelled_at(path, fields).items() if n not in PINNED_FIELDS.get(rel, ())}
            if found:
                naming[rel] = found
    assert {rel: set(found) for rel, found in naming.items()} == FIELDS_TO_MOVE, naming


def test_the_field_check_sees_a_field():
    """The check itself: a module that spells a kind's field, as code, is caught; a docstring's mention is not."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text('"""mentions references."""\n\ndef f(item):\n    return item.references, "ref_mask"\n',
                         encoding="utf-8")
        assert _spelled_at(probe, {"references", "ref_mask", "controls"}) == {"references": 4, "ref_mask": 4}


def test_no_module_uses_a_name_it_never_defines():
    """An undefined name fails only on the path that reaches it: a `bcg capture --warm` (GPU-only) once raised a
    NameError left by a merge. pyflakes finds every one without running the code."""
    from pyflakes.checker import Checker
    from pyflakes.messages import UndefinedName

    found = []
    for path in [*SOURCES, *sorted((PACKAGE.parent / "benchmarks").rglob("*.py"))]:
        checker = Checker(ast.parse(path.read_text(), str(path)), filename=str(path))
        found += [f"{path.relative_to(PACKAGE.parent)}:{m.lineno}: {m.message % m.message_args}"
                  for m in checker.messages if isinstance(m, UndefinedName)]
    assert not found, found
