"""JSON documents and short text fields read from checkpoints, parsed with limits on size, depth and text.

Every JSON or text file a reader takes from a checkpoint comes through here, so a hostile one ends as one
`FormatError` naming the file: too big (the metadata cap of `files.read_all`), nested deeper than
`MAX_DEPTH`, not UTF-8, or holding a string that is not valid text (a `\\ud800` escape decodes to a lone
surrogate, which no output format can store). Errors describe what is wrong; they never quote the bytes.
"""

from __future__ import annotations

import json
from json.encoder import INFINITY
from json.encoder import encode_basestring_ascii as _quoted  # the C function
from typing import Any

from . import files
from .errors import FormatError

#: the deepest nesting a checkpoint's JSON may use (safetensors headers and HF indexes use 3)
MAX_DEPTH = 64
#: the most a one-line text field (an iteration number, a tag) may hold
MAX_TEXT_BYTES = 1024


def is_text(value: str) -> bool:
    """Whether `value` is valid Unicode text (encodes as UTF-8: no lone surrogates)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_strings(value: Any, where: str, what: str, max_depth: int | None = None) -> None:
    """Refuse a value (nested dicts, lists, tuples, sets) that holds a string, or a key, that is not valid text,
    or that nests deeper than `max_depth`. Iterative: its cost is the size of `value`, whatever its depth."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, str):
            if not is_text(node):
                raise FormatError(f"{where}: {what} holds a string that is not valid UTF-8 text (a lone surrogate); "
                                  "the file is damaged or hostile", uri=where)
        elif isinstance(node, dict | list | tuple | set | frozenset):
            if max_depth is not None and depth >= max_depth:
                raise FormatError(f"{where}: {what} is nested more than {max_depth} levels deep; the file is "
                                  "damaged or hostile", uri=where)
            items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            todo.extend((item, depth + 1) for item in items)


def loads(data: bytes | memoryview | str, where: str, what: str = "the JSON document") -> Any:
    """A JSON document from a checkpoint, or a FormatError naming `where` (the file) that describes the fault."""
    try:
        raw = data if isinstance(data, str) else bytes(data)  # bytes: UTF-8 (a BOM allowed), 16 or 32, as json reads
        text = raw if isinstance(raw, str) else raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError:
        raise FormatError(f"{where}: {what} is not Unicode text; the file is damaged", uri=where) from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise FormatError(f"{where}: {what} is nested more than {MAX_DEPTH} levels deep; the file is damaged or "
                          "hostile", uri=where) from None
    except ValueError:
        raise FormatError(f"{where}: {what} is not valid JSON ({len(text)} characters); the file is damaged "
                          "(re-copy or re-export it)", uri=where) from None
    check_strings(doc, where, what, MAX_DEPTH)
    return doc


def read_json(uri: str) -> Any:
    """A JSON metadata file (size-capped, depth-limited, valid text), or a FormatError naming it."""
    return loads(files.read_all(uri), uri)


def read_text(uri: str, what: str) -> str:
    """A one-line text file (`latest`, `latest_checkpointed_iteration.txt`): at most MAX_TEXT_BYTES of UTF-8,
    stripped, or a FormatError naming the file and saying what it should hold (`what`)."""
    size = files.size(uri)
    if size > MAX_TEXT_BYTES:
        raise FormatError(f"{uri}: {size} bytes, but it should hold {what}; the file is damaged", uri=uri)
    data = files.read_all(uri, cap=MAX_TEXT_BYTES)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise FormatError(f"{uri}: {len(data)} bytes that are not UTF-8 text; it should hold {what}",
                          uri=uri) from None


def dumps_indented(value: Any) -> str:
    """`json.dumps(value, indent=2)`, the same text, made by one call per value instead of a generator per level
    that every piece of text passes through (a certificate's manifest: 550 kB of text, 18 to 7 ms). A value that
    `json.dumps` would refuse, or encode by other rules, is handed to it."""
    out: list[str] = []
    try:
        _indented(value, out, "\n")
    except (_Other, RecursionError):
        return json.dumps(value, indent=2)
    return "".join(out)


class _Other(Exception):
    """A value `dumps_indented` leaves to `json.dumps` (not plain JSON data, a key of another type, a cycle)."""


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value == INFINITY:
        return "Infinity"
    if value == -INFINITY:
        return "-Infinity"
    return float.__repr__(value)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, float):
        return _number(key)
    if key is True or key is False or key is None:
        return "true" if key is True else "false" if key is False else "null"
    if isinstance(key, int):
        return int.__repr__(key)
    raise _Other


def _indented(value: Any, out: list[str], newline: str) -> None:  # json's order of checks
    if isinstance(value, str):
        out.append(_quoted(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        out.append(_number(value))
    elif isinstance(value, list | tuple):
        if not value:
            out.append("[]")
            return
        inner = newline + "  "
        lead = "[" + inner
        for item in value:
            out.append(lead)
            _indented(item, out, inner)
            lead = "," + inner
        out.append(newline + "]")
    elif isinstance(value, dict):
        if not value:
            out.append("{}")
            return
        inner = newline + "  "
        lead = "{" + inner
        for key, item in value.items():
            out.append(lead + _quoted(_key(key)) + ": ")
            _indented(item, out, inner)
            lead = "," + inner
        out.append(newline + "}")
    else:
        raise _Other
