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

import pytest

from ckpt_service import auth, migrations, roots
from ckpt_service.errors import Forbidden, InvalidRequest, OutsideRoots, SchemaTooNew, Unauthorized
from ckpt_service.settings import SettingsError, load
from ckpt_service.store import JobStore


def v1_database(path: Path) -> None:
    """A job store as the first release wrote it, holding one queued and one finished job."""
    conn = sqlite3.connect(path, isolation_level=None)
    migrations.migrate(conn, str(path), upto=1)
    spec = {"kind": "export", "source": "/data/a", "target": "/data/b", "options": {}}
    now = time.time()
    for job_id, state in (("job_old_queued", "queued"), ("job_old_done", "succeeded")):
        conn.execute("INSERT INTO jobs (id, kind, state, spec, max_attempts, created_at, updated_at) "
                     "VALUES (?, 'export', ?, ?, 2, ?, ?)", (job_id, state, json.dumps(spec), now, now))
    conn.close()


def test_store_migrates_an_older_schema_and_keeps_its_jobs(tmp_path: Path) -> None:
    db = tmp_path / "ckpt.db"
    v1_database(db)
    store = JobStore(db)
    assert store.query("SELECT MAX(version) AS v FROM schema_version")[0]["v"] == migrations.LATEST
    assert store.query("PRAGMA journal_mode")[0][0] == "wal"
    old = store.get("job_old_queued")
    assert old.state == "queued" and old.target == "/data/b" and old.cancel_requested is False  # backfilled
    claimed = store.claim("w1", 30)
    assert claimed is not None and claimed.id == "job_old_queued" and claimed.attempt == 1
    assert store.get("job_old_done").state == "succeeded"
    assert JobStore(db).migrate() == (migrations.LATEST, migrations.LATEST)  # opening again changes nothing


def test_store_newer_than_the_code_is_refused_clearly(tmp_path: Path) -> None:
    db = tmp_path / "ckpt.db"
    JobStore(db)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (migrations.LATEST + 7,))
    conn.close()
    with pytest.raises(SchemaTooNew, match="newer than this ckpt-service understands"):
        JobStore(db)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    proc = subprocess.run([sys.executable, "-m", "ckpt_service.cli", "worker", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "200"})
    assert proc.returncode == 2 and "upgrade ckpt-service" in proc.stderr


def test_concurrent_claims_never_share_a_job(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "ckpt.db")
    for _ in range(20):
        store.create_job(kind="inspect", spec={"kind": "inspect", "source": "/x"}, target=None, callback_url=None,
                         submitted_by="t", max_attempts=2, queue_limit=100)
    taken: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        own = JobStore(tmp_path / "ckpt.db", migrate=False)
        while (job := own.claim(name, 30)) is not None:
            with lock:
                taken.append(job.id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(taken) == len(set(taken)) == 20


def test_lost_attempts_are_requeued_then_failed(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "ckpt.db")
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
    proc = subprocess.run([sys.executable, "-m", "ckpt_service.cli", "serve", "--print-config", "--data-dir",
                           str(tmp_path), "--workers", "4"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["workers"] == 4 and shown["tokens"] == ["ops:admin:sha256:****"]
    assert entry.digest not in proc.stdout and shown["effective_write_roots"] == [str(tmp_path.resolve())]
    bad = subprocess.run([sys.executable, "-m", "ckpt_service.cli", "serve", "--print-config", "--workers", "-1"],
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
