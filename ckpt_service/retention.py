"""Retention policies and garbage collection.

A policy covers the checkpoints of one run, or those under one path prefix, optionally only sources
(checkpoints no job made) or only exports (made by a job). Within each run it keeps the last K steps,
every Nth step and anything younger than T; a checkpoint is deleted when a policy covers it, no policy
covering it keeps it, and nothing protects it (a run's own checkpoints and each rule's outputs of that run
are ranked separately):

- an alias or a `pin` tag (`pin` or `pin=…`) protects a checkpoint always;
- a checkpoint with a derived output that stays is kept, unless the policy says `delete_with_outputs`;
- a checkpoint a queued or running job reads or writes, or that an active rule has yet to fire on, waits
  for a later run;
- nothing outside the write roots is ever planned (and `roots.check` runs again before each removal).

GC plans first (what, which policy and why, bytes). Executing marks the plan's entries deleted in the
registry and appends them to the deletion log (`pending`, with the device and inode of a local path) in
batches, then removes the data, each only after `roots.check` places it under a write root, and marks the
log entry `done`. An interrupted GC leaves `pending` entries, which the next run finishes first; data
already gone counts as removed. `DELETE /v1/checkpoints/{id}?purge=true` goes through the same log.

A deletion removes exactly the registered path (`remove_checkpoint`), with a single file's manifest beside it
(`<file>.ckpt-manifest.json`): every component of a local path is
opened with O_NOFOLLOW from `/` down, and nothing is removed (`refused`) when a component is a symlink, the
path is no longer what was planned (another device or inode), or it is the folder of a checkpoint that
stays (aliased, pinned, kept, or any other live entry). Inside the tree a symlink is unlinked, never
followed. Each item is handled on its own: one that fails is logged and the others go on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from converters import CkptError

from . import logs, roots
from .audit import AuditLog
from .catalog import NAME, when
from .service_errors import Conflict, NotFound, ServiceError
from .store import new_id, under, views
from .units import DURATION

if TYPE_CHECKING:
    from .service import CkptService
    from .store import JobStore

class PolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME.pattern)
    run: str | None = Field(None, pattern=NAME.pattern, description="The run this policy covers.")
    prefix: str | None = Field(None, min_length=1, max_length=4096, description="Or: everything under this URI.")
    applies_to: Literal["all", "sources", "exports"] = Field("all", description="sources: checkpoints no job made; "
                                                             "exports: outputs of jobs.")
    keep_last: int | None = Field(None, ge=0, le=1_000_000, description="Keep the last K steps of each run.")
    keep_every: int | None = Field(None, ge=1, le=10**12, description="Keep steps divisible by N.")
    keep_younger_than: Annotated[float | None, DURATION] = Field(None, ge=0, description="Keep checkpoints "
                                                                 "registered within T (seconds, or 90m, 36h, 7d).")
    delete_with_outputs: bool = Field(False, description="Delete even when outputs derived from it are kept.")
    action: Literal["delete", "archive"] = Field("delete", description="archive: archive each checkpoint it does not "
                                                 "keep to `store`, check the archive, then delete its files (the "
                                                 "entry stays, restorable); delete: just delete them.")
    store: str | None = Field(None, min_length=1, max_length=4096, description="With action archive: the archive "
                              "store (a folder or URI under a write root).")

    @model_validator(mode="after")
    def _scope(self) -> PolicySpec:
        if (self.run is None) == (self.prefix is None):
            raise ValueError("give exactly one of run or prefix")
        if self.keep_last is None and self.keep_every is None and self.keep_younger_than is None:
            raise ValueError("give at least one of keep_last, keep_every, keep_younger_than (a policy that keeps "
                             "nothing would delete everything it covers)")
        if (self.action == "archive") != (self.store is not None):
            raise ValueError("action archive needs a store (and only it takes one): give both, or neither")
        return self


class PolicyView(BaseModel):
    id: str
    spec: PolicySpec
    created_by: str
    created_at: datetime


class PlanItem(BaseModel):
    checkpoint_id: str
    uri: str
    run: str | None
    step: int | None
    bytes: int
    policy: str
    reason: str
    action: Literal["delete", "archive"] = "delete"
    store: str | None = None  # with action archive: the store it is archived to first


class GcReport(BaseModel):
    dry_run: bool
    plan: list[PlanItem]
    bytes: int = Field(description="Bytes the plan frees: the files it deletes (a checkpoint whose archive failed is "
                       "kept and not counted once the run has tried).")
    archived_bytes: int = Field(0, description="Of `bytes`, those of checkpoints archived (and checked) before their "
                                "files are deleted: still restorable.")
    archive_stored_bytes: int = Field(0, description="What archiving them added to the archive stores (their chunks "
                                      "not there already, deduplicated and compressed); known once archived, so 0 "
                                      "in a dry run. The storage a run frees is `bytes` less this.")
    deleted: list[str] = Field(default_factory=list, description="Deletion ids finished by this run.")
    failed: list[str] = Field(default_factory=list, description="Deletion ids left pending (see their error).")
    archived: list[str] = Field(default_factory=list, description="Checkpoint ids archived (and checked) before "
                                "their files were deleted.")
    not_archived: list[str] = Field(default_factory=list, description="Checkpoint ids whose archive failed or did "
                                    "not check out: kept, see the audit log for why.")


class DeletionView(BaseModel):
    id: str
    checkpoint_id: str
    uri: str
    bytes: int
    policy: str
    reason: str
    requested_by: str
    state: Literal["pending", "done", "refused"]
    error: str | None
    planned_at: datetime
    done_at: datetime | None


def disk_bytes(uri: str) -> int:
    """Bytes the data at `uri` takes (0 when it is gone)."""
    from converters import storage

    if storage.is_local(uri):
        path = storage.local_path(uri)
        if os.path.islink(path) or os.path.isfile(path):
            return os.lstat(path).st_size
        total = 0
        for folder, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total
    try:
        fs, path = storage.filesystem(uri)
        return int(fs.du(path)) if fs.exists(path) else 0
    except (OSError, ValueError):
        return 0


class DeletionRefused(Conflict):
    """The data at a registered path is not what was registered (a symlink, a swapped or kept folder)."""


@dataclass(frozen=True)
class Kept:
    """The live checkpoints another deletion must not touch: their folders' identities and their paths."""

    by_identity: dict[str, str] = field(default_factory=dict)  # dev:ino -> checkpoint id
    by_path: dict[str, str] = field(default_factory=dict)  # registered local path -> checkpoint id


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def local_identity(uri: str) -> str | None:
    """`dev:ino` of a local path itself (a symlink is not followed); None when gone or not local."""
    from converters import storage

    if not storage.is_local(uri):
        return None
    try:
        return identity(os.lstat(storage.local_path(uri)))
    except (OSError, ValueError):
        return None


