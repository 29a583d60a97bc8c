"""Unit tests of the service's pieces without a server: store migrations and claims, storage roots,
settings, tokens, and the job-spec -> engine mapping."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ckpt_service import auth, migrations, roots, store_check
from ckpt_service.dialect import POSTGRESQL, SQLITE, Dialect, is_url
from ckpt_service.registry import Registry
from ckpt_service.service_errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    OutsideRoots,
    SchemaTooNew,
    StoreDamaged,
    Unauthorized,
)
from ckpt_service.settings import SettingsError, load
from ckpt_service.store import JobStore

from .pg_server import PgServer


def raw_connection(location: str) -> tuple[Any, Dialect]:
    """An autocommit connection to the store at `location` that takes the store's SQL, and its dialect."""
    if is_url(location):
        import psycopg

        from ckpt_service.pg import Connection, row_factory

        return Connection(psycopg.connect(location, autocommit=True, row_factory=row_factory)), POSTGRESQL
    return sqlite3.connect(location, isolation_level=None), SQLITE


def v1_database(location: str) -> None:
    """A job store as the first release wrote it, holding one queued and one finished job."""
    conn, dialect = raw_connection(location)
    migrations.migrate(conn, location, upto=1, dialect=dialect)
    spec = {"kind": "export", "source": "/data/a", "target": "/data/b", "options": {}}
    now = time.time()
    for job_id, state in (("job_old_queued", "queued"), ("job_old_done", "succeeded")):
        conn.execute("INSERT INTO jobs (id, kind, state, spec, max_attempts, created_at, updated_at) "
                     "VALUES (?, 'export', ?, ?, 2, ?, ?)", (job_id, state, json.dumps(spec), now, now))
    conn.close()


def test_store_migrates_an_older_schema_and_keeps_its_jobs(store_location: str) -> None:
    v1_database(store_location)
    store = JobStore(store_location)
    assert store.query("SELECT MAX(version) AS v FROM schema_version")[0]["v"] == migrations.LATEST
    if store.dialect is SQLITE:
        assert store.query("PRAGMA journal_mode")[0][0] == "wal"
    old = store.get("job_old_queued")
    assert old.state == "queued" and old.target == "/data/b" and old.cancel_requested is False  # backfilled
    claimed = store.claim("w1", 30)
    assert claimed is not None and claimed.id == "job_old_queued" and claimed.attempt == 1
    assert store.get("job_old_done").state == "succeeded"
    assert JobStore(store_location).migrate() == (migrations.LATEST, migrations.LATEST)  # opening again: no change


def test_migrations_run_once_when_processes_start_together(store_location: str) -> None:
    results: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            store = JobStore(store_location, migrate=False)
            results.append(store.migrate())
            store.close()
        except BaseException as exc:  # shown by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(results) == [(0, migrations.LATEST)] + [(migrations.LATEST, migrations.LATEST)] * 3
    versions = JobStore(store_location).query("SELECT version FROM schema_version ORDER BY version")
    assert [r["version"] for r in versions] == list(range(1, migrations.LATEST + 1))


def test_store_newer_than_the_code_is_refused_clearly(store_location: str, tmp_path: Path) -> None:
    JobStore(store_location)
    conn, _ = raw_connection(store_location)
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (migrations.LATEST + 7,))
    conn.close()
    with pytest.raises(SchemaTooNew, match="newer than this ckpt-service understands"):
        JobStore(store_location)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    flags = ["--database-url", store_location] if is_url(store_location) else []
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "worker", "--data-dir", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "200"})
    assert proc.returncode == 2 and "upgrade ckpt-service" in proc.stderr
    checked = subprocess.run([sys.executable, "-m", "ckptctl", "store", "check", "--data-dir",
                              str(tmp_path), *flags], capture_output=True, text=True, timeout=60, env=env)
    assert checked.returncode == 2 and f"schema version {migrations.LATEST + 7}" in checked.stderr


def test_store_check_reports_the_schema_and_jobs(store_location: str) -> None:
    store = JobStore(store_location)
    store.create_job(kind="inspect", spec={"kind": "inspect", "source": "/x"}, target=None, callback_url=None,
                     submitted_by="t", max_attempts=2, queue_limit=100)
    report = store_check.check(store_location)
    assert (report.path, report.version, report.jobs) == (store.name, migrations.LATEST, 1)
    conn, _ = raw_connection(store_location)
    conn.execute("DROP TABLE lineage")
    conn.close()
    with pytest.raises(StoreDamaged, match=f"schema version {migrations.LATEST} but no lineage table"):
        store_check.check(store_location)


