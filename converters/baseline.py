"""Checksums for checkpoints we did not write (a DCP step, a DeepSpeed folder, a torch file: no manifest).

`record_baseline` reads every file once and records its size, modification time, CRC-32 and a CRC-32 per
16 MiB block (local files through short page-cache mappings, as the copier checksums: flat memory);
`compare_baseline` reads them again and names each file and byte range that differs. The baseline is kept by
the caller (the service registry), never written into the checkpoint's folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from . import storage
from .certificate import BLOCK, block_crcs, mapped_crcs
from .certificate_check import CertificateReport, _File
from .errors import CkptError


@dataclass
class BaselineReport(CertificateReport):
    recorded_at: float = 0.0
    recorded_now: bool = False  # this scrub recorded the baseline (nothing compared yet)

    def summary(self) -> str:
        when = stamp(self.recorded_at)
        if self.recorded_now:
            return f"{self.uri}: baseline recorded at {when} ({self.files} files)"
        if self.ok:
            return f"{self.uri} matches its baseline of {when} ({self.files} files)"
        return f"{self.uri}: {len(self.damaged)} mismatches with its baseline of {when} ({self.files} files checked)"


def stamp(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _folder_and_names(uri: str) -> tuple[str, list[str]]:
    """(the folder the names are relative to, the checkpoint's files: every regular file under a folder, or the
    one file)."""
    if not storage.isdir(uri):
        storage.size(uri)  # a missing file or one outside the read roots says so here
        return storage.parent(uri), [storage.basename(uri)]
    names: list[str] = []
    if storage.is_local(uri):
        storage.check_roots(uri)
        root = storage.local_path(uri)
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    names.append(os.path.relpath(path, root).replace(os.sep, "/"))
        return uri, names
    pending = [""]
    while pending:
        prefix = pending.pop()
        for name in storage.listdir(storage.join(uri, prefix) if prefix else uri):
            rel = f"{prefix}/{name}" if prefix else name
            (pending.append if storage.isdir(storage.join(uri, rel)) else names.append)(rel)
    return uri, sorted(names)


def _stat(where: str) -> tuple[int, int | None]:
    """(size, modification time in ns; None where the storage keeps none we read)."""
    if storage.is_local(where):
        info = os.stat(storage.local_path(where))
        return info.st_size, info.st_mtime_ns
    return storage.size(where), None


def _crcs(where: str, size: int, reader: storage.RangeReader) -> tuple[int, list[int]]:
    if storage.is_local(where):
        return mapped_crcs(storage.local_path(where))
    return block_crcs(_File(reader, where, size).readinto)


def record_baseline(uri: str) -> dict[str, Any]:
    """Every file of the checkpoint at `uri` with its size, mtime_ns, CRC-32 and block CRC-32s."""
    uri = uri.rstrip("/")
    folder, names = _folder_and_names(uri)
    files: dict[str, Any] = {}
    reader = storage.RangeReader()
    try:
        for name in names:
            where = storage.join(folder, name)
            size, mtime = _stat(where)
            whole, blocks = _crcs(where, size, reader)
            files[name] = {"bytes": size, "mtime_ns": mtime, "crc32": whole, "blocks": blocks}
    finally:
        reader.close()
    return {"block": BLOCK, "files": files}


def compare_baseline(uri: str, baseline: dict[str, Any], recorded_at: float) -> BaselineReport:
    """Re-read the checkpoint at `uri` and compare it with `baseline` (`record_baseline`'s): one line per file that
    is gone, new, rewritten (size or mtime changed: a checkpoint should not change, so that counts as damage too)
    or whose bytes differ (naming each differing BLOCK range)."""
    uri = uri.rstrip("/")
    report = BaselineReport(uri, recorded_at=recorded_at)
    when = stamp(recorded_at)
    recorded: dict[str, Any] = baseline.get("files") or {}
    block = int(baseline.get("block") or BLOCK)
    try:
        folder, names = _folder_and_names(uri)
    except CkptError as exc:
        report.damaged.append(f"{uri}: cannot be read back ({exc})")
        return report
    for name in sorted(set(names) - set(recorded)):
        report.damaged.append(f"{storage.join(folder, name)}: new since the baseline of {when}; a checkpoint should "
                              "not change, so this counts as damage")
    reader = storage.RangeReader()
    try:
        for name, info in sorted(recorded.items()):
            where = storage.join(folder, name)
            report.files += 1
            if name not in names:
                report.damaged.append(f"{where}: gone since the baseline of {when}")
                continue
            _compare_file(where, info, block, when, reader, report)
    finally:
        reader.close()
    return report


def _compare_file(where: str, info: dict[str, Any], block: int, when: str, reader: storage.RangeReader,
                  report: BaselineReport) -> None:
    try:
        size, mtime = _stat(where)
        whole, blocks = _crcs(where, size, reader) if block == BLOCK else block_crcs(
            _File(reader, where, size).readinto, block)
    except (CkptError, OSError) as exc:
        report.damaged.append(f"{where}: cannot be read back ({exc})")
        return
    want_size, want_mtime = int(info["bytes"]), info.get("mtime_ns")
    changes = ([f"{want_size} bytes then, {size} now"] if size != want_size else []) + (
        ["modified since"] if want_mtime is not None and mtime is not None and mtime != want_mtime else [])
    if changes:
        report.damaged.append(f"{where}: changed since the baseline of {when} ({', '.join(changes)}): rewritten "
                              "after it was recorded; a checkpoint should not change, so this counts as damage")
    if whole == info.get("crc32") and size == want_size:
        return
    want = info.get("blocks") or []
    for i in range(max(len(want), len(blocks))):
        if i >= len(want) or i >= len(blocks) or want[i] != blocks[i]:
            end = min(max(size, want_size), (i + 1) * block)
            report.damaged.append(f"{where}: bytes {i * block}-{end} differ from the baseline's CRC-32 of {when}")
