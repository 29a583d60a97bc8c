"""Lightning Fabric FSDP checkpoints: `state_dict_type="sharded"` (DCP + meta.pt) and the single-file format.

The slow test saves with Lightning Fabric itself (tests/lightning_tool.py, 2 processes on CPU) and compares
with Lightning's own consolidation (`python -m lightning.fabric.utilities.consolidate_checkpoint`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from converters.formats import detect, load_index

from .conftest import assert_same_tensors, ckptctl

TOOL = Path(__file__).with_name("lightning_tool.py")


def test_meta_pt_is_training_state(tmp_path: Path) -> None:
    """The layout Fabric writes, made with torch's own dcp.save and torch.save."""
    ckpt = tmp_path / "sharded"
    weights = {"model": {"layer.weight": torch.arange(12.0).view(3, 4), "layer.bias": torch.ones(3)}}
    dcp.save(weights, checkpoint_id=str(ckpt))
    torch.save({"step": 11, "loops": {"fit_loop": {"epoch": 2}}}, ckpt / "meta.pt")
    assert detect(str(ckpt)) == "lightning"
    index = load_index(str(ckpt))
    assert index.producer == "Lightning (FSDP, sharded)" and index.files[-1] == "meta.pt"
    assert index.training_state == {"step", "loops.fit_loop.epoch"}
    out = tmp_path / "export"
    proc = ckptctl("export", ckpt, out, "-q")
    assert "left out training state beside the model (loops, step); --only all keeps it" in proc.stderr
    assert_same_tensors(load_file(out / "model.safetensors"), weights["model"])
    full = tmp_path / "all.pt"
    ckptctl("convert", ckpt, full, "--to", "torch", "--only", "all", "-q")
    got = torch.load(full, weights_only=True)
    assert (got["step"], got["loops"]) == (11, {"fit_loop": {"epoch": 2}})
    assert_same_tensors(got["model"], weights["model"])
    (ckpt / "meta.pt").write_bytes(b"not a zip")
    proc = ckptctl("inspect", ckpt, check=False)
    assert proc.returncode == 2 and "meta.pt" in proc.stderr


@pytest.fixture(scope="session")
def fabric_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lightning")
    for args in ([str(TOOL), str(root)],
                 ["-m", "lightning.fabric.utilities.consolidate_checkpoint", str(root / "sharded"), "--output_file",
                  str(root / "consolidated.ckpt")]):
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
def test_fabric_fsdp_matches_lightning_consolidation(fabric_fsdp: Path, tmp_path: Path) -> None:
    sharded, consolidated = fabric_fsdp / "sharded", fabric_fsdp / "consolidated.ckpt"
    want = torch.load(consolidated, weights_only=True)
    index = load_index(str(sharded))
    assert (index.format, index.world_size) == ("lightning", 2)
    assert index.training_state == {"step", "hparams.lr", "hparams.name"}
    # everything, tensor by tensor and value by value, against Lightning's own consolidation
    assert ckptctl("verify", sharded, consolidated, "--keep-keys").stdout.startswith("OK identical: 31 entries")
    full = tmp_path / "all.pt"
    ckptctl("convert", sharded, full, "--to", "torch", "-q", "--verify")
    got = torch.load(full, weights_only=True)
    assert_same_tensors(got["model"], want["model"])
    assert (got["step"], got["hparams"]) == (3, {"lr": 1e-3, "name": "tiny"})
    for fqn, state in want["optimizer"]["state"].items():
        assert_same_tensors(got["optimizer"]["state"][fqn], state)
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    # exports hold the model weights only, from either format
    for source in (sharded, consolidated):
        out = tmp_path / source.name
        ckptctl("export", source, out, "-q", "--verify")
        assert_same_tensors(load_file(out / "model.safetensors"), want["model"])
