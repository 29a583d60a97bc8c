"""Storage roots: the allow-list of places jobs may read from and write to.

A root is a local folder (`/data/ckpts`, `file:///data/ckpts`) or an object-store prefix
(`s3://team-a/checkpoints/`). A URI is inside a root when, after normalising:

- local paths: `os.path.realpath` (symlinks resolved, so a link pointing out of the root is outside)
  lies at or below the root's realpath, compared on whole path components (`/data-other` is not
  inside `/data`);
- object-store URIs: same scheme and bucket, and the root's key segments are a prefix of the URI's,
  compared segment by segment (`s3://b/team-a` does not contain `s3://b/team-ab/x`).

Anything ambiguous is refused rather than interpreted: `..` or `.` segments, empty segments (`a//b`),
percent-escapes, query strings, user info, backslashes and control characters. Relative local paths
are refused too: clients send absolute paths (the client CLI makes them absolute).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from converters import has_control, segments_below

from .service_errors import InvalidRequest, OutsideRoots

MAX_URI_LENGTH = 4096


@dataclass(frozen=True)
class Location:
    """A normalised storage location: `scheme` "file" for local paths (then `bucket` is empty)."""

    scheme: str
    bucket: str
    segments: tuple[str, ...]

    @property
    def local(self) -> bool:
        return self.scheme == "file"

    def uri(self) -> str:
        if self.local:
            return "/" + "/".join(self.segments)
        return f"{self.scheme}://{self.bucket}/" + "/".join(self.segments)

    def contains(self, other: Location) -> bool:
        """True when `other` is this location or lies below it (whole segments only)."""
        return ((self.scheme, self.bucket) == (other.scheme, other.bucket)
                and segments_below(self.segments, other.segments))

    def __str__(self) -> str:
        return self.uri()


def _segments(path: str, what: str, field: str | None) -> tuple[str, ...]:
    parts = path.split("/")
    if parts and parts[0] == "":
        parts = parts[1:]
    if parts and parts[-1] == "":
        parts = parts[:-1]  # one trailing slash is fine
    for part in parts:
        if part in ("..", "."):
            raise OutsideRoots(f"{what}: '{part}' path segments are not allowed; give the full path", field)
        if part == "":
            raise InvalidRequest(f"{what}: empty path segment ('//'); give a normalised URI", field)
    return tuple(parts)


def _basic_checks(uri: str, what: str, field: str | None) -> None:
    if not uri:
        raise InvalidRequest(f"{what}: empty URI", field)
    if len(uri) > MAX_URI_LENGTH:
        raise InvalidRequest(f"{what}: URI longer than {MAX_URI_LENGTH} characters", field)
    if has_control(uri):
        raise InvalidRequest(f"{what}: control characters or backslashes in the URI", field)


def parse(uri: str, what: str = "uri", field: str | None = None, resolve: bool = True) -> Location:
    """Normalise `uri`; local paths go through realpath (unless `resolve` is False)."""
    _basic_checks(uri, what, field)
    if "://" not in uri or uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if uri.startswith("file://") and not path.startswith("/"):
            raise InvalidRequest(f"{what}: file:// URIs take an absolute path and no host (file:///data/x)", field)
        if not os.path.isabs(path):
            raise InvalidRequest(f"{what}: {uri!r} is relative; give an absolute path or a URI", field)
        _segments(path, what, field)  # refuse '..' before realpath can hide it
        real = os.path.realpath(path) if resolve else os.path.normpath(path)
        return Location("file", "", _segments(real, what, field))
    try:
        parts = urlsplit(uri)
    except ValueError:
        raise InvalidRequest(f"{what}: not a valid URI", field) from None
    scheme = parts.scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise InvalidRequest(f"{what}: bad URI scheme", field)
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        raise InvalidRequest(f"{what}: query strings and fragments are not allowed in storage URIs", field)
    if "%" in uri:
        raise InvalidRequest(f"{what}: percent-escapes are not allowed in storage URIs", field)
    if "@" in parts.netloc or not parts.netloc:
        raise InvalidRequest(f"{what}: the URI needs a bucket (scheme://bucket/key) and no user info", field)
    return Location(scheme, parts.netloc, _segments(parts.path, what, field))


def parse_root(text: str) -> Location:
    """A configured root: same rules as a URI; local roots are resolved once, here."""
    return parse(text.strip(), what=f"storage root {text!r}")


def check(uri: str, roots: list[Location], *, field: str, purpose: str) -> str:
    """Normalise `uri` and return it when it lies inside one of `roots`; raise OutsideRoots otherwise.

    `purpose` ("read" or "write") only words the message. A write target may not be a root itself.
    """
    location = parse(uri, what=field, field=field)
    for root in roots:
        if root.contains(location):
            if purpose == "write" and location.segments == root.segments:
                raise OutsideRoots(f"{field}: {location} is a storage root itself; write below it", field,
                                   uri=location.uri())
            return location.uri()
    allowed = ", ".join(str(r) for r in roots) or "none configured"
    raise OutsideRoots(f"{field}: {location} is outside the storage roots this server may {purpose} "
                       f"({allowed})", field, uri=location.uri())


def overlap(a: str, b: str) -> bool:
    """True when one normalised location contains the other (a job must not write into its own source)."""
    la, lb = parse(a, resolve=False), parse(b, resolve=False)
    return la.contains(lb) or lb.contains(la)
