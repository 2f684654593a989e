"""YAML job file -> frozen, validated dataclasses. No torch here.

Every error names file:line, the shot id and the field, in one line (errors.JobError).
"""

from __future__ import annotations

import io
import logging
import re
import reprlib
import unicodedata
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from storyboard_cli.errors import BadInput, JobError, did_you_mean, one_line
from storyboard_cli.folder.layout import RESERVED
from storyboard_cli.job.digests import file_sha256, relative_to_job, remember_sha256
from storyboard_cli.job.inputs import DIGEST_RULE, INPUTS_KEY, InputProblem, Inputs, is_digest, shown_name, suffix_of
from storyboard_cli.job.lora_files import LORA_TAG, SCALE_RANGE, inspect_lora, lora_problem, split_lora_tags
from storyboard_cli.job.preflight import PRESETS, exists, expanded, is_pathlike
from storyboard_cli.samplers import MAX_STEPS, SAMPLERS
from storyboard_cli.steps import NO_DEEPCACHE, DeepCache, guided_steps

log = logging.getLogger(__name__)

NAMED_SIZES = {
    "square": (1024, 1024),
    "portrait": (832, 1216),
    "landscape": (1216, 832),
    "wide": (1344, 768),
}
DEFAULT_BUCKETS = (1, 2, 4, 8)
MIN_SIDE, MAX_SIDE = 64, 4096
MAX_CANDIDATES = 64
MAX_BUCKET = 64
MAX_SEED = 2**63 - 1 - MAX_CANDIDATES
MAX_PATH = 4096  # Linux's PATH_MAX

TOP_KEYS = ("version", "name", "model", "controlnet", "output_dir", "buckets", "loras", "defaults", "shots", INPUTS_KEY)
SHOT_KEYS = ("id", "prompt", "negative", "candidates", "size", "seed", "steps", "guidance", "sampler", "control",
             "lora", "cfg_cutoff", "deepcache")
CONTROL_KEYS = ("image", "scale", "end")
DEEPCACHE_KEYS = ("interval", "branch")
MAX_INTERVAL = 10
MAX_BRANCH = 2  # SDXL's UNet has 3 up blocks: branches 0 (the shallowest skip) to 2
# `bcg render --draft`: the levers every shot gets (docs/PERFORMANCE.md, "Draft renders"): guidance on the
# first half of the steps (the guidance-interval paper's finding: little is lost at low noise), DeepCache's
# full UNet every 3rd step on the shallowest branch (its paper's SDXL setting); a ControlNet stops where the
# guidance stops (the composition it holds is set in the early, noisy steps), and DeepCache runs after it
DRAFT_CUTOFF = 0.5
DRAFT_DEEPCACHE = DeepCache(3, 0)
SHOT_DEFAULTS: dict[str, Any] = {
    "negative": "",
    "candidates": 1,
    "size": "square",
    "steps": 30,
    "guidance": 5.0,
    "sampler": "euler",
}
SHOT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # always fullmatch: '$' lets a trailing newline in
SAFE_NAME = SHOT_ID
SAFE_NAME_RULE = "must be 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"


@dataclass(frozen=True)
class ShotControl:
    """A shot's `control:` (the tensors a batch is conditioned on are conditioning.Control)."""

    image: Path  # absolute, resolved against the job file's folder
    scale: float
    file: str = ""  # the image as seen from the job file's folder: what the outputs record
    end: float = 1.0  # the fraction of the steps the ControlNet runs, as diffusers' control_guidance_end


@dataclass(frozen=True)
class LoraFile:
    """One entry of the job's `loras:`, checked (format, architecture) and hashed at load time."""

    name: str
    path: Path  # absolute, resolved against the job file's folder
    file: str  # as seen from the job file's folder: what the outputs record
    sha256: str  # of the tensor bytes (A1111's addnet hash): a changed file re-renders its shots
    shorthash: str  # what A1111 writes in `Lora hashes`
    text_encoders: bool  # whether it changes the prompt embeddings


@dataclass(frozen=True)
class Shot:
    id: str
    prompt: str
    negative: str
    candidates: int
    width: int
    height: int
    seed: int
    steps: int
    guidance: float
    sampler: str
    control: ShotControl | None
    line: int
    first_candidate: int = 0  # > 0 only for candidates added later (bcg render --reroll)
    loras: tuple[tuple[str, float], ...] = ()  # (name in Job.loras, scale), sorted by name, no zero scales
    cfg_cutoff: float = 1.0  # the fraction of the steps that use guidance (1.0: every step)
    deepcache: DeepCache = NO_DEEPCACHE
    draft: bool = False  # rendered by `bcg render --draft`: marked so in every output


@dataclass(frozen=True)
class Job:
    path: Path
    name: str
    model: str
    controlnet: str | None
    output_dir: Path
    buckets: tuple[int, ...]
    shots: tuple[Shot, ...]
    loras: dict[str, LoraFile] = field(default_factory=dict)  # the top-level `loras:`, by name


