"""Path safety, in one place: which names may be used, and when one location lies inside or overlaps another.

Used by the engine's read confinement and metadata file names (`converters.confinement`) and by the service's
storage roots (`ckpt_service.roots`). Comparisons are on whole path components: `/data-other` is not inside
`/data`, `s3://b/team-ab` is not inside `s3://b/team-a`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

#: control characters and lone surrogates (not valid text): refused in names and URIs alike
CONTROL = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
_DRIVE = re.compile(r"^[A-Za-z]:")


def has_control(text: str) -> bool:
    """True when `text` holds control characters, lone surrogates or backslashes."""
    return bool(CONTROL.search(text)) or "\\" in text


def bad_name(name: str) -> str | None:
    """Why a relative file name (from checkpoint metadata) may not be used, or None when it stays inside its folder."""
    if has_control(name):
        return "holds control characters, lone surrogates or backslashes"
    if "%" in name:
        return "holds percent-escapes"
    for form in dict.fromkeys((name, unicodedata.normalize("NFKC", name))):
        if "://" in form or form.startswith("/") or _DRIVE.match(form) or "\\" in form:
            return "is an absolute path or a URI"
        if any(part in ("", ".", "..") for part in form.split("/")):
            return "has '..', '.' or empty path segments"
    return None


def segments_below(outer: Sequence[str], inner: Sequence[str]) -> bool:
    """True when the path segments `inner` equal `outer` or lie below it."""
    return tuple(inner[:len(outer)]) == tuple(outer)


def inside(path: str, root: str) -> bool:
    """True when the normalised path or URI `path` is `root` or lies below it (whole components)."""
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/")


def inside_any(path: str, roots: Iterable[str]) -> bool:
    """True when `path` is inside one of `roots`."""
    return any(inside(path, root) for root in roots)


def overlap(a: str, b: str) -> bool:
    """True when one normalised path or URI contains the other (trailing slashes ignored)."""
    a, b = a.rstrip("/"), b.rstrip("/")
    return inside(a, b) or inside(b, a)
