"""Schemathesis, the OpenAPI fuzzer, against a real `bcg serve --gpus none` process on 127.0.0.1: every check
(`--checks all`) over a fixed set of cases (deterministic generation, a fixed number of examples per operation and
of stateful scenarios: the same cases on every run and machine, so a finding is never a matter of luck or speed).
It must find nothing (no answer of 500 or more, no status, content type or body the schema does not describe, no
schema-invalid request accepted), and /healthz must still answer within a second afterwards.

The server runs with limits the fuzzer cannot reach, so that every 503 it could see is one the schema documents and
test_serve_api.py exercises (a full queue, --max-workers registrations, /readyz before a worker is ready), not one
that the run's own submissions and registrations cause; and with a token, so the `ignored_auth` check sees each
route refuse a request without it. One worker is registered and ready before the run: /readyz answers 200.
Half the job, lease and worker ids the fuzzer sends are real ones (a canceled job, a live lease, the registered
worker), so it reaches past the 404s: the job's view and its event stream, a PATCH, cancel, retry or move to front of
a final job (409), a heartbeat or completion of a lease that exists, a drain and resume of a worker. The global event
stream is asked with `follow=false` (the events until now, then its end): a stream that follows never ends, and the
fuzzer reads each answer whole.

Every check runs. `positive_data_acceptance` (a schema-valid request must not be refused) is told two answers of
this API that a JSON schema cannot rule out:
- 410, on the lease routes: a lease id is issued by the server and expires, so a well-formed one may be gone;
  410 Gone is the protocol's answer for it (the worker then drops the batch), as 404 is for an unknown job.
- 422, on POST /v1/jobs and PUT /v1/blobs/{sha256}: a job is refused as `bcg plan` refuses it when it names a file
  or model the server does not have, a LoRA the job does not list, two shots with one id; a blob when its bytes
  do not hash to its name. Which files exist and which bytes hash to what is no schema's to say.
- 422, on PUT /v1/leases/{lease_id}/files/{job_id}/{path}: a live lease takes only its own jobs' outputs, and which
  jobs and paths a lease holds is the queue's to say, not the schema's.
"""

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from helpers.serve import Server, free_port


TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STATEFUL = 5  # scenarios of linked calls (a job submitted, then read, patched, cancelled)
EXAMPLES = 10  # per operation, with a fixed seed and deterministic generation: the same cases on every run
BUDGET_S = 150  # the run's cap, far above its ~40 s on two loaded cores (--max-time would repeat the phases)
SEED = 20261201
SLOW_S = 15  # an answer slower than this is a finding: a hang, not a loaded machine (a job's plan took 6.3 s on CI's
# two cores while the other test worker rendered; the latency bounds are test_serve_abuse.py's and test_serve_slo.py's)
DEFAULT_ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]  # schemathesis's own list
JOB = "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: a castle, steps: 2, size: 64x64}\n"
CONFIG = """
[phases.stateful.generation]
max-examples = {stateful}

[checks.positive_data_acceptance]
expected-statuses = {accepted}

[[operations]]
include-name = ["POST /v1/jobs", "PUT /v1/blobs/{{sha256}}"]
checks.positive_data_acceptance.expected-statuses = {accepted_422}

[[operations]]
include-name = ["PUT /v1/leases/{{lease_id}}/files/{{job_id}}/{{path}}"]
checks.positive_data_acceptance.expected-statuses = {accepted_lease_file}

[[operations]]
include-name = ["GET /v1/events"]
parameters = {{ "query.follow" = false }}

[dictionaries.jobs]
values = ["{job}"]
[dictionaries.leases]
values = ["{lease}"]
[dictionaries.workers]
values = ["{worker}"]
[parameters]
"path.job_id" = {{ dictionary = "jobs", probability = 0.5 }}
"path.lease_id" = {{ dictionary = "leases", probability = 0.5 }}
"path.worker_id" = {{ dictionary = "workers", probability = 0.5 }}
"""


@pytest.mark.slow
def test_schemathesis_finds_nothing_and_the_server_stays_healthy(tmp_path):
    server = Server(tmp_path / "root", free_port()).start(
        lease_s=3600, gpus="none", extra=("--token", TOKEN, "--max-queue-images", "100000000",
                                          "--max-workers", "100000000"))
    try:
        def call(method, path, **kwargs):
            r = httpx.request(method, server.url + path, headers={**AUTH, **kwargs.pop("headers", {})}, timeout=10,
                              **kwargs)
            assert r.status_code in (200, 201, 202), r.text
            return r.json()

        worker = call("POST", "/v1/workers", json={"name": "ready"})["worker"]
        canceled = call("POST", "/v1/jobs", content=JOB, headers={"Content-Type": "application/yaml"})["id"]
        call("POST", f"/v1/jobs/{canceled}/cancel")
        call("POST", "/v1/jobs", content=JOB, headers={"Content-Type": "application/yaml"})
        lease = call("POST", "/v1/leases", json={"worker": worker, "ready": True})["lease"]
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
        # the case a timed run once reached by chance: a method a fixed path lacks, where a parameterised route of
        # the same shape (PUT /v1/blobs/{sha256}) would take it
        r = httpx.put(server.url + "/v1/blobs/missing", json={"digests": []}, headers=AUTH, timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
        config = CONFIG.format(accepted=json.dumps(DEFAULT_ACCEPTED + ["410"]),
                               accepted_422=json.dumps(DEFAULT_ACCEPTED + ["422"]),
                               accepted_lease_file=json.dumps(DEFAULT_ACCEPTED + ["410", "422"]), job=canceled,
                               lease=lease, worker=worker, stateful=STATEFUL)
        (tmp_path / "schemathesis.toml").write_text(config)
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(tmp_path / "schemathesis.toml"), "run",
             f"{server.url}/openapi.json", "--checks", "all", "--seed", str(SEED), "--max-examples", str(EXAMPLES),
             "--generation-deterministic",
             "--workers", "1", "--request-timeout", str(2 * SLOW_S), "--max-response-time", str(SLOW_S),
             "-H", f"Authorization: Bearer {TOKEN}", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=BUDGET_S + 120)
        out = run.stdout + run.stderr
        cases = re.search(r"(\d+) generated", out)
        print(out.split("SUMMARY")[-1])
        found = "\n".join(line[:300] for line in out.split("FAILURES")[-1].split("WARNINGS")[0].splitlines()
                          if line.strip() and "st replay" not in line)
        assert run.returncode == 0 and "failure" not in out.split("SUMMARY")[-1], found[-8000:]
        assert cases and int(cases[1]) > 500, out[-3000:]
        t0 = time.monotonic()
        assert httpx.get(server.url + "/healthz", timeout=1).status_code == 200
        assert time.monotonic() - t0 < 1
    finally:
        server.kill_everything()
