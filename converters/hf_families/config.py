"""Model config translation: a Megatron config (Megatron-LM `args` in common.pt, or a NeMo 2 `context/model.yaml`
`config:` in TransformerConfig names) <-> a Hugging Face `config.json`.

`read_megatron` reads what the mapping needs, and the features that decide the family (QKV bias, QK-norm, MoE,
sliding window); `hf_config` writes a family's config.json; `megatron_args` is the other way (HF -> Megatron-LM
argument names, the start of an import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError, OptionError, short
from .transforms import Shape

FEATURES = ("qkv_bias", "qk_norm", "moe", "window", "pre_softmax", "zero_gamma", "gelu", "softcap", "window_pattern",
            "mla", "q_lora", "shared", "sigmoid", "expert_bias", "dense_layers")
FEATURE_WORDS = {"qkv_bias": "QKV bias (add_qkv_bias)", "qk_norm": "QK-norm (qk_layernorm)",
                 "moe": "mixture of experts (num_moe_experts)", "window": "sliding-window attention (window_size)",
                 "pre_softmax": "router weights not renormalized over the top k (moe_router_pre_softmax)",
                 "zero_gamma": "zero-centered norm weights (layernorm_zero_centered_gamma / apply_layernorm_1p)",
                 "gelu": "a GeGLU feed-forward (activation_func fast_gelu / openai_gelu)",
                 "softcap": "logit soft-capping (attn_logit_softcapping / final_logit_softcapping)",
                 "window_pattern": "full-attention layers between sliding-window ones (window_attn_skip_freq)",
                 "mla": "multi-latent attention (multi_latent_attention)",
                 "q_lora": "a low-rank query projection (q_lora_rank)",
                 "shared": "shared experts (moe_shared_expert_intermediate_size)",
                 "sigmoid": "sigmoid routing (moe_router_score_function 'sigmoid')",
                 "expert_bias": "a router expert bias (moe_router_enable_expert_bias)",
                 "dense_layers": "dense layers among the MoE layers (moe_layer_freq)"}
# activation_func names (a Megatron-LM arg, or a NeMo `_target_`) that are HF's gelu_pytorch_tanh (tanh approximation)
TANH_GELU = ("fast_gelu", "openai_gelu", "gelu_tanh")


@dataclass
class ModelConfig:
    shape: Shape
    tied: bool
    features: frozenset[str]
    eps: float
    rope_theta: float
    max_positions: int
    init_std: float
    top_k: int = 0
    window: int | None = None
    rope_scaling: dict[str, Any] | None = None
    nemo_class: str = ""  # NeMo's config class (`LlamaConfig`, `Qwen2Config`, ...), when the config came from NeMo
    extra: dict[str, Any] = field(default_factory=dict)
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense; empty: every layer as `experts` says

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer] if self.moe_layers else self.shape.experts > 0


def get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _require(cfg: dict[str, Any], where: str, *names: str) -> Any:
    value = get(cfg, *names)
    if value is None:
        raise FormatError(f"{where}: the model config has no {names[0]}; cannot build the Hugging Face config")
    return value


# the numeric settings the translation reads (sizes must be positive integers)
MEGATRON_SIZES = ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "num_layers",
                  "kv_channels", "moe_ffn_hidden_size", "moe_router_topk", "max_position_embeddings", "seq_length",
                  "old_context_len", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                  "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk",
                  "mtp_num_layers")
MEGATRON_NUMBERS = ("num_moe_experts", "num_experts", "rotary_percent", "rope_scaling_factor", "scale_factor",
                    "low_freq_factor", "high_freq_factor", "norm_epsilon", "layernorm_epsilon", "rotary_base",
                    "init_method_std", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                    "softmax_scale", "rope_local_base_freq", "moe_router_topk_scaling_factor")
# megatron-core's MLATransformerConfig YaRN settings -> HF rope_parameters (rope_type "yarn")
YARN = {"rotary_scaling_factor": "factor", "original_max_position_embeddings": "original_max_position_embeddings",
        "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}
HF_SIZES = ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "vocab_size", "num_experts_per_tok", "moe_intermediate_size",
            "sliding_window", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_routed_experts", "n_shared_experts", "n_group", "topk_group")
HF_NUMBERS = ("num_local_experts", "num_experts", "rms_norm_eps", "rope_theta", "initializer_range",
              "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "rope_local_base_freq",
              "routed_scaling_factor", "first_k_dense_replace")


def check_numbers(cfg: dict[str, Any], where: str, sizes: tuple[str, ...], numbers: tuple[str, ...]) -> dict[str, Any]:
    """`cfg` with its numeric settings as numbers (YAML 1.1 reads `1e-05` as text: numeric text is taken), or one
    line naming the first that is not a number (or, for a size, not a positive integer)."""
    out = dict(cfg)
    for name in sizes + numbers:
        value = cfg.get(name)
        if value is None:
            continue
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        size = name in sizes
        if isinstance(number, bool) or not isinstance(number, int | float) or (size and (
                not float(number).is_integer() or number <= 0)):
            raise FormatError(f"{where}: {name} is {short(value)}, not a "
                              + ("positive integer" if size else "number") + "; the model config is damaged")
        out[name] = int(number) if size else number
    return out


def _unsupported(cfg: dict[str, Any]) -> list[str]:
    """What no family of the table expresses (the common decoder: RMSNorm, SwiGLU, rope, no linear biases)."""
    problems = []
    norm = get(cfg, "normalization", default="LayerNorm")
    if norm != "RMSNorm":
        problems.append(f"normalization {norm!r} (the table's families use RMSNorm)")
    if not (get(cfg, "swiglu") or get(cfg, "gated_linear_unit")):
        problems.append("no SwiGLU (swiglu / gated_linear_unit is off)")
    activation = activation_name(cfg)
    if activation not in ("silu", *TANH_GELU):
        problems.append(f"activation_func {activation!r} (silu or a tanh GeLU expected)")
    if get(cfg, "add_bias_linear", default=True):
        problems.append("linear biases (add_bias_linear)")
    position = get(cfg, "position_embedding_type", default="learned_absolute")
    if position != "rope" and not get(cfg, "use_rotary_position_embeddings"):
        problems.append(f"position embeddings {position!r} (rope expected)")
    if float(get(cfg, "rotary_percent", default=1.0)) != 1.0:
        problems.append("rotary_percent != 1.0")
    if get(cfg, "rotary_interleaved", default=False):
        problems.append("interleaved rotary embeddings (rotary_interleaved)")
    score = get(cfg, "moe_router_score_function", default="softmax")
    if score not in ("softmax", "sigmoid"):
        problems.append(f"moe_router_score_function {score!r} (softmax or sigmoid routers only)")
    if get(cfg, "q_lora_rank") and not get(cfg, "multi_latent_attention"):
        problems.append("q_lora_rank without multi_latent_attention")
    rope_type = get(cfg, "rope_type")
    if rope_type not in (None, "rope") and not (rope_type == "yarn" and get(cfg, "multi_latent_attention")):
        problems.append(f"rope_type {rope_type!r} (plain rope, or YaRN with multi-latent attention only)")
    return problems


def _moe_layers(cfg: dict[str, Any], layers: int, experts: int, where: str) -> tuple[bool, ...]:
    """megatron-core's moe_layer_freq: an int N puts MoE on every Nth layer from the first (1: all), a list marks
    MoE layers with 1; () when every layer is alike."""
    freq = get(cfg, "moe_layer_freq", default=1)
    if not experts or freq == 1:
        return ()
    if type(freq) is int and freq > 0:
        return tuple(i % freq == 0 for i in range(layers))
    if isinstance(freq, list | tuple) and len(freq) == layers and all(f in (0, 1) for f in freq):
        return () if all(freq) else tuple(bool(f) for f in freq)
    raise FormatError(f"{where}: moe_layer_freq {short(freq)} is neither a positive integer nor a list of {layers} "
                      "0/1 flags; the model config is damaged")


def activation_name(cfg: dict[str, Any]) -> str:
    """The MLP activation's plain name: a Megatron-LM arg, a NeMo `_target_` (dotted path) or silu by default."""
    value = get(cfg, "activation_func", default="silu")
    if isinstance(value, dict):
        value = value.get("_target_", "")
    return str(value).rsplit(".", 1)[-1]


