"""The benchmark area (docs/ARCHITECTURE.md, "The benchmark area"; benchmarks/README.md): every record and raw file
that docs/PERFORMANCE.md and the READMEs cite exists, the records are kept by topic, gpu.sh runs the legs its header
and the README name, the scripts import names the package has, and the package and the tests never import them."""

import ast
import fnmatch
import importlib
import json
import re
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
RAW = RESULTS / "raw.tar.xz"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
README = BENCH / "README.md"
GPU_SH = BENCH / "gpu.sh"
TOPICS = {p.name for p in RESULTS.iterdir() if p.is_dir()}


def _braces(pattern: str) -> list[str]:
    """'a-{b,c}-*.json' -> ['a-b-*.json', 'a-c-*.json'], as the shell expands it."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _braces(pattern[:m.start()] + alt + pattern[m.end():])]


def _quoted(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", path.read_text(encoding="utf-8"))


def _record_paths() -> list[tuple[str, str]]:
    """(document, path pattern) for every path under benchmarks/ a document quotes; benchmarks/README.md also names
    records from results/ (`compiled/...`)."""
    cited = []
    for doc in (PERFORMANCE, ROOT / "README.md", README):
        for text in _quoted(doc):
            for word in text.split():
                word = word.rstrip(",;:)")
                if word.startswith("benchmarks/") and not word.startswith("benchmarks/gpu.sh"):
                    cited.append((doc.name, word))
                elif doc == README and word.split("/")[0] in TOPICS:
                    cited.append((doc.name, f"benchmarks/results/{word}"))
    return cited


def test_the_documents_cite_records():
    assert len(_record_paths()) > 50


@pytest.mark.parametrize("doc, pattern", _record_paths())
def test_every_cited_file_exists(doc, pattern):
    for alt in _braces(pattern):
        assert list(ROOT.glob(alt)) or (ROOT / alt).exists(), f"{doc} cites {alt}, which is not there"


def test_every_raw_file_performance_cites_is_in_the_archive():
    with tarfile.open(RAW) as tar:
        names = tar.getnames()
    cited = re.findall(r"raw\s+`(20[^`]+)`", PERFORMANCE.read_text(encoding="utf-8"))
    assert len(cited) > 20
    for pattern in cited:
        for alt in _braces(pattern):
            assert fnmatch.filter(names, alt) or fnmatch.filter(names, alt + "*"), f"raw {alt} is not in {RAW.name}"


def test_results_are_json_records_by_topic():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and not re.fullmatch(r"raw(-[\d-]+)?\.tar\.xz", p.name)]
    assert not loose, f"results/ holds topic folders and raw archives only: {loose}"
    for topic in TOPICS:
        files = list((RESULTS / topic).iterdir())
        assert files, topic
        for f in files:
            assert f.suffix in (".json", ".jsonl"), f
            assert f.suffix == ".jsonl" or re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9x.-]+\.json", f.name), f
            for line in f.read_text(encoding="utf-8").splitlines() if f.suffix == ".jsonl" else [f.read_text()]:
                json.loads(line)


def _legs() -> tuple[set[str], set[str]]:
    """gpu.sh's legs as its header lists them, and as its `leg` function's cases run them."""
    text = GPU_SH.read_text(encoding="utf-8")
    header = text[text.index("# Legs"):text.index("\nset -uo")]
    listed = set(re.findall(r"^#   (\w+)", header, re.M))
    body = text[text.index("leg() {"):]
    cases = {name for label in re.findall(r"^  ([\w|]+)\)$", body, re.M) for name in label.split("|")}
    return listed, cases


def test_gpu_sh_runs_the_legs_it_lists():
    subprocess.run(["bash", "-n", str(GPU_SH)], check=True)
    listed, cases = _legs()
    assert listed == cases and len(cases) > 10


def test_gpu_sh_runs_a_leg_with_no_artz_and_packs_its_logs(tmp_path):
    """A call without prebuilt kernels (`ARTZ` unset, under `set -u`) runs its legs and packs its logs: a leg whose
    step fails at once (a test file that does not exist) still leaves its line in walls.txt."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "ARTZ"}
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(GPU_SH), "tests:no_such_file"], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "SMOKE": "1", "OUT": str(out), "LIMIT": "120"}, timeout=150)
    assert "unbound variable" not in run.stderr, run.stderr
    with tarfile.open(out / "logs.tgz") as logs:
        walls = logs.extractfile("./walls.txt").read().decode()
    assert re.search(r"^1-tests-gpu0-no_such_file rc=\d+ ", walls, re.M), walls


