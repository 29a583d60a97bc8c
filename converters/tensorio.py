"""Assemble any box of a global tensor from the chunks that tile it, reading only the bytes it needs.

The fast path (chunks and box both span whole rows, the usual dim-0 sharding) is one ranged read
per overlapping chunk straight into the output buffer. Other layouts (chunks split on another
dimension, strided storage) go through numpy views over the covering rows; nothing is converted
to Python objects element by element.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from . import dtypes
from .index import ByteRange, Chunk, TensorEntry
from .rangeread import MIN_REQUEST, READ_CHUNK, RangeReader
from .uris import is_local

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
_UINT = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}


def _full_rows(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return all(o == 0 and s == d for o, s, d in zip(offsets[1:], sizes[1:], shape[1:]))


def _overlap(a: Box, b: Box) -> Box | None:
    offsets, sizes = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def _row_bytes(sizes: tuple[int, ...], item: int) -> int:
    return dtypes.numel(sizes[1:]) * item


def read_box(reader: RangeReader, entry: TensorEntry, box: Box, out: memoryview) -> None:
    """Fill `out` with the row-major bytes of `entry[box]`."""
    offsets, sizes = box
    item = dtypes.itemsize(entry.dtype)
    if len(out) != dtypes.numel(sizes) * item:
        raise ValueError("output buffer does not match the box")
    if not entry.shape:  # 0-d tensor
        chunk = entry.chunks[0]
        data = located(reader, entry, chunk, len(out))
        reader.readinto(data.uri, data.offset, out)
        if chunk.data.record:
            reader.release(chunk.data.uri, chunk.data.record[0], chunk.data.offset, len(out), len(out))
        return
    box_full = _full_rows(offsets, sizes, entry.shape)
    overlapping = [(chunk, inter) for chunk in entry.chunks
                   if (inter := _overlap(box, (chunk.offsets, chunk.sizes))) is not None]
    direct: list[tuple[str, int, memoryview]] = []  # read side by side (remote chunks: requests in parallel)
    for (chunk, inter), data in zip(overlapping, _located_all(reader, entry, overlapping, item)):
        if box_full and data.stride is None and _full_rows(chunk.offsets, chunk.sizes, entry.shape):
            row = _row_bytes(entry.shape, item)
            src = data.offset + (inter[0][0] - chunk.offsets[0]) * row
            dst = (inter[0][0] - offsets[0]) * row
            direct.append((data.uri, src, out[dst: dst + inter[1][0] * row]))
        else:
            _copy_general(reader, entry, chunk, data, inter, box, out, item)
    reader.readinto_many(direct)
    for chunk, inter in overlapping:
        if chunk.data.record:
            reader.release(chunk.data.uri, chunk.data.record[0], chunk.data.offset, dtypes.numel(inter[1]) * item,
                           chunk.numel * item)


def located(reader: RangeReader, entry: TensorEntry, chunk: Chunk, want: int = 0) -> ByteRange:
    """Where the bytes of `chunk` are: `chunk.data`, or for a DCP record (`ByteRange.record`) the tensor's
    bytes inside it, found once per reader and checked against the index. From object storage, the first
    `want` bytes of the tensor (what the caller reads next) come in the same request as the record's header,
    with the records grouped with it (`group_records`)."""
    data, record = chunk.data, chunk.data.record
    if record is None:
        return data

    def find() -> ByteRange:
        from .torchzip import HEAD_READ, TAIL_READ, record_tensor

        if not is_local(data.uri):
            spans = _record_spans(data, record, HEAD_READ + min(want, READ_CHUNK), TAIL_READ)
            group, _, count = record
            if spans[0][0] == group:  # the group's fetch, once (a lone small record of a group fetches itself)
                reader.once(("group", data.uri, group), lambda: reader.prefetch(data.uri, spans, group, count))
            else:
                reader.prefetch(data.uri, spans, data.offset, 1)
        return record_tensor(reader, data, entry.name, entry.dtype, chunk.sizes)

    return reader.once(("record", data.uri, data.offset), find)


def _record_spans(data: ByteRange, record: tuple[int, int, int], head: int, tail: int) -> list[tuple[int, int]]:
    """The ranges to fetch to locate a tensor in a remote record (`data`, of the group `record`) and read its
    first `head` bytes (headers included): its whole group when that is about one `READ_CHUNK` at most or
    little more lies in it; else, for a large record, the group up to the record's `head` bytes and from its
    last `tail` bytes (the zip directory, which torch's records need: their local headers leave sizes to
    data descriptors) to the group's end; for a small record (of a group with a large one, which comes
    first), the record itself."""
    group, length, _ = record
    head_end, tail_start, end = data.offset + head, data.offset + data.length - tail, group + length
    if length <= GROUP_BYTES + MIN_REQUEST:
        return [(group, length)]
    if data.length < MIN_REQUEST:
        return [(data.offset, data.length)]
    if end - head_end <= MIN_REQUEST or tail_start <= head_end:
        return [(group, length)]
    return [(group, head_end - group), (tail_start, end - tail_start)]


def read_positions(lanes: Sequence[Sequence[tuple[TensorEntry, Box | None]]]) -> dict[tuple[str, int], int]:
    """Where each DCP record (its (uri, offset)) is first read, in bytes read before it in its lane, when each
    lane (a file written front to back; the lanes side by side) reads its (entry, box) pieces in turn."""
    positions: dict[tuple[str, int], int] = {}
    for lane in lanes:
        at = 0
        for entry, box in lane:
            box = box or ((0,) * len(entry.shape), entry.shape)
            for chunk in entry.chunks:
                if chunk.data.record is not None and (not entry.shape or _overlap(box, (chunk.offsets, chunk.sizes))):
                    key = (chunk.data.uri, chunk.data.offset)
                    positions[key] = min(positions.get(key, at), at)
            at += dtypes.numel(box[1]) * dtypes.itemsize(entry.dtype)
    return positions


def group_records(tensors: dict[str, TensorEntry], positions: dict[tuple[str, int], int] | None = None
                  ) -> dict[str, TensorEntry]:
    """`tensors` with the DCP records they are read from grouped, so that reading them from object storage
    costs one request per group: records within one file, back to back (a few bytes of other records between
    at most). A record of at least `MIN_REQUEST` bytes takes the smaller ones right after it (up to the next
    large one or `READ_CHUNK` bytes of small ones; small ones before any large one form groups of their own).
    With `positions` (where each record is first read: `read_positions`), any record also joins the group
    before it while the group stays within `GROUP_BYTES` and the record is read within `GROUP_WINDOW` bytes of
    the group's first, so that a group, fetched when one of its records is first read, is not held for long.
    Only these tensors' records are grouped: a group never fetches bytes that are not read.
    """
    by_file: dict[str, dict[tuple[int, int], int]] = {}
    for entry in tensors.values():
        for chunk in entry.chunks:
            if chunk.data.record is not None:
                read_at = (positions or {}).get((chunk.data.uri, chunk.data.offset), 0)
                by_file.setdefault(chunk.data.uri, {})[(chunk.data.offset, chunk.data.length)] = read_at
    groups: dict[tuple[str, int], tuple[int, int, int]] = {}
    for uri, records in by_file.items():
        runs: list[list[tuple[int, int, int]]] = []
        for (offset, length), read_at in sorted(records.items()):
            run = runs[-1] if runs else None
            if run is None or offset - (run[-1][0] + run[-1][1]) > _GROUP_GAP:
                runs.append([(offset, length, read_at)])
                continue
            small = sum(n for _, n, _ in run if n < MIN_REQUEST)
            joins = length < MIN_REQUEST and small + length <= READ_CHUNK
            if positions is not None and not joins:
                joins = offset + length - run[0][0] <= GROUP_BYTES and abs(read_at - run[0][2]) <= GROUP_WINDOW
            if joins:
                run.append((offset, length, read_at))
            else:
                runs.append([(offset, length, read_at)])
        for run in runs:
            start, stop = run[0][0], run[-1][0] + run[-1][1]
            for offset, _, _ in run:
                groups[(uri, offset)] = (start, stop - start, len(run))
    return {name: replace(entry, chunks=[
        replace(c, data=replace(c.data, record=groups[(c.data.uri, c.data.offset)])) if c.data.record else c
        for c in entry.chunks]) for name, entry in tensors.items()}


_GROUP_GAP = 4096
GROUP_BYTES = 16 * 1024 * 1024  # a group read in order: one request of at most this (the copy part size)
GROUP_WINDOW = 32 * 1024 * 1024  # ... of records read at most this many bytes apart


def _located_all(reader: RangeReader, entry: TensorEntry, overlapping: list[tuple[Chunk, Box]],
                 item: int) -> list[ByteRange]:
    """`located` for each (chunk, the part of it being read), records side by side; a record is fetched with
    its header when the part starts near the tensor's start (else only its header is, and the part after)."""
    def find(pair: tuple[Chunk, Box]) -> ByteRange:
        chunk, inter = pair
        row = _row_bytes(chunk.sizes, item)
        first = (inter[0][0] - chunk.offsets[0]) * row
        return located(reader, entry, chunk, first + inter[1][0] * row if first < MIN_REQUEST else 0)

    records = [chunk.data.uri for chunk, _ in overlapping if chunk.data.record]
    return reader.map(find, overlapping, remote=len(records) > 1 and not all(is_local(uri) for uri in records))


