"""The service under attack, through real servers on real sockets: callbacks aimed at internal addresses
(SSRF), one token cancelling another's jobs, event-stream floods, oversize bodies however sent, a damaged
job store, and job processes that would import a module from their working directory."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_service.auth import create
from ckpt_service.jobs import JobSpec
from ckpt_service.migrations import LATEST
from ckpt_service.netguard import CallbackPolicy, CallbackRefused, address_class, pin
from ckpt_service.service_errors import InvalidRequest
from ckpt_service.store import JobStore

from .service_harness import Server, Tokens, job_spec, make_server, serve, wait_for

PAGE = 4096  # SQLite's default page size, which the store keeps


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A read root holding one small real safetensors checkpoint, and an empty write root."""
    base = tmp_path_factory.mktemp("hardening")
    (base / "data" / "ckpt").mkdir(parents=True)
    (base / "out").mkdir()
    save_file({"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "layer.bias": torch.ones(3)},
              base / "data" / "ckpt" / "model.safetensors")
    return base / "data", base / "out"


def ckptctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          timeout=60, env={**environ, "COLUMNS": "400", **(env or {})})


# -- callbacks -------------------------------------------------------------------------------------------


@dataclass
class Listener:
    """An HTTP listener on loopback that records every request it gets."""

    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    port: int = 0


