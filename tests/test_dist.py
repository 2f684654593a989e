"""One job over several torchrun workers (gloo, CPU): the same files as one process (hires passes included), one
manifest, one report; two "machines" on one host; a worker killed and a launcher stopped lose nothing."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import DATA, ROOT, write_job
from storyboard_cli.folder.layout import SHARDS
from storyboard_cli.folder.outputs import Manifest, read_fingerprint
from storyboard_cli.folder.report import Report, Timings
from storyboard_cli.folder.shards import merge_shards, shard_manifest
from storyboard_cli.job.plan import Batch, BucketKey, WorkItem
from storyboard_cli.run import dist

# What the workers run. Until `bcg render` calls dist.render, the same phases are reached through
# dist.py's own entry point; then this becomes "storyboard_cli".
MODULE = "storyboard_cli"

JOB = """version: 1
model: tiny
controlnet: tiny
buckets: [1, 2]
shots:
  - {id: big, prompt: a lighthouse at night, steps: 3, size: 64x96, candidates: 3, seed: 11}
  - {id: wide, prompt: a boat in the waves, steps: 3, size: 96x64, candidates: 3, seed: 12}
  - {id: small, prompt: a hut, steps: 2, size: 64x64, candidates: 4, seed: 13, sampler: dpmpp_2m,
     hires: {scale: 1.5, strength: 0.5}}
  - {id: pose, prompt: the keeper, steps: 2, size: 64x64, candidates: 1, seed: 14,
     control: {image: control/hero_pose.png, scale: 0.8}}