def _copy_general(reader: RangeReader, entry: TensorEntry, chunk: Chunk, data: ByteRange, inter: Box, box: Box,
                  out: memoryview, item: int) -> None:
    """Copy `entry[inter]` from `chunk` (its bytes at `data`) into the box buffer through numpy views."""
    import numpy as np

    utype = _UINT[item]
    first = inter[0][0] - chunk.offsets[0]
    rows = inter[1][0]
    stride = data.stride or dtypes.row_major(chunk.sizes)
    # read the span of storage that holds rows [first, first+rows) of the chunk
    lo = first * stride[0]
    span = dtypes.strided_span((rows, *chunk.sizes[1:]), tuple(stride))
    raw = bytearray(span * item)
    reader.readinto(data.uri, data.offset + lo * item, memoryview(raw))
    src = np.lib.stride_tricks.as_strided(
        np.frombuffer(raw, dtype=utype), shape=(rows, *chunk.sizes[1:]),
        strides=tuple(s * item for s in stride), writeable=False)
    sel = tuple(slice(o - co, o - co + s) for o, s, co in zip(inter[0][1:], inter[1][1:], chunk.offsets[1:]))
    dst = np.frombuffer(out, dtype=utype).reshape(box[1])
    dsel = (slice(inter[0][0] - box[0][0], inter[0][0] - box[0][0] + rows),
            *(slice(o - bo, o - bo + s) for o, s, bo in zip(inter[0][1:], inter[1][1:], box[0][1:])))
    dst[dsel] = src[(slice(None), *sel)]


