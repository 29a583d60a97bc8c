"""Lightning Fabric FSDP checkpoints: `state_dict_type="sharded"` (DCP + meta.pt) and the single-file format.

The slow test saves with Lightning Fabric itself (tests/lightning_tool.py, 2 processes on CPU) and compares
with Lightning's own consolidation (`python -m lightning.fabric.utilities.consolidate_checkpoint`).
"""

from __future__ import annotations

import json
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
    # a reshard keeps Lightning's layout: the DCP folder resharded, meta.pt beside it (its bytes), nothing of
    # meta.pt folded into the DCP
    ws3 = tmp_path / "ws3"
    ckptctl("reshard", ckpt, ws3, "--world-size", "3", "--verify", "-q")
    assert (ws3 / "meta.pt").read_bytes() == (ckpt / "meta.pt").read_bytes()
    assert set(dcp.FileSystemReader(str(ws3)).read_metadata().state_dict_metadata) == {"model.layer.weight",
                                                                                      "model.layer.bias"}
    assert (detect(str(ws3)), load_index(str(ws3)).training_state) == ("lightning", {"step", "loops.fit_loop.epoch"})
    flat = tmp_path / "flat"
    ckptctl("reshard", ckpt, flat, "--world-size", "3", "--output-layout", "flat", "-q")
    assert not (flat / "meta.pt").exists() and "step" in dcp.FileSystemReader(str(flat)).read_metadata(
    ).state_dict_metadata
    (ckpt / "meta.pt").write_bytes(b"not a zip")
    proc = ckptctl("inspect", ckpt, check=False)
    assert proc.returncode == 2 and "meta.pt" in proc.stderr


@pytest.fixture(scope="session")
def fabric_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lightning")
    for args in ([str(TOOL), str(root)],
                 ["-m", "lightning.fabric.utilities.consolidate_checkpoint", str(root / "sharded")]):
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
def test_fabric_fsdp_matches_lightning_consolidation(fabric_fsdp: Path, tmp_path: Path) -> None:
    sharded, consolidated = fabric_fsdp / "sharded", fabric_fsdp / "sharded.consolidated"  # Lightning's own name
    want = torch.load(consolidated, weights_only=True)
    index = load_index(str(sharded))
    assert (index.format, index.world_size) == ("lightning", 2)
    assert index.training_state == {"step", "hparams.lr", "hparams.name"}
    # everything, tensor by tensor and value by value, against Lightning's own consolidation (a torch file by its
    # content: the name ends in .consolidated)
    assert ckptctl("verify", sharded, consolidated, "--keep-keys").stdout.startswith("OK identical: 31 entries")
    assert ckptctl("verify", sharded, consolidated).stdout.startswith("OK identical: 31 entries")
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


def test_a_torch_file_is_known_by_its_content(tmp_path: Path) -> None:
    """Lightning's consolidation writes `CKPT.consolidated`: a torch.save file whatever its name."""
    weights = {"layer.weight": torch.arange(6.0).view(2, 3)}
    torch.save({"model": weights, "step": 4}, tmp_path / "epoch=1.ckpt.consolidated")
    dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "sharded"))
    torch.save({"step": 4}, tmp_path / "sharded" / "meta.pt")
    proc = ckptctl("verify", tmp_path / "sharded", tmp_path / "epoch=1.ckpt.consolidated")
    assert proc.stdout.startswith("OK identical: 2 entries")
    (tmp_path / "other.consolidated").write_bytes(b"PK\x03\x04" + bytes(40))
    proc = ckptctl("inspect", tmp_path / "other.consolidated", check=False)
    assert proc.returncode == 2 and "unknown file type" in proc.stderr


@pytest.mark.slow
def test_fabric_resumes_from_a_reshard_as_from_its_own_checkpoint(fabric_fsdp: Path, tmp_path: Path) -> None:
    """Saved by Fabric at 2 ranks, resharded to 3; `fabric.load` at 3 ranks from either, then two more steps: the
    same losses and the same saved state, bit for bit."""
    ckptctl("reshard", fabric_fsdp / "sharded", tmp_path / "ws3", "--world-size", "3", "--verify", "-q")
    for run, source in (("from-original", fabric_fsdp / "sharded"), ("from-reshard", tmp_path / "ws3")):
        proc = subprocess.run([sys.executable, str(TOOL), str(tmp_path / run), str(source), "3"], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = (json.loads((tmp_path / run / "losses.json").read_text()) for run in ("from-original", "from-reshard"))
    assert got == want and got["step"] == 5 and len(got["losses"]) == 2
    proc = ckptctl("verify", tmp_path / "from-original" / "resumed", tmp_path / "from-reshard" / "resumed",
                   "--keep-keys")
    assert proc.stdout.startswith("OK identical: 31 entries")


@pytest.mark.slow
def test_trainer_resumes_from_a_reshard_as_from_its_own_checkpoint(tmp_path: Path) -> None:
    """Lightning's `Trainer` with `FSDPStrategy(state_dict_type="sharded")`: saved at 2 ranks, resharded to 3;
    `trainer.fit(ckpt_path=…)` at 3 ranks from either runs the same next two steps, bit for bit, and saves the same
    state (the ModelCheckpoint callback's own paths name each run's folder, so they are left out)."""

    def fit(run: str, devices: int, steps: int, resume: Path | None = None) -> list[float]:
        args = [str(TOOL), "trainer", str(tmp_path / run), str(devices), str(steps), *([str(resume)] if resume else [])]
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((tmp_path / run / "losses.json").read_text())

    fit("run", 2, 2)
    ckpt = tmp_path / "run" / "last.ckpt"
    ckptctl("reshard", ckpt, tmp_path / "ws3", "--world-size", "3", "--verify", "-q")
    assert (tmp_path / "ws3" / "meta.pt").read_bytes() == (ckpt / "meta.pt").read_bytes()
    want, got = fit("from-original", 3, 4, ckpt), fit("from-reshard", 3, 4, tmp_path / "ws3")
    assert len(got) == 2 and got == want
    proc = ckptctl("verify", tmp_path / "from-original" / "last.ckpt", tmp_path / "from-reshard" / "last.ckpt",
                   "--keep-keys", "--exclude", "callbacks.*")
    assert proc.stdout.startswith("OK identical: ")
