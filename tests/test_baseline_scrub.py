"""Scrub of checkpoints we did not write (no manifest): the first scrub job records a baseline in the registry
(`ckpt_service.baselines`: each file's size, mtime, CRC-32 and block CRC-32s), later ones compare with it.

Fast tests: `converters.baseline` on a torch file torch wrote, and the offline `ckptctl scrub` refusal. Slow tests:
real FSDP2 DCP steps at 2 gloo ranks (tests/stats_job.py) registered with the service, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from ckpt_service.settings import Settings
from converters.baseline import compare_baseline, record_baseline, stamp
from tests.ranks import run_tool

from .conftest import ckptctl
from .service_harness import run_here

DAY = 86400.0


def flip(path: Path, offset: int) -> None:
    """Flip one bit at `offset` and put the modification time back: bit rot, which no writer announces."""
    info = path.stat()
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def test_a_baseline_names_a_flipped_bit_and_a_rewrite(tmp_path: Path) -> None:
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.arange(5000, dtype=torch.float32), "b": torch.ones(7)}, pt)
    baseline = record_baseline(str(pt))
    size = pt.stat().st_size
    assert list(baseline["files"]) == ["model.pt"] and baseline["files"]["model.pt"]["bytes"] == size
    assert compare_baseline(str(pt), baseline, 0.0).damaged == []
    flip(pt, size // 2)
    report = compare_baseline(str(pt), baseline, 0.0)
    assert report.damaged == [f"{pt}: bytes 0-{size} differ from the baseline's CRC-32 of 1970-01-01T00:00:00Z"]
    assert report.summary() == f"{pt}: 1 mismatches with its baseline of 1970-01-01T00:00:00Z (1 files checked)"
    flip(pt, size // 2)  # back as it was
    assert compare_baseline(str(pt), baseline, 0.0).ok
    torch.save({"w": torch.zeros(3)}, pt)  # rewritten: a new size and modification time
    assert compare_baseline(str(pt), baseline, 0.0).damaged == [
        f"{pt}: changed since the baseline of 1970-01-01T00:00:00Z ({size} bytes then, {pt.stat().st_size} now, "
        "modified since): rewritten after it was recorded; a checkpoint should not change, so this counts as damage",
        f"{pt}: bytes 0-{size} differ from the baseline's CRC-32 of 1970-01-01T00:00:00Z"]


def test_offline_scrub_without_a_manifest_says_how_to_get_checksums(tmp_path: Path) -> None:
    folder = tmp_path / "step"
    folder.mkdir()
    torch.save({"w": torch.ones(3)}, folder / "model.pt")
    proc = ckptctl("scrub", str(folder), check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: {folder}: no recorded checksums (no ckpt-manifest.json, as with any checkpoint a trainer wrote); "
        f"submit a scrub job to the service (ckptctl submit scrub {folder}) to record a baseline there, which "
        "later scrubs compare with"]


# ---- real FSDP2 steps registered with the service -------------------------------------------------------------------


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2-steps")
    run_tool("stats_job", out)
    return out


@pytest.fixture()
def client(tmp_path: Path, store_location: str, steps: Path) -> Iterator[TestClient]:
    """The app on a SQLite store and on a real PostgreSQL one, with copies of two DCP steps under runs/."""
    (tmp_path / "runs").mkdir()
    for n in (1, 2):
        shutil.copytree(steps / f"step-{n}", tmp_path / "runs" / f"step-{n}")
    database = store_location if store_location.startswith("postgresql") else None
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path / "out")],
                        database_url=database)
    settings.prepare()
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def register(client: TestClient, uri: Path) -> str:
    made = client.post("/v1/checkpoints", json={"uri": str(uri)})
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def recorded_at(client: TestClient, checkpoint_id: str) -> float:
    store = client.app.state.service.store  # type: ignore[attr-defined]
    return float(store.query("SELECT recorded_at FROM checkpoint_baselines WHERE checkpoint_id = ?",
                             (checkpoint_id,))[0]["recorded_at"])


def integrity(client: TestClient, checkpoint_id: str) -> dict[str, Any]:
    return dict(client.get(f"/v1/checkpoints/{checkpoint_id}/integrity").json())


@pytest.mark.slow
def test_a_scrub_job_records_a_baseline_then_finds_a_flipped_bit(client: TestClient, tmp_path: Path) -> None:
    step = tmp_path / "runs" / "step-1"
    checkpoint = register(client, step)
    assert integrity(client, checkpoint)["baseline"] is None
    files = sorted(p for p in step.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    first = run_here(client, {"kind": "scrub", "source": str(step)})
    assert first["state"] == "succeeded", first
    at = stamp(recorded_at(client, checkpoint))
    assert first["result"]["summary"] == f"{step}: baseline recorded at {at} ({len(files)} files)"
    status = integrity(client, checkpoint)
    assert status["damaged"] is False and status["last_scrub"]["state"] == "succeeded"
    assert status["baseline"].startswith("baseline recorded at ")
    assert status["baseline"].endswith(f" ({len(files)} files, {total} bytes)")
    assert sorted(os.listdir(step)) == sorted(p.name for p in step.iterdir())  # nothing written into the step
    assert not (step / "ckpt-manifest.json").exists()

    again = run_here(client, {"kind": "scrub", "source": str(step)})
    assert again["state"] == "succeeded" and again["result"]["summary"] == f"{step} matches its baseline of {at} " \
        f"({len(files)} files)"

    shard = sorted(step.glob("*.distcp"))[0]
    size = shard.stat().st_size
    flip(shard, size // 2)
    found = run_here(client, {"kind": "scrub", "source": str(step)})
    assert found["state"] == "failed"
    damage = f"{shard}: bytes 0-{size} differ from the baseline's CRC-32 of {at}"
    assert found["result"]["damaged"] == [damage]
    assert found["error"]["message"] == f"{step}: 1 mismatches with its baseline of {at} ({len(files)} files " \
        f"checked): {damage}"
    status = integrity(client, checkpoint)
    assert status["damaged"] is True and status["last_scrub"]["damaged"] == [damage]
    assert "damaged" in client.get(f"/v1/checkpoints/{checkpoint}").json()["tags"]


@pytest.mark.slow
def test_a_scheduled_scrub_over_training_steps_succeeds_on_clean_ones(client: TestClient, tmp_path: Path) -> None:
    ids = {n: register(client, tmp_path / "runs" / f"step-{n}") for n in (1, 2)}
    rule = client.post("/v1/rules", json={"name": "nightly", "pattern": f"{tmp_path}/runs/*",
                                          "job": {"kind": "scrub"}, "every": "24h"})
    assert rule.status_code == 201, rule.text
    rules = client.app.state.rules  # type: ignore[attr-defined]
    store = client.app.state.service.store  # type: ignore[attr-defined]
    from ckpt_service.executor import run_job

    def period() -> list[dict[str, Any]]:
        rules._periodic_at.clear()
        rules.scan(look=False)
        while (claimed := store.claim("test-worker", 60.0)) is not None:
            assert run_job(store, claimed.id, claimed.attempt) == 0
        return list(client.get("/v1/jobs", params={"kind": "scrub"}).json()["items"])

    jobs = period()
    assert sorted((j["spec"]["source"], j["state"]) for j in jobs) == [
        (str(tmp_path / "runs" / f"step-{n}"), "succeeded") for n in (1, 2)]
    assert all(integrity(client, i)["baseline"] is not None for i in ids.values())

    shard = sorted((tmp_path / "runs" / "step-2").glob("*.distcp"))[-1]
    flip(shard, 7)
    with store.transaction() as conn:  # a day and an hour later
        conn.execute("UPDATE jobs SET created_at = created_at - ?, finished_at = finished_at - ? WHERE kind = 'scrub'",
                     (DAY + 3600, DAY + 3600))
        conn.execute("UPDATE rule_triggers SET claimed_at = claimed_at - ?", (DAY + 3600,))
    jobs = period()[:2]
    assert sorted((j["spec"]["source"], j["state"]) for j in jobs) == [
        (str(tmp_path / "runs" / "step-1"), "succeeded"), (str(tmp_path / "runs" / "step-2"), "failed")]
    assert [integrity(client, ids[n])["damaged"] for n in (1, 2)] == [False, True]