"""
IMAGES = 15  # 11 candidates and the 4 first passes of small's hires candidates (a worker renders the passes of its bases)
LONG = f"version: 1\nmodel: tiny\nbuckets: [1]\nshots:\n  - {{id: a, prompt: x, steps: 6, size: 64x64, candidates: 40}}\n"
VOLATILE = ("finished", "run")  # a manifest line's time and run id


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # torchrun's default for workers


def _torchrun(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _render_args(job, out):
    return ["-m", MODULE, "render", str(job), "--out", str(out), "--device", "cpu"]


def _finish(proc, timeout=120):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _files(out: Path) -> dict[str, np.ndarray]:
    return {p.relative_to(out).as_posix(): np.asarray(Image.open(p)) for p in sorted(out.rglob("*.png"))}


def _records(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in lines), key=lambda r: r["path"])


def _same_as(out: Path, reference: Path) -> None:
    got, want = _files(out), _files(reference)
    assert sorted(got) == sorted(want)
    for path in want:
        assert np.array_equal(got[path], want[path]), path
    assert _records(out) == _records(reference)  # their sha256 too: the same bytes
    assert not (out / SHARDS).exists()
    assert not (out / ".bcg.lock").exists() or not (out / ".bcg.lock").read_text().strip()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The job rendered by one plain process (what every multi-worker render must reproduce)."""
    import shutil

    folder = tmp_path_factory.mktemp("single")
    shutil.copytree(ROOT / "jobs" / "control", folder / "control")
    job = write_job(folder, JOB)
    proc = subprocess.run([sys.executable, "-m", "storyboard_cli", "render", str(job), "--out", str(folder / "out"),
                           "--device", "cpu"], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return job, folder / "out"


@pytest.mark.slow  # torchrun and worker processes
def test_two_workers_render_the_same_files_and_manifest_as_one_process(one_process, tmp_path):
    job, reference = one_process
    out = tmp_path / "out"
    code, log = _finish(_torchrun("--standalone", "--nproc-per-node", "2", *_render_args(job, out)))
    assert code == 0, log
    _same_as(out, reference)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "done" and report["images_rendered"] == IMAGES
    assert [w["rank"] for w in report["workers"]] == [0, 1]
    assert sum(w["images"] for w in report["workers"]) == IMAGES
    assert all(w["busy_s"] >= 0 and w["idle_s"] >= 0 for w in report["workers"])
    assert sum(b["images"] for b in report["buckets"]) == IMAGES


@pytest.mark.slow  # torchrun and worker processes
def test_two_machines_through_a_c10d_endpoint(one_process, tmp_path):
    job, reference = one_process
    out = tmp_path / "out"
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", "bcg-test"]
    nodes = [_torchrun(*rdzv, "--node-rank", str(n), *_render_args(job, out)) for n in (0, 1)]
    results = [_finish(p) for p in nodes]
    assert [code for code, _ in results] == [0, 0], results
    _same_as(out, reference)
    report = json.loads((out / "report.json").read_text())
    assert len(report["workers"]) == 2 and report["images_rendered"] == IMAGES


def _gpus_under_way(tmp_path: Path):
    """`bcg render LONG --gpus 2` on the CPU (torchrun's launcher in a child, its workers below it), once its
    workers have written 3 manifest lines: (job, out, launcher)."""
    job, out = write_job(tmp_path, LONG), tmp_path / "out"
    launcher = subprocess.Popen([sys.executable, "-m", MODULE, "render", str(job), "--out", str(out), "--device",
                                 "cpu", "--gpus", "2"], env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    _wait_for_lines(out, 3, launcher)
    return job, out, launcher


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_for_lines(out: Path, n: int, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        shards = list((out / SHARDS).glob("rank*/manifest.jsonl"))
        if sum(len(s.read_text().splitlines()) for s in shards) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("no progress")


def _lines(out: Path) -> list[dict]:
    """The manifest's lines and those of the shards a run left."""
    files = [out / "manifest.jsonl", *(out / SHARDS).glob("rank*/manifest.jsonl")]
    return [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines() if line.endswith("}")]


def _consistent(out: Path, killed: int | None = None) -> list[str]:
    """Every PNG whole, at most one manifest line per PNG and no line without its file, no temp file but those of
    `killed` (a writer killed with SIGKILL cannot remove its own; the next run sweeps them)."""
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert all(read_fingerprint(out / p) for p in pngs), "a broken PNG"
    paths = [r["path"] for r in _lines(out)]
    assert len(paths) == len(set(paths))
    assert set(paths) <= set(pngs)
    temps = [p.name for p in out.rglob(".*.tmp")]
    assert all(killed is not None and t.endswith(f".{killed}.tmp") for t in temps), temps
    return pngs


@pytest.mark.slow  # torchrun and worker processes
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers through /proc")
def test_stopped_launcher_and_killed_worker_lose_nothing(tmp_path):
    job, out, launcher = _gpus_under_way(tmp_path)
    # SIGTERM to the launcher (`--gpus 2`, torchrun's own API): every worker stops cleanly, at once
    workers = _children(launcher.pid)
    assert len(workers) == 2
    launcher.send_signal(signal.SIGTERM)
    t0 = time.time()
    code, log = _finish(launcher, timeout=60)
    assert time.time() - t0 < 20  # well before torchrun's 30 s SIGKILL
    assert not any(Path(f"/proc/{w}").exists() for w in workers)
    first = _consistent(out)
    assert 3 <= len(first) < 40
    # one summary, the launcher's, once the folder is whole: every worker's images counted
    assert code == 143 and log.count(" rendered, ") == 1 and f"interrupted: {len(first)} rendered, " in log, log
    # one worker killed with SIGKILL: torchrun takes the group down; finished images stay
    runner = _torchrun("--standalone", "--nproc-per-node", "2", *_render_args(job, out))
    _wait_for_lines(out, 3, runner)
    killed = _children(runner.pid)[1]
    os.kill(killed, signal.SIGKILL)
    code, log = _finish(runner)
    assert code != 0
    second = _consistent(out, killed)
    assert set(first) <= set(second)
    assert list((out / SHARDS).glob("rank*/manifest.jsonl")), "the dead run's shards are left for the next run"
    left = {r["path"]: r for r in _lines(out)}
    done = {p: (out / p).stat().st_mtime_ns for p in second}
    # the rerun renders only what is missing: no duplicate, no missing image
    code, log = _finish(_torchrun("--standalone", "--nproc-per-node", "2", *_render_args(job, out)))
    assert code == 0, log
    final = _consistent(out)
    assert len(final) == 40
    assert all((out / p).stat().st_mtime_ns == t for p, t in done.items())  # nothing finished was redone
    report = json.loads((out / "report.json").read_text())
    assert report["images_rendered"] + report["images_skipped"] == 40 and report["images_skipped"] == len(done)
    records = Manifest(out).records
    assert len(records) == 40 and not (out / SHARDS).exists()
    assert all(records[p] == r for p, r in left.items())  # the dead run's lines, merged as they were


def _rank_of(pid: int) -> int:
    env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return int(env["RANK"])


@pytest.mark.slow  # torchrun and worker processes
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers through /proc")
def test_a_worker_killed_under_gpus_is_a_failure_and_the_launcher_merges_the_shards(tmp_path):
    _, out, launcher = _gpus_under_way(tmp_path)
    victim = next(w for w in _children(launcher.pid) if _rank_of(w) == 1)
    os.kill(victim, signal.SIGKILL)
    code, log = _finish(launcher)
    assert code == 1, log  # a crash, not a stop (143): a farm's retry logic must tell them apart
    assert f"error: worker rank 1 (pid {victim}) died from SIGKILL" in log and "Traceback" not in log
    assert "--gpus 2: --device cpu, so 2 workers render on the CPU" in log
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "error" and report["error"].startswith(f"worker rank 1 (pid {victim}) died from SIGKILL")
    pngs = _consistent(out)
    assert not (out / SHARDS).exists()  # merged by the launcher, not left for the next run
    assert sorted(Manifest(out).records) == pngs and len(pngs) >= 3
    assert not any(n.endswith(dist.SHARDS_LEFT) for n in report["notes"])
    # the count is every worker's, the dead one's merged lines included, not rank 0's alone
    assert report["images_rendered"] == len(pngs), (report["images_rendered"], len(pngs), report["notes"], log)
    assert f"died from SIGKILL; the {len(pngs)} images this run rendered are kept, the next run renders the rest" in log
    assert "interrupted:" not in log and "sent no figures" not in log, log  # rank 0's partial view is not printed


def test_gpus_without_gpus_says_the_workers_render_on_the_cpu(monkeypatch):
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: False)
    assert dist.launch_note(2, None) == "--gpus 2: this machine has no GPU, so 2 workers render on the CPU"
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: True)
    assert dist.launch_note(2, None) is None and dist.launch_note(2, "cuda") is None
    assert dist.launch_note(3, "cpu") == "--gpus 3: --device cpu, so 3 workers render on the CPU"


@pytest.mark.gpu
def test_two_gpus_render_the_bench_job_faster_with_the_same_pixels(tmp_path):
    """On a 2-GPU machine: 2 workers >= 1.85x one GPU's images/s (weight loading excluded, capture
    included), every image identical."""
    import shutil

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    shutil.copytree(ROOT / "jobs" / "control", tmp_path / "control")
    job = tmp_path / "bench.yaml"
    shutil.copy(ROOT / "jobs" / "bench.yaml", job)
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["render", str(job), "--compile", "off"]
    single = subprocess.run([sys.executable, "-m", MODULE, *args, "--out", str(one), "--device", "cuda"], env=_env(),
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr
    code, log = _finish(_torchrun("--standalone", "--nproc-per-node", "2", "-m", MODULE, *args, "--out", str(two)),
                        timeout=900)
    assert code == 0, log
    _same_as(two, one)
    r1, r2 = (json.loads((d / "report.json").read_text()) for d in (one, two))
    rate1 = r1["images_rendered"] / (r1["wall_s"] - r1["stages_s"]["load"])
    assert r2["render_images_per_s"] >= 1.85 * rate1, (r2["workers"], rate1)


# --- the pieces, without processes --------------------------------------------------------------

class FakeStore:
    def __init__(self):
        self.counters: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]


def _batch(w: int, h: int, steps: int, size: int, n: int, tag: str) -> Batch:
    items = tuple(WorkItem(shot=tag, k=k, seed=k, prompt="p", negative="", width=w, height=h, steps=steps,
                           guidance=5.0, sampler="euler", outputs=(f"{tag}/{k}.png",)) for k in range(n))
    return Batch(BucketKey(w, h, steps, "euler"), items, size)


def test_claims_hand_out_every_batch_once_largest_first():
    batches = [_batch(64, 64, 2, 2, 2, "s"), _batch(64, 96, 4, 2, 2, "a"), _batch(96, 64, 4, 2, 2, "b"),
               _batch(64, 96, 4, 2, 2, "c"), _batch(64, 96, 4, 1, 1, "d"), _batch(96, 64, 4, 2, 2, "e")]
    store = FakeStore()
    a, b = dist.claim(store, batches, 0), dist.claim(store, batches, 1)
    got = {"a": [], "b": []}
    for name, it in [("a", a), ("b", b)] * 10:  # the two workers take turns
        batch = next(it, None)
        if batch is not None:
            got[name].append(batch)
    claimed = got["a"] + got["b"]
    assert sorted(id(x) for x in claimed) == sorted(id(x) for x in batches)  # each exactly once
    for mine in got.values():
        costs = [dist.cost(x) for x in mine]
        assert costs == sorted(costs, reverse=True)
    # each starts on a shape of its own in the largest tier and keeps to it
    assert [x.key.width for x in got["a"][:2]] == [64, 64]
    assert [x.key.width for x in got["b"][:2]] == [96, 96]


def test_merge_shards_keeps_the_newest_line_and_removes_the_shards(tmp_path):
    old = {"path": "a/1.png", "shot": "a", "sha256": "old"}
    (tmp_path / "manifest.jsonl").write_text(json.dumps(old) + "\n" + json.dumps({"path": "a/0.png"}) + "\n")
    shard_manifest(tmp_path, 0).append({"path": "a/1.png", "shot": "a", "sha256": "new"})
    one = shard_manifest(tmp_path, 1)
    one.append({"path": "b/0.png", "shot": "b"})
    with open(one.path, "a") as f:
        f.write('{"path": "b/1.pn')  # a line cut short by a kill
    assert merge_shards(tmp_path) == 2
    records = Manifest(tmp_path).records
    assert records["a/1.png"]["sha256"] == "new" and set(records) == {"a/0.png", "a/1.png", "b/0.png"}
    assert not (tmp_path / SHARDS).exists()
    assert merge_shards(tmp_path) == 0


def _worker_report(rank, rendered, denoise, wall, failed, peak, busy, arrived, status="done", notes=("a",)) -> dict:
    """A worker's report as it sends it to rank 0 (two buckets, rank 0's graphs and draft shot)."""
    t = Timings(stages={"load": 1.23456, "capture": 0.5 + rank / 3, "encode": 0.1, "denoise": denoise, "decode": 0.2,
                        "save": 0.3})
    b = t.bucket("1024x1024 30 steps euler")
    b.images, b.batches, b.rows, b.steps, b.denoise_s, b.waited_s = rendered, 2, 16, 60, denoise * 0.9, 0.25 + rank / 10
    c = t.bucket("832x1216 30 steps euler +control")
    c.images, c.batches, c.rows, c.steps, c.denoise_s = 1, 1, 2, 30 + rank, denoise * 0.1
    report = Report.build(job="jobs/x.yaml", out_dir=Path("out/x"), device=f"cuda:{rank}", dtype="float16",
                          engine="graph", model="sdxl", timings=t, wall_s=wall, rendered=rendered, skipped=3,
                          failed=failed, peak_mem_mb=peak, graphs=[{"shape": "8x1024x1024", "state": "graph"}],
                          status=status, notes=list(notes), run={"id": "r1", "started": "s", "finished": "f"},
                          shots=[{"shot": "a", "draft": False}, {"shot": "b", "draft": rank == 0}]).to_json()
    return report | {"rank": rank, "host": f"h{rank}", "busy_s": busy, "arrived_s": arrived}


WORKERS = [_worker_report(0, 8, 12.3456789, 20.123456, [], 1234.56, 15.6789, 17.00012),
           _worker_report(1, 6, 9.87654321, 18.7654321, [{"path": "b/y.png", "shot": "b", "reason": "oom"}], None,
                          13.1111, 16.5, status="failed", notes=("a", "b"))]


def test_report_json_keeps_its_keys_order_and_figures():
    """report.json (a render's, a worker's on its way to rank 0, the merged one) as tests/data/report/reports.json
    recorded it, key order included."""
    want = json.loads((DATA / "report" / "reports.json").read_text())
    single = Report.build(job="j.yaml", out_dir=Path("o"), device="cpu", dtype="float32", engine="eager",
                          model="tiny", timings=Timings(stages={"load": 0.11111, "capture": 0.0, "denoise": 2.71828}),
                          wall_s=3.14159, rendered=7, skipped=1, failed=[{"path": "a/x.png", "shot": "a", "reason": "r"}],
                          peak_mem_mb=None, graphs=[], status="failed", notes=["n"], stopped_by=15, error="e",
                          shots=[]).to_json()
    merged = Report.merge([Report.from_json(r) for r in WORKERS]).to_json()
    for got, name in ((single, "single"), (WORKERS[0], "worker"), (merged, "merged")):
        assert json.dumps(got) == json.dumps(want[name]), name
    assert all(Report.from_json(r).to_json() == r for r in (single, *WORKERS, merged))  # the file and back


def test_merged_report_sums_workers_and_measures_idle_on_each_clock():
    merged = Report.merge([Report.from_json(r) for r in WORKERS])
    assert merged.images_rendered == 14 and merged.images_failed == 1 and merged.status == "failed"
    assert [w["idle_s"] for w in merged.workers] == [0.0, 0.5] and merged.wall_s == round(20.123456 + 0.0, 3)
    assert [w["images_per_s"] for w in merged.workers] == [round(8 / 15.6789, 4), round(6 / 13.1111, 4)]
    assert merged.buckets[0]["images"] == 14 and merged.notes == ["a", "b"] and merged.peak_memory_mb == 1234.6
    assert merged.render_s == round(0.5 + 15.679 + 0.0, 3) and merged.steps_per_s == round(
        sum(r["steps_per_s"] for r in WORKERS), 3)
    assert merged.graphs == WORKERS[0]["graphs"] and merged.draft  # rank 0's
    assert not {"rank", "host", "busy_s", "arrived_s"} & set(merged.to_json())


def test_the_markdown_report_has_a_workers_table():
    from storyboard_cli.folder.report import markdown

    merged = Report.merge([Report.from_json(r) for r in WORKERS])
    text = markdown(replace(merged, graphs=[], shots=[]).to_json())
    assert "## Workers" in text and "| 1 | h1 | cuda:1 | 6 | 1 |" in text


def test_a_worker_keeps_to_its_lora_set_within_a_tier():
    """Same cost, same shape, two LoRA sets (in plan order, grouped): each worker keeps one set, so
    neither swaps weights between its batches."""
    sets = [(("a", 0.8),), (("a", 0.8),), (("b", 0.5),), (("b", 0.5),)]
    batches = [replace(_batch(64, 64, 2, 2, 2, f"s{i}"), key=replace(_batch(64, 64, 2, 2, 2, "x").key, loras=s))
               for i, s in enumerate(sets)]
    store = FakeStore()
    a, b = dist.claim(store, batches, 0), dist.claim(store, batches, 1)
    got = {"a": [], "b": []}
    for name, it in [("a", a), ("b", b)] * 3:
        batch = next(it, None)
        if batch is not None:
            got[name].append(batch.key.loras)
    assert got == {"a": [sets[0], sets[0]], "b": [sets[2], sets[2]]}


def test_the_launcher_records_an_image_a_killed_worker_wrote_but_did_not_record(tmp_path, tiny_cpu):
    """kill -9 can land between a worker's PNG rename and its shard line: once the workers have exited, the
    launcher merges the shards and adds a line for such a file (verified by its fingerprint), as the next
    render's start would; the folder's manifest then lists every PNG, each once, and the run's report counts that
    image too (a CI run saw 10 counted of 11 written)."""
    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, render

    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\ndefaults: {steps: 2, size: 64x64}\nshots:\n"
                                       "  - {id: a, prompt: x, seed: 3, candidates: 3}\n"))
    since = time.time() - 1  # file times may round down
    out = render(job, RenderOptions(out_dir=tmp_path / "out"), models=tiny_cpu).out_dir
    records = sorted(Manifest(out).records.values(), key=lambda r: r["path"])
    (out / "manifest.jsonl").unlink()
    for rank, record in enumerate(records[:2]):  # two workers' lines in their shards; the third never written
        shard_manifest(out, rank).append(record)
    assert dist._merge_after(out, job, since) == 1  # the third, written this run
    merged = Manifest(out).records
    assert sorted(merged) == [r["path"] for r in records] and not (out / SHARDS).exists()
    assert all(merged[r["path"]]["fingerprint"] == r["fingerprint"] and merged[r["path"]]["sha256"] == r["sha256"]
               for r in records)
    assert merged[records[0]["path"]] == records[0]  # a worker's own line, as it wrote it
    from storyboard_cli.folder.layout import read_report
    from storyboard_cli.folder.report import write_report

    write_report(out, Report.from_json(read_report(out)).recounted(2))  # what rank 0 saw: the two recorded
    assert dist._settle_report(out, "", 1, None).images_rendered == 3  # two lines of the run's, one recovered
    assert json.loads((out / "report.json").read_text())["images_rendered"] == 3
    assert dist._merge_after(out, job, time.time() + 60) == 0  # nothing left to recover, and none of a later run's


