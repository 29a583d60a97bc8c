"""Early writeback: the disk starts on an output's bytes while the rest of it is still being copied.

A conversion's local outputs are synced by whoever waits for them (a user's `sync`, a job's commit) after the
command exits; left to that sync, the disk starts only once the copy is done. The writers tell `landed(fd, n)` of
each range they put into an output file; every `EVERY` bytes of a file, it asks the kernel to begin writing that
file's dirty pages (Linux's `sync_file_range(SYNC_FILE_RANGE_WRITE)` over the whole file: asynchronous, it does not
wait for the disk, and skips pages already on their way), so the writeback overlaps the copy instead of following
it. Issue 36, 1 GB FSDP2 DCP on 2 cores, `sync` included (interleaved A/B runs and `benchmarks/bench_convert.py
--cases cp,export,reshard` agree): export 1.42 -> 0.98 s, reshard 1.50 -> 1.05 s, against `cp -r` + sync 0.97 s; the
command itself exits ~0.05-0.1 s later, with ~0 s left for the sync (the block allocation and submission the
flusher did after it now run in it). One call per 32 MiB measured as well as per 8 or 16 MiB; a call per range
written (every few MiB, as each tensor landed) blocked the writer threads for up to 1 s in all. (Built once before
beside `copy_file_range` and taken out: the harness then measured it slower; with the writers' own buffered
writes, `Copier._through_buffer`, both measure it faster.)

Python's `os` lacks the call, so it goes through the C library. Where it is missing (not Linux, not glibc) or
refused (a filesystem without it: -1, ignored), nothing happens: the kernel's own writeback and the final sync still
write everything. Object-storage outputs never come here (the writers call it with local fds only).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

EVERY = 32 << 20  # bytes written into one file between two starts of its writeback
#: bytes per write system call. A larger write has the page cache allocate larger folios for it, which costs
#: compaction once free memory runs low (a full page cache, as on any machine that has been working): 1 GB written
#: in 2 MiB writes took 1.3-2.2 s of system time there against 0.47-0.67 s in 256 KiB writes (and 0.45-0.55 s by
#: copy_file_range, which writes 64 KiB at a time); with free memory both were ~0.1 s per 250 MB.
WRITE_STEP = 256 << 10
_WRITE = 2  # SYNC_FILE_RANGE_WRITE


def _call() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # no such call in this C library
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _call()
_lock = threading.Lock()
_written: dict[int, int] = {}  # output fd -> bytes written into it since its writeback last started


def landed(fd: int, nbytes: int) -> None:
    """`nbytes` more are written into the local file `fd`; once `EVERY` have been since the last time, start the
    writeback of all its dirty pages without waiting for it. (An fd reused for another file after a close carries
    the old count over: at most one early start.)"""
    if _SYNC_FILE_RANGE is None:
        return
    with _lock:
        total = _written.get(fd, 0) + nbytes
        due = total >= EVERY
        _written[fd] = 0 if due else total
    if due:
        _SYNC_FILE_RANGE(fd, 0, 0, _WRITE)  # offset 0, length 0: to the end of the file


class SteppedFile:
    """A local file opened for a sequential writer (`Output.open`): what is written reaches the kernel in steps of
    at most `WRITE_STEP` (smaller writes are still gathered by the file's buffer) and is told to `landed`, as the
    copier's positional writes are (`copier.pwrite_all`). Everything else is the file's own."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh

    def write(self, data: Any) -> int:
        with memoryview(data) as raw, raw.cast("B") as view:
            total = len(view)
            for start in range(0, total, WRITE_STEP):
                self._fh.write(view[start:start + WRITE_STEP])
        landed(self._fh.fileno(), total)
        return total

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)
