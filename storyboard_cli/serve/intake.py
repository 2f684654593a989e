"""A submitted job, validated and planned as `bcg plan` does, without a model. Torch-free.

The body is saved as the job file in its job folder (`<root>/jobs/<id>/<file name>`), so the workers load
exactly what was validated; relative paths in it are read from that folder. Errors name the client's file
name, not the server's copy, so they read as `bcg plan` prints them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from storyboard_cli.costs import local_device
from storyboard_cli.errors import BadInput, JobError, StoryboardError
from storyboard_cli.folder.outputs import atomic_write
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.digests import weights_path
from storyboard_cli.job.file import Job, load_job
from storyboard_cli.job.hires import hires_size
from storyboard_cli.job.inputs import Inputs
from storyboard_cli.job.estimate import adapted, image_seconds
from storyboard_cli.job.plan import WorkItem, make_batches, model_fields, phases, work_items
from storyboard_cli.job.preflight import PRESETS, check_model_path, presets_of
from storyboard_cli.serve.blobs import BlobStore
from storyboard_cli.serve.schedule import DEFAULT_PRIORITY, TIERS

JOBS = "jobs"  # <root>/jobs/<id>/: the job file, the digests of its inputs and its output folder
OUT = "out"
INPUTS_FILE = "inputs.json"  # every file the job names -> its sha256 in the blob store
RESERVED_FILES = (OUT, INPUTS_FILE)
SAFE_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class PlannedImage:
    order: int
    shot: str
    k: int
    seed: int
    outputs: tuple[str, ...]
    key: str
    fingerprint: str
    mix: str  # images of different jobs with the same mix may share a batch (model, bucket key, LoRA contents)
    cost: float = 1.0  # denoising work, megapixel-steps (a ControlNet adds half): what orders a job's batches
    est: float = 0.0  # its share of its batch's seconds on the server's cost table (serve/estimates.py calibrates it)


@dataclass(frozen=True)
class Planned:
    id: str
    name: str
    path: Path  # the saved job file
    out_dir: Path
    priority: str
    content_hash: str  # body, file name and priority: what an Idempotency-Key is checked against
    batch: int
    images: tuple[PlannedImage, ...]


@functools.cache
def server_device() -> str:
    """The GPU of the server's machine (or the CPU), asked once: the cost table its estimates start from."""
    return local_device()


def job_folder(root: Path, job_id: str) -> Path:
    return root / JOBS / job_id


def plan_submission(root: Path, job_id: str, body: bytes, filename: str, priority: str = DEFAULT_PRIORITY,
                    inputs: tuple[Path, ...] = (), blobs: BlobStore | None = None,
                    allow_models: tuple[str, ...] = (), blob_limit: int | None = None) -> Planned:
    """Saves and validates the job. Raises BadInput (a JobError at file:line, shot, field) and leaves nothing
    behind when the job is refused. The files the job names are read from the blob store: by the sha256 its
    `inputs:` gives (uploaded before), or, for a path under `root` or one of the `inputs` folders (symlinks
    followed), copied into it now; their digests are kept beside the job file (INPUTS_FILE). A model path and
    the output_dir must lie under those folders too; a hub id must be one of `allow_models`."""
    if priority not in TIERS:
        raise BadInput(f"priority must be one of {', '.join(TIERS)}, got {priority!r}")
    if not SAFE_FILE.fullmatch(filename):
        raise BadInput(f"file name must be letters, digits, '_', '.', '-', got {filename[:80]!r}")
    if filename.lower() in RESERVED_FILES:
        raise BadInput(f"file name {filename!r} is a name the server uses in the job's folder; choose another")
    blobs = blobs or BlobStore(root)
    folder = job_folder(root, job_id)
    folder.mkdir(parents=True)  # a new id: nothing is there to remove if this fails
    path = folder / filename
    named = Inputs(blob=blobs.path, adopt=lambda p: blobs.adopt(p, blob_limit))
    # each file whole or not at all (a full disk): a temporary name, then a rename. No fsync per file: four of them
    # per submission put the submit p99 past 1 s under load (tests/test_serve_load.py), and the job is durable once
    # its queue row commits, as before these files were written atomically
    try:
        atomic_write(path, body, durable=False)
        job = _load(path, filename, (root, *inputs), named, allow_models)
        atomic_write(folder / INPUTS_FILE, json.dumps(named.used, sort_keys=True).encode(), durable=False)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    items = work_items(job)
    est = item_seconds(job, items)
    images = tuple(PlannedImage(n, i.shot, i.k, i.seed, i.outputs, i.key.label, i.fingerprint(job.model),
                                mix_key(job, i), work(i), round(est[id(i)], 4)) for n, i in enumerate(items))
    return Planned(job_id, job.name, path, folder / OUT, priority, content_hash(body, filename, priority),
                   max(job.buckets), images)


