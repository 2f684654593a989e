"""The job file's YAML, read with the line of every mapping and key (`Located`), its size bounded before anything
is constructed (aliases, merge keys, integers: `MAX_ALIAS_VALUES`, `MAX_INT_TEXT`), every error a one-line JobError
at file:line, shot and field; and the short forms of values that messages quote (`clip`, `short_repr`). No torch."""

from __future__ import annotations

import datetime
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml

from storyboard_cli.errors import JobError

# a shot's id: the job file holds every id to it; the loader names a shot by it where it is a valid one
SHOT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # always fullmatch: '$' lets a trailing newline in


class Located(dict):
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

    def repr_Located(self, x: Located, level: int) -> str:  # noqa: N802 (reprlib's dispatch by type name)
        return self.repr_dict(x, level)

    # what YAML wrote, in its own words: no Python spelling reaches a message
    def repr_NoneType(self, x: None, level: int) -> str:  # noqa: N802
        return "null"

    def repr_bool(self, x: bool, level: int) -> str:
        return "true" if x else "false"

    def repr_bytes(self, x: bytes, level: int) -> str:
        return f"<{len(x)} bytes of binary data>"

    def repr_date(self, x: datetime.date, level: int) -> str:
        return x.isoformat()

    def repr_datetime(self, x: datetime.datetime, level: int) -> str:
        return x.isoformat(sep=" ")

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


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> Located:
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
    out = Located()
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


def read_yaml(path: Path) -> Any:
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
