"""A scheduled scrub (a rule with `every`) and a checkpoint's integrity status (GET /v1/checkpoints/{id}/integrity):
a real conversion's output carries a certificate whose cover the registry records; the rule scrubs it once per
period (not again within it, whoever looks), and after a flipped bit the next period's scrub fails, tags the
output `damaged` and the status names the file and range."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from api.app import create_app
from ckpt_service.executor import run_job
from ckpt_service.settings import Settings

from .service_harness import run_here

DAY = 86400.0


@pytest.fixture()
def client(tmp_path: Path, store_location: str) -> Iterator[TestClient]:
    """The app on a SQLite store and on a real PostgreSQL one (the rule's queries in both spellings)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    database = store_location if store_location.startswith("postgresql") else None
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path / "out")],
                        database_url=database)
    settings.prepare()
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def scrub_jobs(client: TestClient) -> list[dict[str, Any]]:
    return list(client.get("/v1/jobs", params={"kind": "scrub"}).json()["items"])


def look(client: TestClient) -> None:
    """One pass of the rules now (the scheduler's pass may have fired already: the outcome is the same)."""
    rules = client.app.state.rules  # type: ignore[attr-defined]
    rules._periodic_at.clear()
    rules.scan(look=False)


def run_queued(client: TestClient) -> None:
    store = client.app.state.service.store  # type: ignore[attr-defined]
    while (claimed := store.claim("test-worker", 60.0)) is not None:
        assert run_job(store, claimed.id, claimed.attempt) == 0


def test_rules_refuse_a_period_on_writing_kinds_and_a_target_on_a_scrub(client: TestClient, tmp_path: Path) -> None:
    base = {"name": "r", "pattern": f"{tmp_path}/out/*"}
    cases = [({"job": {"kind": "export", "target": f"{tmp_path}/out/x/{{name}}"}, "every": "24h"},
              "every: only scan and scrub jobs repeat"),
             ({"job": {"kind": "scrub", "target": f"{tmp_path}/out/x"}}, "a scrub job writes nothing"),
             ({"job": {"kind": "export"}}, "a export job needs a target"),
             ({"job": {"kind": "scrub"}, "every": "soon"}, "write seconds or a duration")]
    for body, words in cases:
        refused = client.post("/v1/rules", json={**base, **body})
        assert refused.status_code == 422 and words in refused.text, refused.text


def test_a_scheduled_scrub_runs_once_a_period_and_marks_damage(client: TestClient, tmp_path: Path) -> None:
    source = tmp_path / "src" / "model.safetensors"
    save_file({"a.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b.bias": torch.ones(3)}, str(source))
    out = tmp_path / "out" / "step1"
    made = run_here(client, {"kind": "convert", "source": str(source), "target": str(out)})
    assert made["state"] == "succeeded", made
    output = made["result"]["checkpoint_id"]
    status = client.get(f"/v1/checkpoints/{output}/integrity").json()
    assert status == {"checkpoint_id": output, "uri": str(out), "damaged": False, "last_scrub": None,
                      "certificate": {"tensors": 2, "files": 1, "source_files": 1, "stats": False},
                      "baseline": None}
    source_id = next(c["id"] for c in client.get("/v1/checkpoints").json()["items"] if c["uri"] == str(source))
    assert client.get(f"/v1/checkpoints/{source_id}/integrity").json()["certificate"] is None

    rule = client.post("/v1/rules", json={"name": "nightly-scrub", "pattern": f"{tmp_path}/out/*",
                                          "job": {"kind": "scrub"}, "every": "24h"})
    assert rule.status_code == 201, rule.text
    assert rule.json()["spec"]["every"] == DAY and rule.json()["spec"]["job"]["target"] is None
    look(client)
    look(client)
    jobs = scrub_jobs(client)
    assert [(j["spec"]["source"], j["submitted_by"]) for j in jobs] == [(str(out), "rule:nightly-scrub")]
    run_queued(client)
    status = client.get(f"/v1/checkpoints/{output}/integrity").json()
    assert status["last_scrub"]["job_id"] == jobs[0]["id"] and status["last_scrub"]["state"] == "succeeded"
    assert status["last_scrub"]["summary"] == f"{out} matches its certificate (1 files, 2 tensors)"
    assert status["damaged"] is False
    look(client)  # within the period: nothing more
    assert len(scrub_jobs(client)) == 1
    triggers = client.get(f"/v1/rules/{rule.json()['id']}/triggers").json()
    assert [(t["uri"], t["state"]) for t in triggers] == [(str(out), "done")]

    data = out / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # one bit of the last tensor value
    data.write_bytes(bytes(raw))
    store = client.app.state.service.store  # type: ignore[attr-defined]
    with store.transaction() as conn:  # a day and an hour later
        conn.execute("UPDATE jobs SET created_at = created_at - ?, finished_at = finished_at - ? WHERE kind = 'scrub'",
                     (DAY + 3600, DAY + 3600))
        conn.execute("UPDATE rule_triggers SET claimed_at = claimed_at - ?", (DAY + 3600,))
    look(client)
    look(client)
    jobs = scrub_jobs(client)
    assert len(jobs) == 2 and jobs[0]["state"] == "queued"
    run_queued(client)
    status = client.get(f"/v1/checkpoints/{output}/integrity").json()
    assert status["damaged"] is True and status["last_scrub"]["job_id"] == jobs[0]["id"]
    assert status["last_scrub"]["state"] == "failed"
    assert status["last_scrub"]["summary"] == f"{out}: 2 mismatches with its certificate (1 files, 2 tensors checked)"
    assert status["last_scrub"]["damaged"] == [
        f"{data}: bytes 0-436 differ from the manifest's CRC-32",
        f"{data} bytes 424-436 (output tensor b.bias) differ from the certificate"]
    assert "damaged" in client.get(f"/v1/checkpoints/{output}").json()["tags"]
    triggers = client.get(f"/v1/rules/{rule.json()['id']}/triggers").json()
    assert [(t["uri"], t["state"], t["job_id"]) for t in triggers] == [(str(out), "job_failed", jobs[0]["id"])]
