"""Checkpoint management against a real `ckptctl serve`: a fake training loop writes DCP checkpoints one by one
(one half-written first), a rule exports each new step exactly once, `latest` follows the run, and GC with
"keep last 2 + pinned" deletes exactly the expected folders after a dry run that listed the same plan."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import ckptctl
from tests.service_harness import Server, make_server, wait_for

pytestmark = pytest.mark.slow  # real servers: the full suite (CI), not the edit loop


def dcp_checkpoint(staging: Path, seed: int) -> Path:
    """A small real DCP checkpoint written by torch, in a staging folder."""
    torch.manual_seed(seed)
    state = {"layer.weight": torch.randn(64, 32), "layer.bias": torch.randn(64), "step": torch.tensor(seed)}
    folder = staging / f"ckpt_{seed}"
    dcp.save(state, checkpoint_id=str(folder))
    return folder


def land(staging: Path, dest: Path, seed: int, truncate: bool = False) -> None:
    """Copy a checkpoint into the run folder; with `truncate`, the data file stops halfway (a writer still busy)."""
    src = dcp_checkpoint(staging, seed)
    tmp = dest.parent / f".{dest.name}.copying"
    shutil.copytree(src, tmp)
    if truncate:
        data = next(tmp.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    os.rename(tmp, dest)


def complete_again(staging: Path, dest: Path, seed: int) -> None:
    for src in dcp_checkpoint(staging, seed).glob("*.distcp"):
        shutil.copyfile(src, dest / src.name)


def cli(server: Server, *args: str, check: bool = True) -> object:
    proc = ckptctl(*args, "--server", server.url, check=check)
    return proc if not check else (json.loads(proc.stdout) if "--json" in args else proc.stdout)


@pytest.fixture
def env(tmp_path: Path):
    runs, exports, readonly = tmp_path / "runs", tmp_path / "exports", tmp_path / "readonly"
    for p in (runs, exports, readonly):
        p.mkdir()
    server = make_server(tmp_path / "data", read_roots=[runs, exports, readonly], write_roots=[runs, exports],
                         workers=2, extra_env={"CKPT_DISCOVER_SECONDS": "0.2"}).start()
    try:
        yield server, runs, exports, readonly, tmp_path / "staging"
    finally:
        server.stop()


def triggers(server: Server, rule: str) -> dict[str, dict]:
    with server.http() as http:
        return {Path(t["uri"]).name: t for t in http.get(f"/v1/rules/{rule}/triggers").json()}


def wait_done(server: Server, rule: str, step: str) -> dict[str, dict]:
    def done() -> dict[str, dict] | None:
        found = triggers(server, rule)
        state = found.get(step, {}).get("state")
        assert state not in ("failed", "job_failed"), found[step]
        return found if state == "done" else None

    return wait_for(done, 60, f"the rule to export {step}", interval=0.2)


def test_rule_exports_each_step_once_and_gc_keeps_last_two_and_pinned(env) -> None:
    server, runs, exports, readonly, staging = env
    run = runs / "run-a"
    run.mkdir()
    cli(server, "rules", "add", "export-all", f"{runs}/*/step_*", "--kind", "export",
        "--target", f"{exports}/{{run}}/{{step}}", "--option", "dtype=bfloat16")

    land(staging, run / "step_1", 1)
    wait_done(server, "export-all", "step_1")
    land(staging, run / "step_2", 2, truncate=True)  # half-written: .metadata there, its data file short
    land(staging, run / "step_3", 3)
    seen = wait_done(server, "export-all", "step_3")
    assert "step_2" not in seen
    with server.client() as client:
        assert all(c["uri"] != str(run / "step_2") for c in client.checkpoints()["items"])
    refused = cli(server, "notify", str(run / "step_2"), check=False)
    assert refused.returncode == 2 and "not a complete checkpoint" in refused.stderr and "step_2" in refused.stderr

    complete_again(staging, run / "step_2", 2)
    wait_done(server, "export-all", "step_2")
    land(staging, run / "step_4", 4)
    seen = wait_done(server, "export-all", "step_4")
    assert {Path(t["uri"]).name: t for t in cli(server, "rules", "triggers", "export-all", "--json")} == seen
    assert sorted(seen) == ["step_1", "step_2", "step_3", "step_4"]
    assert {t["state"] for t in seen.values()} == {"done"}

    again = cli(server, "notify", str(run / "step_4"), "--json")  # a push for a step seen already: no new job
    assert [t["job_id"] for t in again["triggers"]] == [seen["step_4"]["job_id"]]
    with server.client() as client:
        jobs = client.jobs(kind="export")["items"]
    assert sorted(j["spec"]["source"] for j in jobs) == [str(run / f"step_{n}") for n in (1, 2, 3, 4)]
    assert {j["state"] for j in jobs} == {"succeeded"} and {j["submitted_by"] for j in jobs} == {"rule:export-all"}
    assert sorted(p.name for p in (exports / "run-a").iterdir()) == ["1", "2", "3", "4"]

    latest = cli(server, "runs", "show", "run-a", "--latest", "--json")
    assert (latest["step"], latest["checkpoint"]["uri"], latest["aliases"]) == (4, str(run / "step_4"),
                                                                                ["latest@run-a"])
    history = cli(server, "aliases", "--history", "latest@run-a", "--json")
    by_id = {m["checkpoint"]["id"]: m["step"] for m in cli(server, "runs", "show", "run-a", "--json")
             if m["rule_id"] is None}
    assert [by_id[h["checkpoint_id"]] for h in history] == [1, 3, 4]  # step 2 completed after 3: no move back
    export_4 = cli(server, "checkpoints", "show", seen["step_4"]["detail"], "--json")
    assert export_4["uri"] == str(exports / "run-a" / "4")
    lineage = cli(server, "checkpoints", "lineage", export_4["id"], "--json")
    assert [e["checkpoint"]["uri"] for e in lineage["ancestors"]] == [str(run / "step_4")]
    by_alias = cli(server, "submit", "inspect", "alias:run-a/latest", "--json")  # resolved when submitted
    assert by_alias["spec"]["source"] == str(run / "step_4")
    rule_id = cli(server, "rules", "list", "--json")[0]["id"]
    with server.http() as http:
        managed = http.get(f"/v1/checkpoints/{export_4['id']}/managed").json()
    assert (managed["run"], managed["step"], managed["rule_id"]) == ("run-a", 4, rule_id)

    # pin step 1, register a step 0 that lies outside the write roots, keep the last 2 of run-a
    cli(server, "checkpoints", "tag", "latest@run-a", "owner=alice")
    step_1 = next(i for i, s in by_id.items() if s == 1)
    assert cli(server, "checkpoints", "tag", step_1, "pin", "--json")["tags"] == ["pin"]
    assert "best@run-a -> " + step_1 in cli(server, "checkpoints", "alias", step_1, "best")
    assert cli(server, "checkpoints", "show", "best@run-a", "--json")["id"] == step_1
    assert "run run-a  step 1  aliases: best@run-a" in cli(server, "checkpoints", "show", "best@run-a")
    assert [(a["name"], a["checkpoint_id"]) for a in cli(server, "aliases", "--run", "run-a", "--json")] == [
        ("best", step_1), ("latest", latest["checkpoint"]["id"])]
    missing = cli(server, "checkpoints", "show", "nope@run-a", check=False)
    assert missing.returncode == 2 and "no alias nope@run-a" in missing.stderr
    shutil.copytree(dcp_checkpoint(staging, 0), readonly / "run-a" / "step_0")
    with server.client() as client:
        client.register(str(readonly / "run-a" / "step_0"))
    cli(server, "policies", "add", "keep2", "--run", "run-a", "--keep-last", "2")

    expected = sorted([str(run / "step_2"), str(exports / "run-a" / "1"), str(exports / "run-a" / "2")])
    before = sorted(str(p) for p in tmp_tree(runs, exports, readonly))
    dry = cli(server, "gc", "--dry-run", "--json")
    assert sorted(p["uri"] for p in dry["plan"]) == expected
    assert {p["policy"] for p in dry["plan"]} == {"keep2"}
    assert sorted(str(p) for p in tmp_tree(runs, exports, readonly)) == before  # a dry run deletes nothing

    done = cli(server, "gc", "--json")
    assert [(p["uri"], p["bytes"]) for p in done["plan"]] == [(p["uri"], p["bytes"]) for p in dry["plan"]]
    assert len(done["deleted"]) == 3 and done["failed"] == []
    gone = sorted(set(before) - {str(p) for p in tmp_tree(runs, exports, readonly)})
    assert [g for g in gone if g in expected] == expected and all(any(g.startswith(e) for e in expected) for g in gone)
    assert (readonly / "run-a" / "step_0" / ".metadata").exists() and (run / "step_1").exists()
    assert sorted(p.name for p in (exports / "run-a").iterdir()) == ["3", "4"]

    with server.http() as http:
        log = http.get("/v1/deletions").json()
    assert sorted(d["uri"] for d in log) == expected
    assert {(d["state"], d["policy"], d["requested_by"]) for d in log} == {("done", "keep2", "anonymous")}
    assert sum(d["bytes"] for d in log) == done["bytes"] > 0
    assert cli(server, "gc", "--dry-run", "--json")["plan"] == []  # re-running finds nothing more
    listed = {c["uri"] for c in cli(server, "checkpoints", "list", "--json")["items"]}
    assert listed.isdisjoint(expected) and str(run / "step_1") in listed
    assert [m["step"] for m in cli(server, "runs", "show", "run-a", "--json") if m["rule_id"] is None] == [0, 1, 3, 4]


def tmp_tree(*tops: Path) -> list[Path]:
    return [p for top in tops for p in top.rglob("*")]


def torch_step(folder: Path, step: int, truncate: bool = False) -> None:
    """A `torch.save` checkpoint folder; with `truncate`, the archive is cut short (its writer still busy)."""
    folder.mkdir(parents=True)
    torch.manual_seed(step)
    torch.save({"w": torch.randn(32, 16), "b": torch.randn(32)}, folder / "model.pt")
    if truncate:
        data = (folder / "model.pt").read_bytes()
        (folder / "model.pt").write_bytes(data[: len(data) - 64])


def test_notify_latest_only_pause_and_scopes(tmp_path: Path) -> None:
    from tests.service_harness import Tokens

    runs, exports = tmp_path / "runs", tmp_path / "exports"
    runs.mkdir(), exports.mkdir()
    tokens = Tokens.make()
    server = make_server(tmp_path / "data", read_roots=[runs, exports], write_roots=[runs, exports], workers=1,
                         tokens=tokens.entries, extra_env={"CKPT_DISCOVER_SECONDS": "0"}).start()  # pushes only
    try:
        with server.http(tokens.write) as http, server.http(tokens.read) as reader:
            rule = {"name": "newest", "pattern": f"{runs}/*/step_*", "latest_only": True,
                    "job": {"kind": "convert", "target": f"{exports}/{{run}}-{{step}}",
                            "options": {"to": "safetensors"}}}
            assert reader.post("/v1/rules", json=rule).status_code == 403
            assert http.post("/v1/rules", json=rule).status_code == 201
            outside = http.post("/v1/rules", json={**rule, "name": "o", "pattern": f"{tmp_path}/elsewhere/*"})
            assert outside.status_code == 403 and outside.json()["error"]["type"] == "outside_storage_roots"

            torch_step(runs / "r" / "step_1", 1, truncate=True)
            half = http.post("/v1/notify", json={"uri": str(runs / "r" / "step_1")})
            assert half.status_code == 409 and "model.pt" in half.json()["error"]["message"]
            (runs / "r" / "step_1" / "model.pt").unlink()
            torch.save({"w": torch.randn(32, 16), "b": torch.randn(32)}, runs / "r" / "step_1" / "model.pt")
            first = http.post("/v1/notify", json={"uri": str(runs / "r" / "step_1")}).json()
            assert (first["run"], first["step"], [t["state"] for t in first["triggers"]]) == ("r", 1, ["submitted"])

            torch_step(runs / "r" / "step_3", 3)
            torch_step(runs / "r" / "step_2", 2)
            third = http.post("/v1/notify", json={"uri": str(runs / "r" / "step_3")}).json()
            second = http.post("/v1/notify", json={"uri": str(runs / "r" / "step_2")}).json()
            assert [t["state"] for t in third["triggers"]] == ["submitted"]
            assert [t["state"] for t in second["triggers"]] == ["superseded"]  # step 3 came first

            assert http.post("/v1/rules/newest/pause").json()["paused"] is True
            torch_step(runs / "r" / "step_4", 4)
            paused = http.post("/v1/notify", json={"uri": str(runs / "r" / "step_4")}).json()
            assert (paused["step"], paused["triggers"]) == (4, [])  # registered, latest moved, no job
            assert http.get("/v1/runs/r/latest").json()["step"] == 4

            for job_id in (first["triggers"][0]["job_id"], third["triggers"][0]["job_id"]):
                assert server.wait_job(job_id, ("succeeded", "failed"), token=tokens.read)["state"] == "succeeded"
            assert sorted(p.name for p in exports.iterdir()) == ["r-1", "r-3"]

            assert http.post("/v1/gc", json={"dry_run": False}).status_code == 403  # deleting data takes admin
            assert http.post("/v1/gc", json={"dry_run": True}).json()["plan"] == []
            policy = {"name": "p", "run": "r", "keep_last": 1}
            assert http.post("/v1/policies", json=policy).status_code == 403
    finally:
        server.stop()
