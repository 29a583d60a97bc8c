"""A streaming writer for torch.save archives: uncompressed zip, storages aligned to 64 bytes, zip64
when needed, CRC computed while the bytes stream through (the header is patched afterwards)."""

from __future__ import annotations

import struct
import uuid
import zlib
from collections.abc import Iterable
from typing import BinaryIO

_ALIGN = 64
_U32 = 0xFFFFFFFF


class ZipWriter:
    """Writes one torch.save archive into `fh` starting at its current position."""

    def __init__(self, fh: BinaryIO, archive: str = "archive") -> None:
        self.fh = fh
        self.base = fh.tell()
        self.archive = archive
        self.entries: list[tuple[bytes, int, int, int, bool]] = []  # name, offset, size, crc, zip64

    def _header(self, name: bytes, size: int, crc: int, at: int) -> bytes:
        zip64 = size >= _U32
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        data_at = at + 30 + len(name) + len(extra)
        pad = (-(data_at + 4)) % _ALIGN
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        sizes = (_U32, _U32) if zip64 else (size, size)
        return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, crc, *sizes,
                           len(name), len(extra)) + name + extra

    def write_member(self, name: str, chunks: Iterable[bytes | memoryview], size: int) -> None:
        """Stream a member of known `size`; its CRC is patched into the header afterwards."""
        bname = f"{self.archive}/{name}".encode()
        at = self.fh.tell() - self.base
        header = self._header(bname, size, 0, at)
        self.fh.write(header)
        crc, written = 0, 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            written += len(chunk)
            self.fh.write(chunk)
        if written != size:
            raise ValueError(f"member {name}: wrote {written} bytes, expected {size}")
        end = self.fh.tell()
        self.fh.seek(self.base + at + 14)
        self.fh.write(struct.pack("<I", crc))
        self.fh.seek(end)
        self.entries.append((bname, at, size, crc, size >= _U32 or at >= _U32))

    def add(self, name: str, data: bytes) -> None:
        self.write_member(name, [data], len(data))

    def add_torch_records(self) -> None:
        for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"),
                            ("version", b"3"), (".data/serialization_id", uuid.uuid4().hex.encode() * 2)):
            self.add(name, value[:40] if name.endswith("serialization_id") else value)

    def close(self) -> int:
        """Write the central directory; return the archive's total length."""
        cd_start = self.fh.tell() - self.base
        for name, at, size, crc, zip64 in self.entries:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, at) if zip64 else b""
            sizes = (_U32, _U32, _U32) if zip64 else (size, size, at)
            self.fh.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if zip64 else 20, 0, 0, 0, 0x21,
                                      crc, sizes[0], sizes[1], len(name), len(extra), 0, 0, 0, 0, sizes[2])
                          + name + extra)
        cd_end = self.fh.tell() - self.base
        cd_size, count = cd_end - cd_start, len(self.entries)
        if cd_start >= _U32 or count >= 0xFFFF or any(e[4] for e in self.entries):
            self.fh.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size,
                                      cd_start))
            self.fh.write(struct.pack("<IIQI", 0x07064B50, 0, cd_end, 1))
            self.fh.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _U32, _U32, 0))
        else:
            self.fh.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
        return self.fh.tell() - self.base