def remove_checkpoint(uri: str, write_roots: list[roots.Location], *, expected: str | None = None,
                      kept: Kept | None = None) -> None:
    """Delete exactly the data registered at `uri` (data already gone is fine). Local paths: nothing reached
    through a symlink; refused (DeletionRefused) before anything is removed when a component of the path is a
    symlink, when its identity is not `expected` (recorded at plan time), or when it is or holds the folder of
    a `kept` checkpoint. Object-store prefixes go through fsspec (no symlinks there)."""
    from converters import storage

    checked = roots.check(uri, write_roots, field="uri", purpose="write")
    if not storage.is_local(uri):
        _remove_remote(checked)
        return
    path = roots.parse(uri, resolve=False).uri()
    if checked != path and os.path.lexists(path):
        raise DeletionRefused(f"{uri}: a component of the path is a symlink (it leads to {checked}); nothing deleted")
    kept = kept or Kept()
    inside = sorted(i for p, i in kept.by_path.items() if p.startswith(path.rstrip("/") + "/"))
    if inside:
        raise DeletionRefused(f"{uri} holds checkpoint {inside[0]}, which stays; nothing deleted")
    parent = _open_parent(uri, path)
    if parent is None:
        return  # a folder above it is gone: so is the data
    try:
        name = os.path.basename(path)
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise DeletionRefused(f"{uri} is a symlink now, not the data that was registered; nothing deleted")
        if expected is not None and identity(st) != expected:
            raise DeletionRefused(f"{uri} was replaced since the deletion was planned (another folder or file is "
                                  "there now); nothing deleted")
        _refuse_kept(uri, st, kept)
        if stat.S_ISDIR(st.st_mode):
            _remove_dir(uri, parent, name, st, kept)
        else:
            os.unlink(name, dir_fd=parent)
            _remove_sidecar(parent, name)
    except OSError as exc:
        raise ServiceError(f"could not delete {uri}: {type(exc).__name__} ({exc.strerror})") from None
    finally:
        os.close(parent)


