"""Untrusted bytes to a YAML value, safely: size and node limits, duplicate keys, errors with positions.

A ConfigMap is written by people and by tools; whatever it holds, reading it must end in a value or
in problems, never in an exception, a hang or a memory blow-up. PyYAML's safe loader builds aliases
as shared objects, so an "alias bomb" is cheap to load but exponential to walk: the composed node
graph is measured (aliases expanded) before anything is constructed. PyYAML also keeps the last of
duplicate keys silently; here a duplicate is an error.
"""

from __future__ import annotations

from typing import Any

import yaml

from sharing.config.problems import Report, item, key

MAX_BYTES = 1024 * 1024
"""Kubernetes refuses a ConfigMap whose data exceeds 1 MiB; no single document can be bigger."""
MAX_NODES = 100_000
"""Nodes after expanding aliases; a real config has a few hundred."""
MAX_DEPTH = 64


class _TooBig(Exception):
    pass


class _Loader(yaml.SafeLoader):
    """The safe loader, stopping at MAX_DEPTH while composing (PyYAML recurses once per level)."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooBig(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_document(report: Report, raw: str | bytes) -> tuple[bool, Any]:
    """(True, value) for a readable YAML document, else (False, None) with the problems reported."""
    if len(raw) > MAX_BYTES:
        report.error("", f"the document is {len(raw)} bytes; the limit is {MAX_BYTES} (1 MiB)")
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
        loader = _Loader(text)  # checks the characters already
        node = loader.get_single_node()
        if node is None:
            return True, None
        if not _measure(report, node):
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


def _measure(report: Report, root: yaml.Node) -> bool:
    """Expanded node count and depth within limits, no recursive aliases; duplicate keys reported."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, path: str, depth: int) -> int:
        ident = id(node)
        if ident in sizes:
            return sizes[ident]
        if ident in open_nodes:
            raise _TooBig("an alias refers to a node that contains it (a recursive structure)")
        if depth > MAX_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_DEPTH} levels")
        open_nodes.add(ident)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            for i, child in enumerate(node.value):
                total += size(child, item(path, i), depth + 1)
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
                total += size(k, path, depth + 1) + size(v, child_path, depth + 1)
        if total > MAX_NODES:
            raise _TooBig(f"more than {MAX_NODES} nodes once aliases are expanded")
        open_nodes.discard(ident)
        sizes[ident] = total
        return total

    errors = len(report.errors)
    try:
        size(root, "", 0)
    except _TooBig as err:
        report.error("", f"the document is too complex: {err}")
        return False
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
