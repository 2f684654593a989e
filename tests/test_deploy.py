"""deploy/: the scaling examples parse, name only options `bcg serve` and `bcg worker` have and series /metrics
exposes, and run where their tools exist: promtool checks and unit-tests the SLO rules (Debian's `prometheus`
package), the Slurm script starts a real worker (srun stood in by exec) that renders a job, and docker compose
brings up the server and CPU workers where a Docker daemon with compose answers (skipped otherwise)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from functools import cache
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.serve import metrics
from storyboard_cli.serve.store import Store

from conftest import ROOT
from helpers.serve import JOB_3_IMAGES as JOB, Server, eventually, free_port, metric, stop

DEPLOY = ROOT / "deploy"
COMPOSE, RULES = DEPLOY / "docker-compose.yml", DEPLOY / "prometheus-rules.yml"
RULE_TESTS = DEPLOY / "prometheus-rules.test.yml"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))  # what `kubectl apply -f deploy/kubernetes/` applies
KEDA, ADAPTER_VALUES = DEPLOY / "keda" / "worker-scaler.yaml", DEPLOY / "helm" / "prometheus-adapter-values.yaml"
SLURM = DEPLOY / "slurm-workers.sh"
PROMTOOL = shutil.which("promtool")
DEADLINE_S = 120
JOB_DEADLINE_S = 300


@cache
def cli_help(command: str) -> tuple[frozenset[str], frozenset[str]]:
    """(the options, the environment variables) `bcg <command> --help` lists: the rows of its options table."""
    out = subprocess.run([sys.executable, "-m", "storyboard_cli", command, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1"})
    assert out.returncode == 0, out.stderr
    options = frozenset(re.findall(r"^\S\s+(?:\*\s+)?(--[a-z0-9][a-z0-9-]*)", out.stdout, re.M))
    assert {"--token", "--help"} <= options, out.stdout  # the table was read
    return options, frozenset(re.findall(r"\bBCG_[A-Z_]+", out.stdout))


def check_call(argv: list[str], where: str) -> None:
    """`bcg <command> --option ...` as a file writes it: a command bcg has, and only options it has."""
    assert argv[0] == "bcg" and argv[1] in ("serve", "worker"), f"{where}: {argv}"
    used = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
    assert used, f"{where}: {argv}"
    unknown = used - cli_help(argv[1])[0]
    assert not unknown, f"{where}: `bcg {argv[1]}` has no option {sorted(unknown)}"


def bcg_calls(node, where: str):
    """Every `bcg` command line in a parsed YAML document: (argv, the container or service holding it)."""
    if isinstance(node, dict):
        command = node.get("command")
        if isinstance(command, list) and command[:1] == ["bcg"]:
            yield [str(a) for a in command], node
        for key, value in node.items():
            yield from bcg_calls(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from bcg_calls(value, f"{where}[{i}]")


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@cache
def exposed() -> frozenset[str]:
    """Every sample name /metrics can expose, read from the exposition of a real store (the series of a
    family without samples yet, from its type)."""
    with tempfile.TemporaryDirectory() as root:
        store = Store(Path(root))
        try:
            text = metrics.exposition(metrics.registry(store, worker_window_s=60, clock=lambda: 0.0)).decode()
        finally:
            store.close()
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    return frozenset(f.name + s for f in text_string_to_metric_families(text) for s in suffixes[f.type])


def test_every_file_parses():
    assert yaml.safe_load(COMPOSE.read_text())["services"]
    assert yaml.safe_load(RULES.read_text())["groups"]
    assert yaml.safe_load(RULE_TESTS.read_text())["tests"]
    assert yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["rule_files"] == [RULES.name]
    assert {p.name for p in KUBERNETES} == {"server.yaml", "worker.yaml", "hpa.yaml"}
    for path in KUBERNETES + [KEDA]:
        assert all(doc for doc in yaml.safe_load_all(path.read_text())), path
    assert yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    assert subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, timeout=30).returncode == 0


def test_the_compose_file_runs_one_server_and_workers_on_its_volume_with_real_options():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    server = services["server"]
    argv = server["command"]
    check_call(argv, "server")
    root, port = option(argv, "--root"), option(argv, "--port")
    assert option(argv, "--gpus") == "none" and option(argv, "--host") == "0.0.0.0"
    serve_env = cli_help("serve")[1]
    assert {"BCG_TOKEN", "BCG_WORKER_TOKEN"} <= set(server["environment"]) <= serve_env  # off loopback: a token
    assert server["ports"] == [f"127.0.0.1:${{BCG_PORT:-{port}}}:{port}"]
    workers = {name: s for name, s in services.items() if s.get("command", [])[:2] == ["bcg", "worker"]}
    assert set(workers) == {"worker-gpu0", "worker-gpu1", "worker-cpu"}
    for name, worker in workers.items():
        check_call(worker["command"], name)
        assert option(worker["command"], "--server") == f"http://server:{port}", name
        assert set(worker["environment"]) == {"BCG_WORKER_TOKEN"} <= cli_help("worker")[1]
        assert worker["environment"]["BCG_WORKER_TOKEN"] == server["environment"]["BCG_WORKER_TOKEN"]
        assert f"bcg-root:{root}" in worker["volumes"], name  # the job folders at the server's paths
        assert worker["stop_signal"] == "SIGINT" and worker["depends_on"]["server"]["condition"] == "service_healthy"
    assert f"bcg-root:{root}" in server["volumes"]
    gpus = [w["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for w in workers.values()
            if "deploy" in w]
    assert gpus == [["0"], ["1"]]  # one GPU each, not the first one twice
    assert option(workers["worker-cpu"]["command"], "--device") == "cpu"
    allowed_folders_are_mounted(argv, "docker-compose.yml", *({v.rsplit(":", 2)[1] for v in s["volumes"]}
                                                              for s in [server, *workers.values()]))


def allowed_folders_are_mounted(serve: list[str], where: str, *mounts: set[str]) -> None:
    """A server accepts a real model: a hub id on --allow-model and a folder on --allow-dir, which the server and
    every worker (`mounts`: each one's mount paths) see at the same path."""
    models, folders = option(serve, "--allow-model"), [a for o, a in zip(serve, serve[1:]) if o == "--allow-dir"]
    assert models and re.fullmatch(r"[\w.-]+/[\w.-]+", models), f"{where}: no --allow-model hub id"
    assert folders, f"{where}: no --allow-dir"
    for mounted in mounts:
        assert set(folders) <= mounted, (where, folders, mounted)


def test_kubectl_apply_of_the_folder_applies_manifests_only_and_one_autoscaler_per_deployment():
    docs = [d for p in KUBERNETES for d in yaml.safe_load_all(p.read_text())]
    assert all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)  # kubectl refuses anything else
    targets = [d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    targets += [d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "ScaledObject"]
    assert targets == ["bcg-worker"]  # KEDA's ScaledObject makes an HPA of its own: never both applied
    assert yaml.safe_load(KEDA.read_text())["kind"] == "ScaledObject" and KEDA.parent != KUBERNETES[0].parent


def test_the_kubernetes_manifests_pass_the_api_schemas():
    """Every applied manifest against the Kubernetes API's own schemas, strictly (no unknown field), offline
    (the kubernetes-validate package); the KEDA ScaledObject is a CRD the package has no schema for."""
    kv = pytest.importorskip("kubernetes_validate")
    for path in KUBERNETES:
        for doc in yaml.safe_load_all(path.read_text()):
            try:
                kv.validate(doc, kv.latest_version(), strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at "
                            f"{'.'.join(map(str, e.path))}")


def test_kubernetes_scales_the_worker_deployment_on_the_queue_depth():
    docs = {(d["kind"], d["metadata"]["name"]): d for p in KUBERNETES + [KEDA]
            for d in yaml.safe_load_all(p.read_text()) if "kind" in d}
    deployment = docs["Deployment", "bcg-worker"]
    service = docs["Service", "bcg-server"]
    server = docs["StatefulSet", "bcg-server"]["spec"]["template"]["spec"]
    assert docs["StatefulSet", "bcg-server"]["spec"]["replicas"] == 1  # the queue's one writer
    (serve,) = [argv for argv, _ in bcg_calls(server, "server")]
    (work,) = [argv for argv, _ in bcg_calls(deployment, "worker")]
    check_call(serve, "server.yaml")
    check_call(work, "worker.yaml")
    assert option(work, "--server") == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert option(serve, "--port") == str(service["spec"]["ports"][0]["port"])
    claims = {v["persistentVolumeClaim"]["claimName"] for spec in (server, deployment["spec"]["template"]["spec"])
              for v in spec["volumes"]}
    assert claims == {name for kind, name in docs if kind == "PersistentVolumeClaim"} == {"bcg-shared", "bcg-models"}
    scaled = docs["ScaledObject", "bcg-worker"]["spec"]
    hpa = docs["HorizontalPodAutoscaler", "bcg-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == hpa["scaleTargetRef"]["name"] == "bcg-worker"
    assert scaled["minReplicaCount"] == 0 and hpa["minReplicas"] == 1
    (trigger,) = scaled["triggers"]
    assert trigger["metadata"]["query"] == "sum(bcg_queue_images)" and "bcg_queue_images" in exposed()
    (external,) = hpa["metrics"]
    assert external["external"]["metric"]["name"] == "bcg_queue_images"
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert [r["name"]["as"] for r in adapter["rules"]["external"]] == ["bcg_queue_images"]
    mounts = [{m["mountPath"] for c in spec["containers"] for m in c["volumeMounts"]}
              for spec in (server, deployment["spec"]["template"]["spec"])]
    allowed_folders_are_mounted(serve, "server.yaml", *mounts)


def test_the_slo_rules_name_only_series_that_metrics_exposes():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    named = set()
    for r in rules:
        expr = r["expr"]
        for name in recorded:
            expr = expr.replace(name, "")
        named |= set(re.findall(r"(?<![\w:])bcg_[a-z0-9_]+(?![\w:])", expr))
    assert named and not named - exposed(), sorted(named - exposed())
    assert {"bcg_queue_wait_seconds_bucket", "bcg_queue_oldest_age_seconds", "bcg_time_to_first_image_seconds_bucket",
            "bcg_batch_fill_ratio_bucket", "bcg_worker_startup_seconds_bucket",
            "bcg_worker_gpu_energy_joules_total"} <= named
    alerts = {r["alert"]: r["expr"] for r in rules if "alert" in r}
    assert all(f'priority="{p}"' in alerts["BcgQueueWaitHigh"] for p in ("urgent", "normal", "bulk"))
    assert "0.95" in next(r["expr"] for r in rules if r.get("record") == "priority:bcg_queue_wait_seconds:p95_10m")


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (Debian: apt-get install prometheus)")
def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    for argv in (["check", "rules", str(RULES)], ["check", "config", str(DEPLOY / "prometheus.yml")],
                 ["test", "rules", str(RULE_TESTS)]):
        out = subprocess.run([PROMTOOL, *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SUCCESS" in out.stdout + out.stderr


def slurm_calls() -> list[list[str]]:
    script = SLURM.read_text().replace("\\\n", " ")
    return [line.split("#")[0].split("||")[0].split()[1:] for line in map(str.strip, script.splitlines())
            if line.startswith("srun bcg ")]


def test_the_slurm_script_asks_one_gpu_per_task_and_stops_softly():
    text = SLURM.read_text()
    assert re.search(r"^#SBATCH --array=\d+-\d+$", text, re.M) and "#SBATCH --gres=gpu:1" in text
    assert "#SBATCH --signal=INT@" in text  # the worker's soft stop before the time limit
    (argv,) = slurm_calls()
    check_call([a.strip('"') for a in argv], "slurm-workers.sh")


@pytest.mark.parametrize("statuses, ends", [((75, 75, 0), 0), ((75, 3), 3), ((2,), 2)])
def test_the_slurm_script_starts_a_stalled_worker_again_and_ends_with_any_other_status(tmp_path, statuses, ends):
    """A worker that exits 75 (its render stalled: --stall-s) is started again in the same task; any other status
    (0 stopped, 2 cannot render here, 3 ...) ends the task with it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "statuses").write_text("\n".join(map(str, statuses)) + "\n")
    srun = bin_dir / "srun"  # each call: the next status of the list, and its arguments logged
    srun.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\nn=$(head -1 {tmp_path}/statuses)\n'
                    f'sed -i 1d {tmp_path}/statuses\nexit "$n"\n')
    srun.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "BCG_WORKER_TOKEN": "t"}
    task = subprocess.run(["bash", str(SLURM), "--upload"], env=env, capture_output=True, text=True, timeout=60)
    assert task.returncode == ends, task.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == len(statuses) and all(c.startswith("bcg worker --server") and c.endswith("--upload")
                                               for c in calls), calls
    assert task.stderr.count("stalled (exit 75): starting it again") == statuses.count(75), task.stderr


@pytest.mark.slow
def test_the_slurm_script_starts_a_worker_that_renders_a_job(tmp_path):
    """The array task as Slurm runs it, srun replaced by exec: the worker registers under the task's name,
    renders the job, and on SIGINT stops and exits 0; arguments after the script's reach `bcg worker`."""
    server = Server(tmp_path / "root", free_port()).start(gpus="none", extra=("--worker-token", "task-token"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\n[ "$1" = bcg ] || exit 97\nshift\nexec {sys.executable} -m storyboard_cli "$@"\n')
    srun.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "BCG_SERVER": server.url,
           "BCG_WORKER_TOKEN": "task-token", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}
    task = subprocess.Popen(["bash", str(SLURM), "--device", "cpu"], cwd=ROOT, env=env, start_new_session=True)
    try:
        r = httpx.post(server.url + "/v1/jobs", content=JOB, headers={"Content-Type": "application/yaml"}, timeout=10)
        assert r.status_code == 202, r.text
        job = eventually(lambda: server.job(r.json()["id"]), lambda j: j["state"] not in ("queued", "running"),
                         JOB_DEADLINE_S)  # a worker's start (torch, the tiny model) takes long on a busy machine
        assert job["state"] == "succeeded", job
        families = text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text)
        ready = {s.labels["name"]: s.value for f in families for s in f.samples if s.name == "bcg_worker_ready"}
        assert ready == {"slurm-7-3": 1.0}  # the task's name, from Slurm's variables
        os.killpg(task.pid, signal.SIGINT)
        assert task.wait(60) == 0
    finally:
        stop(task)
        server.kill_everything()


def docker_compose() -> list[str] | None:
    """`docker compose` where a Docker daemon answers and the compose plugin is installed, else None."""
    if shutil.which("docker") is None:
        return None
    for argv in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            if subprocess.run(argv, capture_output=True, timeout=30).returncode != 0:
                return None
        except subprocess.TimeoutExpired:
            return None
    return ["docker", "compose", "-f", str(COMPOSE)]


@pytest.mark.slow
@pytest.mark.skipif(docker_compose() is None, reason="no Docker daemon with the compose plugin")
def test_docker_compose_runs_the_server_and_two_cpu_workers_that_render_a_job():
    compose, port = docker_compose(), free_port()
    tokens = {"BCG_TOKEN": uuid.uuid4().hex, "BCG_WORKER_TOKEN": uuid.uuid4().hex}
    env = {**os.environ, **tokens, "BCG_PORT": str(port), "COMPOSE_PROJECT_NAME": f"bcg-test-{uuid.uuid4().hex[:8]}"}

    def run(*argv, timeout=120):
        out = subprocess.run([*compose, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    run("config", "--quiet")
    try:
        run("--profile", "cpu", "up", "-d", "--build", "--scale", "worker-cpu=2", "--wait", "--wait-timeout", "600",
            timeout=1800)  # the first build downloads torch
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {tokens['BCG_TOKEN']}"}
        r = httpx.post(url + "/v1/jobs", content=JOB, headers={"Content-Type": "application/yaml", **auth}, timeout=10)
        assert r.status_code == 202, r.text
        job = eventually(lambda: httpx.get(f"{url}/v1/jobs/{r.json()['id']}", headers=auth, timeout=10).json(),
                         lambda j: j["state"] not in ("queued", "running"), JOB_DEADLINE_S)
        assert job["state"] == "succeeded", job
        assert eventually(lambda: metric(url, "bcg_workers"), lambda n: n == 2, DEADLINE_S) == 2
    finally:
        run("--profile", "cpu", "down", "-v", "--timeout", "30", timeout=300)
