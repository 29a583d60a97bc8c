"""A real PostgreSQL server for the tests: Debian's `postgresql` package (initdb + pg_ctl), started once per
session in a temporary directory on a free loopback port, one fresh database per test (or module).

initdb refuses to run as root, so under root the server runs as the `postgres` user (runuser) in a
directory that user owns. Without the package the PostgreSQL cases are skipped (`.ci/run` installs it).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .service_harness import free_port

STORES = ["sqlite", "postgresql"]


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[-3]))
    return Path(found[-1]).parent if found else None


@dataclass
class PgServer:
    root: Path
    port: int
    bin: Path
    as_user: list[str]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://ckpt@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def pg_ctl(self, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), *args], check=True,
                       capture_output=True, timeout=120)


def start_server() -> PgServer:
    bin_dir = pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="ckpt-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", "ckpt", "--auth=trust",
                    "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=120)
    server = PgServer(root, free_port(), bin_dir, as_user)
    options = (f"-h 127.0.0.1 -p {server.port} -k {root} -c fsync=off -c synchronous_commit=off "
               "-c full_page_writes=off -c max_connections=300")
    server.pg_ctl("-o", options, "-l", str(root / "server.log"), "-w", "-t", "60", "start")
    return server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    server = start_server()
    yield server
    try:
        server.pg_ctl("-m", "immediate", "stop")
    finally:
        shutil.rmtree(server.root, ignore_errors=True)


def store_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """For a fixture parametrised on STORES: the server environment that selects the store."""
    if request.param == "sqlite":
        return {}
    return {"CKPT_DATABASE_URL": request.getfixturevalue("postgres").create_database()}


@pytest.fixture(params=STORES)
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh job store location: a SQLite file, or a PostgreSQL database URL."""
    return store_env(request).get("CKPT_DATABASE_URL") or str(tmp_path / "ckpt.db")