def test_after_a_death_or_rank_0_failing_the_count_is_what_the_manifest_holds_of_the_run(tmp_path, tiny_cpu):
    """Rank 0's figures count the workers whose reports came in. A CI run saw a worker killed while rank 0 published
    a report without the note that others sent none: 3 images in the manifest, 0 counted. Once a worker died, or
    rank 0 failed (it then publishes at once, without the note), the launcher counts what the manifest holds."""
    from storyboard_cli.errors import Status
    from storyboard_cli.folder.layout import read_report
    from storyboard_cli.folder.report import write_report
    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, render

    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\ndefaults: {steps: 2, size: 64x64}\nshots:\n"
                                       "  - {id: a, prompt: x, seed: 3, candidates: 3}\n"))
    out = render(job, RenderOptions(out_dir=tmp_path / "out"), models=tiny_cpu).out_dir
    rank0 = Report.from_json(read_report(out)).recounted(0)  # rank 1 rendered all three; its figures never came
    for status, death, want in [(Status.INTERRUPTED, "worker rank 1 (pid 7) died from SIGKILL", 3),
                                (Status.ERROR, None, 3), (Status.INTERRUPTED, None, 0)]:
        write_report(out, replace(rank0, status=status, notes=[]))
        settled = dist._settle_report(out, "", 0, death)
        assert settled.images_rendered == want, (status, death)
        assert json.loads((out / "report.json").read_text())["images_rendered"] == want
        assert settled.status == (Status.ERROR if death else status)
    write_report(out, replace(rank0, status=Status.ERROR, notes=[]))
    assert dist._settle_report(out, "", None, "died").images_rendered == 0  # the folder not settled: nothing to count


