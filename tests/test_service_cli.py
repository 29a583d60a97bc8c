"""The client commands against a live server (`ckptctl submit/status/jobs/cancel/checkpoints/token`), and a
standalone `ckptctl worker` doing the work for an API-only server on the same data dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from converters import verify
from converters.transforms import KeyOptions

from .service_harness import Server, Tokens, make_server

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


def ckptctl(server: Server, token: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update({"CKPT_SERVER": server.url, "COLUMNS": "200"})
    if token:
        env["CKPT_TOKEN"] = token
    proc = subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptctl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def api_only(fsdp2: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path, Path]]:
    source = fsdp2["fsdp2-dcp"].path
    out = tmp_path_factory.mktemp("cli-out")
    tokens = Tokens.make()
    server = make_server(tmp_path_factory.mktemp("cli-data"), read_roots=[source.parent], write_roots=[out],
                         workers=0, tokens=tokens.entries)
    yield server.start(), tokens, source, out
    server.stop()


def test_submit_with_a_standalone_worker_then_status_jobs_and_checkpoints(
        api_only: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, out = api_only
    target = out / "export-bf16"
    job_id = ckptctl(server, tokens.write, "submit", "export", str(source), str(target), "--dtype", "bfloat16",
                     "--max-shard-size", "100KB").stdout.strip()
    assert job_id.startswith("job_")
    queued = json.loads(ckptctl(server, tokens.read, "status", job_id, "--json").stdout)
    assert queued["state"] == "queued"  # the API server has no job slots
    assert queued["spec"]["options"]["dtype"] == "bfloat16" and queued["spec"]["options"]["clean_keys"] is True

    worker = subprocess.Popen([sys.executable, "-m", "ckptctl", "worker", "--workers", "1", "--data-dir",
                               str(server.data_dir)], env=server.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        followed = ckptctl(server, tokens.read, "status", job_id, "--follow")
        assert "succeeded" in followed.stdout and "registered as ckpt_" in followed.stdout
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert worker.returncode == 0
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 1  # sharded at 100KB
    report = verify(str(source), str(target), keys=KeyOptions(only="model", nest=False), atol=0.01)
    assert report.ok, report.summary()

    listed = ckptctl(server, tokens.read, "jobs", "--state", "succeeded").stdout
    assert job_id in listed
    checkpoints = json.loads(ckptctl(server, tokens.read, "checkpoints", "list", "--json").stdout)["items"]
    made = next(c for c in checkpoints if c["made_by_job"] == job_id)
    shown = ckptctl(server, tokens.read, "checkpoints", "show", made["id"], "--tensors").stdout
    assert "bfloat16" in shown
    lineage = ckptctl(server, tokens.read, "checkpoints", "lineage", made["id"]).stdout
    assert "derived from" in lineage and str(source.resolve()) in lineage


def test_register_cancel_and_errors(api_only: tuple[Server, Tokens, Path, Path], fsdp2: dict) -> None:
    server, tokens, _, out = api_only
    safetensors = fsdp2["safetensors"].path
    registered = json.loads(ckptctl(server, tokens.write, "checkpoints", "register", str(safetensors), "--name",
                                    "llama-2000", "--tag", "eval", "--meta", "step=2000", "--json").stdout)
    assert registered["name"] == "llama-2000" and registered["metadata"] == {"step": 2000}
    found = json.loads(ckptctl(server, tokens.read, "checkpoints", "list", "--tag", "eval", "--json").stdout)
    assert [c["id"] for c in found["items"]] == [registered["id"]]

    job_id = ckptctl(server, tokens.write, "submit", "reshard", str(safetensors), str(out / "ws3"),
                     "--world-size", "3").stdout.strip()
    cancelled = ckptctl(server, tokens.write, "cancel", job_id).stdout
    assert "cancelled" in cancelled
    again = ckptctl(server, tokens.read, "status", job_id, "--follow", check=False)
    assert again.returncode == 1 and "cancelled" in again.stdout

    denied = ckptctl(server, tokens.read, "submit", "inspect", str(safetensors), check=False)
    assert denied.returncode == 2 and "HTTP 403" in denied.stderr
    outside = ckptctl(server, tokens.write, "submit", "export", "/etc", str(out / "x"), check=False)
    assert outside.returncode == 2 and "outside the storage roots" in outside.stderr
    made = ckptctl(server, None, "token", "create", "--scope", "write", "--name", "ci")
    assert made.stdout.startswith("ckpt_") and "ci:write:sha256:" in made.stderr


# -- each interface in its own words (issue 27) -------------------------------------------------------


def piped(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`ckptctl ARGS` with stdout and stderr piped, as a script or `| grep` sees it (no COLUMNS set)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_") and k != "COLUMNS"}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          timeout=120, env=clean)


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path, Path]]:
    """A token-checking API-only server over four tiny one-file checkpoints, `<root>/run-N/step_10`, with a
    deep root so paths are longer than a terminal line."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("words") / ("a-long-folder-name-" * 4).strip("-")
    for run in ("run-1", "run-2", "run-3", "run-4"):
        (root / run / "step_10").mkdir(parents=True)
        save_file({"layer.weight": torch.ones(4, 4)}, str(root / run / "step_10" / "model.safetensors"))
    out = tmp_path_factory.mktemp("words-out")
    tokens = Tokens.make()
    server = make_server(tmp_path_factory.mktemp("words-data"), read_roots=[root, out], write_roots=[out], workers=0,
                         tokens=tokens.entries)
    yield server.start(), tokens, root, out
    server.stop()