def test_concurrent_claims_never_share_a_job(store_location: str) -> None:
    store = JobStore(store_location)
    for _ in range(20):
        store.create_job(kind="inspect", spec={"kind": "inspect", "source": "/x"}, target=None, callback_url=None,
                         submitted_by="t", max_attempts=2, queue_limit=100)
    taken: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        own = JobStore(store_location, migrate=False)
        while (job := own.claim(name, 30)) is not None:
            with lock:
                taken.append(job.id)
        own.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(taken) == len(set(taken)) == 20


def test_concurrent_submissions_keep_idempotency_and_busy_targets(store_location: str) -> None:
    stores = [JobStore(store_location, migrate=False) for _ in range(4)]
    stores[0].migrate()
    outcomes: list[str] = []
    lock = threading.Lock()

    def submit(store: JobStore, n: int) -> None:
        for i in range(5):
            key = ("same-key", "same-hash") if i == 0 else None
            target = "/data/one" if i == 1 else f"/data/t{n}-{i}"
            try:
                job, created = store.create_job(kind="export", spec={"kind": "export"}, target=target,
                                                callback_url=None, submitted_by="t", max_attempts=2, queue_limit=100,
                                                idempotency=key)
                result = f"{i}:{'created' if created else 'replayed'}:{job.id if i == 0 else ''}"
            except Conflict:
                result = f"{i}:conflict"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=submit, args=(store, n)) for n, store in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for store in stores[1:]:
        store.close()
    first = sorted(o for o in outcomes if o.startswith("0:"))
    assert len({o.rsplit(":", 1)[1] for o in first}) == 1  # one job for the key, whoever came first
    assert [o.split(":")[1] for o in first].count("created") == 1
    assert sorted(o for o in outcomes if o.startswith("1:")).count("1:conflict") == 3  # one job per busy target
    assert stores[0].count_by_state() == {"queued": 1 + 1 + 4 * 3}


def test_lost_attempts_are_requeued_then_failed(store_location: str) -> None:
    store = JobStore(store_location)
    job, _ = store.create_job(kind="inspect", spec={"kind": "inspect", "source": "/x"}, target=None,
                              callback_url=None, submitted_by="t", max_attempts=2, queue_limit=10)
    first = store.claim("w1", 30)
    assert first is not None
    assert store.requeue_or_fail(job.id, 1, "worker died") == "queued"
    assert store.requeue_or_fail(job.id, 1, "late duplicate") is None  # not current any more
    second = store.claim("w2", 30)
    assert second is not None and second.attempt == 2
    assert not store.finish_now(job.id, 1, "succeeded")  # a stale attempt cannot finish the job
    assert store.requeue_or_fail(job.id, 2, "worker died again") == "failed"
    failed = store.get(job.id)
    assert failed.error_type == "WorkerLost" and "attempt 2 of 2" in (failed.error_message or "")


@pytest.mark.parametrize(("uri", "ok"), [
    ("/data/team/ckpt", True),
    ("/data", False),  # writing over a root itself
    ("/data/../etc/passwd", False),
    ("/data/./x", False),
    ("/data-other/ckpt", False),
    ("/etc/passwd", False),
    ("file:///data/team/x", True),
    ("file://evil/data/x", False),
    ("s3://team-a/checkpoints/run1/step2", True),
    ("s3://team-a/checkpoints", False),  # the root itself
    ("s3://team-a/checkpoints-old/run1", False),  # prefix on a segment boundary only
    ("s3://team-a/checkpoints/../secrets", False),
    ("s3://team-a//checkpoints/x", False),
    ("s3://team-a/checkpoints/%2e%2e/x", False),
    ("s3://team-a/checkpoints/x?versionId=1", False),
    ("s3://user@team-a/checkpoints/x", False),
    ("s3://team-b/checkpoints/x", False),
    ("gs://team-a/checkpoints/x", False),
    ("S3://team-a/checkpoints/x", True),  # schemes are case-insensitive
    ("relative/path", False),
    ("/data/x\x00y", False),
])
def test_storage_roots(tmp_path: Path, uri: str, ok: bool) -> None:
    data = tmp_path / "data"
    (data / "team").mkdir(parents=True)
    (tmp_path / "data-other").mkdir()
    allowed = [roots.parse_root(str(data)), roots.parse_root("s3://team-a/checkpoints/")]
    local = uri.replace("/data", str(data), 1) if uri.startswith(("/data", "file:///data")) else uri
    local = local.replace("file:///data", f"file://{data}") if local.startswith("file:///data") else local
    local = local.replace("/data-other", str(tmp_path / "data-other")) if "data-other" in uri else local
    if ok:
        assert roots.check(local, allowed, field="target", purpose="write")
    else:
        with pytest.raises((OutsideRoots, InvalidRequest)):
            roots.check(local, allowed, field="target", purpose="write")


