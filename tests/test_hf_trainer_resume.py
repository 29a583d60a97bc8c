"""`ckptctl reshard` keeps the Hugging Face Trainer's checkpoint layout, so `Trainer.train(resume_from_checkpoint=…)`
resumes from the output at the new world size exactly as from the Trainer's own checkpoint.

The slow test trains with the Trainer itself under Accelerate FSDP (FSDP1 and FSDP2) on CPU with gloo
(tests/hf_trainer_tool.py, launched by torchrun). The fast tests build the same folder layout with `dcp.save`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_service.helpers import free_port

from .conftest import ckptctl

TOOL = Path(__file__).with_name("hf_trainer_tool.py")


def train(version: int, out: Path, ranks: int, steps: int, resume: Path | None = None) -> dict[str, float]:
    """Run the Trainer at `ranks` ranks up to `steps` (saving `out/checkpoint-STEPS`); its logged losses."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            str(free_port()), str(TOOL), str(version), str(out), str(steps), *([str(resume)] if resume else [])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "losses.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_trainer_resumes_from_a_reshard_as_from_its_own_checkpoint(version: int, tmp_path: Path) -> None:
    train(version, tmp_path / "run", 2, 2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    ckptctl("reshard", ckpt, tmp_path / "ws3", "--world-size", "3", "--verify", "-q")
    manifest = json.loads((tmp_path / "ws3" / "ckpt-manifest.json").read_text())
    assert manifest["layout"]["per_rank"] == {"rng_state_0.pth": "rng_state_0.pth",
                                              "rng_state_1.pth": "rng_state_1.pth",
                                              "rng_state_2.pth": "rng_state_0.pth"}
    for name in ("scheduler.pt", "trainer_state.json", "rng_state_1.pth"):
        assert (tmp_path / "ws3" / name).read_bytes() == (ckpt / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "ws3" / "optimizer_0").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # the Trainer's own resume at 3 ranks, from its checkpoint and from the reshard: the same next steps, bit for
    # bit (dropout is off and the sampler is seeded, so nothing else differs; rank 2 has no RNG state of its own
    # in the original, and rank 0's in the reshard, which nothing in these steps draws from)
    want = train(version, tmp_path / "from-original", 3, 4, ckpt)
    got = train(version, tmp_path / "from-reshard", 3, 4, tmp_path / "ws3")
    assert set(got) == {"1", "2", "3", "4"} and got == want
    proc = ckptctl("verify", tmp_path / "from-original" / "checkpoint-4", tmp_path / "from-reshard" / "checkpoint-4",
                   "--keep-keys")
    assert proc.stdout.startswith("OK identical: ")


def accelerate_folder(root: Path, ranks: int = 2) -> Path:
    """The Trainer's checkpoint-N layout, written with torch's own dcp.save and torch.save."""
    ckpt = root / "checkpoint-2"
    dcp.save({"model": {"w": torch.arange(12.0).view(6, 2)}}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": {"state": {"w": {"exp_avg": torch.ones(6, 2), "step": torch.tensor(2.0)}},
                            "param_groups": [{"lr": 0.1, "params": ["w"]}]}},
             checkpoint_id=str(ckpt / "optimizer_0"))
    torch.save({"last_epoch": 2}, ckpt / "scheduler.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    for rank in range(ranks):
        torch.save({"python": rank}, ckpt / f"rng_state_{rank}.pth")
    return ckpt


def test_reshard_keeps_the_accelerate_layout(tmp_path: Path) -> None:
    ckpt = accelerate_folder(tmp_path)
    out = tmp_path / "ws3"
    proc = ckptctl("reshard", ckpt, out, "--world-size", "3", "--verify")
    assert "rng_state_2.pth <- rng_state_0.pth" in proc.stderr
    for name, origin in {"scheduler.pt": "scheduler.pt", "trainer_state.json": "trainer_state.json",
                         "rng_state_0.pth": "rng_state_0.pth", "rng_state_1.pth": "rng_state_1.pth",
                         "rng_state_2.pth": "rng_state_0.pth"}.items():
        assert (out / name).read_bytes() == (ckpt / origin).read_bytes(), name
    model = {"model": {"w": torch.zeros(6, 2)}}
    dcp.load(model, checkpoint_id=str(out / "pytorch_model_fsdp_0"))
    assert torch.equal(model["model"]["w"], torch.arange(12.0).view(6, 2))
    # each folder holds its own entries, three ranks' files of them
    for folder, key in (("pytorch_model_fsdp_0", "model.w"), ("optimizer_0", "optimizer.state.w.exp_avg")):
        meta = dcp.FileSystemReader(str(out / folder)).read_metadata()
        assert key in meta.state_dict_metadata and len(meta.state_dict_metadata[key].chunks) == 3, folder
        assert not any(k.startswith("optimizer" if folder.startswith("pytorch") else "model.")
                       for k in meta.state_dict_metadata)
    assert ckptctl("inspect", out).stdout.split("format:")[1].split()[0] == "accelerate"
    # today's flat DCP folder, when asked for
    flat = tmp_path / "flat"
    ckptctl("reshard", ckpt, flat, "--world-size", "3", "--output-layout", "flat", "-q")
    assert (flat / ".metadata").is_file() and not (flat / "scheduler.pt").exists()
    # a selection is not a training state the Trainer resumes from: refused, one line naming the way out
    proc = ckptctl("reshard", ckpt, tmp_path / "model", "--world-size", "3", "--only", "model", check=False)
    assert proc.returncode == 2 and "--output-layout flat" in proc.stderr and not (tmp_path / "model").exists()


def test_reshard_refuses_per_rank_files_with_a_gap(tmp_path: Path) -> None:
    ckpt = accelerate_folder(tmp_path, ranks=3)
    (ckpt / "rng_state_1.pth").unlink()
    proc = ckptctl("reshard", ckpt, tmp_path / "out", "--world-size", "2", check=False)
    assert proc.returncode == 2 and "rng_state_0.pth, rng_state_2.pth do not number the ranks" in proc.stderr
    assert not (tmp_path / "out").exists()


def megatron_folder(ckpt: Path) -> None:
    """A Megatron-core torch_dist save (DCP + metadata.json + common.pt), written with torch itself."""
    dcp.save({"decoder.layers.mlp.linear_fc2.weight": torch.arange(24.0).view(2, 3, 4),
              "decoder.final_layernorm.weight": torch.arange(6.0)}, checkpoint_id=str(ckpt))
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"iteration": 5}, ckpt / "common.pt")