def test_gpu_sh_sends_back_no_file_of_artz_the_call_left_alone(tmp_path):
    """`art.tgz` carries what a call wrote into the cache, by time (a stored FP8 scales file calibrated again keeps its
    name): ARTZ's files keep their archived times when unpacked, so one the call left alone does not come back."""
    import os

    src = tmp_path / "src"
    src.mkdir()
    (src / "fp8-scales-0123456789abcdef0123.json").write_text("{}\n")
    (src / "unet-fp8-64x64-0123456789abcdef0123.pt2").write_bytes(b"x")
    for f in src.iterdir():
        os.utime(f, (1.6e9, 1.6e9))
    artz = tmp_path / "artz.tgz"
    with tarfile.open(artz, "w:gz") as tar:
        for f in sorted(src.iterdir()):
            tar.add(f, arcname=f.name)
    out = tmp_path / "out"
    try:
        run = subprocess.run(["bash", str(GPU_SH), "tests:no_such_file"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "SMOKE": "1", "OUT": str(out), "LIMIT": "120", "ARTZ": str(artz)},
                             timeout=150)
    finally:  # gpu.sh's cache is its machine's /tmp/bcg
        for f in src.iterdir():
            Path("/tmp/bcg/compiled", f.name).unlink(missing_ok=True)
    assert (out / "logs.tgz").is_file(), run.stderr
    with tarfile.open(out / "logs.tgz") as logs:
        at_start = logs.extractfile("./cache_at_start.txt").read().decode().split()
    assert {f.name for f in src.iterdir()} <= set(at_start)
    assert not (out / "art.tgz").exists()


def test_the_fast_accumulation_scout_exports_the_fp8_gemms_with_the_flag():
    """`step_scout.py fp8_fastaccum` builds production's FP8 UNet with one change: every FP8 Linear's `_scaled_mm` in
    the export carries `use_fast_accum=True`, and production's does not. On the CPU the Linears run a float matmul, so
    the scout's CPU run cannot show it; an export on the meta device takes the GPU's branch."""
    code = """
import sys, torch
from contextlib import ExitStack
sys.path.insert(0, "benchmarks/probes")
import step_scout
from storyboard_cli.engine.kernels import fp8
net = torch.nn.Sequential(fp8.Fp8Linear(torch.nn.Linear(64, 32, device="meta", dtype=torch.float16)))
x = torch.empty(16, 64, device="meta", dtype=torch.float16)
for fast in (False, True):
    with ExitStack() as patched:
        for patch in step_scout.FastAccum.patches() if fast else ():
            patched.enter_context(patch)
        graph = torch.export.export(net, (x,)).graph
    flags = [(n.args + (False,) * 8)[7] or n.kwargs.get("use_fast_accum", False) for n in graph.nodes
             if "_scaled_mm" in str(n.target)]
    print(fast, flags)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.split("\n")[:2] == ["False [False]", "True [True]"], run.stdout + run.stderr[-2000:]


def test_the_autotuning_scouts_build_with_the_gemm_backends_production_leaves_out():
    """`step_scout.py autotune` and `fp8_autotune` build production's UNets with inductor's GEMM autotuning over cuBLAS
    and Triton: the build's options (`artifacts.options`, the row's own last) name both backends under the scout's
    change, and production's FP8 builds name cuBLASLt alone."""
    code = """
import sys
from contextlib import ExitStack
sys.path.insert(0, "benchmarks/probes")
import step_scout
from storyboard_cli.engine.kernels import artifacts
from storyboard_cli.engine.kernels.artifacts import Target
from storyboard_cli.engine.variants import VARIANTS
def backends(variant):
    got = artifacts.options(Target("unet", 1024, 1024, VARIANTS[variant].precision))
    return got.get("max_autotune_gemm_backends"), got.get("max_autotune_gemm", False)
print("fp8", *backends("fp8"))
for scout in ("autotune", "fp8_autotune"):
    variant, extra = step_scout.OPTIONS[scout]
    with ExitStack() as patched:
        for patch in step_scout.RECIPES[scout].patches() if scout in step_scout.RECIPES else ():
            patched.enter_context(patch)
        artifacts.INDUCTOR_OPTIONS.update(extra)
        print(scout, *backends(variant))
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.split("\n")[:3] == ["fp8 ATEN False", "autotune ATEN,TRITON True",
                                          "fp8_autotune ATEN,TRITON True"], run.stdout + run.stderr[-2000:]


def test_an_autotuning_build_waits_for_the_other_lanes_timing(tmp_path):
    """Two scouts run as lanes on one GPU; their timings take turns on a file lock. An autotuning build times candidate
    kernels on the GPU as it builds, so it takes the same turn: it waits while the other lane holds it."""
    code = f"""
