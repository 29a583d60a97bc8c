"""An adapter merged and then served in one command: `export --merge-adapter --gguf TYPE` and `--merge-adapter
--quantize SCHEME` (the merged model staged beside the target, then exported from there). Each gives exactly the
file(s) of the two commands run one after the other, leaves no staging folder behind, and the pairs that make no
sense are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptctl import app as cli

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("gguf")

import tests.test_adapters  # noqa: E402,F401  (tells PEFT's LoRA dispatcher the torchtitan-era torchao is absent)
from tests import gguf_reference  # noqa: E402
from tests.test_gguf_export import LLAMA3_SPLIT, _assert_same, _tokenizer  # noqa: E402  (after the skips)

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny Llama with a trained BPE tokenizer, PEFT's save_pretrained folder of a LoRA on it)."""
    root = tmp_path_factory.mktemp("chained")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    _tokenizer(root / "base", LLAMA3_SPLIT)
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(root / "base"),
                                peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # a trained adapter (PEFT starts B at zero)
    model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def test_merge_then_gguf_is_the_two_commands(lora: tuple[Path, Path], tmp_path: Path) -> None:
    base, adapter = lora
    code, output = ckptctl("export", str(adapter), str(tmp_path / "m"), "--merge-adapter", "--base", str(base), "-q")
    assert code == 0, output
    code, output = ckptctl("export", str(tmp_path / "m"), str(tmp_path / "two" / "m.gguf"), "--gguf", "q8_0", "-q")
    assert code == 0, output
    code, output = ckptctl("export", str(adapter), str(tmp_path / "one" / "m.gguf"), "--merge-adapter", "--base",
                           str(base), "--gguf", "q8_0", "-q")
    assert code == 0, output
    assert (tmp_path / "one" / "m.gguf").read_bytes() == (tmp_path / "two" / "m.gguf").read_bytes()
    # the staging folder is gone; the GGUF file's manifest (its CRC-32s, certificate) is beside it
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["m.gguf", "m.gguf.ckpt-manifest.json"]


@pytest.mark.slow
def test_merge_then_gguf_is_peft_then_llama_cpp(lora: tuple[Path, Path], tmp_path: Path) -> None:
    """The reference tools on the same input: PEFT's merge_and_unload() saved by transformers, then llama.cpp's
    own convert_hf_to_gguf.py, write the file our one command writes."""
    import shutil

    base, adapter = lora
    merged = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), adapter)
    folder = tmp_path / "peft" / "m"  # the folder's name is the model's name in the GGUF metadata
    merged.merge_and_unload().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, folder / name)
    gguf_reference.convert(folder, tmp_path / "theirs.gguf", "q8_0", "llama-bpe")
    code, output = ckptctl("export", str(adapter), str(tmp_path / "ours" / "m.gguf"), "--merge-adapter", "--base",
                           str(base), "--gguf", "q8_0", "-q")
    assert code == 0, output
    _assert_same(tmp_path / "ours" / "m.gguf", tmp_path / "theirs.gguf")


@pytest.mark.slow
def test_merge_then_fp8_is_peft_then_llm_compressor(lora: tuple[Path, Path], tmp_path: Path) -> None:
    """PEFT's merge_and_unload() saved by transformers, then llm-compressor's oneshot (no calibration data): the
    same weights, scales and quantization config as our one command."""
    from tests.test_fp8 import _config, _oracle, _tensors

    base, adapter = lora
    merged = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), adapter)
    merged.merge_and_unload().save_pretrained(tmp_path / "peft")
    theirs = _oracle(tmp_path / "peft", tmp_path / "theirs", "FP8_BLOCK", ["lm_head"])
    code, output = ckptctl("export", str(adapter), str(tmp_path / "ours"), "--merge-adapter", "--base", str(base),
                           "--quantize", "fp8-block", "-q")
    assert code == 0, output
    a, b = _tensors(tmp_path / "ours"), _tensors(theirs)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)
    assert _config(tmp_path / "ours")["quantization_config"] == _config(theirs)["quantization_config"]


def test_merge_then_fp8_is_the_two_commands(lora: tuple[Path, Path], tmp_path: Path) -> None:
    base, adapter = lora
    assert ckptctl("export", str(adapter), str(tmp_path / "m"), "--merge-adapter", "--base", str(base), "-q")[0] == 0
    code, output = ckptctl("export", str(tmp_path / "m"), str(tmp_path / "two"), "--quantize", "fp8-block", "-q")
    assert code == 0, output
    code, output = ckptctl("export", str(adapter), str(tmp_path / "one"), "--merge-adapter", "--base", str(base),
                           "--quantize", "fp8-block", "-q")
    assert code == 0, output
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert sorted(one) == sorted(two)
    assert all(torch.equal(one[k].view(torch.uint8), two[k].view(torch.uint8)) if one[k].dtype == torch.float8_e4m3fn
               else torch.equal(one[k], two[k]) for k in one)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((tmp_path / "two" / "config.json").read_text())[
        "quantization_config"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("args", "message"), [
    (["--adapter-only", "--gguf", "f16"], "error: --gguf: an adapter-only export (--adapter-only) cannot also be a "
                                          "GGUF export; choose one"),
    (["--quantize", "fp8-block", "--gguf", "f16"], "error: --gguf: an FP8 export (--quantize) cannot also be a GGUF "
                                                   "export; choose one"),
    (["--merge-adapter", "--gguf", "f16", "--max-shard-size", "1GB"], "error: --max-shard-size does not apply to a "
                                                                      "GGUF export of a merged-adapter export; leave "
                                                                      "it out"),
])
def test_pairs_that_make_no_sense_are_one_line(lora: tuple[Path, Path], tmp_path: Path, args: list[str],
                                               message: str) -> None:
    code, output = ckptctl("export", str(lora[1]), str(tmp_path / "out.gguf"), *args)
    assert (code, output.strip()) == (2, message)
    assert not list(tmp_path.iterdir())
