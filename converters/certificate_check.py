"""Re-check an output against the certificate in its manifest (`converters.certificate`), without the source.

Every output file is read once and its CRC-32 (and each block's, to name the damaged range) compared with the
manifest's; every tensor (or box) is read back through the output's own index and its CRC-32 compared with the
certificate's. When the source is still there, each source range the certificate names is read again and
compared with the CRC-32 of what the conversion read from it. Damage is one line each, naming the file and the
byte range.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from . import storage
from .certificate import BLOCK, block_crcs, sidecar, source_uri
from .checksum import crc32
from .copier import DEFAULT_MEMORY_LIMIT, Copier
from .errors import CkptError, FormatError
from .formats import load_index, read_json
from .index import ByteRange, Chunk, TensorEntry
from .names import MANIFEST


@dataclass
class CertificateReport:
    uri: str
    files: int = 0  # output files checked
    tensors: int = 0  # output tensors (boxes) checked
    source_ranges: int = 0  # source tensors (boxes) checked; 0 when the source is gone or not asked for
    notes: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # one line each: the file, the byte range, the tensor

    @property
    def ok(self) -> bool:
        return not self.damaged

    def summary(self) -> str:
        what = f"{self.files} files, {self.tensors} tensors" + (
            f", {self.source_ranges} source tensors" if self.source_ranges else "")
        if self.ok:
            return f"{self.uri} matches its certificate ({what})"
        return f"{self.uri}: {len(self.damaged)} mismatches with its certificate ({what} checked)"

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "ok": self.ok, "files": self.files, "tensors": self.tensors,
                "source_ranges": self.source_ranges, "notes": self.notes, "damaged": self.damaged,
                "summary": self.summary()}


def manifest_where(uri: str) -> tuple[str, str]:
    """(the manifest of the output at `uri`, the folder its `files` are in): a folder's own, or the one beside a
    single-file output (`certificate.sidecar`)."""
    where = storage.join(uri, MANIFEST)
    if storage.exists(where):
        return where, uri
    beside = sidecar(uri)
    if storage.exists(beside):
        return beside, storage.parent(uri)
    raise FormatError(f"{uri}: no {MANIFEST}, so nothing recorded to check against; only outputs of convert, "
                      "export and reshard carry a certificate", uri=uri)


def manifest_of(uri: str) -> dict[str, Any]:
    where, _ = manifest_where(uri)
    doc = read_json(where)
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise FormatError(f"{where}: not a ckpt-service manifest (no `files`); re-convert to get one", uri=where)
    return doc


def check_certificate(uri: str, with_source: bool = True, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                      files_only: bool = False) -> CertificateReport:
    """Check the output at `uri` against its manifest's CRC-32s and certificate (`files_only`: the files' CRC-32s
    alone, for an output without a certificate)."""
    uri = uri.rstrip("/")
    doc = manifest_of(uri)
    cert = doc.get("certificate")
    if not files_only and not isinstance(cert, dict):
        raise FormatError(f"{manifest_where(uri)[0]}: no certificate (written before certificates existed); "
                          "re-convert to get one", uri=uri)
    report = CertificateReport(uri)
    reader = storage.RangeReader()
    try:
        _check_files(manifest_where(uri)[1], doc["files"], reader, report)
        if files_only or not isinstance(cert, dict):
            return report
        _check_tensors(uri, str(doc.get("format") or ""), cert, reader, memory_limit, report)
        source = str(cert.get("source", {}).get("uri") or "")
        if with_source and source and storage.exists(source):
            _check_source(source, cert, reader, memory_limit, report)
        elif with_source:
            report.notes.append(f"source {source or '?'} is not there: checked the output alone")
        return report
    finally:
        reader.close()


def _check_files(uri: str, files: dict[str, Any], reader: storage.RangeReader, report: CertificateReport) -> None:
    for name, info in sorted(files.items()):
        want, size = info.get("crc32"), info.get("bytes")
        if want is None:
            continue
        where = storage.join(uri, name)
        report.files += 1
        try:
            got, blocks = block_crcs(_File(reader, where, int(size)).readinto)
            real = os.path.getsize(storage.local_path(where)) if storage.is_local(where) else size
        except CkptError as exc:
            report.damaged.append(f"{where}: cannot be read back ({exc})")
            continue
        if real != size:
            report.damaged.append(f"{where}: {real} bytes, the manifest says {size}")
        if got == want:
            continue
        recorded = info.get("blocks") or []
        bad = [i for i, crc in enumerate(blocks) if i >= len(recorded) or recorded[i] != crc] or [0]
        for i in bad:
            end = min(int(size), (i + 1) * BLOCK) if recorded else int(size)
            report.damaged.append(f"{where}: bytes {i * BLOCK}-{end} differ from the manifest's CRC-32")


class NoChecksums(FormatError):
    """A checkpoint without a manifest: nothing recorded with it to check it against."""


def scrub(uri: str, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> CertificateReport:
    """Re-read a stored output and compare it with its recorded checksums: the manifest's file CRC-32s, and
    every tensor's in its certificate where there is one (the source is not read). A checkpoint without a
    manifest has nothing recorded with it (DCP and safetensors files carry no checksums): NoChecksums (the
    service records a baseline for it instead, `converters.baseline`)."""
    uri = uri.rstrip("/")
    if not storage.exists(storage.join(uri, MANIFEST)) and not storage.exists(sidecar(uri)):
        raise NoChecksums(f"{uri}: no recorded checksums (no {MANIFEST}, as with any checkpoint a trainer wrote); "
                          f"submit a scrub job to the service (ckptctl submit scrub {uri}) to record a baseline "
                          "there, which later scrubs compare with", uri=uri)
    doc = manifest_of(uri)
    report = check_certificate(uri, with_source=False, memory_limit=memory_limit,
                               files_only=not isinstance(doc.get("certificate"), dict))
    report.notes = [n for n in report.notes if not n.startswith("source ")]
    return report


class _File:
    """`readinto` over the first `size` bytes of `uri`, front to back."""

    def __init__(self, reader: storage.RangeReader, uri: str, size: int) -> None:
        self.reader, self.uri, self.size, self.offset = reader, uri, size, 0

    def readinto(self, view: memoryview) -> int:
        n = max(0, min(len(view), self.size - self.offset))
        if n:
            self.reader.readinto(self.uri, self.offset, view[:n])
        self.offset += n
        return n


def _check_tensors(uri: str, fmt: str, cert: dict[str, Any], reader: storage.RangeReader, memory_limit: int,
                   report: CertificateReport) -> None:
    if not any("crc32" in piece for pieces in cert.get("tensors", {}).values() for piece in pieces):
        return  # a GGUF file's certificate names no tensors (the engine does not read GGUF): its files' CRC-32s do
    try:
        index = load_index(uri, fmt or None, reader=reader)
    except CkptError as exc:
        report.damaged.append(f"{uri}: its index cannot be read back ({exc})")
        return
    copier = Copier(reader, memory_limit)
    for name, pieces in cert.get("tensors", {}).items():
        entry = index.tensors.get(name)
        if entry is None:
            report.damaged.append(f"{uri}: tensor {name} of the certificate is not in the output")
            continue
        for piece in pieces:
            report.tensors += 1
            if found := _mismatch(copier, entry, piece, "crc32"):
                where, error = found
                report.damaged.append(f"{where} (output tensor {name}) " + (
                    f"cannot be read back ({error})" if error else "differ from the certificate"))


def _check_source(source: str, cert: dict[str, Any], reader: storage.RangeReader, memory_limit: int,
                  report: CertificateReport) -> None:
    copier = Copier(reader, memory_limit)
    # a copy's pieces name the ranges they were read from; a derived export lists what it read under `read`
    read = [(name, p) for name, pieces in cert.get("tensors", {}).items() for p in pieces if "ranges" in p] + \
        [(name, p) for name, pieces in cert.get("read", {}).items() for p in pieces]
    for name, piece in read:
        entry = TensorEntry(name, piece["dtype"], tuple(piece["shape"]), [
            Chunk(tuple(r[3]), tuple(r[4]), ByteRange(source_uri(source, r[0]), int(r[1]), int(r[2]),
                                                      None if r[5] is None else tuple(r[5])))
            for r in piece["ranges"]])
        report.source_ranges += 1
        if found := _mismatch(copier, entry, piece, "source_crc32"):
            where, error = found
            report.damaged.append(f"source {where} (tensor {name}) " + (
                f"cannot be read ({error})" if error else "differ from what the conversion read"))


def _box(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    return None if value is None else (tuple(value[0]), tuple(value[1]))


def _mismatch(copier: Copier, entry: TensorEntry, piece: dict[str, Any],
              key: str) -> tuple[str, CkptError | None] | None:
    """None when the bytes of `piece` (of `entry`) still have the CRC-32 recorded under `key`; else where they lie
    and the error that stopped their reading (None: they were read and differ)."""
    box = _box(piece.get("box"))
    crc = 0
    try:
        for block in copier.stream(entry, None, box):
            crc = crc32(block, crc)
    except CkptError as exc:
        return _where(entry, box), exc
    return None if crc == piece.get(key) else (_where(entry, box), None)


def _where(entry: TensorEntry, box: Any) -> str:
    """The file(s) and byte ranges holding `entry` (the chunks of `box`, when given)."""
    chunks = [c for c in entry.chunks if box is None or tuple(c.offsets) == tuple(box[0])] or entry.chunks
    return ", ".join(f"{c.data.uri} bytes {c.data.offset}-{c.data.offset + c.data.length}" for c in chunks)

