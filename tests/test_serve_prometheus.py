"""/metrics scraped by a real Prometheus server (Debian's `prometheus` package: `apt-get install prometheus`),
started on 127.0.0.1 with a scrape every second against a real `bcg serve`: its query API returns the queue
depth of a submitted job."""

import shutil
import subprocess

import httpx
import pytest

from helpers.serve import JOB_3_IMAGES as JOB, Server, eventually, free_port, stop


PROMETHEUS = shutil.which("prometheus")
CONFIG = """global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: bcg
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""
DEADLINE_S = 30


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus)")
def test_prometheus_scrapes_the_queue_depth(tmp_path):
    server = Server(tmp_path / "root", free_port())
    server.start(gpus="none")  # no worker: the job stays queued
    (tmp_path / "prometheus.yml").write_text(CONFIG.format(port=server.port))
    api, log = f"http://127.0.0.1:{free_port()}", tmp_path / "prometheus.log"
    with log.open("wb") as out:
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={api[7:]}",
                                       "--log.level=warn"], start_new_session=True, stdout=out, stderr=out)
    try:
        r = httpx.post(server.url + "/v1/jobs", content=JOB, headers={"Content-Type": "application/yaml"},
                       params={"priority": "urgent"}, timeout=10)
        assert r.status_code == 202

        def query():
            if prometheus.poll() is not None:
                pytest.fail(f"prometheus exited with {prometheus.returncode}: {log.read_text()}")
            try:
                got = httpx.get(api + "/api/v1/query", params={"query": 'bcg_queue_images{priority="urgent"}'},
                                timeout=5)
            except httpx.HTTPError:  # not listening yet
                return []
            if got.status_code == 503:  # listening, its storage not open yet: Prometheus answers 503 until ready
                return []
            assert got.status_code == 200, got.text
            return got.json()["data"]["result"]

        result = eventually(query, lambda rows: rows and rows[0]["value"][1] == "3", DEADLINE_S)
        assert result[0]["metric"]["job"] == "bcg" and result[0]["metric"]["instance"] == f"127.0.0.1:{server.port}"
        up = httpx.get(api + "/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
        assert [row["value"][1] for row in up] == ["1"]  # the whole exposition parsed: the scrape succeeded
    finally:
        stop(prometheus)
        server.kill_everything()
