"""LoRA adapters (converters.adapters), proven against PEFT itself:

- PEFT's own save_pretrained folder (plain LoRA with lora_bias and rank/alpha patterns, rsLoRA, DoRA,
  modules_to_save) -> our merged export equals `merge_and_unload()` tensor by tensor, bit for bit in fp32, and
  loads with transformers' from_pretrained; our adapter export loads with `PeftModel.from_pretrained` and gives
  PEFT's logits exactly (fast);
- training checkpoints, each trained 2 steps at 2 gloo ranks: the PEFT model under FSDP2 (fully_shard, saved with
  torch.distributed.checkpoint; tests/adapter_job.py), under DeepSpeed ZeRO-2 and ZeRO-3 (engine.save_checkpoint;
  tests/adapter_sources_job.py) and under Accelerate's FSDP (save_state; tests/adapter_accelerate_tool.py) -> our
  adapter export gives the trained model's logits, our merged export equals its `merge_and_unload()` (slow);
- refusals in one line with an exit-2 error: target module missing from the base, rank mismatch, unknown variant,
  alpha unknown.

CI needs: pip install peft==0.21.2 (torch stays as it is). peft 0.21 refuses torchao < 0.16 when it creates LoRA
layers; the torchao installed for torchtitan is older, so the tests tell PEFT's LoRA dispatcher torchao is absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load, load_file, save_file

from ckpt_service.service_errors import exit_code
from converters.adapters import export_adapter, export_merged
from converters.errors import CkptError, FormatError, OptionError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import peft.tuners.lora.torchao as _peft_torchao  # noqa: E402

_peft_torchao.is_torchao_available = lambda: False  # type: ignore[assignment]  # see the module docstring

TOKENS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 60, 3, 7]])
VARIANTS = {
    "lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], lora_bias=True,
                 rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3}),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "k_proj", "gate_proj"]),
    "saved": dict(r=4, lora_alpha=4, target_modules=["q_proj", "up_proj"], modules_to_save=["lm_head"]),
}


def tiny_base(folder: Path, layers: int = 2) -> Path:
    """A random tiny Llama saved by transformers (fp32, untied head, biases for lora_bias)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def load_base(folder: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def peft_model(base: Path, variant: str) -> torch.nn.Module:
    """The PEFT model of `variant` with every adapter tensor random (as after training; B is not zero)."""
    model = peft.get_peft_model(load_base(base), peft.LoraConfig(**VARIANTS[variant]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif "modules_to_save" in name:
                param.mul_(1.5)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_base(tmp_path_factory.mktemp("base") / "llama")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_folder_merged_equals_merge_and_unload(base: Path, tmp_path: Path, variant: str) -> None:
    model = peft_model(base, variant)
    model.save_pretrained(tmp_path / "adapter")
    want = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    result = export_merged(str(tmp_path / "adapter"), str(tmp_path / "merged"), str(base))
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())
    assert result.adapter["variants"] == (["dora"] if variant == "dora" else ["lora"])


def test_merged_in_row_slabs_is_the_same(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Merged 5 output rows at a time (4 for down_proj: slabs of 640 bytes, never fewer than 4 rows, a last slab
    of 1-3 rows joined to the one before): no bit changes (each row is its own), on disk and streamed to object
    storage."""
    from converters.adapters import export as adapter_export
    from converters.adapters import merge

    monkeypatch.setattr(adapter_export, "MIN_SLAB", 5 * 32 * 4)
    monkeypatch.setattr(adapter_export, "SLAB_SHARE", 1 << 30)  # every slab is MIN_SLAB
    slabs: list[str] = []

    def counting(method: str) -> object:
        original = getattr(merge.Workspace, method)

        def counted(self: merge.Workspace, purpose: str, *args: object) -> torch.Tensor:
            slabs.append(purpose)
            return original(self, purpose, *args)
        return counted

    for method in ("read", "pread"):  # rows from the source (an upload), or from the base's copy in the output
        monkeypatch.setattr(merge.Workspace, method, counting(method))
    for variant in ("lora", "dora"):
        model = peft_model(base, variant)
        model.save_pretrained(tmp_path / variant)
        want = model.merge_and_unload().state_dict()
        export_merged(str(tmp_path / variant), str(tmp_path / f"{variant}-out"), str(base), memory_limit=1 << 20)
        got = load_file(tmp_path / f"{variant}-out" / "model.safetensors")
        assert all(torch.equal(got[k], v) for k, v in want.items())
        # streamed in order to object storage (the slabs' reused workspaces, uploaded one after another)
        export_merged(str(tmp_path / variant), f"memory://merged-{variant}", str(base), memory_limit=1 << 20)
        uploaded = load(fsspec.filesystem("memory").cat(f"memory://merged-{variant}/model.safetensors"))
        assert all(torch.equal(uploaded[k], v) for k, v in want.items())
    # slabs per layer: lora q 6 (32 rows: 5 x 5 + 7), v 3 (16: 5, 5, 6), o 6, down 8 (4 rows); dora q 6, k 3,
    # gate 9 (48: 8 x 5 + 8); two layers, two exports each
    assert slabs.count("weight") == 2 * 2 * ((6 + 3 + 6 + 8) + (6 + 3 + 9))


def test_row_slabs_have_at_least_four_rows() -> None:
    """MKL's product of 1-3 rows rounds otherwise than the same rows of the whole product: no slab is that short."""
    from converters.adapters.export import row_slabs

    assert row_slabs(10, 3) == [(0, 4), (4, 6)]
    assert row_slabs(2048, 95)[-1] == (1995, 53)
    assert row_slabs(2, 100) == [(0, 2)]
    assert row_slabs(33, 8) == [(0, 8), (8, 8), (16, 8), (24, 9)]
    torch.manual_seed(0)
    a, b = torch.randn(8, 64), torch.randn(40, 8)
    whole = b @ a
    for start, count in row_slabs(40, 1):
        assert torch.equal(torch.matmul(b[start:start + count].clone(), a), whole[start:start + count])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_adapter_export_loads_in_peft_with_the_same_logits(base: Path, tmp_path: Path, variant: str) -> None:
    model = peft_model(base, variant)
    model.save_pretrained(tmp_path / "adapter")
    want = logits(model)
    export_adapter(str(tmp_path / "adapter"), str(tmp_path / "out"))
    assert sorted(load_file(tmp_path / "out" / "adapter_model.safetensors")) == \
        sorted(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    loaded = peft.PeftModel.from_pretrained(load_base(base), tmp_path / "out").eval()
    assert torch.equal(logits(loaded), want)


def test_merged_cast_to_bfloat16_is_the_fp32_merge_cast(base: Path, tmp_path: Path) -> None:
    model = peft_model(base, "dora")
    model.save_pretrained(tmp_path / "adapter")
    want = model.merge_and_unload().state_dict()
    export_merged(str(tmp_path / "adapter"), str(tmp_path / "merged"), str(base), dtype="bfloat16")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bfloat16_adapter_on_a_bfloat16_base_merges_as_peft(base: Path, tmp_path: Path) -> None:
    """16-bit LoRA weights: PEFT multiplies them in float32 and casts the delta back; so do the row slabs."""
    model = peft_model(base, "lora").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "adapter")
    model.base_model.model.save_pretrained(tmp_path / "base16")  # the base weights, bfloat16 (LoRA layers unmerged)
    plain = {k.replace(".base_layer", ""): v for k, v in load_file(tmp_path / "base16" / "model.safetensors").items()
             if "lora_" not in k}
    save_file(plain, tmp_path / "base16" / "model.safetensors")
    want = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    export_merged(str(tmp_path / "adapter"), str(tmp_path / "merged"), str(tmp_path / "base16"))
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in want.items())


# ---- refusals ----------------------------------------------------------------------------------------------------


def _refused(exc: pytest.ExceptionInfo[CkptError], *words: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and exit_code(exc.value) == 2, text
    for word in words:
        assert word in text, text


def test_target_module_missing_from_base_is_refused(base: Path, tmp_path: Path) -> None:
    peft_model(base, "lora").save_pretrained(tmp_path / "adapter")
    small = tiny_base(tmp_path / "one-layer", layers=1)
    with pytest.raises(FormatError) as exc:
        export_merged(str(tmp_path / "adapter"), str(tmp_path / "out"), str(small))
    _refused(exc, "model.layers.1.", "does not have")
    assert not (tmp_path / "out").exists()


def test_rank_mismatch_is_refused(base: Path, tmp_path: Path) -> None:
    peft_model(base, "lora").save_pretrained(tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(file)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[key] = tensors[key][:, :3].contiguous()
    save_file(tensors, file)
    for call in (export_adapter, lambda s, t: export_merged(s, t, str(base))):
        with pytest.raises(FormatError) as exc:
            call(str(tmp_path / "adapter"), str(tmp_path / "out"))
        _refused(exc, key, "rank mismatch")


def test_rank_disagreeing_with_the_config_is_refused(base: Path, tmp_path: Path) -> None:
    peft_model(base, "lora").save_pretrained(tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, "rank_pattern": {}}))
    with pytest.raises(FormatError) as exc:
        export_merged(str(tmp_path / "adapter"), str(tmp_path / "out"), str(base))
    _refused(exc, "o_proj", "r=4", "rank 2")


def test_unknown_variant_is_refused(base: Path, tmp_path: Path) -> None:
    loha = peft.get_peft_model(load_base(base), peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj"]))
    loha.save_pretrained(tmp_path / "loha")
    with pytest.raises(FormatError) as exc:
        export_adapter(str(tmp_path / "loha"), str(tmp_path / "out"))
    _refused(exc, "LOHA", "unknown adapter variant")
    (tmp_path / "loha" / "adapter_config.json").unlink()  # no config: the tensors say it
    with pytest.raises(FormatError) as exc:
        export_adapter(str(tmp_path / "loha"), str(tmp_path / "out"), alpha=8)
    _refused(exc, "hada_w1_a", "LoHa")


def test_alpha_unknown_is_refused(base: Path, tmp_path: Path) -> None:
    peft_model(base, "rslora").save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_config.json").unlink()
    with pytest.raises(OptionError) as exc:
        export_merged(str(tmp_path / "adapter"), str(tmp_path / "out"), str(base))
    _refused(exc, "alpha", "alpha=NUMBER")


def test_adapter_alone_needs_a_base_to_merge(base: Path, tmp_path: Path) -> None:
    peft_model(base, "lora").save_pretrained(tmp_path / "adapter")
    with pytest.raises(OptionError) as exc:
        export_merged(str(tmp_path / "adapter"), str(tmp_path / "out"))
    _refused(exc, "base=DIR")


# ---- a training checkpoint: FSDP2 at 2 gloo ranks, saved with torch.distributed.checkpoint (slow) -------------------


def _check_training_checkpoint(base: Path, run: Path, checkpoint: str) -> None:
    """The adapter export of a training run's checkpoint gives the trained model's logits in PeftModel; the merged
    export equals the trained model's `merge_and_unload()` bit for bit (files the run saved beside it)."""
    settings = json.loads((run / "lora.json").read_text())
    # alpha and rsLoRA are not in the weights: given by the caller, as the training run set them
    export_adapter(checkpoint, str(run / "adapter"), alpha=settings["lora_alpha"], use_rslora=settings["use_rslora"])
    loaded = peft.PeftModel.from_pretrained(load_base(base), run / "adapter").eval()
    assert torch.equal(logits(loaded), load_file(run / "trained.safetensors")["logits"])
    export_merged(checkpoint, str(run / "merged"), alpha=settings["lora_alpha"], use_rslora=settings["use_rslora"],
                  config_from=str(base))
    got = load_file(run / "merged" / "model.safetensors")
    want = load_file(run / "merged_by_peft.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    transformers.LlamaForCausalLM.from_pretrained(run / "merged")


def _run_job(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_fsdp2_training_checkpoint(base: Path, tmp_path: Path) -> None:
    _run_job("tests.adapter_job", str(base), str(tmp_path))
    _check_training_checkpoint(base, tmp_path, str(tmp_path / "checkpoint"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_training_checkpoint(base: Path, tmp_path: Path, stage: int) -> None:
    """A real DeepSpeed engine (CPU, 2 gloo ranks) trained the PEFT model and saved with save_checkpoint: the
    adapter is found under DeepSpeed's `module.` prefix, the frozen base weights in the model states (ZeRO-2) or
    their fragments (ZeRO-3), the trained ones in the fp32 partitions."""
    pytest.importorskip("deepspeed")
    _run_job("tests.adapter_sources_job", str(base), str(tmp_path), "--stage", str(stage))
    _check_training_checkpoint(base, tmp_path, str(tmp_path / "checkpoint"))


@pytest.mark.slow
def test_accelerate_fsdp_training_checkpoint(base: Path, tmp_path: Path) -> None:
    """Accelerate's FSDP (FSDP1, SHARDED_STATE_DICT, 2 gloo ranks) trained the PEFT model and `save_state` wrote
    its checkpoint (pytorch_model_fsdp_0/ + optimizer_0/): the adapter is read from the model's DCP folder."""
    pytest.importorskip("accelerate")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("adapter_accelerate_tool.py")), str(base), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_training_checkpoint(base, tmp_path, str(tmp_path / "checkpoint"))


# ---- inspect shows the adapter (engine summary -> ckptctl text and --json, REST inspect job) -----------------------


def test_inspect_shows_the_adapter(base: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptctl import app as cli

    env = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
    for variant in ("lora", "saved"):
        peft_model(base, variant).save_pretrained(tmp_path / variant)
    saved = load_file(tmp_path / "lora" / "adapter_model.safetensors")  # the oracle of size and parameters
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "lora"), "--json"], env=env)
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)["adapter"]
    assert info == {"name": "default", "variant": "lora", "modules": 8, "ranks": [2, 4], "alpha": 8,
                    "alpha_pattern": {"down_proj": 3}, "use_rslora": False, "variants": ["lora"],
                    "target_modules": ["down_proj", "o_proj", "q_proj", "v_proj"], "modules_to_save": [],
                    "bytes": 8064, "parameters": 2016, "other_adapters": [],
                    "config": str(tmp_path / "lora" / "adapter_config.json")}
    assert (info["bytes"], info["parameters"]) == (sum(t.nbytes for t in saved.values()),
                                                   sum(t.numel() for t in saved.values()))
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "saved")], env=env)
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    assert "adapter: 'default' lora, 4 modules, rank 4, alpha 4, 12.80 KB (3200 parameters)" in lines, lines
    assert "targets: q_proj, up_proj" in lines and "saved: lm_head.weight" in lines
    # rsLoRA and DoRA, through the REST inspect job
    from fastapi.testclient import TestClient

    from api.app import create_app
    from ckpt_service.executor import run_job
    from ckpt_service.settings import Settings

    for variant, settings in (("rslora-dora", dict(VARIANTS["dora"], use_rslora=True)),):
        model = peft.get_peft_model(load_base(base), peft.LoraConfig(**settings))
        model.save_pretrained(tmp_path / variant)
    service = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    service.prepare()
    with TestClient(create_app(service)) as client:
        job = client.post("/v1/jobs", json={"kind": "inspect", "source": str(tmp_path / "rslora-dora")})
        assert job.status_code == 202, job.text
        store = client.app.state.service.store  # type: ignore[attr-defined]
        claimed = store.claim("test-worker", 60.0)
        assert run_job(store, claimed.id, claimed.attempt) == 0
        shown = client.get(f"/v1/jobs/{job.json()['id']}").json()["result"]["adapter"]
    assert (shown["variant"], shown["ranks"], shown["alpha"], shown["target_modules"]) == \
        ("rslora+dora", [4], 8, ["gate_proj", "k_proj", "q_proj"])