def _remove_sidecar(parent: int, name: str) -> None:
    """A single-file checkpoint's manifest beside it (`<file>.ckpt-manifest.json`) goes with it; a symlink there is
    unlinked, never followed, and a folder of that name is left alone."""
    from converters import manifest_sidecar

    beside = manifest_sidecar(name)
    with contextlib.suppress(OSError):  # the data is gone already; a manifest left behind does no harm
        if not stat.S_ISDIR(os.stat(beside, dir_fd=parent, follow_symlinks=False).st_mode):
            os.unlink(beside, dir_fd=parent)


def _refuse_kept(uri: str, st: os.stat_result, kept: Kept) -> None:
    owner = kept.by_identity.get(identity(st))
    if owner is not None:
        raise DeletionRefused(f"{uri} holds the data of checkpoint {owner}, which stays; nothing deleted")


def _open_parent(uri: str, path: str) -> int | None:
    """An fd of the folder holding `path`, opened one component at a time from `/` without following links
    (None when a component is gone)."""
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in [p for p in os.path.dirname(path).split("/") if p]:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as exc:
                raise DeletionRefused(f"{uri}: path component {part!r} is a symlink or not a folder "
                                      f"({exc.strerror}); nothing deleted") from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_dir(uri: str, parent: int, name: str, st: os.stat_result, kept: Kept) -> None:
    """Remove folder `name` under fd `parent` and everything in it; symlinks inside are unlinked, not followed."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        if identity(os.fstat(fd)) != identity(st):
            raise DeletionRefused(f"{uri} changed while it was being deleted; stopped")
        with os.scandir(fd) as entries:
            found = [(e.name, e.stat(follow_symlinks=False)) for e in entries]
        for child, child_st in found:
            if stat.S_ISDIR(child_st.st_mode):
                _refuse_kept(uri, child_st, kept)
                _remove_dir(uri, fd, child, child_st, kept)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _remove_remote(uri: str) -> None:
    from converters import manifest_sidecar, storage

    try:
        fs, path = storage.filesystem(uri)
        if fs.exists(path):
            single = fs.isfile(path)
            fs.rm(path, recursive=True)
            if single and fs.exists(manifest_sidecar(path)):  # a single file's manifest beside it
                fs.rm(manifest_sidecar(path))
    except FileNotFoundError:
        return
    except (CkptError, OSError) as exc:
        raise ServiceError(f"could not delete {uri}: {type(exc).__name__}") from None


class Retention:
    def __init__(self, service: CkptService) -> None:
        self.service = service
        self.store = service.store

    # -- policies ----------------------------------------------------------------------------------

    def add_policy(self, spec: PolicySpec, by: str) -> PolicyView:
        if spec.prefix is not None:
            spec = spec.model_copy(update={"prefix": roots.check(spec.prefix, self.service.settings.write_locations,
                                                                 field="prefix", purpose="read")})
        if spec.store is not None:
            spec = spec.model_copy(update={"store": roots.check(spec.store, self.service.settings.write_locations,
                                                                field="store", purpose="write")})
        policy_id, now = new_id("pol"), time.time()
        with self.store.transaction() as conn:
            if conn.execute("SELECT 1 FROM retention_policies WHERE name = ?", (spec.name,)).fetchone():
                raise Conflict(f"a policy named {spec.name} exists; remove it first or choose another name")
            conn.execute("INSERT INTO retention_policies (id, name, spec, created_by, created_at) VALUES "
                         "(?, ?, ?, ?, ?)", (policy_id, spec.name, spec.model_dump_json(), by, now))
        return self.policy(policy_id)

    def _row_view(self, row: Any) -> PolicyView:
        view = PolicyView(id=row["id"], spec=PolicySpec.model_validate_json(row["spec"]), created_by=row["created_by"],
                          created_at=when(row["created_at"]))
        view.model_dump_json()  # text that is not UTF-8 fails here, for this row alone
        return view

    def policy(self, policy_id: str) -> PolicyView:
        rows = self.store.query("SELECT * FROM retention_policies WHERE id = ? OR name = ?", (policy_id, policy_id))
        if not rows:
            raise NotFound(f"no retention policy {policy_id}")
        return self._row_view(rows[0])

    def policies(self) -> list[PolicyView]:
        """Every readable policy (a damaged row is logged and left out, of GC too)."""
        return views(self.store.query("SELECT * FROM retention_policies ORDER BY name"), self._row_view)[0]

    def remove_policy(self, policy_id: str) -> PolicyView:
        view = self.policy(policy_id)
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM retention_policies WHERE id = ?", (view.id,))
        return view

    # -- planning ----------------------------------------------------------------------------------

    def _live(self) -> list[dict[str, Any]]:
        rows = self.store.query(
            "SELECT c.id, c.uri, c.tags, c.made_by_job, c.created_at, r.run, r.step, r.rule_id FROM checkpoints c "
            "LEFT JOIN checkpoint_runs r ON r.checkpoint_id = c.id WHERE r.deleted_at IS NULL ORDER BY c.id")
        return [dict(r) for r in rows]

    def _busy(self) -> set[str]:
        busy: set[str] = set()
        for row in self.store.query("SELECT id, spec, target FROM jobs WHERE state IN ('queued', 'running')"):
            busy.update(u for u in (row["target"],) if u)
            try:
                spec = json.loads(row["spec"])
                busy.update(u for u in (spec.get("source"), spec.get("target")) if isinstance(u, str))
            except (ValueError, AttributeError):
                logs.event("gc.unreadable", job_id=row["id"], level=logging.WARNING)
        return busy

    @staticmethod
    def _pinned(c: dict[str, Any]) -> bool:
        """An alias-free protection: a `pin` tag. A checkpoint whose tags cannot be read counts as pinned."""
        try:
            return any(t == "pin" or str(t).startswith("pin=") for t in json.loads(c["tags"]))
        except (ValueError, TypeError):
            logs.event("gc.unreadable", checkpoint_id=c["id"], level=logging.WARNING)
            return True

    @staticmethod
    def _covers(spec: PolicySpec, c: dict[str, Any]) -> bool:
        made = c["made_by_job"] is not None
        if (spec.applies_to == "sources" and made) or (spec.applies_to == "exports" and not made):
            return False
        if spec.run is not None:
            return c["run"] == spec.run
        prefix = roots.parse(spec.prefix or "", resolve=False)
        try:
            return prefix.contains(roots.parse(c["uri"], resolve=False))
        except ServiceError:
            return False

    @staticmethod
    def _verdicts(spec: PolicySpec, covered: list[dict[str, Any]], now: float) -> dict[str, str | None]:
        """checkpoint id -> None (kept) or why this policy would delete it."""
        verdicts: dict[str, str | None] = {}
        by_run: dict[tuple[str | None, str], list[dict[str, Any]]] = defaultdict(list)
        for c in covered:  # a run's training checkpoints, and each rule's outputs of it, are counted apart
            by_run[c["run"], "source" if c["made_by_job"] is None else c["rule_id"] or "output"].append(c)
        for (run, _), group in by_run.items():
            group.sort(key=lambda c: (c["step"] if c["step"] is not None else -1, c["created_at"]), reverse=True)
            for rank, c in enumerate(group):
                kept = ((spec.keep_last is not None and rank < spec.keep_last)
                        or (spec.keep_every is not None and c["step"] is not None and c["step"] % spec.keep_every == 0)
                        or (spec.keep_younger_than is not None and c["created_at"] >= now - spec.keep_younger_than))
                where = f"run {run} step {c['step']}" if run is not None else "no run"
                verdicts[c["id"]] = None if kept else f"{where}: not kept by {_keeps(spec)}"
        return verdicts

    def _writable(self, uri: str) -> bool:
        try:
            roots.check(uri, self.service.settings.write_locations, field="uri", purpose="write")
        except ServiceError:
            return False
        return True

    def _unconverted(self, uris: set[str]) -> set[str]:
        """Those of `uris` that an active rule matches and has not fired on yet (its job is still to come)."""
        from .rules import RuleSpec, matches

        fired = {(r["rule_id"], r["uri"]) for r in self.store.query("SELECT rule_id, uri FROM rule_triggers")}
        waiting = set()
        for row in self.store.query("SELECT id, spec FROM rules WHERE paused = 0"):
            try:
                pattern = RuleSpec.model_validate_json(row["spec"]).pattern
            except ValueError:
                logs.event("gc.unreadable", rule_id=row["id"], level=logging.WARNING)
                continue
            waiting |= {u for u in uris if matches(pattern, u) and (row["id"], u) not in fired}
        return waiting

    def plan(self, now: float | None = None) -> list[PlanItem]:
        now = time.time() if now is None else now
        live = self._live()
        policies = [p.spec for p in self.policies()]
        aliased = {r["checkpoint_id"] for r in self.store.query("SELECT DISTINCT checkpoint_id FROM aliases")}
        busy = self._busy()
        doomed: dict[str, tuple[PolicySpec, str]] = {}
        kept_by_some: set[str] = set()
        for spec in policies:
            for checkpoint_id, reason in self._verdicts(spec, [c for c in live if self._covers(spec, c)], now).items():
                if reason is None:
                    kept_by_some.add(checkpoint_id)
                elif checkpoint_id not in doomed:
                    doomed[checkpoint_id] = (spec, reason)
        by_id = {c["id"]: c for c in live}
        for checkpoint_id in list(doomed):
            c = by_id[checkpoint_id]
            if (checkpoint_id in kept_by_some or checkpoint_id in aliased or self._pinned(c) or c["uri"] in busy
                    or not self._writable(c["uri"])):
                del doomed[checkpoint_id]
        waiting = self._unconverted({c["uri"] for i, c in by_id.items() if i in doomed})
        for checkpoint_id in [i for i in doomed if by_id[i]["uri"] in waiting]:
            del doomed[checkpoint_id]
        children: dict[str, list[str]] = defaultdict(list)
        for row in self.store.query("SELECT child_id, parent_id FROM lineage"):
            children[row["parent_id"]].append(row["child_id"])
        changed = True
        while changed:  # a derived output that stays keeps its source (and so on up the chain)
            changed = False
            for checkpoint_id in list(doomed):
                spec, _ = doomed[checkpoint_id]
                if not spec.delete_with_outputs and any(k in by_id and k not in doomed
                                                        for k in children[checkpoint_id]):
                    del doomed[checkpoint_id]
                    changed = True
        return [PlanItem(checkpoint_id=i, uri=by_id[i]["uri"], run=by_id[i]["run"], step=by_id[i]["step"],
                         bytes=disk_bytes(by_id[i]["uri"]), policy=spec.name, reason=reason, action=spec.action,
                         store=spec.store)
                for i, (spec, reason) in sorted(doomed.items(), key=lambda kv: (by_id[kv[0]]["uri"]))]

    # -- execution ---------------------------------------------------------------------------------

    def run(self, dry_run: bool, by: str) -> GcReport:
        plan = self.plan()
        report = GcReport(dry_run=dry_run, plan=plan, bytes=sum(p.bytes for p in plan),
                          archived_bytes=sum(p.bytes for p in plan if p.action == "archive"), archive_stored_bytes=0)
        if dry_run:
            return report
        for item in [p for p in plan if p.action == "archive"]:  # archived and checked before anything is deleted
            scratch = str(self.service.settings.data_dir / "archive-checks")
            added = archive_first(self.store, item, by, scratch)
            (report.archived if added is not None else report.not_archived).append(item.checkpoint_id)
            report.archive_stored_bytes += added or 0
        plan = [p for p in plan if p.checkpoint_id not in report.not_archived]
        report.bytes = sum(p.bytes for p in plan)
        report.archived_bytes = sum(p.bytes for p in plan if p.action == "archive")
        batch = self.service.settings.gc_batch
        for start in range(0, len(plan), batch):
            self._mark(plan[start:start + batch], by)
        report.deleted, report.failed = self.finish_pending()
        logs.event("gc.done", by=by, planned=len(plan), deleted=len(report.deleted), failed=len(report.failed),
                   bytes=report.bytes, archived_bytes=report.archived_bytes,
                   archive_stored_bytes=report.archive_stored_bytes)
        AuditLog(self.store).record(by, "gc.run", "gc", after=report.model_dump(mode="json"))
        return report

    def _mark(self, items: list[PlanItem], by: str) -> list[str]:
        """One transaction: mark a batch deleted in the registry and log each deletion as pending (with the
        identity of a local path, checked again before removal); returns the deletion ids."""
        now, made = time.time(), []
        with self.store.transaction() as conn:
            for item in items:
                if conn.execute("SELECT 1 FROM aliases WHERE checkpoint_id = ?", (item.checkpoint_id,)).fetchone():
                    continue  # aliased since the plan was made
                cur = conn.execute(
                    "INSERT INTO checkpoint_runs (checkpoint_id, run, step, deleted_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (checkpoint_id) DO UPDATE SET deleted_at = excluded.deleted_at "
                    "WHERE checkpoint_runs.deleted_at IS NULL", (item.checkpoint_id, item.run, item.step, now))
                if cur.rowcount != 1:
                    continue  # another GC (another replica) took it
                made.append(new_id("del"))
                conn.execute("INSERT INTO deletions (id, checkpoint_id, uri, bytes, policy, reason, requested_by, "
                             "state, planned_at, identity) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                             (made[-1], item.checkpoint_id, item.uri, item.bytes, item.policy, item.reason, by,
                              now, local_identity(item.uri)))
        return made

    def finish_pending(self, only: str | None = None) -> tuple[list[str], list[str]]:
        """Remove the data of every pending deletion (this run's and any an interrupted run left), or of
        deletion `only`; returns (done, not done) deletion ids. Each is handled on its own."""
        kept = self._kept()
        sql = ("SELECT id, checkpoint_id, uri, identity, requested_by, policy, reason FROM deletions "
               "WHERE state = 'pending'")
        params: tuple[str, ...] = ()
        if only is not None:
            sql, params = sql + " AND id = ?", (only,)
        done: list[str] = []
        failed: list[str] = []
        for row in self.store.query(sql + " ORDER BY planned_at, id", params):
            state = self._finish(row, kept)
            (done if state == "done" else failed).append(row["id"])
        return done, failed

    def _kept(self) -> Kept:
        """Every live registered local checkpoint: its folder is never removed by another's deletion (symlinks
        followed here: a checkpoint registered through a link protects what it names)."""
        from converters import storage

        kept = Kept()
        for row in self.store.query("SELECT c.id, c.uri FROM checkpoints c LEFT JOIN checkpoint_runs r ON "
                                    "r.checkpoint_id = c.id WHERE r.deleted_at IS NULL"):
            if storage.is_local(row["uri"]):
                path = storage.local_path(row["uri"])
                kept.by_path[path.rstrip("/")] = row["id"]
                with contextlib.suppress(OSError, ValueError):
                    kept.by_identity[identity(os.stat(path))] = row["id"]
        return kept

    def _finish(self, row: Any, kept: Kept) -> str:
        """Remove one pending deletion's data and record the outcome: done, refused, or still pending."""
        state, error = "done", None
        try:
            remove_checkpoint(row["uri"], self.service.settings.write_locations, expected=row["identity"],
                              kept=kept)
        except (roots.OutsideRoots, DeletionRefused) as exc:
            state, error = "refused", str(exc)
        except ServiceError as exc:
            state, error = "pending", str(exc)
        except Exception as exc:  # one bad item is logged and left pending; the others go on
            state, error = "pending", f"could not delete {row['uri']}: {type(exc).__name__}"
            logs.event("gc.item_error", deletion=row["id"], exc_info=True)
        with self.store.transaction() as conn:
            conn.execute("UPDATE deletions SET state = ?, error = ?, done_at = ? WHERE id = ?",
                         (state, error, time.time() if state != "pending" else None, row["id"]))
        logs.event("gc.deleted" if state == "done" else "gc.not_deleted", deletion=row["id"], uri=row["uri"],
                   state=state, error=error)
        if state != "pending":  # still pending: tried again by the next GC, and audited then
            AuditLog(self.store).record(
                row["requested_by"], "checkpoint.delete", f"checkpoint:{row['checkpoint_id']}",
                before={"uri": row["uri"], "deletion": row["id"], "policy": row["policy"], "reason": row["reason"]},
                after={"state": state}, outcome="done" if state == "done" else "refused", detail=error)
        return state

    def purge(self, checkpoint_id: str, uri: str, by: str) -> None:
        """`DELETE /v1/checkpoints/{id}?purge=true`: the same log and removal as GC. The entry stays, marked
        deleted; a refused removal (DeletionRefused, 409) leaves it live again."""
        place = self.store.query("SELECT run, step FROM checkpoint_runs WHERE checkpoint_id = ?", (checkpoint_id,))
        item = PlanItem(checkpoint_id=checkpoint_id, uri=uri, run=place[0]["run"] if place else None,
                        step=place[0]["step"] if place else None, bytes=disk_bytes(uri), policy="purge",
                        reason=f"purged by {by}")
        made = self._mark([item], by)
        if not made:
            raise Conflict(f"checkpoint {checkpoint_id} has an alias or was deleted already; remove the alias first")
        self.finish_pending(made[0])
        row = self.store.query("SELECT state, error FROM deletions WHERE id = ?", (made[0],))[0]
        if row["state"] != "done":  # not retried by GC later: the checkpoint is live again
            with self.store.transaction() as conn:
                conn.execute("UPDATE deletions SET state = 'refused', done_at = ? WHERE id = ?", (time.time(), made[0]))
                conn.execute("UPDATE checkpoint_runs SET deleted_at = NULL WHERE checkpoint_id = ?", (checkpoint_id,))
            raise (DeletionRefused if row["state"] == "refused" else ServiceError)(row["error"])

    def deletions(self, state: str | None = None, limit: int = 100, within: list[str] | None = None
                  ) -> list[DeletionView]:
        """Newest first. `within`: only URIs under these root URIs (a caller's readable roots; None: all),
        filtered in the query so `limit` rows come back whenever that many exist."""
        where, params = ["1 = 1"], list[Any]()
        if state is not None:
            where.append("state = ?")
            params.append(state)
        if within is not None:
            clause, clause_params = under("uri", within)
            where.append(clause)
            params.extend(clause_params)
        rows = self.store.query(f"SELECT * FROM deletions WHERE {' AND '.join(where)} ORDER BY planned_at DESC, id "
                                "LIMIT ?", (*params, limit))
        return views(rows, _deletion_view)[0]  # a damaged row is logged and left out