def item_seconds(job: Job, items: list[WorkItem]) -> dict[int, float]:
    """Each item's estimated seconds (by `id(item)`): its share of its batch, and a hires image's of its pass's too."""
    firsts, planned = phases(job, items)
    passes = dict(zip((id(i) for i in items if i.hires is not None), planned))
    shares = image_seconds(make_batches(firsts, job.buckets) + make_batches(planned, job.buckets),
                           job.model, server_device(), refs=adapted(job))
    return {id(i): shares[id(f)] + (shares[id(passes[id(i)])] if id(i) in passes else 0.0)
            for i, f in zip(items, firsts)}


def mix_key(job: Job, item: WorkItem) -> str:
    """What must match for images of different jobs to share a batch: the models (the job's and each kind's:
    `Kind.mix`), the bucket key (shape, steps, sampler, the nets, the LoRA set by name and scale) and the LoRA
    files' contents. Everything else (prompt, seed, guidance, a guide's image, a reference) is per image."""
    loras = [(f.name, f.sha256, scale) for f, scale in item.loras]
    mixes = [kind.mix(job) for kind in KINDS]
    # the kinds' further models only where a job has them: a plain job's key stays what it was
    extra = [spec for _, further in mixes for spec in further]
    blob = json.dumps([job.model, *(spec for head, _ in mixes for spec in head), item.key.label, loras]
                      + (extra if any(extra) else [])).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def work(item: WorkItem) -> float:
    """An image's denoising work in megapixel-steps, over the steps it runs (an init image's strength skips the
    schedule's first ones: BucketKey.runs), each side network's steps (a ControlNet's) counted at half a UNet's: every
    one it runs, as BucketKey.flops_saved counts them (`Kind.side_ends`)."""
    runs = item.key.runs
    side = 0.5 * runs * sum(end for kind in KINDS for end in kind.side_ends(item))
    hires = 0.0
    if item.hires is not None:  # its second pass: the steps it runs at the size it makes
        w, h = hires_size(item.width, item.height, item.hires.scale)
        hires = w * h / 1e6 * item.hires.steps_run(item.steps)
    return round(item.width * item.height / 1e6 * (runs + side) + hires, 4)


def content_hash(body: bytes, filename: str, priority: str) -> str:
    """What an Idempotency-Key is bound to: the same key with another hash is refused."""
    return hashlib.sha256(b"\0".join([body, filename.encode(), priority.encode()])).hexdigest()


def stored_inputs(job_file: Path) -> dict[str, str]:
    """The files a served job names and their sha256 (what its workers fetch), as intake recorded them."""
    try:
        return json.loads((job_file.parent / INPUTS_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def kept_inputs(root: Path) -> set[str]:
    """The sha256 of every file named by a job whose folder the server keeps (queued, running or finished):
    the blobs `BlobStore.collect` must not remove."""
    named: set[str] = set()
    for folder in (root / JOBS).glob("*"):
        try:
            named.update(json.loads((folder / INPUTS_FILE).read_text(encoding="utf-8")).values())
        except (OSError, ValueError, AttributeError):  # a job refused mid-intake, or a folder not ours
            continue
    return named


def root_of(job_file: Path) -> Path:
    """The server root of a job file it saved (<root>/jobs/<id>/<file>)."""
    return Path(job_file).parent.parent.parent


def served_job(job_file: Path) -> Job:
    """A served job loaded again on the server (its contact sheet): every file it names from the blob store."""
    return load_job(job_file, inputs=Inputs(stored_inputs(job_file), blob=BlobStore(root_of(job_file)).path))


def _load(path: Path, filename: str, roots: tuple[Path, ...], inputs: Inputs, allow_models: tuple[str, ...]) -> Job:
    try:
        job = load_job(path, roots, inputs)
        for field, spec in model_fields(job):
            if spec in presets_of(field):
                continue
            check_model_path(spec, field)
            if spec is not None and spec not in PRESETS and weights_path(spec) is None and spec not in allow_models:
                listed = ": " + ", ".join(allow_models) if allow_models else " is empty"
                raise JobError(str(path), job.lines.get(field), None, field,
                               f"the hub id '{spec[:80]}' is not one this server may download (its --allow-model "
                               f"list{listed})")
        return job
    except JobError as e:
        raise JobError(filename if e.file == str(path) else e.file, e.line, e.shot, e.field, e.message) from None
    except StoryboardError as e:
        raise BadInput(str(e).replace(str(path), filename)) from None
