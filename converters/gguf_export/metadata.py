"""The architecture metadata llama.cpp reads, from an HF config.json, as llama.cpp's convert_hf_to_gguf.py writes
it (conversion/base.py TextModel.set_gguf_parameters, llama.py, qwen.py), in the same order.

A family is picked by the config's `architectures[0]`; one llama.cpp does not know from us is refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from ..errors import FormatError


@dataclass(frozen=True)
class Family:
    hf_arch: str  # config.json architectures[0]
    arch: gguf.MODEL_ARCH
    permute_qk: bool  # llama-style rope: q_proj/k_proj rows permuted as llama.cpp's LlamaModel.permute
    experts: str = ""  # how per-expert tensors are named (names._EXPERTS): "qwen", "mixtral"; "" dense
    # config.json settings llama.cpp's model for the architecture assumes without reading them from the file:
    # (key, the value it assumes, what it does). Another value would load and compute other logits, silently.
    assumes: tuple[tuple[str, Any, str], ...] = ()

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


FAMILIES = {f.hf_arch: f for f in (
    Family("LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA, True),
    Family("MistralForCausalLM", gguf.MODEL_ARCH.LLAMA, True),
    Family("MixtralForCausalLM", gguf.MODEL_ARCH.LLAMA, True, experts="mixtral"),
    Family("Qwen2ForCausalLM", gguf.MODEL_ARCH.QWEN2, False),
    Family("Qwen3ForCausalLM", gguf.MODEL_ARCH.QWEN3, False),
    Family("Qwen3MoeForCausalLM", gguf.MODEL_ARCH.QWEN3MOE, False, experts="qwen",
           assumes=(("norm_topk_prob", True, "renormalises the chosen experts' router weights"),)),
)}


def family(config: dict[str, Any], uri: str) -> Family:
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        said = f"{arch!r} is not a family the GGUF export knows" if arch and len(arch) <= 60 else \
            "has no architectures entry naming the model class"
        raise FormatError(f"{uri} (config.json): {said} (it knows {known}); set architectures or use llama.cpp's "
                          "convert_hf_to_gguf.py", uri=uri, key="architectures")
    fam = FAMILIES[arch]
    for key, value, does in fam.assumes:
        if config.get(key) != value:
            raise FormatError(f"{uri} (config.json): {key} is {config.get(key)!r}, but llama.cpp's {fam.name} always "
                              f"{does} ({key}={value!r}), so the GGUF would compute other logits; no GGUF export "
                              "serves this model (llama.cpp's own converter writes one anyway)", uri=uri, key=key)
    return fam


def _find(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((config[k] for k in keys if k in config), None)


def _required(config: dict[str, Any], keys: tuple[str, ...], uri: str) -> Any:
    value = _find(config, keys)
    if value is None:
        raise FormatError(f"{uri} (config.json): no {keys[0]}; llama.cpp needs it (fix config.json)", uri=uri,
                          key=keys[0])
    return value


def _number(value: Any, key: str, uri: str, kind: type = int) -> Any:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer() and value >= 0
    if not ok:
        raise FormatError(f"{uri} (config.json): {key} is not a {'count' if kind is int else 'number'}; fix "
                          "config.json", uri=uri, key=key)
    return int(value) if kind is int else float(value)


def block_count(config: dict[str, Any], uri: str) -> int:
    keys = ("n_layers", "num_hidden_layers", "n_layer", "num_layers")
    return _number(_required(config, keys, uri), keys[1], uri)


def add_parameters(writer: gguf.GGUFWriter, config: dict[str, Any], fam: Family, file_type: int, uri: str) -> None:
    """The `{arch}.*` keys and general.file_type, as llama.cpp's converter adds them."""
    if "text_config" in config and isinstance(config["text_config"], dict):
        config = {**config, **config["text_config"]}
    writer.add_block_count(block_count(config, uri))

    def count(keys: tuple[str, ...]) -> int | None:
        value = _find(config, keys)
        return None if value is None else _number(value, keys[0], uri)

    if (n_ctx := count(("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                        "model_max_length"))) is not None:
        writer.add_context_length(n_ctx)
    if (n_embd := count(("hidden_size", "n_embd", "dim"))) is not None:
        writer.add_embedding_length(n_embd)
    if (n_ff := count(("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner",
                       "hidden_dim"))) is not None:
        writer.add_feed_forward_length(n_ff)
    if (n_head := count(("num_attention_heads", "n_head", "n_heads"))) is not None:
        writer.add_head_count(n_head)
    if (n_head_kv := count(("num_key_value_heads", "n_kv_heads"))) is not None:
        writer.add_head_count_kv(n_head_kv)
    if config.get("is_causal") is False:
        writer.add_causal_attention(False)
    rope = _rope(config)
    rope_type = rope.get("rope_type")
    if rope_type is not None and rope_type not in ("default", "llama3"):
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(_number(factor, "rope_scaling.factor", uri, float))
        elif rope_type == "yarn" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(_number(factor, "rope_scaling.factor", uri, float))
            writer.add_rope_scaling_orig_ctx_len(_number(rope.get("original_max_position_embeddings"),
                                                         "rope_scaling.original_max_position_embeddings", uri))
            for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                             ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                             ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
                value = rope.get(key, rope.get("attn_factor")) if key == "attention_factor" else rope.get(key)
                if value is not None:
                    add(_number(value, f"rope_scaling.{key}", uri, float))
        else:
            raise FormatError(f"{uri} (config.json): rope type {rope_type!r} is not one the GGUF export writes "
                              "(default, linear, yarn); use llama.cpp's convert_hf_to_gguf.py", uri=uri,
                              key="rope_scaling")
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(_number(theta, "rope_theta", uri, float))
    if (eps := _find(config, ("rms_norm_eps", "norm_eps"))) is not None:
        writer.add_layer_norm_rms_eps(_number(eps, "rms_norm_eps", uri, float))
    if (n_experts := count(("num_local_experts", "num_experts", "n_routed_experts"))) is not None:
        writer.add_expert_count(n_experts)
    if (n_used := count(("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))) is not None:
        writer.add_expert_used_count(n_used)
    if (head_dim := config.get("head_dim")) is not None:
        writer.add_key_length(_number(head_dim, "head_dim", uri))
        writer.add_value_length(_number(head_dim, "head_dim", uri))
    writer.add_file_type(file_type)
    # the family's own keys, after the common ones
    if fam.arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(_number(_required(config, ("vocab_size",), uri), "vocab_size", uri))
        rope_dim = head_dim if head_dim is not None else \
            _number(_required(config, ("hidden_size",), uri), "hidden_size", uri) // \
            max(_number(_required(config, ("num_attention_heads",), uri), "num_attention_heads", uri), 1)
        writer.add_rope_dimension_count(_number(rope_dim, "head_dim", uri))
    if fam.arch == gguf.MODEL_ARCH.QWEN3MOE and (moe_ff := config.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(_number(moe_ff, "moe_intermediate_size", uri))


def rope_freqs(config: dict[str, Any], fam: Family, uri: str) -> np.ndarray | None:
    """Llama 3 rope scaling: the per-frequency factors llama.cpp's converter writes as rope_freqs.weight
    (conversion/llama.py generate_extra_tensors; the same float32 torch steps, so torch is imported here, only
    for such a config: the export itself needs no torch)."""
    rope = _rope(config)
    if fam.arch != gguf.MODEL_ARCH.LLAMA or str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = _number(rope.get("rope_theta", 10000.0), "rope_theta", uri, float)
    dim = config.get("head_dim")
    if dim is None:
        dim = _number(_required(config, ("hidden_size",), uri), "hidden_size", uri) // \
            max(_number(_required(config, ("num_attention_heads",), uri), "num_attention_heads", uri), 1)
    dim = _number(dim, "head_dim", uri)
    factor = _number(rope.get("factor", 8.0), "rope_scaling.factor", uri, float)
    low = _number(rope.get("low_freq_factor", 1.0), "rope_scaling.low_freq_factor", uri, float)
    high = _number(rope.get("high_freq_factor", 4.0), "rope_scaling.high_freq_factor", uri, float)
    old = _number(rope.get("original_max_position_embeddings", 8192), "original_max_position_embeddings", uri)
    if dim <= 0 or high == low or not low or not high:
        raise FormatError(f"{uri} (config.json): llama3 rope scaling with head_dim {dim}, low_freq_factor {low} and "
                          f"high_freq_factor {high} has no rope factors; fix config.json", uri=uri, key="rope_scaling")
    import torch

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = old / low, old / high
    factors: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters (transformers 5) or rope_scaling, with rope_theta mirrored in, as llama.cpp reads them."""
    found = config.get("rope_parameters", config.get("rope_scaling")) or {}
    rope = dict(found) if isinstance(found, dict) else {}
    rope = rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope
    theta = _find(config, ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                           "rotary_emb_base"))
    if "rope_theta" not in rope and theta is not None:
        rope["rope_theta"] = theta
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    return rope
