"""A streaming writer for torch.save archives: uncompressed zip, storages aligned to 64 bytes, zip64
when needed. It never seeks: sizes are known up front and go in the local headers, the CRC is computed
while the bytes stream through and written in a data descriptor after them (general purpose bit 3),
so the same code writes to a local file or straight into an object-store upload."""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from .checksum import crc32
from .copier import pwrite_all

_ALIGN = 64
_U32 = 0xFFFFFFFF
_FLAGS = 0x08  # CRC-32 in a data descriptor after the data


def serial_id(base: str | None = None, *names: object) -> str:
    """A random archive id; or, from `base` and `names`, a derived one: a plan picks one base for all its
    archives, so that every executor (threads here, or tasks on other hosts) writes the same bytes."""
    if base is None:
        return uuid.uuid4().hex
    return hashlib.sha256(":".join(map(str, (base, *names))).encode()).hexdigest()[:32]


def _descriptor(crc: int, size: int) -> bytes:
    """The data descriptor after a member's bytes (zip64 sizes for a member of 4 GiB or more)."""
    return struct.pack("<IIQQ" if size >= _U32 else "<IIII", 0x08074B50, crc, size, size)


@dataclass(frozen=True)
class Slot:
    """A reserved member: its index in the directory, where its bytes go in the file, and how many."""

    entry: int
    data_at: int
    size: int


_GATHER = 64 * 1024


class ZipWriter:
    """Writes one torch.save archive into `fh` (sequential writes only), from its current position."""

    def __init__(self, fh: BinaryIO, archive: str = "archive", start: int | None = None,
                 note: Callable[[int, bytes | bytearray | memoryview], None] | None = None) -> None:
        self.fh = fh
        self.note = note  # told (file offset, bytes) of everything written here (a certificate's CRC-32s)
        self.base = fh.tell() if start is None else start
        self.pos = 0  # bytes written so far, relative to the archive start
        self.archive = archive
        self.entries: list[tuple[bytes, int, int, int, bool]] = []  # name, offset, size, crc, zip64
        self.pending = bytearray()  # headers and small members not yet written: they go with the next bytes

    def _write(self, data: bytes | memoryview) -> None:
        """Write `data` at the archive's position; small pieces (headers, descriptors, the small members of a DCP
        record, about 17 a record) are gathered into one write with what follows them."""
        view = memoryview(data).cast("B")
        if len(view) < _GATHER:
            self.pending += view
        else:
            self._flush()
            self.fh.write(view)
            if self.note is not None:
                self.note(self.base + self.pos, view)
        self.pos += len(view)

    def _flush(self) -> None:
        """Write what `_write` gathered (before the file is used any other way: a seek, a kernel copy, the end)."""
        if self.pending:
            self.fh.write(self.pending)
            if self.note is not None:  # the gathered bytes end at the archive's position
                self.note(self.base + self.pos - len(self.pending), self.pending)
            self.pending = bytearray()

    def _header(self, name: bytes, size: int, at: int) -> bytes:
        zip64 = size >= _U32
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        data_at = self.base + at + 30 + len(name) + len(extra)
        pad = (-(data_at + 4)) % _ALIGN
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        sizes = (_U32, _U32) if zip64 else (size, size)
        return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, _FLAGS, 0, 0, 0x21, 0, *sizes,
                           len(name), len(extra)) + name + extra

    def write_member(self, name: str, chunks: Iterable[Any], size: int,
                     copy_range: Callable[[Any, int, int, int], int] | None = None) -> None:
        """Stream a member of known `size`. Chunks are bytes, or (with `copy_range`) source ranges that
        `copy_range(chunk, fd, offset, crc)` copies into this file in the kernel, returning the running CRC."""
        bname = f"{self.archive}/{name}".encode()
        at = self.pos
        self._write(self._header(bname, size, at))
        crc, written = 0, 0
        for chunk in chunks:
            if copy_range is not None and not isinstance(chunk, bytes | bytearray | memoryview):
                self._flush()
                self.fh.flush()
                crc = copy_range(chunk, self.fh.fileno(), self.base + self.pos, crc)
                written += chunk.length
                self.pos += chunk.length
                self.fh.seek(self.base + self.pos)
                continue
            view = memoryview(chunk).cast("B")
            crc = crc32(view, crc)
            written += len(view)
            self._write(view)
        if written != size:
            raise ValueError(f"member {name}: wrote {written} bytes, expected {size}")
        self._write(_descriptor(crc, size))
        self.entries.append((bname, at, size, crc, size >= _U32 or at >= _U32))

    def reserve(self, name: str, size: int) -> Slot:
        """Lay out a member of known `size` now and leave its bytes to be filled later, by any thread, with
        `pwrite` at `slot.data_at` (a local file only); `settle(slot, crc)` then writes its descriptor. The
        archive's bytes are the same as `write_member` writes."""
        bname = f"{self.archive}/{name}".encode()
        at = self.pos
        self._write(self._header(bname, size, at))
        slot = Slot(len(self.entries), self.base + self.pos, size)
        self.entries.append((bname, at, size, 0, size >= _U32 or at >= _U32))
        self._flush()
        self.pos += size + len(_descriptor(0, size))
        self.fh.seek(self.base + self.pos)
        return slot

    def settle(self, slot: Slot, crc: int) -> None:
        """The CRC-32 of a reserved member's bytes, once they are written: into its descriptor and directory entry."""
        bname, at, size, _, zip64 = self.entries[slot.entry]
        self.entries[slot.entry] = (bname, at, size, crc, zip64)
        descriptor = _descriptor(crc, size)
        pwrite_all(self.fh.fileno(), descriptor, slot.data_at + size)
        if self.note is not None:
            self.note(slot.data_at + size, descriptor)

    def add(self, name: str, data: bytes) -> None:
        self.write_member(name, [data], len(data))

    def add_torch_records(self, serial: str | None = None) -> None:
        """The records torch.save ends with; `serial` is the archive's id (random, as torch's, by default)."""
        for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"),
                            ("version", b"3"), (".data/serialization_id", (serial or serial_id()).encode()[:40])):
            self.add(name, value)

    def close(self) -> int:
        """Write the central directory; return the archive's total length."""
        cd_start = self.pos
        for name, at, size, crc, zip64 in self.entries:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, at) if zip64 else b""
            sizes = (_U32, _U32, _U32) if zip64 else (size, size, at)
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if zip64 else 20, _FLAGS, 0, 0, 0x21,
                                    crc, sizes[0], sizes[1], len(name), len(extra), 0, 0, 0, 0, sizes[2])
                        + name + extra)
        cd_end = self.pos
        cd_size, count = cd_end - cd_start, len(self.entries)
        if cd_start >= _U32 or count >= 0xFFFF or any(e[4] for e in self.entries):
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start))
            self._write(struct.pack("<IIQI", 0x07064B50, 0, cd_end, 1))
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _U32, _U32, 0))
        else:
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
        self._flush()
        return self.pos
