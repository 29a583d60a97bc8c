"""The archive tier in the service: `archive` (checkpoint -> store) and `restore` (archive id in a store -> target)
jobs, the registry's record of each archive (stored bytes against logical bytes, on the checkpoint's page and in its
lineage), and retention's `archive` action (archive, check, then delete: the entry stays, restorable). On SQLite and
PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fastapi.testclient import TestClient

from api.app import create_app
from ckpt_service.auth import create
from ckpt_service.settings import Settings

from .s3server import S3, s3_fixture, s3_server_fixture  # noqa: F401  (fixtures s3 and s3_server)
from .service_harness import make_server, run_here

FROZEN = 64 * 64 * 4  # bytes of the frozen tensor every step shares


def dcp_step(folder: Path, step: int) -> Path:
    """A step of a run as torch.distributed.checkpoint saves it: one frozen tensor, one that moves."""
    torch.manual_seed(0)
    frozen = torch.randn(64, 64)
    torch.manual_seed(step)
    dcp.save({"model": {"frozen": frozen, "moving": torch.randn(32, 32)}}, checkpoint_id=str(folder))
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    state = {"model": {"frozen": torch.empty(64, 64), "moving": torch.empty(32, 32)}}
    dcp.load(state, checkpoint_id=str(folder))
    return state["model"]


@pytest.fixture
def api(tmp_path: Path, store_location: str) -> Iterator[tuple[TestClient, dict[str, str], Path]]:
    token, entry = create("admin", "root")  # type: ignore[arg-type]
    (tmp_path / "frozen").mkdir()
    database = store_location if store_location.startswith("postgresql://") else None
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)],
                        write_roots=[str(tmp_path / "runs"), str(tmp_path / "archive"), str(tmp_path / "back")],
                        tokens=[entry.line()], host="127.0.0.1", database_url=database)
    settings.prepare()
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(settings), headers=headers) as client:
        yield client, headers, tmp_path


def job(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    done = run_here(client, body)
    assert done["state"] == "succeeded", done
    return done


def test_archive_and_restore_jobs_record_the_archive_and_give_the_bytes_back(
        api: tuple[TestClient, dict[str, str], Path]) -> None:
    client, _, root = api
    one, two = dcp_step(root / "runs" / "r" / "step_1", 1), dcp_step(root / "runs" / "r" / "step_2", 2)
    original = files(one)
    first = client.post("/v1/checkpoints", json={"uri": str(one)}).json()
    store = root / "archive" / "store"

    archived = job(client, {"kind": "archive", "source": str(one), "target": str(store)})["result"]
    assert (archived["store"], archived["logical_bytes"]) == (str(store), sum(map(len, original.values())))
    assert archived["checkpoint_id"] == first["id"] and archived["new_bytes"] == archived["logical_bytes"]
    page = client.get(f"/v1/checkpoints/{first['id']}").json()
    assert [(a["store"], a["archive_id"], a["logical_bytes"], a["stored_bytes"], a["archived_by"])
            for a in page["archives"]] == [(str(store), archived["archive_id"], archived["logical_bytes"],
                                            archived["stored_bytes"], "root")]
    assert page["archives"][0]["origin"].startswith("job:") and page["deleted_at"] is None
    listed = {c["id"]: c["archives"] for c in client.get("/v1/checkpoints").json()["items"]}
    assert listed == {first["id"]: page["archives"]}  # the listing carries each checkpoint's archives
    only = client.get("/v1/checkpoints", params={"archived": "true"}).json()["items"]
    assert [c["id"] for c in only] == [first["id"]]

    second = job(client, {"kind": "archive", "source": str(two), "target": str(store)})["result"]
    assert second["dedup_saved"] >= FROZEN  # the frozen tensor was in the store already
    registered = client.get(f"/v1/checkpoints/{second['checkpoint_id']}").json()
    assert registered["uri"] == str(two) and registered["registered_via"]["how"] == "source"

    back = root / "back" / "step_1"
    restored = job(client, {"kind": "restore", "source": str(store), "target": str(back),
                            "options": {"archive_id": archived["archive_id"]}})
    assert files(back) == original
    assert all(torch.equal(a, b) for a, b in zip(loaded(back).values(), loaded(one).values(), strict=True))
    result = restored["result"]
    assert (result["files"], result["restored_from_checkpoint"]) == (len(original), first["id"])
    view = client.get(f"/v1/checkpoints/{result['checkpoint_id']}").json()
    assert (view["uri"], view["made_by_job"]) == (str(back), restored["id"])
    assert view["metadata"]["restored_from"] == f"archive {archived['archive_id']} in {store}"
    lineage = client.get(f"/v1/checkpoints/{view['id']}/lineage").json()
    assert [(e["checkpoint"]["id"], e["job_id"]) for e in lineage["ancestors"]] == [(first["id"], restored["id"])]
    assert lineage["ancestors"][0]["checkpoint"]["archives"][0]["archive_id"] == archived["archive_id"]

    again = client.post("/v1/jobs", json={"kind": "restore", "source": str(store), "target": str(back),
                                          "options": {"archive_id": archived["archive_id"]}})
    assert again.status_code == 409 and "exists" in again.json()["error"]["message"]
    outside = client.post("/v1/jobs", json={"kind": "archive", "source": str(one), "target": str(root / "frozen")})
    assert outside.status_code == 403 and outside.json()["error"]["message"].startswith("target:"), outside.text
    inside = client.post("/v1/jobs", json={"kind": "archive", "source": str(one), "target": str(one / "store")})
    assert inside.status_code == 422 and "overlap" in inside.json()["error"]["message"]
    no_id = client.post("/v1/jobs", json={"kind": "restore", "source": str(store), "target": str(root / "back/x")})
    assert no_id.status_code == 422 and "options.archive_id" in no_id.json()["error"]["message"]


def test_retention_archives_instead_of_deleting_and_keeps_what_it_could_not_archive(
        api: tuple[TestClient, dict[str, str], Path]) -> None:
    client, _, root = api
    steps = [dcp_step(root / "runs" / "r" / f"step_{n}", n) for n in (1, 2, 3)]
    originals = [files(s) for s in steps]
    ids = [client.post("/v1/checkpoints", json={"uri": str(s)}).json()["id"] for s in steps]
    (root / "archive").mkdir()
    broken = root / "archive" / "not-a-folder"
    broken.write_bytes(b"a file where the store should be")

    policy = {"name": "arch", "run": "r", "keep_last": 1, "action": "archive", "store": str(broken)}
    assert client.post("/v1/policies", json=policy).status_code == 201
    dry = client.post("/v1/gc", json={"dry_run": True}).json()
    plan = dry["plan"]
    assert [(p["checkpoint_id"], p["action"], p["store"]) for p in plan] == [(i, "archive", str(broken))
                                                                             for i in ids[:2]]
    logical = sum(len(b) for original in originals[:2] for b in original.values())
    assert (dry["bytes"], dry["archived_bytes"], dry["archive_stored_bytes"]) == (logical, logical, 0)
    kept = client.post("/v1/gc", json={"dry_run": False}).json()
    assert (kept["archived"], kept["not_archived"], kept["deleted"]) == ([], ids[:2], [])
    assert (kept["bytes"], kept["archived_bytes"], kept["archive_stored_bytes"]) == (0, 0, 0)  # nothing freed
    assert [files(s) for s in steps] == originals  # nothing deleted
    assert client.delete("/v1/policies/arch").status_code == 200

    store = root / "archive" / "store"
    assert client.post("/v1/policies", json={**policy, "store": str(store)}).status_code == 201
    report = client.post("/v1/gc", json={"dry_run": False}).json()
    assert (report["archived"], report["not_archived"], len(report["deleted"])) == (ids[:2], [], 2)
    assert not steps[0].exists() and not steps[1].exists() and files(steps[2]) == originals[2]
    for checkpoint_id, original in zip(ids[:2], originals, strict=False):
        page = client.get(f"/v1/checkpoints/{checkpoint_id}").json()
        assert page["deleted_at"] is not None
        (entry,) = page["archives"]
        assert (entry["store"], entry["origin"], entry["logical_bytes"]) == (
            str(store), "retention:arch", sum(map(len, original.values())))
        assert entry["stored_bytes"] <= entry["logical_bytes"]
    added = [client.get(f"/v1/checkpoints/{i}").json()["archives"][0]["new_stored_bytes"] for i in ids[:2]]
    assert (report["bytes"], report["archived_bytes"], report["archive_stored_bytes"]) == (logical, logical,
                                                                                           sum(added))
    assert 0 < sum(added) < logical  # the second step's shared chunks were stored once
    listed = [(c["id"], c["archives"]) for c in client.get("/v1/checkpoints").json()["items"]]
    assert listed == [(ids[2], [])]  # archived entries are not live checkpoints
    restorable = client.get("/v1/checkpoints", params={"archived": "true"}).json()["items"]
    assert [(c["id"], c["deleted_at"] is not None, [(a["store"], a["origin"]) for a in c["archives"]])
            for c in restorable] == [(i, True, [(str(store), "retention:arch")]) for i in sorted(ids[:2])]

    audit = [(r["action"], r["object"], r["outcome"]) for r in
             reversed(client.get("/v1/audit", params={"limit": 1000}).json()["items"])
             if r["action"] in ("checkpoint.archive", "checkpoint.delete")]
    assert sorted(audit) == sorted([("checkpoint.archive", f"checkpoint:{i}", outcome) for i in ids[:2]
                                    for outcome in ("refused", "done")]
                                   + [("checkpoint.delete", f"checkpoint:{i}", "done") for i in ids[:2]])
    assert [(a[0], a[2]) for a in audit] == [("checkpoint.archive", "refused")] * 2 + [
        ("checkpoint.archive", "done")] * 2 + [("checkpoint.delete", "done")] * 2  # archived, then deleted

    archive_id = client.get(f"/v1/checkpoints/{ids[0]}").json()["archives"][0]["archive_id"]
    alias = client.put("/v1/aliases/r/old", json={"checkpoint_id": ids[0]})
    assert alias.status_code == 422 and alias.json()["error"]["message"] == (
        f"checkpoint {ids[0]} was archived in {store} as {archive_id} and its files deleted; restore it to its own "
        "place (a restore job of that archive id), then set the alias")
    back = root / "back" / "step_1"
    restored = job(client, {"kind": "restore", "source": str(store), "target": str(back),
                            "options": {"archive_id": archive_id}})
    assert files(back) == originals[0]
    assert restored["result"]["restored_from_checkpoint"] == ids[0]

    # restored to its own place, the archived entry is live again (same id, still archived)
    second = client.get(f"/v1/checkpoints/{ids[1]}").json()["archives"][0]
    again = job(client, {"kind": "restore", "source": second["store"], "target": str(steps[1]),
                         "options": {"archive_id": second["archive_id"]}})
    assert (again["result"]["checkpoint_id"], again["result"]["restored_from_checkpoint"]) == (ids[1], ids[1])
    assert files(steps[1]) == originals[1]
    page = client.get(f"/v1/checkpoints/{ids[1]}").json()
    assert page["deleted_at"] is None and page["made_by_job"] == again["id"] and len(page["archives"]) == 1
    assert client.put("/v1/aliases/r/back", json={"checkpoint_id": ids[1]}).status_code == 200  # live again
    listed = [c["id"] for c in client.get("/v1/checkpoints").json()["items"]]
    assert listed == sorted([*ids[1:], restored["result"]["checkpoint_id"]])


def test_a_rule_archives_each_new_step_into_one_store(api: tuple[TestClient, dict[str, str], Path]) -> None:
    from ckpt_service.executor import run_job

    client, _, root = api
    store = root / "archive" / "rules"
    rule = {"name": "keep-all", "pattern": f"{root}/runs/*/step_*", "job": {"kind": "archive", "target": str(store)}}
    assert client.post("/v1/rules", json=rule).status_code == 201
    jobs = client.app.state.service.store
    for n in (1, 2):  # the store exists after the first: the second step is archived into it all the same
        step = dcp_step(root / "runs" / "r" / f"step_{n}", n)
        (trigger,) = client.post("/v1/notify", json={"uri": str(step)}).json()["triggers"]
        assert trigger["state"] == "submitted", trigger
        claimed = jobs.claim("test-worker", 60.0)
        assert claimed is not None and run_job(jobs, claimed.id, claimed.attempt) == 0
        done = client.get(f"/v1/jobs/{trigger['job_id']}").json()
        assert (done["state"], done["kind"], done["submitted_by"]) == ("succeeded", "archive", "rule:keep-all")
        page = client.get(f"/v1/checkpoints/{done['result']['checkpoint_id']}").json()
        assert (page["uri"], [a["archive_id"] for a in page["archives"]]) == (str(step), [done["result"]["archive_id"]])


@pytest.mark.slow  # a real server and S3 server
def test_retention_archives_s3_checkpoints_to_an_s3_store_and_a_job_restores_one(s3: S3, tmp_path: Path) -> None:
    runs, store, back = s3.uri("runs"), s3.uri("archive/store"), s3.uri("back")
    server = make_server(tmp_path / "data", read_roots=[runs, s3.uri("archive"), back],  # type: ignore[list-item]
                         write_roots=[runs, s3.uri("archive"), back], workers=1).start()  # type: ignore[list-item]
    try:
        with server.http() as http:
            ids = []
            for n in (1, 2):
                s3.upload(dcp_step(tmp_path / "staging" / f"step_{n}", n), f"runs/r/step_{n}")
                ids.append(http.post("/v1/checkpoints", json={"uri": f"{runs}/r/step_{n}"}).json()["id"])
            original = s3.files("runs/r/step_1")
            policy = {"name": "arch", "run": "r", "keep_last": 1, "action": "archive", "store": store}
            assert http.post("/v1/policies", json=policy).status_code == 201
            report = http.post("/v1/gc", json={"dry_run": False}).json()
            assert (report["archived"], report["not_archived"], len(report["deleted"])) == ([ids[0]], [], 1)
            assert s3.keys("runs/r/step_1") == [] and s3.keys("runs/r/step_2") == [".metadata", "__0_0.distcp"]
            (entry,) = http.get(f"/v1/checkpoints/{ids[0]}").json()["archives"]
            assert (entry["store"], entry["logical_bytes"]) == (store, sum(map(len, original.values())))
            job = http.post("/v1/jobs", json={"kind": "restore", "source": store, "target": f"{back}/step_1",
                                              "options": {"archive_id": entry["archive_id"]}}).json()
            done = server.wait_job(job["id"], ("succeeded", "failed"))
            assert done["state"] == "succeeded", done
            assert s3.files("back/step_1") == original
            assert done["result"]["restored_from_checkpoint"] == ids[0]
    finally:
        server.stop()
