"""Conversion certificates (`converters.certificate`), `verify --certificate` and scrub.

Sources are real DCP checkpoints written by torch's own dcp.save; outputs are read back with safetensors and
torch's dcp.load as oracles; single bits are flipped in output and source files and must be found, by name
and byte range.
"""

from __future__ import annotations

import json
import math
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
    stats = certificate(with_stats)["stats"]
    assert {side["check"] for side in stats.values()} == {"equal"}
    for name, tensor in weights().items():  # computed on the page cache the kernel copied from, as torch gives them
        got, want = stats[name]["source"], tensor.double()
        assert (got["count"], got["min"], got["max"]) == (want.numel(), want.min().item(), want.max().item())
        assert got["l2"] == pytest.approx(want.norm().item(), rel=1e-12)
        assert got["mean"] == pytest.approx(want.mean().item(), rel=1e-12, abs=1e-15)


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


# --- outputs made by computing (GGUF, FP8, merged adapters), renaming (an adapter alone) or as one file ----------


def tiny_llama(folder: Path) -> Path:
    """A random tiny Llama saved by transformers itself, with a byte-level BPE tokenizer trained here (GGUF needs
    one)."""
    from .test_gguf_export import LLAMA3_SPLIT, _model

    assert LLAMA3_SPLIT
    return _model("llama", folder, torch.float32)


def lora_folder(base: Path, folder: Path) -> Path:
    """A PEFT LoRA adapter on `base`, saved by PEFT (random A and B, as after training)."""
    from .test_adapters import peft_model

    peft_model(base, "lora").save_pretrained(folder)
    return folder


