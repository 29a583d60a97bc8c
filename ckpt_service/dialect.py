"""The two databases the job store runs on: SQLite under the data dir (the embedded default) and
PostgreSQL (`CKPT_DATABASE_URL`), shared by API replicas and worker hosts.

Every query is written once, in SQLite's spelling with `?` placeholders. `Dialect` names the few
statements that differ in meaning (how a write transaction starts, the row locks of a claim, the lock
that serialises migrations and submissions), and `Dialect.sql` rewrites the spelling for PostgreSQL:
placeholders, JSON access and column types in the schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit, urlunsplit

URL_SCHEMES = ("postgresql://", "postgres://")
#: pg_advisory_lock keys: one for migrations, one that orders submissions and registry writes
MIGRATION_LOCK = 0x636B7074_0001
SERIAL_LOCK = 0x636B7074_0002

_JSON_EXTRACT = re.compile(r"json_extract\(([\w.]+), '\$\.(\w+(?:\.\w+)*)'\)")
_JSON_EACH = re.compile(r"json_each\(([\w.]+)\)")
_SERIAL_KEY = re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b")
_REAL = re.compile(r"\bREAL\b")


def is_url(location: str | Any) -> bool:
    return isinstance(location, str) and location.startswith(URL_SCHEMES)


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:****@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _json_path(found: re.Match[str]) -> str:
    """`json_extract(c, '$.a.b')` -> `(c::jsonb -> 'a' ->> 'b')`: a nested key's text, NULL where missing."""
    *outer, last = found.group(2).split(".")
    steps = "".join(f" -> '{key}'" for key in outer)
    return f"({found.group(1)}::jsonb{steps} ->> '{last}')"


@lru_cache(maxsize=1024)
def postgres_sql(text: str) -> str:
    """SQLite spelling -> PostgreSQL: `json_extract(c, '$.k')`, `json_each(c)`, REAL, AUTOINCREMENT, `?`."""
    text = _JSON_EXTRACT.sub(_json_path, text)
    text = _JSON_EACH.sub(r"jsonb_array_elements_text(\1::jsonb) AS value", text)
    text = _SERIAL_KEY.sub("BIGSERIAL PRIMARY KEY", text)
    text = _REAL.sub("DOUBLE PRECISION", text)  # PostgreSQL's REAL is 4 bytes: too coarse for timestamps
    return text.replace("%", "%%").replace("?", "%s")


@dataclass(frozen=True)
class Dialect:
    name: str
    begin: str  # starts a write transaction
    skip_locked: str  # ends the SELECT that claims rows: other claimers pass over them
    for_update: str  # ends a SELECT whose row the transaction then changes
    migration_lock: str | None
    migration_unlock: str | None
    serialize: str | None  # orders submissions and registry writes across processes (SQLite: BEGIN IMMEDIATE does)
    elsewhere: str  # the way out of a schema that is too new
    autocommit_writes: bool  # a one-statement write is sent alone (PostgreSQL), not in BEGIN … COMMIT

    def sql(self, text: str) -> str:
        return postgres_sql(text) if self.name == "postgresql" else text


SQLITE = Dialect("sqlite", "BEGIN IMMEDIATE", "", "", None, None, None, "or use another --data-dir", False)
POSTGRESQL = Dialect("postgresql", "BEGIN", " FOR UPDATE SKIP LOCKED", " FOR UPDATE",
                     f"SELECT pg_advisory_lock({MIGRATION_LOCK})", f"SELECT pg_advisory_unlock({MIGRATION_LOCK})",
                     f"SELECT pg_advisory_xact_lock({SERIAL_LOCK})",
                     "or point CKPT_DATABASE_URL at another database", True)
