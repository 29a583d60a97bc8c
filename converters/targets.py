"""Outputs and their completeness: whether a target may be written, whether an output prefix is finished, and
which side (source or target) an OSError escaping a conversion belongs to."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import wraps
from typing import Concatenate, ParamSpec, TypeVar

from .confinement import member
from .errors import FormatError, SourceError, TargetError
from .files import exists, isdir, listdir, size, static_source
from .jsonsafe import read_json
from .names import MANIFEST, WRITING, tmp_prefix
from .pathsafety import overlap
from .uris import is_local, join, local_path

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _on_target(path: str, target: str) -> bool:
    """Whether `path` (from an OSError) lies in `target` or in its temporary sibling `.NAME.tmp-...`."""
    if is_local(target):
        base = os.path.abspath(local_path(target))
        path = os.path.abspath(path)
        parent, name = os.path.split(base)
        return path == base or path.startswith(base + os.sep) or path.startswith(os.path.join(parent, tmp_prefix(name)))
    return path.startswith(target.split("://", 1)[-1])


def names_source(exc: OSError, target: str) -> bool:
    """Whether `exc` names a file outside `target` and its temporary sibling (a source file, when converting)."""
    return isinstance(exc.filename, str | bytes | os.PathLike) and not _on_target(os.fsdecode(exc.filename), target)


@contextmanager
def io_errors(source: str, target: str) -> Iterator[None]:
    """Name the side an OSError escaping a conversion came from: one naming a file outside `target` (and its
    temporary sibling) is a SourceError naming that file of `source`; any other is a TargetError naming `target`."""
    try:
        yield
    except OSError as exc:
        if names_source(exc, target):
            name = os.fsdecode(exc.filename)
            raise SourceError(f"{name}: cannot read ({exc.strerror or exc}); check the source {source}",
                              uri=name) from None
        raise TargetError(f"{target}: {exc.strerror or exc}", uri=target) from None


def with_io_errors(fn: Callable[Concatenate[str, str, _P], _R]) -> Callable[Concatenate[str, str, _P], _R]:
    """`io_errors` around a command `fn(source, target, ...)` (convert, reshard), its source `static_source`
    (unless the target lies in it: that one changes)."""
    @wraps(fn)
    def run(source: str, target: str, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        static = not overlap(source, target)
        with io_errors(source, target), (static_source(source) if static else nullcontext()):
            return fn(source, target, *args, **kwargs)
    return run


def check_target(uri: str, overwrite: bool) -> bool:
    """Refuse to write over an existing output, unless asked, or unless it is one we never finished; return
    whether there is one (to be replaced)."""
    if not exists(uri):
        return False
    if not overwrite and not is_incomplete(uri):
        raise TargetError(f"{uri}: already exists; pass --overwrite to replace it, or choose another target", uri=uri)
    return True


def _names(uri: str) -> list[str] | None:
    """The entries of the remote output prefix `uri`, or None when it is local or not a folder (an upload's
    marker and manifest only exist on remote outputs: local ones appear by an atomic rename)."""
    return None if is_local(uri) or not isdir(uri) else listdir(uri)


def _unfinished(names: list[str]) -> bool:
    """The one completeness rule: an upload's marker without the manifest written when it finished."""
    return WRITING in names and MANIFEST not in names


def is_incomplete(uri: str) -> bool:
    """True for an output prefix that ckpt-service started and did not finish (marker, no manifest)."""
    names = _names(uri)
    return names is not None and _unfinished(names)


def check_complete(uri: str) -> None:
    """Refuse an output prefix whose upload never finished, or whose files differ from its manifest."""
    names = _names(uri)
    if names is None:
        return
    if _unfinished(names):
        raise SourceError(f"{uri}: incomplete output (an upload started but never finished: no "
                          "ckpt-manifest.json); re-run the job that writes it", uri=uri)
    if MANIFEST not in names:
        return
    where = join(uri, MANIFEST)
    manifest = read_json(where)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise FormatError(f"{where}: files must be a JSON object of file name -> {{bytes, crc32}}; the manifest is "
                          "damaged")
    for name, info in files.items():
        path = member(uri, name, f"{where} (files)")
        if not exists(path) or size(path) != info.get("bytes"):
            raise SourceError(f"{path}: missing or not the size ckpt-manifest.json records; the output is damaged, "
                              "re-run the job that wrote it", uri=path)