def make(kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """(the output of `kind`, the file of it to damage) made by the engine from checkpoints real tools saved."""
    from converters.adapters import export_adapter, export_merged
    from converters.gguf_export import export_gguf
    from converters.quantize.export import export_fp8

    if kind in ("safetensors-file", "torch-file"):
        source = tmp_path / "dcp"
        dcp.save({"model": weights()}, checkpoint_id=str(source), no_dist=True)
        out = tmp_path / ("model.safetensors" if kind == "safetensors-file" else "model.pt")
        convert(str(source), str(out), ConvertOptions(to="safetensors" if kind == "safetensors-file" else "torch"))
        return out, out
    if kind in ("gguf", "fp8"):
        source = tiny_llama(tmp_path / "llama")
        if kind == "gguf":
            out = tmp_path / "model.gguf"
            export_gguf(str(source), str(out), "q8_0")
            return out, out
        export_fp8(str(source), str(tmp_path / "fp8"), "FP8_BLOCK")
        return tmp_path / "fp8", tmp_path / "fp8" / "model.safetensors"
    from .test_adapters import tiny_base

    base = tiny_base(tmp_path / "base")
    adapter = lora_folder(base, tmp_path / "adapter")
    if kind == "adapter":
        export_adapter(str(adapter), str(tmp_path / "peft"))
        return tmp_path / "peft", tmp_path / "peft" / "adapter_model.safetensors"
    export_merged(str(adapter), str(tmp_path / "merged"), str(base))
    return tmp_path / "merged", tmp_path / "merged" / "model.safetensors"


def manifest_doc(out: Path) -> dict:
    where = out / MANIFEST if out.is_dir() else out.parent / f"{out.name}.{MANIFEST}"
    return json.loads(where.read_text())


@pytest.mark.parametrize("kind", ["safetensors-file", "torch-file", "gguf", "fp8", "adapter", "merged"])
def test_every_output_kind_has_a_certificate_that_finds_a_flipped_bit(tmp_path: Path, kind: str) -> None:
    out, damaged_file = make(kind, tmp_path)
    doc = manifest_doc(out)
    files = doc["files"]
    assert files[damaged_file.name]["crc32"] == zlib.crc32(damaged_file.read_bytes())
    data = damaged_file.read_bytes()
    assert files[damaged_file.name]["blocks"] == [zlib.crc32(data[i:i + (16 << 20)])
                                                  for i in range(0, len(data), 16 << 20)]
    cert = doc["certificate"]
    source = Path(cert["source"]["uri"])
    read = cert.get("read") or {n: [p for p in pieces if "ranges" in p] for n, pieces in cert["tensors"].items()}
    assert read and all(p["ranges"] for pieces in read.values() for p in pieces)
    for pieces in read.values():  # what was read, as the source holds it now
        for piece in pieces:
            if piece["box"] is None and len(piece["ranges"]) == 1 and piece["ranges"][0][5] is None:
                file, offset, length = piece["ranges"][0][:3]
                raw = ((source / file) if not Path(file).is_absolute() else Path(file)).read_bytes()
                assert piece["source_crc32"] == zlib.crc32(raw[offset:offset + length])
    if kind in ("fp8", "adapter", "merged"):  # each output tensor's CRC-32, as safetensors reads it back
        loaded = load_file(str(damaged_file))
        assert cert["derived"] == {"fp8": "fp8", "adapter": "adapter", "merged": "merge"}[kind]
        for name, tensor in loaded.items():
            (piece,) = cert["tensors"][name]
            assert piece["crc32"] == zlib.crc32(tensor.contiguous().view(torch.uint8).numpy().tobytes()), name
    report = check_certificate(str(out))
    assert report.ok, report.damaged
    assert report.source_ranges == sum(len(p) for p in read.values())
    code, text = ckptctl("verify", "--certificate", str(out))
    assert code == 0, text
    size = damaged_file.stat().st_size
    flip(damaged_file, size - 3)
    report = check_certificate(str(out))
    assert not report.ok
    assert report.damaged[0] == f"{damaged_file}: bytes 0-{size} differ from the manifest's CRC-32"
    code, text = ckptctl("verify", "--certificate", str(out))
    assert code == 1 and f"{damaged_file}: bytes 0-{size} differ" in text
    assert not scrub(str(out)).ok
    name, piece = next((n, p) for n, pieces in sorted(read.items()) for p in pieces if p["ranges"][0][2])
    file, offset, length = piece["ranges"][0][:3]
    path = source / file if not Path(file).is_absolute() else Path(file)
    flip(path, offset + length // 2)  # a bit of what the export read, in the source
    assert f"source {path} bytes {offset}-{offset + length} (tensor {name}) differ from what the conversion read" \
        in check_certificate(str(out)).damaged


def big_weights() -> dict[str, torch.Tensor]:
    """Tensors whose bytes cross the manifest's 16 MiB blocks at odd places, in every kind of output."""
    torch.manual_seed(1)
    return {"a.weight": torch.randn(1000, 4099), "b.weight": torch.randn(777, 3001).half(),
            "c.bias": torch.randn(12345), "d.weight": torch.randn(2048, 2500), "e": torch.arange(7)}


def recomputed(out: Path) -> dict[str, tuple[int, list[int]]]:
    """Every output file's CRC-32 and 16 MiB block CRC-32s, recomputed from the files on disk with zlib."""
    found = {}
    for name in json.loads(manifest_file(out).read_text())["files"]:
        data = (out / name if out.is_dir() else out).read_bytes()
        found[name] = (zlib.crc32(data), [zlib.crc32(data[i:i + (16 << 20)]) for i in range(0, len(data), 16 << 20)])
    return found


def manifest_file(out: Path) -> Path:
    return out / MANIFEST if out.is_dir() else out.with_name(f"{out.name}.{MANIFEST}")


@pytest.mark.parametrize("readback", [False, True])
def test_recorded_file_and_block_crcs_equal_the_files_on_disk(tmp_path: Path, readback: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from converters import certificate as cert_mod

    monkeypatch.setattr(cert_mod, "READBACK", readback)
    source = tmp_path / "dcp"
    dcp.save({"model": big_weights()}, checkpoint_id=str(source), no_dist=True)
    read_back: list[str] = []
    real = cert_mod.mapped_crcs

    def spy(path: str, *args: object, **kwargs: object) -> object:
        read_back.append(os.path.basename(path))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cert_mod, "mapped_crcs", spy)
    outputs = {"export": (tmp_path / "export", ConvertOptions(export=True)),
               "torch": (tmp_path / "model.pt", ConvertOptions(to="torch")),
               "reshard": (tmp_path / "resharded", ReshardOptions(world_size=2)),
               # statistics are taken in the same mappings as the CRC-32s: still nothing read back
               "export --stats": (tmp_path / "export-stats", ConvertOptions(export=True, stats=True)),
               "torch --stats": (tmp_path / "stats.pt", ConvertOptions(to="torch", stats=True)),
               "reshard --stats": (tmp_path / "resharded-stats", ReshardOptions(world_size=2, stats=True))}
    for kind, (out, options) in outputs.items():
        read_back.clear()
        if isinstance(options, ReshardOptions):
            reshard(str(source), str(out), options)
        else:
            convert(str(source), str(out), options)
        files = json.loads(manifest_file(out).read_text())["files"]
        assert any(info["bytes"] > 16 << 20 for info in files.values()), kind
        assert {name: (info["crc32"], info["blocks"]) for name, info in files.items()} == recomputed(out), kind
        assert check_certificate(str(out)).ok, kind
        # every byte was checksummed as it was written: no output file is read back (DCP's .metadata is)
        assert len(read_back) == (len(files) if readback else sum(n == ".metadata" for n in files)), kind
        if "stats" in kind:  # and every tensor's statistics were taken, once: those of the source
            stats = json.loads(manifest_file(out).read_text())["certificate"]["stats"]
            assert len(stats) == len(big_weights()), kind
            for name, tensor in big_weights().items():
                side = next(v for k, v in stats.items() if k.removeprefix("model.") == name)  # keys as cleaned
                assert side["check"] == "equal" and side["source"]["count"] == tensor.numel(), kind
                assert math.isclose(side["source"]["mean"], tensor.double().mean().item(), rel_tol=1e-12,
                                    abs_tol=1e-15), kind
