"""The reader base class: every format reads its own metadata, then the same checks run once for all formats."""

from __future__ import annotations

from typing import ClassVar

from .. import dtypes, storage
from ..errors import FormatError
from ..index import CheckpointIndex, TensorEntry, check_tiling
from ..jsonsafe import check_strings


class BaseReader:
    """A checkpoint reader. Subclasses set `format`, implement `read` and, to be detected, `sniff`."""

    format: ClassVar[str] = ""
    #: how specific `sniff` is; `detect` takes the most specific format that says yes, so a layout built on another
    #: format's files (DeepSpeed universal over DeepSpeed ZeRO over a torch file, Lightning over DCP) wins over it:
    #: 0 a generic file format, 1 a framework's folder layout, 2 a layout built on top of another one
    specificity: ClassVar[int] = 0

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        self.uri = uri
        self.reader = reader
        self.check_where = uri  # the file or folder the shared checks name in their errors

    @classmethod
    def sniff(cls, uri: str, names: list[str] | None) -> bool:
        """Whether `uri` holds this format: `names` lists a folder, or is None when `uri` is a file."""
        return cls.sniff_file(uri) if names is None else cls.sniff_folder(uri, names)

    @classmethod
    def sniff_file(cls, uri: str) -> bool:
        """Whether the file `uri` is a checkpoint of this format (no format is a single file unless it says)."""
        return False

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        """Whether the folder `uri`, holding `names`, is a checkpoint of this format."""
        return False

    def read(self, locate: bool = True) -> CheckpointIndex:
        raise NotImplementedError

    def index(self, locate: bool = True) -> CheckpointIndex:
        """The checkpoint's index, checked the same way for every format."""
        index = self.read(locate)
        check_index(index, self.check_where, located=locate)
        return index


def check_index(index: CheckpointIndex, where: str, located: bool = True) -> None:
    """Names are strings, every string is valid text, no name is both a tensor and a value, every tensor's chunks
    tile its shape once and, once located, each chunk's byte range is exactly the size its dtype and shape (and
    strides) need."""
    for name in index.names():
        if not isinstance(name, str) or not name:
            raise FormatError(f"{where}: entry name {name!r} is not a non-empty string; the checkpoint is damaged",
                              uri=where)
    check_text(index, where)
    both = sorted(set(index.tensors) & set(index.objects))
    if both:
        raise FormatError(f"{where}: {both[0]!r} is both a tensor and a value; the checkpoint is damaged",
                          uri=where, key=both[0])
    for entry in index.tensors.values():
        check_tiling(entry, where)
        if located:
            check_sizes(entry, where)


def check_text(index: CheckpointIndex, where: str) -> None:
    """Every name, key path, file name, note and value string of the index is valid UTF-8 text: a lone surrogate
    (a pickle string or a JSON `\\ud800` escape) could be neither shown, stored nor written to any output."""
    paths = [e.path for e in index.tensors.values()] + [e.path for e in index.objects.values()]
    check_strings([index.names(), paths, index.files, index.notes, index.producer,
                   dict(index.stacked)], where, "an entry name, key or file name")
    for obj in index.objects.values():
        check_strings(obj.value, where, f"the value of {obj.name!r}")


def check_sizes(entry: TensorEntry, where: str) -> None:
    item = dtypes.itemsize(entry.dtype)
    for chunk in entry.chunks:
        data = chunk.data
        if data.record:  # checked when it is located
            continue
        need = item * (dtypes.numel(chunk.sizes) if data.stride is None else dtypes.strided_span(chunk.sizes,
                                                                                                   data.stride))
        if data.length != need:
            raise FormatError(f"{data.uri}: chunk {chunk.offsets} of {entry.name!r} holds {data.length} bytes, but "
                              f"{entry.dtype}{list(chunk.sizes)} needs {need}; the checkpoint is damaged",
                              uri=data.uri, key=entry.name)
