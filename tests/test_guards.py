"""Guards with bounds on statistics (`--require BOUND`, `require` over REST): a conversion, a rule's job and an
alias move check the source's scan against them, and a refusal names the tensor, the statistic, its value and
the bound. Slow tests: real FSDP2 steps (tests/guards_job.py) whose second step the training code blew up."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckptctl import app as cli
from converters import OptionError, scan
from converters.stats.guards import Bound, check, parse_bound, parse_bounds
from tests.ranks import run_tool

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
#: the bounds the tests guard with: every tensor within |10|, and the layers' weights within an L2 norm of 100
BOUNDS = ["max_abs<=10", "l2<=100:layers.*.weight"]


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


def test_bounds_parse_from_short_strings() -> None:
    assert parse_bound("max_abs<=100") == Bound("max_abs", 100.0, True, None)
    assert parse_bound(" l2 <= 1e4 : *.weight ") == Bound("l2", 1e4, True, "*.weight")
    assert parse_bound("std>=1e-6:layers.*") == Bound("std", 1e-6, False, "layers.*")
    assert parse_bound("FINITE") == Bound("finite")
    assert str(parse_bound("l2<=1e4:*.weight")) == "l2<=10000:*.weight"
    assert parse_bounds(["max_abs<=1"], require_finite=True) == [Bound("finite"), Bound("max_abs", 1.0)]


@pytest.mark.parametrize(("text", "says"), [
    ("mean<=1", "bound 'mean<=1': unknown statistic 'mean'; choose one of max_abs, l2, std"),
    ("max_abs<100", "bound 'max_abs<100': write finite, or STAT<=LIMIT[:GLOB] / STAT>=LIMIT[:GLOB] with STAT one "
                    "of max_abs, l2, std"),
    ("l2<=big", "bound 'l2<=big': limit 'big' is not a number (e.g. 100 or 1e4)"),
    ("l2<=-1", "bound 'l2<=-1': limit '-1' must be a finite number >= 0"),
    ("std<=inf", "bound 'std<=inf': limit 'inf' must be a finite number >= 0"),
])
def test_a_bad_bound_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(OptionError) as caught:
        parse_bound(text)
    assert str(caught.value) == says and caught.value.option == "require"


def test_check_reads_statistics_over_all_elements() -> None:
    rows: list[dict[str, Any]] = [
        {"name": "a.weight", "nan": 0, "posinf": 0, "neginf": 0, "min": -200.0, "max": 3.0, "l2": 5e4, "std": 1.0},
        {"name": "b.bias", "nan": 0, "posinf": 1, "neginf": 0, "min": -2.0, "max": 3.0, "l2": 5.0, "std": 1.0},
        {"name": "c.big", "nan": 0, "posinf": 0, "neginf": 0, "min": 0.0, "max": 1.0, "l2": "inf", "std": 0.5},
        {"name": "d.empty", "nan": 0, "posinf": 0, "neginf": 0, "min": None, "max": None, "l2": 0.0, "std": None}]
    broken = check(parse_bounds(["max_abs<=100", "l2<=1e4:*.weight", "l2<=1:*.wieght", "std>=0.1"], True), rows)
    assert [(str(b.bound), [name for name, _ in b.tensors]) for b in broken] == [
        ("finite", ["b.bias"]), ("max_abs<=100", ["a.weight", "b.bias"]), ("l2<=10000:*.weight", ["a.weight"]),
        ("l2<=1:*.wieght", []), ("std>=0.1", ["b.bias"])]
    assert broken[1].tensors == (("a.weight", 200.0), ("b.bias", math.inf)) and math.isnan(broken[4].tensors[0][1])
    assert [str(b) for b in broken] == [
        "NaN or Inf in 1 tensor(s) (b.bias)",
        "2 tensor(s) over max_abs<=100: a.weight max_abs=200, b.bias max_abs=inf",
        "1 tensor(s) over l2<=10000:*.weight: a.weight l2=50000",
        "no tensor matching *.wieght (l2<=1:*.wieght)",
        "1 tensor(s) under std>=0.1: b.bias std=nan"]


def small_step(folder: Path, scale: float) -> Path:
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    save_file({"layers.0.weight": torch.randn(8, 4) * scale, "layers.0.bias": torch.zeros(8)},
              str(folder / "model.safetensors"))
    return folder


def test_bad_bounds_exit_2_and_422_in_one_line(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    step = small_step(tmp_path / "runs" / "r" / "step_1", 1.0)
    code, output = ckptctl("export", str(step), str(tmp_path / "out"), "--require", "mean<=1", "-q")
    assert code == 2 and output.strip().splitlines() == [
        "error: require.0: bound 'mean<=1': unknown statistic 'mean'; choose one of max_abs, l2, std"]
    assert not (tmp_path / "out").exists()
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        checkpoint = client.post("/v1/checkpoints", json={"uri": str(step), "name": "s1"}).json()["id"]
        moved = client.put("/v1/aliases/default/prod", json={"checkpoint_id": checkpoint, "require": ["l2<=x"]})
        rule = client.post("/v1/rules", json={"name": "serve", "pattern": f"{tmp_path}/runs/*/step_*", "job": {
            "kind": "export", "target": f"{tmp_path}/exports/{{run}}-{{step}}", "options": {"require": "l2<1"}}})
    assert moved.status_code == 422 and len(moved.json()["error"]["message"].splitlines()) == 1
    assert "bound 'l2<=x': limit 'x' is not a number (e.g. 100 or 1e4)" in moved.json()["error"]["message"]
    assert rule.status_code == 422 and len(rule.json()["error"]["message"].splitlines()) == 1
    assert "bound 'l2<1': write finite, or STAT<=LIMIT[:GLOB]" in rule.json()["error"]["message"]


# ---- real FSDP2 steps (tests/guards_job.py) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2-guards")
    run_tool("guards_job", out)
    return out


def blown(steps: Path) -> str:
    """What the bounds say of step 2, from torch on the unsharded tensors the ranks gathered."""
    from tests.guards_job import BLOWN

    weight = torch.load(steps / "full-2.pt", weights_only=True)[BLOWN].double()
    return (f"1 tensor(s) over max_abs<=10: {BLOWN} max_abs={weight.abs().max().item():.6g}; "
            f"1 tensor(s) over l2<=100:layers.*.weight: {BLOWN} l2={weight.norm().item():.6g}")


@pytest.mark.slow
def test_the_bounds_see_the_blown_up_weights_as_torch_does(steps: Path) -> None:
    from tests.guards_job import BLOWN

    assert check(parse_bounds(BOUNDS, True), scan(str(steps / "step-1")).tensors) == []
    broken = check(parse_bounds(BOUNDS, True), scan(str(steps / "step-2")).tensors)
    weight = torch.load(steps / "full-2.pt", weights_only=True)[BLOWN].double()
    assert [(str(b.bound), [name for name, _ in b.tensors]) for b in broken] == [
        ("max_abs<=10", [BLOWN]), ("l2<=100:layers.*.weight", [BLOWN])]
    assert broken[0].tensors[0][1] == weight.abs().max().item()  # from float32 min and max: exact
    assert math.isclose(broken[1].tensors[0][1], weight.norm().item(), rel_tol=1e-12)


@pytest.mark.slow
def test_export_with_bounds_writes_nothing_from_the_blown_up_step(steps: Path, tmp_path: Path) -> None:
    flags = [arg for bound in BOUNDS for arg in ("--require", bound)]
    code, output = ckptctl("export", str(steps / "step-2"), str(tmp_path / "out"), *flags, "--require-finite", "-q")
    assert code == 2 and output.strip().splitlines() == [
        f"error: {steps / 'step-2'}: {blown(steps)}; nothing was written (require {', '.join(BOUNDS)})"]
    assert not (tmp_path / "out").exists()
    assert ckptctl("export", str(steps / "step-1"), str(tmp_path / "fine"), *flags, "-q")[0] == 0


@pytest.mark.slow
def test_a_rule_with_bounds_does_not_export_the_blown_up_step(steps: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.executor import run_job
    from ckpt_service.settings import Settings

    runs, exports = tmp_path / "runs", tmp_path / "exports"
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(runs)], write_roots=[str(exports)])
    settings.prepare()
    states = {}
    with TestClient(create_app(settings)) as client:
        rule = {"name": "serve", "pattern": f"{runs}/*/step_*",
                "job": {"kind": "export", "target": f"{exports}/{{run}}-{{step}}", "options": {"require": BOUNDS}}}
        added = client.post("/v1/rules", json=rule)
        assert added.status_code == 201, added.text
        store = client.app.state.service.store  # type: ignore[attr-defined]
        for step in (1, 2):
            folder = runs / "r" / f"step_{step}"
            folder.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-r", str(steps / f"step-{step}"), str(folder)], check=True)
            fired = client.post("/v1/notify", json={"uri": str(folder)}).json()
            assert [t["state"] for t in fired["triggers"]] == ["submitted"], fired
            claimed = store.claim("test-worker", 60.0)
            assert run_job(store, claimed.id, claimed.attempt) == 0
            states[step] = client.get(f"/v1/jobs/{claimed.id}").json()
    assert states[1]["state"] == "succeeded" and (exports / "r-1" / "model.safetensors").exists()
    assert states[2]["state"] == "failed" and not (exports / "r-2").exists()
    assert states[2]["error"]["message"] == (f"{runs / 'r' / 'step_2'}: {blown(steps)}; nothing was written "
                                             f"(require {', '.join(BOUNDS)})")


@pytest.mark.slow
def test_an_alias_with_bounds_moves_only_to_a_step_within_them(steps: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    from .service_harness import run_here

    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(steps)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        ids = {step: client.post("/v1/checkpoints", json={"uri": str(steps / f"step-{step}"),
                                                          "name": f"step{step}"}).json()["id"] for step in (1, 2)}
        scans = {step: run_here(client, {"kind": "scan", "source": str(steps / f"step-{step}")}) for step in (1, 2)}
        assert {s["state"] for s in scans.values()} == {"succeeded"}
        body = {"require": BOUNDS, "require_finite": True}
        moved = client.put("/v1/aliases/default/prod", json={"checkpoint_id": ids[1], **body})
        assert moved.status_code == 200, moved.text
        blocked = client.put("/v1/aliases/default/prod", json={"checkpoint_id": ids[2], **body})
        assert blocked.status_code == 409
        assert blocked.json()["error"]["message"] == (
            f"alias prod@default not moved: scan {scans[2]['id']} found {blown(steps)}")
        assert client.get("/v1/aliases/default/prod").json()["checkpoint"]["id"] == ids[1]
        assert client.put("/v1/aliases/default/prod", json={"checkpoint_id": ids[2]}).status_code == 200  # unguarded


@pytest.mark.slow
def test_ckptctl_alias_require_is_refused_by_a_real_server_in_one_line(steps: Path, tmp_path: Path) -> None:
    from tests.conftest import ckptctl as run_ckptctl

    from .service_harness import make_server

    server = make_server(tmp_path / "data", read_roots=[steps], write_roots=[tmp_path], workers=1).start()
    try:
        def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            return run_ckptctl(*args, "--server", server.url, check=check)

        for step in (1, 2):
            cli("checkpoints", "register", str(steps / f"step-{step}"), "--name", f"step{step}")
            cli("submit", "scan", str(steps / f"step-{step}"), "--wait", "-q")
        flags = [arg for bound in BOUNDS for arg in ("--require", bound)]
        assert "prod@default -> " in cli("checkpoints", "alias", "step1", "prod", *flags).stdout
        refused = cli("checkpoints", "alias", "step2", "prod", *flags, check=False)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith("error: alias prod@default not moved: scan job_"), refused.stderr
        assert refused.stderr.strip().endswith(f"found {blown(steps)} (HTTP 409)"), refused.stderr
        bad = cli("checkpoints", "alias", "step2", "prod", "--require", "max_abs<=ten", check=False)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert "bound 'max_abs<=ten': limit 'ten' is not a number" in bad.stderr
    finally:
        server.stop()


def test_repeated_rule_options_gather_into_one_list(tmp_path: Path) -> None:
    """`ckptctl rules add --option KEY=...` given twice keeps both values (it kept the last): a list option takes
    them all, a single-valued one is refused by the server in one line, naming it."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings
    from ckptctl.manage import job_options

    options = job_options(["require=finite", 'require=["max_abs<=10"]', "dtype=bfloat16", "latest=3", "note=a=b"])
    assert options == {"require": ["finite", "max_abs<=10"], "dtype": "bfloat16", "latest": 3, "note": "a=b"}
    assert job_options(["dtype=bfloat16", "dtype=float16"]) == {"dtype": ["bfloat16", "float16"]}
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        def add(name: str, given: list[str]) -> Any:
            job = {"kind": "export", "target": f"{tmp_path}/out/{{run}}", "options": job_options(given)}
            return client.post("/v1/rules", json={"name": name, "pattern": f"{tmp_path}/*/step_*", "job": job})

        kept = add("both", ["require=finite", "require=max_abs<=10"])
        assert kept.status_code == 201, kept.text
        assert kept.json()["spec"]["job"]["options"]["require"] == ["finite", "max_abs<=10"]
        twice = add("twice", ["dtype=bfloat16", "dtype=float16"])
        assert twice.status_code == 422 and "dtype" in twice.text, twice.text