def slabs(shape: tuple[int, ...], item: int, budget: int) -> Iterator[Box]:
    """Boxes that tile `shape` in row-major order, each at most `budget` bytes where a row allows it."""
    if not shape:
        yield (), ()
        return
    yield from _slabs((), shape, item, budget)


def _slabs(prefix: tuple[int, ...], shape: tuple[int, ...], item: int, budget: int) -> Iterator[Box]:
    depth = len(prefix)
    rest = shape[depth:]
    row = dtypes.numel(rest[1:]) * item
    if rest[0] == 0:
        return
    if row <= budget or len(rest) == 1:
        step = max(1, budget // max(row, 1))
        for start in range(0, rest[0], step):
            n = min(step, rest[0] - start)
            yield (*prefix, start, *(0,) * (len(rest) - 1)), (*(1,) * depth, n, *rest[1:])
        return
    for i in range(rest[0]):
        yield from _slabs((*prefix, i), shape, item, budget)


def cast(data: memoryview | bytes, src: str, dst: str) -> memoryview:
    """Cast raw bytes between floating dtypes, rounding exactly as torch's `.to()` does.

    numpy with ml_dtypes' bfloat16/float8 types does the work (round to nearest even, NaN stays NaN,
    overflow gives inf) in blocks of `_CAST_BLOCK` elements, so temporaries stay small and casting needs
    no torch import. Like torch, float64 goes through float32 on its way to a 16-bit type.
    """
    if not data:
        return memoryview(b"")
    import numpy as np

    types = _numpy_types()
    source = np.frombuffer(data, dtype=types[src])
    out = np.empty(len(source), dtype=types[dst])
    via_f32 = src == "float64" and dtypes.itemsize(dst) < 4
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, len(source), _CAST_BLOCK):
            block = source[i: i + _CAST_BLOCK]
            if via_f32:
                block = block.astype(np.float32)
            np.copyto(out[i: i + _CAST_BLOCK], block, casting="unsafe")
    return out.view(np.uint8).data