def test_symlinks_resolve_before_the_root_check(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "inner").symlink_to(root / "escape")
    allowed = [roots.parse_root(str(root))]
    for uri in (root / "escape" / "ckpt", root / "inner" / "new-output"):
        with pytest.raises(OutsideRoots):
            roots.check(str(uri), allowed, field="source", purpose="read")
    linked_root = tmp_path / "linked-root"
    linked_root.symlink_to(root)  # a root given through a link still contains its real children
    assert roots.check(str(root / "x"), [roots.parse_root(str(linked_root))], field="source", purpose="read")


def test_settings_sources_and_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("CKPT_"):
            monkeypatch.delenv(key)
    _, entry = auth.create("write", "ci")
    config = tmp_path / "ckpt.toml"
    config.write_text(f'workers = 3\nport = 9000\ntokens = ["{entry.line()}"]\nread_roots = ["{tmp_path}"]\n')
    monkeypatch.setenv("CKPT_PORT", "9100")
    monkeypatch.setenv("CKPT_WRITE_ROOTS", f"{tmp_path}/a, s3://bucket/prefix/")
    settings = load(config, port=None, workers=5, data_dir=tmp_path / "d")
    assert (settings.workers, settings.port) == (5, 9100)  # flag > env > file
    assert settings.write_roots == [f"{tmp_path}/a", "s3://bucket/prefix"]
    assert settings.tokens == [entry.line()] and not settings.anonymous
    masked = json.dumps(settings.masked())
    assert entry.digest not in masked and "ci:write:sha256:****" in masked
    with pytest.raises(ValueError, match="no tokens configured"):
        load(None, host="0.0.0.0", data_dir=tmp_path)
    assert load(None, host="0.0.0.0", allow_anonymous=True, data_dir=tmp_path).anonymous
    with pytest.raises(ValueError, match="NAME:SCOPE:sha256:HEX"):
        load(None, tokens=["ckpt_rawtokenpasted"], data_dir=tmp_path)
    with pytest.raises(ValueError, match="heartbeat_seconds"):
        load(None, lease_seconds=1, heartbeat_seconds=1, data_dir=tmp_path)
    with pytest.raises(SettingsError):
        load(tmp_path / "missing.toml")


