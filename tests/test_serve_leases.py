"""A lease belongs to the worker it was issued to: another worker (or a client that read the lease id from a job's
events) can neither renew, complete nor give it back. A completion whose report the server cannot read is refused
naming the field, and a stored lease report it cannot read never stops the job's report from being written. A
worker's failed image says its reason as one plain line. Real `bcg serve` (and `bcg worker`) processes."""

import json
from pathlib import Path

import httpx

from storyboard_cli.folder.report import Report, Timings
from storyboard_cli.serve.edge import PROBLEM

from helpers.serve import YAML, eventually, register, start_worker, stop

JOB = """version: 1
model: tiny
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 2}
"""


def problem(r, status):
    assert r.status_code == status and r.headers["content-type"] == PROBLEM, r.text
    detail = r.json()["detail"]
    assert "\n" not in detail and "Traceback" not in detail and "object at 0x" not in detail, detail
    return detail


def leased(url, worker):
    job = httpx.post(url + "/v1/jobs", content=JOB, headers=YAML, timeout=10).json()
    lease = eventually(lambda: httpx.post(url + "/v1/leases", json={"worker": worker}, timeout=10),
                       lambda r: r.status_code == 200, 30).json()
    return job, lease


def states(url, job_id):
    return {i["state"] for i in httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()["images"]}


def lease_report(out_dir):
    """A worker's report of its part of a lease, as report.json's keys (folder/report.py) have it."""
    return Report.build(job="job.yaml", out_dir=Path(out_dir), device="cpu", dtype="fp32", engine="eager",
                        model="tiny", timings=Timings(), wall_s=0.5, rendered=0, skipped=0, failed=[],
                        peak_mem_mb=None, graphs=[], status="failed", notes=[]).to_json()


def test_only_its_holder_renews_completes_or_gives_back_a_lease(server):
    url = server.start(gpus="none").url
    holder, other = register(url, "holder"), register(url, "other")
    job, lease = leased(url, holder)
    base = f"{url}/v1/leases/{lease['lease']}"
    ids = [i["id"] for i in lease["images"]]
    failed = {str(i): "broken" for i in ids}
    for path, body in (("heartbeat", {"worker": other}), ("complete", {"worker": other, "failed": failed}),
                       ("fail", {"worker": other, "reason": "not mine"})):
        detail = problem(httpx.post(f"{base}/{path}", json=body, timeout=10), 403)
        assert f"not issued to worker {other}" in detail, detail
    assert states(url, job["id"]) == {"leased"}  # nothing changed
    # an older worker's calls, which name no worker: refused as malformed, never a 500
    assert "worker" in problem(httpx.post(f"{base}/complete", json={"failed": failed}, timeout=10), 422)
    assert "worker" in problem(httpx.post(f"{base}/heartbeat", json={}, timeout=10), 422)
    assert httpx.post(f"{base}/heartbeat", json={"worker": holder}, timeout=10).status_code == 200
    schema = httpx.get(url + "/openapi.json", timeout=10).json()
    models = schema["components"]["schemas"]
    assert "worker" in models["Completion"]["required"] and "worker" in models["LeaseFailure"]["required"]
    assert "403" in schema["paths"]["/v1/leases/{lease_id}/complete"]["post"]["responses"]
    assert "403" in schema["paths"]["/v1/leases/{lease_id}/fail"]["post"]["responses"]
    assert httpx.post(f"{base}/complete", json={"worker": holder, "failed": failed}, timeout=10).status_code == 200
    assert states(url, job["id"]) == {"failed"}


def test_a_report_the_server_cannot_read_is_refused_and_a_stored_one_never_stops_the_jobs_report(server, tmp_path):
    with open(tmp_path / "serve.log", "w") as err:
        url = server.start(gpus="none", stderr=err).url
    worker = register(url, "w")
    job, lease = leased(url, worker)
    base = f"{url}/v1/leases/{lease['lease']}"
    failed = {str(i["id"]): "broken" for i in lease["images"]}
    good = lease_report(lease["jobs"][job["id"]]["out_dir"])
    for report, field in (({}, ".job: Field required"), ({**good, "wall_s": "slow"}, "wall_s"),
                          ({**good, "buckets": [{"bucket": "64x64"}]}, "images"), ({**good, "run": []}, "run")):
        r = httpx.post(f"{base}/complete", json={"worker": worker, "failed": failed, "reports": {job["id"]: report}},
                       timeout=10)
        detail = problem(r, 422)
        assert detail.startswith("body.reports.") and field in detail, detail
    assert states(url, job["id"]) == {"leased"}
    # reports kept by another bcg version, or damaged: skipped, each with a log line
    leases = server.root / "jobs" / job["id"] / "leases"
    leases.mkdir(parents=True, exist_ok=True)
    (leases / "older.json").write_text(json.dumps({"worker": "w-older", "report": {}}))
    (leases / "typed.json").write_text(json.dumps({"worker": "w-typed", "report": {**good, "stages_s": "x"}}))
    (leases / "torn.json").write_text('{"worker": "w-torn", "rep')
    r = httpx.post(f"{base}/complete", json={"worker": worker, "failed": failed, "reports": {job["id"]: good}},
                   timeout=10)
    assert r.status_code == 200, r.text
    out = server.root / "jobs" / job["id"] / "out"
    report = eventually(lambda: json.loads((out / "report.json").read_text()) if (out / "report.json").exists()
                        else {}, lambda r: r.get("status") == "failed", 30)
    assert [w["host"] for w in report["workers"]] == [worker] and report["images_failed"] == 2
    eventually(lambda: (out / "index.html").exists(), bool, 10)  # the sheet, written after the report
    skipped = eventually(lambda: [line for line in (tmp_path / "serve.log").read_text().splitlines()
                                  if "is skipped" in line], lambda lines: len(lines) >= 3, 10)
    assert {line.split("the report of lease ")[1].split(" ")[0] for line in skipped} == {"older", "typed", "torn"}
    assert any("stages_s" in line for line in skipped), skipped


def test_a_failed_image_says_its_reason_in_one_plain_line(server):
    """A job that no longer loads on the worker (its file on the server changed after it was accepted): each image
    fails with the job's own message, not prefixed by a Python class name."""
    url = server.start(gpus="none").url
    job = httpx.post(url + "/v1/jobs", content=JOB, headers=YAML, timeout=10).json()
    (server.root / "jobs" / job["id"] / "job.yaml").write_text(JOB.replace("steps: 2", "steps: many"))
    worker = start_worker(url, "w")
    try:
        done = server.wait(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
    finally:
        stop(worker)
    reasons = {i["reason"] for i in done["images"]}
    assert done["state"] == "failed" and len(reasons) == 1, done
    reason = reasons.pop()
    assert "steps" in reason and "\n" not in reason and not reason.startswith(("JobError", "BadInput")), reason
