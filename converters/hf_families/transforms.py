"""The reusable transforms of the mapping table: one Megatron tensor -> the Hugging Face tensors it holds.

Every transform returns views (`converters.stacking`): byte ranges of the checkpoint's chunks, so nothing is
read until the writer copies it and memory stays flat whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import FormatError
from ..index import Chunk, TensorEntry
from ..stacking import concat, rows, view


@dataclass(frozen=True)
class Shape:
    """What a transform needs to know about the model (from its config)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    experts: int = 0
    moe_ffn: int = 0


# a transform: (the Megatron tensor, the model shape, the HF names it becomes) -> one tensor per HF name
Transform = Callable[[TensorEntry, Shape, tuple[str, ...]], list[TensorEntry]]


def _expect(entry: TensorEntry, shape: tuple[int, ...], what: str) -> None:
    if entry.shape != shape:
        raise FormatError(f"{entry.name!r} is {list(entry.shape)}, the config says {list(shape)} ({what}); the "
                          "config does not match the weights")


def identity(entry: TensorEntry, shape: Shape, names: tuple[str, ...]) -> list[TensorEntry]:
    """The same bytes under the HF name."""
    return [TensorEntry(names[0], entry.dtype, entry.shape, entry.chunks)]


def qkv(entry: TensorEntry, shape: Shape, names: tuple[str, ...]) -> list[TensorEntry]:
    """Megatron's fused `linear_qkv` (weight or bias) -> q, k, v. Its rows are grouped per query group
    g = [the q heads of g, k_g, v_g] (GQA; MQA is one group, MHA one head per group)."""
    per_group = shape.heads // shape.groups
    block = (per_group + 2) * shape.head_dim
    _expect(entry, (shape.groups * block, *entry.shape[1:]), "query groups x (q heads + k + v) x head dim rows")
    if len(entry.shape) == 2:
        _expect(entry, (shape.groups * block, shape.hidden), "fused QKV weight")
    q_rows = per_group * shape.head_dim
    parts: list[list[TensorEntry]] = [[], [], []]
    for g in range(shape.groups):
        base = g * block
        parts[0].append(rows(entry, base, q_rows, entry.name))
        parts[1].append(rows(entry, base + q_rows, shape.head_dim, entry.name))
        parts[2].append(rows(entry, base + q_rows + shape.head_dim, shape.head_dim, entry.name))
    return [concat(name, part) for name, part in zip(names, parts)]


def _halves(entry: TensorEntry, half: int, names: tuple[str, ...]) -> list[TensorEntry]:
    _expect(entry, (2 * half, *entry.shape[1:]), "gate and up of the gated MLP, stacked")
    return [rows(entry, 0, half, names[0]), rows(entry, half, half, names[1])]


def gate_up(entry: TensorEntry, shape: Shape, names: tuple[str, ...]) -> list[TensorEntry]:
    """The fused SwiGLU `linear_fc1` = cat([gate, up], 0) -> gate, up."""
    return _halves(entry, shape.ffn, names)


def halves(entry: TensorEntry, shape: Shape, names: tuple[str, ...]) -> list[TensorEntry]:
    """A fused `linear_fc1` of its own size (shared experts) -> its gate, up: the two halves of its rows."""
    if not entry.shape or entry.shape[0] % 2:
        raise FormatError(f"{entry.name!r} is {list(entry.shape)}: not gate and up stacked (an even row count)")
    return _halves(entry, entry.shape[0] // 2, names)


def expert_gate_up(entry: TensorEntry, shape: Shape, names: tuple[str, ...]) -> list[TensorEntry]:
    """One expert's fused `linear_fc1` -> its gate, up (the MoE FFN size)."""
    return _halves(entry, shape.moe_ffn, names)


def expert(entry: TensorEntry, index: int, count: int) -> TensorEntry:
    """Expert `index` of a tensor whose leading axis holds all `count` experts (Megatron-core's torch_dist
    layout of grouped and sequential experts) as a tensor of its own."""
    if not entry.shape or entry.shape[0] != count:
        raise FormatError(f"{entry.name!r} is {list(entry.shape)}, expected a leading axis of {count} experts "
                          "(num_moe_experts); the config does not match the weights")
    box = ((index, *(0,) * (len(entry.shape) - 1)), (1, *entry.shape[1:]))
    return view(entry, box, f"{entry.name}[{index}]", drop=1)


# ---------------------------------------------------------------------------------- the other way: HF -> Megatron

def qkv_join(parts: list[TensorEntry], shape: Shape, name: str) -> TensorEntry:
    """q, k, v (weights or biases) -> Megatron's fused rows, per query group [q heads of g, k_g, v_g]."""
    q, k, v = parts
    per_group, d = shape.heads // shape.groups, shape.head_dim
    _expect(q, (shape.groups * per_group * d, *q.shape[1:]), "query heads x head dim rows")
    for part in (k, v):
        _expect(part, (shape.groups * d, *q.shape[1:]), "query groups x head dim rows")
    pieces = []
    for g in range(shape.groups):
        pieces += [rows(q, g * per_group * d, per_group * d, name), rows(k, g * d, d, name), rows(v, g * d, d, name)]
    return concat(name, pieces)


def join(parts: list[TensorEntry], shape: Shape, name: str) -> TensorEntry:
    """gate, up -> the fused `linear_fc1` (cat along dim 0); one part -> itself under the Megatron name."""
    return concat(name, parts)


def stack(name: str, parts: list[TensorEntry]) -> TensorEntry:
    """Tensors of one shape as one with a new leading axis (layers, or experts), as views: no data is read."""
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape != first.shape for p in parts):
        raise FormatError(f"cannot stack {', '.join(p.name for p in parts[:3])} into {name!r}: shapes or dtypes "
                          "differ")
    chunks = []
    for i, part in enumerate(parts):
        for c in part.chunks:
            stride = c.data.stride
            data = c.data if stride is None else replace(c.data, stride=(0, *stride))
            chunks.append(Chunk((i, *c.offsets), (1, *c.sizes), data))
    return TensorEntry(name, first.dtype, (len(parts), *first.shape), chunks)


INVERSE: dict[Transform, Callable[[list[TensorEntry], Shape, str], TensorEntry]] = {
    identity: join, qkv: qkv_join, gate_up: join, expert_gate_up: join, halves: join}
