"""The GGUF container: gguf-py's `GGUFWriter` lays out the header (key/values and tensor infos, exactly as
llama.cpp's converter gets them), into memory; the tensor data is then streamed after it, tensor by tensor and slab
by slab, each tensor aligned to GGUF's 32 bytes as GGUFWriter aligns it. The output appears only when complete
(`open_output`: temp name + rename locally, one upload remotely).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from .. import dtypes, heap, storage
from ..certificate import Ledger, Tally
from ..tensorio import read_box, slabs
from .names import Part, Planned
from .quant import Converter, converted

ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT


class HeaderWriter(gguf.GGUFWriter):
    """A GGUFWriter whose "file" is memory: it writes the header, the caller streams the data."""

    def open_output_file(self, path: Any = None) -> None:
        self.fout = [io.BytesIO()]  # type: ignore[list-item]
        self.state = gguf.gguf_writer.WriterState.EMPTY

    def header(self) -> bytes:
        self.write_header_to_file()
        self.write_kv_data_to_file()
        self.write_ti_data_to_file()
        assert self.fout is not None
        data = self.fout[0].getvalue()  # type: ignore[attr-defined]
        return data + bytes(-len(data) % ALIGN)


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy type slabs of dtype `name` are read as (bfloat16, which numpy lacks, as its bits: uint16)."""
    return np.dtype(np.uint16 if name == "bfloat16" else name)


class Reader:
    """Source slabs as numpy arrays, through one reused buffer of about `budget` bytes (no torch: importing it
    alone costs ~1 CPU-s and ~190 MB of RSS)."""

    def __init__(self, reader: storage.RangeReader, budget: int, ledger: Ledger | None = None) -> None:
        self.reader, self.budget, self.ledger = reader, budget, ledger  # ledger: the certificate's record of reads
        self._buffer = bytearray(0)
        self._tally: Tally | None = None  # the part being read, for the certificate

    def _read(self, part: Part, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        nbytes = dtypes.numel(sizes) * dtypes.itemsize(part.entry.dtype)
        heap.release()
        if len(self._buffer) < nbytes:
            self._buffer = bytearray(nbytes)
        view = memoryview(self._buffer)[:nbytes]
        if nbytes:
            read_box(self.reader, part.entry, (offsets, sizes), view)
            if self._tally is not None:
                self._tally.add(view, view)
        dtype = _numpy_dtype(part.entry.dtype)
        return np.frombuffer(view, dtype=dtype).reshape(sizes) if nbytes else np.empty(sizes, dtype=dtype)

    def slabs(self, part: Part) -> Iterator[np.ndarray]:
        """`part` in whole rows (the last dimension is never split), permuted where it asks to be; each read is
        handed to the ledger (row-major order within the part) while it is in memory."""
        whole = part.sizes == part.entry.shape and not any(part.offsets)
        self._tally = self.ledger.reading(part.entry, None if whole else (part.offsets, part.sizes)) \
            if self.ledger is not None else None
        yield from self._slabs(part)
        if self._tally is not None:
            self._tally.close()
            self._tally = None

    def _slabs(self, part: Part) -> Iterator[np.ndarray]:
        item = dtypes.itemsize(part.entry.dtype)
        row = (part.sizes[-1] if part.sizes else 1) * item
        if part.heads:
            rows = part.sizes[0]
            per_head = rows // part.heads
            rest = part.sizes[1:]
            step = max(1, self.budget // max(per_head * dtypes.numel(rest) * item, 1))
            for head in range(0, part.heads, step):
                n = min(step, part.heads - head)
                data = self._read(part, (head * per_head, *(0,) * len(rest)), (n * per_head, *rest))
                yield data.reshape(n, 2, per_head // 2, *rest).swapaxes(1, 2).reshape(data.shape)
            return
        for offsets, sizes in slabs(part.sizes, item, max(self.budget, row)):
            yield self._read(part, tuple(o + p for o, p in zip(offsets, part.offsets, strict=True)), sizes)


def write_data(fh: Any, planned: list[Planned], types: list[gguf.GGMLQuantizationType], source: Reader) -> None:
    """The tensor data after the header: each tensor converted slab by slab, then padded to ALIGN."""
    convert = Converter()
    for tensor, qtype in zip(planned, types, strict=True):
        written = 0
        if tensor.data is not None:
            data = converted(tensor.data, "float32", qtype)
            fh.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
            written += data.nbytes
        for part in tensor.parts:
            for rows in source.slabs(part):
                if not rows.size:
                    continue
                data = convert(rows, part.entry.dtype, qtype)
                fh.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
                written += data.nbytes
        fh.write(bytes(-written % ALIGN))
