"""Which local files and remote URIs this process may read, and opening local files safely.

- `member(base, name, where)` turns a file name that checkpoint metadata names (an index's `weight_map`, a
  DCP `relative_path`) into a path inside the checkpoint's folder, refusing names that leave it
  (absolute paths, `..`, backslashes, percent-escapes and their Unicode-normalised forms);
- local files are opened only when they are regular files (never a FIFO, device or socket: checked
  before opening, and again on the open descriptor, which is opened non-blocking);
- with read roots set (the engine config's `read_roots`, `current()`: every service process (API, scheduler,
  worker, job, inspection) sets them to its read roots plus its write roots, since it reads back what it
  writes), every local file and every folder listed must resolve, symlinks followed, inside one of them, files
  checked before opening and again on the opened descriptor; remote URIs must lie below one of the roots given
  as URIs. Without roots (offline), member symlinks are followed;
- whole-file reads stop at `max_metadata_bytes()` (the engine config's).
"""

from __future__ import annotations

import os
import stat

from .config import current
from .errors import FormatError, SourceError
from .pathsafety import bad_name, inside_any
from .uris import is_local, join, local_path


def max_metadata_bytes() -> int:
    """The cap on every whole-file read (metadata, index JSON, zip directory, pickles): the engine config's."""
    return current().max_metadata_bytes


def _root(text: str) -> str:
    return os.path.realpath(local_path(text)) if is_local(text) else text.rstrip("/")


def read_roots() -> list[str] | None:
    """The read roots in force (the engine config's, local ones resolved), or None (no check)."""
    roots = current().read_roots
    return None if roots is None else [_root(r) for r in roots if r.strip()]


def check_roots(uri: str, real: str | None = None) -> None:
    """Refuse `uri` (local: resolved, or its resolved path `real`) when it lies outside the read roots in force."""
    roots = read_roots()
    if roots is None:
        return
    where = real if real is not None else (os.path.realpath(local_path(uri)) if is_local(uri) else uri)
    if not inside_any(where, roots):
        raise SourceError(f"{uri}: resolves outside the storage roots this process may read; refusing to read it",
                          uri=uri)


def member(base: str, name: object, where: str) -> str:
    """The path of file `name`, as the checkpoint metadata in `where` names it, inside the folder `base`.

    Names that would leave the folder are refused before anything is looked up."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{where}: names a data file {name!r}, which is not a file name; the metadata is damaged")
    why = bad_name(name)
    if why:
        raise FormatError(f"{where}: names the data file {name!r}, which {why}; a checkpoint may only name files "
                          "inside its own folder, so it was not read")
    return join(base, name)


def _kind(mode: int) -> str:
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"


def stat_local(uri: str, missing: str) -> os.stat_result:
    """stat() of a local file we are about to read: inside the read roots, existing, a regular file."""
    path = local_path(uri)
    check_roots(uri)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise SourceError(f"{uri}: {missing}", uri=uri) from None
    except PermissionError:
        raise SourceError(f"{uri}: permission denied", uri=uri) from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{uri}: {_kind(st.st_mode)}; refusing to read it", uri=uri)
    return st


def open_file(uri: str, missing: str = "no such file") -> int:
    """A read-only descriptor of a local regular file inside the read roots; never blocks (a FIFO is refused)."""
    stat_local(uri, missing)
    try:
        fd = os.open(local_path(uri), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SourceError(f"{uri}: {missing}", uri=uri) from None
    except OSError as exc:
        raise SourceError(f"{uri}: cannot open ({exc.strerror})", uri=uri) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
            raise FormatError(f"{uri}: {_kind(st.st_mode)}; refusing to read it", uri=uri)
        if read_roots() is not None:
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = os.path.realpath(local_path(uri))
            check_roots(uri, real)
    except BaseException:
        os.close(fd)
        raise
    return fd
