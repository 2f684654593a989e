"""What crosses `bcg serve`'s HTTP boundary, as pydantic models: the bodies the server validates before it acts
(strict types: `"1"` is not an integer, `1` is not a boolean; every integer within 2^53, so within 64 bits;
every string, list and mapping bounded), the answers /openapi.json describes, and the job body's JSON schema.
The routes take and return these models; the worker (serve/lease_client.py, lease_session.py's `Outcome`) and `bcg
submit` (serve/client.py) build and parse the same ones. Torch-free.

The job body is validated by job/file.py (file:line, shot, field), never by these models: `JobDoc` only
describes it, from job/file.py's own limits, so the schema and the validator share one home per number.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.json_schema import models_json_schema

from storyboard_cli.folder.layout import RESERVED
from storyboard_cli.folder.report import CONDITIONS, Report
from storyboard_cli.job import file as job_file
from storyboard_cli.job import hires
from storyboard_cli.job.file import SHOT_DEFAULTS
from storyboard_cli.job.conditions import source as source_kind
from storyboard_cli.job.conditions.reference import REFERENCE_SCALE, REFERENCE_SLOTS
from storyboard_cli.job.conditions.region import REGION_SLOTS
from storyboard_cli.job.inputs import DIGEST
from storyboard_cli.job.lora_files import SCALE_RANGE
from storyboard_cli.job.preflight import PRESETS
from storyboard_cli.samplers import MAX_STEPS, SAMPLERS
from storyboard_cli.serve.schedule import TIERS, ImageState, JobState

MAX_INT = 2**53 - 1  # I-JSON's exact integers (RFC 7493): within int64, and no JSON tool rounds them
MAX_LEASE_IMAGES = 4096  # far above a lease (one batch of at most MAX_BUCKET images, its riders included)
MAX_BATCHES = 1024  # batches rendered for one lease (an out-of-memory retry splits one in two)
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # worker names and ids: they label metric series
MAX_TEXT = 4000  # characters of a reason (an image's failure, a lease given back)
MAX_WARM = 256  # mixes a worker names as warm

Priority = Literal[tuple(TIERS)]
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="1-64 letters, digits, '_', '.' or '-'")]
ImageId = Annotated[int, Field(ge=0, le=MAX_INT)]
ImageKey = Annotated[str, Field(pattern=r"^[0-9]{1,15}$", description="an image id, in decimal")]
JobId = Annotated[str, Field(min_length=1, max_length=64)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


class Closed:
    """`Closed[dict[K, V]]`: a mapping whose every key must match K's pattern, in the JSON schema too
    (`additionalProperties: false` beside the `patternProperties` pydantic writes, which alone let any key in)."""

    def __class_getitem__(cls, mapping):
        return Annotated[mapping, cls()]

    def __get_pydantic_json_schema__(self, core_schema, handler):
        schema = handler(core_schema)
        schema["additionalProperties"] = False
        return schema


class Body(BaseModel):
    """A request body: strict types, no field it does not name."""

    model_config = ConfigDict(strict=True, extra="forbid")


# ---------------------------------------------------------------- the workers' protocol


class Registration(Body):
    """POST /v1/workers: a worker's name (it labels the worker's metric series, with the id issued for it)."""

    name: Name


class Registered(BaseModel):
    worker: str = Field(description="the id this worker names in its leases and heartbeats")
    name: str
    lease_s: float = Field(description="a lease's time to live; a worker not seen for this long is forgotten")


class WorkerReport(Body):
    """POST /v1/leases and POST /v1/leases/{lease_id}/heartbeat: who asks, its GPU's figures, whether it is
    ready (its model loaded and its graphs captured: what /readyz counts)."""

    worker: Name = Field(description="the id POST /v1/workers issued")
    gpu: dict[Annotated[str, Field(min_length=1, max_length=64)],
              Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)]] | None = Field(
        None, max_length=32, description="torch.cuda memory (bytes) and NVML utilisation (0-1); null on a CPU")
    ready: bool = False
    warm: list[Annotated[str, Field(max_length=64)]] = Field(
        [], max_length=MAX_WARM, description="the mixes (models, bucket key, LoRA set) this worker has prepared: "
                                        "it is leased those first")
    uptime_s: Seconds | None = Field(None, description="seconds since the worker started")


class Batch(Body):
    shape: Annotated[str, Field(pattern=r"^[1-9][0-9]{1,3}x[1-9][0-9]{1,3}$", description="WxH")]
    images: Annotated[int, Field(ge=1, le=job_file.MAX_BUCKET)]
    seconds: Seconds
    bucket: Annotated[int, Field(ge=1, le=job_file.MAX_BUCKET)] | None = Field(
        None, description="the bucket it ran in (images over bucket: how full it was)")


class ManifestLine(BaseModel):
    """One line of an output folder's manifest (folder/outputs.py), for an output this lease uploaded."""

    model_config = ConfigDict(extra="allow")
    path: Annotated[str, Field(min_length=1, max_length=4096)]