_CAST_BLOCK = 1 << 20


def _numpy_types() -> dict[str, Any]:
    import ml_dtypes
    import numpy as np

    return {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
            "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def direct_ranges(entry: TensorEntry, box: Box | None = None) -> list[tuple[str, int, int]] | None:
    """The byte ranges whose concatenation is `entry[box]`, when no reshaping is needed; else None.

    That holds when every chunk is located (not a DCP record still to locate), contiguous storage tiling whole
    rows, and the box spans whole rows.
    """
    if any(chunk.data.record for chunk in entry.chunks):
        return None
    if box is None:
        box = ((0,) * len(entry.shape), entry.shape)
    offsets, sizes = box
    if not entry.shape:
        chunk = entry.chunks[0]
        return [(chunk.data.uri, chunk.data.offset, chunk.data.length)]
    if not _full_rows(offsets, sizes, entry.shape):
        return None
    row = _row_bytes(entry.shape, dtypes.itemsize(entry.dtype))
    out = []
    for chunk in sorted(entry.chunks, key=lambda c: c.offsets[0]):
        if chunk.data.stride is not None or not _full_rows(chunk.offsets, chunk.sizes, entry.shape):
            return None
        inter = _overlap(box, (chunk.offsets, chunk.sizes))
        if inter is None:
            continue
        start = chunk.data.offset + (inter[0][0] - chunk.offsets[0]) * row
        out.append((chunk.data.uri, start, inter[1][0] * row))
    return out


_COMPARE_BLOCK = 8 << 20
COMPARE_SLAB = 4 << 20  # bytes per side and step: larger slabs compare no faster, they only cost memory


def compare_slab(memory_limit: int) -> int:
    """Bytes of each side compared at a time: small, and within a quarter of the memory limit."""
    return max(64 * 1024, min(COMPARE_SLAB, memory_limit // 4))




def same_bytes(a: memoryview, b: memoryview) -> bool:
    """`a == b` at memory speed (comparing memoryviews with `==` goes element by element in Python's C
    code, 25x slower than memcmp), in blocks, so the comparison's temporaries stay small."""
    import numpy as np

    if len(a) != len(b):
        return False
    word = 8 if len(a) % 8 == 0 else 1
    x = np.frombuffer(a, dtype=np.uint64 if word == 8 else np.uint8)
    y = np.frombuffer(b, dtype=x.dtype)
    step = _COMPARE_BLOCK // word
    return all(np.array_equal(x[i: i + step], y[i: i + step]) for i in range(0, len(x), step))
