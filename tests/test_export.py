"""Every input layout exports to safetensors/torch with each tensor equal to the unsharded model's."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from converters import ConvertOptions, convert

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


def _tiny_llama_run(tmp_path: Path) -> tuple[object, Path]:
    """A training run laid out as users save one: `run/step_100/` holds the DCP checkpoint of a tiny random
    Llama (model and optimizer) with config.json, generation_config.json and a tokenizer beside it."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 5, 9]]), labels=torch.tensor([[1, 5, 9]])).loss.backward()
    optim.step()
    step = tmp_path / "run" / "step_100"
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(step), no_dist=True)
    config.save_pretrained(step)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(step)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 64)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>", pad_token="<pad>")
    tokenizer.save_pretrained(step)
    return model, step


def test_export_of_a_training_checkpoint_serves_with_from_pretrained(tmp_path: Path) -> None:
    """A newcomer's path: export a Hugging Face model's training checkpoint and load it with `from_pretrained`,
    with no file copied by hand: config (its dtype set to the export's), generation config and tokenizer are
    carried; the weights equal the source's exactly and greedy generation matches."""
    transformers = pytest.importorskip("transformers")
    model, step = _tiny_llama_run(tmp_path)
    out = tmp_path / "export"
    proc = ckptctl("export", step, out, "--json", "-q")
    side = json.loads(proc.stdout)["side_files"]
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(side["carried"])
    assert side["missing"] == []
    assert any(line.startswith("carried side files: config.json, generation_config.json, tokenizer.json")
               for line in json.loads(proc.stdout)["report"])
    manifest = json.loads((out / "ckpt-manifest.json").read_text())
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(manifest["files"])

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] in (set(), []) and info["unexpected_keys"] in (set(), [])
    assert_same_tensors(loaded.state_dict(), model.state_dict())  # fp32, bit for bit
    prompt = torch.tensor([[1, 7, 11, 13]])
    want = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(loaded.eval().generate(prompt, max_new_tokens=8, do_sample=False), want)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("w5 w9")["input_ids"] == [5, 9]

    bf16 = tmp_path / "bf16"
    said = ckptctl("export", step, bf16, "--dtype", "bfloat16", "-q")
    assert "carried side files: config.json, generation_config.json" in said.stderr
    config = json.loads((bf16 / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16


def test_export_side_files_from_the_run_folder_or_config_from(tmp_path: Path) -> None:
    """Accelerate / HF Trainer keep config and tokenizer in the run folder above the weights; `--config-from`
    names another folder; a config.json that is not a JSON object is refused in one line, nothing written."""
    _model, step = _tiny_llama_run(tmp_path)
    weights = step / "pytorch_model_fsdp_0"
    weights.mkdir()
    for item in list(step.iterdir()):
        if item.name == ".metadata" or item.suffix == ".distcp":
            item.rename(weights / item.name)
    run = step.parent
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # the run folder holds these
        (step / name).rename(run / name)
    proc = ckptctl("export", weights, tmp_path / "a", "--json", "-q")
    carried = json.loads(proc.stdout)["side_files"]["carried"]
    assert carried["config.json"] == str(run / "config.json")
    assert carried["generation_config.json"] == str(step / "generation_config.json")

    elsewhere = tmp_path / "hf-config"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    proc = ckptctl("export", weights, tmp_path / "b", "--config-from", elsewhere, "--json", "-q")
    side = json.loads(proc.stdout)["side_files"]
    assert side["carried"] == {"config.json": str(elsewhere / "config.json")}
    assert "generation_config.json" in side["missing"]

    (run / "config.json").write_text("[1, 2]")
    bad = ckptctl("export", weights, tmp_path / "c", check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "config.json: not a JSON object" in bad.stderr and not (tmp_path / "c").exists()


def test_export_side_files_on_object_storage(tmp_path: Path) -> None:
    """Source and target as fsspec URIs (memory://, as s3:// goes): the run folder's config and tokenizer are
    found by listing, written with the weights, and recorded in the target's manifest."""
    import fsspec

    from converters.transforms import KeyOptions

    from .s3server import clear_fs_caches

    _model, step = _tiny_llama_run(tmp_path)
    clear_fs_caches()
    mem = fsspec.filesystem("memory")
    try:
        for path in sorted(step.iterdir()):
            where = "memory://runs/llama/" + ("" if path.suffix == ".json" else "step_100/")  # config in run/
            mem.pipe_file(where + path.name, path.read_bytes())
        options = ConvertOptions(export=True, keys=KeyOptions(only="model", clean=True), dtype="float16")
        result = convert("memory://runs/llama/step_100", "memory://exports/llama", options)
        assert result.side_files is not None
        assert set(result.side_files.found_in) == {"config.json", "generation_config.json", "tokenizer.json",
                                                   "tokenizer_config.json", "special_tokens_map.json"} & {
            p.name for p in step.iterdir()}
        config = json.loads(mem.cat_file("memory://exports/llama/config.json"))
        assert config.get("torch_dtype", config.get("dtype")) == "float16"
        manifest = json.loads(mem.cat_file("memory://exports/llama/ckpt-manifest.json"))
        assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(manifest["files"])
        assert manifest["export"]["dtype"] == "float16"
    finally:
        clear_fs_caches()
