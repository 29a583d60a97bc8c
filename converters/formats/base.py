"""The reader base class: every format reads its own metadata, then the same checks run once for all formats."""

from __future__ import annotations

from typing import ClassVar

from .. import storage
from ..errors import FormatError
from ..index import CheckpointIndex, check_tiling


class BaseReader:
    """A checkpoint reader. Subclasses set `format`, implement `read` and, to be detected, `sniff`."""

    format: ClassVar[str] = ""

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        self.uri = uri
        self.reader = reader
        self.check_where = uri  # the file or folder the shared checks name in their errors

    @classmethod
    def sniff(cls, uri: str, names: list[str] | None) -> bool:
        """Whether `uri` holds this format: `names` lists a folder, or is None when `uri` is a file."""
        return False

    def read(self, locate: bool = True) -> CheckpointIndex:
        raise NotImplementedError

    def index(self, locate: bool = True) -> CheckpointIndex:
        """The checkpoint's index, checked the same way for every format."""
        index = self.read(locate)
        check_index(index, self.check_where)
        return index


def check_index(index: CheckpointIndex, where: str) -> None:
    """Names are strings, no name is both a tensor and a value, every tensor's chunks tile its shape once."""
    for name in index.names():
        if not isinstance(name, str) or not name:
            raise FormatError(f"{where}: entry name {name!r} is not a non-empty string; the checkpoint is damaged",
                              uri=where)
    both = sorted(set(index.tensors) & set(index.objects))
    if both:
        raise FormatError(f"{where}: {both[0]!r} is both a tensor and a value; the checkpoint is damaged",
                          uri=where, key=both[0])
    for entry in index.tensors.values():
        check_tiling(entry, where)
