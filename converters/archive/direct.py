"""A local file that restore's workers write in place, each a whole chunk at its offset, through direct I/O
(O_DIRECT) where the filesystem takes it.

Direct I/O moves a chunk's blocks from the worker's buffer to the disk: no copy into the page cache and no
writeback after it (in a buffered restore these were the largest costs: ~40% of its CPU copying into the page
cache, then the writeback that a `sync` waits for). It asks for the buffer's address, the file offset and the
length in multiples of `ALIGN`: a worker decodes a chunk at offset % ALIGN of an aligned buffer (`aligned`), so
the chunk's whole blocks go straight from there; the blocks it shares with its neighbours (its first and last,
in part) are gathered here and written once complete, the file's last block whole, the file then cut to its size.
A filesystem that refuses direct I/O (at open, or EINVAL on a write) is written through the page cache instead.
What direct I/O writes is not left in the page cache.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

ALIGN = 4096  # the block size direct I/O aligns to (the largest logical block size of common devices)
_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned(size: int) -> np.ndarray:
    """A uint8 buffer of `size` bytes starting at an address that is a multiple of ALIGN."""
    raw = np.empty(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size]


class DirectFile:
    """The file at `path` (created, or truncated) that will hold `size` bytes, written by several threads."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.lock = threading.Lock()
        self.shared: dict[int, tuple[np.ndarray, list[tuple[int, int]]]] = {}  # block -> its bytes, ranges held
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = bool(_DIRECT)
        try:
            self.fd = os.open(path, flags | _DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o600)

    def write(self, data: np.ndarray, offset: int) -> None:
        """Writes `data` (uint8) at `offset`; its address must be `offset` modulo ALIGN (see `aligned`)."""
        end = offset + len(data)
        with self.lock:
            if not self.direct:
                _pwrite(self.fd, data, offset)
                return
            if data.ctypes.data % ALIGN != offset % ALIGN:
                raise ValueError("data not placed at its offset modulo ALIGN")
            first, last = -(-offset // ALIGN) * ALIGN, end // ALIGN * ALIGN  # [first, last): its whole blocks
            if first < last:
                self._direct(data[first - offset:last - offset], first)
            pieces = [(offset, end)] if first > last else [
                *([(offset, first)] if offset < first else []), *([(last, end)] if last < end else [])]
            for start, stop in pieces:
                if self.direct:
                    self._gather(data[start - offset:stop - offset], start, stop)
                else:  # refused just now: the rest of the chunk through the page cache too
                    _pwrite(self.fd, data[start - offset:stop - offset], start)

    def _gather(self, part: np.ndarray, start: int, stop: int) -> None:
        """Bytes [start, stop) of a block others share: written when the block is complete."""
        block = start // ALIGN * ALIGN
        buf, held = self.shared.setdefault(block, (aligned(ALIGN), []))
        buf[start - block:stop - block] = part
        held.append((start, stop))
        if sum(b - a for a, b in held) == min(ALIGN, self.size - block):
            del self.shared[block]
            self._direct(buf, block)  # the file's last block whole: cut to the file's size at the end

    def _direct(self, data: np.ndarray, offset: int) -> None:
        if self.direct:
            try:
                _pwrite(self.fd, data, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._buffered()
        _pwrite(self.fd, data, offset)

    def _buffered(self) -> None:
        """From now on through the page cache (this filesystem refuses the alignment); what was gathered for shared
        blocks is written as it is."""
        fd = os.open(self.path, os.O_WRONLY)
        os.close(self.fd)
        self.fd, self.direct = fd, False
        for block, (buf, held) in self.shared.items():
            for start, stop in held:
                _pwrite(self.fd, buf[start - block:stop - block], start)
        self.shared.clear()

    def close(self, mode: int | None = None) -> None:
        """Cuts the file to its size (a last block written whole) and gives it `mode`, when given (a complete
        file); closes it."""
        try:
            if mode is not None:
                if self.shared:
                    raise ValueError(f"{self.path}: blocks {sorted(self.shared)} were not written whole")
                os.ftruncate(self.fd, self.size)
                os.fchmod(self.fd, mode)
        finally:
            os.close(self.fd)


def _pwrite(fd: int, data: np.ndarray | bytes | memoryview, offset: int) -> None:
    view = memoryview(data)  # type: ignore[arg-type]
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
