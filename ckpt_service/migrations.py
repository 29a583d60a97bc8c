"""Schema versions of the job store, applied in order at start-up; each runs in one transaction.

Written in SQLite's spelling; PostgreSQL gets them through `dialect.postgres_sql` (REAL -> DOUBLE
PRECISION, AUTOINCREMENT -> BIGSERIAL, json_extract -> ->>). Add a version by appending to MIGRATIONS;
never edit one that has shipped. A database whose version is newer than the last entry here belongs to
a newer ckpt-service and is refused (`SchemaTooNew`).
"""

from __future__ import annotations

from typing import Any

from .dialect import SQLITE, Dialect
from .errors import SchemaTooNew

V1_JOBS = [
    """CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL,
        worker TEXT,
        lease_until REAL,
        heartbeat_at REAL,
        pid INTEGER,
        progress TEXT,
        result TEXT,
        error_type TEXT,
        error_message TEXT,
        created_at REAL NOT NULL,
        started_at REAL,
        attempt_started_at REAL,
        finished_at REAL,
        updated_at REAL NOT NULL
    )""",
    "CREATE INDEX jobs_by_state ON jobs (state, seq)",
]

V2_REGISTRY = [
    "ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE jobs ADD COLUMN target TEXT",
    "ALTER TABLE jobs ADD COLUMN callback_url TEXT",
    "ALTER TABLE jobs ADD COLUMN callback_state TEXT",
    "ALTER TABLE jobs ADD COLUMN callback_owner TEXT",
    "ALTER TABLE jobs ADD COLUMN callback_until REAL",
    "ALTER TABLE jobs ADD COLUMN submitted_by TEXT",
    # v1 jobs wrote their target only inside the spec; the busy-target check needs it as a column
    "UPDATE jobs SET target = json_extract(spec, '$.target') WHERE kind IN ('convert', 'export', 'reshard')",
    "CREATE INDEX jobs_by_target ON jobs (target, state)",
    "CREATE INDEX jobs_by_callback ON jobs (callback_state)",
    """CREATE TABLE idempotency (
        principal TEXT NOT NULL,
        key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        job_id TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (principal, key)
    )""",
    """CREATE TABLE workers (
        id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        slots INTEGER NOT NULL,
        started_at REAL NOT NULL,
        seen_at REAL NOT NULL
    )""",
    """CREATE TABLE checkpoints (
        id TEXT PRIMARY KEY,
        uri TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        format TEXT,
        summary TEXT NOT NULL,
        tags TEXT NOT NULL DEFAULT '[]',
        metadata TEXT NOT NULL DEFAULT '{}',
        made_by_job TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    )""",
    "CREATE INDEX checkpoints_by_name ON checkpoints (name)",
    """CREATE TABLE lineage (
        child_id TEXT NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
        parent_id TEXT NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
        job_id TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (child_id, parent_id)
    )""",
    "CREATE INDEX lineage_by_parent ON lineage (parent_id)",
]

MIGRATIONS: list[list[str]] = [V1_JOBS, V2_REGISTRY]
LATEST = len(MIGRATIONS)


def current_version(conn: Any) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    return int(conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)


def too_new(where: str, version: int, dialect: Dialect = SQLITE) -> SchemaTooNew:
    return SchemaTooNew(f"job store {where} has schema version {version}, newer than this ckpt-service "
                        f"understands ({LATEST}): upgrade ckpt-service, {dialect.elsewhere}")


def migrate(conn: Any, where: str, upto: int = LATEST, dialect: Dialect = SQLITE) -> tuple[int, int]:
    """Bring the database to version `upto`; returns (version before, version after).

    `conn` must be in autocommit mode. The version check and every step run in one transaction, under
    BEGIN IMMEDIATE on SQLite and under an advisory lock on PostgreSQL, so processes starting together
    migrate once (the others wait, then find the work done).
    """
    if dialect.migration_lock:
        conn.execute(dialect.migration_lock)
    try:
        conn.execute(dialect.begin)
        try:
            before = current_version(conn)
            if before > LATEST:
                raise too_new(where, before, dialect)
            for version in range(before + 1, upto + 1):
                for statement in MIGRATIONS[version - 1]:
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        if dialect.migration_unlock:
            conn.execute(dialect.migration_unlock)
    return before, max(before, upto)
