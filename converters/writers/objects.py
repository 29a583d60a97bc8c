"""Non-tensor values: load them safely (allow-list unpickler, no torch import)."""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from ..index import ObjectEntry
from ..rangeread import RangeReader
from ..torchzip import read_archive
from ..unpickle import TensorRef


def load_object(entry: ObjectEntry, reader: RangeReader) -> Any:
    if entry.data is None:
        return entry.value
    archive = read_archive(reader, entry.data.uri, entry.data.offset, entry.data.length,
                           label=f"{entry.data.uri} ({entry.name})")
    if isinstance(archive.obj, TensorRef):
        raise FormatError(f"{entry.data.uri}: {entry.name!r} is stored as bytes but holds a tensor")
    return archive.obj


def writable_object(entry: ObjectEntry, reader: RangeReader) -> Any:
    """The value of `entry`, refused by name if it is anything a writer must not pickle."""
    from .. import picklewriter  # here: reading objects (every command) needs no pickle writer

    value = load_object(entry, reader)
    picklewriter.dumps(value, label=f"entry {entry.name!r}")
    return value
