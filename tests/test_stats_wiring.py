"""`ckptctl scan`, `ckptctl diff` and `inspect --stats` (converters.scan / converters.diff as job kinds): the
values they print equal torch's float64 computation on the same tensors, the exit codes say what a pipeline needs
(scan: 1 when a tensor holds NaN or Inf; diff: 1 when the checkpoints differ beyond the tolerances), and the
service runs both as jobs whose results are kept (a diff that finds differences fails, keeping its result, as
verify does)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckptctl import app as cli

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


def weights(step: int) -> dict[str, torch.Tensor]:
    """Two layers of a step: layer 0 moves between steps, layer 1 stays (frozen)."""
    torch.manual_seed(0)
    base = {"layers.0.weight": torch.randn(64, 32), "layers.1.weight": torch.randn(16, 8).to(torch.bfloat16),
            "layers.1.bias": torch.zeros(16)}
    base["layers.0.weight"] += 0.01 * step
    return base


@pytest.fixture()
def steps(tmp_path: Path) -> tuple[Path, Path]:
    one, two = tmp_path / "step1", tmp_path / "step2"
    for folder, step in ((one, 1), (two, 2)):
        folder.mkdir()
        save_file(weights(step), str(folder / "model.safetensors"))
    return one, two


def test_scan_json_equals_torch_and_exits_1_on_nan(steps: tuple[Path, Path], tmp_path: Path) -> None:
    one, _ = steps
    code, output = ckptctl("scan", str(one), "--json", "-q")
    assert code == 0, output
    got = {t["name"]: t for t in json.loads(output)["tensors"]}
    for name, tensor in weights(1).items():
        wide = tensor.to(torch.float64)
        row = got[name]
        assert (row["count"], row["zeros"], row["nan"]) == (tensor.numel(), int((tensor == 0).sum()), 0)
        assert row["min"] == wide.min().item() and row["max"] == wide.max().item()
        assert math.isclose(row["mean"], wide.mean().item(), rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(row["std"], wide.std(correction=0).item(), rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(row["l2"], wide.norm().item(), rel_tol=1e-12)
    bad = tmp_path / "bad"
    bad.mkdir()
    inf = float("inf")
    save_file({"w": torch.tensor([1.0, float("nan"), inf, -inf, 0.0])}, str(bad / "model.safetensors"))
    code, output = ckptctl("scan", str(bad), "--json", "-q")
    row = json.loads(output)["tensors"][0]
    assert code == 1
    assert (row["nan"], row["posinf"], row["neginf"], row["zeros"], row["min"], row["max"]) == (1, 1, 1, 1, 0.0, 1.0)


def test_inspect_stats_prints_the_table(steps: tuple[Path, Path]) -> None:
    code, output = ckptctl("inspect", str(steps[0]), "--stats")
    assert code == 0, output
    row = next(line for line in output.splitlines() if line.startswith("layers.1.bias"))
    assert row.split("\t")[:7] == ["layers.1.bias", "float32", "[16]", "0", "0", "0", "16"]
    code, output = ckptctl("inspect", str(steps[0]), "--stats", "--json")
    assert json.loads(output)["stats"]["finite"] is True


def test_diff_reports_what_moved_and_exits_1(steps: tuple[Path, Path]) -> None:
    one, two = steps
    code, output = ckptctl("diff", str(one), str(two), "--json", "-q")
    assert code == 1, output
    doc = json.loads(output)
    tensors = {t["name"]: t for t in doc["tensors"]}
    a, b = weights(1)["layers.0.weight"].double(), weights(2)["layers.0.weight"].double()
    assert tensors["layers.0.weight"]["max_abs_diff"] == (a - b).abs().max().item()
    assert math.isclose(tensors["layers.0.weight"]["rel_l2"], ((a - b).norm() / b.norm()).item(), rel_tol=1e-12)
    assert tensors["layers.1.weight"]["identical"] is True
    assert doc["differs"] is True and doc["unchanged_layers"] == ["layers.1"]
    assert ckptctl("diff", str(one), str(two), "--atol", "0.02", "-q")[0] == 0  # within the tolerance
    code, output = ckptctl("diff", str(one), str(one), "-q")
    assert code == 0 and "SAME" in output


def test_missing_source_is_one_line(tmp_path: Path) -> None:
    code, output = ckptctl("scan", str(tmp_path / "nothing"))
    assert code == 2 and len(output.strip().splitlines()) == 1 and "nothing" in output


def test_the_service_runs_scan_and_diff_jobs(steps: tuple[Path, Path], tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    from .service_harness import run_here

    one, two = steps
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        page = client.get("/").text
        assert '<option value="scan"' in page or ">scan<" in page
        registered = client.post("/v1/checkpoints", json={"uri": str(one), "name": "step1"})
        assert registered.status_code == 201, registered.text
        missing = client.get("/v1/checkpoints/step1/stats")
        assert missing.status_code == 404 and "submit a scan job" in missing.json()["error"]["message"]
        done = {kind: run_here(client, {"kind": kind, **body})
                for kind, body in (("scan", {"source": str(one)}), ("diff", {"source": str(one), "target": str(two)}))}
        stored = client.get("/v1/checkpoints/step1/stats")
        assert stored.status_code == 200, stored.text
    scan, diff = done["scan"], done["diff"]
    assert stored.json()["job_id"] == scan["id"] and stored.json()["tensors"] == scan["result"]["tensors"]
    assert scan["state"] == "succeeded" and scan["result"]["finite"] is True
    assert {t["name"] for t in scan["result"]["tensors"]} == set(weights(1))
    assert diff["state"] == "failed" and diff["result"]["differs"] is True  # kept, as a verify's report is
    assert diff["result"]["unchanged_layers"] == ["layers.1"]


def nan_step(folder: Path) -> Path:
    """A step whose training diverged: one NaN in one tensor."""
    folder.mkdir(parents=True)
    tensors = weights(1)
    tensors["layers.0.weight"][3, 4] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_require_finite_writes_nothing_from_a_diverged_step(steps: tuple[Path, Path], tmp_path: Path) -> None:
    bad = nan_step(tmp_path / "runs" / "r" / "step_9")
    code, output = ckptctl("export", str(bad), str(tmp_path / "out"), "--require-finite", "-q")
    assert code == 2 and output.strip().splitlines() == [
        f"error: {bad}: NaN or Inf in 1 tensor(s) (layers.0.weight); nothing was written (require_finite)"]
    assert not (tmp_path / "out").exists()
    assert ckptctl("export", str(steps[0]), str(tmp_path / "fine"), "--require-finite", "-q")[0] == 0


def test_a_rule_that_requires_finite_steps_does_not_export_a_diverged_one(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.executor import run_job
    from ckpt_service.settings import Settings

    runs, exports = tmp_path / "runs", tmp_path / "exports"
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(runs)], write_roots=[str(exports)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        rule = {"name": "serve", "pattern": f"{runs}/*/step_*",
                "job": {"kind": "export", "target": f"{exports}/{{run}}-{{step}}", "options": {"require_finite": True}}}
        assert client.post("/v1/rules", json=rule).status_code == 201, client.post("/v1/rules", json=rule).text
        store = client.app.state.service.store  # type: ignore[attr-defined]
        states = {}
        for step, make in ((1, lambda f: f.mkdir(parents=True) or save_file(weights(1), str(f / "model.safetensors"))),
                           (2, nan_step)):
            folder = runs / "r" / f"step_{step}"
            make(folder)
            fired = client.post("/v1/notify", json={"uri": str(folder)}).json()
            assert [t["state"] for t in fired["triggers"]] == ["submitted"], fired
            claimed = store.claim("test-worker", 60.0)
            assert run_job(store, claimed.id, claimed.attempt) == 0
            states[step] = client.get(f"/v1/jobs/{claimed.id}").json()
    assert states[1]["state"] == "succeeded" and (exports / "r-1" / "model.safetensors").exists()
    assert states[2]["state"] == "failed" and "require_finite" in states[2]["error"]["message"]
    assert not (exports / "r-2").exists()


def test_a_guarded_alias_moves_only_to_a_clean_scan(steps: tuple[Path, Path], tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    from .service_harness import run_here

    bad = nan_step(tmp_path / "bad")
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        ids = {name: client.post("/v1/checkpoints", json={"uri": str(path), "name": name}).json()["id"]
               for name, path in (("good", steps[0]), ("bad", bad))}
        unscanned = client.put("/v1/aliases/default/prod", json={"checkpoint_id": ids["good"], "require_finite": True})
        assert unscanned.status_code == 409 and "no statistics yet" in unscanned.json()["error"]["message"]
        for path in (steps[0], bad):
            assert run_here(client, {"kind": "scan", "source": str(path)})["state"] == "succeeded"
        moved = client.put("/v1/aliases/default/prod", json={"checkpoint_id": ids["good"], "require_finite": True})
        assert moved.status_code == 200, moved.text
        blocked = client.put("/v1/aliases/default/prod", json={"checkpoint_id": ids["bad"], "require_finite": True})
        assert blocked.status_code == 409
        assert blocked.json()["error"]["message"].startswith("alias prod@default not moved: scan ")
        assert blocked.json()["error"]["message"].endswith("found NaN or Inf in 1 tensor(s) (layers.0.weight)")
        assert client.get("/v1/aliases/default/prod").json()["checkpoint"]["id"] == ids["good"]


def test_stats_are_the_newest_scan_of_each_step(tmp_path: Path, store_location: str) -> None:
    """GET .../stats and the run's plot points take each URI's newest succeeded scan (looked up per URI, on
    SQLite and PostgreSQL): a step scanned again after it changed shows the second scan."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    from .service_harness import run_here

    run = tmp_path / "runs" / "r"
    for step in (1, 2):
        (run / f"step{step}").mkdir(parents=True)
        save_file(weights(step), str(run / f"step{step}" / "model.safetensors"))
    database = store_location if store_location.startswith("postgresql") else None
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)],
                        database_url=database)
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        for step in (1, 2):
            body = {"uri": str(run / f"step{step}"), "name": f"s{step}", "metadata": {"run": "r", "step": step}}
            assert client.post("/v1/checkpoints", json=body).status_code == 201
        first = run_here(client, {"kind": "scan", "source": str(run / "step1")})
        second = run_here(client, {"kind": "scan", "source": str(run / "step2")})
        changed = weights(1)
        changed["layers.1.bias"] = torch.full((16,), 2.0)
        save_file(changed, str(run / "step1" / "model.safetensors"))
        again = run_here(client, {"kind": "scan", "source": str(run / "step1")})
        stats = client.get("/v1/checkpoints/s1@r/stats").json()
        points = client.get("/v1/runs/r/stats").json()
    assert {first["state"], second["state"], again["state"]} == {"succeeded"}
    assert stats["job_id"] == again["id"] and stats["tensors"] == again["result"]["tensors"]
    bias = next(t for t in stats["tensors"] if t["name"] == "layers.1.bias")
    assert (bias["min"], bias["max"], bias["l2"]) == (2.0, 2.0, 8.0)
    assert [(p["step"], p["job_id"]) for p in points] == [(1, again["id"]), (2, second["id"])]
