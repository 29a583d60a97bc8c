"""The audit log: each change made through the API is one row (who, what, the object before and after), each
refused attempt one row with the line the caller got; `GET /v1/audit` is for admins and filters; nothing in the
API changes the log. The table comes from a schema version of its own, in SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from api.app import create_app
from ckpt_service.audit import AuditLog
from ckpt_service.auth import create
from ckpt_service.settings import Settings
from ckpt_service.store import JobStore


def step(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    save_file({"w": torch.randn(8, 4), "b": torch.randn(8)}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, dict[str, str]], Path]]:
    made = {name: create(scope, name) for name, scope in  # type: ignore[arg-type]
            (("alice", "write"), ("bob", "write"), ("root", "admin"), ("viewer", "read"))}
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)],
                        tokens=[entry.line() for _, entry in made.values()], host="127.0.0.1")
    settings.prepare()
    headers = {name: {"Authorization": f"Bearer {token}"} for name, (token, _) in made.items()}
    with TestClient(create_app(settings)) as client:
        yield client, headers, tmp_path


def rows(client: TestClient, headers: dict[str, str], **filters: Any) -> list[dict[str, Any]]:
    answer = client.get("/v1/audit", params={"limit": 1000, **filters}, headers=headers)
    assert answer.status_code == 200, answer.text
    return list(reversed(answer.json()["items"]))  # oldest first


def test_each_change_and_each_refusal_is_one_row(api: tuple[TestClient, dict[str, dict[str, str]], Path]) -> None:
    client, h, root = api
    one, two = step(root / "runs" / "r" / "step_1", 1), step(root / "runs" / "r" / "step_2", 2)
    started = time.time()
    first = client.post("/v1/checkpoints", json={"uri": str(one), "name": "first"}, headers=h["alice"]).json()
    second = client.post("/v1/checkpoints", json={"uri": str(two), "name": "second"}, headers=h["alice"]).json()
    assert client.post(f"/v1/checkpoints/{first['id']}/tags", json={"set": {"stage": "eval"}},
                       headers=h["alice"]).status_code == 200
    taken = client.post(f"/v1/checkpoints/{first['id']}/tags", json={"set": {"stage": "prod"}}, headers=h["bob"])
    assert taken.status_code == 403
    assert client.put("/v1/aliases/team/best", json={"checkpoint_id": first["id"]}, headers=h["alice"]).status_code \
        == 200
    assert client.put("/v1/aliases/team/best", json={"checkpoint_id": second["id"]},
                      headers=h["alice"]).status_code == 200
    stolen = client.delete("/v1/aliases/team/best", headers=h["bob"])
    assert stolen.status_code == 403
    rule = {"name": "nightly", "pattern": f"{root}/runs/*/step_*",
            "job": {"kind": "convert", "target": f"{root}/exports/{{run}}-{{step}}", "options": {"to": "safetensors"}}}
    made_rule = client.post("/v1/rules", json=rule, headers=h["alice"]).json()
    three = step(root / "runs" / "r" / "step_3", 3)
    notified = client.post("/v1/notify", json={"uri": str(three)}, headers=h["alice"]).json()
    assert notified["triggers"][0]["state"] == "submitted", notified
    assert client.post("/v1/rules/nightly/pause", headers=h["alice"]).json()["paused"] is True
    assert client.delete("/v1/rules/nightly", headers=h["bob"]).status_code == 403
    job = client.post("/v1/jobs", json={"kind": "convert", "source": str(one), "target": str(root / "out"),
                                        "options": {"to": "safetensors"}}, headers=h["alice"]).json()
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=h["alice"]).json()["state"] == "cancelled"
    nobody = client.post("/v1/jobs", json={"kind": "convert", "source": str(one), "target": str(root / "o2")},
                         headers={"Authorization": "Bearer ckpt_not-a-token"})
    assert nobody.status_code == 401
    policy = client.post("/v1/policies", json={"name": "keep", "run": "r", "keep_last": 1}, headers=h["root"]).json()
    assert client.post("/v1/gc", json={"dry_run": True}, headers=h["root"]).status_code == 200  # changes nothing
    assert client.post("/v1/gc", json={"dry_run": False}, headers=h["alice"]).status_code == 403
    assert client.post("/v1/gc", json={"dry_run": False}, headers=h["root"]).status_code == 200
    assert client.delete(f"/v1/policies/{policy['id']}", headers=h["root"]).status_code == 200
    assert client.delete("/v1/aliases/team/best", headers=h["alice"]).status_code == 204
    assert client.delete(f"/v1/checkpoints/{second['id']}", headers=h["alice"]).status_code == 200

    log = rows(client, h["root"])
    rule_job = notified["triggers"][0]["job_id"]
    assert [(r["principal"], r["action"], r["object"], r["outcome"]) for r in log] == [
        ("alice", "checkpoint.register", f"checkpoint:{first['id']}", "done"),
        ("alice", "checkpoint.register", f"checkpoint:{second['id']}", "done"),
        ("alice", "checkpoint.tag", f"checkpoint:{first['id']}", "done"),
        ("bob", "checkpoint.tag", f"checkpoint:{first['id']}", "refused"),
        ("alice", "alias.move", "alias:team/best", "done"),
        ("alice", "alias.move", "alias:team/best", "done"),
        ("bob", "alias.remove", "alias:team/best", "refused"),
        ("alice", "rule.add", f"rule:{made_rule['id']}", "done"),
        ("rule:nightly", "job.submit", f"job:{rule_job}", "done"),  # the job the rule made, then the notify
        ("alice", "checkpoint.notify", f"checkpoint:{notified['checkpoint_id']}", "done"),
        ("alice", "rule.pause", f"rule:{made_rule['id']}", "done"),
        ("bob", "rule.remove", f"rule:{made_rule['id']}", "refused"),
        ("alice", "job.submit", f"job:{job['id']}", "done"),
        ("alice", "job.cancel", f"job:{job['id']}", "done"),
        ("unauthenticated", "job.submit", "job:(new)", "refused"),
        ("root", "policy.add", f"policy:{policy['id']}", "done"),
        ("alice", "gc.run", "gc", "refused"),
        ("root", "checkpoint.delete", f"checkpoint:{first['id']}", "done"),  # keep_last 1; step 2 has the alias
        ("root", "gc.run", "gc", "done"),
        ("root", "policy.remove", f"policy:{policy['id']}", "done"),
        ("alice", "alias.remove", "alias:team/best", "done"),
        ("alice", "checkpoint.unregister", f"checkpoint:{second['id']}", "done"),
    ]
    assert all(started <= r["at"] <= time.time() for r in log)
    assert not one.exists() and two.exists()
    tag, refused_tag = log[2], log[3]
    assert (tag["before"], tag["after"]) == ([], {"checkpoint_id": first["id"], "tags": ["stage=eval"]})
    assert refused_tag["before"] == ["stage=eval"] and refused_tag["after"] is None
    assert refused_tag["detail"] == "HTTP 403: " + taken.json()["error"]["message"]
    moved = log[5]
    assert (moved["before"]["checkpoint"]["id"], moved["after"]["checkpoint"]["id"]) == (first["id"], second["id"])
    assert log[4]["before"] is None
    assert log[6]["detail"] == "HTTP 403: " + stolen.json()["error"]["message"]
    assert (log[8]["after"]["spec"]["source"], log[8]["after"]["submitted_by"]) == (str(three), "rule:nightly")
    assert (log[10]["before"]["paused"], log[10]["after"]["paused"]) == (False, True)
    assert (log[13]["before"]["state"], log[13]["after"]["state"]) == ("queued", "cancelled")
    assert log[14]["detail"] == "HTTP 401: " + nobody.json()["error"]["message"]
    assert log[16]["detail"] == "HTTP 403: token 'alice' has scope write; this needs admin"
    assert log[17]["before"]["uri"] == str(one) and log[17]["after"] == {"state": "done"}
    assert (log[18]["after"]["deleted"], log[18]["after"]["dry_run"]) == ([log[17]["before"]["deletion"]], False)
    assert log[20]["before"]["checkpoint"]["id"] == second["id"] and log[20]["after"] is None  # 204: gone
    assert log[21]["before"]["id"] == second["id"]

    # filters: exact, prefix (`*`), outcome, time, and pages
    assert [r["action"] for r in rows(client, h["root"], principal="bob")] == [
        "checkpoint.tag", "alias.remove", "rule.remove"]
    assert [r["seq"] for r in rows(client, h["root"], action="rule.*")] == [log[i]["seq"] for i in (7, 10, 11)]
    assert [r["seq"] for r in rows(client, h["root"], object="alias:team/best")] == [
        log[i]["seq"] for i in (4, 5, 6, 20)]
    assert len(rows(client, h["root"], outcome="refused")) == 5
    assert rows(client, h["root"], since=log[-1]["at"]) == [log[-1]]
    assert rows(client, h["root"], until=log[0]["at"]) == [log[0]]
    page = client.get("/v1/audit", params={"limit": 10}, headers=h["root"]).json()
    middle = client.get("/v1/audit", params={"limit": 10, "cursor": page["next_cursor"]}, headers=h["root"]).json()
    rest = client.get("/v1/audit", params={"limit": 10, "cursor": middle["next_cursor"]}, headers=h["root"]).json()
    assert [r["seq"] for r in page["items"] + middle["items"] + rest["items"]] == [r["seq"] for r in reversed(log)]
    assert rest["next_cursor"] is None

    # admins only, and no route changes the log
    for who in ("alice", "viewer"):
        refused = client.get("/v1/audit", headers=h[who])
        assert refused.status_code == 403 and "needs admin" in refused.json()["error"]["message"]
    assert client.get("/v1/audit").status_code == 401
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert client.request(method, "/v1/audit", headers=h["root"]).status_code == 405
    assert len(rows(client, h["root"])) == len(log)

    # a submit replayed by its Idempotency-Key changed nothing: only its first request is a row
    keyed = {"kind": "convert", "source": str(two), "target": str(root / "keyed"), "options": {"to": "safetensors"}}
    first_try = client.post("/v1/jobs", json=keyed, headers={**h["alice"], "Idempotency-Key": "k1"})
    retry = client.post("/v1/jobs", json=keyed, headers={**h["alice"], "Idempotency-Key": "k1"})
    assert retry.headers["Idempotent-Replayed"] == "true" and retry.json()["id"] == first_try.json()["id"]
    assert [r["object"] for r in rows(client, h["root"], action="job.submit", principal="alice")] == [
        f"job:{job['id']}", f"job:{first_try.json()['id']}"]


def test_audit_table_in_each_store(store_location: str) -> None:
    log = AuditLog(JobStore(store_location))
    log.record("oidc:alice", "alias.move", "alias:ns/best", before={"id": "a"}, after={"id": "b"})
    log.record("bob", "rule.remove", "rule:r1", outcome="refused", detail="HTTP 403: not yours")
    log.record("bob", "rule.add", "rule:r2", after={"name": "ünïcode"})
    found = log.entries(obj="rule:*")
    assert [(e.principal, e.action, e.object, e.outcome, e.detail, e.after) for e in found.items] == [
        ("bob", "rule.add", "rule:r2", "done", None, {"name": "ünïcode"}),
        ("bob", "rule.remove", "rule:r1", "refused", "HTTP 403: not yours", None)]
    first = log.entries(principal="oidc:*").items
    assert [(e.before, e.after) for e in first] == [({"id": "a"}, {"id": "b"})]
    page = log.entries(limit=2)
    assert [e.object for e in page.items] == ["rule:r2", "rule:r1"] and page.next_cursor is not None
    assert [e.object for e in log.entries(cursor=int(page.next_cursor)).items] == ["alias:ns/best"]


def test_secrets_in_answers_stay_out_of_the_log(api: tuple[TestClient, dict[str, dict[str, str]], Path]) -> None:
    """The dashboard's sign-in handoff (its answer is an access token) and sign-out (its answer holds the ID
    token) are never audited, and a change route the audit table does not know is a row without the answer."""
    from types import SimpleNamespace

    from ckpt_service.auth import Principal
    from ckpt_service.oidc_login import Handoff

    client, h, _ = api
    app: Any = client.app
    handed = Handoff("eyJ.secret.token", 60, Principal("oidc:alice", "write"), "eyJ.id.token")
    app.state.login_flows = SimpleNamespace(take=lambda handoff: handed,
                                            end_session=lambda hint, back: f"https://issuer/end?hint={hint}&to={back}")
    answer = client.post("/v1/session/handoff", json={"handoff": "h1"})
    assert (answer.json()["access_token"], answer.json()["id_token"]) == ("eyJ.secret.token", "eyJ.id.token")
    out = client.post("/v1/session/logout", json={"id_token_hint": "eyJ.id.token"})
    assert out.json() == {"url": "https://issuer/end?hint=eyJ.id.token&to=http://testserver/v1/session/ended"}

    def rotate() -> dict[str, str]:
        return {"new_secret": "s3cr3t"}

    app.router.add_api_route("/v1/rotate", rotate, methods=["POST"])
    assert client.post("/v1/rotate", headers=h["root"]).json() == {"new_secret": "s3cr3t"}
    log = rows(client, h["root"])
    assert [(r["principal"], r["action"], r["object"], r["after"]) for r in log] == [
        ("root", "POST /v1/rotate", "path:/v1/rotate", None)]

