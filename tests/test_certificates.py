"""Conversion certificates (`converters.certificate`), `verify --certificate` and scrub.

Sources are real DCP checkpoints written by torch's own dcp.save; outputs are read back with safetensors and
torch's dcp.load as oracles; single bits are flipped in output and source files and must be found, by name
and byte range.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptctl import app as cli
from converters import ConvertOptions, ReshardOptions, check_certificate, convert, reshard, scrub
from converters.names import MANIFEST

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"layers.0.weight": torch.randn(64, 32), "layers.0.bias": torch.randn(32),
            "layers.1.weight": torch.randn(16, 32).half(), "steps": torch.arange(10)}


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "dcp"
    dcp.save({"model": weights()}, checkpoint_id=str(folder), no_dist=True)
    return folder


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))


def certificate(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())["certificate"]


def test_a_cast_export_certifies_source_output_and_statistics(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(str(source), str(out), ConvertOptions(export=True, dtype="bfloat16", stats=True))
    cert = certificate(out)
    manifest = json.loads((out / MANIFEST).read_text())
    loaded = load_file(str(out / "model.safetensors"))
    want = weights()
    assert cert["source"] == {"uri": str(source), "format": "dcp"}
    assert set(cert["tensors"]) == set(loaded) == set(want)  # the export's clean names
    for name, pieces in cert["tensors"].items():
        original = want[name]
        (piece,) = pieces
        assert piece["source_crc32"] == zlib.crc32(original.numpy().tobytes())
        assert piece["crc32"] == zlib.crc32(loaded[name].view(torch.uint8).numpy().tobytes())
        assert piece["ranges"][0][0] == "__0_0.distcp"
    for name, info in manifest["files"].items():
        assert info["crc32"] == zlib.crc32((out / name).read_bytes())
    checks = {name: side["check"] for name, side in cert["stats"].items()}
    assert checks == {"layers.0.weight": "within rounding", "layers.0.bias": "within rounding",
                      "layers.1.weight": "within rounding", "steps": "equal"}
    for name, side in cert["stats"].items():
        got = loaded[name].double()
        assert side["output"]["min"] == got.min().item() and side["output"]["max"] == got.max().item()
        assert side["output"]["count"] == got.numel() == side["source"]["count"]
    assert check_certificate(str(out)).ok


def test_without_stats_the_certificate_has_no_statistics_and_an_exact_copy_is_equal(source: Path,
                                                                                    tmp_path: Path) -> None:
    out = tmp_path / "plain"
    convert(str(source), str(out), ConvertOptions())
    cert = certificate(out)
    assert "stats" not in cert
    assert all(p["crc32"] == p["source_crc32"] for pieces in cert["tensors"].values() for p in pieces)
    with_stats = tmp_path / "stats"
    convert(str(source), str(with_stats), ConvertOptions(stats=True))
    assert {side["check"] for side in certificate(with_stats)["stats"].values()} == {"equal"}


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_flipped_bit_in_any_output_file_is_found(source: Path, tmp_path: Path, where: str) -> None:
    out = tmp_path / "resharded"
    reshard(str(source), str(out), ReshardOptions(world_size=2))
    assert check_certificate(str(out)).ok
    for name in json.loads((out / MANIFEST).read_text())["files"]:
        damaged = tmp_path / f"damaged-{name}"
        shutil.copytree(out, damaged)
        size = os.path.getsize(damaged / name)
        offset = {"start": 0, "middle": size // 2, "end": size - 1}[where]
        flip(damaged / name, offset)
        report = check_certificate(str(damaged))
        assert not report.ok, (name, offset)
        assert report.damaged[0] == f"{damaged / name}: bytes 0-{size} differ from the manifest's CRC-32"
        code, text = ckptctl("verify", "--certificate", str(damaged))
        assert code == 1 and f"{damaged / name}: bytes 0-{size}" in text


def test_a_flipped_bit_in_a_source_range_is_found_and_named(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(str(source), str(out), ConvertOptions())
    piece = certificate(out)["tensors"]["layers.0.weight"][0]
    file, offset, length = piece["ranges"][0][:3]
    flip(source / file, offset + length // 2)
    report = check_certificate(str(out))
    assert report.damaged == [f"source {source / file} bytes {offset}-{offset + length} (tensor "
                              "layers.0.weight) differ from what the conversion read"]
    code, text = ckptctl("verify", "--certificate", str(out))
    assert code == 1 and f"source {source / file} bytes {offset}-{offset + length}" in text
    assert scrub(str(out)).ok  # the output itself is intact: scrub reads only what it holds


def test_verify_certificate_without_one_is_one_line(source: Path) -> None:
    code, text = ckptctl("verify", "--certificate", str(source))
    assert code == 2 and "no ckpt-manifest.json" in text and len(text.strip().splitlines()) == 1


def test_a_scrub_job_finds_a_flipped_bit_and_marks_the_checkpoint_damaged(source: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.executor import run_job
    from ckpt_service.settings import Settings

    out = tmp_path / "out"
    convert(str(source), str(out), ConvertOptions())
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        registered = client.post("/v1/checkpoints", json={"uri": str(out), "name": "exported"})
        assert registered.status_code == 201, registered.text
        store = client.app.state.service.store  # type: ignore[attr-defined]

        def scrub_job() -> dict:
            job = client.post("/v1/jobs", json={"kind": "scrub", "source": str(out)})
            assert job.status_code == 202, job.text
            claimed = store.claim("test-worker", 60.0)
            assert run_job(store, claimed.id, claimed.attempt) == 0
            return client.get(f"/v1/jobs/{job.json()['id']}").json()

        clean = scrub_job()
        assert clean["state"] == "succeeded" and clean["result"]["ok"] is True
        assert "damaged" not in client.get("/v1/checkpoints/exported").json()["tags"]
        size = os.path.getsize(out / "model.safetensors")
        flip(out / "model.safetensors", size - 5)
        found = scrub_job()
        tags = client.get("/v1/checkpoints/exported").json()["tags"]
    assert found["state"] == "failed" and found["result"]["ok"] is False
    assert f"{out / 'model.safetensors'}: bytes 0-{size} differ from the manifest's CRC-32" in found["error"]["message"]
    assert "damaged" in tags
