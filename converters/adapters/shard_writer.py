"""Writing the adapter exports' safetensors files: each output tensor is either a plain copy of a stored tensor
(cast or not), which takes the copier's ordinary path (locally: through a window buffer when uncast, several at once
in a thread pool), or computed (a merged LoRA weight): its slabs, each of known size, are computed and written at
their offsets by two worker threads side by side (torch, the checksums and the writes release the GIL), so both
cores merge. A computed tensor may first be copied into place like any other (locally), and merged there: the copy
(system calls, which release the GIL) runs while torch is still being imported and takes the new pages (the dear
part of writing a file: overwriting them is several times cheaper), and the merge reads its rows back from it.
Locally every tensor's CRC-32 (and the certificate's CRC-32 of every range written) is taken from the bytes as they
are written, so the output need not be read back."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from .. import dtypes
from ..checksum import crc32_combine
from ..config import ContextPool
from ..copier import Copier, pwrite_all, settled
from ..errors import FormatError
from ..index import TensorEntry
from ..output import Output
from ..writers.safetensors import Planned, header_bytes

WORKERS = 2  # threads that compute and write the slabs of computed tensors (this machine: 2 cores)


@dataclass
class Slab:
    """`nbytes` bytes of a computed tensor, in order: `run()` computes them in the calling thread (in its own
    workspace) and returns them, valid until that thread runs its next slab."""

    nbytes: int
    run: Callable[[], memoryview]


@dataclass
class Computed:
    """A computed tensor: its slabs in order, then `done()`, called in the writing thread once every slab has
    been written (what needs them all in order: the certificate's CRC-32 of what they read)."""

    slabs: Iterator[Slab]
    done: Callable[[], None] = field(default=lambda: None)


Where = tuple[int, int]  # a local output file's descriptor, and the offset of a tensor's copy in it


@dataclass
class Item:
    """One output tensor: a copy of `entry` (cast to `dtype`), or what `compute(where)` gives. With both, locally
    `entry` is copied into place first and `compute` is handed where the copy lies (in its output dtype, which is
    `entry`'s) to merge into; else (an upload) it is handed None and reads the source."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    entry: TensorEntry | None = None
    compute: Callable[[Where | None], Computed] | None = None

    @property
    def nbytes(self) -> int:
        return dtypes.numel(self.shape) * dtypes.itemsize(self.dtype)


def copied(name: str, entry: TensorEntry, cast_to: str | None) -> Item:
    """`entry` as it is, or cast to `cast_to` when it is floating."""
    dtype = cast_to if cast_to and entry.dtype in dtypes.FLOATING else entry.dtype
    return Item(name, dtype, entry.shape, entry=entry)


def _size_error(item: Item, produced: int) -> FormatError:
    """A merge that produced the wrong size would corrupt the file."""
    return FormatError(f"{item.name}: produced {produced} bytes, expected {item.nbytes}", key=item.name)


def _computed_blocks(item: Item) -> Iterator[memoryview]:
    """The bytes of a computed `item`, slab after slab in this thread (an upload, written front to back)."""
    assert item.compute is not None
    computed = item.compute(None)
    written = 0
    for slab in computed.slabs:
        block = slab.run()
        if len(block) != slab.nbytes:
            raise _size_error(item, written + len(block))
        written += len(block)
        yield block
    if written != item.nbytes:
        raise _size_error(item, written)
    computed.done()


def _stream(copier: Copier, item: Item) -> Iterator[memoryview]:
    if item.compute is not None:  # computed from the source (its copy, if any, is not made: the file streams)
        return _computed_blocks(item)
    assert item.entry is not None
    return copier.stream(item.entry, item.dtype)


def _write_slab(copier: Copier, fd: int, offset: int, item: Item, slab: Slab) -> int:
    """Compute `slab` and write it at `offset` of `fd` (a worker's task); its CRC-32."""
    block = slab.run()
    if len(block) != slab.nbytes:
        raise _size_error(item, len(block))
    return copier.write_noted(fd, block, offset)


def _write_computed(workers: ContextPool, copier: Copier, fd: int, offset: int, item: Item,
                    copy: Future[int] | None) -> int:
    """The slabs of a computed `item`, computed and written at their offsets by `workers` side by side (at most
    two each in flight, so the slabs ahead are few), into its `copy` once that is in place; its CRC-32, joined
    from theirs in order."""
    assert item.compute is not None
    if copy is not None:
        copy.result()
        if copier.ledger is not None:  # the copy's bytes are overwritten: the merged ones are noted instead
            copier.ledger.unwrite(fd, offset, item.nbytes)
    computed = item.compute(None if copy is None else (fd, offset))
    pending: deque[tuple[Future[int], int]] = deque()
    crc, start, end = 0, offset, offset + item.nbytes
    try:
        for slab in computed.slabs:
            if offset + slab.nbytes > end:
                raise _size_error(item, offset + slab.nbytes - start)
            pending.append((workers.submit(_write_slab, copier, fd, offset, item, slab), slab.nbytes))
            offset += slab.nbytes
            if len(pending) >= 2 * WORKERS:
                future, nbytes = pending.popleft()
                crc = crc32_combine(crc, future.result(), nbytes)
        while pending:
            future, nbytes = pending.popleft()
            crc = crc32_combine(crc, future.result(), nbytes)
    finally:
        wait([future for future, _ in pending])  # no worker still uses what the slabs read when this returns
    if offset != end:
        raise _size_error(item, offset - start)
    computed.done()
    return crc


def write_file(out: Output, name: str, items: list[Item], copier: Copier) -> dict[str, int]:
    """One safetensors file of `items` (in safetensors' order). Locally the copies run in the copier's threads
    while the computed tensors' slabs are computed and written by two workers; returns each tensor's CRC-32
    (the certificate's, taken as written). Remotely every tensor streams in order (no CRC-32s returned)."""
    items = sorted(items, key=lambda item: dtypes.safetensors_order(item.dtype, item.name))
    planned = [Planned(item.name, TensorEntry(item.name, item.dtype, item.shape, []), item.dtype) for item in items]
    header = header_bytes(planned, {"format": "pt"})
    if not out.local:
        with out.open(name) as fh:
            fh.write(header)
            for item in items:
                for block in _stream(copier, item):
                    fh.write(block)
        return {}
    offsets, at = [], len(header)
    for item in items:
        offsets.append(at)
        at += item.nbytes
    path = out.path(name)
    crcs: dict[str, int] = {}
    with open(path, "w+b") as fh, ContextPool(copier.threads, thread_name_prefix="ckpt-merge") as pool:  # w+: read too
        fd = fh.fileno()
        pwrite_all(fd, header, 0)
        copier.note(fd, 0, header)
        futures = {item.name: pool.submit(copier.write_at, fd, offset, item.entry, item.dtype, None, True)
                   for offset, item in zip(offsets, items) if item.entry is not None}
        with settled(futures.values()), ContextPool(WORKERS, thread_name_prefix="ckpt-merge-slab") as workers:
            for offset, item in zip(offsets, items):
                if item.compute is not None:
                    crcs[item.name] = _write_computed(workers, copier, fd, offset, item, futures.get(item.name))
        os.ftruncate(fd, at)
    out.record(name, at)
    crcs.update({tensor: future.result() for tensor, future in futures.items() if tensor not in crcs})
    return {item.name: crcs[item.name] for item in items}
