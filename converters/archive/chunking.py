"""Where a checkpoint's files are cut into chunks.

Files the engine's index describes are cut at the byte ranges of their tensors (a DCP record, a safetensors
tensor, a torch.save storage): ranges under `SMALL` bytes grouped with their neighbours up to `GROUP` bytes,
ranges longer than `PIECE` cut into fixed pieces from the range's start (an unchanged tensor gives the same
chunks at any offset in the file).
Bytes between ranges, and files the index does not describe, are cut by content (`cdc_cuts`): a window-sum
gear hash over `WINDOW` bytes, vectorised with numpy, cuts where its low bits are zero, between `MIN_CDC` and
`PIECE` bytes apart, so an insertion moves only the chunks around it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..index import CheckpointIndex

PIECE = 4 << 20  # largest chunk
SMALL = 16 << 10  # tensor ranges under this size are grouped with their neighbours ...
GROUP = 64 << 10  # ... up to this size (a group changes when any of its tensors does)
MIN_CDC = 256 << 10
MASK = (1 << 19) - 1  # content-defined cuts: about every MIN_CDC + 512 KiB
WINDOW = 48
BLOCK = 8 << 20  # bytes hashed at a time by cdc_cuts' caller
_GEAR = np.random.default_rng(0x0C4B7).integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)


@dataclass(frozen=True)
class Segment:
    """`length` bytes at `offset` of one file; `itemsize` the element size of the data (1: not known);
    `by_content`: cut by content (not described by the index)."""

    offset: int
    length: int
    itemsize: int = 1
    by_content: bool = False


def tensor_ranges(index: CheckpointIndex, files: dict[str, str]) -> dict[str, list[tuple[int, int, int]]]:
    """Relative file name -> sorted, non-overlapping (offset, length, itemsize) of the tensors in it; `files`
    maps each file's full URI (as the index names it) to its relative name."""
    found: dict[str, list[tuple[int, int, int]]] = {}
    for entry in index.tensors.values():
        try:
            itemsize = dtypes.itemsize(entry.dtype)
        except Exception:  # a dtype the engine sizes differently (sub-byte): the range stays a range
            itemsize = 1
        for chunk in entry.chunks:
            data = chunk.data
            name = files.get(data.uri)
            if name is None:
                continue
            offset, length = data.offset, data.length  # a DCP record: the whole record
            if data.stride is not None or length <= 0:
                continue
            found.setdefault(name, []).append((offset, length, itemsize))
    out: dict[str, list[tuple[int, int, int]]] = {}
    for name, ranges in found.items():
        kept: list[tuple[int, int, int]] = []
        for offset, length, itemsize in sorted(set(ranges)):
            if kept and offset < kept[-1][0] + kept[-1][1]:
                continue  # overlapping ranges (a view of a storage): the first one cuts
            kept.append((offset, length, itemsize))
        out[name] = kept
    return out


def segments(size: int, ranges: list[tuple[int, int, int]]) -> Iterator[Segment]:
    """A file of `size` bytes as segments: its tensor ranges (grouped, then cut into pieces) and the bytes between
    them (to be cut by content)."""
    group: list[Segment] = []

    def flush() -> Iterator[Segment]:
        if group:
            sizes = {s.itemsize for s in group}
            yield Segment(group[0].offset, group[-1].offset + group[-1].length - group[0].offset,
                          sizes.pop() if len(sizes) == 1 else 1)
            group.clear()

    at = 0
    for offset, length, itemsize in ranges:
        if offset + length > size:
            break
        if offset > at:
            yield from flush()
            yield Segment(at, offset - at, 1, True)
        if length >= SMALL:
            yield from flush()
            for start in range(offset, offset + length, PIECE):
                yield Segment(start, min(PIECE, offset + length - start), itemsize)
        else:
            if group and offset + length - group[0].offset > GROUP:
                yield from flush()
            group.append(Segment(offset, length, itemsize))
        at = offset + length
    yield from flush()
    if at < size:
        yield Segment(at, size - at, 1, True)


def cdc_cuts(data: bytes | memoryview, final: bool) -> list[int]:
    """Chunk ends (exclusive offsets into `data`) by content; without `final`, the bytes after the last cut stay
    for the next call (the caller prepends them to the next block)."""
    n = len(data)
    if n == 0:
        return []
    sums = np.cumsum(_GEAR[np.frombuffer(data, np.uint8)], dtype=np.uint32)
    window = sums[WINDOW:] - sums[:-WINDOW] if n > WINDOW else sums[:0]
    candidates = np.flatnonzero((window & MASK) == 0) + WINDOW + 1  # cut after the window's last byte
    del sums, window
    cuts: list[int] = []
    last = 0
    pos = 0
    while True:
        low = last + MIN_CDC
        i = int(np.searchsorted(candidates, low, side="left")) if pos < len(candidates) else len(candidates)
        nxt = int(candidates[i]) if i < len(candidates) else None
        if nxt is not None and nxt - last <= PIECE:
            cuts.append(nxt)
            last = nxt
            pos = i + 1
        elif n - last > PIECE:
            last += PIECE
            cuts.append(last)
        else:
            break
    if final and last < n:
        cuts.append(n)
    return cuts
