"""The job store: SQLite in WAL mode under the data dir, shared by the API, the workers and job processes
of one host; or PostgreSQL (`CKPT_DATABASE_URL`), shared by API replicas and workers on many hosts.

Every state change is one short transaction, written once for both databases (see dialect.py). Claims
run under BEGIN IMMEDIATE on SQLite and `SELECT … FOR UPDATE SKIP LOCKED` on PostgreSQL, so two workers
never take the same job; updates from a job's process are fenced on (job id, attempt) so a late write from
an attempt that was given up on changes nothing.

    queued ──claim──> running ──finish──> succeeded | failed | cancelled
      ^                 │
      └──── requeue ────┘   (worker died or lease expired, attempts left)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import logs, migrations
from .dialect import SQLITE, Dialect, is_url
from .jobs import TERMINAL, JobRecord
from .service_errors import Conflict, InvalidRequest, NotFound, QueueFull, StoreError
from .store_check import as_store_error

BUSY_TIMEOUT_S = 30  # how long a SQLite statement waits for another connection's lock
TERMINAL_SQL = "(" + ", ".join(f"'{state}'" for state in sorted(TERMINAL)) + ")"
_CALLBACK_PENDING = "callback_state = CASE WHEN callback_url IS NOT NULL THEN 'pending' END"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def _text(value: bytes) -> str:
    """SQLite TEXT as str; bytes that are not UTF-8 (a damaged row) become lone surrogates, which the row's
    reader refuses for that row alone, instead of failing the whole query."""
    return value.decode("utf-8", "surrogateescape")


class SqliteConnections:
    """One SQLite connection per thread, in autocommit mode (the store sends BEGIN IMMEDIATE/COMMIT)."""

    dialect = SQLITE
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)

    def __init__(self, path: str) -> None:
        self.path = self.name = path
        self._local = threading.local()

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"job store {self.path}: cannot open ({exc})") from None
        conn.row_factory = sqlite3.Row
        conn.text_factory = _text
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            conn.close()
            raise as_store_error(self.path, exc) from None
        return conn

    @contextmanager
    def connection(self, first: str | None = None) -> Iterator[sqlite3.Connection]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        if first:
            try:
                conn.execute(first)
            except sqlite3.Error as exc:
                raise as_store_error(self.path, exc) from None
        yield conn

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def error(self, exc: BaseException) -> StoreError:
        assert isinstance(exc, sqlite3.Error)
        return as_store_error(self.path, exc)

    def prepare(self, conn: sqlite3.Connection) -> None:
        """Switch a new database to WAL. SQLite answers "database is locked" at once, without its busy
        handler, when several processes open a new database together (one is making the WAL while another
        looks): retry for as long as the busy timeout would have waited."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def views(rows: list[Any], render: Any) -> tuple[list[Any], list[str]]:
    """Render each row on its own: (what rendered, ids of the rows that could not be read). One damaged row
    never breaks a listing for the others."""
    done, unreadable = [], []
    for row in rows:
        try:
            done.append(render(row))
        except (ValueError, TypeError, KeyError, OverflowError):  # bad JSON, bad text, out-of-range numbers
            name = text(str(row["id"]))
            unreadable.append(name)
            logs.event("store.unreadable_row", id=name, level=logging.WARNING)
    return done, unreadable


def dumps(value: Any, field: str) -> str:
    """JSON for the store; refuses (InvalidRequest) text that is not valid UTF-8 (lone surrogates) so that
    nothing a listing could not render is ever committed."""
    text = json.dumps(value)
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field}: holds text that is not valid UTF-8 (a lone surrogate such as \\ud800); "
                             "fix the name or value", field) from None
    return text


def text(value: str) -> str:
    """`value` with anything that is not valid UTF-8 text (lone surrogates) escaped, for messages."""
    return value.encode("utf-8", "backslashreplace").decode()


def like_prefix(text: str) -> str:
    """`text` as a LIKE pattern that matches itself literally ('!' escapes %, _ and itself: ESCAPE '!')."""
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_")


