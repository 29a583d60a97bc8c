"""The declarative mapping table: per family, Megatron-core names -> Hugging Face names + a transform.

Layer rules are relative to `decoder.layers.{i}.` (Megatron) and `model.layers.{i}.` (HF). A rule's Megatron
names are alternatives (the first present is used: Transformer Engine fuses the norms into the linear layers,
the local spec keeps them apart). An expert rule (`per_expert`) has `{e}` in its HF names; its Megatron names
either hold every expert on a leading axis (torch_dist's layout of grouped and sequential experts) or, with
`{e}` in them, one expert each. `when` names the feature a rule needs (config.FEATURES, "untied", "no_q_lora",
or per layer "dense_layer" / "moe_layer").
A family with `per_layer_keys` is saved by megatron-core under `decoder.layers.{i}.` keys, not layer-stacked
(its layers differ: transformer_block.py's non_homogeneous_layers, set by a moe_layer_freq list).
Adding a family is one `Family(...)` entry here and a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import DEEPSEEK_LATENT_EPS, ModelConfig
from .transforms import Transform, expert_gate_up, gate_up, halves, identity, qkv


@dataclass(frozen=True)
class Rule:
    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    transform: Transform = identity
    when: str = ""
    per_expert: bool = False


def rule(megatron: str | tuple[str, ...], hf: str | tuple[str, ...], transform: Transform = identity,
         when: str = "", per_expert: bool = False) -> Rule:
    return Rule(megatron if isinstance(megatron, tuple) else (megatron,), hf if isinstance(hf, tuple) else (hf,),
                transform, when, per_expert)


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    model_type: str
    features: frozenset[str]  # what the model must have, of config.FEATURES
    layer: tuple[Rule, ...]
    optional: frozenset[str] = frozenset()  # what it may have
    nemo_classes: tuple[str, ...] = ()  # NeMo config classes of this family (`--to-hf auto`)
    extra: Any = None  # ModelConfig -> the family's own config.json fields
    notes: tuple[str, ...] = field(default=())
    per_layer_keys: bool = False
    norm_eps: float | None = None  # an epsilon the HF class uses for some norms whatever its config says


    def config_fields(self, mc: ModelConfig) -> dict[str, Any]:
        return dict(self.extra(mc)) if self.extra is not None else {}


TOP = (
    rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    rule("decoder.final_layernorm.weight", "model.norm.weight"),
    rule("output_layer.weight", "lm_head.weight", when="untied"),
)

ATTENTION = (
    rule("self_attention.linear_qkv.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), qkv),
    rule("self_attention.linear_qkv.bias",
         ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), qkv, when="qkv_bias"),
    rule("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    rule(("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"), "input_layernorm.weight"),
    rule("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when="qk_norm"),
    rule("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when="qk_norm"),
)

DENSE_MLP = (
    rule(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), "post_attention_layernorm.weight"),
    rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), gate_up),
    rule("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)

_EXPERTS = ("mlp.experts.experts.{}", "mlp.experts.{}", "mlp.experts.experts.{{e}}.{}",
            "mlp.experts.local_experts.{{e}}.{}")


def _experts(name: str) -> tuple[str, ...]:
    return tuple(form.format(name) for form in _EXPERTS)


def moe_mlp(prefix: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """A MoE block: router + experts (fc1 = [gate; up], fc2 = down) under the HF block `prefix`."""
    return (
        rule(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), "post_attention_layernorm.weight"),
        rule("mlp.router.weight", f"{prefix}.gate.weight"),
        rule(_experts("linear_fc1.weight"), (f"{prefix}.experts.{{e}}.{gate}.weight",
                                             f"{prefix}.experts.{{e}}.{up}.weight"), expert_gate_up, per_expert=True),
        rule(_experts("linear_fc2.weight"), f"{prefix}.experts.{{e}}.{down}.weight", per_expert=True),
    )


# Gemma 2 / 3 (Megatron-Bridge gemma2_bridge.py): four norms a layer, the attention and MLP outputs normed too;
# megatron-core keeps the weights zero-centered (apply_layernorm_1p) as HF's Gemma RMSNorm does (1 + w): identity
GEMMA_NORMS = (
    rule("self_attention.linear_proj.post_layernorm.weight", "post_attention_layernorm.weight"),
    rule(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), "pre_feedforward_layernorm.weight"),
    rule("mlp.linear_fc2.post_layernorm.weight", "post_feedforward_layernorm.weight"),
    rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), gate_up),
    rule("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)


def _gemma(mc: ModelConfig) -> dict[str, Any]:
    """Gemma 2's fields: the embedding scale (sqrt hidden) is in the HF class, as in Megatron-Bridge's embedding."""
    layers = mc.shape.layers
    return {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "query_pre_attn_scalar": mc.extra["query_pre_attn_scalar"],
            "attn_logit_softcapping": mc.extra.get("attn_logit_softcapping"),
            "final_logit_softcapping": mc.extra.get("final_logit_softcapping"),
            "sliding_window": mc.window,
            "layer_types": mc.extra.get("layer_types", ["full_attention"] * layers)}


def _gemma3(mc: ModelConfig) -> dict[str, Any]:
    local = float(mc.extra.get("rope_local_base_freq", 10000.0))
    return {**_gemma(mc), "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": mc.rope_theta},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": local}},
            "use_bidirectional_attention": False}


# DeepSeek-V3 (Megatron-Bridge deepseek/common.py): multi-latent attention under megatron-core's MLA names (the
# rows keep HF's order: q_up per head [nope, rope], kv_down [kv_lora_rank, rope], kv_up per head [k nope, v];
# megatron-core de-interleaves the rope half as HF's rope_interleave does); TE names first, local spec's after
MLA = (
    rule("input_layernorm.weight", "input_layernorm.weight"),
    rule("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", when="q_lora"),
    rule(("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
         "self_attn.q_a_layernorm.weight", when="q_lora"),
    rule("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", when="q_lora"),
    rule("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", when="no_q_lora"),
    rule("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    rule(("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
         "self_attn.kv_a_layernorm.weight"),
    rule("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    rule("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
)

DEEPSEEK_MLP = (
    rule(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), "post_attention_layernorm.weight",
         when="dense_layer"),
    rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), gate_up, when="dense_layer"),
    rule("mlp.linear_fc2.weight", "mlp.down_proj.weight", when="dense_layer"),
    rule("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", when="moe_layer"),
    rule("mlp.router.weight", "mlp.gate.weight", when="moe_layer"),
    rule("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", when="moe_layer"),
    *(Rule(r.megatron, r.hf, r.transform, "moe_layer", True) for r in moe_mlp("mlp", "gate_proj", "up_proj",
                                                                            "down_proj")[2:]),
    rule("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"), halves, when="moe_layer"),
    rule("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", when="moe_layer"),
)


def _deepseek_v3(mc: ModelConfig) -> dict[str, Any]:
    x, s = mc.extra, mc.shape
    rope = int(x.get("qk_pos_emb_head_dim", 64))
    nope = int(x.get("qk_head_dim", 128))
    first = mc.moe_layers.index(True) if True in mc.moe_layers else 0
    return {"intermediate_size": s.ffn, "moe_intermediate_size": s.moe_ffn, "n_routed_experts": s.experts,
            "n_shared_experts": int(x["moe_shared_expert_intermediate_size"]) // s.moe_ffn,
            "num_experts_per_tok": mc.top_k, "n_group": int(x.get("moe_router_num_groups") or 1),
            "topk_group": int(x.get("moe_router_group_topk") or 1),
            "routed_scaling_factor": float(x.get("moe_router_topk_scaling_factor") or 1.0),
            "first_k_dense_replace": first, "norm_topk_prob": True, "q_lora_rank": x.get("q_lora_rank"),
            "kv_lora_rank": int(x["kv_lora_rank"]), "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "qk_head_dim": nope + rope, "head_dim": rope, "v_head_dim": int(x.get("v_head_dim", 128)),
            "num_key_value_heads": s.heads, "rope_interleave": True, "attention_bias": False,
            "num_nextn_predict_layers": 0, "output_router_logits": False, **_yarn(mc)}


def _yarn(mc: ModelConfig) -> dict[str, Any]:
    """megatron-core's YaRN settings (MLATransformerConfig) as HF rope_parameters; nothing for plain rope."""
    if "yarn" not in mc.extra:
        return {}
    return {"rope_parameters": {"rope_type": "yarn", "rope_theta": mc.rope_theta, **mc.extra["yarn"]}}