# ---------------------------------------------------------------- YAML with line numbers


class _Located(dict):
    """A mapping that remembers the line of itself and of each key."""

    line: int
    lines: dict[Any, int]


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        self.key, self.line = key, line


MAX_ALIAS_VALUES = 100_000  # values YAML aliases may add to a job: a real one adds a few hundred
MESSAGE_VALUE = 80  # characters of a value that a message quotes
MAX_INT_TEXT = 100  # characters of an integer: no field takes more than 19 digits; int() of 4300+ refuses
_INT_TAG = "tag:yaml.org,2002:int"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _TooLarge(Exception):
    """The composed document would expand past a limit; located like a JobError (file aside)."""

    def __init__(self, line: int, shot: str | None, field: str | None, message: str):
        self.line, self.shot, self.field, self.message = line, shot, field, message


class _Loader(yaml.SafeLoader):
    def construct_document(self, node: yaml.Node) -> Any:
        # PyYAML shares an aliased node, so a 1 KB file of nested aliases composes to a few dozen nodes yet
        # constructs (merge keys) or walks (repr, json) to billions of values: its size is counted first
        _check_size(node)
        return super().construct_document(node)


# YAML 1.2's floats with an exponent (1e6, 1E-3, -2.5e+3, 1.5e3): YAML 1.1 needs a dot and a signed exponent,
# and reads these as strings. A dotless number without an exponent (08) stays what 1.1 makes of it.
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
                              list("-+.0123456789"))


def _children(node: yaml.Node) -> list[tuple[str | int | None, yaml.Node, yaml.Node | None]]:
    """A composed node's children as (label, child, key node): a list's items by index; a mapping's keys
    (label None) and values (label: the key's text)."""
    if isinstance(node, yaml.SequenceNode):
        return [(i, item, None) for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        return [pair for key, value in node.value for pair in
                ((None, key, None), (key.value if isinstance(key, yaml.ScalarNode) else None, value, key))]
    return []


def _check_size(root: yaml.Node) -> None:
    """Raises _TooLarge where aliases would add more than MAX_ALIAS_VALUES values, where an alias holds
    itself, or where an integer is longer than MAX_INT_TEXT. Each node is counted once (its expanded size
    memoised), in a loop rather than recursion: the cost is that of the text, not of its expansion."""
    sizes: dict[int, int] = {}  # id(node) -> the values it expands to, itself included
    open_: set[int] = set()  # the nodes whose children are being counted: the path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        if counted:
            sizes[id(node)] = 1 + sum(sizes[id(child)] for _, child, _ in _children(node))
            open_.discard(id(node))
        elif id(node) in open_:
            raise _TooLarge(*_where(root, node), "a YAML alias refers to a list or mapping that holds it")
        elif id(node) not in sizes:
            if isinstance(node, yaml.ScalarNode) and node.tag == _INT_TAG and len(node.value) > MAX_INT_TEXT:
                _, shot, field = _where(root, node)
                raise _TooLarge(node.start_mark.line + 1, shot, field,
                                f"an integer of {len(node.value)} characters is too large for any field")
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for _, child, _ in _children(node))
    if sizes[id(root)] - len(sizes) > MAX_ALIAS_VALUES:
        node = root  # named by the deepest node that alone is over the budget
        while (big := max(_children(node), key=lambda c: sizes[id(c[1])], default=None)) and \
                sizes[id(big[1])] > MAX_ALIAS_VALUES:
            node = big[1]
        raise _TooLarge(*_where(root, node), f"YAML aliases expand to more than {MAX_ALIAS_VALUES} values")


def _where(root: yaml.Node, target: yaml.Node) -> tuple[int, str | None, str | None]:
    """(line, shot, field) of a node, as first reached from the root: the line of the last mapping key on
    the way there (else the node's), the shot under `shots:` and its id, the keys below it (`deepcache.branch`)."""
    parents: dict[int, tuple[yaml.Node, str | int | None, yaml.Node | None] | None] = {id(root): None}
    stack = [root]
    while stack and id(target) not in parents:
        node = stack.pop()
        for label, child, key in _children(node):
            if id(child) not in parents:
                parents[id(child)] = (node, label, key)
                stack.append(child)
    path: list[tuple[str | int | None, yaml.Node, yaml.Node | None]] = []  # (label, node, key node), root down
    node = target
    while (up := parents.get(id(node))) is not None:
        path.append((up[1], node, up[2]))
        node = up[0]
    path.reverse()
    line = next((key.start_mark.line + 1 for _, _, key in reversed(path) if key is not None),
                target.start_mark.line + 1)
    shot = None
    if len(path) >= 2 and path[0][0] == "shots" and isinstance(path[1][0], int):
        shot, path = _shot_label(path[1][1], path[1][0]), path[2:]
    field = ".".join(label for label, _, key in path if isinstance(label, str) and key.tag != _MERGE_TAG)
    return line, shot, clip(field) or None


