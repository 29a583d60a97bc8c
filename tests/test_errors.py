"""Bad input: one clear line, a non-zero exit, and nothing left behind."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from converters.errors import UnsafePickleError
from converters.formats import load_index

from .conftest import Sample, ckptctl


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_refused_without_running(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(fsdp2["fsdp2-dcp"].path, bad)
    marker = tmp_path / "pwned"
    (bad / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafePickleError, match="system"):
        load_index(str(bad))
    proc = ckptctl("export", bad, tmp_path / "out", check=False)
    assert proc.returncode == 2 and "not on the allow-list" in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_malicious_rank_file_is_refused(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    import torch

    folder = tmp_path / "ranks"
    folder.mkdir()
    marker = tmp_path / "pwned"
    for rank in range(2):
        torch.save({"w": torch.ones(2), "x": _Payload(marker)}, folder / f"rank{rank}.pt")
    proc = ckptctl("inspect", folder, check=False)
    assert proc.returncode == 2 and "posix.system" in proc.stderr
    assert not marker.exists()


def test_truncated_distcp_names_the_file(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    bad = tmp_path / "trunc"
    shutil.copytree(fsdp2["fsdp2-dcp"].path, bad)
    data = bad / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    proc = ckptctl("export", bad, tmp_path / "out", check=False)
    assert proc.returncode == 2 and "__1_0.distcp" in proc.stderr and "truncated" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir())


def test_missing_distcp_file(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    bad = tmp_path / "missing"
    shutil.copytree(fsdp2["fsdp2-dcp"].path, bad)
    (bad / "__0_0.distcp").unlink()
    proc = ckptctl("inspect", bad, check=False)  # metadata only: still answers
    assert proc.returncode == 0
    proc = ckptctl("export", bad, tmp_path / "out", check=False)
    assert proc.returncode == 2 and "__0_0.distcp" in proc.stderr and "missing" in proc.stderr


def test_not_a_metadata_pickle(tmp_path: Path) -> None:
    bad = tmp_path / "notdcp"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps({"hello": 1}))
    proc = ckptctl("inspect", bad, check=False)
    assert proc.returncode == 2 and "not a DCP metadata pickle" in proc.stderr
    (bad / ".metadata").write_bytes(b"garbage, not a pickle")
    proc = ckptctl("inspect", bad, check=False)
    assert proc.returncode == 2 and ".metadata" in proc.stderr


def test_wrong_folder_names_the_subfolders(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    parent = tmp_path / "checkpoint-2000"
    parent.mkdir()
    shutil.copytree(fsdp2["fsdp2-dcp"].path, parent / "pytorch_model_fsdp_0")
    shutil.copytree(fsdp2["fsdp2-dcp"].path, parent / "pytorch_model_fsdp_1")
    proc = ckptctl("inspect", parent, check=False)
    assert proc.returncode == 2
    assert "pytorch_model_fsdp_0" in proc.stderr and "pytorch_model_fsdp_1" in proc.stderr


def test_missing_path_existing_target_unknown_format(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    proc = ckptctl("inspect", tmp_path / "nope", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    target = tmp_path / "exists"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    proc = ckptctl("export", fsdp2["fsdp2-dcp"].path, target, check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert (target / "keep.txt").read_text() == "mine"
    ckptctl("export", fsdp2["fsdp2-dcp"].path, target, "--overwrite")
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").exists()
    proc = ckptctl("export", fsdp2["fsdp2-dcp"].path, tmp_path / "x", "--from", "zarr", check=False)
    assert proc.returncode == 2 and "unknown format" in proc.stderr
    proc = ckptctl("export", fsdp2["fsdp2-dcp"].path, tmp_path / "x", "--dtype", "int8", check=False)
    assert proc.returncode == 2 and "--dtype" in proc.stderr


def test_disk_full_leaves_nothing(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    """A real small filesystem (tmpfs) that fills up mid-write."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=64k tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        proc = ckptctl("export", fsdp2["fsdp2-dcp"].path, mount / "out", check=False)
        assert proc.returncode == 2 and "disk full" in proc.stderr
        assert list(mount.iterdir()) == []
    finally:
        os.system(f"umount {mount}")
