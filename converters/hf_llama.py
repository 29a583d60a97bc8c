"""`export --to-hf llama`: a Megatron GPT model of the Llama family as Hugging Face `LlamaForCausalLM`.

Works on the clean, unstacked view (`decoder.layers.{i}.…`): the fused QKV weight is split per query
group into q/k/v (GQA), the fused SwiGLU `linear_fc1` into gate/up, the rest renamed. Every output
tensor is a view (byte ranges) of the checkpoint's chunks, so nothing is read until it is written.
The config comes from the checkpoint itself (common.pt args or NeMo context/model.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import FormatError, OptionError
from .index import CheckpointIndex, TensorEntry
from .stacking import concat, rows


@dataclass
class GptShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    tied: bool


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _require(cfg: dict[str, Any], where: str, *names: str) -> Any:
    value = _get(cfg, *names)
    if value is None:
        raise FormatError(f"{where}: the model config has no {names[0]}; cannot build the Llama config")
    return value


def _check_llama(cfg: dict[str, Any], where: str) -> None:
    problems = []
    norm = _get(cfg, "normalization", default="LayerNorm")
    if norm != "RMSNorm":
        problems.append(f"normalization {norm!r} (Llama uses RMSNorm)")
    if not (_get(cfg, "swiglu") or _get(cfg, "gated_linear_unit")):
        problems.append("no SwiGLU (swiglu / gated_linear_unit is off)")
    if _get(cfg, "add_bias_linear", default=True) or _get(cfg, "add_qkv_bias", default=False):
        problems.append("linear biases (add_bias_linear / add_qkv_bias)")
    position = _get(cfg, "position_embedding_type", default="learned_absolute")
    if position != "rope" and not _get(cfg, "use_rotary_position_embeddings"):
        problems.append(f"position embeddings {position!r} (Llama uses rope)")
    if float(_get(cfg, "rotary_percent", default=1.0)) != 1.0:
        problems.append("rotary_percent != 1.0")
    if _get(cfg, "qk_layernorm", default=False):
        problems.append("qk_layernorm")
    if problems:
        raise OptionError(f"{where}: not a Llama-family model: " + "; ".join(problems)
                          + "; export without `to_hf` to get the weights under their Megatron names")


def hf_config(cfg: dict[str, Any], where: str, view: CheckpointIndex) -> tuple[GptShape, dict[str, Any]]:
    """The model shape and the `config.json` of the equivalent LlamaForCausalLM."""
    _check_llama(cfg, where)
    hidden = int(_require(cfg, where, "hidden_size"))
    heads = int(_require(cfg, where, "num_attention_heads"))
    gqa = _get(cfg, "group_query_attention", default=True)
    groups = int(_get(cfg, "num_query_groups", default=heads) if gqa else heads)
    head_dim = int(_get(cfg, "kv_channels", default=hidden // heads))
    tied = bool(_get(cfg, "share_embeddings_and_output_weights",
                     default=not _get(cfg, "untie_embeddings_and_output_weights", default=False)))
    embed = _find(view, "embedding.word_embeddings.weight")
    shape = GptShape(layers=int(_require(cfg, where, "num_layers")), hidden=hidden,
                     ffn=int(_require(cfg, where, "ffn_hidden_size")), heads=heads, groups=groups,
                     head_dim=head_dim, tied=tied and "output_layer.weight" not in view.tensors)
    if heads % groups:
        raise FormatError(f"{where}: {heads} attention heads do not divide into {groups} query groups")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
        "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim,
        "vocab_size": embed.shape[0], "hidden_act": "silu",
        "max_position_embeddings": int(_get(cfg, "max_position_embeddings", "seq_length", default=4096)),
        "rms_norm_eps": float(_get(cfg, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        "rope_theta": float(_get(cfg, "rotary_base", default=10000)),
        "tie_word_embeddings": shape.tied, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": embed.dtype, "initializer_range": float(_get(cfg, "init_method_std", default=0.02)),
    }
    if _get(cfg, "use_rope_scaling") or _get(cfg, "scale_factor"):
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": float(_get(cfg, "rope_scaling_factor", "scale_factor", default=8.0)),
            "low_freq_factor": float(_get(cfg, "low_freq_factor", default=1.0)),
            "high_freq_factor": float(_get(cfg, "high_freq_factor", default=4.0)),
            "original_max_position_embeddings": int(_get(cfg, "old_context_len", default=8192))}
    return shape, config


def _find(view: CheckpointIndex, name: str) -> TensorEntry:
    if name not in view.tensors:
        raise FormatError(f"{view.uri}: no {name!r} in the checkpoint; is this a Megatron GPT model?")
    return view.tensors[name]


def _either(view: CheckpointIndex, *names: str) -> TensorEntry:
    for name in names:
        if name in view.tensors:
            return view.tensors[name]
    raise FormatError(f"{view.uri}: none of {', '.join(map(repr, names))} in the checkpoint")


def _layer(view: CheckpointIndex, shape: GptShape, i: int) -> dict[str, TensorEntry]:
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    qkv = _find(view, f"{src}self_attention.linear_qkv.weight")
    per_group = shape.heads // shape.groups
    block = (per_group + 2) * shape.head_dim
    if qkv.shape != (shape.groups * block, shape.hidden):
        raise FormatError(f"{view.uri}: {qkv.name!r} is {list(qkv.shape)}, the config says "
                          f"[{shape.groups * block}, {shape.hidden}]; the config does not match the weights")
    q_rows = per_group * shape.head_dim
    parts: dict[str, list[TensorEntry]] = {"q": [], "k": [], "v": []}
    for g in range(shape.groups):
        base = g * block
        parts["q"].append(rows(qkv, base, q_rows, qkv.name))
        parts["k"].append(rows(qkv, base + q_rows, shape.head_dim, qkv.name))
        parts["v"].append(rows(qkv, base + q_rows + shape.head_dim, shape.head_dim, qkv.name))
    fc1 = _find(view, f"{src}mlp.linear_fc1.weight")
    if fc1.shape != (2 * shape.ffn, shape.hidden):
        raise FormatError(f"{view.uri}: {fc1.name!r} is {list(fc1.shape)}, expected [{2 * shape.ffn}, "
                          f"{shape.hidden}] (gate and up of the SwiGLU MLP)")
    out = {f"{dst}self_attn.{p}_proj.weight": concat(f"{dst}self_attn.{p}_proj.weight", parts[p]) for p in parts}
    out[f"{dst}mlp.gate_proj.weight"] = rows(fc1, 0, shape.ffn, f"{dst}mlp.gate_proj.weight")
    out[f"{dst}mlp.up_proj.weight"] = rows(fc1, shape.ffn, shape.ffn, f"{dst}mlp.up_proj.weight")
    renames = {
        f"{dst}self_attn.o_proj.weight": (f"{src}self_attention.linear_proj.weight",),
        f"{dst}mlp.down_proj.weight": (f"{src}mlp.linear_fc2.weight",),
        f"{dst}input_layernorm.weight": (f"{src}self_attention.linear_qkv.layer_norm_weight",
                                         f"{src}input_layernorm.weight"),
        f"{dst}post_attention_layernorm.weight": (f"{src}mlp.linear_fc1.layer_norm_weight",
                                                  f"{src}pre_mlp_layernorm.weight"),
    }
    for new, olds in renames.items():
        entry = _either(view, *olds)
        out[new] = TensorEntry(new, entry.dtype, entry.shape, entry.chunks)
    return out


def to_llama(view: CheckpointIndex, cfg: dict[str, Any], where: str) -> tuple[CheckpointIndex, dict, list[str]]:
    """The view under LlamaForCausalLM names and layouts, its config.json, and a report."""
    shape, config = hf_config(cfg, where, view)
    tensors: dict[str, TensorEntry] = {}
    for i in range(shape.layers):
        tensors.update(_layer(view, shape, i))
    for new, old in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                     ("model.norm.weight", "decoder.final_layernorm.weight"),
                     ("lm_head.weight", None if shape.tied else "output_layer.weight")):
        if old is not None:
            entry = _find(view, old)
            tensors[new] = TensorEntry(new, entry.dtype, entry.shape, entry.chunks)
    used = {f"decoder.layers.{i}." for i in range(shape.layers)}
    left = [n for n in view.tensors if not any(n.startswith(u) for u in used) and n not in (
        "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")]
    if left:
        raise FormatError(f"{view.uri}: tensors with no Llama counterpart: {', '.join(left[:5])}; export "
                          "without `to_hf` to keep them")
    out = CheckpointIndex(uri=view.uri, format=view.format, producer=view.producer, world_size=view.world_size,
                          tensors=tensors, files=view.files)
    report = [f"mapped to LlamaForCausalLM: {shape.layers} layers, {shape.heads} heads in {shape.groups} query "
              f"groups, vocab {config['vocab_size']} (config from {where})"]
    return out, config, report
