"""Moves tensor bytes from a source index to an output stream in bounded slabs, casting on the way."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import dtypes
from .index import TensorEntry
from .storage import RangeReader
from .tensorio import Box, cast, read_box, slabs

DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024


@dataclass
class Progress:
    """Counts bytes and tensors done; `callback` (if any) gets the object after each step."""

    total_bytes: int = 0
    total_tensors: int = 0
    done_bytes: int = 0
    done_tensors: int = 0
    callback: Callable[[Progress], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int = 0, tensors: int = 0) -> None:
        with self._lock:
            self.done_bytes += nbytes
            self.done_tensors += tensors
        if self.callback is not None:
            self.callback(self)


class Copier:
    """Streams tensors as raw bytes; never holds more than `slab_bytes` (twice, when casting) per call."""

    def __init__(self, reader: RangeReader, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                 progress: Progress | None = None, workers: int = 1) -> None:
        self.reader = reader
        self.progress = progress or Progress()
        # room for a source slab and its cast copy per worker
        self.slab_bytes = max(64 * 1024, memory_limit // (3 * max(1, workers)))

    def out_dtype(self, entry: TensorEntry, cast_to: str | None) -> str:
        if cast_to and entry.dtype in dtypes.FLOATING and entry.dtype != cast_to:
            return cast_to
        return entry.dtype

    def stream(self, entry: TensorEntry, cast_to: str | None = None, box: Box | None = None
               ) -> Iterator[memoryview]:
        """Yield the row-major bytes of `entry` (or of `entry[box]`), cast to `cast_to` if it is floating."""
        out_dtype = self.out_dtype(entry, cast_to)
        item = dtypes.itemsize(entry.dtype)
        base, shape = box if box is not None else ((0,) * len(entry.shape), entry.shape)
        for offsets, sizes in slabs(shape, item, self.slab_bytes):
            absolute = (tuple(b + o for b, o in zip(base, offsets)), sizes)
            buf = bytearray(dtypes.numel(sizes) * item)
            view = memoryview(buf)
            read_box(self.reader, entry, absolute, view)
            self.progress.add(len(buf))
            yield cast(view, entry.dtype, out_dtype) if out_dtype != entry.dtype else view
        self.progress.add(tensors=1)