def test_rank_0_done_with_its_batches_shows_the_others_progress_to_the_total(monkeypatch):
    """Under --gpus, rank 0 prints the job's progress; once its own batches are done it waits for the others'
    figures, and the lines go on as they deliver theirs, the last one at the total."""
    from types import SimpleNamespace

    class Store:  # the others deliver 5 more images, then 5 more, then send their figures
        def __init__(self):
            self.polls, self.delivered = 0, 30

        def check(self, keys):
            self.polls += 1
            self.delivered += 5 if self.polls in (3, 6) else 0
            return self.polls >= 6

        def add(self, key, n):
            assert key == "delivered"
            self.delivered += n
            return self.delivered

    monkeypatch.setattr(dist, "DELIVERED_POLL_S", 0.0)
    session, shown = object.__new__(dist.DistSession), []
    session.w, session.store, session.show = dist.Worker(0, 2, 0), Store(), shown.append
    session.delivered, session.polled, session.pending = 30, 0.0, SimpleNamespace(outputs=40)
    assert session._gather(stopped=False) == [0, 1]
    assert [(e.kind, e.done, e.total) for e in shown] == [("progress", 35, 40), ("progress", 40, 40)]


def test_a_worker_that_captures_on_first_use_wants_the_kernels_of_every_shape_it_may_claim(tmp_path, tiny_cpu):
    """A multi-GPU worker captures nothing ahead (it captures the shapes it claims, on first use), yet its engine is
    told of every shape: their compiled kernels are wanted (loaded before each graph's first capture, built where the
    cache lacks them), not only the hires passes'. Before, such a worker ran plain graphs under `--compile auto`."""
    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, RenderSession

    class Told(EagerEngine):
        def prepare(self, shapes, kinds=None, later=(), beside=False):
            self.told = (list(shapes), list(later), beside)

    class FirstUse(RenderSession):
        def capture_ahead(self, shapes):
            return []

    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\nbuckets: [2]\ndefaults: {steps: 2}\nshots:\n"
                                       "  - {id: a, prompt: x, seed: 3, size: 64x64, candidates: 2}\n"
                                       "  - {id: b, prompt: y, seed: 4, size: 64x96, candidates: 2}\n"))
    engine = Told(tiny_cpu)
    session = FirstUse(job, RenderOptions(out_dir=tmp_path / "out"), models=tiny_cpu, engine=engine)
    session.prepare()
    shapes, later, beside = engine.told
    assert shapes == [] and beside
    assert sorted(later) == sorted([Shape(2, 64, 64, False), Shape(2, 96, 64, False)]), later


def test_a_worker_other_than_rank_0_makes_its_images_thumbnails_and_no_page(tmp_path):
    """Rank 0 alone writes index.html; each worker makes the thumbnails of the images it writes, as they land, so
    rank 0's updates of the sheet find them made."""
    from storyboard_cli.folder.sheet import make_thumb
    from storyboard_cli.job.file import load_job

    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, seed: 1}\n"))
    out = tmp_path / "out"
    pixels = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    png = out / "a" / "a_c0_s1.png"
    png.parent.mkdir(parents=True)
    Image.fromarray(pixels).save(png)
    sheet = dist._NoSheet(out, job, [])
    sheet.thumb("a", "a/a_c0_s1.png", pixels)
    sheet.update([], running=True)
    thumb = out / "a" / "thumbs" / "a_c0_s1.jpg"
    assert thumb.is_file() and not (out / "index.html").exists()
    assert make_thumb(png, tmp_path / "same.jpg", 0) == (96, 64)
    assert thumb.read_bytes() == (tmp_path / "same.jpg").read_bytes()
