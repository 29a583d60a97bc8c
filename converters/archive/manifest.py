"""A manifest (`manifests/<id>.json`): an archived checkpoint's files, their modes and chunks, and its sizes.

{"format": "ckpt-archive/2", "hash": "blake3", "id", "source", "single_file", "created",
 "files": [{"name", "size", "mode", "chunks": [[hash, length, stored_length], ...]}],
 "logical_bytes", "unique_bytes", "stored_bytes", "new_bytes", "new_stored_bytes"}

A single-file checkpoint (`single_file`) lists the file, then the manifest that was beside it if there was one
(`<file>.ckpt-manifest.json`, `certificate.sidecar`), restored beside the restored file.

Format ckpt-archive/1 (no "hash": its chunks are addressed by SHA-256) is still read and restored.
Read back, every field is checked: a manifest that is not one of ours is refused in one line."""

from __future__ import annotations

import json
import re
from typing import Any

from ..certificate import sidecar
from ..errors import FormatError
from ..pathsafety import bad_name
from .hashing import BLAKE3, SHA256
from .store import MANIFESTS, Store

FORMAT = "ckpt-archive/2"
FORMATS = {"ckpt-archive/1": SHA256, FORMAT: BLAKE3}  # format -> the hash addressing its chunks
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")


def check_id(archive_id: str) -> str:
    if not isinstance(archive_id, str) or not _ID.match(archive_id) or ".." in archive_id:
        raise FormatError(f"archive id {archive_id!r} is not an id (letters, digits, '.', '_', '-'); "
                          "list the store's archives for the ids")
    return archive_id


def manifest_key(archive_id: str) -> str:
    return f"{MANIFESTS}/{check_id(archive_id)}.json"


def read(store: Store, archive_id: str) -> dict[str, Any]:
    raw = store.get(manifest_key(archive_id))
    if raw is None:
        raise FormatError(f"archive {archive_id} is not in store {store.uri}; list the store's archives for the ids",
                          uri=store.uri)
    return parse(raw, f"{store.uri}/{manifest_key(archive_id)}")


def parse(raw: bytes, where: str) -> dict[str, Any]:
    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: {what}; this is not an archive manifest (re-archive the checkpoint)", uri=where)

    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
        raise bad(f"format is not one of {', '.join(sorted(FORMATS))}")
    if doc.get("hash", SHA256) != FORMATS[doc["format"]]:
        raise bad(f"hash {doc.get('hash')!r} is not {FORMATS[doc['format']]} (what {doc['format']} uses)")
    files = doc.get("files")
    if not isinstance(files, list):
        raise bad("files is not a list")
    names: set[str] = set()
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise bad(f"files[{i}] is not an object")
        name, size, mode, chunks = entry.get("name"), entry.get("size"), entry.get("mode"), entry.get("chunks")
        if not isinstance(name, str) or bad_name(name) or name in names:
            raise bad(f"files[{i}].name {name!r} is not a safe relative file name, or repeats")
        names.add(name)
        if not _count(size) or not _count(mode) or (mode or 0) > 0o777 or not isinstance(chunks, list):
            raise bad(f"files[{i}] ({name}) has a bad size, mode or chunk list")
        total = 0
        for chunk in chunks:
            if (not isinstance(chunk, list) or len(chunk) != 3 or not isinstance(chunk[0], str)
                    or not _HASH.match(chunk[0]) or not _count(chunk[1]) or not _count(chunk[2])):
                raise bad(f"files[{i}] ({name}) lists a chunk that is not [hash, length, stored length]")
            total += chunk[1]
        if total != size:
            raise bad(f"files[{i}] ({name}): its chunks hold {total} bytes, not its size {size}")
    if doc.get("single_file") and len(files) > 1 and [f["name"] for f in files[1:]] != [sidecar(files[0]["name"])]:
        raise bad("a single file lists files other than itself and its manifest beside it")
    return doc


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def ids(store: Store) -> list[str]:
    out = []
    for key in store.listing(MANIFESTS):
        name = key.rsplit("/", 1)[-1]
        if key.count("/") == 1 and name.endswith(".json") and _ID.match(name[:-5]):
            out.append(name[:-5])
    return sorted(out)


def hash_name(doc: dict[str, Any]) -> str:
    """The hash addressing the chunks of a parsed manifest."""
    return FORMATS[doc["format"]]


def hashes(doc: dict[str, Any]) -> set[str]:
    return {c[0] for f in doc["files"] for c in f["chunks"]}