def _shot_label(node: yaml.Node, index: int) -> str:
    """A composed shot's id where it is a valid one, else its place in the list (`#3`)."""
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        if isinstance(key, yaml.ScalarNode) and key.value == "id" and isinstance(value, yaml.ScalarNode) \
                and SHOT_ID.fullmatch(value.value):
            return value.value
    return f"#{index + 1}"


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded walk (the first items of each list and mapping, three levels deep), extended to
    the mappings this loader builds and to integers too long for repr()."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 4, 4, 4, 4
        self.maxstring = self.maxlong = self.maxother = MESSAGE_VALUE

    def repr__Located(self, x: _Located, level: int) -> str:  # noqa: N802 (reprlib's dispatch by type name)
        return self.repr_dict(x, level)

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * MESSAGE_VALUE:  # repr() of a huge int is quadratic, and refused past 4300 digits
            return f"<an integer of {x.bit_length() * 30103 // 100000 + 1} digits>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def clip(text: str, limit: int = MESSAGE_VALUE) -> str:
    """`text` cut to `limit` characters, '...' marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_repr(value: Any) -> str:
    """repr(value) as a message shows it: cut to MESSAGE_VALUE characters, without first building the full
    repr of a huge value (an alias bomb, a megabyte of text)."""
    return clip(_SHORT_REPR.repr(value))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Located:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise _DuplicateKey(key, line)  # unhashable / complex key: reported as a bad key
        if key in seen:
            raise _DuplicateKey(key, line)
        seen[key] = line
    loader.flatten_mapping(node)  # merge keys (<<: *anchor); explicit keys override merged ones
    out = _Located()
    out.line, out.lines = node.start_mark.line + 1, {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_text(path: Path, kind: str = "job") -> str:
    """A YAML file's text (`kind`: "job" or "picks"), or a one-line JobError saying why not."""
    file = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise JobError(file, None, None, None, f"{kind} file not found") from None
    except IsADirectoryError:
        raise JobError(file, None, None, None, f"is a folder, not a {kind} file") from None
    except OSError as e:
        raise JobError(file, None, None, None, f"cannot read: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise JobError(file, line, None, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x})") from None


