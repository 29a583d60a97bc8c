"""export --to-hf for every family of the table (converters/hf_families), against the real classes.

Slow: a tiny model of each real `transformers` class (random weights, offline) is saved with save_pretrained;
tests/hf_families_tool.py builds megatron-core's own GPTModel from its config, copies the weights in through
the inverse mapping written there from megatron-core's layout, saves it with `dist_checkpointing.save` and
records Megatron's own forward logits. The export must give back the HF tensors bit for bit, a config.json
that from_pretrained loads into the same model, and logits equal to the original's and to Megatron's.
Fast: the refusals, on synthetic views.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from safetensors.torch import load_file

from converters.errors import FormatError, OptionError
from converters.hf_families import CHOICES, FAMILIES, megatron_args, to_hf
from converters.index import ByteRange, CheckpointIndex, Chunk, TensorEntry

from .conftest import ckptctl

TOOL = Path(__file__).with_name("hf_families_tool.py")
IDS = torch.tensor([[3, 17, 90, 42, 5, 77, 0, 64, 8, 33, 71, 12]])
COMMON: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                              max_position_embeddings=64, tie_word_embeddings=False)
# family -> (transformers config class, its fields beyond COMMON); each exercises another corner of the mapping
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # QKV bias
    "qwen3": ("Qwen3Config", {"head_dim": 24, "num_key_value_heads": 1, "tie_word_embeddings": True}),  # MQA, tied
    "mistral": ("MistralConfig", {"num_key_value_heads": 4, "sliding_window": None}),  # MHA
    "mixtral": ("MixtralConfig", {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"moe_intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
                                     "norm_topk_prob": False, "head_dim": 16}),  # QK-norm + MoE, pre-softmax router
    # zero-centered norms, post-norms, GeGLU, soft-capping, a window shorter than IDS on every other layer, tied
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24,
                                "tie_word_embeddings": True}),
    # + QK-norm, a local rope base beside the global one, no soft-capping
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 20,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "tie_word_embeddings": True}),
    # MLA with a low-rank q and YaRN (mscale in the softmax scale), first-k dense, shared experts, sigmoid group
    # top-k routing with the expert bias
    # (rms_norm_eps 1e-6: transformers normalises the q and kv latents with it whatever the config says)
    "deepseek_v3": ("DeepseekV3Config", {"rms_norm_eps": 1e-6, "num_key_value_heads": 4, "moe_intermediate_size": 32,
                                         "n_shared_experts": 1,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                                         "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
                                         "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12,
                                         "v_head_dim": 10, "routed_scaling_factor": 2.5,
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                             "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8}}),
}
# saved by the tool as megatron-core's tensors (no local GPTModel spec builds Gemma's post-norms; MLA: see the tool)
RAW = ("gemma2", "gemma3", "deepseek_v3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def test_the_request_schema_offers_the_table() -> None:
    from ckpt_service.job_requests import HFArchitecture

    assert get_args(HFArchitecture) == CHOICES == ("auto", *FAMILIES)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/hf/FAMILY: a tiny model of each family saved by transformers, with its logits on IDS."""
    import transformers

    root = tmp_path_factory.mktemp("families")
    for family, (config_class, fields) in MODELS.items():
        torch.manual_seed(len(family))
        config = getattr(transformers, config_class)(**{**COMMON, **fields})
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # untrained norms are ones and biases zeros: make every value distinct
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / "hf" / family)
        with torch.no_grad():
            torch.save(model.eval()(IDS).logits, root / "hf" / family / "logits.pt")
    return root