import fcntl, sys, threading, time
from types import SimpleNamespace
sys.path.insert(0, "benchmarks/probes")
import step_scout
print(*[n for n in step_scout.OPTIONS if step_scout.tunes_on_gpu(n)])
args = SimpleNamespace(build_dir=__import__("pathlib").Path({str(tmp_path / "build")!r}))
class Rec(dict):
    put = dict.__setitem__
rec = Rec()
other = open(args.build_dir.parent / "step-scout-timing.lock", "w")
fcntl.flock(other, fcntl.LOCK_EX)
def build():
    with step_scout.timing_turn(args, rec, "build_lock_wait_s"):
        rec["built_at"] = time.perf_counter()
t = threading.Thread(target=build); t.start()
time.sleep(0.6)
released = time.perf_counter(); other.close(); t.join(10)
print(rec["built_at"] >= released, rec["build_lock_wait_s"] >= 0.5)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.split("\n")[:2] == ["autotune fp8_autotune", "True True"], run.stdout + run.stderr[-2000:]


def test_the_readme_names_only_legs_gpu_sh_has():
    _, legs = _legs()
    text = README.read_text(encoding="utf-8")
    named = set(re.search(r"the legs: `([^`]+)`", text.replace("\n", " ")).group(1).split())
    assert {n.split("[")[0] for n in named} == legs
    table = text[text.index("| script (`bench/`) | legs |"):text.index("## Probes")]
    for cell in re.findall(r"^\| `[\w.]+` \| (.+) \|$", table, re.M):
        for spec in " ".join(re.findall(r"`([^`]+)`", cell)).split():
            if "=" not in spec and not spec.startswith(("python", "benchmarks/")):
                assert spec.split(":")[0].split("@")[0] in legs, spec


