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
        done = run_here(client, {"kind": "import", "source": str(qwen2), "target": str(tmp_path / "dcp"),
                                 "options": {"into": "dcp", "world_size": 2}})
    assert done["state"] == "succeeded", done
    assert (tmp_path / "dcp" / "__1_0.distcp").is_file() and (tmp_path / "dcp" / "config.json").is_file()


def test_import_to_dcp_is_what_dcp_load_reads(qwen2: Path, tmp_path: Path) -> None:
    """`import --to dcp`: the HF names as the model's state_dict has them, config.json beside the DCP files;
    dcp.load fills a fresh model's state_dict with the HF tensors (tests/test_hf_families.py loads every family
    into FSDP2 at 2 ranks)."""
    import torch.distributed.checkpoint as dcp

    code, output = ckptctl("import", str(qwen2), str(tmp_path / "dcp"), "--to", "dcp", "--world-size", "2", "-q")
    assert code == 0, output
    assert sorted(p.name for p in (tmp_path / "dcp").glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    config = transformers.AutoConfig.from_pretrained(tmp_path / "dcp")
    torch.manual_seed(1)
    state = transformers.Qwen2ForCausalLM(config).state_dict()
    assert sorted(dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata) == sorted(state)
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    want = load_file(qwen2 / "model.safetensors")
    assert sorted(state) == sorted(want) and all(torch.equal(state[n], t) for n, t in want.items())


def test_import_to_dcp_refusals(qwen2: Path, tmp_path: Path) -> None:
    code, output = ckptctl("import", str(qwen2), str(tmp_path / "mg"), "--world-size", "2", "-q")
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert "only an import into dcp is laid out for ranks" in output and not (tmp_path / "mg").exists()
    from safetensors.torch import save_file

    headless = tmp_path / "headless"
    headless.mkdir()
    (headless / "config.json").write_bytes((qwen2 / "config.json").read_bytes())  # tie_word_embeddings: false
    save_file({n: t for n, t in load_file(qwen2 / "model.safetensors").items() if n != "lm_head.weight"},
              headless / "model.safetensors")
    code, output = ckptctl("import", str(headless), str(tmp_path / "dcp"), "--to", "dcp", "-q")
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert "no 'lm_head.weight'" in output and "tie_word_embeddings is false" in output
    assert not (tmp_path / "dcp").exists()
