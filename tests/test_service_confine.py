"""Service jobs read only inside their storage roots, member by member: a checkpoint inside the read root
whose data file is a symlink to a file outside every root fails the job, naming the file, while the same
checkpoint converts offline (where the user reads with their own permissions).

The API process reads no checkpoint itself: registering, the tensor table, `POST /v1/notify` and rule
discovery read in a sandboxed job process, confined like jobs; one hostile folder never stops discovery."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from .conftest import ckptctl
from .service_harness import Server, Tokens, job_spec, leftovers, make_server, wait_for

pytestmark = pytest.mark.slow


def test_member_symlink_out_of_the_read_roots_fails_the_job(tmp_path: Path) -> None:
    read_root, write_root, outside = tmp_path / "data", tmp_path / "out", tmp_path / "elsewhere"
    for folder in (read_root, write_root, outside):
        folder.mkdir()
    weights = {"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    source = read_root / "ckpt"
    dcp.save(weights, checkpoint_id=str(source), no_dist=True)
    (data_file,) = source.glob("*.distcp")
    shutil.move(data_file, outside / data_file.name)  # the bytes now live outside every root
    os.symlink(outside / data_file.name, data_file)

    offline = tmp_path / "offline"
    ckptctl("export", str(source), str(offline))
    assert torch.equal(load_file(offline / "model.safetensors")["layer.weight"], weights["layer.weight"])

    tokens = Tokens.make()
    server = make_server(tmp_path / "srv", read_roots=[read_root], write_roots=[write_root],
                         tokens=tokens.entries).start()
    try:
        target = write_root / "export"
        with server.client(tokens.write) as client:
            job = client.submit(job_spec("export", source, target))
        done = server.wait_job(job["id"], ("failed", "succeeded"), token=tokens.read)
        assert done["state"] == "failed", done
        message = done["error"]["message"]
        assert data_file.name in message and "outside the storage roots" in message, message
        assert str(outside) not in message  # nothing about where the link points
        assert leftovers(target) == []
    finally:
        server.stop()


SECRET_NAME = "outside.secret_projection"
SECRET_BYTES = b"TOPSECRET-api-key-0123456789"


@dataclass
class Site:
    """A server whose read root holds checkpoints with members linked to files outside every root."""

    server: Server
    tokens: Tokens
    runs: Path
    exports: Path
    outside: Path

    def linked_out(self, name: str, member: str, target: Path) -> Path:
        """A folder in the read root whose `member` is a symlink to `target` (outside every root)."""
        folder = self.runs / name
        folder.mkdir(parents=True)
        os.symlink(target, folder / member)
        return folder

    def registered(self) -> list[dict[str, Any]]:
        with self.server.http(self.tokens.read) as http:
            return http.get("/v1/checkpoints").json()["items"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    base = tmp_path_factory.mktemp("confine")
    runs, exports, outside = base / "runs", base / "exports", base / "elsewhere"
    for folder in (runs, exports, outside):
        folder.mkdir()
    save_file({SECRET_NAME: torch.zeros(2, 2)}, outside / "secret.safetensors")
    (outside / "secret.bin").write_bytes(SECRET_BYTES * 4)
    tokens = Tokens.make()
    server = make_server(base / "srv", read_roots=[runs], write_roots=[exports], tokens=tokens.entries,
                         extra_env={"CKPT_DISCOVER_SECONDS": "0.3"}).start()
    try:
        yield Site(server, tokens, runs, exports, outside)
    finally:
        server.stop()


def one_line_refusal(response: Any) -> str:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    message = response.json()["error"]["message"]
    assert "\n" not in message and SECRET_NAME not in response.text, message
    assert "TOPSECRET" not in response.text and str(SECRET_BYTES[:8]) not in response.text, message
    return message


def test_register_refuses_members_linked_out_of_the_roots(site: Site) -> None:
    weights = site.linked_out("reg-st", "model.safetensors", site.outside / "secret.safetensors")
    dcp_folder = site.runs / "reg-dcp"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(dcp_folder), no_dist=True)
    (dcp_folder / ".metadata").unlink()
    os.symlink(site.outside / "secret.bin", dcp_folder / ".metadata")
    with site.server.http(site.tokens.write) as http:
        message = one_line_refusal(http.post("/v1/checkpoints", json={"uri": str(weights)}))
        assert "model.safetensors" in message and "outside the storage roots" in message, message
        message = one_line_refusal(http.post("/v1/checkpoints", json={"uri": str(dcp_folder)}))
        assert ".metadata" in message and "outside the storage roots" in message, message
    assert [c["uri"] for c in site.registered() if "reg-" in c["uri"]] == []  # nothing stored


def test_tensor_table_never_shows_names_from_outside_the_roots(site: Site) -> None:
    folder = site.runs / "shown"
    folder.mkdir()
    save_file({"inside.weight": torch.ones(3)}, folder / "model.safetensors")
    with site.server.http(site.tokens.write) as http:
        created = http.post("/v1/checkpoints", json={"uri": str(folder)})
        assert created.status_code == 201, created.text
    checkpoint_id = created.json()["id"]
    with site.server.http(site.tokens.read) as reader:
        table = reader.get(f"/v1/checkpoints/{checkpoint_id}", params={"tensors": "true"}).json()
        assert [t["name"] for t in table["summary"]["tensor_table"]] == ["inside.weight"]
        (folder / "model.safetensors").unlink()  # swapped for a link out after it was registered
        os.symlink(site.outside / "secret.safetensors", folder / "model.safetensors")
        message = one_line_refusal(reader.get(f"/v1/checkpoints/{checkpoint_id}", params={"tensors": "true"}))
        assert "outside the storage roots" in message, message


def test_notify_refuses_a_member_linked_out_of_the_roots(site: Site) -> None:
    folder = site.linked_out("pushed", "model.safetensors", site.outside / "secret.safetensors")
    with site.server.http(site.tokens.write) as http:
        refused = http.post("/v1/notify", json={"uri": str(folder)})
        assert refused.status_code == 409, refused.text
        message = one_line_refusal(refused)
        assert "model.safetensors" in message and "outside the storage roots" in message, message
    assert [c["uri"] for c in site.registered() if c["uri"] == str(folder)] == []


def test_discovery_goes_on_past_a_hostile_folder_and_shows_it_on_the_rule(site: Site) -> None:
    hostile, good = site.runs / "r" / "step_1", site.runs / "r" / "step_2"
    hostile.mkdir(parents=True)
    (hostile / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)  # Megatron-shaped, nested too deep
    (hostile / ".metadata").write_bytes(b"\x80\x04N.")
    good.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32)}, good / "model.safetensors")
    rule = {"name": "exports", "pattern": f"{site.runs}/r/step_*",
            "job": {"kind": "export", "target": f"{site.exports}/{{run}}-{{step}}"}}
    with site.server.http(site.tokens.write) as http:
        assert http.post("/v1/rules", json=rule).status_code == 201
        fired = wait_for(lambda: http.get("/v1/rules/exports/triggers").json(), 30, "the good step to fire")
        assert [Path(t["uri"]).name for t in fired] == ["step_2"] and fired[0]["state"] in ("submitted", "done")
        view = wait_for(lambda: (v := http.get("/v1/rules/exports").json())["skipped"] and v, 10, "the skip shown")
    assert list(view["skipped"]) == [str(hostile)] and view["last_error"] is None, view
    why = view["skipped"][str(hostile)]
    assert str(hostile) in why and "\n" not in why and "Traceback" not in why, why
    assert [e for e in site.server.log_events() if e.get("event") == "manage.loop_error"] == []

    with site.server.http(site.tokens.read) as reader:  # the output, in a write root, shows its tensor table too
        [done] = wait_for(lambda: [t for t in reader.get("/v1/rules/exports/triggers").json() if t["state"] == "done"],
                          60, "the export to finish")
        table = reader.get(f"/v1/checkpoints/{done['detail']}", params={"tensors": "true"})
        assert [t["name"] for t in table.json()["summary"]["tensor_table"]] == ["w"], table.text
