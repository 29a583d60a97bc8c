"""The output engines as options of the export kind, in each interface: `ckptctl export SRC OUT --quantize
fp8-block [--ignore MODULE]`, `--adapter-only`, `--merge-adapter [--base DIR]` run offline on tiny checkpoints
made by transformers and PEFT, and their outputs load in their consumers (the FP8 layout as compressed-tensors
describes it, the adapter in PeftModel, the merged model in transformers); the same options through the service
(the real app, its job run by the executor) and on the dashboard's form; one one-line refusal per option
(exit 2 on the command line, 422 over REST)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptctl import app as cli
from converters.quantize.fp8 import quantize

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_adapters import load_base, logits, peft_model, tiny_base  # noqa: E402  (after the skips)

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


def tiny_bf16(folder: Path) -> Path:
    """A random tiny Llama in bfloat16 (sizes that are multiples of FP8_BLOCK's 128)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is no dict)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bf16(tmp_path_factory.mktemp("wiring") / "llama")


Lora = tuple[Path, Path, torch.Tensor, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Lora:
    """(the base HF folder, PEFT's own save_pretrained folder of a LoRA on it, the PEFT model's logits, its
    merge_and_unload() state dict)."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_base(root / "base")
    model = peft_model(base, "lora")
    model.save_pretrained(root / "adapter")
    want = logits(model)
    merged = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return base, root / "adapter", want, merged


def test_quantize_fp8_block_offline(llama: Path, tmp_path: Path) -> None:
    code, output = ckptctl("export", str(llama), str(tmp_path / "fp8"), "--quantize", "fp8-block",
                           "--ignore", "lm_head", "--ignore", "re:.*down_proj", "-q")
    assert code == 0, output
    quant = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "float-quantized")
    assert quant["ignore"] == ["model.layers.0.mlp.down_proj", "lm_head"]
    assert quant["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    source, got = tensors(llama), tensors(tmp_path / "fp8")
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        weight, scale = quantize(source[f"{name}.weight"], "block")
        assert got[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(got[f"{name}.weight"].view(torch.uint8), weight.view(torch.uint8))
        assert torch.equal(got[f"{name}.weight_scale"], scale)
    for kept in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(got[kept], source[kept])


def test_adapter_only_offline_loads_in_peft(lora: Lora, tmp_path: Path) -> None:
    base, adapter, want, _merged = lora
    code, output = ckptctl("export", str(adapter), str(tmp_path / "peft"), "--adapter-only", "-q")
    assert code == 0, output
    assert sorted(p.name for p in (tmp_path / "peft").iterdir() if not p.name.startswith("ckpt-")) == \
        ["adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(load_base(base), tmp_path / "peft").eval()
    assert torch.equal(logits(loaded), want)


def test_merge_adapter_offline_is_merge_and_unload(lora: Lora, tmp_path: Path) -> None:
    base, adapter, _logits, want = lora
    code, output = ckptctl("export", str(adapter), str(tmp_path / "merged"), "--merge-adapter", "--base", str(base),
                           "--dtype", "bfloat16", "-q")
    assert code == 0, output
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    assert all(torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)) for k, v in want.items())


@pytest.mark.parametrize(("args", "message"), [
    (["--quantize", "int4"], "error: --quantize: unknown quantization 'int4'; choose one of fp8-dynamic, "
                             "fp8-block, fp8-tensor"),
    (["--ignore", "re:.*mlp.*"], "error: --ignore applies only to an FP8 export; set --quantize or leave it out"),
    (["--quantize", "fp8-block", "--dtype", "float16"], "error: --dtype does not apply to an FP8 export; leave it out"),
    (["--adapter-only", "--max-shard-size", "1GB"], "error: --max-shard-size does not apply to an adapter-only "
                                                    "export; leave it out"),
    (["--merge-adapter", "--adapter-only"], "error: --merge-adapter: an adapter-only export (--adapter-only) "
                                            "cannot also be a merged-adapter export; choose one"),
    (["--base", "/somewhere"], "error: --base applies only to a merged-adapter export; set --merge-adapter or "
                               "leave it out"),
])
def test_each_option_refused_in_one_line(llama: Path, tmp_path: Path, args: list[str], message: str) -> None:
    code, output = ckptctl("export", str(llama), str(tmp_path / "out"), *args)
    assert (code, output.strip()) == (2, message)
    assert not (tmp_path / "out").exists()


def test_the_service_runs_them_as_export_jobs(llama: Path, lora: Lora, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.settings import Settings

    from .service_harness import run_here

    base, adapter, _logits, want = lora
    roots = [str(llama.parent), str(adapter.parent), str(tmp_path)]
    settings = Settings(data_dir=tmp_path / "state", read_roots=roots, write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        page = client.get("/").text
        assert all(f'name="options.{name}"' in page for name in ("quantize", "ignore", "adapter_only",
                                                                 "merge_adapter", "base"))
        refused = [client.post("/v1/jobs", json={"kind": "export", "source": str(llama), "target": str(tmp_path / "x"),
                                                 "options": options})
                   for options in ({"quantize": "fp8-tensor", "rename": ["a=b"]}, {"quantize": "nf4"},
                                   {"adapter_only": True, "merge_adapter": True},
                                   {"merge_adapter": True, "base": "/usr"})]
        # api/errors' 422 handler keeps pydantic's "Value error, " prefix for every one_of refusal (left to its owner)
        assert [(r.status_code, r.json()["error"]["message"].replace("Value error, ", "")) for r in refused] == [
            (422, "options.rename does not apply to an FP8 export; leave it out"),
            (422, "options.quantize: unknown quantization 'nf4'; choose one of fp8-dynamic, fp8-block, fp8-tensor"),
            (422, "options.merge_adapter: an adapter-only export (options.adapter_only) cannot also be a "
                  "merged-adapter export; choose one"),
            (403, f"options.base: /usr is outside the storage roots this server may read ({', '.join(roots)})")]
        done = {name: run_here(client, {"kind": "export", "source": str(source), "target": str(tmp_path / name),
                                        "options": options})
                for name, source, options in (("fp8", llama, {"quantize": "FP8_DYNAMIC"}),
                                              ("merged", adapter, {"merge_adapter": True, "base": str(base)}))}
    fp8, merged = done["fp8"], done["merged"]
    assert (fp8["state"], fp8["spec"]["options"]["quantize"], fp8["result"]["scheme"]) == \
        ("succeeded", "fp8-dynamic", "FP8_DYNAMIC")
    assert fp8["result"]["quantized"] == 7 and fp8["result"]["ignored"] == ["lm_head"]
    assert fp8["result"]["total_bytes"] == sum(p.stat().st_size for p in (tmp_path / "fp8").iterdir()
                                               if p.name in {o["name"] for o in fp8["result"]["outputs"]})
    assert tensors(tmp_path / "fp8")["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert merged["state"] == "succeeded", merged
    assert merged["result"]["adapter"]["variants"] == ["lora"]
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
