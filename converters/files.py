"""Questions about files and folders, local or remote (exists, isdir, listdir, size), and whole-file reads of
small metadata, confined (`confinement`) and capped at `max_metadata_bytes()`.

While a command reads a remote checkpoint that does not change (`static_source`), each folder at or under
it is listed once and the questions about what lies there answer from that listing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from .confinement import check_roots, max_metadata_bytes, open_file, stat_local
from .errors import FormatError, SourceError
from .pathsafety import inside
from .remote import filesystem, remote_call, translate_errors
from .uris import basename, is_local, local_path, parent

_Listing = dict[str, tuple[bool, int]]  # name -> (is a folder, size)
_static_lock = threading.Lock()
_static: dict[str, tuple[list[int], dict[str, _Listing]]] = {}  # root -> ([users], folder -> its listing)


@contextmanager
def static_source(uri: str) -> Iterator[None]:
    """While a command reads the remote checkpoint `uri`, which does not change while it is read, each folder
    at or under it is listed once: `exists`, `isdir`, `listdir` and `size` of what lies there answer from that
    listing (a source of a few files costs one request instead of one or two per question, each a round trip
    on object storage). Elsewhere listings stay uncached (another process may be writing there)."""
    root = uri.rstrip("/")
    if is_local(uri):
        yield
        return
    with _static_lock:
        _static.setdefault(root, ([0], {}))[0][0] += 1
    try:
        yield
    finally:
        with _static_lock:
            users = _static[root][0]
            users[0] -= 1
            if not users[0]:
                del _static[root]


def _listed(uri: str) -> _Listing | None:
    """The listing of the remote folder `uri` when it lies in a `static_source` (listed now if need be; a file or
    a missing folder lists empty), else None."""
    key = uri.rstrip("/")
    with _static_lock:
        cache = next((c for root, (_, c) in _static.items() if inside(key, root)), None)
        if cache is None or key in cache:
            return None if cache is None else cache[key]
    own = key.split("://", 1)[-1]
    fs, path = filesystem(key)
    with translate_errors(key):
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            entries = []
    listing = {basename(e["name"]): (e.get("type") == "directory", int(e.get("size") or 0))
               for e in entries if e["name"].rstrip("/") != own}
    with _static_lock:
        cache[key] = listing
    return listing


def _listed_entry(uri: str) -> tuple[bool, int] | Literal[False] | None:
    """(is a folder, size) of `uri` from the cached listing of its folder; False when that listing lacks it;
    None when its folder lies in no `static_source`."""
    listing = _listed(parent(uri))
    return None if listing is None else listing.get(basename(uri), False)


def exists(uri: str) -> bool:
    if is_local(uri):
        return os.path.exists(local_path(uri))
    entry = _listed_entry(uri)
    if entry is not None:
        return entry is not False
    return bool(_listed(uri)) or bool(remote_call(uri, "exists"))


def lexists(uri: str) -> bool:
    """exists(), but true for a local symlink whose target is missing (so that reading it says why)."""
    return os.path.lexists(local_path(uri)) if is_local(uri) else exists(uri)


def isdir(uri: str) -> bool:
    if is_local(uri):
        return os.path.isdir(local_path(uri))
    entry = _listed_entry(uri)
    if entry is not None:
        return entry is not False and entry[0]
    return bool(_listed(uri)) or bool(remote_call(uri, "isdir"))


def listdir(uri: str) -> list[str]:
    """Names (not paths) of the entries of a folder (inside the read roots, symlinks resolved), sorted."""
    check_roots(uri)
    if is_local(uri):
        return sorted(os.listdir(local_path(uri)))
    listing = _listed(uri)
    if listing:
        return sorted(listing)
    own = uri.split("://", 1)[-1].rstrip("/")
    return sorted(basename(p) for p in remote_call(uri, "ls", detail=False) if p.rstrip("/") != own)


def size(uri: str, missing: str = "no such file") -> int:
    """Size of a file we may read (local: a regular file inside the read roots)."""
    if is_local(uri):
        return stat_local(uri, missing).st_size
    check_roots(uri)
    entry = _listed_entry(uri)
    if entry and not entry[0]:
        return entry[1]
    fs, path = filesystem(uri)
    with translate_errors(uri):
        try:
            return int(fs.size(path))
        except FileNotFoundError:
            raise SourceError(f"{uri}: {missing}", uri=uri) from None


def _too_big(uri: str, cap: int) -> FormatError:
    return FormatError(f"{uri}: larger than the {cap}-byte limit for metadata files; the file is damaged or not "
                       f"what its name says (if it is genuine, raise CKPT_MAX_METADATA_BYTES)")


def read_all(uri: str, cap: int | None = None) -> bytes:
    """Read a whole metadata file, refusing one larger than `cap` (default `max_metadata_bytes()`).

    The real size is checked before reading, and at most cap+1 bytes are read (a growing file too)."""
    cap = max_metadata_bytes() if cap is None else cap
    if not is_local(uri):
        if size(uri) > cap:
            raise _too_big(uri, cap)
        check_roots(uri)
        data = bytes(remote_call(uri, "cat_file", start=0, end=cap + 1))
        if len(data) > cap:
            raise _too_big(uri, cap)
        return data
    fd = open_file(uri)
    try:
        if os.fstat(fd).st_size > cap:
            raise _too_big(uri, cap)
        parts: list[bytes] = []
        got = 0
        while got <= cap:
            piece = os.read(fd, min(cap + 1 - got, 1 << 24))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        if got > cap:
            raise _too_big(uri, cap)
        return b"".join(parts)
    except OSError as exc:
        raise SourceError(f"{uri}: cannot read ({exc.strerror})", uri=uri) from None
    finally:
        os.close(fd)