def test_a_refusal_names_the_flag_on_the_cli_and_the_field_in_rest(words: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, root, out = words
    (out / "taken").mkdir()
    (out / "taken" / "x").write_text("x")
    proc = ckptctl(server, tokens.write, "submit", "export", str(root / "run-1" / "step_10"), str(out / "taken"),
                   check=False)
    assert proc.returncode == 2
    assert "replace it with --overwrite" in proc.stderr and "options.overwrite" not in proc.stderr
    with server.http(tokens.write) as http:
        r = http.post("/v1/jobs", json={"kind": "export", "source": str(root / "run-1" / "step_10"),
                                        "target": str(out / "taken"), "options": {}})
    assert r.status_code == 409
    error = r.json()["error"]
    assert "options.overwrite" in error["message"]
    assert error["fields"][0]["field"] == "options.overwrite"  # where a form puts the message


def test_a_missing_token_says_ckpt_token_or_token(words: tuple[Server, Tokens, Path, Path]) -> None:
    server, _, _, _ = words
    proc = piped("jobs", env={"CKPT_SERVER": server.url})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "set CKPT_TOKEN or pass --token" in proc.stderr
    assert "Authorization" not in proc.stderr


def test_checkpoints_by_name_name_at_run_and_alias(words: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, root, _ = words
    made = {}
    for run, name in (("run-1", "demo"), ("run-2", "demo"), ("run-3", "solo")):
        registered = ckptctl(server, tokens.write, "checkpoints", "register", str(root / run / "step_10"), "--name",
                             name, "--json")
        made[run] = json.loads(registered.stdout)["id"]
    shown = ckptctl(server, tokens.read, "checkpoints", "show", "solo", "--json")
    assert json.loads(shown.stdout)["id"] == made["run-3"]
    shown = ckptctl(server, tokens.read, "checkpoints", "show", "demo@run-2", "--json")
    assert json.loads(shown.stdout)["id"] == made["run-2"]
    ckptctl(server, tokens.write, "checkpoints", "alias", "solo", "best")
    shown = ckptctl(server, tokens.read, "checkpoints", "show", "best@run-3", "--json")
    assert json.loads(shown.stdout)["id"] == made["run-3"]
    lineage = ckptctl(server, tokens.read, "checkpoints", "lineage", "solo", "--json")
    assert json.loads(lineage.stdout)["checkpoint"]["id"] == made["run-3"]
    ambiguous = ckptctl(server, tokens.read, "checkpoints", "show", "demo", check=False)
    assert ambiguous.returncode == 2 and ambiguous.stderr.count("\n") == 1
    assert made["run-1"] in ambiguous.stderr and made["run-2"] in ambiguous.stderr and "demo@run-1" in ambiguous.stderr
    with server.http(tokens.read) as http:
        assert http.get("/v1/checkpoints/solo").json()["id"] == made["run-3"]
        assert http.get("/v1/checkpoints/demo@run-1/lineage").json()["checkpoint"]["id"] == made["run-1"]
        refused = http.get("/v1/checkpoints/demo")
        assert refused.status_code == 422 and made["run-2"] in refused.json()["error"]["message"]
        assert http.get("/v1/checkpoints/nothing-here").status_code == 404


def test_piped_output_is_whole_one_record_per_line(words: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, root, out = words
    source = root / "run-4" / "step_10"
    ckptctl(server, tokens.write, "checkpoints", "register", str(source), "--name", "piped")
    env = {"CKPT_SERVER": server.url, "CKPT_TOKEN": tokens.read}
    listed = piped("checkpoints", "list", "--name", "piped", env=env)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split("\t")[0] == "id" and len(rows) == 1
    cells = rows[0].split("\t")
    assert cells[0].startswith("ckpt_") and "…" not in listed.stdout and cells[-1] == str(source)
    assert "None" not in listed.stdout
    job_id = ckptctl(server, tokens.write, "submit", "export", str(source), str(out / "piped-export"),
                     "--quiet").stdout.strip()
    status = piped("status", job_id, env=env)
    lines = status.stdout.splitlines()
    assert lines[0].startswith(f"{job_id}  export  queued  attempt ")
    assert lines[1] == f"  {source} -> {out / 'piped-export'}"


def test_dtype_aliases_on_the_cli_and_in_rest(words: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, root, out = words
    source = root / "run-1" / "step_10"
    proc = ckptctl(server, tokens.write, "submit", "export", str(source), str(out / "bf16"), "--dtype", "bf16",
                   "--json")
    assert json.loads(proc.stdout)["spec"]["options"]["dtype"] == "bfloat16"
    with server.http(tokens.write) as http:
        r = http.post("/v1/jobs", json={"kind": "export", "source": str(source), "target": str(out / "fp16"),
                                        "options": {"dtype": "fp16"}})
    assert r.status_code == 202 and r.json()["spec"]["options"]["dtype"] == "float16"
    local = piped("export", str(source), str(out / "half"), "--dtype", "half", "--quiet")
    assert local.returncode == 0, local.stderr
    from safetensors import safe_open

    with safe_open(str(next((out / "half").glob("*.safetensors"))), "pt") as f:
        assert str(f.get_tensor("layer.weight").dtype) == "torch.float16"


def test_help_reads_like_a_command_line() -> None:
    text = piped("export", "--help", env={"COLUMNS": "200"}).stdout
    assert "Usage: ckptctl export [OPTIONS] SOURCE TARGET" in text
    for typed in ("<bool>", "<list[str]>", "<str>", "{source}", "null:"):
        assert typed not in text, typed
    include = next(line for line in text.splitlines() if "--include" in line)
    assert "GLOB" in include and "Repeatable" in include
    assert "[float32|bfloat16|float16]" in text and "Default: 5GB." in text
    assert "--clean-keys" in text and "Default: --clean-keys." in text
    for group in ("rules", "policies", "checkpoints", "runs", "token", "store", "submit"):
        for line in piped(group, "--help", env={"COLUMNS": "200"}).stdout.splitlines():
            cells = line.strip("│ ").split(None, 1)  # every command row: its name, then its description
            if cells and cells[0] in ("list", "remove", "pause", "resume", "add", "show", "triggers"):
                assert len(cells) == 2 and cells[1].strip(), f"{group} {cells[0]} has no description"


def test_a_missing_required_option_is_one_line() -> None:
    proc = piped("reshard", "a", "b")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: Missing option '--world-size'. (see: ckptctl reshard --help)"]


def test_serve_on_a_busy_port_refuses_before_starting(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = piped("serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--host", "127.0.0.1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already "
                                        "in use); choose another with --port or CKPT_PORT, or stop what holds it"]
    assert proc.stdout == "" and not (tmp_path / "data").exists()  # no store opened, no worker started


def test_the_readme_test_command_upgrades_pip_first_and_ci_runs_it() -> None:
    """A fresh venv's stock pip 23 backtracks for 20+ minutes over the test extra: the README's one command line
    upgrades pip before the install, and `.ci/run` runs that same line."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert "\n" not in command
    steps = [step.strip() for step in command.split("&&")]
    assert steps[0] == "python -m pip install --upgrade pip"
    assert steps[1].startswith("python -m pip install") and '-e ".[test]"' in steps[1]
    assert command in (root / ".ci" / "run").read_text().splitlines()


def test_serve_on_a_terminal_says_where_the_dashboard_is(tmp_path: Path) -> None:
    import pty
    import select
    import time

    from ckpt_service.helpers import free_port

    port = free_port()
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "serve", "--port", str(port), "--workers", "0",
                             "--data-dir", str(tmp_path / "data")], stdout=follower, stderr=subprocess.DEVNULL, env=env)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"\n" not in seen and time.monotonic() < deadline and proc.poll() is None:
            if select.select([leader], [], [], 0.5)[0]:
                seen += os.read(leader, 4096)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(leader)
    assert seen.decode().splitlines()[0].startswith(f"Dashboard: http://127.0.0.1:{port}/")