def _report_model() -> type[BaseModel]:
    """A worker's report of one job's part of a lease: report.json's keys as `folder.report.Report` types them (the
    one home of that list), strict; keys it does not name pass through (a newer worker's), unread."""
    hints = typing.get_type_hints(Report)
    return create_model("LeaseReport", __config__=ConfigDict(strict=True, extra="allow"), **{
        f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(Report) if f.name not in ("share", "conditions")}, **{
        key: (list[dict[str, typing.Any]] | None, None) for key in CONDITIONS})  # each kind's, at the top level


LeaseReport = _report_model()


def lease_report(report: Report) -> LeaseReport:
    """A worker's `Report` of its part of a lease, as its completion sends it."""
    return LeaseReport.model_validate(report.to_json())


def report_of(sent: LeaseReport) -> Report:
    """The `Report` a completion (or a lease report the server kept) carries; keys it does not name are dropped."""
    return Report.from_json(sent.model_dump())


class Completion(Body):
    """POST /v1/leases/{lease_id}/complete: which of the lease's images landed, which failed and why, what the
    worker measured, and (from a worker without the server's filesystem) the manifest lines of what it uploaded.
    Only the worker the lease was issued to may complete it."""

    worker: Name = Field(description="the id POST /v1/workers issued: the lease's holder")
    done: list[ImageId] = Field([], max_length=MAX_LEASE_IMAGES)
    cached: list[ImageId] = Field([], max_length=MAX_LEASE_IMAGES, description="of `done`: copied, not rendered")
    failed: Closed[dict[ImageKey, Text]] = Field({}, max_length=MAX_LEASE_IMAGES, description="image id -> reason")
    batches: list[Batch] = Field([], max_length=MAX_BATCHES)
    out_of_memory: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    model_loads: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    manifest: dict[JobId, list[ManifestLine]] = Field({}, max_length=MAX_LEASE_IMAGES,
                                                      description="per job, the manifest line of each image written")
    reports: dict[JobId, LeaseReport] = Field({}, max_length=MAX_LEASE_IMAGES,
                                              description="per job, the worker's report of this lease (its stages, "
                                                          "buckets, graphs): merged into the job's report")
    disk_full: Text | None = Field(None, description="a PNG this worker could not write into the job folders it "
                                   "shares with the server, for want of space (the error, one line): the images not "
                                   "named go back to the queue, their attempts kept; the server leases no batch "
                                   "until space is freed (where its own disk is under --min-free-mb; else a strike "
                                   "against this worker)")


class LeaseFailure(Body):
    """POST /v1/leases/{lease_id}/fail: the lease's holder could not render it for an error of its own machine (its
    device unusable, a CUDA error), not of the images: they go back to the queue with their attempts, and the
    worker takes a strike."""

    worker: Name = Field(description="the id POST /v1/workers issued: the lease's holder")
    reason: Text = Field(description="what failed, one line")


class Leased(BaseModel):
    """A part of a lease: built once on the server, read by the worker; a change is a copy (`model_copy`)."""

    model_config = ConfigDict(frozen=True)


