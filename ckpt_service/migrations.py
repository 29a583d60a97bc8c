"""Schema versions of the job store, applied in order at start-up; each runs in one transaction.

Written in SQLite's spelling; PostgreSQL gets them through `dialect.postgres_sql` (REAL -> DOUBLE
PRECISION, AUTOINCREMENT -> BIGSERIAL, json_extract -> ->>). Add a version by appending to MIGRATIONS;
never edit one that has shipped. A database whose version is newer than the last entry here belongs to
a newer ckpt-service and is refused (`SchemaTooNew`).
"""

from __future__ import annotations

from typing import Any

from .dialect import SQLITE, Dialect
from .service_errors import SchemaTooNew

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

#: checkpoint management (catalog.py, retention.py, rules.py): runs and steps, aliases with history, retention
#: policies and the deletion log, rules and the (rule, checkpoint) triggers that make each rule fire once.
#: Steps and byte counts are BIGINT (past 2**31 on PostgreSQL); timestamps are epoch seconds like v1/v2's.
V3_MANAGE = [
    """CREATE TABLE checkpoint_runs (
        checkpoint_id TEXT PRIMARY KEY REFERENCES checkpoints (id) ON DELETE CASCADE,
        run TEXT,
        step BIGINT,
        rule_id TEXT,
        deleted_at REAL
    )""",
    "CREATE INDEX checkpoint_runs_by_run ON checkpoint_runs (run, step)",
    """CREATE TABLE aliases (
        namespace TEXT NOT NULL,
        name TEXT NOT NULL,
        checkpoint_id TEXT NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
        updated_by TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (namespace, name)
    )""",
    "CREATE INDEX aliases_by_checkpoint ON aliases (checkpoint_id)",
    """CREATE TABLE alias_history (
        id TEXT PRIMARY KEY,
        namespace TEXT NOT NULL,
        name TEXT NOT NULL,
        checkpoint_id TEXT,
        previous_id TEXT,
        changed_by TEXT NOT NULL,
        changed_at REAL NOT NULL
    )""",
    "CREATE INDEX alias_history_by_name ON alias_history (namespace, name, changed_at)",
    """CREATE TABLE retention_policies (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        spec TEXT NOT NULL,
        created_by TEXT NOT NULL,
        created_at REAL NOT NULL
    )""",
    """CREATE TABLE deletions (
        id TEXT PRIMARY KEY,
        checkpoint_id TEXT NOT NULL,
        uri TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        policy TEXT NOT NULL,
        reason TEXT NOT NULL,
        requested_by TEXT NOT NULL,
        state TEXT NOT NULL,
        error TEXT,
        planned_at REAL NOT NULL,
        done_at REAL
    )""",
    "CREATE INDEX deletions_by_state ON deletions (state, planned_at)",
    """CREATE TABLE rules (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        spec TEXT NOT NULL,
        paused INTEGER NOT NULL DEFAULT 0,
        created_by TEXT NOT NULL,
        created_at REAL NOT NULL
    )""",
    """CREATE TABLE rule_triggers (
        rule_id TEXT NOT NULL REFERENCES rules (id) ON DELETE CASCADE,
        uri TEXT NOT NULL,
        checkpoint_id TEXT,
        state TEXT NOT NULL,
        job_id TEXT,
        detail TEXT,
        claimed_at REAL NOT NULL,
        PRIMARY KEY (rule_id, uri)
    )""",
    "CREATE INDEX rule_triggers_by_job ON rule_triggers (job_id)",
]

#: owners and deletion identities. Each managed object records the principal that owns it: a registered checkpoint
#: (`owner`), each of its tags (`tag_owners`: tag key -> owner) and an alias (`owner`); rules and policies have
#: `created_by` already. Rows from before this version have no owner and may be changed by admins only.
#: A deletion records the (st_dev:st_ino) of the local path it plans to remove, checked again before removal.
V4_OWNERS = [
    "ALTER TABLE checkpoints ADD COLUMN owner TEXT",
    "ALTER TABLE checkpoints ADD COLUMN tag_owners TEXT NOT NULL DEFAULT '{}'",
    "ALTER TABLE aliases ADD COLUMN owner TEXT",
    "ALTER TABLE deletions ADD COLUMN identity TEXT",
]

#: how each checkpoint came to be registered (`registered_via`, JSON: {"how": "registered" | "output" | "source" |
#: "discovered" | "notified", "job": …, "by": …}); rows from before this version have none.
V5_ORIGIN = [
    "ALTER TABLE checkpoints ADD COLUMN registered_via TEXT",
]

#: the audit log (audit.py): one row per change or refused attempt, appended and never updated or deleted by the
#: service. `before`/`after`: the object's JSON around the change (NULL where there was none); `outcome`: done or
#: refused; `detail`: the refusal's one line, or what else the change needs said.
V6_AUDIT = [
    """CREATE TABLE audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        principal TEXT NOT NULL,
        action TEXT NOT NULL,
        object TEXT NOT NULL,
        outcome TEXT NOT NULL,
        before TEXT,
        after TEXT,
        detail TEXT
    )""",
    "CREATE INDEX audit_by_principal ON audit (principal, seq)",
    "CREATE INDEX audit_by_action ON audit (action, seq)",
    "CREATE INDEX audit_by_object ON audit (object, seq)",
    "CREATE INDEX audit_by_time ON audit (at)",
]

#: archived checkpoints (archived.py): each archive of a registered checkpoint in an archive store (converters.archive),
#: with its bytes as stored (its distinct chunks, compressed) against its logical bytes; `origin`: job or retention.
V7_ARCHIVES = [
    """CREATE TABLE checkpoint_archives (
        checkpoint_id TEXT NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
        store TEXT NOT NULL,
        archive_id TEXT NOT NULL,
        logical_bytes BIGINT NOT NULL,
        stored_bytes BIGINT NOT NULL,
        new_stored_bytes BIGINT NOT NULL,
        archived_by TEXT NOT NULL,
        origin TEXT NOT NULL,
        archived_at REAL NOT NULL,
        PRIMARY KEY (checkpoint_id, store)
    )""",
    "CREATE INDEX checkpoint_archives_by_id ON checkpoint_archives (store, archive_id)",
]

#: checksums recorded for a registered checkpoint that carries none (baselines.py): the first scrub of a checkpoint
#: without a manifest records each file's size, mtime, CRC-32 and block CRC-32s (`baseline`, JSON); later scrubs
#: compare with it. Kept here, never in the checkpoint's folder.
V8_BASELINES = [
    """CREATE TABLE checkpoint_baselines (
        checkpoint_id TEXT PRIMARY KEY REFERENCES checkpoints (id) ON DELETE CASCADE,
        recorded_at REAL NOT NULL,
        job_id TEXT,
        files INTEGER NOT NULL,
        bytes BIGINT NOT NULL,
        baseline TEXT NOT NULL
    )""",
]

MIGRATIONS: list[list[str]] = [V1_JOBS, V2_REGISTRY, V3_MANAGE, V4_OWNERS, V5_ORIGIN, V6_AUDIT, V7_ARCHIVES,
                               V8_BASELINES]
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
