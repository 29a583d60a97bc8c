"""Archived checkpoints in the registry: each archive of a registered checkpoint in an archive store
(`converters.archive`), with its stored bytes against its logical bytes (table `checkpoint_archives`).

- an `archive` job (source -> store) records the archive of its source (registering the source first if new);
- a `restore` job (archive id in a store -> target) registers its output (the executor does) and links it to
  the archived checkpoint: lineage `restored derived_from archived` by the job, metadata `restored_from`;
- retention's `archive` action (retention.py) archives a checkpoint, checks the archive (`check_archive`: every
  chunk read back and its hash checked, the files as long as the originals) and only then deletes its files:
  the entry stays, deleted and restorable.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from converters import FormatError

from .units import when

if TYPE_CHECKING:
    from .jobs import JobSpec
    from .store import JobStore


class ArchiveView(BaseModel):
    store: str = Field(description="The archive store (folder or URI).")
    archive_id: str
    logical_bytes: int = Field(description="The checkpoint's bytes.")
    stored_bytes: int = Field(description="Its distinct chunks as stored (deduplicated, compressed).")
    new_stored_bytes: int = Field(description="What archiving it added to the store (the rest was there already).")
    archived_by: str
    origin: str = Field(description="job:ID, or retention:POLICY.")
    archived_at: datetime


def _view(row: Any) -> ArchiveView:
    return ArchiveView(store=row["store"], archive_id=row["archive_id"], logical_bytes=row["logical_bytes"],
                       stored_bytes=row["stored_bytes"], new_stored_bytes=row["new_stored_bytes"],
                       archived_by=row["archived_by"], origin=row["origin"],
                       archived_at=when(float(row["archived_at"])))


def archives_of(store: JobStore, checkpoint_id: str) -> list[ArchiveView]:
    rows = store.query("SELECT * FROM checkpoint_archives WHERE checkpoint_id = ? ORDER BY archived_at, store",
                       (checkpoint_id,))
    return [_view(r) for r in rows]


def archives_by_checkpoint(store: JobStore, checkpoint_ids: list[str]) -> dict[str, list[ArchiveView]]:
    """The archives of each of a page of checkpoints, in one query (a listing's `archives`, no query per row)."""
    found: dict[str, list[ArchiveView]] = {}
    if not checkpoint_ids:
        return found
    marks = ", ".join("?" * len(checkpoint_ids))
    for row in store.query(f"SELECT * FROM checkpoint_archives WHERE checkpoint_id IN ({marks}) "
                           "ORDER BY archived_at, store", tuple(checkpoint_ids)):
        found.setdefault(row["checkpoint_id"], []).append(_view(row))
    return found


def archived_checkpoint(store: JobStore, archive_store: str, archive_id: str) -> str | None:
    """The registered checkpoint archived as `archive_id` in `archive_store`, if the registry knows it."""
    rows = store.query("SELECT checkpoint_id FROM checkpoint_archives WHERE store = ? AND archive_id = ? "
                       "ORDER BY archived_at DESC", (archive_store, archive_id))
    return rows[0]["checkpoint_id"] if rows else None


def record(conn: Any, checkpoint_id: str, result: dict[str, Any], by: str, origin: str) -> None:
    """Inside a transaction: the checkpoint is archived as `result` says (an `ArchiveResult.to_dict()`); archiving it
    into the same store again replaces the row."""
    conn.execute("INSERT INTO checkpoint_archives (checkpoint_id, store, archive_id, logical_bytes, stored_bytes, "
                 "new_stored_bytes, archived_by, origin, archived_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                 "ON CONFLICT (checkpoint_id, store) DO UPDATE SET archive_id = excluded.archive_id, "
                 "logical_bytes = excluded.logical_bytes, stored_bytes = excluded.stored_bytes, "
                 "new_stored_bytes = excluded.new_stored_bytes, archived_by = excluded.archived_by, "
                 "origin = excluded.origin, archived_at = excluded.archived_at",
                 (checkpoint_id, result["store"], result["archive_id"], int(result["logical_bytes"]),
                  int(result["stored_bytes"]), int(result["new_stored_bytes"]), by, origin, time.time()))


def check_archive(archive_store: str, archive_id: str, source: str, scratch: str) -> None:
    """The archive gives `source` back whole: restored into a folder under `scratch` (every chunk's hash checked by
    the restore) and compared byte for byte with the files at `source`; the copy is removed. FormatError in one line
    naming the first file that differs (the original is then kept)."""
    from converters import manifest_sidecar, restore_archive, storage

    os.makedirs(scratch, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="archive-check-", dir=scratch) as folder:
        copy = os.path.join(folder, "restored")
        restore_archive(archive_store, archive_id, copy)
        restored = _files(copy)
        originals = _files(source)
        if len(originals) == 1 and len(restored) == 1 and "" in restored:  # a single-file checkpoint
            originals = {"": next(iter(originals.values()))}
            beside = manifest_sidecar(source)  # its manifest (an output of ours), archived with it
            name = beside.rstrip("/").rsplit("/", 1)[-1]
            if storage.exists(beside):
                originals[name] = beside
            if os.path.lexists(manifest_sidecar(copy)):
                restored[name] = manifest_sidecar(copy)
        if sorted(restored) != sorted(originals):
            differ = sorted(set(restored) ^ set(originals))
            raise FormatError(f"archive {archive_id} in {archive_store} does not hold the files of {source} "
                              f"({', '.join(differ[:3])}); the original is kept", uri=source)
        for name, where in originals.items():
            if not _same(where, restored[name]):
                raise FormatError(f"archive {archive_id} in {archive_store}: {name or source} does not restore to "
                                  f"the bytes of {where}; the original is kept", uri=where)


def _files(uri: str) -> dict[str, str]:
    """relative name ('' for a file itself) -> path or URI of each file at `uri`."""
    from converters import storage

    if storage.is_local(uri):
        root = storage.local_path(uri)
        if os.path.isfile(root):
            return {"": root}
        found = {}
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                found[os.path.relpath(path, root).replace(os.sep, "/")] = path
        return found
    fs, path = storage.filesystem(uri)
    if fs.isfile(path):
        return {"": uri}
    base, skip = uri.rstrip("/"), len(path.split("://", 1)[-1].rstrip("/")) + 1
    names = [name.split("://", 1)[-1][skip:] for name in fs.find(path)]
    return {name: f"{base}/{name}" for name in names}


def _same(original: str, copy: str, block: int = 8 << 20) -> bool:
    from converters import storage

    if storage.is_local(original):
        source: Any = open(storage.local_path(original), "rb")  # noqa: SIM115 (closed below)
    else:
        fs, path = storage.filesystem(original)
        source = fs.open(path, "rb")
    with source as a, open(copy, "rb") as b:
        while True:
            left, right = a.read(block), b.read(block)
            if left != right:
                return False
            if not left:
                return True


def _summary(uri: str) -> dict[str, Any] | None:
    from .executor import _summary as summary

    return summary(uri)


def archive_job_recorder(store: JobStore, spec: JobSpec, job_id: str,
                         result: dict[str, Any]) -> Callable[[Any], None]:
    """What a succeeded archive job records (its source registered first if new): prepared outside the transaction
    (reads the source's metadata), written inside it."""
    from .registry import Registry, default_name

    registry = Registry(store)
    known = registry.find_uri(spec.source)
    summary = None if known is not None else _summary(spec.source)
    rows = store.query("SELECT submitted_by FROM jobs WHERE id = ?", (job_id,))
    by = rows[0]["submitted_by"] if rows and rows[0]["submitted_by"] else "service"

    def write(conn: Any) -> None:
        row = conn.execute("SELECT id FROM checkpoints WHERE uri = ?", (spec.source,)).fetchone()
        if row is not None:
            checkpoint_id = row["id"]
        elif summary is not None:
            checkpoint_id = registry.add(conn, uri=spec.source, name=default_name(spec.source), summary=summary,
                                         tags=[], metadata={}, via={"how": "source", "job": job_id})
        else:
            return  # not a checkpoint the registry can describe: the job's result still names the archive
        record(conn, checkpoint_id, result, by, f"job:{job_id}")
        result["checkpoint_id"] = checkpoint_id
    return write


def restore_job_recorder(store: JobStore, spec: JobSpec, job_id: str,
                         result: dict[str, Any]) -> Callable[[Any], None]:
    """What a succeeded restore job records besides its output (the executor registers that): lineage from the
    archived checkpoint, and metadata `restored_from` (archive id and store). Restored to the archived checkpoint's
    own place, the entry is live again with its lineage as it was."""
    archive_id = str(getattr(spec.options, "archive_id", "") or "")
    original = archived_checkpoint(store, spec.source.rstrip("/"), archive_id)
    parents = [] if original is None else store.query(
        "SELECT parent_id, job_id, created_at FROM lineage WHERE child_id = ?", (original,))

    def write(conn: Any) -> None:
        child = result.get("checkpoint_id")
        if child is None:
            return
        row = conn.execute("SELECT metadata FROM checkpoints WHERE id = ?", (child,)).fetchone()
        metadata = {**json.loads(row["metadata"]), "restored_from": f"archive {archive_id} in {spec.source}"}
        conn.execute("UPDATE checkpoints SET metadata = ? WHERE id = ?", (json.dumps(metadata), child))
        if original is None:
            return
        result["restored_from_checkpoint"] = original
        if original == child:  # back in its own place: live again, its parents kept (the output's refresh cut them)
            conn.execute("UPDATE checkpoint_runs SET deleted_at = NULL WHERE checkpoint_id = ?", (child,))
            for edge in parents:
                conn.execute("INSERT INTO lineage (child_id, parent_id, job_id, created_at) VALUES (?, ?, ?, ?) "
                             "ON CONFLICT (child_id, parent_id) DO NOTHING",
                             (child, edge["parent_id"], edge["job_id"], edge["created_at"]))
            return
        conn.execute("INSERT INTO lineage (child_id, parent_id, job_id, created_at) VALUES (?, ?, ?, ?) "
                     "ON CONFLICT (child_id, parent_id) DO UPDATE SET job_id = excluded.job_id, "
                     "created_at = excluded.created_at", (child, original, job_id, time.time()))
    return write