class LeasedJob(Leased):
    # one job of a lease (no docstring: it would be the schema's description). The store knows where it is; the
    # API adds its text and its files' digests, so every answer carries them: required on the wire
    # (`json_schema_serialization_defaults_required`), empty only between the two
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)
    path: str = Field(description="the job file on the server")
    out_dir: str = Field(description="its output folder on the server")
    job_file: str = Field(description="the job file's name")
    job_text: str = Field(default_factory=str,
                          description="the job file's text (for a worker without the server's filesystem)")
    inputs: dict[str, str] = Field(default_factory=dict,
                                   description="each file the job names -> its sha256 (GET /v1/blobs/{sha256})")


class LeasedImage(Leased):
    id: int
    job: str
    outputs: list[str]
    mix: str | None = Field(None, description="what must match for images to share a batch (a worker's `warm`)")
    twin: str | None = Field(description="a PNG already rendered with this image's fingerprint, on the server")
    twin_of: list[str] | None = Field(description="[its job, its output path]")
    twin_url: str | None = Field(description="where to download that PNG")


class Lease(Leased):
    lease: str
    job: str = Field(description="the head job (the best ranked)")
    jobs: dict[str, LeasedJob]
    expires: float
    ttl: float = Field(description="seconds: heartbeat well within it")
    images: list[LeasedImage]


def job_file_url(job_id: str, path: str) -> str:
    """Where GET /v1/jobs/{job_id}/files/{path} serves a file of a job's folder (a twin's PNG), from the root."""
    return f"/v1/jobs/{job_id}/files/{path}"


class LeaseAck(BaseModel):
    lease: str


class StoredOutput(BaseModel):
    stored: str


# ---------------------------------------------------------------- input files (blob_routes.py, client.py)

MAX_QUERY = 10_000  # digests asked about in one POST /v1/blobs/missing


class BlobQuery(BaseModel):
    digests: list[Annotated[str, Field(pattern=f"^{DIGEST.pattern}$")]] = Field(max_length=MAX_QUERY)


class BlobsMissing(BaseModel):
    missing: list[str]


class BlobStored(BaseModel):
    sha256: str
    size: int
    created: bool


# ---------------------------------------------------------------- jobs


class PriorityChange(Body):
    """PATCH /v1/jobs/{job_id}."""

    priority: Priority


class ImageView(BaseModel):
    id: int
    shot: str
    candidate: int
    seed: int
    state: Literal[ImageState.QUEUED, ImageState.LEASED, ImageState.DONE, ImageState.FAILED, ImageState.CANCELED]
    attempts: int
    cached: bool
    reason: str | None
    outputs: list[str]
    urls: list[str] = Field(description="the outputs' URLs, once done")
    worker: str | None = Field(None, description="the worker of its last lease (null: never leased)")
    seconds: float | None = Field(None, description="its last lease's seconds: to its end, or until now while it "
                                                    "renders (null: never leased, or queued again)")


class JobView(BaseModel):
    id: str
    name: str
    state: Literal[JobState.ALL]
    priority: Priority
    submitted: float
    finished: float | None
    images_by_state: dict[str, int]
    queue_position: int | None = Field(description="images queued ahead of this job's; null once none is open")
    eta_s: float | None
    images: list[ImageView]
    url: str
    report_url: str
    sheet_url: str


class JobRow(BaseModel):
    """A job as a row of GET /v1/jobs: its view without its images, with who renders it and its latest image."""

    id: str
    name: str
    state: Literal[JobState.ALL]
    priority: Priority
    front: bool = Field(description="moved to the front: it ranks ahead of the jobs open when it was moved")
    submitted: float
    finished: float | None
    images: int = Field(description="its images, every state")
    images_by_state: dict[str, int]
    queue_position: int | None = Field(description="images queued ahead of this job's; null once none is open")
    eta_s: float | None
    workers: list[str] = Field(description="the workers rendering its images now")
    latest_url: str | None = Field(description="its image finished last (null: none yet)")
    thumbnail_url: str | None = Field(description="that image's thumbnail once the contact sheet has it, else the "
                                                  "image")
    url: str
    report_url: str
    sheet_url: str