def _rope_bases(cfg: dict[str, Any]) -> dict[str, Any]:
    """Megatron-Bridge's Gemma 3 keeps rotary_base as (local, global): split it into rope_local_base_freq and
    rotary_base so each is checked as a number."""
    base = cfg.get("rotary_base")
    if isinstance(base, list | tuple) and len(base) == 2:
        return {**cfg, "rope_local_base_freq": base[0], "rotary_base": base[1]}
    return cfg


def read_megatron(cfg: dict[str, Any], where: str) -> ModelConfig:
    """The model's shape and features from its Megatron config; one line naming what no family expresses."""
    cfg = check_numbers(_rope_bases(cfg), where, MEGATRON_SIZES, MEGATRON_NUMBERS + tuple(YARN))
    problems = _unsupported(cfg)
    if problems:
        raise OptionError(f"{where}: no Hugging Face family in the table expresses " + "; ".join(problems)
                          + "; export without `to_hf` to get the weights under their Megatron names")
    hidden = int(_require(cfg, where, "hidden_size"))
    heads = int(_require(cfg, where, "num_attention_heads"))
    gqa = get(cfg, "group_query_attention", default=True)
    groups = int(get(cfg, "num_query_groups", default=heads) if gqa else heads)
    if groups <= 0 or heads % groups:
        raise OptionError(f"{where}: {heads} attention heads do not divide into {groups} query groups; no Hugging "
                          "Face attention expresses that", option="to_hf")
    ffn = int(_require(cfg, where, "ffn_hidden_size"))
    experts = int(get(cfg, "num_moe_experts", "num_experts", default=0) or 0)
    window = get(cfg, "window_size")
    features = {name for name, on in (("qkv_bias", get(cfg, "add_qkv_bias", default=False)),
                                      ("qk_norm", get(cfg, "qk_layernorm", default=False)),
                                      ("moe", experts > 0), ("window", window is not None),
                                      ("pre_softmax", experts > 0 and get(cfg, "moe_router_pre_softmax")),
                                      ("zero_gamma", get(cfg, "layernorm_zero_centered_gamma", "apply_layernorm_1p")),
                                      ("gelu", activation_name(cfg) in TANH_GELU),
                                      ("softcap", get(cfg, "attn_logit_softcapping", "final_logit_softcapping")),
                                      ("window_pattern", window is not None and get(cfg, "window_attn_skip_freq")),
                                      ("mla", get(cfg, "multi_latent_attention")),
                                      ("q_lora", get(cfg, "multi_latent_attention") and get(cfg, "q_lora_rank")),
                                      ("shared", get(cfg, "moe_shared_expert_intermediate_size")),
                                      ("sigmoid", experts > 0 and get(cfg, "moe_router_score_function") == "sigmoid"),
                                      ("expert_bias", experts > 0 and get(cfg, "moe_router_enable_expert_bias",
                                                                          "moe_router_expert_bias"))) if on}
    shape = Shape(layers=int(_require(cfg, where, "num_layers")), hidden=hidden, ffn=ffn, heads=heads,
                  groups=groups, head_dim=int(get(cfg, "kv_channels", default=hidden // heads)), experts=experts,
                  moe_ffn=int(get(cfg, "moe_ffn_hidden_size", default=ffn)) if experts else 0)
    tied = bool(get(cfg, "share_embeddings_and_output_weights",
                    default=not get(cfg, "untie_embeddings_and_output_weights", default=False)))
    scaling = None
    if get(cfg, "use_rope_scaling") or get(cfg, "scale_factor"):
        scaling = {"rope_type": "llama3",
                   "factor": float(get(cfg, "rope_scaling_factor", "scale_factor", default=8.0)),
                   "low_freq_factor": float(get(cfg, "low_freq_factor", default=1.0)),
                   "high_freq_factor": float(get(cfg, "high_freq_factor", default=4.0)),
                   "original_max_position_embeddings": int(get(cfg, "old_context_len", default=8192))}
    if window is not None:
        window = _window(window, where)
    target = str(cfg.get("_target_") or "")
    extra = {name: cfg[name] for name in ("attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq")
             if cfg.get(name) is not None}
    scale = get(cfg, "query_pre_attn_scalar")
    if scale is None and get(cfg, "softmax_scale"):  # Megatron-Bridge's Gemma: softmax_scale = scalar ** -0.5
        scale = round(float(cfg["softmax_scale"]) ** -2)
    extra["query_pre_attn_scalar"] = int(scale) if scale is not None else shape.head_dim
    if window is not None:
        extra["layer_types"] = _layer_types(cfg.get("window_attn_skip_freq"), shape.layers, where)
    for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                 "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_topk_scaling_factor", "mtp_num_layers"):
        if cfg.get(name) is not None:
            extra[name] = cfg[name]
    if get(cfg, "rope_type") == "yarn":
        extra["yarn"] = {hf: cfg[name] for name, hf in YARN.items() if cfg.get(name) is not None}
    moe_layers = _moe_layers(cfg, shape.layers, experts, where)
    if moe_layers and not all(moe_layers):
        features.add("dense_layers")
    return ModelConfig(shape=shape, tied=tied, features=frozenset(features),
                       eps=float(get(cfg, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
                       rope_theta=float(get(cfg, "rotary_base", default=10000)),
                       max_positions=int(get(cfg, "max_position_embeddings", "seq_length", default=4096)),
                       init_std=float(get(cfg, "init_method_std", default=0.02)),
                       top_k=int(get(cfg, "moe_router_topk", default=2)) if experts else 0, window=window,
                       rope_scaling=scaling, nemo_class=target.rsplit(".", 1)[-1], extra=extra, moe_layers=moe_layers)


def _layer_types(freq: Any, layers: int, where: str) -> list[str]:
    """HF's layer_types from megatron-core's window_attn_skip_freq (utils.is_layer_window_attention): an int N makes
    every Nth layer (1-based) full attention; a list marks sliding-window layers with 1."""
    if freq is None:
        sliding = [True] * layers
    elif type(freq) is int and freq > 0:
        sliding = [(i + 1) % freq != 0 for i in range(layers)]
    elif isinstance(freq, list) and len(freq) == layers and all(f in (0, 1) for f in freq):
        sliding = [bool(f) for f in freq]
    else:
        raise FormatError(f"{where}: window_attn_skip_freq {short(freq)} is neither a positive integer nor a list of "
                          f"{layers} 0/1 flags; the model config is damaged")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _window(value: Any, where: str) -> int:
    """Megatron's window_size is (left, right) with right 0 for causal attention: a query sees itself and `left`
    keys before it (utils.get_sliding_window_causal_mask, as Transformer Engine), so left + 1 keys, where HF's
    sliding_window counts every key seen (masking_utils.sliding_window_overlay). A bare int (Megatron-Bridge's
    Gemma 3 provider) already counts the keys."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[1] == 0 and type(value[0]) is int \
            and value[0] >= 0:
        return value[0] + 1
    if type(value) is int and value > 0:
        return value
    raise OptionError(f"{where}: window_size {value!r} is not a causal sliding window (left, 0); no Hugging Face "
                      "family in the table expresses it", option="to_hf")


def hf_config(architecture: str, model_type: str, mc: ModelConfig, vocab: int, dtype: str,
              extra: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the family's HF class: the fields every family shares, then the family's own."""
    s = mc.shape
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": s.hidden, "intermediate_size": s.moe_ffn if s.experts else s.ffn,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.groups,
        "head_dim": s.head_dim, "vocab_size": vocab, "hidden_act": "silu", "max_position_embeddings": mc.max_positions,
        "rms_norm_eps": mc.eps, "rope_theta": mc.rope_theta, "tie_word_embeddings": mc.tied,
        "torch_dtype": dtype, "initializer_range": mc.init_std,
    }
    if mc.rope_scaling is not None:
        config["rope_scaling"] = dict(mc.rope_scaling)
    config.update(extra)
    return config


def megatron_args(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """A HF config.json in Megatron-LM argument names (what `args` in common.pt holds for the same model)."""
    def need(name: str) -> Any:
        if hf.get(name) is None:
            raise FormatError(f"{where}: no {name}; cannot build the Megatron config")
        return hf[name]

    hf = check_numbers(hf, where, HF_SIZES, HF_NUMBERS)
    rope = check_numbers(hf["rope_parameters"] if isinstance(hf.get("rope_parameters"), dict) else {}, where, (),
                         ("rope_theta",))
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0)
    args: dict[str, Any] = {
        "num_layers": int(need("num_hidden_layers")), "hidden_size": hidden,
        "ffn_hidden_size": int(need("intermediate_size")), "num_attention_heads": heads,
        "group_query_attention": True, "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": int(hf.get("head_dim") or hidden // heads), "normalization": "RMSNorm",
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)), "swiglu": True, "add_bias_linear": False,
        "add_qkv_bias": hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias")),
        "qk_layernorm": hf.get("model_type") in ("qwen3", "qwen3_moe"),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "position_embedding_type": "rope", "rotary_percent": 1.0,
        "rotary_base": int(rope.get("rope_theta") or hf.get("rope_theta") or 10000),
        "max_position_embeddings": int(hf.get("max_position_embeddings") or 4096),
        "padded_vocab_size": int(need("vocab_size")), "init_method_std": float(hf.get("initializer_range", 0.02)),
    }
    if experts:
        args.update(num_experts=experts, moe_router_topk=int(need("num_experts_per_tok")),
                    moe_ffn_hidden_size=int(hf.get("moe_intermediate_size") or need("intermediate_size")),
                    # Mixtral renormalizes the top k router weights; Qwen-MoE only with norm_topk_prob
                    moe_router_pre_softmax=hf.get("model_type") != "mixtral" and not hf.get("norm_topk_prob"))
    window = hf.get("sliding_window")
    if window and (hf.get("model_type") != "qwen2" or hf.get("use_sliding_window")):
        args["window_size"] = (int(window) - 1, 0)  # HF counts the query itself (`_window`)
    if hf.get("model_type") in GEMMA:
        args.update(_gemma_args(hf, where, args))
    if hf.get("model_type") == "deepseek_v3":
        args.update(_deepseek_args(hf, where, args))
    return args


#: transformers' DeepSeek-V3 normalises its q and kv latents with this epsilon, whatever rms_norm_eps says;
#: megatron-core uses one epsilon for every norm, so only a model whose rms_norm_eps is this one maps exactly (as the
#: released ones do)
DEEPSEEK_LATENT_EPS = 1e-6


def deepseek_group_mismatch(top_k: int, groups: Any, group_topk: Any) -> str | None:
    """Why group-limited routing would pick other experts on each side, or None: transformers ranks expert groups by
    the sum of their top 2 scores, megatron-core's group_limited_topk by the sum of their top (top k // groups
    chosen)."""
    if not groups or int(groups) <= 1 or not group_topk or top_k // int(group_topk) == 2:
        return None
    return (f"{groups} expert groups with {group_topk} chosen for top {top_k}: megatron-core ranks groups by their "
            f"top {top_k // int(group_topk)} scores, transformers by their top 2")


def _deepseek_args(hf: dict[str, Any], where: str, args: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 in Megatron-LM's MLA and MoE arguments (Megatron-Bridge deepseek/common.py): first-k dense
    layers as a moe_layer_freq list, sigmoid routing with the expert bias, group top-k and scaling factor."""
    def fail(what: str) -> OptionError:
        return OptionError(f"{where}: {what}; Megatron-core's DeepSeek layers do not express it", option="family")

    if hf.get("rope_interleave") is False:
        raise fail("rope_interleave is false (megatron-core's MLA de-interleaves the rope half)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind not in ("default", "yarn"):
        raise fail(f"rope type {short(kind)} (default or yarn only)")
    yarn: dict[str, Any] = {}
    if kind == "yarn":
        numbers = check_numbers(rope, where, ("original_max_position_embeddings",),
                                ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"))
        yarn = {"rope_type": "yarn", **{name: numbers[field] for name, field in YARN.items()
                                        if numbers.get(field) is not None}}
    top_k = int(hf.get("num_experts_per_tok") or 1)
    if not hf.get("norm_topk_prob", True) and top_k > 1:
        raise fail("norm_topk_prob is false (megatron-core's sigmoid router renormalizes the top k)")
    if (why := deepseek_group_mismatch(top_k, hf.get("n_group"), hf.get("topk_group"))) is not None:
        raise fail(why)
    if float(hf.get("rms_norm_eps", DEEPSEEK_LATENT_EPS)) != DEEPSEEK_LATENT_EPS:
        raise fail(f"rms_norm_eps is {float(hf['rms_norm_eps']):g}, but transformers normalises the q and kv latents "
                   f"with {DEEPSEEK_LATENT_EPS:g} whatever the config says, and megatron-core's MLA uses one epsilon "
                   "for every norm")
    layers, first = args["num_layers"], int(hf.get("first_k_dense_replace") or 0)
    moe_ffn = int(hf.get("moe_intermediate_size") or args["ffn_hidden_size"])
    out: dict[str, Any] = {
        "multi_latent_attention": True, "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": int(hf.get("kv_lora_rank") or 512), "qk_head_dim": int(hf.get("qk_nope_head_dim") or 128),
        "qk_pos_emb_head_dim": int(hf.get("qk_rope_head_dim") or 64), "v_head_dim": int(hf.get("v_head_dim") or 128),
        "rope_type": "rope", "num_query_groups": args["num_attention_heads"], **yarn,
        "moe_shared_expert_intermediate_size": int(hf.get("n_shared_experts") or 0) * moe_ffn or None,
        "moe_layer_freq": [0] * first + [1] * (layers - first), "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_router_num_groups": hf.get("n_group"),
        "moe_router_group_topk": hf.get("topk_group"),
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "moe_router_pre_softmax": False}
    return {k: v for k, v in out.items() if v is not None}


GEMMA = ("gemma2", "gemma3_text")


def _gemma_args(hf: dict[str, Any], where: str, args: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 (text) beyond the common decoder: zero-centered norms (HF's RMSNorm scales by 1 + w, as
    megatron-core's with apply_layernorm_1p: the weights copy as they are), tanh GeGLU, soft-capping, the
    attention scale, the sliding-window pattern and (Gemma 3) the local rope base and QK-norm."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    out: dict[str, Any] = {"apply_layernorm_1p": True,
                           "activation_func": "fast_gelu" if act == "gelu_pytorch_tanh" else act,
                           "qk_layernorm": hf["model_type"] == "gemma3_text",
                           "query_pre_attn_scalar": int(hf.get("query_pre_attn_scalar") or args["kv_channels"])}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(name) is not None:
            out[name] = float(hf[name])
    types = hf.get("layer_types")
    if "window_size" in args and isinstance(types, list) and "full_attention" in types:
        out["window_attn_skip_freq"] = [int(t == "sliding_attention") for t in types]
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        for kind, params in rope.items():
            if not isinstance(params, dict) or params.get("rope_type", "default") != "default":
                raise OptionError(f"{where}: rope_parameters.{kind} is {short(params)}; only default rope (no "
                                  "scaling) maps to Megatron here", option="family")
        full: dict[str, Any] = rope["full_attention"]
        local: dict[str, Any] = rope.get("sliding_attention") or full
        checked = check_numbers({"full": full.get("rope_theta"), "local": local.get("rope_theta")}, where, (),
                                ("full", "local"))
        out["rotary_base"] = int(checked["full"] or 10000)
        out["rope_local_base_freq"] = int(checked["local"] or 10000)
    return out