@contextmanager
def listener() -> Iterator[Listener]:
    seen = Listener()

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.received.append((self.path, dict(self.headers), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with serve(Hook) as hook:
        seen.port = hook.server_port
        yield seen


def callback_states(server: Server, job_ids: list[str]) -> dict[str, str | None]:
    conn = sqlite3.connect(server.data_dir / "ckpt.db")
    try:
        marks = ",".join("?" * len(job_ids))
        return dict(conn.execute(f"SELECT id, callback_state FROM jobs WHERE id IN ({marks})", job_ids).fetchall())
    finally:
        conn.close()


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_callbacks_reach_only_public_or_allowed_addresses(roots: tuple[Path, Path], tmp_path: Path) -> None:
    read_root, write_root = roots
    source = read_root / "ckpt"
    with listener() as hook:
        server = make_server(tmp_path / "state", read_roots=[read_root], write_roots=[write_root], workers=1)
        server.start()
        try:
            private = [f"http://127.0.0.1:{hook.port}/a", f"http://localhost:{hook.port}/a", "http://169.254.169.254/",
                       "http://10.1.2.3/", f"http://[::ffff:127.0.0.1]:{hook.port}/a", "http://[::1]/",
                       f"http://2130706433:{hook.port}/a", "http://0.0.0.0/", "http://[fe80::1]/", "http://224.0.0.1/"]
            with server.http() as http:
                for url in private:
                    refused = http.post("/v1/jobs", json={**job_spec("inspect", source), "callback_url": url})
                    assert refused.status_code == 422, (url, refused.text)
                    error = refused.json()["error"]
                    assert error["fields"][0]["field"] == "callback_url" and "CKPT_CALLBACK_ALLOW" in error["message"]
                assert http.get("/v1/jobs").json()["items"] == []
            # Past the submit-time check (as a name that resolves differently later would be): the send-time
            # check resolves the name itself and refuses every non-public address.
            store = JobStore(server.data_dir / "ckpt.db", migrate=False)
            ids = []
            for url in (f"http://127.0.0.1:{hook.port}/sent", f"http://localhost:{hook.port}/sent"):
                spec = JobSpec.model_validate(job_spec("inspect", source)).model_dump(mode="json")
                job, _ = store.create_job(kind="inspect", spec=spec, target=None, callback_url=url,
                                          submitted_by="anonymous", max_attempts=1, queue_limit=10)
                ids.append(job.id)
            store.close()
            for job_id in ids:
                assert server.wait_job(job_id, ("succeeded", "failed"))["state"] == "succeeded"
            wait_for(lambda: set(callback_states(server, ids).values()) == {"failed"}, 30, "the refusals")
            refused_ids = {e["job_id"] for e in server.log_events() if e.get("event") == "callback.refused"}
            assert refused_ids == set(ids), server.log_tail()
        finally:
            server.stop()
        assert hook.received == []  # nothing reached the loopback listener

        # an operator who lists the address lets callbacks through, with the URL's host in the Host header
        allowed = make_server(tmp_path / "state", read_roots=[read_root], write_roots=[write_root], workers=1,
                              extra_env={"CKPT_CALLBACK_ALLOW": "127.0.0.1"}).start()
        try:
            url = f"http://127.0.0.1:{hook.port}/done"
            with allowed.client() as client:
                job = client.submit({**job_spec("inspect", source), "callback_url": url})
            wait_for(lambda: hook.received, 30, "the callback")
        finally:
            allowed.stop()
    assert len(hook.received) == 1
    path, headers, body = hook.received[0]
    document = json.loads(body)
    assert path == "/done" and headers["Host"] == f"127.0.0.1:{hook.port}" and headers["X-Ckpt-Job"] == job["id"]
    assert document["id"] == job["id"] and document["state"] == "succeeded"


@pytest.mark.parametrize(("address", "why"), [
    ("8.8.8.8", None), ("2001:4860:4860::8888", None), ("2002:808:808::1", None),  # public, and 6to4 of public
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("10.1.2.3", "private"), ("192.168.0.1", "private"),
    ("172.16.0.1", "private"), ("fd00::1", "private"), ("100.64.0.1", "non-public"), ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"), ("240.0.0.1", "reserved"), ("fec0::1", "site-local"),
    ("::ffff:127.0.0.1", "IPv4-mapped loopback"), ("::ffff:169.254.169.254", "IPv4-mapped link-local"),
    ("::ffff:10.0.0.1", "IPv4-mapped private"), ("::127.0.0.1", "IPv4-compatible loopback"),
    ("2002:7f00:1::", "6to4 loopback"), ("2002:a00:1::", "6to4 private"), ("64:ff9b::a00:1", "NAT64 private"),
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "Teredo private"),  # client 10.0.0.1, stored inverted
])
def test_address_classes(address: str, why: str | None) -> None:
    assert address_class(ipaddress.ip_address(address)) == why


def test_callbacks_are_pinned_to_the_checked_address() -> None:
    """The name is resolved once; the request goes to that address and the name only rides in Host and SNI."""
    pinned = pin("http://localhost:8080/hook?x=1", CallbackPolicy.parse(["localhost"]))
    assert pinned.url.host in ("127.0.0.1", "::1") and pinned.url.port == 8080 and pinned.url.path == "/hook"
    assert pinned.headers == {"Host": "localhost:8080"} and pinned.extensions == {}
    with pytest.raises(CallbackRefused, match=r"localhost resolves to .*, not a public address \(loopback\)"):
        pin("http://localhost:8080/hook", CallbackPolicy.parse(["10.0.0.0/8"]))
    public = pin("https://8.8.8.8/hook", CallbackPolicy())
    assert str(public.url) == "https://8.8.8.8/hook" and public.headers == {"Host": "8.8.8.8"}
    with pytest.raises(CallbackRefused, match="does not resolve"):
        pin("http://no-such-host.invalid/hook", CallbackPolicy())


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_callback_allow_list_is_validated(tmp_path: Path) -> None:
    env = {"CKPT_CALLBACK_ALLOW": "hooks.internal, 10.0.0.0/8, http://x/"}
    bad = ckptctl("serve", "--print-config", "--data-dir", str(tmp_path), env=env)
    assert bad.returncode == 2 and "callback_allow" in bad.stderr and "http://x/" in bad.stderr, bad.stderr
    env["CKPT_CALLBACK_ALLOW"] = "hooks.internal, 10.0.0.0/8, ::1"
    good = ckptctl("serve", "--print-config", "--data-dir", str(tmp_path), env=env)
    assert json.loads(good.stdout)["callback_allow"] == ["hooks.internal", "10.0.0.0/8", "::1"]


# -- one API-only server: ownership, event-stream caps, body limits ------------------------------------


@dataclass
class Api:
    server: Server
    tokens: Tokens
    alice: str
    bob: str
    source: Path


@pytest.fixture(scope="module")
def api(roots: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    read_root, write_root = roots
    tokens = Tokens.make()
    alice, alice_entry = create("write", "alice")
    bob, bob_entry = create("write", "bob")
    server = make_server(tmp_path_factory.mktemp("api-state"), read_roots=[read_root], write_roots=[write_root],
                         workers=0, tokens=[*tokens.entries, alice_entry.line(), bob_entry.line()],
                         extra_env={"CKPT_SSE_MAX_STREAMS": "3", "CKPT_SSE_MAX_STREAMS_PER_PRINCIPAL": "2",
                                    "CKPT_MAX_REQUEST_BYTES": "4096"})
    yield Api(server.start(), tokens, alice, bob, read_root / "ckpt")
    server.stop()


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_only_the_submitter_or_an_admin_may_cancel(api: Api) -> None:
    with api.server.http(api.alice) as alice, api.server.http(api.bob) as bob, \
            api.server.http(api.tokens.admin) as admin:
        first = alice.post("/v1/jobs", json=job_spec("inspect", api.source)).json()
        second = alice.post("/v1/jobs", json=job_spec("inspect", api.source)).json()
        assert first["submitted_by"] == "alice"
        refused = bob.post(f"/v1/jobs/{first['id']}/cancel")
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "forbidden"
        assert "alice" in refused.json()["error"]["message"]
        assert bob.get(f"/v1/jobs/{first['id']}").json()["state"] == "queued"  # reading is still allowed
        cancelled = admin.post(f"/v1/jobs/{first['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        own = alice.post(f"/v1/jobs/{second['id']}/cancel")
        assert own.status_code == 200 and own.json()["state"] == "cancelled"


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_event_streams_are_capped_per_token_and_in_total(api: Api) -> None:
    with api.server.http(api.alice) as alice:
        job = alice.post("/v1/jobs", json=job_spec("inspect", api.source)).json()  # stays queued: no workers
    path = f"/v1/jobs/{job['id']}/events"

    def follow(stack: ExitStack, token: str) -> int:
        client = stack.enter_context(api.server.http(token))
        return stack.enter_context(client.stream("GET", path)).status_code

    with ExitStack() as streams:
        assert [follow(streams, api.alice) for _ in range(2)] == [200, 200]
        with api.server.http(api.alice) as alice:
            third = alice.get(path)
            assert third.status_code == 429 and third.json()["error"]["type"] == "too_many_streams"
            assert third.headers["Retry-After"].isdigit() and "PER_PRINCIPAL" in third.text
        assert follow(streams, api.bob) == 200
        with api.server.http(api.tokens.admin) as admin:
            total = admin.get(path)
            assert total.status_code == 429 and "CKPT_SSE_MAX_STREAMS" in total.text
    # the closed streams give their slots back
    with ExitStack() as streams:
        wait_for(lambda: follow(streams, api.tokens.admin) == 200, 10, "a freed stream slot")
    with api.server.http(api.tokens.admin) as admin:
        admin.post(f"/v1/jobs/{job['id']}/cancel")


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_oversize_bodies_get_413_however_they_are_sent(api: Api) -> None:
    big = json.dumps(job_spec("inspect", api.source, tensors=True) | {"pad": "x" * 8000}).encode()
    small = json.dumps(job_spec("inspect", api.source)).encode()

    def chunked(data: bytes) -> Iterator[bytes]:
        for start in range(0, len(data), 1000):
            yield data[start:start + 1000]

    headers = {"Content-Type": "application/json"}
    with api.server.http(api.tokens.admin) as http:
        before = len(http.get("/v1/jobs", params={"limit": 200}).json()["items"])
        sized = http.post("/v1/jobs", content=big, headers=headers)
        streamed = http.post("/v1/jobs", content=chunked(big), headers=headers)
        assert streamed.request.headers.get("Transfer-Encoding") == "chunked"
        assert "Content-Length" not in streamed.request.headers
        for response in (sized, streamed):
            assert response.status_code == 413, response.text
            assert response.json() == {"error": {"type": "payload_too_large", "message": "request body over 4096 "
                                                                                          "bytes"}}
        ok = http.post("/v1/jobs", content=chunked(small), headers=headers)  # a chunked body within the limit
        assert ok.status_code == 202, ok.text
        jobs = http.get("/v1/jobs", params={"limit": 200}).json()["items"]
        assert len(jobs) == before + 1
        http.post(f"/v1/jobs/{ok.json()['id']}/cancel")


# -- the job store: checked at start-up, by /readyz, and by `ckptctl store` ------------------------------


def filled_store(path: Path, jobs: int) -> None:
    """A real job store holding `jobs` queued jobs, checkpointed into the main file."""
    store = JobStore(path)
    for n in range(jobs):
        store.create_job(kind="inspect", spec={"kind": "inspect", "source": f"/data/ckpt-{n:04d}" * 8}, target=None,
                         callback_url=None, submitted_by="t", max_attempts=2, queue_limit=100_000)
    store.query("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()


def damage(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xa5" * length)


def one_error_line(proc: subprocess.CompletedProcess[str], path: Path) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: job store {path} is damaged (") and "ckptctl store restore" in lines[0]
    return lines[0]


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_a_damaged_store_stops_start_up_with_one_line(tmp_path: Path) -> None:
    header, middle = tmp_path / "header", tmp_path / "middle"
    header.mkdir()
    middle.mkdir()
    filled_store(header / "ckpt.db", 3)
    damage(header / "ckpt.db", 0, 16)  # "SQLite format 3\0"
    filled_store(middle / "ckpt.db", 300)
    pages = (middle / "ckpt.db").stat().st_size // PAGE
    assert pages > 12
    damage(middle / "ckpt.db", 3 * PAGE, 8 * PAGE)
    for data_dir, detail in ((header, "file is not a database"), (middle, "Page")):
        db = data_dir / "ckpt.db"
        for command in (["serve", "--port", "0", "--workers", "0"], ["worker", "--workers", "1"], ["store", "check"]):
            line = one_error_line(ckptctl(*command, "--data-dir", str(data_dir)), db)
            assert detail in line, line


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_readyz_reports_a_store_damaged_while_serving(roots: tuple[Path, Path], tmp_path: Path) -> None:
    read_root, write_root = roots
    data_dir = tmp_path / "state"
    data_dir.mkdir()
    filled_store(data_dir / "ckpt.db", 300)
    server = make_server(data_dir, read_roots=[read_root], write_roots=[write_root], workers=0,
                         extra_env={"CKPT_STORE_CHECK_SECONDS": "0"}).start()
    try:
        with server.http() as http:
            ready = http.get("/readyz")
            assert ready.status_code == 200 and ready.json()["checks"]["store"] == "ok"
            damage(data_dir / "ckpt.db", 3 * PAGE, 8 * PAGE)
            damaged = http.get("/readyz")
            assert damaged.status_code == 503 and damaged.json()["status"] == "unavailable"
            checks = damaged.json()["checks"]
            assert checks["store"] == "damaged" and "is damaged (" in checks["store_problem"]
            assert http.get("/healthz").status_code == 200  # alive, but not ready
    finally:
        server.stop()


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_store_backup_and_restore_round_trip(tmp_path: Path) -> None:
    data_dir = tmp_path / "state"
    data_dir.mkdir()
    db = data_dir / "ckpt.db"
    filled_store(db, 40)
    d = ["--data-dir", str(data_dir)]
    checked = ckptctl("store", "check", *d)
    healthy = f"job store {db}: ok (schema version {LATEST}, 40 jobs)"
    assert checked.returncode == 0 and checked.stdout.strip() == healthy
    backup = tmp_path / "backups" / "ckpt-1.db"
    missing = ckptctl("store", "backup", str(backup), *d)
    assert missing.returncode == 2 and f"folder {backup.parent} does not exist" in missing.stderr
    backup.parent.mkdir()
    made = ckptctl("store", "backup", str(backup), *d)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in backup.parent.iterdir()) == ["ckpt-1.db"]  # one file, nothing beside it
    again = ckptctl("store", "backup", str(backup), *d)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    damage(db, 3 * PAGE, 8 * PAGE)
    one_error_line(ckptctl("store", "check", *d), db)
    one_error_line(ckptctl("store", "backup", str(tmp_path / "other.db"), *d), db)  # no backup of a damaged store
    restored = ckptctl("store", "restore", str(backup), *d)
    assert restored.returncode == 0 and "40 jobs" in restored.stdout, restored.stderr
    assert ckptctl("store", "check", *d).stdout.strip() == f"job store {db}: ok (schema version {LATEST}, 40 jobs)"
    kept = [p for p in data_dir.iterdir() if p.name.startswith("ckpt.db.replaced-")
            and not p.name.endswith(("-wal", "-shm"))]
    assert len(kept) == 1 and kept[0].read_bytes()[3 * PAGE:4 * PAGE] == b"\xa5" * PAGE  # kept aside, as it was
    store = JobStore(db)
    assert len(store.list_jobs(limit=200)[0]) == 40
    store.close()


# -- job processes: no working directory on sys.path -----------------------------------------------------


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_job_processes_never_import_from_the_working_directory(roots: tuple[Path, Path], tmp_path: Path) -> None:
    read_root, write_root = roots
    cwd, marker = tmp_path / "cwd", tmp_path / "imported"
    cwd.mkdir()
    canary = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("converters/__init__.py", "safetensors/__init__.py", "numpy.py", "ml_dtypes.py"):
        (cwd / name).parent.mkdir(exist_ok=True)
        (cwd / name).write_text(canary)
    # the canaries work: a Python that has its working directory on sys.path imports them
    subprocess.run([sys.executable, "-c", "import converters"], cwd=cwd, check=True, timeout=60)
    assert marker.read_text() == "converters\n"
    marker.unlink()
    server = make_server(tmp_path / "state", read_roots=[read_root], write_roots=[write_root], workers=1,
                         cwd=cwd).start()
    try:
        with server.client() as client:
            job = client.submit(job_spec("export", read_root / "ckpt", write_root / "canary-export"))
        done = server.wait_job(job["id"], ("succeeded", "failed"))
    finally:
        server.stop()
    assert done["state"] == "succeeded", done["error"]
    assert (write_root / "canary-export" / "model.safetensors").is_file()
    assert not marker.exists(), marker.read_text()


# -- managed objects: deletions that follow no symlink, damaged rows, owners --------------------------------


@dataclass
class Managed:
    server: Server
    tokens: Tokens
    alice: str
    bob: str
    out: Path


@pytest.fixture(scope="module")
def managed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Managed]:
    """A server whose one root is read and written (GC and purges delete there), one worker; tokens alice and bob
    write."""
    base = tmp_path_factory.mktemp("managed")
    (base / "out").mkdir()
    tokens = Tokens.make()
    alice, alice_entry = create("write", "alice")
    bob, bob_entry = create("write", "bob")
    server = make_server(base / "state", read_roots=[base / "out"], write_roots=[base / "out"], workers=1,
                         tokens=[*tokens.entries, alice_entry.line(), bob_entry.line()])
    yield Managed(server.start(), tokens, alice, bob, base / "out")
    server.stop()


def small_checkpoint(folder: Path, value: float) -> Path:
    folder.mkdir(parents=True)
    save_file({"w": torch.full((4,), value)}, folder / "model.safetensors")
    return folder


def registered(http: object, folder: Path) -> str:
    made = http.post("/v1/checkpoints", json={"uri": str(folder)})  # type: ignore[attr-defined]
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def deletion_states(http: object) -> dict[str, tuple[str, str | None]]:
    """checkpoint id -> (state, error) of its newest deletion."""
    rows = http.get("/v1/deletions", params={"limit": 1000}).json()  # type: ignore[attr-defined]
    return {r["checkpoint_id"]: (r["state"], r["error"]) for r in reversed(rows)}


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_gc_deletes_the_registered_folder_never_a_swapped_symlinks_target(managed: Managed) -> None:
    run = managed.out / "swap"
    folders = [small_checkpoint(run / f"step_{n}", n) for n in (1, 2, 3, 4)]
    with managed.server.http(managed.tokens.admin) as admin:
        ids = [registered(admin, f) for f in folders]
        assert admin.put("/v1/aliases/swap/prod", json={"checkpoint_id": ids[2]}).status_code == 200
        assert admin.post("/v1/policies", json={"name": "swap", "run": "swap", "keep_last": 1}).status_code == 201
        plan = admin.post("/v1/gc", json={"dry_run": True}).json()["plan"]
        assert [p["checkpoint_id"] for p in plan] == ids[:2]  # step_3 is aliased (prod), step_4 kept
        # the attack: a planned folder becomes a symlink to the aliased production checkpoint
        shutil.rmtree(folders[1])
        os.symlink(folders[2], folders[1])
        report = admin.post("/v1/gc", json={"dry_run": False})
        assert report.status_code == 200, report.text
        assert (folders[2] / "model.safetensors").is_file()  # prod is untouched
        assert folders[1].is_symlink() and not folders[0].exists()
        states = deletion_states(admin)
        assert states[ids[0]] == ("done", None)
        assert states[ids[1]][0] == "refused" and "symlink" in (states[ids[1]][1] or "")
        collected = admin.get(f"/v1/checkpoints/{ids[0]}")  # the entry says its data is gone
        assert collected.status_code == 200 and collected.json()["deleted_at"] is not None
        assert admin.get(f"/v1/checkpoints/{ids[2]}").json()["deleted_at"] is None
        listed = {c["id"] for c in admin.get("/v1/checkpoints", params={"limit": 200}).json()["items"]}
        assert ids[0] not in listed and ids[2] in listed


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_purge_deletes_the_registered_folder_never_a_swapped_symlinks_target(managed: Managed) -> None:
    keep = small_checkpoint(managed.out / "purge" / "keep", 1)
    doomed = small_checkpoint(managed.out / "purge" / "doomed", 2)
    with managed.server.http(managed.tokens.admin) as admin:
        keep_id, doomed_id = registered(admin, keep), registered(admin, doomed)
        shutil.rmtree(doomed)
        os.symlink(keep, doomed)
        refused = admin.delete(f"/v1/checkpoints/{doomed_id}", params={"purge": "true"})
        assert refused.status_code == 409, refused.text
        message = refused.json()["error"]["message"]
        assert "symlink" in message and "nothing deleted" in message
        assert (keep / "model.safetensors").is_file() and doomed.is_symlink()
        assert admin.get(f"/v1/checkpoints/{doomed_id}").json()["deleted_at"] is None  # still live
        # inside the tree a symlink is unlinked, never followed
        doomed.unlink()
        small_checkpoint(doomed, 3)
        os.symlink(keep, doomed / "folder-link")
        os.symlink(keep / "model.safetensors", doomed / "file-link")
        purged = admin.delete(f"/v1/checkpoints/{doomed_id}", params={"purge": "true"})
        assert purged.status_code == 200, purged.text
        assert purged.json()["deleted_at"] is not None and not os.path.lexists(doomed)
        assert (keep / "model.safetensors").is_file()
        assert admin.get(f"/v1/checkpoints/{doomed_id}").json()["deleted_at"] is not None
        assert deletion_states(admin)[doomed_id][0] == "done"
        assert admin.get(f"/v1/checkpoints/{keep_id}").json()["deleted_at"] is None


def test_a_deletion_refuses_a_replaced_or_protected_folder(tmp_path: Path) -> None:
    from ckpt_service import roots as service_roots
    from ckpt_service.retention import DeletionRefused, Kept, local_identity, remove_checkpoint

    write = [service_roots.parse_root(str(tmp_path))]
    planned, kept = small_checkpoint(tmp_path / "planned", 1), small_checkpoint(tmp_path / "kept", 2)
    identity, kept_identity = local_identity(str(planned)), local_identity(str(kept))
    assert identity is not None and kept_identity is not None
    shutil.rmtree(planned)
    os.rename(kept, planned)  # the kept folder moved into the planned path: another inode than planned
    with pytest.raises(DeletionRefused, match="replaced since the deletion was planned"):
        remove_checkpoint(str(planned), write, expected=identity)
    with pytest.raises(DeletionRefused, match="checkpoint ckpt_kept, which stays"):
        remove_checkpoint(str(planned), write, kept=Kept(by_identity={kept_identity: "ckpt_kept"}))
    small_checkpoint(planned / "export", 3)  # a live checkpoint inside: refused before anything is removed
    with pytest.raises(DeletionRefused, match="holds checkpoint ckpt_inner, which stays"):
        remove_checkpoint(str(planned), write, kept=Kept(by_path={str(planned / "export"): "ckpt_inner"}))
    assert (planned / "model.safetensors").is_file() and (planned / "export" / "model.safetensors").is_file()
    remove_checkpoint(str(planned), write, expected=kept_identity)
    assert not planned.exists()
    remove_checkpoint(str(planned), write)  # data already gone is fine


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_gc_skips_a_damaged_item_and_deletes_the_others(managed: Managed) -> None:
    run = managed.out / "iso"
    folders = [small_checkpoint(run / f"step_{n}", n) for n in (1, 2, 3)]
    with managed.server.http(managed.tokens.admin) as admin:
        ids = [registered(admin, f) for f in folders]
        conn = sqlite3.connect(managed.server.data_dir / "ckpt.db")
        with conn:  # an old or damaged entry in the same run: tags that are not JSON
            conn.execute("INSERT INTO checkpoints (id, uri, name, summary, tags, metadata, created_at, updated_at) "
                         "VALUES ('ckpt_damaged_tags', ?, 'step_0', '{}', '[not json', '{}', 0, 0)",
                         (str(run / "step_0"),))
            conn.execute("INSERT INTO checkpoint_runs (checkpoint_id, run, step) VALUES ('ckpt_damaged_tags', "
                         "'iso', 0)")
            conn.execute("INSERT INTO retention_policies (id, name, spec, created_by, created_at) VALUES "
                         "('pol_damaged', 'damaged', '{no', 'x', 0)")  # and a damaged policy
        conn.close()
        assert admin.post("/v1/policies", json={"name": "iso", "run": "iso", "keep_last": 1}).status_code == 201
        report = admin.post("/v1/gc", json={"dry_run": False})
        assert report.status_code == 200, report.text
        assert sorted(p["checkpoint_id"] for p in report.json()["plan"]) == sorted(ids[:2])
        assert not folders[0].exists() and not folders[1].exists() and folders[2].exists()
        policies = admin.get("/v1/policies")  # the damaged one is left out, the others listed
        assert policies.status_code == 200 and "iso" in [p["spec"]["name"] for p in policies.json()]
        assert "damaged" not in [p["spec"]["name"] for p in policies.json()]
    assert any(e.get("event") == "gc.unreadable" and e.get("checkpoint_id") == "ckpt_damaged_tags"
               for e in managed.server.log_events())


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_only_the_owner_or_an_admin_changes_a_managed_object(managed: Managed) -> None:
    server = managed.server
    folder = small_checkpoint(managed.out / "owned" / "step_1", 1)
    with server.http(managed.alice) as alice, server.http(managed.bob) as bob, \
            server.http(managed.tokens.admin) as admin, server.http(managed.tokens.read) as reader:
        checkpoint_id = registered(alice, folder)
        assert alice.get(f"/v1/checkpoints/{checkpoint_id}").json()["owner"] == "alice"
        assert alice.post(f"/v1/checkpoints/{checkpoint_id}/tags", json={"set": {"pin": ""}}).status_code == 200
        assert alice.put("/v1/aliases/owned/prod", json={"checkpoint_id": checkpoint_id}).status_code == 200
        rule = {"name": "owned", "pattern": str(managed.out / "owned" / "step_*"),
                "job": {"kind": "export", "target": str(managed.out / "owned-out" / "{step}")}}
        made = alice.post("/v1/rules", json=rule)
        assert made.status_code == 201, made.text
        attempts = {
            "untag": lambda c: c.post(f"/v1/checkpoints/{checkpoint_id}/tags", json={"remove": ["pin"]}),
            "retag": lambda c: c.post(f"/v1/checkpoints/{checkpoint_id}/tags", json={"set": {"pin": "x"}}),
            "unalias": lambda c: c.delete("/v1/aliases/owned/prod"),
            "pause": lambda c: c.post("/v1/rules/owned/pause"),
            "unrule": lambda c: c.delete("/v1/rules/owned"),
            "unregister": lambda c: c.delete(f"/v1/checkpoints/{checkpoint_id}"),
        }
        for what, attempt in attempts.items():
            refused = attempt(bob)
            assert refused.status_code == 403, (what, refused.text)
            message = refused.json()["error"]["message"]
            assert "alice" in message and "\n" not in message, (what, message)
            assert attempt(reader).status_code == 403, what  # a read token never
        assert alice.get(f"/v1/checkpoints/{checkpoint_id}/tags").json()["tags"] == ["pin"]
        assert alice.get("/v1/aliases/owned/prod").status_code == 200
        assert alice.get("/v1/rules/owned").json()["paused"] is False
        # a new tag key is bob's; the owner (or an admin) changes what they own
        assert bob.post(f"/v1/checkpoints/{checkpoint_id}/tags", json={"set": {"bob": "1"}}).status_code == 200
        assert alice.post(f"/v1/checkpoints/{checkpoint_id}/tags", json={"remove": ["bob"]}).status_code == 403
        assert bob.post(f"/v1/checkpoints/{checkpoint_id}/tags", json={"remove": ["bob"]}).status_code == 200
        assert alice.post("/v1/rules/owned/pause").json()["paused"] is True
        assert admin.post("/v1/rules/owned/resume").json()["paused"] is False
        assert admin.delete("/v1/aliases/owned/prod").status_code == 204
        assert alice.delete("/v1/rules/owned").status_code == 200
        assert alice.delete(f"/v1/checkpoints/{checkpoint_id}").status_code == 200
        # a job's output belongs to the job's submitter
        export = alice.post("/v1/jobs", json=job_spec("export", folder, managed.out / "owned-export"))
        assert export.status_code == 202, export.text
    done = server.wait_job(export.json()["id"], ("succeeded", "failed"), token=managed.alice)
    assert done["state"] == "succeeded", done["error"]
    with server.http(managed.alice) as alice, server.http(managed.bob) as bob:
        output = alice.get(f"/v1/checkpoints/{done['result']['checkpoint_id']}").json()
        assert output["owner"] == "alice"
        assert bob.delete(f"/v1/checkpoints/{output['id']}").status_code == 403
        assert alice.delete(f"/v1/checkpoints/{output['id']}").status_code == 200
    # rows from before owners were recorded have none: admins only
    conn = sqlite3.connect(server.data_dir / "ckpt.db")
    with conn:
        conn.execute("INSERT INTO checkpoints (id, uri, name, summary, tags, metadata, created_at, updated_at) "
                     "VALUES ('ckpt_ownerless', '/old/ckpt', 'old', '{}', '[\"pin\"]', '{}', 0, 0)")
    conn.close()
    with server.http(managed.alice) as alice, server.http(managed.tokens.admin) as admin:
        refused = alice.post("/v1/checkpoints/ckpt_ownerless/tags", json={"remove": ["pin"]})
        assert refused.status_code == 403 and "an admin" in refused.json()["error"]["message"]
        assert alice.delete("/v1/checkpoints/ckpt_ownerless").status_code == 403
        assert admin.delete("/v1/checkpoints/ckpt_ownerless").status_code == 200


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_a_damaged_row_never_breaks_a_listing(managed: Managed) -> None:
    folder = small_checkpoint(managed.out / "listing" / "good", 1)
    with managed.server.http(managed.tokens.admin) as admin:
        good = registered(admin, folder)
        conn = sqlite3.connect(managed.server.data_dir / "ckpt.db")
        with conn:  # rows an older version or a damaged disk left: a lone surrogate, bad JSON, bytes not UTF-8
            for row_id, summary in (("ckpt_bad_surrogate", '{"keys": ["\\ud800"]}'), ("ckpt_bad_json", "{no")):
                conn.execute("INSERT INTO checkpoints (id, uri, name, summary, tags, metadata, created_at, "
                             "updated_at) VALUES (?, ?, 'bad', ?, '[]', '{}', 0, 0)", (row_id, f"/x/{row_id}", summary))
            conn.execute("INSERT INTO checkpoints (id, uri, name, summary, tags, metadata, created_at, updated_at) "
                         "VALUES ('ckpt_bad_bytes', '/x/bytes', CAST(X'66FF' AS TEXT), '{}', '[]', '{}', 0, 0)")
            spec = json.dumps(job_spec("inspect", "/x/\ud800"))
            for job_id, text in (("job_bad_surrogate", spec), ("job_bad_json", "{no")):
                conn.execute("INSERT INTO jobs (id, kind, state, spec, max_attempts, submitted_by, created_at, "
                             "updated_at) VALUES (?, 'inspect', 'failed', ?, 1, 'x', 0, 0)", (job_id, text))
        conn.close()
        checkpoints = admin.get("/v1/checkpoints", params={"limit": 200})
        assert checkpoints.status_code == 200, checkpoints.text
        assert good in {c["id"] for c in checkpoints.json()["items"]}
        bad = {"ckpt_bad_bytes", "ckpt_bad_json", "ckpt_bad_surrogate"}  # (and what other tests here damaged)
        assert bad <= set(checkpoints.json()["unreadable"]) and not bad & {c["id"] for c in checkpoints.json()["items"]}
        jobs = admin.get("/v1/jobs", params={"limit": 200})
        assert jobs.status_code == 200, jobs.text
        assert sorted(jobs.json()["unreadable"]) == ["job_bad_json", "job_bad_surrogate"]
        one = admin.get("/v1/checkpoints/ckpt_bad_surrogate")
        assert one.status_code == 409 and "cannot be read" in one.json()["error"]["message"]


def test_owners_and_damaged_rows_on_both_stores(tmp_path: Path, store_location: str) -> None:
    """The same SQL on SQLite and PostgreSQL: owners of checkpoints, tags and aliases (schema v4), and a
    listing that names a damaged row instead of failing."""
    from ckpt_service.auth import Principal
    from ckpt_service.catalog import Catalog
    from ckpt_service.registry import Registry
    from ckpt_service.service_errors import Forbidden

    store = JobStore(store_location if store_location.startswith("postgresql://") else tmp_path / "ckpt.db")
    registry = Registry(store)
    catalog = Catalog(store, registry, "{run}/step_{step}")
    alice, bob = Principal("alice", "write"), Principal("bob", "write")
    with store.transaction() as conn:
        first = registry.add(conn, uri="/d/r/step_1", name="step_1", summary={}, tags=["pin"], metadata={},
                             via={"how": "registered"}, owner="alice")
        catalog.place(conn, first, "r", 1, "test")
    assert registry.get(first).owner == "alice"
    with pytest.raises(Forbidden, match=r"tag pin of checkpoint \w+ belongs to 'alice'"):
        catalog.set_tags(first, {}, ["pin"], bob)
    assert catalog.set_tags(first, {"bob": "1"}, [], bob) == ["pin", "bob=1"]
    assert catalog.set_tags(first, {}, ["pin"], alice) == ["bob=1"]
    catalog.set_alias("r", "prod", first, "alice", alice)
    with pytest.raises(Forbidden, match="alias prod@r belongs to 'alice'"):
        catalog.remove_alias("r", "prod", "bob", bob)
    with pytest.raises(Forbidden, match="alias latest@r has no owner; only an admin"):
        catalog.remove_alias("r", "latest", "bob", bob)
    catalog.remove_alias("r", "latest", "admin", Principal("root", "admin"))
    not_text = "summary: holds text that is not valid UTF-8"
    with pytest.raises(InvalidRequest, match=not_text), store.transaction() as conn:
        registry.add(conn, uri="/d/r/step_2", name="step_2", summary={"keys": ["\ud800"]}, tags=[], metadata={},
                     via={"how": "registered"})
    with store.transaction() as conn:
        conn.execute("INSERT INTO checkpoints (id, uri, name, summary, tags, metadata, created_at, updated_at) "
                     "VALUES ('ckpt_0damaged', '/d/x', 'x', '{no', '[]', '{}', 0, 0)")
    page, _, unreadable = registry.list(tag="bob=1")
    assert [v.id for v in page] == [first] and unreadable == []
    page, _, unreadable = registry.list()
    assert [v.id for v in page] == [first] and unreadable == ["ckpt_0damaged"]
    assert registry.find_uri("/d/r/step_2") is None  # nothing that failed validation was stored
    store.close()


@pytest.mark.slow  # a real server or a ckptctl subprocess
def test_a_name_that_is_not_text_is_refused_before_it_is_stored(managed: Managed) -> None:
    folder = managed.out / "not-text" / "ckpt"
    folder.mkdir(parents=True)
    header = json.dumps({"\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()  # \ud800 escape
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with managed.server.http(managed.tokens.admin) as admin:
        refused = admin.post("/v1/checkpoints", json={"uri": str(folder)})
        assert 400 <= refused.status_code < 500, refused.text
        assert "\n" not in refused.json()["error"]["message"]
        listed = admin.get("/v1/checkpoints", params={"limit": 200})
        assert listed.status_code == 200, listed.text
        assert str(folder) not in {c["uri"] for c in listed.json()["items"]}
        conn = sqlite3.connect(managed.server.data_dir / "ckpt.db")
        try:
            assert conn.execute("SELECT COUNT(*) FROM checkpoints WHERE uri = ?", (str(folder),)).fetchone()[0] == 0
        finally:
            conn.close()
