"""Views of parts of a tensor, and layer unstacking: `decoder.layers.w` of shape (L, ...) -> `decoder.layers.i.w`.

A view is a new `TensorEntry` whose chunks are sub-boxes of the source chunks: each is a byte range of
the same file (strided when the box does not cover whole rows), so no tensor data is read or copied.
"""

from __future__ import annotations

from dataclasses import replace

from . import dtypes
from .errors import FormatError
from .index import ByteRange, CheckpointIndex, Chunk, TensorEntry

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _sub_chunk(chunk: Chunk, box: Box, item: int, drop: int) -> Chunk | None:
    """The part of `chunk` inside `box`, placed relative to the box, its first `drop` dims removed."""
    lo = tuple(max(o, co) for o, co in zip(box[0], chunk.offsets))
    hi = tuple(min(o + s, co + cs) for o, s, co, cs in zip(box[0], box[1], chunk.offsets, chunk.sizes))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    sizes = tuple(h - low for low, h in zip(lo, hi))
    if chunk.data.record:
        raise ValueError(f"{chunk.data.uri}@{chunk.data.offset}: a view needs located chunks (DcpReader.locate_remote)")
    stride = chunk.data.stride or dtypes.row_major(chunk.sizes)
    start = chunk.data.offset + item * sum((low - co) * st for low, co, st in zip(lo, chunk.offsets, stride))
    sizes, stride = sizes[drop:], stride[drop:]
    span = dtypes.strided_span(sizes, stride)
    data = ByteRange(chunk.data.uri, start, span * item, None if dtypes.is_row_major(sizes, stride) else stride)
    if data.stride is None:
        data = replace(data, length=dtypes.numel(sizes) * item)
    offsets = tuple(low - o for low, o in zip(lo, box[0]))[drop:]
    return Chunk(offsets, sizes, data)


def view(entry: TensorEntry, box: Box, name: str, drop: int = 0) -> TensorEntry:
    """`entry[box]` as its own tensor named `name`; `drop` leading dims (of size 1 in the box) are removed."""
    if any(box[1][d] != 1 for d in range(drop)):
        raise ValueError("only size-1 dimensions can be dropped")
    item = dtypes.itemsize(entry.dtype)
    chunks = [c for c in (_sub_chunk(chunk, box, item, drop) for chunk in entry.chunks) if c is not None]
    return TensorEntry(name, entry.dtype, box[1][drop:], chunks)


def unstack(index: CheckpointIndex) -> tuple[CheckpointIndex, list[str]]:
    """Split every layer-stacked tensor into one tensor per layer; leave out `_extra_state` entries."""
    if not index.stacked:
        return index, []
    tensors: dict[str, TensorEntry] = {}
    layers: dict[str, int] = {}
    for name, entry in index.tensors.items():
        prefix = index.stacked.get(name)
        if prefix is None:
            tensors[name] = entry
            continue
        if not entry.shape or not name.startswith(prefix):
            raise FormatError(f"{index.uri}: {name!r} is marked layer-stacked but has no leading layer dimension")
        count = layers.setdefault(prefix, entry.shape[0])
        if entry.shape[0] != count:
            raise FormatError(f"{index.uri}: {name!r} stacks {entry.shape[0]} layers, other tensors under "
                              f"{prefix!r} stack {count}; the checkpoint is damaged")
        rest = name[len(prefix):]
        for i in range(count):
            new = f"{prefix}{i}.{rest}"
            box = ((i, *(0,) * (len(entry.shape) - 1)), (1, *entry.shape[1:]))
            tensors[new] = view(entry, box, new, drop=1)
    extra = [n for n in index.objects if n.rsplit(".", 1)[-1].split("/", 1)[0] == "_extra_state"]
    objects = {n: e for n, e in index.objects.items() if n not in extra}
    report = [f"unstacked {len(index.stacked)} layer-stacked tensors into per-layer names ("
              + ", ".join(f"{p}0..{n - 1}" for p, n in sorted(layers.items())) + ")"]
    if extra:
        report.append(f"left out {len(extra)} _extra_state entries (Transformer Engine / FP8 bookkeeping, "
                      "not weights); convert with `to` torch to keep them")
    return replace(index, tensors=tensors, objects=objects, stacked={}), report


def concat(name: str, parts: list[TensorEntry]) -> TensorEntry:
    """Tensors joined along dim 0 (each part's chunks shifted to its place); no data is read."""
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts):
        raise FormatError(f"cannot join {', '.join(p.name for p in parts)} into {name!r}: shapes or dtypes differ")
    chunks, at = [], 0
    for part in parts:
        chunks += [replace(c, offsets=(c.offsets[0] + at, *c.offsets[1:])) for c in part.chunks]
        at += part.shape[0]
    return TensorEntry(name, first.dtype, (at, *first.shape[1:]), chunks)


def rows(entry: TensorEntry, start: int, count: int, name: str) -> TensorEntry:
    """Rows [start, start + count) of `entry` (dim 0) as a tensor of its own."""
    if start < 0 or start + count > entry.shape[0]:
        raise FormatError(f"{entry.name!r} has {entry.shape[0]} rows, cannot take {start}..{start + count}")
    return view(entry, ((start, *(0,) * (len(entry.shape) - 1)), (count, *entry.shape[1:])), name)
