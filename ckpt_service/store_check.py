"""Check, back up and restore the job store (`ckptctl store check|backup|restore`, start-up, /readyz).

`check` opens the file read-only and runs `PRAGMA quick_check` and the schema-version checks; a damaged
store is one `StoreDamaged` line naming the file and the fix. `backup` copies a sound store with
SQLite's online backup API (consistent while the service runs) into a temporary file that is checked,
then renamed into place. `restore` puts a checked backup in place of the store, keeping the old files.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from . import migrations
from .dialect import is_url
from .service_errors import StoreDamaged, StoreError

#: SQLite's primary result codes for a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB
DAMAGE_CODES = (11, 26)
FIX = ("stop the service, then restore a backup with `ckptctl store restore BACKUP` (backups come from "
       "`ckptctl store backup DEST`), or move the file aside to start with an empty store")
_SIDE_FILES = ("-wal", "-shm")


def damaged(path: str | os.PathLike[str], detail: str) -> StoreDamaged:
    detail = " ".join(detail.split())[:200]
    return StoreDamaged(f"job store {path} is damaged ({detail}): {FIX}")


def is_damage(exc: sqlite3.Error) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF in DAMAGE_CODES


def as_store_error(path: str | os.PathLike[str], exc: sqlite3.Error) -> StoreError:
    """The service error for a sqlite error on the store: StoreDamaged (with the fix) for a damaged file."""
    if is_damage(exc):
        return damaged(path, str(exc))
    return StoreError(f"job store {path}: {exc}")


@dataclass(frozen=True)
class Report:
    path: str
    version: int
    jobs: int

    def line(self) -> str:
        return f"job store {self.path}: ok (schema version {self.version}, {self.jobs} jobs)"


def _tables_at(version: int) -> set[str]:
    made = " ".join(" ".join(step) for step in migrations.MIGRATIONS[:version])
    return set(re.findall(r"CREATE TABLE (\w+)", made)) | {"schema_version"}


def check_database(url: str) -> Report:
    """A PostgreSQL store: reachable (`SELECT 1`), its schema version known and its tables there."""
    from .dialect import POSTGRESQL, redact
    from .pg import check as pg_check

    name = redact(url)
    version, jobs, tables = pg_check(url)
    if version > migrations.LATEST:
        raise migrations.too_new(name, version, POSTGRESQL)
    missing = sorted(_tables_at(version) - tables) if version else []
    if missing:
        raise StoreDamaged(f"job store {name} is damaged (schema version {version} but no {', '.join(missing)} "
                           "table): restore the database from a backup (pg_dump), or use an empty database")
    return Report(name, version, jobs)


def check(path: str | os.PathLike[str]) -> Report:
    """The store at `path` is sound (integrity, schema version, tables), or StoreDamaged / SchemaTooNew.
    A postgresql:// URL is checked with `check_database`."""
    if is_url(path):
        return check_database(str(path))
    if not os.path.isfile(path):
        raise StoreError(f"job store {path}: no such file (the service makes one on its first start)")
    if os.path.getsize(path) == 0:
        return Report(str(path), 0, 0)  # created, never written: the service sets it up at start-up
    try:
        conn = sqlite3.connect(f"file:{quote(os.fspath(path))}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        raise as_store_error(path, exc) from None
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)").fetchall()]
        if problems != ["ok"]:
            raise damaged(path, "; ".join(problems))
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return Report(str(path), 0, 0)
        if "schema_version" not in tables:
            raise damaged(path, "it has no schema_version table")
        version = int(conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)
        if version > migrations.LATEST:
            raise migrations.too_new(str(path), version)
        missing = sorted(_tables_at(version) - tables)
        if missing:
            raise damaged(path, f"schema version {version} but no {', '.join(missing)} table")
        jobs = int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]) if version else 0
        return Report(str(path), version, jobs)
    except sqlite3.Error as exc:
        raise damaged(path, str(exc)) if is_damage(exc) else StoreError(f"job store {path}: {exc}") from None
    finally:
        conn.close()


def _copy(source: str | os.PathLike[str], dest: Path) -> Report:
    """Online backup of `source` into `dest` (via a checked temporary file beside it); returns its report."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        src = sqlite3.connect(f"file:{quote(os.fspath(source))}?mode=ro", uri=True, timeout=30)
        try:
            out = sqlite3.connect(tmp)
            try:
                src.backup(out)
                out.execute("PRAGMA journal_mode = DELETE")  # one self-contained file, no -wal beside it
            finally:
                out.close()
        finally:
            src.close()
        report = check(tmp)
        os.replace(tmp, dest)
        return Report(str(dest), report.version, report.jobs)
    except sqlite3.Error as exc:
        raise as_store_error(source, exc) from None
    finally:
        for name in (tmp, *(Path(f"{tmp}{s}") for s in _SIDE_FILES)):
            if name.exists():
                name.unlink()


def backup(store: str | os.PathLike[str], dest: Path, overwrite: bool = False) -> Report:
    """Copy a sound store to `dest` (a file), consistent even while the service writes to it."""
    check(store)
    if dest.is_dir():
        raise StoreError(f"backup {dest}: is a folder; give a file name, e.g. {dest / 'ckpt-backup.db'}")
    if dest.exists() and not overwrite:
        raise StoreError(f"backup {dest}: exists; pass --overwrite to replace it, or choose another name")
    if not dest.parent.is_dir():
        raise StoreError(f"backup {dest}: folder {dest.parent} does not exist")
    return _copy(store, dest)


def restore(backup_file: Path, store: str | os.PathLike[str]) -> tuple[Report, Path | None]:
    """Put a checked backup in place of `store`; the old files move aside. Returns (report, where they went)."""
    check(backup_file)
    store = Path(store)
    aside = None
    if store.exists():
        aside = store.with_name(f"{store.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", *_SIDE_FILES):
            old = Path(f"{store}{suffix}")
            if old.exists():
                os.replace(old, f"{aside}{suffix}")
    return _copy(backup_file, store), aside


class StoreHealth:
    """The outcome of `check` for /readyz, re-run at most every `every` seconds (None: sound)."""

    def __init__(self, path: str | os.PathLike[str], every: float) -> None:
        self.path, self.every = path, every
        self._lock = threading.Lock()
        self._at = -1e18
        self._problem: StoreError | None = None

    def problem(self) -> StoreError | None:
        with self._lock:
            if time.monotonic() - self._at >= self.every:
                try:
                    check(self.path)
                    self._problem = None
                except StoreError as exc:
                    self._problem = exc
                self._at = time.monotonic()
            return self._problem
