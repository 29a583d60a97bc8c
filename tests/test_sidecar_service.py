"""A single-file output's manifest beside it (`<file>.ckpt-manifest.json`, converters.certificate) in the service:
GC's removal and a retried or cancelled job's clean-up delete it with its file, and `inspect`'s certificate cover
reads it. The output is the engine's conversion of a DCP checkpoint torch's dcp.save wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_service import roots
from ckpt_service.executor import clean_target
from ckpt_service.retention import remove_checkpoint
from ckpt_service.summary import summarize
from converters import ConvertOptions, convert, load_index
from converters.names import MANIFEST

from .s3server import S3, s3_fixture, s3_server_fixture  # noqa: F401  (fixtures s3 and s3_server)


def single_file(tmp_path: Path) -> tuple[Path, Path]:
    """(model.safetensors converted from a real DCP checkpoint, the manifest beside it)."""
    torch.manual_seed(0)
    source = tmp_path / "dcp"
    dcp.save({"model": {"a.weight": torch.randn(8, 4), "a.bias": torch.randn(4)}}, checkpoint_id=str(source),
             no_dist=True)
    out = tmp_path / "out" / "model.safetensors"
    convert(str(source), str(out), ConvertOptions(to="safetensors"))
    beside = out.parent / f"model.safetensors.{MANIFEST}"
    assert beside.is_file()
    return out, beside


def test_gc_removal_deletes_a_single_files_manifest_with_it(tmp_path: Path) -> None:
    out, _ = single_file(tmp_path)
    other = out.parent / "other.safetensors"
    other.write_bytes(b"x")
    remove_checkpoint(str(out), [roots.parse_root(str(tmp_path))])
    assert sorted(p.name for p in out.parent.iterdir()) == ["other.safetensors"]


def test_gc_removal_unlinks_a_symlinked_manifest_without_following_it(tmp_path: Path) -> None:
    out, beside = single_file(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    beside.unlink()
    beside.symlink_to(elsewhere)
    remove_checkpoint(str(out), [roots.parse_root(str(tmp_path))])
    assert list(out.parent.iterdir()) == [] and elsewhere.read_text() == "{}"


def test_a_cancelled_jobs_clean_up_removes_the_file_its_manifest_and_their_temporaries(tmp_path: Path) -> None:
    out, beside = single_file(tmp_path)
    half = out.parent / f".model.safetensors.{MANIFEST}.0123abcd"  # write_sidecar's temporary name
    half.write_text("{")
    removed = clean_target(str(out), overwrite=False)
    assert sorted(Path(p).name for p in removed) == sorted([half.name, out.name, beside.name])
    assert list(out.parent.iterdir()) == []


def test_an_overwriting_jobs_clean_up_keeps_the_file_and_its_manifest(tmp_path: Path) -> None:
    out, beside = single_file(tmp_path)
    assert clean_target(str(out), overwrite=True) == []
    assert out.is_file() and beside.is_file()


def test_inspect_reads_a_single_files_certificate_from_its_manifest(tmp_path: Path) -> None:
    out, beside = single_file(tmp_path)
    doc = json.loads(beside.read_text())
    assert summarize(load_index(str(out)))["certificate"] == {
        "tensors": 2, "files": 1, "source_files": 1, "stats": False}
    assert "stats" not in doc["certificate"]
    beside.unlink()
    assert "certificate" not in summarize(load_index(str(out)))


@pytest.mark.slow
def test_gc_removal_on_s3_deletes_the_manifest_beside_the_file(s3: S3, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = tmp_path / "dcp"
    dcp.save({"model": {"a.weight": torch.randn(8, 4)}}, checkpoint_id=str(source), no_dist=True)
    out = s3.uri("exports/one/model.safetensors")
    convert(str(source), out, ConvertOptions(to="safetensors"))
    assert s3.keys("exports/one") == ["model.safetensors", f"model.safetensors.{MANIFEST}"]
    remove_checkpoint(out, [roots.parse_root(s3.uri("exports"))])
    assert s3.keys("exports") == []