def archive_first(store: JobStore, item: PlanItem, by: str, scratch: str) -> int | None:
    """Retention's `archive` action, before the deletion: archive the checkpoint to the policy's store, check the
    archive (restored under `scratch`, every chunk's hash checked, and compared byte for byte with the original),
    record it in the registry; one audit row either way. The bytes archiving added to the store, or None (the
    checkpoint is kept) when any of it fails."""
    from converters import archive_checkpoint

    from .archived import check_archive, record

    target = f"checkpoint:{item.checkpoint_id}"
    try:
        result = archive_checkpoint(item.uri, item.store or "").to_dict()
        check_archive(result["store"], result["archive_id"], item.uri, scratch)
    except Exception as exc:  # the engine's one line (or an OS error): the checkpoint stays
        error = str(exc) if isinstance(exc, CkptError) else f"could not archive {item.uri}: {type(exc).__name__}"
        logs.event("gc.not_archived", checkpoint_id=item.checkpoint_id, uri=item.uri, error=error)
        AuditLog(store).record(by, "checkpoint.archive", target, before={"uri": item.uri, "policy": item.policy},
                               outcome="refused", detail=error)
        return None
    with store.transaction() as conn:
        record(conn, item.checkpoint_id, result, by, f"retention:{item.policy}")
    logs.event("gc.archived", checkpoint_id=item.checkpoint_id, uri=item.uri, store=result["store"],
               archive_id=result["archive_id"])
    AuditLog(store).record(by, "checkpoint.archive", target, before={"uri": item.uri, "policy": item.policy},
                           after={key: result[key] for key in ("store", "archive_id", "logical_bytes",
                                                               "stored_bytes", "new_stored_bytes")})
    return int(result["new_stored_bytes"])


def _deletion_view(r: Any) -> DeletionView:
    view = DeletionView(id=r["id"], checkpoint_id=r["checkpoint_id"], uri=r["uri"], bytes=r["bytes"],
                        policy=r["policy"], reason=r["reason"], requested_by=r["requested_by"], state=r["state"],
                        error=r["error"], planned_at=when(r["planned_at"]),
                        done_at=when(r["done_at"]))
    view.model_dump_json()  # text that is not UTF-8 fails here, for this row alone
    return view


def _keeps(spec: PolicySpec) -> str:
    parts = []
    if spec.keep_last is not None:
        parts.append(f"keep_last {spec.keep_last}")
    if spec.keep_every is not None:
        parts.append(f"keep_every {spec.keep_every}")
    if spec.keep_younger_than is not None:
        parts.append(f"keep_younger_than {spec.keep_younger_than:g}s")
    return f"policy {spec.name} (" + ", ".join(parts) + ")"