def under(column: str, prefixes: list[str]) -> tuple[str, list[Any]]:
    """SQL (with its parameters) true when `column` holds one of the normalised root URIs `prefixes` or a URI
    below one (whole segments: root `/d/a` holds `/d/a/x`, not `/d/ab`); false for NULL, and for every row
    when `prefixes` is empty. LIKE narrows the candidates (a text_pattern_ops index could serve it on
    PostgreSQL); the substr comparison makes the match exact, as SQLite's LIKE ignores ASCII case."""
    if not prefixes:
        return "1 = 0", []
    terms, params = [], list[Any]()
    for prefix in prefixes:
        base = prefix if prefix.endswith("/") else prefix + "/"
        terms.append(f"{column} = ? OR ({column} LIKE ? ESCAPE '!' AND substr({column}, 1, ?) = ?)")
        params.extend([prefix, like_prefix(base) + "%", len(base), base])
    return "(" + " OR ".join(f"({term})" for term in terms) + ")", params


def _checked(job: JobRecord) -> JobRecord:
    job.view().model_dump_json()  # text that is not UTF-8 fails here, for this row alone
    return job


def connections(location: str) -> Any:
    """SQLite for a file path; PostgreSQL for a postgresql:// URL."""
    if is_url(location):
        from .pg import PostgresConnections

        return PostgresConnections(location)
    return SqliteConnections(location)


