"""Flat partitions as tensors: a run of elements of a flat 1-D buffer, seen as boxes of a row-major tensor.

Sharded optimizers (DeepSpeed ZeRO) keep each parameter as a run of elements inside flat per-rank
buffers, cut at arbitrary element positions. `flat_boxes` turns such a run into the row-major boxes
of the parameter it covers, each one contiguous in the buffer, so every box is one byte range and the
index model (`Chunk` = box + bytes) describes the parameter without loading a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import dtypes
from ..errors import FormatError
from ..index import ByteRange, Chunk, TensorEntry


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row-major boxes, in order, that cover elements [start, stop) of a tensor of `shape`; each box is a
    contiguous run of elements, so it is one byte range of a flat buffer."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = dtypes.numel(shape[1:])
    rest = (0,) * (len(shape) - 1)
    first, last = start // inner, (stop - 1) // inner
    if first == last and (start % inner or stop % inner):  # inside one row
        base = first * inner
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start - base, stop - base)]
    head = -(-start // inner) * inner  # first row boundary at or after start
    tail = stop // inner * inner  # last row boundary at or before stop
    out = flat_boxes(shape, start, head) if head > start else []
    if tail > head:
        out.append(((head // inner, *rest), ((tail - head) // inner, *shape[1:])))
    return out + (flat_boxes(shape, tail, stop) if stop > tail else [])


@dataclass(frozen=True)
class Flat:
    """A flat 1-D tensor of `dtype` whose bytes are `data`."""

    data: ByteRange
    dtype: str

    @property
    def numel(self) -> int:
        return self.data.length // dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class Piece:
    """`count` elements of `flat`, from its element `start`."""

    flat: Flat
    start: int
    count: int


def locate(flats: list[Flat], start: int, count: int) -> list[Piece]:
    """Pieces for elements [start, start+count) of the concatenation of `flats`."""
    out, base = [], 0
    for flat in flats:
        numel = flat.numel
        lo, hi = max(start, base), min(start + count, base + numel)
        if lo < hi:
            out.append(Piece(flat, lo - base, hi - lo))
        base += numel
    if sum(p.count for p in out) != count:
        raise FormatError(f"elements {start}..{start + count} lie past the end of the flat partitions "
                          f"({base} elements); the checkpoint is damaged or incomplete")
    return out


def entry_of(name: str, shape: tuple[int, ...], pieces: list[Piece], path: tuple[str, ...]) -> TensorEntry:
    """The tensor whose row-major elements are the concatenation of `pieces` (cut to its size)."""
    kinds = {p.flat.dtype for p in pieces}
    if len(kinds) > 1:
        raise FormatError(f"{name}: its partitions are stored in different dtypes ({', '.join(sorted(kinds))}); "
                          "the checkpoint is damaged")
    dtype = kinds.pop() if kinds else "float32"
    item = dtypes.itemsize(dtype)
    numel, pos, chunks = dtypes.numel(shape), 0, []
    for piece in pieces:
        stop = min(pos + piece.count, numel)
        at, data = piece.start, piece.flat.data
        for offsets, sizes in flat_boxes(shape, pos, stop):
            n = dtypes.numel(sizes)
            chunks.append(Chunk(offsets, sizes, ByteRange(data.uri, data.offset + at * item, n * item)))
            at += n
        pos = stop
        if pos >= numel:
            break
    return TensorEntry(name, dtype, shape, chunks, path=path)
