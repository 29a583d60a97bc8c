"""PostgreSQL connections of the job store (psycopg 3 with psycopg_pool; the `postgres` extra).

Connections are autocommit; `JobStore.transaction` sends BEGIN/COMMIT itself, as it does on SQLite.
Rows answer by name and by position, like `sqlite3.Row`. Taking a connection from the pool is retried
with backoff while the database is unreachable, and every retry is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import logs
from .dialect import POSTGRESQL, postgres_sql, redact
from .service_errors import StoreError

CONNECT_TIMEOUT = 5.0
RETRIES = 5
FIRST_DELAY, MAX_DELAY = 0.2, 3.0
POOL_SIZE = 16


def _psycopg() -> Any:
    try:
        import psycopg
        import psycopg_pool
    except ImportError:
        raise StoreError("CKPT_DATABASE_URL names PostgreSQL, but psycopg is not installed: "
                         "pip install 'ckpt-service[postgres]'") from None
    return psycopg, psycopg_pool


class Row(dict[str, Any]):
    """A row by column name (`row["id"]`) and by position (`row[0]`)."""

    __slots__ = ("cells",)  # not `values`, which would hide dict.values()
    cells: Sequence[Any]

    def __getitem__(self, key: Any) -> Any:
        return self.cells[key] if isinstance(key, int) else dict.__getitem__(self, key)


def row_factory(cursor: Any) -> Any:
    names = [column.name for column in cursor.description or ()]

    def make(values: Sequence[Any]) -> Row:
        row = Row(zip(names, values))
        row.cells = values
        return row
    return make


class Connection:
    """One pooled connection; `execute` takes the store's SQLite-spelled SQL."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.raw.execute(postgres_sql(sql), tuple(params))

    def close(self) -> None:
        self.raw.close()


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


class PostgresConnections:
    dialect = POSTGRESQL

    def __init__(self, url: str) -> None:
        psycopg, psycopg_pool = _psycopg()
        self.url, self.name = url, redact(url)
        self.errors: tuple[type[BaseException], ...] = (psycopg.Error,)
        self._lost = (psycopg.OperationalError, psycopg_pool.PoolTimeout)
        self.pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=POOL_SIZE, timeout=CONNECT_TIMEOUT, name="ckpt-store", open=True,
            kwargs={"autocommit": True, "row_factory": row_factory, "connect_timeout": int(CONNECT_TIMEOUT)})

    def error(self, exc: BaseException) -> StoreError:
        return StoreError(f"job store {self.name}: {short(exc)}")

    def _take(self, first: str, params: Sequence[Any] = ()) -> tuple[Any, Any]:
        """A pooled connection and the cursor of `first` (BEGIN, or a read) run on it. A connection the server
        dropped (restart, failover, idle timeout) is discarded and another one taken, with backoff."""
        delay = FIRST_DELAY
        for attempt in range(1, RETRIES + 1):
            raw = None
            try:
                raw = self.pool.getconn()
                return raw, raw.execute(postgres_sql(first), tuple(params))
            except self._lost as exc:
                if raw is not None:
                    self.pool.putconn(raw)  # a broken one is closed by the pool, which opens a new one
                    if not raw.broken:
                        raise  # the server answered with an error: nothing to retry
                if attempt == RETRIES:
                    raise StoreError(f"job store {self.name}: cannot connect after {RETRIES} tries "
                                     f"({short(exc)}); is the database up?") from None
                logs.event("store.reconnect", level=logging.WARNING, store=self.name, attempt=attempt,
                           retry_in=delay, error=short(exc))
                time.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
            except BaseException:
                if raw is not None:
                    self.pool.putconn(raw)
                raise
        raise AssertionError("unreachable")

    @contextmanager
    def connection(self, first: str = "SELECT 1") -> Iterator[Connection]:
        raw, _ = self._take(first)
        try:
            yield Connection(raw)
        finally:
            self.pool.putconn(raw)

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raw, cursor = self._take(sql, params)
        try:
            return cursor.fetchall()
        finally:
            self.pool.putconn(raw)

    def write(self, sql: str, params: Sequence[Any] = ()) -> tuple[list[Any], int]:
        raw, cursor = self._take(sql, params)
        try:
            return (cursor.fetchall() if cursor.description else []), cursor.rowcount
        finally:
            self.pool.putconn(raw)

    def prepare(self, conn: Connection) -> None:
        pass

    def close(self) -> None:
        self.pool.close()


def check(url: str) -> tuple[int, int, set[str]]:
    """(schema version, jobs, tables) of the database at `url`: `SELECT 1`, then the schema; StoreError if down."""
    psycopg, _ = _psycopg()
    name = redact(url)
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT)) as conn:
            conn.execute("SELECT 1")
            tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = "
                                                 "current_schema()")}
            if "schema_version" not in tables:
                return 0, 0, tables
            version = int(conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)
            jobs = int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]) if "jobs" in tables else 0
            return version, jobs, tables
    except psycopg.Error as exc:
        raise StoreError(f"job store {name}: {short(exc)}") from None
