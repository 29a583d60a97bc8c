"""Writing the adapter exports' safetensors files: each output tensor is either a plain copy of a stored tensor
(cast or not), which takes the copier's ordinary path (locally: `copy_file_range` when uncast, several at once in
a thread pool), or computed (a merged LoRA weight), whose slabs are written at their offsets meanwhile."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass

from .. import dtypes
from ..config import ContextPool
from ..copier import Copier, pwrite_all
from ..errors import FormatError
from ..index import TensorEntry
from ..output import Output
from ..writers.safetensors import Planned, header_bytes

Blocks = Callable[[], Iterator[memoryview]]


@dataclass
class Item:
    """One output tensor: a copy of `entry` (cast to `dtype`), or the slabs `blocks` yields (each valid until the
    one after next is asked for)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    entry: TensorEntry | None = None
    blocks: Blocks | None = None

    @property
    def nbytes(self) -> int:
        return dtypes.numel(self.shape) * dtypes.itemsize(self.dtype)


def copied(name: str, entry: TensorEntry, cast_to: str | None) -> Item:
    """`entry` as it is, or cast to `cast_to` when it is floating."""
    dtype = cast_to if cast_to and entry.dtype in dtypes.FLOATING else entry.dtype
    return Item(name, dtype, entry.shape, entry=entry)


def _stream(copier: Copier, item: Item) -> Iterator[memoryview]:
    if item.blocks is not None:
        return item.blocks()
    assert item.entry is not None
    return copier.stream(item.entry, item.dtype)


def _checked(item: Item, blocks: Iterator[memoryview]) -> Iterator[memoryview]:
    written = 0
    for block in blocks:
        written += len(block)
        yield block
    if written != item.nbytes:  # a merge that produced the wrong size would corrupt the file
        raise FormatError(f"{item.name}: produced {written} bytes, expected {item.nbytes}", key=item.name)


def _write_pipelined(writer: ContextPool, fd: int, offset: int, item: Item, blocks: Iterator[memoryview]) -> None:
    """Write each block at its offset in `writer`'s thread while the next is computed: a computed item's block
    stays valid until the one after next is asked for, so a write is waited for before that."""
    pending: deque[Future[None]] = deque()
    try:
        for block in _checked(item, blocks):
            pending.append(writer.submit(pwrite_all, fd, block, offset))
            offset += len(block)
            if len(pending) == 2:
                pending.popleft().result()
    finally:
        for future in pending:
            future.result()


def write_file(out: Output, name: str, items: list[Item], copier: Copier) -> None:
    """One safetensors file of `items` (in safetensors' order). Locally the copies run in the copier's threads
    while the computed tensors are written by this one; remotely every tensor streams in order."""
    items = sorted(items, key=lambda item: dtypes.safetensors_order(item.dtype, item.name))
    planned = [Planned(item.name, TensorEntry(item.name, item.dtype, item.shape, []), item.dtype) for item in items]
    header = header_bytes(planned, {"format": "pt"})
    if not out.local:
        with out.open(name) as fh:
            fh.write(header)
            for item in items:
                for block in _checked(item, _stream(copier, item)):
                    fh.write(block)
        return
    offsets, at = [], len(header)
    for item in items:
        offsets.append(at)
        at += item.nbytes
    path = out.path(name)
    with open(path, "wb") as fh, ContextPool(copier.threads, thread_name_prefix="ckpt-merge") as pool:
        fd = fh.fileno()
        pwrite_all(fd, header, 0)
        futures: list[Future[int]] = [pool.submit(copier.write_at, fd, offset, item.entry, item.dtype)
                                      for offset, item in zip(offsets, items) if item.entry is not None]
        try:
            with ContextPool(1, thread_name_prefix="ckpt-merge-write") as writer:
                for offset, item in zip(offsets, items):
                    if item.entry is None:
                        _write_pipelined(writer, fd, offset, item, _stream(copier, item))
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()
        finally:
            for future in futures:
                future.cancel()
            wait(futures)  # no thread writes to fd after it is closed
        os.ftruncate(fd, at)
    out.record(name, at)