def _read_yaml(path: Path) -> Any:
    file = str(path)
    text = read_text(path)
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (SafeLoader subclass)
    except _TooLarge as e:
        raise JobError(file, e.line, e.shot, e.field, e.message) from None
    except _DuplicateKey as e:
        raise JobError(file, e.line, None, None, f"duplicate or invalid key {short_repr(e.key)}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        what = clip((e.problem or "invalid YAML").strip(), 2 * MESSAGE_VALUE)  # it may quote a tag of the file
        raise JobError(file, line, None, None, f"YAML syntax error: {what}") from None
    except yaml.reader.ReaderError as e:
        line = text[: e.position].count("\n") + 1
        raise JobError(file, line, None, None, f"YAML cannot contain the character {e.character!r}") from None
    except yaml.YAMLError as e:
        raise JobError(file, None, None, None, f"YAML error: {clip(str(e), 2 * MESSAGE_VALUE)}") from None
    except RecursionError:
        raise JobError(file, None, None, None, "YAML nests too deeply") from None


# ---------------------------------------------------------------- validation


class _Ctx:
    """Where we are in the file, to build located errors."""

    def __init__(self, file: str, roots: tuple[Path, ...] | None = None, inputs: Inputs | None = None):
        self.file = file
        self.images_checked: set[Path] = set()  # control images decoded once per job, however many shots use them
        self.roots = None if roots is None else tuple(Path(r).resolve() for r in roots)
        self.inputs = inputs

    def fail(self, line: int | None, shot: str | None, field: str | None, message: str) -> JobError:
        return JobError(self.file, line, shot, field, message)

    def confine(self, path: Path, line: int | None, shot: str | None, field: str, shown: str | None = None) -> None:
        """With roots (the render service), a file the job names, symlinks followed, must lie under one."""
        if self.roots is not None and not any(path.resolve().is_relative_to(r) for r in self.roots):
            raise self.fail(line, shot, field, f"{shown or path} is outside the folders this server may read and write")

    def input_file(self, rel: str, job_dir: Path, line: int | None, shot: str | None, field: str,
                   is_file: bool = True) -> tuple[Path, str]:
        """A file the job names: (the file to read, the name the outputs record). Named in the job's inputs
        (by sha256), it is read from the blob store; else it is a path from the job's folder, confined on the
        service and there copied into the blob store before anything reads it."""
        inputs, fail, name = self.inputs, (lambda why: self.fail(line, shot, field, why)), clip(rel)
        digest = inputs.digests.get(rel) if inputs is not None else None
        blobs = inputs is not None and inputs.blob is not None
        local = expanded(rel)
        if local is None:
            raise fail(f"{name}: {clip(rel.split('/')[0])} names no user of this machine")
        path = (job_dir / local).resolve()
        if not (digest is not None and blobs):
            self.confine(path, line, shot, field, name)
            if not (path.is_file() if is_file else path.exists()):
                raise fail(f"file not found: {name}")
        if blobs:
            try:
                if digest is None:
                    if inputs.adopt is None:
                        raise fail(f"{name} is not among the job's uploaded inputs")
                    digest = inputs.adopt(path)
                inputs.used[rel] = digest
                return inputs.blob(digest, suffix_of(rel)), shown_name(rel, job_dir)
            except (InputProblem, BadInput) as e:
                raise fail(f"{name}: {e}") from None
        if digest is not None and file_sha256(path) != digest:
            raise fail(f"{name} changed since its sha256 was recorded in '{INPUTS_KEY}:' ({digest[:12]}...)")
        return path, relative_to_job(path, job_dir)

    def confine_model(self, spec: str | None, line: int | None, field: str) -> None:
        """A model named by a local path (as the loader reads it: from the working folder) is confined too;
        presets and hub ids are not files of this machine."""
        if self.roots is None or spec is None or spec in PRESETS:
            return
        path = expanded(spec)
        if path is None:  # `~user` of no user here: no folder of this server's either
            raise self.fail(line, None, field, f"{clip(spec)} is outside the folders this server may read and write")
        if is_pathlike(spec) or exists(path):
            self.confine(path, line, None, field, clip(spec))


def _line_of(mapping: Any, key: str, fallback: int | None = None) -> int | None:
    if isinstance(mapping, _Located):
        return mapping.lines.get(key, mapping.line)
    return fallback


def _check_keys(ctx: _Ctx, mapping: _Located, allowed: tuple[str, ...], shot: str | None, prefix: str = "") -> None:
    for key in mapping:
        if key in allowed:
            continue
        line = mapping.lines.get(key, mapping.line)
        raise ctx.fail(line, shot, clip(f"{prefix}{key}"), f"unknown key{did_you_mean(str(key), allowed, known=True)}")


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", type(None): "empty"}.get(type(value), "a mapping" if isinstance(value, dict) else type(value).__name__)


def _as_int(ctx: _Ctx, value: Any, line: int | None, shot: str | None, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.fail(line, shot, field, f"must be an integer, got {_type_name(value)} ({short_repr(value)})")
    if not lo <= value <= hi:
        raise ctx.fail(line, shot, field, f"must be between {lo} and {hi}, got {short_repr(value)}")
    return value


def _as_float(ctx: _Ctx, value: Any, line: int | None, shot: str | None, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ctx.fail(line, shot, field, f"must be a number, got {_type_name(value)} ({short_repr(value)})")
    value = float(value)
    if not lo <= value <= hi:  # also rejects NaN
        raise ctx.fail(line, shot, field, f"must be between {lo:g} and {hi:g}, got {value:g}")
    return value


def _as_str(ctx: _Ctx, value: Any, line: int | None, shot: str | None, field: str, *, empty_ok: bool) -> str:
    if not isinstance(value, str):
        raise ctx.fail(line, shot, field, f"must be a string, got {_type_name(value)} ({short_repr(value)})")
    if not empty_ok and not value.strip():
        raise ctx.fail(line, shot, field, "must not be empty")
    if "\x00" in value:
        raise ctx.fail(line, shot, field, "must not contain NUL characters")
    return value


def parse_size(text: Any) -> tuple[int, int]:
    """'WxH' or a named aspect -> (width, height). Raises ValueError with a reason."""
    if not isinstance(text, str):
        raise ValueError(f"must be 'WxH' or one of {', '.join(NAMED_SIZES)}, got {_type_name(text)} "
                         f"({short_repr(text)})")
    key = text.strip().lower()
    if key in NAMED_SIZES:
        return NAMED_SIZES[key]
    m = re.fullmatch(r"(\d{1,9})\s*[x×]\s*(\d{1,9})", key)  # 9 digits: int() stays cheap, the range check says why
    if not m:
        raise ValueError(f"must be 'WxH' or one of {', '.join(NAMED_SIZES)}, got {short_repr(text)}"
                         f"{did_you_mean(key, NAMED_SIZES)}")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if side % 8:
            raise ValueError(f"{width}x{height}: both sides must be multiples of 8")
        if not MIN_SIDE <= side <= MAX_SIDE:
            raise ValueError(f"{width}x{height}: each side must be between {MIN_SIDE} and {MAX_SIDE}")
    return width, height


def _default_seed(shot_id: str) -> int:
    # stable across runs and machines, unlike hash()
    return zlib.crc32(shot_id.encode())


def _resolve_shot(ctx: _Ctx, raw: Any, index: int, defaults: _Located, job_dir: Path, has_controlnet: bool,
                  list_line: int, loras: dict[str, LoraFile]) -> Shot:
    if not isinstance(raw, _Located):
        raise ctx.fail(list_line, f"#{index + 1}", None, f"a shot must be a mapping, got {_type_name(raw)}")
    shot_id = raw.get("id")
    if shot_id is None:
        raise ctx.fail(raw.line, f"#{index + 1}", "id", "missing")
    label = clip(shot_id) if isinstance(shot_id, str) else f"#{index + 1}"
    id_line = _line_of(raw, "id")
    shot_id = _as_str(ctx, shot_id, id_line, label, "id", empty_ok=False)
    if not SHOT_ID.fullmatch(shot_id):
        label = clip(shot_id) if shot_id.isprintable() else f"#{index + 1}"  # the message stays one line
        raise ctx.fail(id_line, label, "id", f"{SAFE_NAME_RULE} (it names a folder), got {short_repr(shot_id)}")
    if shot_id.lower() in RESERVED:
        raise ctx.fail(id_line, label, "id", f"'{shot_id}' is a name bcg uses in the output folder "
                       f"({', '.join(RESERVED)}); choose another")
    _check_keys(ctx, raw, SHOT_KEYS, shot_id)

    def get(field: str) -> tuple[Any, int | None]:
        if field in raw:
            return raw[field], _line_of(raw, field)
        if field in defaults:
            return defaults[field], _line_of(defaults, field)
        if field in SHOT_DEFAULTS:
            return SHOT_DEFAULTS[field], raw.line
        return None, raw.line

    prompt, line = get("prompt")
    if prompt is None:
        raise ctx.fail(line, shot_id, "prompt", "missing")
    prompt = _as_str(ctx, prompt, line, shot_id, "prompt", empty_ok=False)
    prompt, lora_scales = _shot_loras(ctx, prompt, line, *get("lora"), shot_id, loras)
    negative, line = get("negative")
    negative = "" if negative is None else _as_str(ctx, negative, line, shot_id, "negative", empty_ok=True)
    if LORA_TAG.search(negative):
        raise ctx.fail(line, shot_id, "negative", "a <lora:...> tag cannot go in the negative prompt; "
                       "put it in the prompt or in 'lora:'")
    candidates = _as_int(ctx, *get("candidates"), shot_id, "candidates", 1, MAX_CANDIDATES)
    size, line = get("size")
    try:
        width, height = parse_size(size)
    except ValueError as e:
        raise ctx.fail(line, shot_id, "size", str(e)) from None
    seed, line = get("seed")
    seed = _default_seed(shot_id) if seed is None else _as_int(ctx, seed, line, shot_id, "seed", 0, MAX_SEED)
    steps = _as_int(ctx, *get("steps"), shot_id, "steps", 1, MAX_STEPS)
    guidance = _as_float(ctx, *get("guidance"), shot_id, "guidance", 0.0, 30.0)
    sampler, line = get("sampler")
    sampler = _as_str(ctx, sampler, line, shot_id, "sampler", empty_ok=False)
    if sampler not in SAMPLERS:
        raise ctx.fail(line, shot_id, "sampler", f"unknown sampler {short_repr(sampler)} (known: {', '.join(SAMPLERS)})"
                       f"{did_you_mean(sampler, SAMPLERS)}")
    control, line = get("control")
    if control is not None:
        control = _resolve_control(ctx, control, line, shot_id, job_dir, has_controlnet)
    cfg_cutoff, line = get("cfg_cutoff")
    cfg_cutoff = 1.0 if cfg_cutoff is None else _as_float(ctx, cfg_cutoff, line, shot_id, "cfg_cutoff", 0.0, 1.0)
    deepcache = _deepcache(ctx, *get("deepcache"), shot_id)
    return Shot(shot_id, prompt, negative, candidates, width, height, seed, steps, guidance, sampler, control, raw.line,
                loras=lora_scales, cfg_cutoff=cfg_cutoff, deepcache=deepcache)


def _deepcache(ctx: _Ctx, raw: Any, line: int | None, shot_id: str) -> DeepCache:
    """`deepcache: {interval: N, branch: K}` (branch 0 when left out); `off`, `false` or nothing: off."""
    if raw is None or raw is False:
        return NO_DEEPCACHE
    if not isinstance(raw, _Located):
        raise ctx.fail(line, shot_id, "deepcache", f"must be a mapping like {{interval: 3, branch: 0}}, or off; "
                       f"got {_type_name(raw)} ({short_repr(raw)})")
    _check_keys(ctx, raw, DEEPCACHE_KEYS, shot_id, prefix="deepcache.")
    if "interval" not in raw:
        raise ctx.fail(raw.line, shot_id, "deepcache.interval", "missing (the full UNet runs every N-th step)")
    interval = _as_int(ctx, raw["interval"], _line_of(raw, "interval"), shot_id, "deepcache.interval", 2,
                       MAX_INTERVAL)
    branch = _as_int(ctx, raw.get("branch", 0), _line_of(raw, "branch", raw.line), shot_id, "deepcache.branch", 0,
                     MAX_BRANCH)
    return DeepCache(interval, branch)


def as_draft(job: Job) -> Job:
    """The job as `bcg render --draft` renders it: every shot with the draft levers, marked as a draft; a
    ControlNet ends where the guidance does (or earlier, where the shot says so)."""
    def draft(s: Shot) -> Shot:
        end = guided_steps(s.steps, DRAFT_CUTOFF) / s.steps
        control = s.control and replace(s.control, end=min(s.control.end, end))
        return replace(s, cfg_cutoff=DRAFT_CUTOFF, deepcache=DRAFT_DEEPCACHE, draft=True, control=control)

    return replace(job, shots=tuple(draft(s) for s in job.shots))


def _known_lora(ctx: _Ctx, name: Any, line: int | None, shot_id: str, field: str, loras: dict[str, LoraFile]) -> str:
    if isinstance(name, str) and name in loras:
        return name
    if not loras:
        raise ctx.fail(line, shot_id, field, f"unknown LoRA {short_repr(name)}: the job has no top-level 'loras:' "
                       f"(name: file.safetensors)")
    raise ctx.fail(line, shot_id, field, f"unknown LoRA {short_repr(name)} (the job's loras: {clip(', '.join(loras))})"
                   f"{did_you_mean(str(name), loras)}")


def _shot_loras(ctx: _Ctx, prompt: str, prompt_line: int | None, raw: Any, line: int | None, shot_id: str,
                loras: dict[str, LoraFile]) -> tuple[str, tuple[tuple[str, float], ...]]:
    """The shot's `lora:` mapping and the prompt's A1111 `<lora:name:scale>` tags, merged: (the prompt
    without its tags, ((name, scale), ...) sorted, zero scales left out). Both ways give the same image."""
    lo, hi = SCALE_RANGE
    scales: dict[str, float] = {}
    if raw is not None:
        if not isinstance(raw, dict):
            raise ctx.fail(line, shot_id, "lora", f"must be a mapping of LoRA name: scale, like {{mei: 0.8}}, "
                           f"got {_type_name(raw)}")
        for name, scale in raw.items():
            name_line = _line_of(raw, name, line)
            name = _known_lora(ctx, name, name_line, shot_id, "lora", loras)
            scales[name] = _as_float(ctx, scale, name_line, shot_id, f"lora.{name}", lo, hi)
    try:
        text, tags = split_lora_tags(prompt)
    except ValueError as e:  # it quotes the tag, which may be most of a long prompt
        raise ctx.fail(prompt_line, shot_id, "prompt", clip(str(e), 2 * MESSAGE_VALUE)) from None
    for name, scale in tags:
        tag = f"<lora:{name}:{scale:g}>"
        _known_lora(ctx, name, prompt_line, shot_id, "prompt", loras)
        if not lo <= scale <= hi:
            raise ctx.fail(prompt_line, shot_id, "prompt", f"{tag}: the weight must be between {lo:g} and {hi:g}")
        if scales.get(name, scale) != scale:
            raise ctx.fail(prompt_line, shot_id, "prompt", f"{tag} disagrees with the scale {scales[name]:g} "
                           f"given for '{name}' (in 'lora:' or another tag); give it once")
        scales[name] = scale
    if tags and not text.strip():
        raise ctx.fail(prompt_line, shot_id, "prompt", "nothing is left once its <lora:...> tags are removed")
    return text, tuple(sorted((n, s) for n, s in scales.items() if s != 0))


def _resolve_loras(ctx: _Ctx, raw: Any, line: int | None, job_dir: Path, model: str) -> dict[str, LoraFile]:
    """The top-level `loras: {name: file.safetensors}`: every file read (header and hash, no torch) and
    checked against the job's model, so `bcg plan` finds a bad one before any model loads."""
    if raw is None:
        return {}
    if not isinstance(raw, _Located):
        raise ctx.fail(line, None, "loras", f"must be a mapping of name: file.safetensors, got {_type_name(raw)}")
    out = {}
    for name, rel in raw.items():
        name_line = _line_of(raw, name, line)
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ctx.fail(name_line, None, f"loras.{name}", f"a LoRA name {SAFE_NAME_RULE}")
        field_name = f"loras.{name}"
        rel = _as_str(ctx, rel, name_line, None, field_name, empty_ok=False)
        path, shown = ctx.input_file(rel, job_dir, name_line, None, field_name, is_file=False)
        problem = lora_problem(path, model)
        if problem:
            raise ctx.fail(name_line, None, field_name, problem.replace(path.name, Path(shown).name))
        info = inspect_lora(path)
        out[name] = LoraFile(name, path, shown, info.hash, info.shorthash, info.text_encoders)
    return out


def _declared_inputs(ctx: _Ctx, raw: Any, line: int | None) -> None:
    """The job's `inputs: {name as the job writes it: sha256}` (what `bcg submit` uploaded), added to what the
    caller knows; the caller's digest wins where both name a file."""
    if raw is None:
        return
    if not isinstance(raw, _Located):
        raise ctx.fail(line, None, INPUTS_KEY, f"must be a mapping of file name: sha256, got {_type_name(raw)}")
    if ctx.inputs is None:
        ctx.inputs = Inputs()
    for name, digest in raw.items():
        name_line = _line_of(raw, name, line)
        if not isinstance(name, str) or not name.strip():
            raise ctx.fail(name_line, None, INPUTS_KEY, "each key must be a file name as the job writes it")
        if not is_digest(digest):
            raise ctx.fail(name_line, None, f"{INPUTS_KEY}.{name[:80]}", f"must be {DIGEST_RULE}")
        ctx.inputs.digests.setdefault(name, digest)


def _resolve_control(ctx: _Ctx, raw: Any, line: int | None, shot_id: str, job_dir: Path,
                     has_controlnet: bool) -> ShotControl:
    if not isinstance(raw, _Located):
        raise ctx.fail(line, shot_id, "control", f"must be a mapping with 'image' and 'scale', got {_type_name(raw)}")
    _check_keys(ctx, raw, CONTROL_KEYS, shot_id, prefix="control.")
    if not has_controlnet:
        raise ctx.fail(line, shot_id, "control", "the job sets no top-level 'controlnet' model")
    image_line = _line_of(raw, "image", line)
    if "image" not in raw:
        raise ctx.fail(raw.line, shot_id, "control.image", "missing")
    rel = _as_str(ctx, raw["image"], image_line, shot_id, "control.image", empty_ok=False)
    path, shown = ctx.input_file(rel, job_dir, image_line, shot_id, "control.image")
    if path not in ctx.images_checked:
        _check_image(ctx, path, image_line, shot_id, shown)
        ctx.images_checked.add(path)
    scale = _as_float(ctx, raw.get("scale", 1.0), _line_of(raw, "scale", line), shot_id, "control.scale", 0.0, 2.0)
    end_line = _line_of(raw, "end", line)
    end = _as_float(ctx, raw.get("end", 1.0), end_line, shot_id, "control.end", 0.0, 1.0)
    if end <= 0:
        raise ctx.fail(end_line, shot_id, "control.end", "must be above 0 (the fraction of the steps the ControlNet "
                                                         "runs; leave out `control` for none)")
    return ShotControl(path, scale, shown, end)


def _check_image(ctx: _Ctx, path: Path, line: int | None, shot_id: str, shown: str) -> None:
    """Decodes every pixel, so a truncated file or a broken PNG stream fails here, before any model loads,
    not in the middle of a render; the bytes read are hashed for the skip check on the way."""
    from PIL import Image, UnidentifiedImageError

    def bad(why: str) -> JobError:
        return ctx.fail(line, shot_id, "control.image", f"not a readable image: {shown} ({why})")

    try:
        data = path.read_bytes()
    except OSError as e:
        raise bad(e.strerror or e.__class__.__name__) from None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                pixels = im.width * im.height
        if any(issubclass(w.category, Image.DecompressionBombWarning) for w in caught):
            # said once, in our words (the process ignores PIL's own warning: cli.main)
            log.warning("control image %s is %.0f megapixels: each shot resizes it to its own size; a smaller "
                        "file loads faster", shown, pixels / 1e6)
    except Image.DecompressionBombError as e:
        raise bad(f"too many pixels: {e}") from None
    except UnidentifiedImageError:
        raise bad("empty file" if not data else "not a PNG, JPEG, WebP or other image file this can read") from None
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error) as e:
        raise bad(one_line(e, 120)) from None
    remember_sha256(path, data)


def _top_field(ctx: _Ctx, doc: _Located, key: str, *, required: bool = False) -> tuple[Any, int | None]:
    line = _line_of(doc, key)
    if key not in doc or doc[key] is None:
        if required:
            raise ctx.fail(doc.line, None, key, "missing")
        return None, line
    return doc[key], line


def _first_content_line(path: Path) -> int:
    lines = path.read_text(encoding="utf-8").splitlines()
    return next((i + 1 for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), 1)


def load_job(path: str | Path, roots: tuple[Path, ...] | None = None, inputs: Inputs | None = None) -> Job:
    """Reads and validates a job file. Raises JobError (exit code 2) on any problem. With `roots` (the
    render service's folders), every file the job names must lie under one of them, or it is refused
    before it is read. With `inputs` (the service and its workers), files the job names by sha256 are read
    from a blob store (job/inputs.py)."""
    path = Path(path).expanduser()
    ctx = _Ctx(str(path), roots, inputs)
    doc = _read_yaml(path)
    if doc is None:
        raise ctx.fail(1, None, None, "the job file is empty")
    if not isinstance(doc, _Located):
        raise ctx.fail(_first_content_line(path), None, None, f"the top level must be a mapping, got {_type_name(doc)}")
    _check_keys(ctx, doc, TOP_KEYS, None)

    version, line = _top_field(ctx, doc, "version", required=True)
    if version != 1 or isinstance(version, bool):
        raise ctx.fail(line, None, "version", f"must be 1, got {short_repr(version)}")
    name, line = _top_field(ctx, doc, "name")
    if name is None:
        name = _name_from_file(ctx, path, doc.line)
    else:
        name = _as_str(ctx, name, line, None, "name", empty_ok=False)
        if not SAFE_NAME.fullmatch(name):
            raise ctx.fail(line, None, "name", f"{SAFE_NAME_RULE} (it names a folder), got {short_repr(name)}")
    model, line = _top_field(ctx, doc, "model", required=True)
    model = _as_str(ctx, model, line, None, "model", empty_ok=False)
    ctx.confine_model(model, line, "model")
    controlnet, line = _top_field(ctx, doc, "controlnet")
    if controlnet is not None:
        controlnet = _as_str(ctx, controlnet, line, None, "controlnet", empty_ok=False)
        ctx.confine_model(controlnet, line, "controlnet")
    output_dir, line = _top_field(ctx, doc, "output_dir")
    output_dir = Path("outputs") / name if output_dir is None else _output_dir(ctx, output_dir, line)
    ctx.confine(path.resolve().parent / output_dir, line, None, "output_dir", clip(str(output_dir)))

    buckets, line = _top_field(ctx, doc, "buckets")
    if buckets is None:
        buckets = DEFAULT_BUCKETS
    else:
        if not isinstance(buckets, list) or not buckets:
            raise ctx.fail(line, None, "buckets", f"must be a non-empty list of batch sizes, got {short_repr(buckets)}")
        buckets = tuple(sorted({_as_int(ctx, b, line, None, "buckets", 1, MAX_BUCKET) for b in buckets}))

    defaults, line = _top_field(ctx, doc, "defaults")
    if defaults is None:
        defaults = _Located()
        defaults.line, defaults.lines = doc.line, {}
    elif not isinstance(defaults, _Located):
        raise ctx.fail(line, None, "defaults", f"must be a mapping, got {_type_name(defaults)}")
    else:
        _check_keys(ctx, defaults, tuple(k for k in SHOT_KEYS if k != "id"), None, prefix="defaults.")

    job_dir = path.resolve().parent
    _declared_inputs(ctx, *_top_field(ctx, doc, INPUTS_KEY))
    loras = _resolve_loras(ctx, *_top_field(ctx, doc, "loras"), job_dir, model)

    shots_raw, line = _top_field(ctx, doc, "shots", required=True)
    if not isinstance(shots_raw, list):
        raise ctx.fail(line, None, "shots", f"must be a list of shots, got {_type_name(shots_raw)}")
    if not shots_raw:
        raise ctx.fail(line, None, "shots", "the job has no shots")
    shots: list[Shot] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(shots_raw):
        shot = _resolve_shot(ctx, raw, i, defaults, job_dir, controlnet is not None, line, loras)
        folded = shot.id.lower()  # case-insensitive file systems would merge 'A' and 'a'
        if folded in seen:
            raise ctx.fail(_line_of(raw, "id"), shot.id, "id",
                           f"duplicate shot id (first used on line {seen[folded]})")
        seen[folded] = _line_of(raw, "id") or 0
        shots.append(shot)
    return Job(path, name, model, controlnet, output_dir, buckets, tuple(shots), loras)


def _output_dir(ctx: _Ctx, raw: Any, line: int | None) -> Path:
    """The job's `output_dir:`, `~` expanded as the model path is."""
    text = _as_str(ctx, raw, line, None, "output_dir", empty_ok=False)
    if len(text) > MAX_PATH:
        raise ctx.fail(line, None, "output_dir", f"is {len(text)} characters long; a path has at most {MAX_PATH}")
    folder = expanded(text)
    if folder is None:
        raise ctx.fail(line, None, "output_dir", f"{clip(text)}: {clip(text.split('/')[0])} names no user of "
                       f"this machine")
    return folder


def _name_from_file(ctx: _Ctx, path: Path, line: int) -> str:
    """A job without `name:` is named after its file, made safe for a folder name: `ep 1 (v2).yaml` -> `ep-1-v2`,
    `épisode.yaml` -> `episode` (accents dropped, as NFKD decomposes them)."""
    ascii_stem = unicodedata.normalize("NFKD", path.stem).encode("ascii", "ignore").decode()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", ascii_stem).lstrip("-_.").rstrip("-")[:64]
    if not name:
        raise ctx.fail(line, None, None, f"the file name {path.name!r} cannot name the output folder: "
                       f"add a top-level 'name:' ({SAFE_NAME_RULE})")
    return name


def named_files(path: Path) -> list[str]:
    """The files a job names (its LoRA files, its shots' and defaults' control images), as it writes them, in
    file order, without validating the rest: what `bcg submit` uploads. Raises JobError for a file that is not
    YAML."""
    doc = _read_yaml(Path(path))
    if not isinstance(doc, dict):
        return []
    names: list[str] = []
    loras = doc.get("loras")
    if isinstance(loras, dict):
        names += [v for v in loras.values() if isinstance(v, str)]
    defaults = doc.get("defaults")
    shots = doc.get("shots")
    for holder in ([defaults] if isinstance(defaults, dict) else []) + (shots if isinstance(shots, list) else []):
        control = holder.get("control") if isinstance(holder, dict) else None
        if isinstance(control, dict) and isinstance(control.get("image"), str):
            names.append(control["image"])
    return list(dict.fromkeys(n for n in names if n.strip()))
