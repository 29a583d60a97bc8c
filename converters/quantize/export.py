"""`export_fp8`: an HF checkpoint (or any source the engine reads, under its cleaned model names) written as an
FP8 checkpoint in the compressed-tensors layout that llm-compressor writes and vLLM / transformers load:
sharded safetensors (`<m>.weight` float8_e4m3fn, `<m>.weight_scale` in the weight's dtype, everything else as
it was) plus the index, config.json with `quantization_config`, and the other side files an export carries.

Streaming: one tensor at a time, in row slabs of `memory_limit // 64` bytes (at least 128 rows), read into one
reused buffer and quantized in a few more (float32 quotient, FP8 copy) that are reused too: small slabs stay in
the CPU's caches between the passes over them, and memory stays flat. A file holds its wider tensors first
(safetensors' order, which keeps every tensor aligned), so a weight's scales come before the FP8 weights; but the
whole layout (header, every offset) is known before any data is written, so a local file is written at offsets:
each quantized weight is read once, its FP8 slabs written in place as they are quantized while the slab's scales
(its rows', its 128-row bands') are taken from the same slab in memory, and the scales (small) are written into
the places left for them once the shard's weights are done. Meanwhile the tensors kept as they are (embeddings,
`lm_head`, norms: most of the bytes when the source is float32) take the copier's ordinary path in two threads (read
into a window buffer and written from it, `Copier._through_buffer`, when the source holds them whole). A per-tensor
scale needs the whole weight's |max| first: such a weight is read twice, unless it fits in one slab. Object storage
takes a stream in file order: there the scales of a shard are computed first (one pass over each of its weights) and
the weights read again. The output appears only when complete (`open_output`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .. import dtypes, heap, storage
from ..certificate import Ledger, certify_derived
from ..checksum import crc32, crc32_combine
from ..config import ContextPool
from ..copier import DEFAULT_MEMORY_LIMIT, Copier, pwrite_all, settled
from ..errors import FormatError, OptionError
from ..index import TensorEntry
from ..jsonsafe import loads
from ..modelview import model_view
from ..output import Output, open_output
from ..sidefiles import CONFIG, collect
from ..tensorio import read_box
from ..writers.safetensors import Planned, header_bytes, write_shards
from . import fp8
from .config import BLOCK, Scheme, quantization_config, scheme
from .select import compile_ignore, select

DEFAULT_SHARD_SIZE = 5 * 1000**3
SOURCE_FLOATS = ("float32", "bfloat16", "float16")
COPY_THREADS = 2  # the copies' threads, beside the one quantizing (this machine: 2 cores)


@dataclass
class Fp8Result:
    target: str
    scheme: str
    quantized: list[str]  # modules whose weight is FP8
    ignored: list[str]  # Linear modules kept in their dtype (the config's `ignore`)
    outputs: list[tuple[str, int]]
    report: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"target": self.target, "scheme": self.scheme, "quantized": len(self.quantized),
                "ignored": self.ignored, "outputs": [{"name": n, "bytes": b} for n, b in self.outputs],
                "report": self.report}


@dataclass
class _Item:
    """One output tensor: copied from `entry`, or the FP8 weight / the scale of the weight `entry`."""

    name: str
    kind: str  # "copy", "weight" or "scale"
    entry: TensorEntry
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return dtypes.numel(self.shape) * dtypes.itemsize(self.dtype)


class _Quantizer:
    """Scales and FP8 slabs of the quantized weights, read through `reader` in slabs of about `budget` bytes
    (numpy in reused buffers: `fp8.Slab`)."""

    def __init__(self, reader: storage.RangeReader, chosen: Scheme, budget: int, ledger: Ledger | None = None) -> None:
        self.reader, self.chosen, self.budget = reader, chosen, budget
        self.ledger = ledger  # the certificate's record of what is read
        self.scales: dict[str, np.ndarray] = {}
        self._buffer = bytearray(0)  # one read buffer for every slab, grown to the largest
        self._slab = fp8.Slab()

    def read(self, entry: TensorEntry, box: tuple[tuple[int, ...], tuple[int, ...]]) -> memoryview:
        """The bytes of `entry[box]` in the shared read buffer (valid until the next read)."""
        nbytes = dtypes.numel(box[1]) * dtypes.itemsize(entry.dtype)
        heap.release()
        if len(self._buffer) < nbytes:
            self._buffer = bytearray(nbytes)
        view = memoryview(self._buffer)[:nbytes]
        read_box(self.reader, entry, box, view)
        return view

    def slabs(self, entry: TensorEntry, record: bool = False) -> Iterator[tuple[memoryview, tuple[int, int]]]:
        """The bytes and shape of each slab of whole rows (a multiple of 128), handed to the certificate's ledger
        when `record` (the pass whose bytes are written: a second pass would only take the CRC-32s again)."""
        rows, cols = entry.shape
        row_bytes, step = cols * dtypes.itemsize(entry.dtype), self.rows_per_slab(entry)
        tally = self.ledger.reading(entry) if self.ledger is not None and record else None
        for start in range(0, rows, step):
            n = min(step, rows - start)
            view = self.read(entry, ((start, 0), (n, cols))) if n * row_bytes else memoryview(b"")
            if tally is not None and view:
                tally.add(view, view)
            yield view, (n, cols)  # until the next slab
        if tally is not None:
            tally.close()

    def rows_per_slab(self, entry: TensorEntry) -> int:
        row_bytes = max(entry.shape[1] * dtypes.itemsize(entry.dtype), 1)
        return max(BLOCK[0], self.budget // row_bytes // BLOCK[0] * BLOCK[0])

    def scale(self, entry: TensorEntry) -> np.ndarray:
        """The scales of `entry`: those its FP8 pass took (`weight`), else from a pass over it of their own."""
        found = self.scales.get(entry.name)
        if found is None:
            strategy, slab = self.chosen.strategy, self._slab
            parts = [slab.amax(slab.widen(view, entry.dtype, shape), strategy) for view, shape in self.slabs(entry)]
            if not parts:  # no rows
                amax = np.zeros(fp8.scale_shape(entry.shape, strategy), dtype=np.float32)
            else:
                amax = np.stack(parts).max(axis=0) if strategy == "tensor" else np.concatenate(parts)
            found = fp8.scale_of(amax, entry.dtype)
            self.scales[entry.name] = found
        return found

    def weight(self, entry: TensorEntry) -> Iterator[memoryview]:
        """The FP8 bytes of `entry`, slab by slab. Unless its scales are known already (`scale`), each slab's
        scales (its rows', its 128-row bands', or a per-tensor weight's when it is one slab) come from the slab
        itself, in the same read, and are kept once the last slab is out; a per-tensor weight larger than a slab
        needs its |max| first: `scale` reads it once more."""
        strategy = self.chosen.strategy
        known = self.scales.get(entry.name)
        if known is None and strategy == "tensor" and entry.shape[0] > self.rows_per_slab(entry):
            known = self.scale(entry)
        taken: list[np.ndarray] = []  # the scales of each slab, when not known
        at = 0
        for view, shape in self.slabs(entry, record=True):
            rows = self._slab.widen(view, entry.dtype, shape)
            if known is None:
                part = fp8.scale_of(self._slab.amax(rows, strategy), entry.dtype)
                taken.append(part)
            elif strategy == "channel":
                part = known[at: at + shape[0]]
            elif strategy == "block":
                part = known[at // BLOCK[0]: (at + shape[0] + BLOCK[0] - 1) // BLOCK[0]]
            else:
                part = known
            at += shape[0]
            if view:
                yield self._slab.quantize(rows, part, entry.dtype, strategy).data.cast("B")
        if known is None:
            self.scales[entry.name] = np.concatenate(taken) if taken else fp8.scale_of(
                np.zeros(fp8.scale_shape(entry.shape, strategy), dtype=np.float32), entry.dtype)


def _plan(tensors: dict[str, TensorEntry], quantized: set[str], chosen: Scheme) -> list[_Item]:
    items = []
    for name, entry in tensors.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in quantized:
            if entry.dtype not in SOURCE_FLOATS:
                raise FormatError(f"{name}: {entry.dtype} cannot be quantized to FP8 (the source must hold float32, "
                                  "bfloat16 or float16 weights); add its module to `ignore` or export the unquantized "
                                  "checkpoint first", key=name)
            items.append(_Item(name, "weight", entry, "float8_e4m3fn", entry.shape))
            items.append(_Item(f"{name}_scale", "scale", entry, entry.dtype,
                               fp8.scale_shape(entry.shape, chosen.strategy)))
        else:
            items.append(_Item(name, "copy", entry, entry.dtype, entry.shape))
    for item in items:  # refuse dtypes safetensors cannot hold before anything is written
        dtypes.to_safetensors(item.dtype, item.name)
    names = {item.name for item in items}
    clash = [f"{m}.weight_scale" for m in quantized if f"{m}.weight_scale" in tensors]
    if clash or len(names) != len(items):
        raise FormatError(f"{clash[0] if clash else 'a weight_scale'}: the source already holds FP8 scales; it is "
                          "quantized already, export it as it is", key=clash[0] if clash else None)
    return sorted(items, key=lambda item: item.name)


def _write_shard(out: Output, name: str, items: list[_Item], quantizer: _Quantizer, copier: Copier) -> dict[str, int]:
    """One shard; locally, each of its tensors' CRC-32s as written (`_write_at_offsets`), remotely none."""
    items = sorted(items, key=lambda item: dtypes.safetensors_order(item.dtype, item.name))
    planned = [Planned(item.name, TensorEntry(item.name, item.dtype, item.shape, []), item.dtype) for item in items]
    header = header_bytes(planned, {"format": "pt"})
    crcs: dict[str, int] = {}
    if out.local:
        crcs = _write_at_offsets(out, name, header, items, quantizer, copier)
    else:
        _write_in_order(out, name, header, items, quantizer, copier)
    for item in items:  # a weight's scale is written with it or in a later shard: done with both now
        if item.kind == "scale":
            quantizer.scales.pop(item.entry.name, None)
    return crcs


def _write_at_offsets(out: Output, name: str, header: bytes, items: list[_Item], quantizer: _Quantizer,
                      copier: Copier) -> dict[str, int]:
    """A local file: the copies at their offsets in the copier's threads while this one writes the FP8 weights at
    theirs (each read once, its scales taken on the way), then the scales into the places left for them. Returns
    each tensor's CRC-32, taken as its bytes are written (the copies' from the page cache as they land, the rest
    from memory), and the certificate notes every byte's CRC-32s block by block (`Ledger.wrote`): nothing is read
    back."""
    offsets, at = [], len(header)
    for item in items:
        offsets.append(at)
        at += item.nbytes
    crcs: dict[str, int] = {}
    ledger = copier.ledger
    with open(out.path(name), "wb") as fh, ContextPool(copier.threads, thread_name_prefix="ckpt-fp8") as pool:
        fd = fh.fileno()
        pwrite_all(fd, header, 0)
        copier.note(fd, 0, header)
        copies = {item.name: pool.submit(copier.write_at, fd, start, item.entry, None, None, True)
                  for item, start in zip(items, offsets, strict=True) if item.kind == "copy"}
        with settled(copies.values()):
            for item, start in zip(items, offsets, strict=True):
                if item.kind == "weight":
                    crc = 0
                    for block in quantizer.weight(item.entry):
                        crc = crc32_combine(crc, _write(fd, block, start, ledger), len(block))
                        start += len(block)
                    crcs[item.name] = crc
            for item, start in zip(items, offsets, strict=True):
                if item.kind == "scale":  # its weight came before it in this shard or in an earlier one
                    data = memoryview(fp8.scale_bytes(quantizer.scale(item.entry), item.dtype))
                    crcs[item.name] = _write(fd, data, start, ledger)
        os.ftruncate(fd, at)
    out.record(name, at)
    crcs.update({tensor: future.result() for tensor, future in copies.items()})
    return crcs


def _write(fd: int, data: memoryview, offset: int, ledger: Ledger | None) -> int:
    """Write `data` at `offset` of the local output `fd` and return its CRC-32, noted block by block for the
    certificate (`Ledger.wrote_bytes`). Not in turn with the copier's writes (`Copier.write_noted`): this thread
    would wait out the copier's writes, quantizing nothing meanwhile; the kernel orders the writes itself."""
    crc = ledger.wrote_bytes(fd, offset, data) if ledger is not None else crc32(data)
    pwrite_all(fd, data, offset)
    return crc


def _write_in_order(out: Output, name: str, header: bytes, items: list[_Item], quantizer: _Quantizer,
                    copier: Copier) -> None:
    """A stream (object storage): the shard's scales first (a pass over each weight of their own), as the file
    holds them before the FP8 weights, then everything in file order."""
    for item in items:
        if item.kind == "scale":
            quantizer.scale(item.entry)
    with out.open(name) as fh:
        fh.write(header)
        for item in items:
            if item.kind == "scale":
                fh.write(fp8.scale_bytes(quantizer.scale(item.entry), item.dtype))
                continue
            for block in quantizer.weight(item.entry) if item.kind == "weight" else copier.stream(item.entry):
                fh.write(block)


def _config(side_data: dict[str, bytes], source: str, chosen: Scheme, ignored: list[str]) -> bytes:
    if CONFIG not in side_data:
        raise OptionError(f"{source}: no config.json beside the checkpoint; a quantized export writes its "
                          "quantization_config there: pass config_from=DIR (the folder holding the model's "
                          "config.json)",
                          field="config_from")
    doc = loads(side_data[CONFIG], CONFIG)
    if not isinstance(doc, dict):
        raise FormatError(f"{source} ({CONFIG}): not a JSON object; fix it or pass config_from=DIR", uri=source)
    if "quantization_config" in doc:
        raise FormatError(f"{source} ({CONFIG}): the model is quantized already (it has a quantization_config); "
                          "quantize the unquantized checkpoint", uri=source)
    doc["quantization_config"] = quantization_config(chosen, ignored)
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


@storage.with_io_errors
def export_fp8(source: str, target: str, scheme_name: str = "FP8_DYNAMIC", ignore: tuple[str, ...] | list[str] = (
        "lm_head",), *, max_shard_size: int = DEFAULT_SHARD_SIZE, memory_limit: int = DEFAULT_MEMORY_LIMIT,
        overwrite: bool = False, config_from: str | None = None, source_format: str | None = None) -> Fp8Result:
    """Write `source` as an FP8 compressed-tensors checkpoint at `target` (a folder)."""
    chosen = scheme(scheme_name)
    checked = compile_ignore(ignore)
    if max_shard_size <= 0:
        raise OptionError("max_shard_size must be positive", field="max_shard_size")
    if memory_limit < 1024 * 1024:
        raise OptionError("memory_limit must be at least 1MiB", field="memory_limit")
    if target.endswith(".safetensors"):
        raise OptionError(f"{target}: an FP8 export is a folder (weights, index and config.json); name a folder",
                          field="target")
    storage.check_target(target, overwrite)
    reader = storage.RangeReader()
    try:
        view = model_view(source, source_format, reader, "to quantize")
        side = collect(source, config_from, None)
        raw = loads(side.data[CONFIG], CONFIG) if CONFIG in side.data else {}
        tied = "lm_head.weight" not in view.tensors and bool(raw.get("tie_word_embeddings", True)) \
            if isinstance(raw, dict) else False
        chosen_modules = select({n: t.shape for n, t in view.tensors.items()}, checked, tied)
        if not chosen_modules.quantized:
            kept = ", ".join(checked) or "none"
            raise OptionError(f"{source}: no Linear weight is left to quantize (ignore: {kept})",
                              field="ignore")
        config_bytes = _config(side.data, source, chosen, chosen_modules.ignored)
        items = _plan(view.tensors, set(chosen_modules.quantized), chosen)
        # a slab of the source, its float32 widening and quotient, its FP8 copy: a few slabs at once
        ledger = Ledger(view.uri, view.format, derived="fp8")  # what is read, for the certificate
        quantizer = _Quantizer(reader, chosen, max(memory_limit // 64, 1024 * 1024), ledger)
        copier = Copier(reader, memory_limit // 16, threads=COPY_THREADS)  # the tensors kept as they are
        copier.ledger = ledger
        report = [f"{chosen.name}: {len(chosen_modules.quantized)} Linear weights to FP8; kept: "
                  + (", ".join(chosen_modules.ignored) or "none"), side.report()]
        if chosen.strategy == "block":
            odd = [m for m in chosen_modules.quantized if view.tensors[f"{m}.weight"].shape[1] % BLOCK[1]]
            if odd:
                report.append(f"{len(odd)} weights have in_features not a multiple of 128 (e.g. {odd[0]}): their "
                              "scales cover zero-padded blocks, as llm-compressor's do, but FP8_BLOCK's per-128 "
                              "activation groups need whole groups at inference")
        with open_output(target, overwrite, "safetensors") as out:
            out.about["quantization"] = {"scheme": chosen.name, "ignore": checked}
            written: dict[str, tuple[str, int]] = {}  # tensor -> (its file, its CRC-32 as written)

            def write(o: Output, name: str, shard: list[_Item]) -> None:
                written.update({tensor: (name, crc) for tensor, crc in
                                _write_shard(o, name, shard, quantizer, copier).items()})
            write_shards(out, items, max_shard_size, write,
                         {name: config_bytes if name == CONFIG else data for name, data in side.data.items()})
            certify_derived(out, ledger, written if out.local else None)
            outputs = [(n, f["bytes"]) for n, f in out.files.items()]
        report.extend(reader.fetch_note())
        return Fp8Result(target, chosen.name, chosen_modules.quantized, chosen_modules.ignored, outputs, report)
    finally:
        reader.close()