class JobPage(BaseModel):
    """GET /v1/jobs: a page of jobs, newest first."""

    jobs: list[JobRow]
    next: str | None = Field(description="the `cursor` of the next page (null: the last page)")
    last_event: int = Field(description="the global stream's last id when the page was read (GET /v1/events?after=)")


class WorkerView(BaseModel):
    id: str = Field(description="the id the server issued")
    name: str
    state: Literal["rendering", "idle", "cold", "draining", "drained", "quarantined", "lost"] = Field(
        description="cold: its model not ready yet; draining: leased nothing more, its batch running; lost: not seen "
                    "within --lease-s")
    job: str | None = Field(description="the head job of its current lease")
    lease: str | None
    images: int = Field(description="its current lease's images")
    shape: str | None = Field(description="its current batch's bucket key (size, steps, sampler)")
    warm: list[str] = Field(description="the mixes it has prepared (its warm graphs), from its last lease request")
    heartbeat_age_s: float = Field(description="seconds since its last lease request or heartbeat")
    images_per_s: float = Field(description="images it finished per second over the last 5 minutes")
    gpu: dict[str, float] | None = Field(description="its GPU's figures (memory bytes, power watts, ...); null on "
                                                     "a CPU")
    ready: bool
    draining: bool
    strikes: int
    quarantined: str | None


class WorkersView(BaseModel):
    """GET /v1/workers: every registered worker."""

    workers: list[WorkerView]
    last_event: int


class TierView(BaseModel):
    queued: int = Field(description="images waiting for a lease")
    rendering: int = Field(description="images leased")
    jobs: int = Field(description="jobs with an image queued or rendering")
    oldest_s: float = Field(description="seconds the oldest waiting image has waited since its job's submission")


class QueueView(BaseModel):
    """GET /v1/queue: the queue per priority, whether it dispatches, its drain rate and workers."""

    tiers: dict[Priority, TierView]
    paused: bool = Field(description="dispatch paused: no batch is leased (POST /v1/queue/resume)")
    paused_since: float | None
    leases: int
    images_per_s: float = Field(description="the drain rate: images finished per second over the last 5 minutes")
    workers: int = Field(description="registered workers seen within --lease-s")
    workers_ready: int
    drained: list[str] = Field(description="the names of the workers drained (leased nothing more until resumed)")
    last_event: int


class QueueEvent(BaseModel):
    """The `data` of an event of GET /v1/events: a job's event (JobEvent: `job`, `state`, `images_by_state`, ...)
    or one of the queue's own (queue_paused, queue_resumed; worker_drained, worker_resumed with `worker`, `name`)."""

    model_config = ConfigDict(extra="allow")
    at: float
    job: str | None = None
    state: Literal[JobState.ALL] | None = None
    worker: str | None = None


class JobEvent(BaseModel):
    """The `data` of one of a job's server-sent events: the job's state after the change, and the change's own
    fields (a lease's worker and images, a new priority, ...)."""

    model_config = ConfigDict(extra="allow")
    job: str
    state: Literal[JobState.ALL]
    at: float
    images_by_state: dict[str, int]


