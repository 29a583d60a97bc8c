"""PEFT's merge, module by module, in the same operations, order and dtypes as `merge_and_unload()` (peft 0.21:
`tuners/lora/layer.py` `Linear.get_delta_weight` / `Linear.merge`, `Embedding.get_delta_weight`,
`tuners/lora/variants.py` `DoraLinearVariant.merge_unsafe`, `tuners/lora/dora.py` `get_weight_norm`), so fp32
results are bit for bit PEFT's.

    delta = transpose(B @ A, fan_in_fan_out) * scaling   (A, B in float32 when they are 16-bit, cast back)
    LoRA:  W += delta                                     (in place: W's dtype, torch's promotion)
    DoRA:  n = ||transpose(W) + 1 * transpose(delta)||_row  (in W's dtype);  W = (m / n) * (W + delta)
    lora_bias: b += lora_B.bias * scaling
    Embedding: delta = transpose(B @ A, True) * scaling

Row slabs: a LoRA or DoRA Linear (without fan_in_fan_out) is merged `rows` output rows at a time: every output
element and every row norm depends on its own row only, so memory stays bounded by the slab.
"""

from __future__ import annotations

import os

import torch

from .. import heap
from ..dtypes import numel
from ..index import TensorEntry
from ..rangeread import RangeReader
from ..tensorio import read_box

_SIXTEEN = (torch.float16, torch.bfloat16)


release = heap.release  # between slabs (see converters.heap)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def read_tensor(reader: RangeReader, entry: TensorEntry, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """`entry` (or its rows [start, start + n)) as a new torch tensor."""
    shape = entry.shape
    if rows is not None:
        shape = (rows[1], *shape[1:])
    box = ((rows[0] if rows else 0, *(0,) * (len(shape) - 1)), shape) if shape else ((), ())
    tensor = torch.empty(shape, dtype=torch_dtype(entry.dtype))  # not zeroed: read_box fills every byte
    if numel(shape):
        read_box(reader, entry, box, tensor.view(-1).view(torch.uint8).numpy().data.cast("B"))
    return tensor


def _t(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """PEFT's `transpose`."""
    return weight.T if fan_in_fan_out else weight


def delta_weight(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool,
                 embedding: bool = False) -> torch.Tensor:
    """`get_delta_weight`: Linear casts by lora_B's dtype, Embedding by lora_embedding_A's."""
    dtype = a.dtype if embedding else b.dtype
    cast = dtype in _SIXTEEN
    if cast:
        a, b = a.float(), b.float()
    out = _t(b @ a, True if embedding else fan_in_fan_out) * scaling
    return out.to(dtype=dtype) if cast else out


class Workspace:
    """Reused buffers, one per purpose, grown to the largest slab asked for: slabs of a merge land in the same
    pages each time (no page faults, no heap to hand back), so memory stays flat at a few slabs."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, purpose: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel(shape) * dtype.itemsize
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[purpose] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)

    def read(self, purpose: str, reader: RangeReader, entry: TensorEntry, rows: tuple[int, int]) -> torch.Tensor:
        """Rows [start, start + n) of `entry`, read into this workspace."""
        shape = (rows[1], *entry.shape[1:])
        tensor = self.get(purpose, shape, torch_dtype(entry.dtype))
        if numel(shape):
            box = ((rows[0], *(0,) * (len(shape) - 1)), shape)
            read_box(reader, entry, box, tensor.view(-1).view(torch.uint8).numpy().data.cast("B"))
        return tensor

    def pread(self, purpose: str, fd: int, offset: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A tensor of `shape` and `dtype` read from the local file `fd` at `offset` into this workspace."""
        tensor = self.get(purpose, shape, torch_dtype(dtype))
        pread_into(fd, offset, tensor.view(-1).view(torch.uint8).numpy().data.cast("B"))
        return tensor


def pread_into(fd: int, offset: int, view: memoryview) -> None:
    """Fill `view` from the local file `fd` at `offset` (bytes this process wrote there: never short)."""
    got = 0
    while got < len(view):
        more = os.preadv(fd, [view[got:]], offset + got)
        if more <= 0:
            raise OSError(f"output file ends before byte {offset + len(view)}")
        got += more


def delta_rows(a: torch.Tensor, b: torch.Tensor, scaling: float, space: Workspace) -> torch.Tensor:
    """`delta_weight` of a Linear without fan_in_fan_out, for some rows of lora_B, in `space`: the same operations
    (matmul, times scaling, cast back from float32 for 16-bit adapters), written into reused buffers."""
    shape = (b.shape[0], a.shape[1])
    if b.dtype in _SIXTEEN:
        product = space.get("delta32", shape, torch.float32)
        torch.matmul(b.float(), a.float(), out=product)
        product.mul_(scaling)
        return space.get("delta", shape, b.dtype).copy_(product)
    product = space.get("delta", shape, b.dtype)
    torch.matmul(b, a, out=product)
    return product.mul_(scaling)


def merge_lora(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`base_layer.weight.data += delta_weight`."""
    weight += delta
    return weight


def merge_dora(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor,
               fan_in_fan_out: bool) -> torch.Tensor:
    """`DoraLinearVariant.merge_unsafe` (weight norm by `get_weight_norm` with scaling=1)."""
    orig_dtype = weight.dtype
    norm_input = _t(weight, fan_in_fan_out)
    norm_input = norm_input + 1 * _t(delta, fan_in_fan_out)
    weight_norm = torch.linalg.norm(norm_input, dim=1).to(norm_input.dtype).detach()
    factor = magnitude / weight_norm
    factor = _t(factor.view(-1, 1), fan_in_fan_out)
    return (factor * (weight.data + delta)).to(orig_dtype)


def merge_bias(bias: torch.Tensor, b_bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """`base_layer.bias.data += lora_B.bias * scaling`."""
    bias += b_bias * scaling
    return bias
