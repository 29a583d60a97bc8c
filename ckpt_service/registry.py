"""The checkpoint registry: named, tagged checkpoints with their `inspect` summary, and lineage edges
(`child derived_from parent`, made by a job) that can be walked both ways.
"""

from __future__ import annotations

import builtins
import json
import time
from collections import deque
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from .archived import ArchiveView, archives_by_checkpoint, archives_of
from .jobs import Format
from .service_errors import Conflict, NotFound
from .store import JobStore, dumps, new_id, under, views

MAX_LINEAGE = 500
Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:=/-]+$")]
MetaValue = str | int | float | bool | None


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(min_length=1, max_length=4096)
    name: str | None = Field(None, min_length=1, max_length=200, description="Default: the last path segment.")
    tags: list[Tag] = Field(default_factory=list, max_length=32)
    metadata: dict[Annotated[str, Field(max_length=64)], MetaValue] = Field(default_factory=dict, max_length=64,
                                                                           description="Free-form: run id, step…")
    source_format: Format | None = None


class CheckpointView(BaseModel):
    id: str
    name: str
    uri: str
    format: str | None
    world_size: int | None = None
    total_bytes: int | None = None
    tensors: int | None = None
    has_optimizer: bool | None = None
    dtypes: dict[str, int] = Field(default_factory=dict)
    tags: list[str]
    metadata: dict[str, Any]
    made_by_job: str | None
    registered_via: dict[str, str] | None = Field(
        None, description="How it came to be registered: how = registered (by a token: by), output (of job), "
        "source (of job), discovered (by a rule's scan) or notified (by); None for entries older than this field.")
    created_at: datetime
    updated_at: datetime
    owner: str | None = Field(None, description="The token name that registered it (None: made by the service, "
                              "or registered before owners were recorded; then only admins may change it).")
    deleted_at: datetime | None = Field(None, description="When GC or a purge deleted its data (the entry stays "
                                        "for lineage; it is not listed as a live checkpoint).")
    summary: dict[str, Any] = Field(description="What `ckptctl inspect --json` reports.")
    archives: list[ArchiveView] = Field(default_factory=list, description="The archive stores holding it (a restore "
                                        "job gives it back byte for byte), each with its stored against its logical "
                                        "bytes; with deleted_at set, its files are gone and it is archived.")


class LineageEdge(BaseModel):
    checkpoint: CheckpointView
    job_id: str | None
    depth: int = Field(description="1 for direct parents (or children), 2 for theirs, …")


class LineageView(BaseModel):
    checkpoint: CheckpointView
    ancestors: list[LineageEdge]
    descendants: list[LineageEdge]


#: every query for views reads the entry with its deletion mark
_SELECT = ("SELECT c.*, r.deleted_at AS deleted_at FROM checkpoints c "
           "LEFT JOIN checkpoint_runs r ON r.checkpoint_id = c.id")


def _view(row: Any) -> CheckpointView:
    summary = json.loads(row["summary"])
    deleted = row["deleted_at"]
    view = CheckpointView(
        id=row["id"], name=row["name"], uri=row["uri"], format=row["format"], world_size=summary.get("world_size"),
        total_bytes=summary.get("total_bytes"), tensors=summary.get("tensors"),
        has_optimizer=summary.get("has_optimizer"), dtypes=summary.get("dtypes") or {}, tags=json.loads(row["tags"]),
        metadata=json.loads(row["metadata"]), made_by_job=row["made_by_job"],
        registered_via=json.loads(row["registered_via"]) if row["registered_via"] else None,
        created_at=datetime.fromtimestamp(row["created_at"], tz=timezone.utc),
        updated_at=datetime.fromtimestamp(row["updated_at"], tz=timezone.utc), owner=row["owner"],
        deleted_at=None if deleted is None else datetime.fromtimestamp(deleted, tz=timezone.utc), summary=summary)
    view.model_dump_json()  # a damaged row (text that is not UTF-8) fails here, not while a page is rendered
    return view


