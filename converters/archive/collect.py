"""Garbage collection of chunks no manifest references, safe under concurrent archives.

The handshake: an archive writes `pending/<token>.json`, then waits while a live `gc/<token>.json` exists, and
only then looks at which chunks the store holds (removing its marker after its manifest is written). A gc
writes `gc/<token>.json`, then deletes nothing if a live pending marker exists. Whichever writes its marker
second sees the other's, so a gc never deletes a chunk an archive counted on. Markers older than `stale_s`
are left by interrupted runs: they are ignored, and gc removes stale pending markers (their chunks become
garbage). Chunks younger than `grace_s` are kept as well (a margin for clocks and listings)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from .manifest import hashes, ids, manifest_key, parse
from .store import CHUNKS, GC, PENDING, Store

STALE_S = 6 * 3600.0
GRACE_S = 3600.0


def put_marker(store: Store, kind: str, what: str) -> str:
    key = f"{kind}/{uuid.uuid4().hex}.json"
    store.put(key, json.dumps({"started": time.time(), "what": what}).encode())
    return key


def live_markers(store: Store, kind: str, stale_s: float, mine: str | None = None) -> tuple[list[str], list[str]]:
    """(live, stale) marker keys of `kind`."""
    live: list[str] = []
    stale: list[str] = []
    now = time.time()
    for key, (mtime, _) in store.listing(kind).items():
        if key == mine:
            continue
        (stale if now - mtime > stale_s else live).append(key)
    return live, stale


def wait_for_gc(store: Store, stale_s: float = STALE_S, poll_s: float = 0.05) -> None:
    while live_markers(store, GC, stale_s)[0]:
        time.sleep(poll_s)


@dataclass
class GcResult:
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept: int = 0
    skipped: str | None = None  # why nothing was deleted
    stale_markers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"deleted": len(self.deleted), "freed_bytes": self.freed_bytes, "kept": self.kept,
                "skipped": self.skipped, "stale_markers_removed": self.stale_markers}


def gc(store_uri: str, grace_s: float = GRACE_S, stale_s: float = STALE_S) -> GcResult:
    """Deletes the chunks of `store_uri` no manifest references (older than `grace_s`); while an archive runs
    it deletes nothing and says so."""
    store = Store(store_uri)
    mine = put_marker(store, GC, "gc")
    result = GcResult()
    try:
        live, stale = live_markers(store, PENDING, stale_s)
        if live:
            result.skipped = f"{len(live)} archive(s) in progress; run gc again when they end"
            return result
        for key in stale:
            store.delete(key)
        result.stale_markers = stale
        used: set[str] = set()
        for archive_id in ids(store):
            raw = store.get(manifest_key(archive_id))
            if raw is not None:  # None: removed since it was listed, so it references nothing
                used |= hashes(parse(raw, store.where(manifest_key(archive_id))))
        now = time.time()
        for key, (mtime, size) in store.listing(CHUNKS).items():
            digest = key.rsplit("/", 1)[-1]
            if digest in used or now - mtime < grace_s:
                result.kept += 1
                continue
            store.delete(key)
            result.deleted.append(digest)
            result.freed_bytes += size
        return result
    finally:
        store.delete(mine)
