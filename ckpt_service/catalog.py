"""Runs, steps, tags and aliases over the registry.

- A checkpoint belongs to a run at a step: given at registration (`metadata.run`, `metadata.step`) or read
  from its path by the run pattern (`CKPT_RUN_PATTERN`, default `{run}/step_{step}`: the last two path
  segments). Rule outputs take their source's run and step. "The latest step of run X" is a query.
- Tags are the registry's tag list; `key=value` tags replace the tag with the same key.
- Aliases (`prod`, `best`, `latest`) are unique within a namespace (a run, or `default`); moving one is one
  transaction that also appends to its history. `latest` follows the highest step of each run.

A checkpoint is referred to by id, or as `ALIAS@NAMESPACE`; a job source may be `alias:NAMESPACE/ALIAS`.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from .auth import Principal
from .registry import CheckpointView, Registry, Tag
from .service_errors import Forbidden, InvalidRequest, NotFound
from .store import JobStore, new_id, under
from .units import when

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_NAMESPACE = "default"
LATEST = "latest"
_TAG = TypeAdapter(Tag)


class ManagedView(BaseModel):
    """A checkpoint with its run, step, aliases and the rule that made it (GET /v1/aliases/…, `show prod@RUN`)."""

    checkpoint: CheckpointView
    run: str | None
    step: int | None
    aliases: list[str]
    rule_id: str | None
    deleted_at: datetime | None


class AliasChange(BaseModel):
    namespace: str
    name: str
    checkpoint_id: str | None
    previous_id: str | None
    changed_by: str
    changed_at: datetime


class RunView(BaseModel):
    run: str
    checkpoints: int
    latest_step: int | None
    latest_id: str | None


def check_name(value: str, field: str) -> str:
    if not NAME.match(value):
        raise InvalidRequest(f"{field}: {value[:80]!r} is not a name (1-64 of A-Z a-z 0-9 _ . -)", field)
    return value


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """`{run}/step_{step}` -> a regex matching the end of a path, with groups run and step."""
    if pattern.count("{run}") != 1 or pattern.count("{step}") > 1:
        raise InvalidRequest("run_pattern: name {run} once and {step} at most once, e.g. {run}/step_{step}",
                             "run_pattern")
    parts = re.split(r"(\{run\}|\{step\})", pattern.strip("/"))
    body = "".join({"{run}": r"(?P<run>[A-Za-z0-9_.-]{1,64})", "{step}": r"(?P<step>\d{1,18})"}.get(p, re.escape(p))
                   for p in parts)
    return re.compile(rf"(?:^|/){body}/?$")


def check_owner(principal: Principal | None, owner: str | None, what: str) -> None:
    """Changing or removing a managed object (a rule, tag, alias or registered checkpoint) is for the token name
    that made it and for admins; one with no owner (made by the service, or before owners were recorded) is for
    admins only. `principal` None: an in-process caller (the service itself)."""
    if principal is None or principal.scope == "admin":
        return
    if owner is None or principal.scope != "write" or principal.name != owner:
        whose = f"belongs to {owner!r}" if owner is not None else "has no owner"
        raise Forbidden(f"{what} {whose}; only {'that token or ' if owner is not None else ''}an admin may change it")


class Catalog:
    def __init__(self, store: JobStore, registry: Registry, run_pattern: str) -> None:
        self.store = store
        self.registry = registry
        self.pattern = compile_pattern(run_pattern)

    # -- runs and steps ----------------------------------------------------------------------------

    def derive(self, uri: str) -> tuple[str | None, int | None]:
        match = self.pattern.search(uri.rstrip("/"))
        if match is None:
            return None, None
        step = match.groupdict().get("step")
        return match["run"], int(step) if step is not None else None

    def place(self, conn: Any, checkpoint_id: str, run: str | None, step: int | None,
              by: str, rule_id: str | None = None) -> None:
        """Inside a transaction: record the run and step of a checkpoint (whose data exists now: a job may have
        re-made an output GC deleted); move `latest@run` when it is newer."""
        conn.execute("INSERT INTO checkpoint_runs (checkpoint_id, run, step, rule_id) VALUES (?, ?, ?, ?) "
                     "ON CONFLICT (checkpoint_id) DO UPDATE SET run = excluded.run, step = excluded.step, "
                     "rule_id = COALESCE(excluded.rule_id, checkpoint_runs.rule_id), deleted_at = NULL",
                     (checkpoint_id, run, step, rule_id))
        if run is None or step is None or rule_id is not None:
            return  # `latest` names a run's newest training checkpoint, not a rule's output
        row = conn.execute("SELECT r.step FROM aliases a JOIN checkpoint_runs r ON r.checkpoint_id = a.checkpoint_id "
                           "WHERE a.namespace = ? AND a.name = ?", (run, LATEST)).fetchone()
        if row is None or row["step"] is None or step > row["step"]:
            self._move(conn, run, LATEST, checkpoint_id, by)

    def place_registered(self, view: CheckpointView, by: str) -> None:
        """After a registration: run and step from `metadata.run` / `metadata.step`, else from the path."""
        run, step = self.derive(view.uri)
        meta_run, meta_step = view.metadata.get("run"), view.metadata.get("step")
        if meta_run is not None:
            run = check_name(str(meta_run), "metadata.run")
        if meta_step is not None:
            if isinstance(meta_step, bool) or not str(meta_step).isdigit():
                raise InvalidRequest("metadata.step: a whole number of steps", "metadata.step")
            step = int(meta_step)
        if run is not None:
            with self.store.transaction() as conn:
                self.place(conn, view.id, run, step, by)

    def runs(self, within: list[str] | None = None) -> list[RunView]:
        """Each run's live steps. `within`: count only checkpoints under these root URIs (a caller's readable
        roots; None: all); a run with none there is left out, and its latest step is the newest one there."""
        clause, params = under("c.uri", within) if within is not None else ("1 = 1", [])
        rows = self.store.query(
            "SELECT r.run, COUNT(*) AS n, MAX(r.step) AS latest FROM checkpoint_runs r JOIN checkpoints c ON "
            "c.id = r.checkpoint_id WHERE r.run IS NOT NULL AND r.deleted_at IS NULL AND r.rule_id IS NULL AND "
            f"{clause} GROUP BY r.run ORDER BY r.run", tuple(params))
        return [RunView(run=r["run"], checkpoints=r["n"], latest_step=r["latest"],
                        latest_id=self._latest_id(r["run"], within)) for r in rows]

    def _latest_id(self, run: str, within: list[str] | None = None) -> str | None:
        clause, params = under("c.uri", within) if within is not None else ("1 = 1", [])
        rows = self.store.query("SELECT r.checkpoint_id FROM checkpoint_runs r JOIN checkpoints c ON c.id = "
                                "r.checkpoint_id WHERE r.run = ? AND r.deleted_at IS NULL AND r.rule_id IS NULL AND "
                                f"r.step IS NOT NULL AND {clause} ORDER BY r.step DESC LIMIT 1", (run, *params))
        return rows[0]["checkpoint_id"] if rows else None

    def steps(self, run: str) -> list[ManagedView]:
        rows = self.store.query("SELECT checkpoint_id FROM checkpoint_runs WHERE run = ? AND deleted_at IS NULL "
                                "ORDER BY step, checkpoint_id", (run,))
        if not rows:
            raise NotFound(f"no checkpoints in run {run}")
        return [self.managed(r["checkpoint_id"]) for r in rows]

    def latest(self, run: str, within: list[str] | None = None) -> ManagedView:
        """The run's newest step (`within`: among those under these root URIs; None: all)."""
        found = self._latest_id(run, within)
        if found is None:
            raise NotFound(f"run {run} has no checkpoint with a step")
        return self.managed(found)

    def managed(self, checkpoint_id: str) -> ManagedView:
        view = self.registry.get(checkpoint_id)
        rows = self.store.query("SELECT * FROM checkpoint_runs WHERE checkpoint_id = ?", (checkpoint_id,))
        row = rows[0] if rows else None
        aliases = [f"{a['name']}@{a['namespace']}" for a in self.store.query(
            "SELECT namespace, name FROM aliases WHERE checkpoint_id = ? ORDER BY namespace, name", (checkpoint_id,))]
        return ManagedView(checkpoint=view, run=row["run"] if row else None, step=row["step"] if row else None,
                           aliases=aliases, rule_id=row["rule_id"] if row else None,
                           deleted_at=when(row["deleted_at"]) if row else None)

    # -- tags --------------------------------------------------------------------------------------

    def set_tags(self, checkpoint_id: str, set_: dict[str, str], remove: list[str],
                 principal: Principal | None = None) -> list[str]:
        """Set `key=value` tags (replacing the same key) and remove tags by key; returns the tag list. A new key
        is owned by whoever sets it; changing or removing an existing one is for its owner or an admin."""
        new = []
        for key, value in set_.items():
            try:
                new.append(_TAG.validate_python(f"{key}={value}" if value != "" else key))
            except ValidationError:
                raise InvalidRequest(f"tags.{key[:64]}: tags are 1-64 of A-Z a-z 0-9 _ . : = / -",
                                     f"tags.{key[:64]}") from None
        drop = set(remove) | set(set_)
        with self.store.transaction() as conn:
            row = conn.execute("SELECT tags, tag_owners FROM checkpoints WHERE id = ?", (checkpoint_id,)).fetchone()
            if row is None:
                raise NotFound(f"no checkpoint {checkpoint_id}")
            owners: dict[str, str | None] = json.loads(row["tag_owners"])
            for tag in json.loads(row["tags"]):
                key = tag.partition("=")[0]
                if key in drop:
                    check_owner(principal, owners.get(key), f"tag {key} of checkpoint {checkpoint_id}")
            tags = [t for t in json.loads(row["tags"]) if t.partition("=")[0] not in drop] + new
            if len(tags) > 32:
                raise InvalidRequest("tags: at most 32 tags per checkpoint", "tags")
            owners = {k: v for k, v in owners.items() if k not in drop}
            owners.update({t.partition("=")[0]: principal.name if principal else None for t in new})
            conn.execute("UPDATE checkpoints SET tags = ?, tag_owners = ?, updated_at = ? WHERE id = ?",
                         (json.dumps(tags), json.dumps(owners), time.time(), checkpoint_id))
        return tags

    # -- aliases -----------------------------------------------------------------------------------

    def _move(self, conn: Any, namespace: str, name: str, checkpoint_id: str | None, by: str,
              principal: Principal | None = None) -> None:
        """Inside a transaction: point (or with None, remove) an alias. An existing alias is moved or removed
        by its owner or an admin only; a new one is owned by `principal` (None: the service, e.g. `latest`)."""
        now = time.time()
        row = conn.execute("SELECT checkpoint_id, owner FROM aliases WHERE namespace = ? AND name = ?",
                           (namespace, name)).fetchone()
        previous = row["checkpoint_id"] if row else None
        if previous == checkpoint_id:
            return
        if row is not None:
            check_owner(principal, row["owner"], f"alias {name}@{namespace}")
        if checkpoint_id is None:
            conn.execute("DELETE FROM aliases WHERE namespace = ? AND name = ?", (namespace, name))
        else:
            conn.execute("INSERT INTO aliases (namespace, name, checkpoint_id, updated_by, updated_at, owner) "
                         "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (namespace, name) DO UPDATE SET "
                         "checkpoint_id = excluded.checkpoint_id, updated_by = excluded.updated_by, "
                         "updated_at = excluded.updated_at",
                         (namespace, name, checkpoint_id, by, now, principal.name if principal else None))
        conn.execute("INSERT INTO alias_history (id, namespace, name, checkpoint_id, previous_id, changed_by, "
                     "changed_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (new_id("alh"), namespace, name, checkpoint_id, previous, by, now))

    def namespace_of(self, checkpoint_id: str) -> str:
        rows = self.store.query("SELECT run FROM checkpoint_runs WHERE checkpoint_id = ?", (checkpoint_id,))
        return rows[0]["run"] if rows and rows[0]["run"] else DEFAULT_NAMESPACE

    def set_alias(self, namespace: str | None, name: str, checkpoint_id: str, by: str,
                  principal: Principal | None = None) -> ManagedView:
        """Point `name@namespace` (default: the checkpoint's run) at a checkpoint, atomically."""
        check_name(name, "alias")
        view = self.registry.get(checkpoint_id)
        namespace = check_name(namespace, "namespace") if namespace else self.namespace_of(checkpoint_id)
        with self.store.transaction() as conn:
            gone = conn.execute("SELECT deleted_at FROM checkpoint_runs WHERE checkpoint_id = ?",
                                (checkpoint_id,)).fetchone()
            if gone is not None and gone["deleted_at"] is not None:
                if view.archives:  # retention archived it first: restoring it in place makes it live again
                    a = view.archives[0]
                    raise InvalidRequest(f"checkpoint {checkpoint_id} was archived in {a.store} as {a.archive_id} and "
                                         "its files deleted; restore it to its own place (a restore job of that "
                                         "archive id), then set the alias", "checkpoint_id")
                raise InvalidRequest(f"checkpoint {checkpoint_id} was deleted by garbage collection", "checkpoint_id")
            self._move(conn, namespace, name, checkpoint_id, by, principal)
        return self.managed(checkpoint_id)

    def remove_alias(self, namespace: str, name: str, by: str, principal: Principal | None = None) -> None:
        self.resolve(namespace, name)
        with self.store.transaction() as conn:
            self._move(conn, namespace, name, None, by, principal)

    def resolve(self, namespace: str, name: str) -> str:
        rows = self.store.query("SELECT checkpoint_id FROM aliases WHERE namespace = ? AND name = ?",
                                (namespace, name))
        if not rows:
            raise NotFound(f"no alias {name}@{namespace}")
        return rows[0]["checkpoint_id"]

    def checkpoint_id(self, ref: str) -> str:
        """The checkpoint `ref` names: an id, `ALIAS@RUN` (`latest@run-7`), `NAME@RUN`, or a NAME only one listed
        checkpoint has. NotFound when none does; InvalidRequest naming the candidates when several do."""
        if self.store.query("SELECT 1 FROM checkpoints WHERE id = ?", (ref,)):
            return ref
        name, sep, run = ref.partition("@")
        if sep and (aliased := self.store.query("SELECT checkpoint_id FROM aliases WHERE namespace = ? AND name = ?",
                                                (run, name))):
            return aliased[0]["checkpoint_id"]
        sql = ("SELECT c.id, r.run FROM checkpoints c LEFT JOIN checkpoint_runs r ON r.checkpoint_id = c.id "
               "WHERE c.name = ? AND r.deleted_at IS NULL")
        rows = self.store.query(sql + (" AND r.run = ?" if sep else "") + " ORDER BY c.id LIMIT 11",
                                (name, run) if sep else (name,))
        if not rows:
            raise NotFound(f"no alias {ref} and no checkpoint named {name} in run {run}" if sep else
                           f"no checkpoint with the id or name {ref} (NAME@RUN and ALIAS@RUN name one in a run)")
        if len(rows) > 1:
            listed = ", ".join(r["id"] + (f" ({name}@{r['run']})" if r["run"] else "") for r in rows[:10])
            count = len(rows) if len(rows) <= 10 else "more than 10"
            raise InvalidRequest(f"{ref} names {count} checkpoints: {listed}; give an id or NAME@RUN", "checkpoint_id")
        return rows[0]["id"]

    def history(self, namespace: str, name: str) -> list[AliasChange]:
        rows = self.store.query("SELECT * FROM alias_history WHERE namespace = ? AND name = ? "
                                "ORDER BY changed_at, id", (namespace, name))
        if not rows:
            raise NotFound(f"no alias {name}@{namespace}")
        return [AliasChange(namespace=r["namespace"], name=r["name"], checkpoint_id=r["checkpoint_id"],
                            previous_id=r["previous_id"], changed_by=r["changed_by"],
                            changed_at=when(r["changed_at"])) for r in rows]

    def aliases(self, namespace: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT namespace, name, checkpoint_id, updated_by, updated_at FROM aliases"
        params: tuple[str, ...] = ()
        if namespace is not None:
            sql, params = sql + " WHERE namespace = ?", (namespace,)
        return [{"namespace": r["namespace"], "name": r["name"], "checkpoint_id": r["checkpoint_id"],
                 "updated_by": r["updated_by"], "updated_at": when(r["updated_at"])}
                for r in self.store.query(sql + " ORDER BY namespace, name", params)]

    def resolve_source(self, source: str) -> str:
        """`alias:NAMESPACE/NAME` -> the URI it names now; anything else unchanged."""
        if not source.startswith("alias:"):
            return source
        namespace, sep, name = source.removeprefix("alias:").partition("/")
        if not sep:
            raise InvalidRequest("source: write an alias as alias:RUN/NAME (e.g. alias:run-7/prod)", "source")
        try:
            checkpoint_id = self.resolve(check_name(namespace, "source"), check_name(name, "source"))
        except NotFound as exc:
            raise InvalidRequest(f"source: {exc}", "source") from None
        return self.registry.get(checkpoint_id).uri
