"""Conversion certificates: what an output was made from and what it holds, recorded in its manifest.

While a conversion copies, the copier hands every tensor (or box of one, in a reshard) to a `Ledger`: the
CRC-32 of the source bytes it read (row-major, before any cast) and of the bytes it wrote, and with `stats`
the statistics of both (`converters.stats.moments`), all computed on the slabs and window buffers already in
memory (`Copier._through_buffer`). At the end `certificate()` gives the manifest's `certificate`:

- `source`: its URI and format, and per tensor (per box): the source byte ranges it was read from (file
  relative to the source, offset, length; a DCP record's range) and the CRC-32 of the values read;
- `output`: per tensor (per box) the output dtype and the CRC-32 of its bytes in the output (the manifest's
  `files` carry every output file's size and CRC-32 too);
- with `stats`: the statistics of source and output side by side, and the check: `equal` for an exact copy,
  `within rounding` for a cast (counts equal, values within the output dtype's rounding), else `differs`.

An export that computes its output (GGUF, FP8, a merged adapter) or renames it (an adapter alone) is
`derived`: the tensors it reads itself are handed to a `Ledger` through `reading` (and those the copier
copies, as above), and its certificate holds `read` (per source tensor: the ranges and the CRC-32 of the
values read) and `tensors` (per output tensor its CRC-32, taken as it is written where the writer hands them
over, else computed while each output file is read back for its own CRC-32s). A single-file output
(`out.safetensors`, `model.pt`, `model.gguf`) has no folder for a manifest: its manifest, certificate included,
is written beside it as `<file>.ckpt-manifest.json` (`write_sidecar`, once the file is in place).

The manifest's CRC-32 of each local output file and of each `BLOCK` of it are joined (`crc32_combine`) from
the CRC-32s of the bytes written into it, taken as they are written (`Ledger.wrote`: from the copier's window buffers
and slabs, cut at the output's block edges, and headers from memory); a file those do not
tile exactly (a derived export's, DCP's `.metadata`), or every file with `READBACK`, is read back instead.

`converters.verification.check_certificate` re-checks an output against it later.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import dtypes, storage
from .checksum import crc32, crc32_combine
from .index import CheckpointIndex, TensorEntry
from .names import MANIFEST
from .tensorio import Box

if TYPE_CHECKING:  # numpy and the statistics are imported when asked for (`ckptctl --help` stays light)
    from .stats.moments import Moments, TensorStats

#: the unit roundoff of each floating dtype a cast can land in (2**-p, p the significand's bits)
ROUNDING = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
            "float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}
#: the smallest normal value of each: below it a cast rounds in absolute steps (subnormals, flush to zero)
TINY = {"float64": 2.2250738585072014e-308, "float32": 1.1754943508222875e-38, "float16": 6.103515625e-05,
        "bfloat16": 1.1754943508222875e-38, "float8_e4m3fn": 2.0**-6, "float8_e5m2": 2.0**-14}


BLOCK = 16 << 20  # the manifest records a CRC-32 per block of each output file
STEP = 4 << 20  # bytes read at a time
#: re-read every output file for its CRC-32s even where the CRC-32s of the bytes written into it account for
#: them (a paranoid mode: the output as the filesystem holds it, not as it was handed to the kernel)
READBACK = False


def block_parts(start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) of an output file cut where its `BLOCK`s begin."""
    parts = []
    while start < end:
        cut = min(end, (start // BLOCK + 1) * BLOCK)
        parts.append((start, cut))
        start = cut
    return parts


def file_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def joined_crcs(ranges: list[tuple[int, int, int]], size: int) -> tuple[int, list[int]] | None:
    """(CRC-32 of a file of `size` bytes, of each `BLOCK` of it) from the (start, length, CRC-32) of the ranges
    written into it, without reading it: None unless the ranges tile the file exactly (no gap, no overlap, none
    across a block's edge), as then nothing else can be in it."""
    blocks: list[int] = []
    crc, pos, block_end = 0, 0, min(BLOCK, size)
    for start, length, part in sorted(ranges):
        if not length:
            continue
        if start != pos or start + length > block_end:
            return None
        crc, pos = crc32_combine(crc, part, length), start + length
        if pos == block_end:
            blocks.append(crc)
            crc, block_end = 0, min(pos + BLOCK, size)
    if pos != size:
        return None
    whole, at = 0, 0
    for block in blocks:
        length = min(BLOCK, size - at)
        whole, at = crc32_combine(whole, block, length), at + length
    return whole, blocks


def box_key(box: Box | None) -> list[list[int]] | None:
    return None if box is None else [list(box[0]), list(box[1])]


class Tally:
    """One stream of one tensor (or box): CRC-32s of the bytes read and written, their moments with stats.

    `counts` says whether it takes statistics; their `Moments` (and numpy) are made by the first thread that
    hands it values, so a writer thread that only copies never waits for numpy's import."""

    def __init__(self, ledger: Ledger, entry: TensorEntry, out_dtype: str, box: Box | None) -> None:
        self.ledger, self.entry, self.out_dtype, self.box = ledger, entry, out_dtype, box
        self.src_crc = self.out_crc = 0
        self.copied = 0  # source ranges the copier copied so far (`add_crc`)
        self.counts = ledger.stats and entry.dtype in dtypes.WITH_STATISTICS and out_dtype in dtypes.WITH_STATISTICS
        self.src: Moments | None = None
        self.out: Moments | None = None  # None for an uncast copy: its output's statistics are the source's

    def moments(self) -> tuple[Moments, Moments | None] | None:
        """(source, output) moments, made on first use; None without statistics."""
        if not self.counts:
            return None
        if self.src is None:
            from .stats.moments import Moments

            entry = self.entry
            # an uncast copy writes the bytes it read (their CRC-32s agree): its output's statistics are the source's
            self.out = Moments(entry.name, self.out_dtype, entry.shape) if self.out_dtype != entry.dtype else None
            self.src = Moments(entry.name, entry.dtype, entry.shape)
        return self.src, self.out

    def add(self, read: memoryview, written: memoryview) -> None:
        """Take a slab as read from the source and as written to the output (the same view when not cast)."""
        self.src_crc = crc32(read, self.src_crc)
        self.out_crc = self.src_crc if written is read else crc32(written, self.out_crc)
        moments = self.moments()
        if moments is not None:
            import numpy as np

            from .stats.moments import numpy_dtype

            src, out = moments
            src.add(np.frombuffer(read, dtype=numpy_dtype(self.entry.dtype)))
            if out is not None:
                out.add(np.frombuffer(written, dtype=numpy_dtype(self.out_dtype)))

    def add_values(self, view: memoryview) -> None:
        """The statistics (not the CRC-32s) of a slab copied unchanged (`add_crc` gives the CRC-32s)."""
        moments = self.moments()
        if moments is not None:
            import numpy as np

            from .stats.moments import numpy_dtype

            moments[0].add(np.frombuffer(view, dtype=numpy_dtype(self.entry.dtype)))

    def extend(self, crc: int, length: int) -> None:
        """Take the next `length` bytes read, whose CRC-32 is `crc` (a slab checksummed in another thread), as
        `add(view, view)` would (no statistics: a derived export's reads have none)."""
        self.src_crc = self.out_crc = crc32_combine(self.src_crc, crc, length)

    def add_crc(self, crc: int) -> None:
        """A source range the copier copied unchanged: `crc` is both CRC-32s extended over it."""
        self.src_crc = self.out_crc = crc
        self.copied += 1

    def close(self) -> None:
        self.ledger.record(self)


class Ledger:
    """Everything the copier read and wrote in one conversion, gathered from its writer threads."""

    def __init__(self, source: str, source_format: str, stats: bool = False, derived: str | None = None) -> None:
        self.source, self.source_format, self.stats = source.rstrip("/"), source_format, stats
        self.derived = derived  # what a derived export makes ("gguf", "fp8", ...): its pieces are what it read
        self.pieces: dict[str, list[dict[str, Any]]] = {}
        self.reads: dict[tuple[str, str, str], dict[str, Any]] = {}  # (name, box, first file) -> a piece read
        # tallies of source ranges copied unchanged whose CRC-32 is taken from the output as it is read back:
        # (tally, (device, inode) of the output file, start, length, how to compute it from the source instead)
        self.deferred: list[tuple[Tally, tuple[int, int], int, int, Callable[[], int]]] = []
        self.moments: dict[str, tuple[Moments, Moments | None]] = {}  # output None: an uncast copy
        # (device, inode) of a local output file -> (start, length, CRC-32) of each range written into it, none
        # across a `BLOCK`'s edge: its CRC-32s are joined from them instead of reading it back (`joined_crcs`)
        self.written: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def open(self, entry: TensorEntry, out_dtype: str, box: Box | None) -> Tally:
        return Tally(self, entry, out_dtype, box)

    def defer(self, tally: Tally, fd: int, start: int, length: int, fallback: Callable[[], int]) -> None:
        """`tally`'s bytes were copied unchanged (source ranges) into `length` bytes of the local file `fd` from
        `start`: their CRC-32 is computed when the certificate reads the output back (`resolve`), or else by
        `fallback`."""
        st = os.fstat(fd)
        with self._lock:
            self.deferred.append((tally, (st.st_dev, st.st_ino), start, length, fallback))

    def wrote(self, fd: int, start: int, length: int, crc: int) -> None:
        """`length` bytes at `start` of the local output file `fd` (inside one `BLOCK`) have the CRC-32 `crc`."""
        key = file_key(fd)
        with self._lock:
            self.written.setdefault(key, []).append((start, length, crc))

    def unwrite(self, fd: int, start: int, length: int) -> None:
        """[start, start + length) of the local output `fd` is about to be written again (a copy merged in
        place): forget the CRC-32s noted inside it; its new bytes are noted as they are written."""
        key = file_key(fd)
        with self._lock:
            noted = self.written.get(key)
            if noted is not None:
                noted[:] = [r for r in noted if not (start <= r[0] and r[0] + r[1] <= start + length)]

    def wrote_bytes(self, fd: int, start: int, data: bytes | bytearray | memoryview) -> int:
        """`data` was written at `start` of the local output file `fd`: its CRC-32s, block by block, from memory;
        returns the CRC-32 of the whole of `data` (joined from the blocks')."""
        crc = 0
        with memoryview(data) as raw, raw.cast("B") as view:
            for low, high in block_parts(start, start + len(view)):
                part = crc32(view[low - start:high - start])
                self.wrote(fd, low, high - low, part)
                crc = crc32_combine(crc, part, high - low)
        return crc

    def reading(self, entry: TensorEntry, box: Box | None = None) -> Tally:
        """A source tensor (or box of one) that a derived export reads itself: `add(view, view)` each slab, in
        row-major order, then `close()`. Read again (a second pass), it is recorded once."""
        return Tally(self, entry, entry.dtype, box)

    def read_whole(self, entry: TensorEntry, data: memoryview) -> None:
        """`entry` read in one piece into `data`."""
        tally = self.reading(entry)
        tally.add(data, data)
        tally.close()

    def record(self, tally: Tally) -> None:
        entry = tally.entry
        ranges = [[self._relative(c.data.uri), c.data.offset, c.data.length, list(c.offsets), list(c.sizes),
                   None if c.data.stride is None else list(c.data.stride)] for c in entry.chunks]
        piece: dict[str, Any] = {"box": box_key(tally.box), "dtype": entry.dtype, "shape": list(entry.shape),
                                 "out_dtype": tally.out_dtype, "ranges": ranges, "source_crc32": tally.src_crc,
                                 "crc32": tally.out_crc}
        if self.derived:
            del piece["out_dtype"], piece["crc32"]  # the output's own CRC-32s come from reading it back
            first = str(ranges[0][0]) if ranges else ""
            with self._lock:
                self.reads[(entry.name, str(piece["box"]), first)] = piece
            return
        with self._lock:
            self.pieces.setdefault(entry.name, []).append(piece)
            moments = tally.moments()  # an empty tensor's too
            if moments is not None:
                have = self.moments.get(entry.name)
                if have is None:
                    self.moments[entry.name] = moments
                else:
                    have[0].merge(moments[0])
                    if have[1] is not None and moments[1] is not None:
                        have[1].merge(moments[1])

    def _relative(self, uri: str) -> str:
        prefix = self.source + "/"
        return uri[len(prefix):] if uri.startswith(prefix) else uri

    def read_doc(self) -> dict[str, list[dict[str, Any]]]:
        """The source pieces a derived export read, by tensor name."""
        doc: dict[str, list[dict[str, Any]]] = {}
        for (name, _, _), piece in sorted(self.reads.items()):
            doc.setdefault(name, []).append(piece)
        return doc

    def certificate(self, view: CheckpointIndex) -> dict[str, Any]:
        """The manifest's certificate for an output holding the tensors of `view`."""
        tensors = {name: sorted(self.pieces.get(name, []), key=lambda p: str(p["box"])) for name in view.tensors}
        doc: dict[str, Any] = {"source": {"uri": self.source, "format": self.source_format},
                               "tensors": tensors}
        if self.stats:
            doc["stats"] = {name: side_by_side(src.result(), out.result() if out is not None else src.result())
                            for name, (src, out) in sorted(self.moments.items()) if name in view.tensors}
        return doc


def side_by_side(src: TensorStats, out: TensorStats) -> dict[str, Any]:
    a, b = src.to_dict(), out.to_dict()
    return {"source": a, "output": b, "check": compare(src, out)}


def compare(src: TensorStats, out: TensorStats) -> str:
    """`equal` when the statistics are the same, `within rounding` when a cast explains the difference,
    else `differs`."""
    keys = ("count", "nan", "posinf", "neginf", "zeros", "min", "max", "mean", "std", "l2")
    if all(getattr(src, k) == getattr(out, k) for k in keys):
        return "equal"
    if src.dtype == out.dtype or out.dtype not in ROUNDING:
        return "differs"
    if (src.count, src.nan) != (out.count, out.nan) or out.zeros < src.zeros:
        return "differs"
    u, tiny = ROUNDING[out.dtype] * 1.01, TINY[out.dtype]
    if src.posinf + src.neginf != out.posinf + out.neginf:
        return "differs"  # a cast that overflowed to infinity lost values
    scale = src.l2 / math.sqrt(max(src.count, 1))  # root mean square: the size of a typical value

    def near(x: float | int | None, y: float | int | None, size: float) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return abs(float(x) - float(y)) <= u * size + tiny

    return "within rounding" if (near(src.min, out.min, abs(float(src.min or 0)))
                                 and near(src.max, out.max, abs(float(src.max or 0)))
                                 and near(src.mean, out.mean, scale) and near(src.std, out.std, 2 * scale)
                                 and near(src.l2, out.l2, src.l2)) else "differs"


def certify(out: Any, copier: Any, view: CheckpointIndex) -> None:
    """Put the certificate of what `copier` read and wrote into `out`'s manifest (a single-file target's goes
    beside it: `write_sidecar`), with every output file's CRC-32."""
    ledger = copier.ledger
    if ledger is None:
        return
    file_crcs(out, ledger)
    out.about["certificate"] = ledger.certificate(view)


def certify_derived(out: Any, ledger: Ledger, written: dict[str, tuple[str, int]] | None = None) -> None:
    """The certificate of a derived export (`Ledger.derived`): what it read from the source, and each output
    tensor's CRC-32: from `written` (tensor -> (file, CRC-32), taken as the writer wrote it; the files' own
    CRC-32s joined from `Ledger.wrote`'s), else read back from the safetensors files with the files' own
    CRC-32s in one pass."""
    tensors: dict[str, list[dict[str, Any]]] = {}

    def spans_of(name: str, path: str) -> dict[str, tuple[int, int]]:
        return safetensors_spans(path) if path.endswith(".safetensors") else {}

    if written is not None:
        file_crcs(out, ledger)
        tensors = {tensor: [{"box": None, "crc32": crc, "file": name}] for tensor, (name, crc) in written.items()}
    else:
        for (name, spans), crcs in file_crcs(out, ledger, spans_of).items():
            for tensor, crc in zip(spans, crcs, strict=True):
                tensors[tensor] = [{"box": None, "crc32": crc, "file": name}]
    out.about["certificate"] = {"source": {"uri": ledger.source, "format": ledger.source_format},
                                "derived": ledger.derived, "tensors": dict(sorted(tensors.items())),
                                "read": ledger.read_doc()}


def safetensors_spans(path: str) -> dict[str, tuple[int, int]]:
    """Tensor name -> (start, end) bytes in a safetensors file this process has just written."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return {name: (8 + n + int(info["data_offsets"][0]), 8 + n + int(info["data_offsets"][1]))
            for name, info in header.items() if name != "__metadata__"}


def sidecar(target: str) -> str:
    """Where the manifest of the single-file output `target` lives."""
    return f"{target.rstrip('/')}.{MANIFEST}"


def write_sidecar(out: Any, kind: str) -> None:
    """Write a committed single-file output's manifest (its CRC-32s and certificate) beside it; locally under a
    temporary name first, so a reader never sees half of it."""
    if not out.single_file or "certificate" not in out.about:
        return
    where, data = sidecar(out.uri), out.manifest(kind)
    if not out.local:
        fs, _ = storage.filesystem(where)
        with storage.translate_errors(where, writing=True):
            fs.pipe_file(where, data)
        return
    path = storage.local_path(where)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def file_crcs(out: Any, ledger: Ledger | None = None,
              spans_of: Callable[[str, str], dict[str, tuple[int, int]]] | None = None) -> dict[Any, list[int]]:
    """Give every output file its CRC-32 in the manifest, and locally the CRC-32 of each `BLOCK` of it (so a
    damaged range can be named): a remote upload computed the file's; locally the file is read back (from the
    page cache), and in the same pass the CRC-32 of each byte range `ledger` deferred to it (`Ledger.defer`) and
    of each (name -> range) `spans_of(file name, path)` gives; returns {(file name, its spans): their CRC-32s}."""
    found: dict[Any, list[int]] = {}
    deferred = list(ledger.deferred) if ledger is not None else []
    done: set[int] = set()
    for name, info in out.files.items():
        if not out.local:
            continue
        path = out.path(name)
        spans = spans_of(name, path) if spans_of is not None else {}
        st = os.stat(path)
        mine = [i for i, d in enumerate(deferred) if d[1] == (st.st_dev, st.st_ino)]
        written = ledger.written.get((st.st_dev, st.st_ino)) if ledger is not None else None
        joined = None if READBACK or spans or mine or written is None else joined_crcs(written, st.st_size)
        if joined is not None:  # every byte of it was checksummed as it was written
            info["crc32"], info["blocks"] = joined
            found[(name, ())] = []
            continue
        ranges = list(spans.values()) + [(deferred[i][2], deferred[i][2] + deferred[i][3]) for i in mine]
        info["crc32"], info["blocks"], crcs = mapped_crcs(path, ranges, with_spans=True)
        found[(name, tuple(spans))] = crcs[:len(spans)]
        for i, crc in zip(mine, crcs[len(spans):], strict=True):
            deferred[i][0].add_crc(crc)
            done.add(i)
    for i, (tally, _, _, _, fallback) in enumerate(deferred):
        if i not in done:
            tally.add_crc(fallback())  # not in a file read back here: from the source, as the copy read it
        tally.close()
    if ledger is not None:
        ledger.deferred.clear()
        ledger.written.clear()
    return found


def mapped_crcs(path: str, spans: list[tuple[int, int]] | None = None, with_spans: bool = False) -> Any:
    """`block_crcs` of a local file, read through short mappings of the page cache (no copy into a buffer); with
    `with_spans`, also the CRC-32 of each (start, end) of `spans`, extended block by block over the same mapping."""
    whole, blocks = 0, []
    spans = spans or []
    found = [0] * len(spans)
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    first = 0  # spans before this one (in file order) ended before the current block
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for offset in range(0, size, BLOCK):
            end = min(offset + BLOCK, size)
            with mmap.mmap(fh.fileno(), end - offset, access=mmap.ACCESS_READ, offset=offset) as mapping, \
                    memoryview(mapping) as view:
                crc = crc32(view)
                while first < len(order) and spans[order[first]][1] <= offset:
                    first += 1
                for i in order[first:]:
                    start, stop = spans[i]
                    if start >= end:
                        break
                    low, high = max(start, offset), min(stop, end)
                    if low < high:
                        found[i] = crc32(view[low - offset:high - offset], found[i])
            whole = crc32_combine(whole, crc, end - offset)  # joined, not read twice
            blocks.append(crc)
    return (whole, blocks, found) if with_spans else (whole, blocks)


def block_crcs(readinto: Any, block: int = BLOCK) -> tuple[int, list[int]]:
    """(CRC-32 of a whole stream, the CRC-32 of each `block` bytes of it) from `readinto(view) -> n`."""
    whole, blocks = 0, []
    buf = memoryview(bytearray(min(block, STEP)))
    crc, filled = 0, 0
    while True:
        n = readinto(buf[:min(len(buf), block - filled)])
        if not n:
            break
        whole, crc, filled = crc32(buf[:n], whole), crc32(buf[:n], crc), filled + n
        if filled == block:
            blocks.append(crc)
            crc, filled = 0, 0
    if filled:
        blocks.append(crc)
    return whole, blocks


def source_files(ledger: Ledger) -> list[str]:
    """The source files the certificate names."""
    return sorted({r[0] for pieces in ledger.pieces.values() for p in pieces for r in p["ranges"]})


def source_uri(source: str, name: str) -> str:
    return name if "://" in name or name.startswith("/") else storage.join(source, name)
