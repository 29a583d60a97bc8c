"""Moves tensor bytes from a source index to an output in bounded slabs, casting on the way.

Uncast local-to-local copies of whole-row chunks are handed to the writer as source ranges (`SourceRange`),
which it copies through a reused 2 MiB window buffer per thread (`Copier._through_buffer`: read, checksum
and statistics from the buffer, `pwrite`), faster than `copy_file_range` into ext4; the holes of a sparse
source are skipped (the output stays sparse; a CRC is extended over a hole without reading it). Everything
else is read in slabs of at most `slab_bytes` and written with `pwrite` at known offsets, so independent
tensors can be written by several threads at once; the writes into one output file take turns (the kernel
serialises them anyway).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from . import dtypes, writeback
from .checksum import crc32, crc32_combine, crc32_zeros
from .config import ContextPool
from .errors import SourceError
from .index import TensorEntry
from .rangeread import RangeReader
from .readahead import Budget, Buffer, ReadAhead
from .tensorio import Box, cast, direct_ranges, read_box, slabs
from .uris import is_local, local_path

if TYPE_CHECKING:
    from .certificate import Ledger, Tally

DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024
DEFAULT_THREADS = 4
_WINDOW = 2 << 20  # bytes read, checksummed and written at a time (a mapping's, to checksum a range)


@dataclass
class Progress:
    """Counts bytes and tensors done; `callback` (if any) gets the object after each step, one call at a
    time (writer threads share this object), each seeing the counts of its own step.

    A tensor written in pieces (a reshard: one box per rank holding it) counts as done once, with its last
    piece: `pieces` names how many each such tensor has (absent: one)."""

    total_bytes: int = 0
    total_tensors: int = 0
    done_bytes: int = 0
    done_tensors: int = 0
    callback: Callable[[Progress], None] | None = None
    pieces: dict[str, int] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def add(self, nbytes: int = 0, tensors: int = 0) -> None:
        with self._lock:
            self.done_bytes += nbytes
            self.done_tensors += tensors
            if self.callback is not None:
                self.callback(self)

    def piece_done(self, name: str) -> None:
        """One piece of tensor `name` is written; the tensor counts when its last piece is."""
        with self._lock:
            left = self.pieces.get(name, 1) - 1
            if left > 0:
                self.pieces[name] = left
                return
            self.pieces.pop(name, None)
            self.add(tensors=1)


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write all of `data` at `offset` of the local file `fd`, at most `writeback.WRITE_STEP` bytes per system
    call, then tell `writeback` (which starts the file's writeback every so many bytes)."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.pwrite(fd, view[:writeback.WRITE_STEP], offset)
        view, offset = view[n:], offset + n
    writeback.landed(fd, total)


def _truncated(path: str, end: int) -> SourceError:
    return SourceError(f"{path}: file is shorter than the checkpoint metadata says (wanted bytes up to {end}); it "
                       "is truncated: re-copy or re-upload it", uri=path)


@contextmanager
def settled(futures: Iterable[Future]) -> Iterator[None]:
    """The copier's copies running beside the block's own writes into one file: on leaving the block, every copy has
    ended (a failed one raises); on an error, the copies not started are cancelled and the running ones waited
    out, so no thread writes to the file after its owner closes it."""
    pending = list(futures)
    try:
        yield
        done, _ = wait(pending, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()
    finally:
        for future in pending:
            future.cancel()
        wait(pending)


def data_runs(fd: int, start: int, end: int) -> Iterator[tuple[int, int, bool, int]]:
    """(start, stop, is_data, data_end) runs covering [start, end) of file `fd`, from lseek(SEEK_DATA/SEEK_HOLE):
    data, or holes (which read as zeros); `data_end` is where a data run really ends, past `end` maybe. A
    filesystem without hole support reports all data. Offsets past the end of the file count as a hole."""
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # no SEEK_DATA here: treat everything as data
                yield pos, end, True, end
                return
            data = end  # no data from pos to the end of the file
        if data > pos:
            yield pos, min(data, end), False, pos
        if data >= end:
            return
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        yield data, min(hole, end), True, hole
        pos = hole


@dataclass(frozen=True)
class SourceRange:
    """Bytes to copy file to file (`Copier.copy_range`): `length` bytes of local `path` from `offset`. When the
    certificate already read them, `crc` is the running CRC-32 of the tensor's bytes through this piece, extended
    from `crc_before` (the copy takes it instead of reading them again)."""

    path: str
    offset: int
    length: int
    crc_before: int = 0
    crc: int | None = None
    tally: Tally | None = field(default=None, compare=False)  # takes the CRC-32 `copy_range` computes for it


def mapped_windows(fd: int, offset: int, length: int) -> Iterator[memoryview]:
    """A local file range as views of short page-cache mappings, one `_WINDOW` from each window's start (so
    every window but the last starts whole elements when `offset` does), each unmapped once the caller moves on: no
    page stays in this process's RSS, threads never unmap each other's pages, and no byte is copied into a buffer.
    The caller must not keep a view past its step."""
    end = offset + length
    while offset < end:
        low = offset - offset % mmap.ALLOCATIONGRANULARITY
        high = min(end, offset + _WINDOW)
        with mmap.mmap(fd, high - low, access=mmap.ACCESS_READ, offset=low) as mapping, \
                memoryview(mapping) as view, view[offset - low:] as part:
            yield part
        offset = high


class Copier:
    """Streams tensors as raw bytes; holds at most `slab_bytes` (plus its cast copy) per thread."""

    def __init__(self, reader: RangeReader, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                 progress: Progress | None = None, threads: int = DEFAULT_THREADS) -> None:
        self.reader = reader
        self.progress = progress or Progress()
        self.memory_limit = memory_limit
        self.threads = max(1, threads)
        # room for a source slab and its cast copy in every thread
        self.slab_bytes = max(64 * 1024, memory_limit // (3 * self.threads))
        self._local = threading.local()
        self._file_locks: dict[int, threading.Lock] = {}  # output fd -> its writers' turn
        self._locks_lock = threading.Lock()
        self._data_runs: dict[int, tuple[int, int]] = {}  # source fd -> a run of data in it (start, end)
        self.ahead = Budget(self.slab_bytes)  # remote reads ahead of uploads, all files together
        self.ledger: Ledger | None = None  # a conversion's certificate: what each tensor read and wrote

    def out_dtype(self, entry: TensorEntry, cast_to: str | None) -> str:
        if cast_to and entry.dtype in dtypes.FLOATING and entry.dtype != cast_to:
            return cast_to
        return entry.dtype

    def stream(self, entry: TensorEntry, cast_to: str | None = None, box: Box | None = None,
               buffer: Buffer | None = None) -> Iterator[memoryview]:
        """Yield the row-major bytes of `entry` (or of `entry[box]`), cast to `cast_to` if it is floating, each
        slab read into `buffer(n)` (default: this thread's reused slab, valid until the next step)."""
        out_dtype = self.out_dtype(entry, cast_to)
        item = dtypes.itemsize(entry.dtype)
        base, shape = box if box is not None else ((0,) * len(entry.shape), entry.shape)
        tally = self.ledger.open(entry, out_dtype, box) if self.ledger is not None else None
        for offsets, sizes in slabs(shape, item, self.slab_bytes):
            absolute = (tuple(b + o for b, o in zip(base, offsets)), sizes)
            view = (buffer or self._buffer)(dtypes.numel(sizes) * item)
            read_box(self.reader, entry, absolute, view)
            self.progress.add(len(view))
            written = cast(view, entry.dtype, out_dtype) if out_dtype != entry.dtype else view
            if tally is not None:
                tally.add(view, written)
            yield written
        if tally is not None:
            tally.close()
        self.progress.piece_done(entry.name)

    @contextmanager
    def in_order(self, jobs: Sequence[tuple[TensorEntry, str | None, Box | None]],
                 pool: ThreadPoolExecutor | None = None) -> Iterator[list[Iterable[memoryview]]]:
        """The blocks of each (entry, cast_to, box) of `jobs` (`stream`), one iterable per job, to be used in
        order (a file written front to back: an upload). From object storage, the jobs are read ahead in
        `pool`'s threads (or the copier's own), within `self.ahead` (one slab, shared by an output's files)."""
        remote = any(not is_local(chunk.data.uri) for entry, _, _ in jobs for chunk in entry.chunks)
        if not remote or len(jobs) < 2:
            yield [self.stream(entry, cast_to, box) for entry, cast_to, box in jobs]
            return
        streams = [partial(self.stream, entry, cast_to, box) for entry, cast_to, box in jobs]
        with ExitStack() as stack:
            if pool is None:
                pool = stack.enter_context(ContextPool(self.threads, thread_name_prefix="ckpt-ahead"))
            ahead = stack.enter_context(ReadAhead(pool, streams, self.ahead))
            yield [ahead.blocks(i) for i in range(len(jobs))]

    def pieces(self, entry: TensorEntry, cast_to: str | None = None, box: Box | None = None,
               as_ranges: bool = False, into: tuple[int, int] | None = None) -> Iterator[memoryview | SourceRange]:
        """Like `stream`, but when `as_ranges` allows and nothing needs reshaping or casting, yield
        `SourceRange`s (local source byte ranges) for the writer to copy (`copy_range`) instead of bytes. `into`
        (the local output fd and offset the caller writes the pieces at, one after the other) defers the CRC-32 to
        the certificate's read-back of the output (`Ledger.defer`); with statistics, each piece carries the
        running CRC-32 the certificate read with them through short mappings of the page cache (`SourceRange.crc`,
        which `write_at` takes as its own). Otherwise `copy_range` computes the CRC-32 (and the statistics) from
        the buffer it copies through, cut at the output's blocks, so the output's CRC-32s are joined, not read
        back, and hands it to the certificate (`SourceRange.tally`)."""
        ledger = self.ledger
        if as_ranges and self.out_dtype(entry, cast_to) == entry.dtype:
            ranges = direct_ranges(entry, box)
            if ranges is not None and all(is_local(uri) for uri, _, _ in ranges):
                tally = ledger.open(entry, entry.dtype, box) if ledger is not None else None
                defer = tally is not None and not tally.counts and into is not None
                copied = []
                crc = 0
                lazy = tally is not None and into is None
                for uri, offset, length in ranges:
                    piece = SourceRange(local_path(uri), offset, length)
                    if lazy and tally is not None:  # `copy_range` checksums it as it copies, where it lands
                        piece = SourceRange(piece.path, offset, length, crc, None, tally)
                        done = tally.copied
                        yield piece
                        if tally.copied == done:  # not copied by `copy_range`: from the source
                            tally.add_crc(self._range_crc(piece, tally, crc))
                        crc = tally.src_crc
                        copied.append(piece)
                        self.progress.add(length)
                        continue
                    if tally is not None and not defer:  # through the page cache, as the copy itself reads it
                        piece = SourceRange(piece.path, offset, length, crc, self._range_crc(piece, tally, crc))
                        crc = piece.crc or 0
                        tally.add_crc(crc)
                    copied.append(piece)
                    yield piece
                    self.progress.add(length)
                if ledger is not None and tally is not None and into is not None and defer:
                    ledger.defer(tally, into[0], into[1], sum(p.length for p in copied),
                                 partial(self._pieces_crc, copied))
                elif tally is not None:
                    tally.close()
                self.progress.piece_done(entry.name)
                return
        yield from self.stream(entry, cast_to, box)

    def copy_range(self, piece: SourceRange, fd: int, dst: int, crc: int = 0) -> int:
        """Copy `piece` into `fd` at `dst` (`_copy`); return `crc` extended over it (`piece.crc` when the
        certificate already read it from `crc`, else computed from the buffer it is copied through; over a hole,
        computed without reading)."""
        if piece.crc is not None and crc == piece.crc_before:  # the caller's CRC-32 runs as the certificate's
            self._copy(piece, fd, dst, None)
            return piece.crc
        takes = piece.tally is not None and crc == piece.crc_before  # the certificate's CRC-32 runs as the caller's
        out = self._copy(piece, fd, dst, crc, piece.tally if takes else None)
        if takes and piece.tally is not None:
            piece.tally.add_crc(out)
        return out

    def _copy(self, piece: SourceRange, fd: int, dst: int, crc: int | None, tally: Tally | None = None) -> int:
        """Copy `piece` into `fd` at `dst` (whose range must still be zeros: outputs are new files) through this
        thread's window buffer (`_through_buffer`); extend `crc` (unless None) over every byte, and with `tally`
        take the piece's statistics. A sparse piece's holes are skipped (the output stays sparse; the CRC-32 is
        extended over a hole without reading it, `_noted_zeros`, except with statistics, which read the piece
        whole for whole elements), and a range ending in a hole gets its last byte written, so the file is as
        long as a dense copy would make it."""
        src_fd = self.reader.fd(piece.path)
        end = piece.offset + piece.length
        if end > os.fstat(src_fd).st_size:
            raise _truncated(piece.path, end)
        runs = list(self._runs(src_fd, piece.offset, end))
        counts = tally if tally is not None and tally.counts else None
        if len(runs) == 1 and runs[0][2]:  # dense: the common case
            return self._through_buffer(piece.path, piece.offset, piece.length, fd, dst, crc, counts, True) or 0
        runs_crc = crc
        if counts is not None:  # windows from the piece's start hold whole elements (its holes read as zeros)
            crc = self._through_buffer(piece.path, piece.offset, piece.length, fd, dst, crc, counts, False)
            runs_crc = None
        for start, stop, is_data in runs:
            at = dst + start - piece.offset
            if is_data:
                runs_crc = self._through_buffer(piece.path, start, stop - start, fd, at, runs_crc, None, True)
            elif runs_crc is not None:
                runs_crc = self._noted_zeros(fd, at, stop - start, runs_crc)
        if runs and not runs[-1][2]:
            self._pwrite(fd, b"\0", dst + piece.length - 1)
        return (crc if counts is not None else runs_crc) or 0

    def _noted_zeros(self, fd: int, at: int, length: int, crc: int) -> int:
        """`crc` extended over `length` zero bytes (a hole) at `at` of the output `fd`, without reading them; with a
        certificate, noted block by block (`Ledger.wrote`), as written bytes are."""
        ledger = self.ledger
        if ledger is None:
            return crc32_zeros(length, crc)
        from .certificate import block_parts

        for low, high in block_parts(at, at + length):
            n = high - low
            part = crc32_zeros(n)
            ledger.wrote(fd, low, n, part)
            crc = crc32_combine(crc, part, n)
        return crc

    def _through_buffer(self, path: str, offset: int, length: int, fd: int, at: int, crc: int | None,
                        tally: Tally | None, write: bool) -> int | None:
        """Copy `length` bytes of local `path` from `offset` to `at` in the output `fd` through this thread's
        window buffer (`_read_windows`; unless not `write`: only read, for the checksum and statistics); return
        `crc` extended over them (None: not computed), each window's CRC-32s noted block by block (`_noted_crc`),
        so the output's CRC-32s are joined, not read back; `tally` takes their values (statistics).

        Not `copy_file_range`: into ext4 it splices through a pipe a few pages at a time, which cost ~1.5x the
        system time of a read and a write of the same bytes and left ~30 % more writeback for a `sync` (1 GB
        FSDP2 DCP to safetensors, 2 cores: sys 0.75 -> 0.52 s, exit 1.0 -> 0.73 s, exit + sync 1.55 -> 1.18 s),
        and checksumming its bytes meant faulting in mappings of the source besides; from the buffer the CRC-32
        and the statistics read bytes already in cache. 2 MiB windows measured best (1 MiB ones: the reshard 20-50 %
        slower; 4-8 MiB ones, then written whole, doubled the system time: see `writeback.WRITE_STEP`)."""
        for part in self._read_windows(path, offset, length):
            if tally is not None:
                tally.add_values(part)
            if crc is not None:
                crc = self._noted_crc(fd, at, part, crc)
            if write:
                self._pwrite(fd, part, at)
            at += len(part)
        return crc

    def _read_windows(self, path: str, offset: int, length: int) -> Iterator[memoryview]:
        """A local file range read `_WINDOW` at a time (whole elements when `offset` starts one) into this
        thread's reused window buffer, each view valid until the next step. For statistics, which pass over each
        window several times, a read into a buffer that stays in cache costs less than faulting in a mapping of
        the page cache (1 GB of float32: about 0.4 CPU s against 0.5)."""
        buf = getattr(self._local, "window", None)
        if buf is None:
            buf = self._local.window = bytearray(_WINDOW)
        with memoryview(buf) as view:
            end = offset + length
            while offset < end:
                n = min(_WINDOW, end - offset)
                with view[:n] as part:
                    self.reader.readinto(path, offset, part)
                    yield part
                offset += n

    def note(self, fd: int, offset: int, data: bytes | bytearray | memoryview) -> None:
        """`data` is written at `offset` of the local output `fd` by its writer (headers, records): the certificate
        takes its CRC-32s from memory (`Ledger.wrote_bytes`)."""
        if self.ledger is not None:
            self.ledger.wrote_bytes(fd, offset, data)

    def _noted_crc(self, fd: int, offset: int, data: memoryview, crc: int) -> int:
        """`crc` extended over `data`, written at `offset` of `fd`; with a certificate, noted block by block too."""
        if self.ledger is None:
            return crc32(data, crc)
        return crc32_combine(crc, self.ledger.wrote_bytes(fd, offset, data), data.nbytes)

    def write_noted(self, fd: int, data: memoryview, offset: int) -> int:
        """Write `data` at `offset` of the local output `fd` (in turn with the other writers of it); return its
        CRC-32, taken from memory and with a certificate noted block by block (`Ledger.wrote`)."""
        crc = self._noted_crc(fd, offset, data, 0)
        self._pwrite(fd, data, offset)
        return crc

    def _runs(self, fd: int, start: int, end: int) -> Iterator[tuple[int, int, bool]]:
        """Data runs and holes covering [start, end) of the file `fd`. The data run last seen in each file is
        remembered (threads share it), so that the many ranges of a dense file cost no system call."""
        known = self._data_runs.get(fd)
        if known is not None and known[0] <= start and end <= known[1]:
            yield start, end, True
            return
        for run in data_runs(fd, start, end):
            if run[2]:
                self._data_runs[fd] = (run[0], run[3])
            yield run[:3]

    def _turn(self, fd: int) -> threading.Lock:
        """The lock that writers of output `fd` take in turn. The kernel writes to one file one writer at a time
        anyway (ext4, xfs: the inode lock), and writers that wait for it there spin on CPU; waiting here sleeps.
        Reads, casts and checksums still run side by side."""
        lock = self._file_locks.get(fd)
        if lock is None:
            with self._locks_lock:
                lock = self._file_locks.setdefault(fd, threading.Lock())
        return lock

    def _pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> None:
        with self._turn(fd):
            pwrite_all(fd, data, offset)

    def _mapped_crc(self, path: str, offset: int, length: int, crc: int) -> int:
        """CRC-32 of a local file range, read through the page cache without a copy (`mapped_windows`)."""
        for part in mapped_windows(self.reader.fd(path), offset, length):
            crc = crc32(part, crc)
        return crc

    def _pieces_crc(self, pieces: list[SourceRange]) -> int:
        crc = 0
        for piece in pieces:
            crc = self._mapped_crc(piece.path, piece.offset, piece.length, crc)
        return crc

    def _range_crc(self, piece: SourceRange, tally: Tally, crc: int) -> int:
        """`crc` extended over `piece`'s bytes, read through the page cache (a hole's computed without reading it);
        with statistics, `tally` takes their values in the same pass."""
        src_fd = self.reader.fd(piece.path)
        end = piece.offset + piece.length
        if end > os.fstat(src_fd).st_size:
            raise _truncated(piece.path, end)
        if tally.counts:
            return self._mapped_tally(piece.path, piece.offset, piece.length, tally, crc)
        for start, stop, is_data in self._runs(src_fd, piece.offset, end):
            crc = self._mapped_crc(piece.path, start, stop - start, crc) if is_data else crc32_zeros(stop - start, crc)
        return crc

    def _mapped_tally(self, path: str, offset: int, length: int, tally: Tally, crc: int) -> int:
        """`tally.add_values` each window of a local file range as mapped from the page cache (windows cut at
        whole elements: `offset` starts one, `_WINDOW` is a multiple of every element size); return `crc`
        extended over the range, in the same mapping."""
        for part in mapped_windows(self.reader.fd(path), offset, length):
            crc = crc32(part, crc)
            tally.add_values(part)
        return crc

    def _buffer(self, nbytes: int) -> memoryview:
        """This thread's reusable slab buffer (valid until its next `stream` step): no page faults per slab."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(max(nbytes, min(self.slab_bytes, 1 << 20)))
        return memoryview(buf)[:nbytes]

    def write_at(self, fd: int, offset: int, entry: TensorEntry, cast_to: str | None = None,
                 box: Box | None = None, checksum: bool = False) -> int:
        """Write the bytes of `entry` (or `entry[box]`) into the local file `fd` at `offset`; return their
        CRC-32 with `checksum` (computed on the bytes in flight, in the slab or window buffer they are
        copied through), else 0."""
        crc = 0
        track = checksum or self._joins()
        for piece in self.pieces(entry, cast_to, box, as_ranges=True, into=None if track else (fd, offset)):
            if isinstance(piece, SourceRange):
                if track:
                    crc = self.copy_range(piece, fd, offset, crc)
                else:
                    self._copy(piece, fd, offset, None)
                offset += piece.length
            else:
                if track:
                    crc = self._noted_crc(fd, offset, piece, crc)
                self._pwrite(fd, piece, offset)
                offset += len(piece)
        return crc if checksum else 0

    def _joins(self) -> bool:
        """Whether the certificate joins the output's CRC-32s from those of the bytes written (`Ledger.written`):
        checksummed in the writer threads as they are copied, instead of one pass reading the output back after.
        With statistics too (taken from the same buffer, `_through_buffer`). Not for a derived export (it reads its
        files back for each tensor's CRC-32), nor in the paranoid mode that re-reads every output file."""
        from . import certificate

        ledger = self.ledger
        return ledger is not None and not ledger.derived and not certificate.READBACK

    def write_many(self, fd: int, jobs: list[tuple[int, TensorEntry, str | None]], pool: ThreadPoolExecutor,
                   checksum: bool = False) -> list[int]:
        """`write_at` for every (offset, entry, cast_to) side by side in `pool`; their CRC-32s with `checksum`.

        Every write has stopped when this returns or raises (the first error; writes not yet started are
        dropped), so no thread writes to `fd` after its owner closed it."""
        futures = [pool.submit(self.write_at, fd, offset, entry, cast_to, None, checksum)
                   for offset, entry, cast_to in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for future in futures:
                future.cancel()
            wait(futures)
        return [future.result() for future in futures]