@pytest.fixture(scope="module")
def models(hf_models: Path) -> Path:
    """+ ROOT/megatron/FAMILY: megatron-core's own save of each (tests/hf_families_tool.py)."""
    root = hf_models
    proc = subprocess.run([sys.executable, str(TOOL), str(root), "29741", *MODELS], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_export_gives_back_the_hf_model(models: Path, tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    # mistral's Megatron config reads as llama's (same layout, no sliding window): name it; the others: auto
    choice = "mistral" if family == "mistral" else "auto"
    proc = ckptctl("export", models / "megatron" / family, out, "--to-hf", choice, "-q", "--verify")
    assert f"mapped to {ARCHITECTURES[family]}: 2 layers" in proc.stderr
    if family == "deepseek_v3":
        assert "left out the 1 multi-token prediction layer(s) (2 tensors under mtp.)" in proc.stderr
    original = models / "hf" / family
    got, want = load_file(out / "model.safetensors"), load_file(original / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config, source = (json.loads((p / "config.json").read_text()) for p in (out, original))
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                "num_local_experts", "num_experts_per_tok", "sliding_window", "num_experts", "moe_intermediate_size",
                "norm_topk_prob", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                "routed_scaling_factor", "rope_interleave"):
        assert config.get(key) == source.get(key), key
    if family.startswith("gemma"):  # the sliding-window pattern (Qwen2's and Mistral's HF configs derive theirs)
        assert config["layer_types"] == source["layer_types"]
    assert config["head_dim"] == (source.get("head_dim") or 16)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.rope_parameters == source["rope_parameters"]
    with torch.no_grad():
        logits = model(IDS).logits
    assert torch.equal(logits, torch.load(original / "logits.pt", weights_only=True))
    saved = json.loads((models / "logits" / f"{family}.json").read_text())
    args = json.loads(json.dumps(megatron_args(source, "config.json")))
    assert {k: args[k] for k in saved if k in args} == {k: v for k, v in saved.items() if k in args}
    if family in RAW:
        return
    # Megatron's own forward on its checkpoint: the mapping (both ways) preserves the model
    torch.testing.assert_close(logits, torch.load(models / "logits" / f"{family}.pt", weights_only=True),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_family_that_cannot_express_the_model_is_refused_whole(models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for family, choice, words in (
            ("qwen3", "llama", "the model has QK-norm (qk_layernorm), which LlamaForCausalLM does not; choose qwen3"),
            ("llama", "qwen2", "Qwen2ForCausalLM needs QKV bias (add_qkv_bias), which the model does not have; "
                               "choose llama or mistral"),
            ("mixtral", "mistral", "the model has mixture of experts (num_moe_experts), which MistralForCausalLM")):
        proc = ckptctl("export", models / "megatron" / family, out, "--to-hf", choice, "-q", check=False)
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists()
    proc = ckptctl("export", models / "megatron" / "llama", out, "--to-hf", "gemma", "-q", check=False)
    assert proc.returncode == 2 and "gemma" in proc.stderr and not out.exists()


# ------------------------------------------------------------------------------------------ fast: refusals

def _view(tensors: dict[str, tuple[int, ...]]) -> CheckpointIndex:
    entries = {n: TensorEntry(n, "float32", s, [Chunk((0,) * len(s), s, ByteRange("mem://x", 0, 4 * _numel(s)))])
               for n, s in tensors.items()}
    return CheckpointIndex(uri="mem://x", format="megatron", tensors=entries)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


CFG: dict[str, Any] = dict(num_layers=1, hidden_size=8, ffn_hidden_size=12, num_attention_heads=4, num_query_groups=2,
                           normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                           untie_embeddings_and_output_weights=True)


def _llama_view(**extra: tuple[int, ...]) -> CheckpointIndex:
    return _view({"embedding.word_embeddings.weight": (16, 8), "decoder.final_layernorm.weight": (8,),
                  "output_layer.weight": (16, 8), "decoder.layers.0.self_attention.linear_qkv.weight": (16, 8),
                  "decoder.layers.0.self_attention.linear_proj.weight": (8, 8),
                  "decoder.layers.0.input_layernorm.weight": (8,), "decoder.layers.0.pre_mlp_layernorm.weight": (8,),
                  "decoder.layers.0.mlp.linear_fc1.weight": (24, 8), "decoder.layers.0.mlp.linear_fc2.weight": (8, 12),
                  **extra})


def test_views_split_qkv_per_query_group() -> None:
    out, config, report = to_hf(_llama_view(), CFG, "args")
    k = out.tensors["model.layers.0.self_attn.k_proj.weight"]
    # 2 groups of [q, q, k, v] x head dim 2: k_0 = rows 4..5, k_1 = rows 12..13 (32 bytes a row... 8 floats)
    assert [(c.offsets, c.data.offset) for c in k.chunks] == [((0, 0), 4 * 8 * 4), ((2, 0), 12 * 8 * 4)]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 2
    assert report[0].startswith("mapped to LlamaForCausalLM: 1 layers, 4 heads in 2 query groups, vocab 16")


@pytest.mark.parametrize(("cfg", "error", "words"), [
    ({"num_query_groups": 3}, OptionError, "args: 4 attention heads do not divide into 3 query groups"),
    ({"normalization": "LayerNorm"}, OptionError, "normalization 'LayerNorm'"),
    ({"moe_shared_expert_intermediate_size": 4}, OptionError, "shared experts"),
    ({"qk_layernorm": True, "add_qkv_bias": True}, OptionError, "no family in the table has QK-norm"),
    ({"ffn_hidden_size": 10}, FormatError, "the config does not match the weights"),
    ({"hidden_size": "64x"}, FormatError, "args: hidden_size is '64x', not a positive integer; the model config "
                                          "is damaged"),
    ({"hidden_size": 8.5}, FormatError, "args: hidden_size is 8.5, not a positive integer"),
    ({"num_attention_heads": 0}, FormatError, "args: num_attention_heads is 0, not a positive integer"),
    ({"rotary_base": [1]}, FormatError, "args: rotary_base is [1], not a number"),
    ({"window_size": ["a", 0]}, OptionError, "is not a causal sliding window (left, 0)"),
    # Gemma's zero-centered norms copy 1:1 only into a Gemma class (Llama's RMSNorm scales by w, not 1 + w)
    ({"apply_layernorm_1p": True}, OptionError, "no family in the table has zero-centered norm weights"),
    ({"activation_func": "quick_gelu"}, OptionError, "activation_func 'quick_gelu' (silu or a tanh GeLU expected)"),
    ({"activation_func": {"_target_": "megatron.core.activations.fast_gelu"}}, OptionError,
     "no family in the table has a GeGLU feed-forward"),
    ({"apply_layernorm_1p": True, "activation_func": "fast_gelu", "window_size": [4, 0],
      "window_attn_skip_freq": "x"}, FormatError, "args: window_attn_skip_freq 'x' is neither a positive integer"),
    ({"rope_type": "yarn"}, OptionError, "rope_type 'yarn' (plain rope, or YaRN with multi-latent attention only)"),
    ({"num_moe_experts": 2, "moe_layer_freq": [0, 1, 1]}, FormatError, "args: moe_layer_freq [0, 1, 1] is neither a "
                                                                       "positive integer nor a list of 1 0/1 flags"),
    ({"multi_latent_attention": True}, OptionError, "no family in the table has multi-latent attention"),
])
def test_configs_the_table_cannot_express(cfg: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as caught:
        to_hf(_llama_view(), {**CFG, **cfg}, "args")
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_left_over_and_missing_tensors_are_refused() -> None:
    with pytest.raises(FormatError, match=r"tensors with no LlamaForCausalLM counterpart: decoder\.layers\.0\.extra"):
        to_hf(_llama_view(**{"decoder.layers.0.extra": (8,)}), CFG, "args")
    with pytest.raises(FormatError, match=r"no 'decoder\.layers\.0\.self_attention\.linear_qkv\.bias'"):
        to_hf(_llama_view(), {**CFG, "add_qkv_bias": True}, "args", "qwen2")
    with pytest.raises(OptionError, match="to_hf gemma: choose one of auto, llama"):
        to_hf(_llama_view(), CFG, "args", "gemma")


def test_a_router_mixtral_cannot_express_is_refused() -> None:
    moe = {"decoder.layers.0.mlp.router.weight": (2, 8), "decoder.layers.0.mlp.experts.experts.linear_fc1.weight":
           (2, 24, 8), "decoder.layers.0.mlp.experts.experts.linear_fc2.weight": (2, 8, 12)}
    view = _llama_view(**moe)
    for name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"):
        del view.tensors[name]
    cfg = {**CFG, "num_moe_experts": 2, "moe_router_topk": 1}
    out, config, _ = to_hf(view, cfg, "args")  # softmax over the top k: Mixtral's own routing
    assert config["num_local_experts"] == 2 and "model.layers.0.block_sparse_moe.experts.1.w3.weight" in out.tensors
    with pytest.raises(OptionError) as caught:
        to_hf(view, {**cfg, "moe_router_pre_softmax": True}, "args", "mixtral")
    assert str(caught.value) == ("args: to_hf mixtral: the model has router weights not renormalized over the top k "
                                 "(moe_router_pre_softmax), which MixtralForCausalLM does not; export without "
                                 "`to_hf` to keep Megatron names")
    with pytest.raises(OptionError, match="moe_router_score_function 'sigmoid'"):
        to_hf(view, {**cfg, "moe_router_score_function": "sigmoid"}, "args")


def test_a_gemma_checkpoint_named_as_another_family_is_refused() -> None:
    gemma = {**CFG, "apply_layernorm_1p": True, "activation_func": "fast_gelu", "attn_logit_softcapping": 50.0}
    with pytest.raises(OptionError) as caught:
        to_hf(_llama_view(), gemma, "args", "llama")
    assert str(caught.value) == (
        "args: to_hf llama: the model has a GeGLU feed-forward (activation_func fast_gelu / openai_gelu), which "
        "LlamaForCausalLM does not; the model has logit soft-capping (attn_logit_softcapping / "
        "final_logit_softcapping), which LlamaForCausalLM does not; the model has zero-centered norm weights "
        "(layernorm_zero_centered_gamma / apply_layernorm_1p), which LlamaForCausalLM does not; choose gemma2 "
        "(or auto)")
    with pytest.raises(FormatError, match=r"no 'decoder\.layers\.0\.self_attention\.linear_proj\.post_layernorm"):
        to_hf(_llama_view(), gemma, "args")


def test_gemma_window_pattern_and_attention_scale() -> None:
    view = _view({n: t.shape for n, t in _llama_view().tensors.items() if "pre_mlp" not in n} | {
        f"decoder.layers.0.{n}": (8,) for n in ("pre_mlp_layernorm.weight", "self_attention.linear_proj.post_layernorm"
                                                ".weight", "mlp.linear_fc2.post_layernorm.weight")})
    cfg = {**CFG, "num_layers": 1, "layernorm_zero_centered_gamma": True, "activation_func": "openai_gelu",
           "window_size": [4, 0], "window_attn_skip_freq": 2, "softmax_scale": 0.25}
    config = to_hf(view, cfg, "model.yaml")[1]
    assert (config["architectures"], config["layer_types"], config["query_pre_attn_scalar"], config["sliding_window"],
            config["hidden_activation"]) == (["Gemma2ForCausalLM"], ["sliding_attention"], 16, 5, "gelu_pytorch_tanh")
    assert "model.layers.0.pre_feedforward_layernorm.weight" in to_hf(view, cfg, "model.yaml")[0].tensors


def test_numeric_text_is_a_number() -> None:
    """PyYAML reads NeMo's `layernorm_epsilon: 1e-05` as text."""
    config = to_hf(_llama_view(), {**CFG, "layernorm_epsilon": "1e-05", "hidden_size": "8"}, "model.yaml")[1]
    assert (config["rms_norm_eps"], config["hidden_size"]) == (1e-05, 8)


def test_auto_reads_the_family_from_the_config() -> None:
    view = _llama_view(**{"decoder.layers.0.self_attention.linear_qkv.bias": (16,)})
    assert to_hf(view, {**CFG, "add_qkv_bias": True}, "args")[1]["architectures"] == ["Qwen2ForCausalLM"]
    nemo = {**CFG, "_target_": "nemo.collections.llm.gpt.model.mistral.MistralConfig7B", "window_size": [4, 0]}
    config = to_hf(_llama_view(), nemo, "model.yaml")[1]
    # (4, 0): the query and the 4 keys before it
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], 5)


# ------------------------------------------------------------------------------------- HF -> Megatron (import)

@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_import_then_export_gives_back_the_hf_model(models: Path, tmp_path: Path, family: str) -> None:
    from converters.hf_families.importer import import_hf

    result = import_hf(str(models / "hf" / family), str(tmp_path / "megatron"))
    assert result.family == family and result.report[0].startswith(f"imported {ARCHITECTURES[family]} as Megatron")
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((tmp_path / "megatron" / "release" / "metadata.json").read_text())["sharded_backend"] == \
        "torch_dist"
    # the same names, shapes and bytes megatron-core itself saved for this model (the `models` fixture)
    from converters.formats import load_index

    ours, theirs = load_index(str(tmp_path / "megatron")), load_index(str(models / "megatron" / family))
    assert {n: t.shape for n, t in ours.tensors.items()} == {n: t.shape for n, t in theirs.tensors.items()
                                                             if not n.startswith("mtp.")}  # HF has no MTP layers
    if family not in RAW:
        assert {n for n in ours.objects if "_extra_state" in n} == {n for n in theirs.objects if "_extra_state" in n}
    out = tmp_path / "back"
    proc = ckptctl("export", tmp_path / "megatron", out, "--to-hf", "mistral" if family == "mistral" else "auto",
                   "-q", "--verify")
    # the generation config save_pretrained wrote went into the import and comes back with the export
    generation = (models / "hf" / family / "generation_config.json").read_bytes()
    assert (tmp_path / "megatron" / "generation_config.json").read_bytes() == generation
    assert (out / "generation_config.json").read_bytes() == generation, proc.stderr
    got, want = load_file(out / "model.safetensors"), load_file(models / "hf" / family / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tp", "ep", "pp"), [("qwen2", 2, 1, 1), ("qwen3_moe", 2, 1, 1),
                                                        ("mixtral", 1, 2, 1), ("llama", 1, 1, 2)])
def test_megatron_loads_the_import_in_parallel(models: Path, tmp_path: Path, family: str, tp: int, ep: int,
                                               pp: int) -> None:
    """megatron-core's own dist_checkpointing.load reads the import into a GPTModel at TP=2, EP=2 or PP=2 built from
    the args the import wrote; its forward (through both pipeline stages at PP=2) equals the HF model's."""
    from converters.hf_families.importer import import_hf

    import_hf(str(models / "hf" / family), str(tmp_path / "megatron"))
    logits = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, str(TOOL), "load", str(tmp_path / "megatron" / "release"), str(logits),
                           str(tp), str(ep), str(pp), str(29750 + tp * 3 + ep + pp * 5 + len(family))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(logits, weights_only=True),
                               torch.load(models / "hf" / family / "logits.pt", weights_only=True), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.slow
def test_deepseek_import_has_megatrons_extra_states(hf_models: Path, tmp_path: Path) -> None:
    """DeepSeek-V3 is saved per layer (`decoder.layers.{i}.`): its `_extra_state` keys are megatron-core's own for
    that layout (`shard_0_1`, per expert `shard_{e}_{E}`, the dense layer's MLP and the MoE layer's experts and
    shared experts), from a GPTModel megatron-core builds from the same config. MLA's attention needs Transformer
    Engine in megatron-core 0.16, so the reference attention is the local spec's: the linear_proj keys are
    compared, and MLA's other linear modules are keyed the same way (Column/RowParallelLinear)."""
    from converters.formats import load_index
    from converters.hf_families.importer import import_hf

    source = hf_models / "hf" / "deepseek_v3"
    import_hf(str(source), str(tmp_path / "megatron"))
    ours = {n for n in load_index(str(tmp_path / "megatron")).objects if "_extra_state" in n}
    proc = subprocess.run([sys.executable, str(TOOL), "extra-states", str(source / "config.json"),
                           str(tmp_path / "keys.json"), "29781"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = set(json.loads((tmp_path / "keys.json").read_text()))
    attention = {n for n in theirs if ".self_attention." in n}
    assert {n for n in ours if ".self_attention." not in n} == theirs - attention
    assert {n for n in attention if ".linear_proj." in n} <= ours
    mla = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
    assert {n for n in ours if ".self_attention." in n} == {
        f"decoder.layers.{i}.self_attention.{m}._extra_state/shard_0_1" for i in range(2) for m in mla}


@pytest.mark.slow
def test_fsdp2_loads_the_dcp_import(hf_models: Path, tmp_path: Path) -> None:
    """`import --to dcp` of every family, dcp.load into FSDP2-wrapped transformers models built from the config.json
    it carried, at 2 gloo ranks: each model's full state_dict equals from_pretrained's of the HF folder (the tied
    head, transformers' fused experts) and its forward gives the original logits."""
    from transformers import AutoModelForCausalLM

    for family in MODELS:
        proc = ckptctl("import", hf_models / "hf" / family, tmp_path / family, "--to", "dcp", "--world-size", "2")
        assert f"imported {ARCHITECTURES[family]} as a DCP checkpoint for 2 FSDP2 rank(s)" in proc.stderr
        assert ("tied embeddings: lm_head.weight" in proc.stderr) == MODELS[family][1].get("tie_word_embeddings",
                                                                                          False)
        assert ("fused the experts of" in proc.stderr) == (family in ("mixtral", "qwen3_moe", "deepseek_v3"))
    proc = subprocess.run([sys.executable, str(TOOL), "fsdp2", str(tmp_path), "29771", *MODELS], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for family in MODELS:
        got = torch.load(tmp_path / f"{family}.pt", weights_only=True)
        want = AutoModelForCausalLM.from_pretrained(hf_models / "hf" / family, dtype=torch.float32).state_dict()
        assert sorted(got["state"]) == sorted(want), family
        for name, tensor in want.items():
            assert got["state"][name].dtype == tensor.dtype and torch.equal(got["state"][name], tensor), name
        assert torch.equal(got["logits"], torch.load(hf_models / "hf" / family / "logits.pt", weights_only=True)), \
            family


@pytest.mark.slow
def test_import_carries_the_tokenizer(models: Path, tmp_path: Path) -> None:
    import shutil

    from converters.hf_families.importer import import_hf

    hf = tmp_path / "hf"
    shutil.copytree(models / "hf" / "llama", hf)
    files = {"tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
             "tokenizer_config.json": b'{"model_max_length": 64}', "chat_template.jinja": b"{{ messages }}"}
    for name, data in files.items():
        (hf / name).write_bytes(data)
    result = import_hf(str(hf), str(tmp_path / "megatron"))
    assert result.report[1] == ("carried side files: generation_config.json, tokenizer.json, tokenizer_config.json, "
                                "chat_template.jinja")
    for name, data in files.items():
        assert (tmp_path / "megatron" / name).read_bytes() == data
    assert not (tmp_path / "megatron" / "config.json").exists()  # Megatron's config is common.pt's args
    out = tmp_path / "back"
    proc = ckptctl("export", tmp_path / "megatron", out, "--to-hf", "auto", "-q")
    for name, data in files.items():
        assert (out / name).read_bytes() == data, proc.stderr


def test_import_refusals(tmp_path: Path) -> None:
    from converters.hf_families.importer import import_hf

    (tmp_path / "hf").mkdir()
    with pytest.raises(FormatError, match=r"no config\.json"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_attention_heads": 4}))
    with pytest.raises(OptionError, match="model_type 'gpt2' has no family in the table"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": "four"}))
    with pytest.raises(FormatError, match=r"config\.json: num_attention_heads is 'four', not a positive integer"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "llama", **COMMON, "num_attention_heads": 4, "num_key_value_heads": 3}))
    with pytest.raises(OptionError, match="4 attention heads do not divide into 3 query groups"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    scaled = {"model_type": "gemma3_text", **COMMON, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(OptionError, match=r"config\.json: rope_parameters\.full_attention is .*; only default rope"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    deepseek = {"model_type": "deepseek_v3", **COMMON, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "n_shared_experts": 1, "moe_intermediate_size": 32, "kv_lora_rank": 16}
    for fields, words in (({"rope_interleave": False}, "rope_interleave is false"),
                          ({"norm_topk_prob": False}, "norm_topk_prob is false"),
                          ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
                          ({}, "rms_norm_eps is 1e-05, but transformers normalises the q and kv latents with 1e-06"),
                          ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 4},
                           "2 expert groups with 1 chosen for top 4: megatron-core ranks groups by their top 4 "
                           "scores, transformers by their top 2")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**deepseek, **fields}))
        with pytest.raises(OptionError) as caught:
            import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
        assert words in str(caught.value) and "Megatron-core's DeepSeek layers do not express it" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_export_refuses_group_routing_transformers_computes_otherwise() -> None:
    """megatron-core ranks DeepSeek expert groups by the sum of their top (top k // groups chosen) scores,
    transformers by their top 2: a Megatron model where those differ is refused in one line, not exported to route
    other experts."""
    from converters.hf_families.config import megatron_args, read_megatron
    from converters.hf_families.mapping import check
    from converters.hf_families.table import FAMILIES

    hf = {"model_type": "deepseek_v3", **COMMON, "rms_norm_eps": 1e-6, "num_key_value_heads": 4, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "kv_lora_rank": 16,
          "n_group": 2, "topk_group": 1}
    args = megatron_args(hf, "hf")
    check(FAMILIES["deepseek_v3"], read_megatron(args, "ckpt"), "ckpt")  # top 2 of 1 group: both take the top 2
    with pytest.raises(OptionError) as caught:
        check(FAMILIES["deepseek_v3"], read_megatron({**args, "moe_router_topk": 4}, "ckpt"), "ckpt")
    assert str(caught.value) == ("ckpt: to_hf deepseek_v3: 2 expert groups with 1 chosen for top 4: megatron-core "
                                 "ranks groups by their top 4 scores, transformers by their top 2, so "
                                 "DeepseekV3ForCausalLM would route other experts; export without `to_hf` to keep "
                                 "Megatron names")