def default_name(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1] or uri


class Registry:
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def add(self, conn: Any, *, uri: str, name: str, summary: dict[str, Any], tags: list[str],
            metadata: dict[str, Any], via: dict[str, str], made_by_job: str | None = None,
            owner: str | None = None) -> str:
        """Inside a transaction: insert a checkpoint (its text checked first), recording how it came (`via`);
        Conflict if the URI is registered already."""
        row_values = (dumps(uri, "uri"), dumps(name, "name"), dumps(summary, "summary"), json.dumps(tags),
                      dumps(metadata, "metadata"))
        self.store.serialize(conn)
        row = conn.execute("SELECT c.id, r.deleted_at FROM checkpoints c LEFT JOIN checkpoint_runs r ON "
                           "r.checkpoint_id = c.id WHERE c.uri = ?", (uri,)).fetchone()
        if row is not None:
            gone = "" if row["deleted_at"] is None else " (its data was deleted; unregister that entry first)"
            raise Conflict(f"{uri} is registered already as {row['id']}{gone}")
        now = time.time()
        checkpoint_id = new_id("ckpt")
        tag_owners = {t.partition("=")[0]: owner for t in tags} if owner else {}
        conn.execute("INSERT INTO checkpoints (id, uri, name, format, summary, tags, metadata, made_by_job, "
                     "created_at, updated_at, owner, tag_owners, registered_via) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (checkpoint_id, uri, name, summary.get("format"), *row_values[2:], made_by_job, now, now,
                      owner, json.dumps(tag_owners), dumps(via, "registered_via")))
        return checkpoint_id

    def register(self, request: RegisterRequest, uri: str, summary: dict[str, Any],
                 owner: str | None = None) -> CheckpointView:
        with self.store.transaction() as conn:
            checkpoint_id = self.add(conn, uri=uri, name=request.name or default_name(uri), summary=summary,
                                     tags=list(request.tags), metadata=dict(request.metadata), owner=owner,
                                     via={"how": "registered", "by": owner} if owner else {"how": "registered"})
        return self.get(checkpoint_id)

    def record_output(self, conn: Any, *, uri: str, summary: dict[str, Any], job_id: str,
                      source_uri: str, source_summary: dict[str, Any] | None) -> str:
        """Inside the transaction that marks a job succeeded: register (or refresh, when a job overwrote it)
        the output (owned by the job's submitter), register the source if it is new, and record `output
        derived_from source` by `job_id`."""
        now = time.time()
        self.store.serialize(conn)
        row = conn.execute("SELECT id FROM checkpoints WHERE uri = ?", (uri,)).fetchone()
        if row is None:
            job = conn.execute("SELECT submitted_by FROM jobs WHERE id = ?", (job_id,)).fetchone()
            child = self.add(conn, uri=uri, name=default_name(uri), summary=summary, tags=[], metadata={},
                             via={"how": "output", "job": job_id}, made_by_job=job_id,
                             owner=job["submitted_by"] if job else None)
        else:
            child = row["id"]
            conn.execute("UPDATE checkpoints SET summary = ?, format = ?, made_by_job = ?, updated_at = ? "
                         "WHERE id = ?", (dumps(summary, "summary"), summary.get("format"), job_id, now, child))
            conn.execute("DELETE FROM lineage WHERE child_id = ?", (child,))  # a new artifact at the same place
        parent_row = conn.execute("SELECT id FROM checkpoints WHERE uri = ?", (source_uri,)).fetchone()
        if parent_row is not None:
            parent = parent_row["id"]
        elif source_summary is not None:
            parent = self.add(conn, uri=source_uri, name=default_name(source_uri), summary=source_summary, tags=[],
                              metadata={}, via={"how": "source", "job": job_id})
        else:
            return child
        if parent != child:
            conn.execute("INSERT INTO lineage (child_id, parent_id, job_id, created_at) VALUES (?, ?, ?, ?) "
                         "ON CONFLICT (child_id, parent_id) DO UPDATE SET job_id = excluded.job_id, "
                         "created_at = excluded.created_at", (child, parent, job_id, now))
        return child

    def get(self, checkpoint_id: str) -> CheckpointView:
        rows = self.store.query(f"{_SELECT} WHERE c.id = ?", (checkpoint_id,))
        if not rows:
            raise NotFound(f"no checkpoint {checkpoint_id}")
        try:
            view = _view(rows[0])
            view.archives = archives_of(self.store, checkpoint_id)
            return view
        except (ValueError, TypeError, KeyError, OverflowError):
            raise Conflict(f"checkpoint {checkpoint_id}: its stored entry cannot be read (damaged text or JSON); "
                           "unregister it and register the checkpoint again") from None

    def find_uri(self, uri: str) -> CheckpointView | None:
        rows = self.store.query(f"{_SELECT} WHERE c.uri = ?", (uri,))
        return _view(rows[0]) if rows else None

    def list(self, name: str | None = None, tag: str | None = None, format: str | None = None, limit: int = 50,
             after: str | None = None, within: builtins.list[str] | None = None, archived: bool = False
             ) -> tuple[builtins.list[CheckpointView], str | None, builtins.list[str]]:
        """Ordered by id; returns (page, id to pass as `after` for the next page or None, ids of entries on this
        page that could not be read), each with its `archives` (one query for the page). `within`: only URIs under
        these root URIs (None: all). `archived`: instead of the live checkpoints, those an archive store holds,
        live or with their files deleted (restorable)."""
        where: list[str] = ["EXISTS (SELECT 1 FROM checkpoint_archives a WHERE a.checkpoint_id = c.id)" if archived
                            else "r.deleted_at IS NULL"]  # collected entries stay (for lineage) but are not listed
        params: list[Any] = []
        if within is not None:
            clause, clause_params = under("c.uri", within)
            where.append(clause)
            params.extend(clause_params)
        if name is not None:
            where.append("name = ?")
            params.append(name)
        if format is not None:
            where.append("format = ?")
            params.append(format)
        if tag is not None:
            where.append("c.tags LIKE ? AND EXISTS (SELECT 1 FROM json_each(c.tags) WHERE value = ?)")
            params.extend([f"%{json.dumps(tag)}%", tag])
        if after is not None:
            where.append("c.id > ?")
            params.append(after)
        rows = self.store.query(f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY c.id LIMIT ?", (*params, limit + 1))
        page, unreadable = views(rows[:limit], _view)
        archives = archives_by_checkpoint(self.store, [view.id for view in page])
        for view in page:
            view.archives = archives.get(view.id, [])
        return page, (rows[limit - 1]["id"] if len(rows) > limit else None), unreadable

    def delete(self, checkpoint_id: str) -> CheckpointView:
        view = self.get(checkpoint_id)
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))
        return view

    def lineage(self, checkpoint_id: str) -> LineageView:
        root = self.get(checkpoint_id)
        up = self._walk(checkpoint_id, "SELECT parent_id AS next, job_id FROM lineage WHERE child_id = ?")
        down = self._walk(checkpoint_id, "SELECT child_id AS next, job_id FROM lineage WHERE parent_id = ?")
        return LineageView(checkpoint=root, ancestors=up, descendants=down)

    def _walk(self, start: str, sql: str) -> builtins.list[LineageEdge]:  # `list` here is the method above
        """Breadth-first, each checkpoint once (so cycles end), at most MAX_LINEAGE entries."""
        seen, edges = {start}, builtins.list[LineageEdge]()
        todo: deque[tuple[str, int]] = deque([(start, 0)])
        while todo and len(edges) < MAX_LINEAGE:
            node, depth = todo.popleft()
            for row in self.store.query(sql, (node,)):
                if row["next"] in seen:
                    continue
                seen.add(row["next"])
                edges.append(LineageEdge(checkpoint=self.get(row["next"]), job_id=row["job_id"], depth=depth + 1))
                todo.append((row["next"], depth + 1))
        return edges