def test_reshard_keeps_the_megatron_layout_and_refuses_nemo(tmp_path: Path) -> None:
    """Megatron-LM's save folder: `latest_checkpointed_iteration.txt` and `iter_0000005/` (its DCP resharded, the
    other files copied). A NeMo 2 folder (weights/ + context/) is refused in one line naming
    `--output-layout flat`, which writes one DCP folder."""
    run = tmp_path / "run"
    megatron_folder(run / "iter_0000005")
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    ckptctl("reshard", run, tmp_path / "ws3", "--world-size", "3", "--verify", "-q")
    kept = tmp_path / "ws3" / "iter_0000005"
    for name in ("latest_checkpointed_iteration.txt", "iter_0000005/metadata.json", "iter_0000005/common.pt"):
        assert (tmp_path / "ws3" / name).read_bytes() == (run / name).read_bytes(), name
    meta = dcp.FileSystemReader(str(kept)).read_metadata().state_dict_metadata
    assert set(meta) == {"decoder.layers.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"}
    assert sorted(p.name for p in kept.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    nemo = tmp_path / "nemo"
    megatron_folder(nemo / "weights")
    (nemo / "context").mkdir()
    proc = ckptctl("reshard", nemo, tmp_path / "nemo3", "--world-size", "3", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "NeMo 2" in lines[0], proc.stderr
    assert "--output-layout flat" in lines[0] and not (tmp_path / "nemo3").exists()
    ckptctl("reshard", nemo, tmp_path / "nemo3", "--world-size", "3", "--output-layout", "flat", "-q")
    assert (tmp_path / "nemo3" / ".metadata").is_file()


def test_hostile_side_files_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A side file the layout copies that is a FIFO, or larger than the cap: one line naming it, nothing written."""
    import os

    ckpt = accelerate_folder(tmp_path)
    (ckpt / "scheduler.pt").unlink()
    os.mkfifo(ckpt / "scheduler.pt")
    proc = ckptctl("reshard", ckpt, tmp_path / "out", "--world-size", "3", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "scheduler.pt" in lines[0], proc.stderr
    (ckpt / "scheduler.pt").unlink()
    with open(ckpt / "scheduler.pt", "wb") as fh:
        fh.truncate(65 << 20)  # sparse: 65 MiB on paper
    proc = ckptctl("reshard", ckpt, tmp_path / "out", "--world-size", "3", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "scheduler.pt: 68157440 bytes" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*out*"))