class JobStore:
    """Thread-safe. Open it with `JobStore(path or postgresql:// URL)`; it migrates on open."""

    def __init__(self, location: str | os.PathLike[str], migrate: bool = True) -> None:
        self.path = str(location)
        self.db = connections(self.path)
        self.dialect: Dialect = self.db.dialect
        self.name: str = self.db.name  # for messages: a URL without its password
        if self.dialect.autocommit_writes:  # close the pool with the store, not later in a pool thread's GC
            weakref.finalize(self, self.db.close)
        if migrate:
            self.migrate()

    # -- connections and transactions --------------------------------------------------------------

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """BEGIN (IMMEDIATE on SQLite) … COMMIT; rolled back on any error. Database errors become StoreError."""
        errors = self.db.errors
        with self.db.connection(self.dialect.begin) as conn:
            try:
                yield conn
            except errors as exc:
                with contextlib.suppress(*errors):
                    conn.execute("ROLLBACK")
                raise self.db.error(exc) from None
            except BaseException:
                with contextlib.suppress(*errors):
                    conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except errors as exc:
                with contextlib.suppress(*errors):
                    conn.execute("ROLLBACK")
                raise self.db.error(exc) from None

    def serialize(self, conn: Any) -> None:
        """Inside a transaction: wait for other submissions and registry writes (SQLite's BEGIN IMMEDIATE
        already orders every write; PostgreSQL takes a transaction-scoped advisory lock)."""
        if self.dialect.serialize:
            conn.execute(self.dialect.serialize)

    def write(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[list[Any], int]:
        """One statement as a transaction of its own: (rows it returned, rows it changed). On PostgreSQL it is
        sent alone in autocommit mode (one round trip instead of three)."""
        if self.dialect.autocommit_writes:
            try:
                return self.db.write(sql, params)
            except self.db.errors as exc:
                raise self.db.error(exc) from None
        with self.transaction() as conn:
            cur = conn.execute(sql, params)
            return (cur.fetchall() if cur.description else []), cur.rowcount

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        try:
            return self.db.read(sql, params)
        except self.db.errors as exc:
            raise self.db.error(exc) from None

    def migrate(self) -> tuple[int, int]:
        with self.db.connection() as conn:
            try:
                self.db.prepare(conn)
                return migrations.migrate(conn, self.name, dialect=self.dialect)
            except self.db.errors as exc:
                raise self.db.error(exc) from None

    def ping(self) -> None:
        self.query("SELECT 1")

    # -- jobs: submit, read, cancel ----------------------------------------------------------------

    def create_job(self, *, kind: str, spec: dict[str, Any], target: str | None, callback_url: str | None,
                   submitted_by: str, max_attempts: int, queue_limit: int,
                   idempotency: tuple[str, str] | None = None) -> tuple[JobRecord, bool]:
        """Queue a job; returns (job, created). With an idempotency (key, request hash) seen before, the
        earlier job comes back (created False); the same key with another request is a Conflict."""
        now, spec_text = time.time(), dumps(spec, "spec")
        with self.transaction() as conn:
            self.serialize(conn)  # one submission at a time: idempotency, queue depth and busy targets hold
            if idempotency:
                row = conn.execute("SELECT request_hash, job_id FROM idempotency WHERE principal = ? AND key = ?",
                                   (submitted_by, idempotency[0])).fetchone()
                if row is not None:
                    if row["request_hash"] != idempotency[1]:
                        raise Conflict("Idempotency-Key was already used for a different request; use a new key")
                    return self._get(conn, row["job_id"]), False
            depth = conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE state = 'queued'").fetchone()["n"]
            if depth >= queue_limit:
                raise QueueFull(f"the queue is full ({depth} jobs waiting); retry later")
            if target is not None:
                busy = conn.execute("SELECT id FROM jobs WHERE target = ? AND state IN ('queued', 'running')",
                                    (target,)).fetchone()
                if busy is not None:
                    raise Conflict(f"target {target} is being written by job {busy['id']}; wait for it or cancel it")
            job_id = new_id("job")
            conn.execute(
                "INSERT INTO jobs (id, kind, state, spec, max_attempts, target, callback_url, submitted_by, "
                "created_at, updated_at) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
                (job_id, kind, spec_text, max_attempts, target, callback_url, submitted_by, now, now))
            if idempotency:
                conn.execute("INSERT INTO idempotency (principal, key, request_hash, job_id, created_at) "
                             "VALUES (?, ?, ?, ?, ?)", (submitted_by, idempotency[0], idempotency[1], job_id, now))
            return self._get(conn, job_id), True

    def _get(self, conn: Any, job_id: str, lock: bool = False) -> JobRecord:
        """Inside a transaction; `lock`: the transaction then changes the job (its row is locked till the end)."""
        row = conn.execute(f"SELECT * FROM jobs WHERE id = ?{self.dialect.for_update if lock else ''}",
                           (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id}")
        return JobRecord.from_row(row)

    def get(self, job_id: str) -> JobRecord:
        rows = self.query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise NotFound(f"no job {job_id}")
        return JobRecord.from_row(rows[0])

    def list_jobs(self, state: str | None = None, kind: str | None = None, limit: int = 50,
                  before: int | None = None, within: list[str] | None = None
                  ) -> tuple[list[JobRecord], int | None, list[str]]:
        """Newest first; returns (jobs, seq to pass as `before` for the next page or None, ids of jobs on this
        page whose stored rows cannot be read). `within`: only jobs whose source, and target and options'
        read paths when they have them, lie under these root URIs (a caller's readable roots; None: all), so
        pages are full."""
        where, params = ["1 = 1"], list[Any]()
        for column, value in (("state", state), ("kind", kind)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if within is not None:  # as api.security.job_uris: the source, the target and the paths options read
            for n, field in enumerate(("source", "target", "options.config_from", "options.base")):
                column = f"json_extract(spec, '$.{field}')"
                clause, clause_params = under(column, within)
                where.append(clause if n == 0 else f"({column} IS NULL OR {clause})")
                params.extend(clause_params)
        if before is not None:
            where.append("seq < ?")
            params.append(before)
        rows = self.query(f"SELECT * FROM jobs WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?",
                          (*params, limit + 1))
        next_before = rows[limit - 1]["seq"] if len(rows) > limit else None
        jobs, unreadable = views(rows[:limit], lambda row: _checked(JobRecord.from_row(row)))
        return jobs, next_before, unreadable

    def request_cancel(self, job_id: str) -> JobRecord:
        """A queued job is cancelled at once; a running one is flagged (its worker stops it)."""
        now = time.time()
        with self.transaction() as conn:
            job = self._get(conn, job_id, lock=True)
            if job.state == "queued":
                conn.execute(f"UPDATE jobs SET state = 'cancelled', cancel_requested = 1, finished_at = ?, "
                             f"updated_at = ?, {_CALLBACK_PENDING} WHERE id = ?", (now, now, job_id))
            elif job.state == "running":
                conn.execute("UPDATE jobs SET cancel_requested = 1, updated_at = ? WHERE id = ?", (now, job_id))
            elif job.state != "cancelled":
                raise Conflict(f"job {job_id} already {job.state}; nothing to cancel")
            return self._get(conn, job_id)

    # -- jobs: the worker side ---------------------------------------------------------------------

    def claim(self, worker: str, lease_seconds: float) -> JobRecord | None:
        """Take the oldest queued job for `worker` (attempt + 1), or None."""
        now = time.time()
        # one statement: pick the oldest queued job (rows other claimers hold are skipped) and take it
        rows, _ = self.write(
                "UPDATE jobs SET state = 'running', attempt = attempt + 1, worker = ?, lease_until = ?, "
                "heartbeat_at = ?, attempt_started_at = ?, started_at = COALESCE(started_at, ?), pid = NULL, "
                "progress = NULL, updated_at = ? WHERE state = 'queued' AND id = (SELECT id FROM jobs WHERE "
                f"state = 'queued' ORDER BY seq LIMIT 1{self.dialect.skip_locked}) RETURNING *",
                (worker, now + lease_seconds, now, now, now, now))
        return JobRecord.from_row(rows[0]) if rows else None

    def heartbeat(self, job_id: str, worker: str, attempt: int, lease_seconds: float) -> tuple[bool, bool]:
        """Extend the lease; returns (still ours, cancel requested)."""
        now = time.time()
        rows, _ = self.write("UPDATE jobs SET lease_until = ?, heartbeat_at = ? WHERE id = ? AND worker = ? "
                             "AND attempt = ? AND state = 'running' RETURNING cancel_requested",
                             (now + lease_seconds, now, job_id, worker, attempt))
        return bool(rows), bool(rows and rows[0]["cancel_requested"])

    def take_over(self, job_id: str, attempt: int, old_worker: str, new_worker: str, lease_seconds: float) -> bool:
        """Claim a dead worker's running job for cleaning it up; only one reaper wins."""
        now = time.time()
        _, changed = self.write("UPDATE jobs SET worker = ?, lease_until = ?, heartbeat_at = ? WHERE id = ? "
                                "AND attempt = ? AND worker = ? AND state = 'running'",
                                (new_worker, now + lease_seconds, now, job_id, attempt, old_worker))
        return changed == 1

    def set_pid(self, job_id: str, attempt: int, pid: int) -> None:
        self.write("UPDATE jobs SET pid = ? WHERE id = ? AND attempt = ? AND state = 'running'",
                   (pid, job_id, attempt))

    def set_progress(self, job_id: str, attempt: int, progress: dict[str, Any]) -> None:
        self.write("UPDATE jobs SET progress = ?, updated_at = ? WHERE id = ? AND attempt = ? AND state = 'running'",
                   (json.dumps(progress), time.time(), job_id, attempt))

    @staticmethod
    def _finish_statement(job_id: str, attempt: int, state: str, result: dict[str, Any] | None,
                          error: tuple[str, str] | None) -> tuple[str, tuple[Any, ...]]:
        if state not in TERMINAL:
            raise ValueError(f"finish: {state!r} is not a final state ({', '.join(sorted(TERMINAL))})")
        now = time.time()
        error_type, message = error or (None, None)
        try:
            result_text = dumps(result, "result") if result is not None else None
        except InvalidRequest as exc:  # never stored: a listing could not render it
            state, result_text, error_type, message = "failed", None, "FormatError", str(exc)
        return (f"UPDATE jobs SET state = ?, result = ?, error_type = ?, error_message = ?, finished_at = ?, "
                f"updated_at = ?, lease_until = NULL, {_CALLBACK_PENDING} WHERE id = ? AND attempt = ? "
                "AND state = 'running'",
                (state, result_text, error_type, None if message is None else text(message), now, now, job_id,
                 attempt))

    def finish(self, conn: Any, job_id: str, attempt: int, state: str,
               result: dict[str, Any] | None = None, error: tuple[str, str] | None = None) -> bool:
        """Inside a transaction: end attempt `attempt` of a running job. False if it is no longer ours."""
        return conn.execute(*self._finish_statement(job_id, attempt, state, result, error)).rowcount == 1

    def finish_now(self, job_id: str, attempt: int, state: str, result: dict[str, Any] | None = None,
                   error: tuple[str, str] | None = None) -> bool:
        return self.write(*self._finish_statement(job_id, attempt, state, result, error))[1] == 1

    def requeue_or_fail(self, job_id: str, attempt: int, reason: str) -> str | None:
        """After a job process died: cancelled if that was asked for, queued again while attempts are left,
        failed with `reason` after that. Returns the new state, or None if the attempt was not current."""
        now = time.time()
        with self.transaction() as conn:
            job = self._get(conn, job_id, lock=True)
            if job.state != "running" or job.attempt != attempt:
                return None
            if job.cancel_requested:
                self.finish(conn, job_id, attempt, "cancelled")
                return "cancelled"
            if job.attempt < job.max_attempts:
                conn.execute("UPDATE jobs SET state = 'queued', worker = NULL, lease_until = NULL, pid = NULL, "
                             "error_type = 'WorkerLost', error_message = ?, updated_at = ? WHERE id = ?",
                             (reason, now, job_id))
                return "queued"
            self.finish(conn, job_id, attempt, "failed",
                        error=("WorkerLost", f"{reason} (attempt {attempt} of {job.max_attempts}); giving up"))
            return "failed"

    def release(self, job_id: str, attempt: int) -> bool:
        """Graceful shutdown: put a running job back in the queue without using up an attempt."""
        _, changed = self.write("UPDATE jobs SET state = 'queued', attempt = attempt - 1, worker = NULL, "
                                "lease_until = NULL, pid = NULL, updated_at = ? WHERE id = ? AND attempt = ? "
                                "AND state = 'running' AND cancel_requested = 0", (time.time(), job_id, attempt))
        return changed == 1

    def running(self) -> list[JobRecord]:
        return [JobRecord.from_row(r) for r in self.query("SELECT * FROM jobs WHERE state = 'running'")]

    # -- callbacks ---------------------------------------------------------------------------------

    def claim_callbacks(self, owner: str, hold_seconds: float, limit: int = 8) -> list[JobRecord]:
        """Take finished jobs whose callback is due (or whose sender died) for `owner` to deliver."""
        now = time.time()
        with self.transaction() as conn:
            rows = conn.execute("SELECT id FROM jobs WHERE callback_state = 'pending' OR (callback_state = "
                                f"'sending' AND callback_until < ?) LIMIT ?{self.dialect.skip_locked}",
                                (now, limit)).fetchall()
            ids = [r["id"] for r in rows]
            for job_id in ids:
                conn.execute("UPDATE jobs SET callback_state = 'sending', callback_owner = ?, callback_until = ? "
                             "WHERE id = ?", (owner, now + hold_seconds, job_id))
            return [self._get(conn, job_id) for job_id in ids]

    def callback_done(self, job_id: str, delivered: bool) -> None:
        self.write("UPDATE jobs SET callback_state = ? WHERE id = ?", ("sent" if delivered else "failed", job_id))

    # -- workers and metrics -----------------------------------------------------------------------

    def register_worker(self, worker: str, host: str, pid: int, slots: int) -> None:
        now = time.time()
        self.write("INSERT INTO workers (id, host, pid, slots, started_at, seen_at) VALUES (?, ?, ?, ?, ?, ?) "
                   "ON CONFLICT (id) DO UPDATE SET host = excluded.host, pid = excluded.pid, "
                   "slots = excluded.slots, started_at = excluded.started_at, seen_at = excluded.seen_at",
                   (worker, host, pid, slots, now, now))

    def touch_worker(self, worker: str) -> None:
        self.write("UPDATE workers SET seen_at = ? WHERE id = ?", (time.time(), worker))

    def remove_worker(self, worker: str) -> None:
        self.write("DELETE FROM workers WHERE id = ?", (worker,))

    def live_workers(self, within_seconds: float) -> list[Any]:
        return self.query("SELECT * FROM workers WHERE seen_at >= ?", (time.time() - within_seconds,))

    def count_by_state(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in self.query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")}

    def finished_stats(self) -> list[Any]:
        """(kind, state, seconds, bytes) of every finished job that ran, for the metrics histograms."""
        return self.query(
            f"SELECT kind, state, finished_at - started_at AS seconds, "
            f"COALESCE(CAST(json_extract(progress, '$.total_bytes') AS BIGINT), 0) AS bytes FROM jobs "
            f"WHERE state IN {TERMINAL_SQL} AND started_at IS NOT NULL")
