"""inspect reads metadata only; verify finds every kind of difference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import Sample, ckptctl

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


def test_inspect_reports_layout(fsdp2: dict[str, Sample], fsdp1: dict[str, Sample]) -> None:
    info = json.loads(ckptctl("inspect", fsdp2["fsdp2-dcp"].path, "--json", "--tensors").stdout)
    ref = fsdp2["fsdp2-dcp"].ref()
    assert info["format"] == "dcp" and info["world_size"] == 2 and info["has_optimizer"]
    model_rows = [r for r in info["tensor_table"] if r["name"].startswith("model.")]
    shapes = {r["name"][6:]: tuple(r["shape"]) for r in model_rows}
    assert shapes == {k: tuple(v.shape) for k, v in ref["model"].items()}
    assert info["dtypes"] == {"float32": info["tensors"]}
    rank = json.loads(ckptctl("inspect", fsdp1["rank-files-sharded"].path, "--json").stdout)
    assert rank["format"] == "rank-files" and rank["producer"] == "FSDP1 ShardedTensor" and rank["world_size"] == 2
    dt = json.loads(ckptctl("inspect", fsdp2["rank-files-dtensor"].path, "--json").stdout)
    assert dt["producer"] == "FSDP2 DTensor"
    hf = json.loads(ckptctl("inspect", fsdp2["hf-dcp"].path, "--json").stdout)
    assert hf["format"] == "hf-dcp" and hf["world_size"] == 2 and not hf["has_optimizer"]


def test_inspect_does_not_import_torch(fsdp2: dict[str, Sample]) -> None:
    code = ("import sys; from ckptctl import app; from converters import inspect; "
            f"inspect({str(fsdp2['fsdp2-dcp'].path)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_verify_identical_and_different(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    src = fsdp2["fsdp2-dcp"].path
    out = tmp_path / "export"
    ckptctl("export", src, out)
    proc = ckptctl("verify", src, out, "--only", "model")
    assert proc.returncode == 0 and proc.stdout.startswith("OK")
    # the other layouts of the same training state are identical too
    assert ckptctl("verify", fsdp2["rank-files-dtensor"].path, out, "--only", "model").stdout.startswith("OK")
    # change one value, drop one key, add one key
    tensors = load_file(out / "model.safetensors")
    tensors["norm.weight"] = tensors["norm.weight"].clone()
    tensors["norm.weight"][3] += 1e-3
    del tensors["lm_head.weight"]
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "changed.safetensors", metadata={"format": "pt"})
    proc = ckptctl("verify", src, tmp_path / "changed.safetensors", "--only", "model", "--json", check=False)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["different"] == ["norm.weight"] and report["missing"] == ["lm_head.weight"]
    assert report["extra"] == ["extra.weight"]
    assert abs(report["max_abs_diff"]["norm.weight"] - 1e-3) < 1e-4
    # a cast export differs from its source, but within tolerance
    ckptctl("export", src, tmp_path / "bf16", "--dtype", "bfloat16")
    assert ckptctl("verify", src, tmp_path / "bf16", "--only", "model", check=False).returncode == 1
    assert ckptctl("verify", src, tmp_path / "bf16", "--only", "model", "--atol", "0.05").stdout.startswith("OK")


def test_verify_against_an_export_compares_what_it_holds(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    """`verify SOURCE EXPORT` with no options: the export's manifest says it holds the model alone (under its
    names, cast as it was): that is what is compared, and the output says so."""
    src = fsdp2["fsdp2-dcp"].path
    out = tmp_path / "export"
    ckptctl("export", src, out, "--rename", r"^lm_head\.=head.")
    proc = ckptctl("verify", src, out)
    assert proc.stdout.startswith("OK identical: ")
    assert f"{out} is an export (model weights only): compared what it holds" in proc.stderr
    ckptctl("export", src, tmp_path / "bf16", "--dtype", "bfloat16")
    cast = ckptctl("verify", src, tmp_path / "bf16", "--json")
    report = json.loads(cast.stdout)
    assert report["ok"] and report["compared"] > 0 and report["missing"] == report["extra"] == []
    assert "cast to bfloat16" in report["notes"][0]
    # asked for another selection, the export is compared as asked: dtypes differ, and --rtol is the way
    asked = ckptctl("verify", src, tmp_path / "bf16", "--only", "model", check=False)
    assert asked.returncode == 1 and "only dtypes differ" in asked.stdout and "--rtol" in asked.stdout
    within = ckptctl("verify", src, tmp_path / "bf16", "--only", "model", "--rtol", "1e-2")
    assert within.stdout.startswith("OK equal within rtol=0.01, atol=0, max difference ")
    assert "identical" not in within.stdout
    tolerant = json.loads(ckptctl("verify", src, tmp_path / "bf16", "--only", "model", "--rtol", "1e-2",
                                  "--json").stdout)
    assert 0 < tolerant["tolerance"]["max_diff"] < 0.05 and tolerant["tolerance"]["rtol"] == 0.01
