"""Odd requests against one real `bcg serve --gpus none`: a client that goes away mid-body (one log line, no
traceback, nothing kept), a job naming `~user` paths (the same answer whether the user exists or not), file paths
holding a newline or a control character (the route's own answer, not "no route")."""

import os
import pwd
import socket
import time
from urllib.parse import quote

import httpx
import pytest

from helpers.serve import ONE_IMAGE_JOB, YAML, Server, eventually, free_port, register

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("requests")
    with open(folder / "server.log", "wb") as log:
        s = Server(folder / "root", free_port()).start(lease_s=30, gpus="none", stderr=log)
    s.log = folder / "server.log"
    yield s
    s.kill_everything()


def _cut_short(port, head):
    """Sends the request line and headers of a 100 KB body, 1 KB of it, and goes away."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(f"{head} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n".encode() + b"\r\n" + b"x" * 1000)
        time.sleep(0.3)


@pytest.mark.slow
def test_a_client_gone_mid_body_is_one_log_line_and_leaves_nothing(server):
    _cut_short(server.port, f"PUT /v1/blobs/{'a' * 64}")
    _cut_short(server.port, "POST /v1/jobs")
    lines = eventually(lambda: server.log.read_text().splitlines(),
                       lambda lines: sum("disconnected" in line for line in lines) == 2, timeout_s=10)
    assert not [line for line in lines if "Traceback" in line or "ClientDisconnect" in line], lines
    assert not list((server.root / "blobs" / "tmp").glob("*"))
    assert not (server.root / "jobs").exists() or not list((server.root / "jobs").iterdir())


@pytest.mark.slow
def test_home_paths_are_refused_in_the_same_words_whether_the_user_exists_or_not(server):
    me = pwd.getpwuid(os.getuid()).pw_name
    answers = {}
    for user in (me, "no-such-user-bcg"):
        for field, text in (("output_dir", f"output_dir: ~{user}/out"), ("control.image", f"image: ~{user}/pose.png"),
                            ("model", f"model: ~{user}/sdxl.safetensors")):
            body = ONE_IMAGE_JOB.replace("model: tiny\n", "model: tiny\ncontrolnet: tiny\n")
            body = {"output_dir": body.replace("version: 1\n", f"version: 1\n{text}\n"),
                    "control.image": body.replace("seed: 1}", f"seed: 1, control: {{{text}}}}}"),
                    "model": body.replace("model: tiny\n", f"{text}\n")}[field]
            r = httpx.post(server.url + "/v1/jobs", content=body, headers={**YAML, "X-Job-Filename": "ep.yaml"},
                           timeout=10)
            assert r.status_code == 422, r.text
            answers[user, field] = r.json()["detail"].replace(user, "USER")
    for field in ("output_dir", "control.image", "model"):
        assert answers[me, field] == answers["no-such-user-bcg", field], field
        assert answers[me, field].endswith("~USER" + answers[me, field].split("~USER", 1)[1])
        assert "is outside the folders this server may read and write" in answers[me, field]
        assert os.path.expanduser("~") not in answers[me, field]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["a\nb.png", "x/\n/y.png", "a\x01b.png"])
def test_a_file_path_with_a_newline_or_a_control_character_reaches_its_route(server, name):
    job = httpx.post(server.url + "/v1/jobs", content=ONE_IMAGE_JOB.replace("seed: 1", f"seed: {sum(map(ord, name))}"),
                     headers=YAML, timeout=10).json()
    name = quote(name, safe="/")
    got = httpx.get(f"{server.url}/v1/jobs/{job['id']}/files/{name}", timeout=10)
    assert got.status_code == 404 and got.json()["title"] == "no such file", got.text
    worker = register(server.url, "w")
    lease = httpx.post(server.url + "/v1/leases", json={"worker": worker}, timeout=10).json()
    put = httpx.put(f"{server.url}/v1/leases/{lease['lease']}/files/{lease['job']}/{name}", content=b"png",
                    params={"worker": worker}, headers=OCTETS, timeout=10)
    assert put.status_code == 422 and put.json()["title"] == "not this lease's file", put.text
    assert "\n" not in put.json()["detail"] and "\n" not in got.json()["detail"]
