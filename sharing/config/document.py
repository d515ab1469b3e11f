"""Untrusted bytes to a YAML value, safely: size and node limits, duplicate keys, errors with positions.

A ConfigMap is written by people and by tools; whatever it holds, reading it must end in a value or
in problems, never in an exception, a hang or a memory blow-up. The limits are checked before
anything is built: the byte size, then a stream of the parser's events (libyaml's when PyYAML has
it) counted against the node and depth limits, with aliases expanded (PyYAML builds aliases as
shared objects, so an "alias bomb" is cheap to load but exponential to walk). Building one graph of
PyYAML nodes costs about 0.7 KB per node: 480,000 list items took an agent past 256 MiB. PyYAML also
keeps the last of duplicate keys silently; here a duplicate is an error.
"""

from __future__ import annotations

from typing import Any

import yaml

from sharing.config.problems import Report, item, key

MAX_BYTES = 1024 * 1024
"""Kubernetes refuses a ConfigMap whose data exceeds 1 MiB; no single document can be bigger."""
MAX_CONFIG_BYTES = 256 * 1024
"""One config (one ConfigMap key); NVIDIA's default mig-parted file, 81 configs, is 12 KB."""
MAX_NODES = 20_000
"""Nodes after expanding aliases; a real config has a few hundred (NVIDIA's default file 1,123)."""
MAX_DEPTH = 64

_FAST = getattr(yaml, "CSafeLoader", None)
"""libyaml's parser and composer, when PyYAML was built with it (its wheels are)."""


class _TooBig(Exception):
    pass


class _Loader(yaml.SafeLoader):
    """The pure-Python safe loader, for exact error positions; stops at MAX_NODES and MAX_DEPTH while
    composing too, should libyaml and PyYAML ever read a document differently."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooBig(f"nested deeper than {MAX_DEPTH} levels")
            if self._nodes > MAX_NODES:
                raise _TooBig(f"more than {MAX_NODES} nodes")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _scan(text: str, loader: type[Any]) -> None:
    """Stream the parser's events and raise _TooBig at the first past a limit; nothing is built."""
    frames: list[tuple[int, int, str | None]] = []  # per open collection: nodes before it, level, anchor
    deepest: list[int] = []  # per open collection: the deepest level reached inside it
    anchored: dict[str, tuple[int, int]] = {}  # per anchor: expanded nodes, levels below it
    total = 0
    for event in yaml.parse(text, Loader=loader):
        level = len(frames)
        if isinstance(event, yaml.CollectionEndEvent):
            before, start, anchor = frames.pop()
            low = deepest.pop()
            if anchor is not None:
                anchored[anchor] = (total - before, low - start)
            if deepest:
                deepest[-1] = max(deepest[-1], low)
            continue
        if isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for _, _, anchor in frames):
                raise _TooBig("an alias refers to a node that contains it (a recursive structure)")
            size, below = anchored.get(event.anchor or "", (1, 0))
        elif isinstance(event, yaml.ScalarEvent | yaml.CollectionStartEvent):
            size, below = 1, 0
        else:
            continue
        total += size
        if total > MAX_NODES:
            raise _TooBig(f"more than {MAX_NODES} nodes" + (" once aliases are expanded" if size > 1 else ""))
        if level + below >= MAX_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_DEPTH} levels")
        if deepest:
            deepest[-1] = max(deepest[-1], level + below)
        if isinstance(event, yaml.CollectionStartEvent):
            frames.append((total - 1, level, event.anchor))
            deepest.append(level)
        elif isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
            anchored[event.anchor] = (1, 0)


def load_document(report: Report, raw: str | bytes, limit: int = MAX_BYTES) -> tuple[bool, Any]:
    """(True, value) for a readable YAML document, else (False, None) with the problems reported."""
    if len(raw) > limit:
        what = "one config" if limit == MAX_CONFIG_BYTES else "a document"
        report.error("", f"{len(raw)} bytes; the limit for {what} is {limit} ({limit // 1024} KiB)")
        return False, None
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            report.error("", f"not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start}")
            return False, None
    else:
        text = raw
    loader = None
    try:
        fast = _FAST is not None and _scanned(text, _FAST)
        if not fast:
            _scan(text, yaml.SafeLoader)  # libyaml refused it: PyYAML's own parser says where and why
        loader = _FAST(text) if fast and _FAST is not None else _Loader(text)
        node = loader.get_single_node()
        if node is None:
            return True, None
        if not _duplicates(report, node):
            return False, None
        return True, loader.construct_document(node)
    except _TooBig as err:
        report.error("", f"the document is too complex: {err}")
    except yaml.MarkedYAMLError as err:
        report.error("", _marked(err))
    except yaml.reader.ReaderError as err:
        line, column = _position(text, err.position)
        report.error("", f"invalid YAML at line {line}, column {column}: {_reader_problem(err)}")
    except yaml.YAMLError as err:
        report.error("", f"invalid YAML: {err}")
    except RecursionError:
        report.error("", "invalid YAML: nested too deeply")
    except (ValueError, TypeError, OverflowError) as err:
        # e.g. an integer of more than 4300 digits, a date like 2024-02-30
        report.error("", f"invalid YAML: a value cannot be read: {err}")
    finally:
        if loader is not None:
            loader.dispose()
    return False, None


def _scanned(text: str, loader: type[Any]) -> bool:
    """True when libyaml streams the document within the limits; False when it cannot read it."""
    try:
        _scan(text, loader)
    except yaml.YAMLError:
        return False
    return True


def _marked(err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark or err.context_mark
    problem = err.problem or err.context or "syntax error"
    if err.context and err.problem:
        problem = f"{problem} ({err.context})"
    if mark is None:
        return f"invalid YAML: {problem}"
    return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _reader_problem(err: yaml.reader.ReaderError) -> str:
    if isinstance(err.character, int):
        return f"character #x{err.character:04x} is not allowed ({err.reason})"
    return str(err.reason)


def _position(text: str, offset: int) -> tuple[int, int]:
    before = text[:offset]
    line = before.count("\n") + 1
    return line, offset - (before.rfind("\n") + 1) + 1


def _duplicates(report: Report, root: yaml.Node) -> bool:
    """Duplicate keys reported; False when there are any (the graph is within the limits already)."""
    seen_nodes: set[int] = set()

    def walk(node: yaml.Node, path: str) -> None:
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, child in enumerate(node.value):
                walk(child, item(path, i))
        elif isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for k, v in node.value:
                child_path = path
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    child_path = key(path, k.value)
                    if (k.tag, k.value) in seen:
                        report.error(
                            child_path,
                            f"duplicate key at line {k.start_mark.line + 1}, "
                            f"column {k.start_mark.column + 1}; YAML would keep only the last one",
                        )
                    seen.add((k.tag, k.value))
                walk(k, path)
                walk(v, child_path)

    errors = len(report.errors)
    walk(root, "")
    return len(report.errors) == errors


def describe(value: object) -> str:
    """A value's YAML kind for messages: `a string ("x")`, `a boolean (true)`, `a list`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({short_int(value)})"
    if isinstance(value, float):
        return f"a number ({value})"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({shown!r})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__} value"


def short_int(value: int) -> str:
    """An integer for a message; a huge one is not spelled out (str() of it may even fail)."""
    return str(value) if abs(value) < 10**18 else ("a huge number" if value > 0 else "a huge negative number")