class Problem(BaseModel):
    """RFC 9457 problem details: `detail` is one line a person can act on."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str


class Health(BaseModel):
    ok: bool


class Ready(BaseModel):
    ready: bool
    workers: int
    workers_ready: int


# ---------------------------------------------------------------- the job body, described (job/file.py validates it)

Scale = Annotated[float, Field(ge=SCALE_RANGE[0], le=SCALE_RANGE[1])]
SafeName = Annotated[str, Field(pattern=f"^{job_file.SAFE_NAME.pattern}$")]
NonEmpty = Annotated[str, Field(pattern=r"^[^\x00]*\S[^\x00]*$", description="not empty, no NUL")]


class Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ControlDoc(Doc):
    image: NonEmpty = Field(description="a control image: a name in the job's `inputs`, or a path under the "
                                        "server's folders")
    scale: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    end: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    net: SafeName | None = Field(None, description="a name in the job's `controlnets` (left out: its only net)")


RefScale = Annotated[float, Field(ge=REFERENCE_SCALE[0], le=REFERENCE_SCALE[1])]


class ReferenceDoc(Doc):
    image: NonEmpty = Field(description="a reference picture: a name in the job's `inputs`, or a path under the "
                                        "server's folders")
    scale: RefScale = 1.0


class CharacterDoc(Doc):
    reference: NonEmpty | ReferenceDoc
    scale: RefScale | None = None
    lora: dict[str, Scale] | None = Field(None, description="name in the job's `loras` -> scale")


class RegionDoc(Doc):
    """One part of a shot's frame with its own prompt: `box` or `mask`, one of the two."""

    box: Annotated[list[float], Field(min_length=4, max_length=4)] | None = Field(
        None, description="[x, y, w, h] in pixels, or fractions of the frame when all are <= 1; inside the frame")
    mask: NonEmpty | None = Field(None, description="a mask image (white: the region): a name in the job's `inputs`, "
                                                    "or a path under the server's folders")
    prompt: NonEmpty = Field(description="what the region shows: at most 77 CLIP tokens")
    characters: Annotated[list[SafeName], Field(max_length=REFERENCE_SLOTS)] | None = Field(
        None, description="names in the job's `characters`: their references, inside the region alone (needs "
                          "`ip_adapter`; their LoRAs are not applied: no per-region LoRA)")
    reference: NonEmpty | ReferenceDoc | None = Field(None, description="a reference inside the region alone (needs "
                                                                        "`ip_adapter`)")


class DeepCacheDoc(Doc):
    interval: Annotated[int, Field(ge=2, le=job_file.MAX_INTERVAL)]
    branch: Annotated[int, Field(ge=0, le=job_file.MAX_BRANCH)] = 0


class HiresDoc(Doc):
    scale: Annotated[float, Field(ge=1.0, le=hires.MAX_SCALE, description=f"the upscale factor; the result at most "
                                                                           f"{hires.MAX_HIRES_SIDE} px a side")]
    strength: Annotated[float, Field(gt=0.0, le=1.0, description="of the pass's S steps, the last int(S * strength) "
                                                                 "run")] = hires.DEFAULT_STRENGTH
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = Field(None, description="the pass's schedule (left "
                                                                                       "out: the shot's steps)")
    upscaler: Literal[tuple(hires.UPSCALERS)] = hires.DEFAULT_UPSCALER


class InitDoc(Doc):
    image: NonEmpty = Field(description="the image the shot starts from: a name in the job's `inputs`, or a path "
                                        "under the server's folders")
    strength: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
        None, description="of S steps the last int(S * strength) run (default 0.3, with a mask 0.9999)")
    resize: Literal[tuple(source_kind.RESIZE)] | None = Field(
        None, description="how a source of another aspect than the shot's becomes its size")


class MaskDoc(Doc):
    image: NonEmpty | None = Field(None, description="white repaints; the source's size (not with `box`)")
    box: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=4, max_length=4)] | None = Field(
        None, description="[x, y, width, height] in the source's pixels (not with `image`)")
    blur: Annotated[int, Field(ge=0, le=source_kind.MAX_BLUR)] = 0
    padding: Annotated[int, Field(ge=0, le=source_kind.MAX_PADDING)] | None = Field(
        None, description="repaint the masked area plus this many pixels at the shot's size and paste it back")


