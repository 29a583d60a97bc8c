"""Every input layout exports to safetensors/torch with each tensor equal to the unsharded model's."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from converters.api import ConvertOptions, convert

from .conftest import FSDP1_LAYOUTS, FSDP2_LAYOUTS, Sample, assert_same_tensors, ckptctl

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


def load_export(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


@pytest.mark.parametrize("layout", FSDP2_LAYOUTS + FSDP1_LAYOUTS)
def test_export_every_layout_matches_reference(layout: str, fsdp1: dict[str, Sample], fsdp2: dict[str, Sample],
                                               tmp_path: Path) -> None:
    sample = {**fsdp1, **fsdp2}[layout]
    target = tmp_path / "export"
    ckptctl("export", sample.path, target, "--quiet")
    assert_same_tensors(load_export(target), sample.ref()["model"])


@pytest.mark.parametrize("layout", ["fsdp2-dcp", "fsdp1-dcp", "accelerate", "rank-files-sharded"])
def test_convert_torch_keeps_model_and_optimizer(layout: str, fsdp1: dict[str, Sample], fsdp2: dict[str, Sample],
                                                 tmp_path: Path) -> None:
    sample = {**fsdp1, **fsdp2}[layout]
    target = tmp_path / "full.pt"
    ckptctl("convert", sample.path, target, "--to", "torch", "--only", "all", "--clean-keys", "--verify")
    got = torch.load(target, weights_only=True)
    assert zipfile.ZipFile(target).testzip() is None  # every CRC-32 is right
    ref = sample.ref()
    assert_same_tensors(got["model"], ref["model"])
    assert sorted(got["optim"]["state"]) == sorted(ref["optim"]["state"])
    for fqn, state in ref["optim"]["state"].items():
        assert_same_tensors(got["optim"]["state"][fqn], state)
    got_group, ref_group = got["optim"]["param_groups"][0], ref["optim"]["param_groups"][0]
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert got_group[key] == ref_group[key], key
    assert sorted(got_group["params"]) == sorted(ref_group["params"])


def test_accelerate_parent_folder_reads_model_and_optimizer(fsdp1: dict[str, Sample], tmp_path: Path) -> None:
    info = json.loads(ckptctl("inspect", fsdp1["accelerate"].path, "--json").stdout)
    assert info["format"] == "accelerate" and info["producer"] == "Accelerate"
    assert info["has_optimizer"] and info["world_size"] == 2
    optim_only = tmp_path / "optim.pt"
    ckptctl("convert", fsdp1["accelerate"].path, optim_only, "--to", "torch", "--only", "optim", "--clean-keys")
    got = torch.load(optim_only, weights_only=True)
    ref = fsdp1["accelerate"].ref()["optim"]
    assert sorted(got["state"]) == sorted(ref["state"])
    assert torch.equal(got["state"]["tok_emb.weight"]["exp_avg"], ref["state"]["tok_emb.weight"]["exp_avg"])


def test_export_bfloat16_casts_floats_only(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    sample = fsdp2["fsdp2-dcp"]
    target = tmp_path / "bf16"
    ckptctl("export", sample.path, target, "--dtype", "bfloat16", "--max-shard-size", "100KB", "--verify")
    ref = {k: v.to(torch.bfloat16) for k, v in sample.ref()["model"].items()}
    got = load_export(target)
    assert_same_tensors(got, ref)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in ref.values())
    for name in files:
        assert (target / name).stat().st_size <= 100_000 + 64 * 1024  # one tensor may overflow a shard


def test_cast_never_touches_integer_tensors(tmp_path: Path) -> None:
    src = tmp_path / "mixed.pt"
    sd = {"w": torch.randn(7, 3), "ids": torch.arange(10, dtype=torch.int64), "mask": torch.tensor([True, False]),
          "h": torch.randn(4, dtype=torch.float16)}
    torch.save(sd, src)
    convert(str(src), str(tmp_path / "out"), ConvertOptions(dtype="bfloat16"))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], sd["ids"])
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], sd["mask"])
    assert torch.equal(got["w"], sd["w"].bfloat16()) and torch.equal(got["h"], sd["h"].bfloat16())


def test_cast_and_copy_across_many_slabs(tmp_path: Path) -> None:
    """Tensors far larger than one slab (a 1MiB memory limit) come out exact, cast or not."""
    src = tmp_path / "big.pt"
    sd = {"a": torch.randn(1001, 333) * 1e3, "b": torch.randn(777, 129).double(), "c": torch.randn(5000).half(),
          "t": torch.randn(300, 400).t(), "s": torch.tensor(3.5)}
    sd["a"][0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    torch.save(sd, src)
    for dtype in (None, "bfloat16", "float16", "float32"):
        out = tmp_path / f"out-{dtype}"
        convert(str(src), str(out), ConvertOptions(dtype=dtype, memory_limit=1024 * 1024, verify=True))
        got = load_file(out / "model.safetensors")
        for name, tensor in sd.items():
            want = tensor.to(getattr(torch, dtype)) if dtype else tensor
            assert torch.equal(got[name], want), (dtype, name)


def test_bf16_parameters_export_exactly(samples, tmp_path: Path) -> None:
    sample = samples.one("fsdp2-bf16", "fsdp2-dcp", world_size=2, dtype="bfloat16")
    ckptctl("export", sample.path, tmp_path / "out")
    got = load_export(tmp_path / "out")
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert_same_tensors(got, sample.ref()["model"])


def test_tied_embeddings_are_written_twice_or_dropped_on_request(samples, tmp_path: Path) -> None:
    sample = samples.one("fsdp2-tied", "fsdp2-dcp", world_size=2, tie_embeddings=True)
    ref = sample.ref()["model"]
    ckptctl("export", sample.path, tmp_path / "both")
    got = load_export(tmp_path / "both")
    assert torch.equal(got["lm_head.weight"], got["tok_emb.weight"])
    assert_same_tensors(got, ref)
    ckptctl("export", sample.path, tmp_path / "dropped", "--drop-tied", "lm_head.weight")
    got = load_export(tmp_path / "dropped")
    assert "lm_head.weight" not in got and torch.equal(got["tok_emb.weight"], ref["tok_emb.weight"])
    with safe_open(tmp_path / "dropped" / "model.safetensors", "pt") as fh:
        assert json.loads(fh.metadata()["tied_weights"]) == {"lm_head.weight": "tok_emb.weight"}
    # a tensor with no equal partner is never dropped
    bad = ckptctl("export", sample.path, tmp_path / "bad", "--drop-tied", "norm.weight", check=False)
    assert bad.returncode == 2 and "lose data" in bad.stderr and not (tmp_path / "bad").exists()


def test_compiled_model_prefixes_are_stripped(samples, tmp_path: Path) -> None:
    sample = samples.one("fsdp2-compiled", "torch-full", world_size=2, compile_prefix=True)
    proc = ckptctl("export", sample.path, tmp_path / "out")
    assert "_orig_mod." in proc.stderr  # reported
    assert_same_tensors(load_export(tmp_path / "out"), sample.ref()["model"])
    kept = ckptctl("export", sample.path, tmp_path / "kept", "--keep-keys")  # raises unless it exits 0
    assert "_orig_mod." not in kept.stderr  # nothing to report: the names were kept
    assert all(k.startswith("_orig_mod.") for k in load_export(tmp_path / "kept"))


def test_rename_include_exclude(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    sample = fsdp2["fsdp2-dcp"]
    ckptctl("export", sample.path, tmp_path / "out", "--rename", r"^layers\.(\d+)\.=blocks.\1.",
            "--include", "blocks.*", "--exclude", "*.bias")
    got = load_export(tmp_path / "out")
    ref = sample.ref()["model"]
    want = {k.replace("layers.", "blocks.", 1): v for k, v in ref.items()
            if k.startswith("layers.") and not k.endswith(".bias")}
    assert_same_tensors(got, want)


def test_non_tensor_entries_are_reported_for_safetensors(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    proc = ckptctl("convert", fsdp2["fsdp2-dcp"].path, tmp_path / "all", "--only", "all", "--json")
    result = json.loads(proc.stdout)
    assert "optim.param_groups.0.lr" in result["skipped"]
    got = load_export(tmp_path / "all")
    ref = fsdp2["fsdp2-dcp"].ref()
    want = ref["optim"]["state"]["tok_emb.weight"]["exp_avg_sq"]
    assert torch.equal(got["optim.state.tok_emb.weight.exp_avg_sq"], want)


def test_single_file_targets_and_small_memory_limit(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    sample = fsdp2["rank-files-dtensor"]
    ckptctl("export", sample.path, tmp_path / "one.safetensors", "--memory-limit", "1MiB")
    assert_same_tensors(load_file(tmp_path / "one.safetensors"), sample.ref()["model"])


def test_from_pretrained_loads_an_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp

    config = transformers.LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=97, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    src = tmp_path / "dcp"
    dcp.save({"model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=str(src))
    out = tmp_path / "hf"
    ckptctl("export", src, out, "--max-shard-size", "200KB")
    config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert_same_tensors(loaded.state_dict(), model.state_dict())


def test_hf_pytorch_model_bin_shards(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    """HF `pytorch_model-0000i-of-0000N.bin` + `pytorch_model.bin.index.json` (read with the allow-list)."""
    ref = fsdp2["fsdp2-dcp"].ref()["model"]
    names = sorted(ref)
    folder = tmp_path / "hf-bin"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        file = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({k: ref[k] for k in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    info = json.loads(ckptctl("inspect", folder, "--json").stdout)
    assert info["format"] == "torch" and info["tensors"] == len(ref)
    ckptctl("export", folder, tmp_path / "out")
    assert_same_tensors(load_export(tmp_path / "out"), ref)
    forced = ckptctl("inspect", folder, "--from", "dcp", check=False)
    assert forced.returncode == 2 and ".metadata" in forced.stderr