def _script_imports() -> list[tuple[str, str, str, list[str]]]:
    """(script, module, name, the attributes the script reads or sets on it) for each `from storyboard_cli... import`."""
    out = []
    for path in sorted(BENCH.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                used.setdefault(node.value.id, set()).add(node.attr)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("storyboard_cli"):
                out += [(path.relative_to(ROOT).as_posix(), node.module, a.name, sorted(used.get(a.asname or a.name, ())))
                        for a in node.names]
    return out


@pytest.mark.parametrize("script, module, name, attrs", _script_imports(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_scripts_import_what_the_package_has(script, module, name, attrs):
    """A probe is not maintained as an entry point, but it must still name what the package has: a module it reads
    (`C.text_dims`) or patches (`graphs.CHECK_RTOL = ...`) has that attribute. The product's Triton kernels import
    where Triton is (a GPU's torch has it; CI's CPU torch has not)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        pytest.skip("needs Triton")
    obj = getattr(mod, name, None)
    if obj is None and importlib.util.find_spec(f"{module}.{name}"):
        obj = importlib.import_module(f"{module}.{name}")
    assert obj is not None, f"{script}: {module} has no {name}"
    if isinstance(obj, types.ModuleType):
        assert not [a for a in attrs if not hasattr(obj, a)], f"{script}: {module}.{name} lacks {attrs}"


def _test_imports() -> list[tuple[str, str, str]]:
    """(script, module, name) for each name a script takes from the tests' modules (run with PYTHONPATH=tests)."""
    out = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    (ROOT / "tests" / (node.module.replace(".", "/") + ".py")).is_file():
                out += [(path.relative_to(ROOT).as_posix(), node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("script, module, name", _test_imports())
def test_the_scripts_import_what_the_tests_have(script, module, name):
    tree = ast.parse((ROOT / "tests" / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert name in defined, f"{script}: tests/{module} has no {name}"


def test_neither_the_package_nor_the_tests_import_the_benchmarks():
    importing = []
    for path in [*(ROOT / "storyboard_cli").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                importing.append(path.relative_to(ROOT).as_posix())
    assert not importing



def test_rekey_renames_what_was_built_under_the_key_with_the_l2_size_to_todays_key(tmp_path):
    """`probes/rekey.py`: an artifact whose name is the one the code before gave it (its key named the L2's size) on a
    card with the L2 named is renamed, with its marker and build record, to today's name; one built on a card with
    another L2, or a file of another kind, keeps its name. On a faked H100 SXM with the tiny models."""
    code = f"""
import sys, torch, pytest
from pathlib import Path
from types import SimpleNamespace
sys.path[:0] = ["benchmarks/probes", "tests"]
import rekey
from helpers.kernels import H100_SXM, OnGpu, fake_gpu
from storyboard_cli.engine.kernels.artifacts import artifact_key
from storyboard_cli.engine.kernels.export import Target
from storyboard_cli.models.loader import load_sdxl
tiny = load_sdxl("tiny", "tiny", "cpu", torch.float32)
models = SimpleNamespace(unet=OnGpu(tiny.unet), controlnets=(OnGpu(tiny.controlnets[0]),))
root = Path({str(tmp_path)!r})
with pytest.MonkeyPatch.context() as mp:
    fake_gpu(mp, dict(H100_SXM))
    unet, net, other = Target("unet", 128, 128), Target("controlnet", 192, 128, "fp8"), Target("unet", 64, 64)
    for target, l2 in ((unet, rekey.H100_SXM_L2), (net, rekey.H100_SXM_L2), (other, 40 << 20)):
        model = models.unet if target.module == "unet" else models.controlnets[0]
        stem = rekey.legacy_path(target, model, root, l2).name.removesuffix(".pt2")
        for suffix in (".pt2", ".ok", ".build.json"):
            (root / (stem + suffix)).write_text(suffix)
    (root / "checked-0123456789abcdef0123.json").write_text("{{}}")
    with mp.context() as old_torch:
        old_torch.setattr(torch, "__version__", "2.0.0")
        print("legacy", rekey.legacy_path(unet, models.unet, root, rekey.H100_SXM_L2).stem.rsplit("-", 1)[1])
    for line in rekey.rekey(root, models, [unet, net, other], rekey.H100_SXM_L2):
        print(line)
    print("keys", artifact_key(unet, models.unet), artifact_key(net, models.controlnets[0]))
print("files", *sorted(p.name for p in root.iterdir()))
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.splitlines()
    # the key 8e201c6's artifacts.py (the L2's size in GPU_FACTS) gave the tiny UNet at 128x128 on this faked H100
    # under torch "2.0.0", run with that tree first on the path: rekey's legacy key is the old code's. A new recipe
    # leaves the sets rekey.py is for stale; then the probe and this test go
    assert "legacy 176d8b485b0739e4c6c3" in out, out
    unet_key, net_key = out[-2].split()[1:]
    files = set(out[-1].split()[1:])
    renamed = [line for line in out if " -> " in line]
    assert len(renamed) == 2 and any("kept" in line and "64x64" in line for line in out), out
    for stem in (f"unet-128x128-{unet_key}", f"controlnet-fp8-128x192-{net_key}"):
        assert {stem + s for s in (".pt2", ".ok", ".build.json")} <= files, files
    assert len([f for f in files if f.startswith("unet-64x64-")]) == 3 and "checked-0123456789abcdef0123.json" in files
    assert len(files) == 10, files
    assert all(line.split(" -> ")[0] not in files for line in renamed)