def _llama(mc: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


def _qwen2(mc: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": mc.window is not None, "sliding_window": mc.window,
            "max_window_layers": mc.shape.layers}


def _qwen3(mc: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}


def _mistral(mc: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": mc.window}


def _mixtral(mc: ModelConfig) -> dict[str, Any]:
    return {"num_local_experts": mc.shape.experts, "num_experts_per_tok": mc.top_k, "sliding_window": mc.window,
            "output_router_logits": False}


def _qwen3_moe(mc: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "intermediate_size": mc.shape.ffn, "moe_intermediate_size": mc.shape.moe_ffn,
            "num_local_experts": mc.shape.experts, "num_experts_per_tok": mc.top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": "pre_softmax" not in mc.features, "output_router_logits": False}


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", frozenset(), ATTENTION + DENSE_MLP,
           nemo_classes=("LlamaConfig", "Llama2Config", "Llama3Config", "Llama31Config", "Llama32Config"),
           extra=_llama),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", frozenset({"qkv_bias"}), ATTENTION + DENSE_MLP,
           optional=frozenset({"window"}), nemo_classes=("Qwen2Config", "Qwen25Config"), extra=_qwen2),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", frozenset({"qk_norm"}), ATTENTION + DENSE_MLP,
           nemo_classes=("Qwen3Config",), extra=_qwen3),
    Family("mistral", "MistralForCausalLM", "mistral", frozenset(), ATTENTION + DENSE_MLP,
           optional=frozenset({"window"}), nemo_classes=("MistralConfig", "MistralConfig7B", "MistralNeMoConfig"),
           extra=_mistral),
    Family("mixtral", "MixtralForCausalLM", "mixtral", frozenset({"moe"}),
           ATTENTION + moe_mlp("block_sparse_moe", "w1", "w3", "w2"), optional=frozenset({"window"}),
           nemo_classes=("MixtralConfig",), extra=_mixtral),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", frozenset({"qk_norm", "moe"}),
           ATTENTION + moe_mlp("mlp", "gate_proj", "up_proj", "down_proj"), optional=frozenset({"pre_softmax"}),
           nemo_classes=("Qwen3MoEConfig", "Qwen3MoeConfig"), extra=_qwen3_moe),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", frozenset({"zero_gamma", "gelu"}), ATTENTION + GEMMA_NORMS,
           optional=frozenset({"window", "window_pattern", "softcap"}),
           nemo_classes=("Gemma2Config", "Gemma2Config2B", "Gemma2Config9B", "Gemma2Config27B"), extra=_gemma),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", frozenset({"zero_gamma", "gelu", "qk_norm"}),
           ATTENTION + GEMMA_NORMS, optional=frozenset({"window", "window_pattern"}),
           nemo_classes=("Gemma3Config1B", "Gemma3Config"), extra=_gemma3),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3",
           frozenset({"mla", "moe", "sigmoid", "expert_bias", "shared"}), MLA + DEEPSEEK_MLP,
           optional=frozenset({"q_lora", "dense_layers"}), nemo_classes=("DeepSeekV3Config",), extra=_deepseek_v3,
           per_layer_keys=True, norm_eps=DEEPSEEK_LATENT_EPS),
)}