class ShotFields(Doc):
    """What a shot sets, and what `defaults` sets for every shot."""

    prompt: NonEmpty = Field(None, description="A1111 `<lora:name:scale>` tags name the job's `loras`")
    negative: Annotated[str, Field(pattern=r"^[^\x00]*$")] | None = SHOT_DEFAULTS["negative"]
    candidates: Annotated[int, Field(ge=1, le=job_file.MAX_CANDIDATES)] = SHOT_DEFAULTS["candidates"]
    size: Annotated[str, Field(pattern=r"^\s*([0-9]+\s*[x×]\s*[0-9]+|[A-Za-z]+)\s*$",
                               description=f"'WxH' (multiples of 8, {job_file.MIN_SIDE}-{job_file.MAX_SIDE}) or "
                                           f"one of {', '.join(job_file.NAMED_SIZES)}")] = SHOT_DEFAULTS["size"]
    seed: Annotated[int, Field(ge=0, le=job_file.MAX_SEED)] | None = None
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = SHOT_DEFAULTS["steps"]
    guidance: Annotated[float, Field(ge=0.0, le=30.0)] = SHOT_DEFAULTS["guidance"]
    sampler: Literal[tuple(SAMPLERS)] = SHOT_DEFAULTS["sampler"]
    control: ControlDoc | Annotated[list[ControlDoc], Field(min_length=1)] | None = Field(
        None, description="needs the job's `controlnet` or `controlnets`; a list: one guide per net, summed")
    characters: Annotated[list[SafeName], Field(max_length=REFERENCE_SLOTS)] | None = Field(
        None, description="names in the job's `characters`: their references and LoRAs (needs `ip_adapter`)")
    reference: NonEmpty | ReferenceDoc | None = Field(None, description="a one-off reference (needs `ip_adapter`)")
    regions: Annotated[list[RegionDoc], Field(max_length=REGION_SLOTS)] | None = Field(
        None, description="parts of the frame with their own prompts (and references); the shot's prompt is seen "
                          "everywhere")
    lora: dict[str, Scale] | None = Field(None, description="name in the job's `loras` -> scale")
    init: InitDoc | None = Field(None, description="start from an image (img2img)")
    mask: MaskDoc | None = Field(None, description="repaint only part of the `init` image (inpainting)")
    cfg_cutoff: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    deepcache: DeepCacheDoc | Literal[False] | None = None
    hires: HiresDoc | Literal[False] | None = Field(None, description="upscale, then img2img at the new size")


class ShotDoc(ShotFields):
    id: Annotated[str, Field(pattern=f"^{job_file.SHOT_ID.pattern}$",
                             description=f"names the shot's folder: unique (ignoring case), not one of "
                                         f"{', '.join(RESERVED)}")]


class JobDoc(Doc):
    """A job file (`bcg plan`'s format), as YAML or JSON. A null top-level value is as if left out, except
    for the required ones; within a shot (or `defaults`) only `negative`, `seed`, `control`, `lora`, `init`, `mask`,
    `cfg_cutoff`, `deepcache` and `hires` may be null."""

    version: Literal[1]
    name: SafeName | None = Field(None, description="the output folder's name (default: from X-Job-Filename)")
    model: Literal[PRESETS] | NonEmpty = Field(description="a preset, a hub id on the server's --allow-model list, or "
                                                       "a model folder or file under the server's folders")
    controlnet: NonEmpty | None = None
    controlnets: Closed[dict[SafeName, NonEmpty]] | None = Field(None, description="name -> ControlNet model "
                                                                                   "(not with `controlnet`)")
    ip_adapter: NonEmpty | None = Field(None, description="an IP-Adapter preset, folder or file")
    image_encoder: NonEmpty | None = None
    characters: Closed[dict[SafeName, CharacterDoc]] | None = None
    output_dir: NonEmpty | None = None
    buckets: list[Annotated[int, Field(ge=1, le=job_file.MAX_BUCKET)]] | None = Field(None, min_length=1)
    loras: Closed[dict[SafeName, NonEmpty]] | None = Field(None, description="name -> LoRA file (.safetensors)")
    defaults: ShotFields | None = None
    shots: list[ShotDoc] = Field(min_length=1)
    inputs: Closed[dict[Annotated[str, Field(pattern=r"^[\s\S]*\S[\s\S]*$")],
                        Annotated[str, Field(pattern=f"^{DIGEST.pattern}$")]]] | None = Field(
        None, description="each file the job names -> its sha256, uploaded with PUT /v1/blobs/{sha256}")


def component_schemas(models: tuple[type[BaseModel], ...], mode: str = "validation") -> dict[str, Any]:
    """The models' JSON schemas as OpenAPI components (`#/components/schemas/<name>`), nested models included."""
    _, top = models_json_schema([(m, mode) for m in models], ref_template="#/components/schemas/{model}")
    return top.get("$defs", {})