def test_print_config_masks_token_hashes(tmp_path: Path) -> None:
    _, entry = auth.create("admin", "ops")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update({"CKPT_TOKENS": json.dumps([entry.line()]), "COLUMNS": "200"})
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "serve", "--print-config", "--data-dir",
                           str(tmp_path), "--workers", "4"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["workers"] == 4 and shown["tokens"] == ["ops:admin:sha256:****"]
    assert entry.digest not in proc.stdout and shown["effective_write_roots"] == [str(tmp_path.resolve())]
    bad = subprocess.run([sys.executable, "-m", "ckptctl", "serve", "--print-config", "--workers", "-1"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "setting workers" in bad.stderr


def test_tokens_and_scopes() -> None:
    tokens = {scope: auth.create(scope) for scope in ("read", "write", "admin")}  # type: ignore[arg-type]
    checker = auth.TokenChecker([entry for _, entry in tokens.values()], anonymous=False)
    assert checker.require(f"Bearer {tokens['admin'][0]}", "write").scope == "admin"
    assert checker.require(f"bearer {tokens['read'][0]}", "read").name == "read"
    with pytest.raises(Forbidden):
        checker.require(f"Bearer {tokens['read'][0]}", "write")
    for header in (None, "", "Bearer ", "Basic abc", f"Bearer {tokens['read'][0]}x"):
        with pytest.raises(Unauthorized):
            checker.require(header, "read")
    assert auth.TokenChecker([], anonymous=True).require(None, "admin") == auth.ANONYMOUS


def test_registry_filters_by_tag_and_walks_lineage(store_location: str) -> None:
    store = JobStore(store_location)
    registry = Registry(store)
    with store.transaction() as conn:
        first = registry.add(conn, uri="/data/a", name="a", summary={"format": "fsdp2"}, tags=["base", "v1"],
                             metadata={"step": 1}, via={"how": "registered"})
        registry.add(conn, uri="/data/b", name="b", summary={"format": "hf"}, tags=["v1"], metadata={},
                     via={"how": "registered"})
    with store.transaction() as conn:
        child = registry.record_output(conn, uri="/data/c", summary={"format": "hf"}, job_id="job_x",
                                       source_uri="/data/a", source_summary=None)
    assert sorted(v.uri for v in registry.list(tag="v1")[0]) == ["/data/a", "/data/b"]
    assert [v.uri for v in registry.list(tag="base")[0]] == ["/data/a"]
    assert registry.list(tag="nope")[0] == []
    lineage = registry.lineage(first)
    assert [(e.checkpoint.id, e.job_id, e.depth) for e in lineage.descendants] == [(child, "job_x", 1)]
    with pytest.raises(Conflict, match="registered already"), store.transaction() as conn:
        registry.add(conn, uri="/data/a", name="again", summary={}, tags=[], metadata={}, via={"how": "registered"})


def test_postgres_connection_loss_is_retried_and_logged(postgres: PgServer, caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    url = postgres.create_database()
    store = JobStore(url)
    store.create_job(kind="inspect", spec={"kind": "inspect", "source": "/x"}, target=None, callback_url=None,
                     submitted_by="t", max_attempts=2, queue_limit=10)
    conn, _ = raw_connection(url)
    killed = conn.execute("SELECT pg_terminate_backend(pid) AS k FROM pg_stat_activity WHERE datname = "
                          "current_database() AND pid <> pg_backend_pid()").fetchall()
    conn.close()
    assert killed and all(r["k"] for r in killed)
    with caplog.at_level("WARNING", logger="ckpt_service"):
        job = store.claim("w1", 30)
    assert job is not None and job.attempt == 1
    reconnects = [r for r in caplog.records if r.getMessage() == "store.reconnect"]
    assert reconnects and reconnects[0].fields["store"] == url and reconnects[0].fields["attempt"] == 1
    store.close()


def test_a_dead_hosts_job_is_cleaned_then_retried_by_another_host(store_location: str, tmp_path: Path) -> None:
    """A worker on another host that stopped renewing its lease (powered off): a live worker takes the job
    over once, removes the partial output, and queues it for its second attempt."""
    from ckpt_service.settings import Settings
    from ckpt_service.worker import WorkerPool

    store = JobStore(store_location)
    target = tmp_path / "out"
    job, _ = store.create_job(kind="export", spec={"kind": "export", "source": "/x", "target": str(target)},
                              target=str(target), callback_url=None, submitted_by="t", max_attempts=2,
                              queue_limit=10)
    lease = 3.0  # long enough that the first reap below runs inside it on a loaded machine
    claimed = time.monotonic()
    assert store.claim("far-away-host:4242:abcdef", lease_seconds=lease) is not None
    partial = tmp_path / ".out.tmp-1234abcd"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    settings = Settings(data_dir=tmp_path / "data", database_url=store_location if is_url(store_location) else None,
                        lease_seconds=4, heartbeat_seconds=1)
    pools = [WorkerPool(settings, JobStore(store_location, migrate=False), slots=0) for _ in range(2)]
    for pool in pools:
        pool.reap()
    assert time.monotonic() - claimed < lease, "the set-up outlasted the lease: the check above proves nothing"
    assert store.get(job.id).state == "running"  # the lease still runs: nobody touches the job
    time.sleep(max(0.0, claimed + lease + 0.1 - time.monotonic()))
    threads = [threading.Thread(target=pool.reap) for pool in pools]  # two live hosts race to reap it
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    requeued = store.get(job.id)
    assert (requeued.state, requeued.attempt, requeued.error_type) == ("queued", 1, "WorkerLost")
    assert "far-away-host:4242:abcdef stopped heartbeating (lease expired)" in (requeued.error_message or "")
    assert not partial.exists()
    second = store.claim("near-host:1:aaaaaa", 30)
    assert second is not None and (second.id, second.attempt) == (job.id, 2)
    for pool in pools:
        pool.store.close()


def test_database_url_setting_is_checked_and_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("CKPT_")]:
        monkeypatch.delenv(key)
    config = tmp_path / "ckpt.toml"
    config.write_text('database_url = "postgresql://ckpt:s3cret@db.internal:5433/jobs"\n')
    settings = load(config, data_dir=str(tmp_path))
    assert settings.store_location == "postgresql://ckpt:s3cret@db.internal:5433/jobs"
    assert settings.masked()["database_url"] == "postgresql://ckpt:****@db.internal:5433/jobs"
    monkeypatch.setenv("CKPT_DATABASE_URL", "")  # empty: SQLite under the data dir, as without it
    assert load(data_dir=str(tmp_path)).store_location == str(tmp_path / "ckpt.db")
    monkeypatch.setenv("CKPT_DATABASE_URL", "mysql://ckpt@db/jobs")
    with pytest.raises(ValidationError, match="postgresql://USER@HOST"):
        load(data_dir=str(tmp_path))
