"""The files of a checkpoint to archive (local folder or file, or remote prefix) and reads of their bytes."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import IO, Any

from ..certificate import sidecar
from ..errors import SourceError
from ..pathsafety import bad_name
from ..remote import filesystem, translate_errors
from ..uris import basename, is_local, join, local_path


@dataclass(frozen=True)
class SourceFile:
    name: str  # relative to the checkpoint ('/'-separated); a single-file checkpoint: its base name
    uri: str
    size: int
    mode: int


def list_files(source: str) -> tuple[list[SourceFile], bool]:
    """The checkpoint's files, sorted by name, and whether `source` is a single file. A single file's manifest
    beside it (`<file>.ckpt-manifest.json`, `certificate.sidecar`: an output of ours, its CRC-32s and certificate)
    follows it, so a restore gives the file back certified."""
    source = source.rstrip("/")
    if is_local(source):
        return _local(local_path(source))
    fs, path = filesystem(source)
    with translate_errors(source):
        if fs.isfile(path):
            info = fs.info(path)
            files = [SourceFile(basename(source), source, int(info["size"]), 0o644)]
            beside = sidecar(source)
            _, beside_path = filesystem(beside)
            if fs.isfile(beside_path):
                files.append(SourceFile(sidecar(basename(source)), beside, int(fs.info(beside_path)["size"]), 0o644))
            return files, True
        found = fs.find(path, detail=True)
    if not found:
        raise SourceError(f"archive: {source} holds no files; give a checkpoint folder or file", uri=source)
    own = source.split("://", 1)[1]
    files = []
    for name, info in found.items():
        rel = name.split("://", 1)[-1][len(own) + 1:]
        files.append(SourceFile(_checked(rel, source), join(source, rel), int(info["size"]), 0o644))
    return sorted(files, key=lambda f: f.name), False


def _checked(rel: str, source: str) -> str:
    why = bad_name(rel)
    if why:
        raise SourceError(f"archive: file {rel!r} in {source} {why}; rename it before archiving", uri=source)
    return rel


def _local(root: str) -> tuple[list[SourceFile], bool]:
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        raise SourceError(f"archive: no such checkpoint {root}", uri=root) from None
    if stat.S_ISREG(top.st_mode):
        return [SourceFile(os.path.basename(root), root, top.st_size, stat.S_IMODE(top.st_mode)),
                *_local_sidecar(root)], True
    if not stat.S_ISDIR(top.st_mode):
        raise SourceError(f"archive: {root} is neither a folder nor a file", uri=root)
    files = []
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            full = os.path.join(folder, name)
            info = os.lstat(full)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if stat.S_ISLNK(info.st_mode):
                raise SourceError(f"archive: {full} is a symbolic link; replace it by the file it names "
                                  "(restore writes plain files)", uri=full)
            if stat.S_ISREG(info.st_mode):
                files.append(SourceFile(_checked(rel, root), full, info.st_size, stat.S_IMODE(info.st_mode)))
            elif not stat.S_ISDIR(info.st_mode):
                raise SourceError(f"archive: {full} is not a plain file; remove it from the checkpoint", uri=full)
    if not files:
        raise SourceError(f"archive: {root} holds no files; give a checkpoint folder or file", uri=root)
    return sorted(files, key=lambda f: f.name), False


def _local_sidecar(root: str) -> list[SourceFile]:
    """The manifest beside the local file `root`, if there is one (a folder of that name is none of ours)."""
    beside = sidecar(root)
    try:
        info = os.lstat(beside)
    except FileNotFoundError:
        return []
    if stat.S_ISLNK(info.st_mode):
        raise SourceError(f"archive: {beside} (the manifest beside {root}) is a symbolic link; replace it by the file "
                          "it names (restore writes plain files)", uri=beside)
    if not stat.S_ISREG(info.st_mode):
        return []
    return [SourceFile(sidecar(os.path.basename(root)), beside, info.st_size, stat.S_IMODE(info.st_mode))]


def open_read(uri: str) -> IO[bytes]:
    if is_local(uri):
        return open(local_path(uri), "rb")
    fs, path = filesystem(uri)
    with translate_errors(uri):
        handle: Any = fs.open(path, "rb", block_size=8 << 20)
    return handle
