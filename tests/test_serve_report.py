"""A served job's report is merged by the one merger (`Report.merge`), as a multi-GPU render's workers' are: a row per
worker (its leases summed), the job's rate the sum of its workers'; and a worker's `Report` crosses the wire in the
completion it builds as the very model the server reads, back to the same `Report`. Pure: no server process."""

import json
from pathlib import Path

from storyboard_cli.folder.report import Report, Timings
from storyboard_cli.serve import folders, wire
from storyboard_cli.serve.lease_session import Outcome


def lease_report(rendered: int, denoise: float, wall: float, hidden: float | None = None) -> Report:
    """A worker's report of one lease: one bucket of 20 steps, `denoise` seconds of it."""
    t = Timings(stages={"load": 1.0, "capture": 0.5, "encode": 0.25, "denoise": denoise, "decode": 0.5, "save": 0.125})
    b = t.bucket("64x64 20 steps euler")
    b.images, b.batches, b.rows, b.steps, b.denoise_s = rendered, 1, 2 * rendered, 20, denoise
    if hidden is not None:
        t.expose("decode", 0.5 - hidden)
    return Report.build(job="job.yaml", out_dir=Path("out"), device="cpu", dtype="float32", engine="eager",
                        model="tiny", timings=t, wall_s=wall, rendered=rendered, skipped=0, failed=[],
                        peak_mem_mb=None, graphs=[{"shape": f"{rendered}x64x64", "state": "eager"}], status="done",
                        notes=["n"], run={"id": "r", "started": "s", "finished": "f"})


def test_the_completion_a_worker_builds_carries_its_report_as_the_server_reads_it():
    report = lease_report(2, 1.5, 3.0, hidden=0.25)
    outcome = Outcome(done=[1, 2], failed={3: "boom"}, batches=[wire.Batch(shape="64x64", images=2, bucket=2,
                                                                            seconds=1.5)],
                      records={"j": [{"path": "a/0.png", "sha256": "ab"}]}, reports={"j": report})
    sent = outcome.completion("w1").model_dump_json(exclude_unset=True)
    got = wire.Completion.model_validate_json(sent)  # as the route reads the body
    assert wire.report_of(got.reports["j"]) == report
    assert got.worker == "w1" and got.done == [1, 2] and got.failed == {"3": "boom"} and got.batches[0].seconds == 1.5
    assert got.manifest["j"][0].model_dump() == {"path": "a/0.png", "sha256": "ab"}
    assert json.loads(sent)["reports"]["j"] == report.to_json()  # on the wire: report.json's keys, no more


def test_a_served_jobs_report_is_merged_as_a_multi_gpu_renders_one_row_per_worker(tmp_path):
    job_file, out = tmp_path / "job.yaml", tmp_path / "out"
    job_file.write_text("")
    leases = [("w1", lease_report(2, 1.0, 2.0, hidden=0.25)), ("w2", lease_report(1, 2.0, 3.0, hidden=0.0)),
              ("w1", lease_report(3, 3.0, 4.0, hidden=0.125))]
    for n, (worker, report) in enumerate(leases):
        folders.keep_reports({"j": (job_file, out, set())}, f"lease{n}", worker, {"j": wire.lease_report(report)})
    image = {"shot": "a", "reason": None, "cached": False}
    job = {"id": "j", "out_dir": str(out), "state": "failed", "submitted": 100.0, "finished": 110.0, "images": [
        {**image, "state": "done", "outputs": ["a/0.png", "a/1.png"]}, {**image, "state": "done", "outputs": ["a/2.png"],
                                                                       "cached": True},
        {**image, "state": "failed", "outputs": ["a/3.png"], "reason": "boom"}]}
    merged = folders.merged_report(job, job_file, now=500.0)
    assert [(w["rank"], w["host"], w["images"], w["busy_s"], w["idle_s"]) for w in merged.workers] == [
        (0, "w1", 5, 6.0, 0.0), (1, "w2", 1, 3.0, 0.0)]  # w1's two leases, one row
    assert merged.steps_per_s == round(40 / 4.0 + 20 / 2.0, 3)  # each worker's rate over its leases, side by side
    assert merged.buckets[0]["images"] == 6 and merged.stages_s["denoise"] == 6.0 and merged.stages_s["load"] == 3.0
    assert merged.hidden_s == {"decode": 0.375}  # what the denoising hid, summed as the stages are
    assert len(merged.graphs) == 3 and merged.notes == ["n"]
    # what the queue knows: the job's images, state and wall time from submission to its end
    assert (merged.images_rendered, merged.images_cached, merged.images_failed) == (2, 1, 1)
    assert merged.status == "failed" and merged.wall_s == 10.0 and merged.images_per_s == 0.2
    assert merged.failures == [{"path": "a/3.png", "shot": "a", "reason": "boom"}]
    data = merged.to_json()
    assert "render_s" not in data and data["workers"] == merged.workers and data["job"] == str(job_file)
    assert folders.merged_report({**job, "id": "none"}, tmp_path / "none" / "job.yaml", 500.0).workers == []
