"""The audit log: one appended row per change (submit, cancel, register, unregister, tag, alias move, rule and
policy changes, GC runs) and per refused attempt, with who, when, what and the object before and after.

Rows are only ever inserted (nothing in the service updates or deletes them, and the API has no route that
could); `GET /v1/audit` (admin) reads them newest first with filters. `object` names the thing changed as
`KIND:ID` (`job:…`, `checkpoint:…`, `alias:NAMESPACE/NAME`, `rule:…`, `policy:…`, `gc`); `before`/`after`
are the object's JSON around the change (None where it did not exist).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from . import logs
from .service_errors import InvalidRequest, StoreError
from .store import JobStore, dumps

Outcome = Literal["done", "refused"]
MAX_JSON = 64 * 1024  # a before/after larger than this is stored as a note saying so (a GC report can be big)


class AuditEntry(BaseModel):
    seq: int
    at: float = Field(description="Unix time of the change.")
    principal: str = Field(description="The token name or oidc:SUBJECT that acted (`unauthenticated` for a "
                                       "request without a valid token).")
    action: str = Field(description="What was done or tried, e.g. job.submit, alias.move, rule.remove.")
    object: str = Field(description="KIND:ID of what it was done to.")
    outcome: Outcome
    before: Any = None
    after: Any = None
    detail: str | None = Field(None, description="For a refusal: the one line the caller got.")


class AuditPage(BaseModel):
    items: list[AuditEntry]
    next_cursor: str | None = Field(None, description="Pass as `cursor` for older entries.")


def _json(value: Any) -> str | None:
    if value is None:
        return None
    text = dumps(value, "audit")
    if len(text) > MAX_JSON:
        return json.dumps({"truncated": f"{len(text)} bytes of JSON, over the audit log's {MAX_JSON}"})
    return text


class AuditLog:
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def record(self, principal: str, action: str, obj: str, *, before: Any = None, after: Any = None,
               outcome: Outcome = "done", detail: str | None = None) -> None:
        """Append one row. A failure to write is logged and never undoes or refuses the change itself (the
        change is already committed when this runs)."""
        try:
            self.store.write("INSERT INTO audit (at, principal, action, object, outcome, before, after, detail) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (time.time(), principal[:200], action[:100], obj[:500], outcome, _json(before),
                              _json(after), detail[:1000] if detail else None))
        except (StoreError, InvalidRequest) as exc:
            logs.event("audit.unwritten", action=action, object=obj, principal=principal, error=str(exc),
                       level=logging.ERROR)

    def entries(self, principal: str | None = None, action: str | None = None, obj: str | None = None,
                since: float | None = None, until: float | None = None, outcome: Outcome | None = None,
                limit: int = 100, cursor: int | None = None) -> AuditPage:
        """Newest first. `action` and `obj` match exactly, or as a prefix when they end with `*`
        (`alias:*`, `rule.*`); `since`/`until`: Unix times, inclusive."""
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("principal", principal), ("action", action), ("object", obj)):
            if value is None:
                continue
            if value.endswith("*"):
                where.append(f"substr({column}, 1, ?) = ?")
                params += [len(value) - 1, value[:-1]]
            else:
                where.append(f"{column} = ?")
                params.append(value)
        bounds: tuple[tuple[str, Any], ...] = (("at >= ?", since), ("at <= ?", until), ("seq < ?", cursor),
                                               ("outcome = ?", outcome))
        for clause, bound in bounds:
            if bound is not None:
                where.append(clause)
                params.append(bound)
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self.store.query(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit + 1))
        items = [AuditEntry(seq=row["seq"], at=row["at"], principal=row["principal"], action=row["action"],
                            object=row["object"], outcome=row["outcome"],
                            before=json.loads(row["before"]) if row["before"] else None,
                            after=json.loads(row["after"]) if row["after"] else None, detail=row["detail"])
                 for row in rows[:limit]]
        return AuditPage(items=items, next_cursor=str(items[-1].seq) if len(rows) > limit else None)
