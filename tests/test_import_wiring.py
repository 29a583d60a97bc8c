"""`ckptctl import HF MEGATRON` (converters.import_hf as a job kind): a tiny transformers model imported to a
Megatron-LM save and exported back with `export --to-hf auto` gives every tensor of the original bit for bit;
the service runs the same as a job; a folder the table has no family for is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptctl import app as cli

transformers = pytest.importorskip("transformers")

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 (grouped-query attention with QKV biases), saved by transformers."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("import") / "qwen2"
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_import_then_export_gives_the_model_back(qwen2: Path, tmp_path: Path) -> None:
    code, output = ckptctl("import", str(qwen2), str(tmp_path / "megatron"), "-q")
    assert code == 0, output
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    code, output = ckptctl("export", str(tmp_path / "megatron"), str(tmp_path / "hf"), "--to-hf", "auto", "-q")
    assert code == 0, output
    want, got = load_file(qwen2 / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen2"


def test_a_model_without_a_family_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)) \
        .save_pretrained(folder)
    code, output = ckptctl("import", str(folder), str(tmp_path / "out"), "-q")
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert "gpt2" in output and not (tmp_path / "out").exists()


def test_the_service_runs_an_import_job(qwen2: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    from .service_harness import run_here

    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(qwen2.parent)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        done = run_here(client, {"kind": "import", "source": str(qwen2), "target": str(tmp_path / "mg"),
                                 "options": {"family": "qwen2"}})
    assert done["state"] == "succeeded", done
    assert done["result"]["family"] == "qwen2" and done["result"]["total_bytes"] > 0
