"""A reference forward, in plain torch, that computes logits from a Megatron-core checkpoint's own tensors.

For the families megatron-core 0.16 cannot build on CPU (no Transformer Engine): Gemma 2 / Gemma 3 (post-norms,
soft-capping, per-layer rope bases live in Megatron-Bridge's TE modules) and DeepSeek-V3 (MLA needs TE's
attention). It reads what `ckptctl import` wrote with our own reader (`read_megatron`: the tensors under
megatron-core's names and the Megatron-LM `args` of common.pt), never the HF tensors, and follows megatron-core's
semantics (the code named beside each step), so `tests/test_megatron_reference.py` can hold it against the
transformers forward of the model the import came from.

Shapes: x is [tokens, hidden] (one sequence, no batch); attention works on [heads, tokens, head_dim].
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from converters.formats import load_index
from converters.rangeread import RangeReader
from converters.tensorio import read_box

Args = dict[str, Any]
Tensors = dict[str, Tensor]


def read_megatron(folder: str) -> tuple[Tensors, Args]:
    """Every tensor of a Megatron torch_dist folder (whole, as torch tensors) and the Megatron-LM args."""
    reader = RangeReader()
    try:
        index = load_index(folder, None, reader=reader)
        tensors = {}
        for name, entry in index.tensors.items():
            buf = bytearray(math.prod(entry.shape) * torch.empty((), dtype=getattr(torch, entry.dtype)).itemsize)
            read_box(reader, entry, ((0,) * len(entry.shape), entry.shape), memoryview(buf))
            tensors[name] = torch.frombuffer(buf, dtype=getattr(torch, entry.dtype)).reshape(entry.shape)
    finally:
        reader.close()
    args = {name[len("args."):]: o.value for name, o in index.objects.items() if name.startswith("args.")}
    return tensors, args


def layer(t: Tensors, i: int, name: str) -> Tensor:
    """Layer i's tensor: keyed per layer (`decoder.layers.{i}.`) or layer-stacked (`decoder.layers.`, axis 0)."""
    return t[f"decoder.layers.{i}.{name}"] if f"decoder.layers.{i}.{name}" in t else t[f"decoder.layers.{name}"][i]


# ------------------------------------------------------------------------------------------------ building blocks

def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    """RMSNorm; layernorm_zero_centered_gamma (Megatron-LM's apply_layernorm_1p) scales by (1 + w)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * (1 + weight if zero_centered else weight)


def gated_mlp(x: Tensor, fc1: Tensor, fc2: Tensor, act: Any) -> Tensor:
    """megatron-core's MLP with gated_linear_unit: linear_fc1 = [gate; up], act(gate) * up, then linear_fc2."""
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    return (act(gate) * up) @ fc2.T


def rope_freqs(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """RotaryEmbedding.forward: the angles [tokens, dim] = cat(freqs, freqs) (rotary_interleaved off)."""
    freqs = torch.outer(positions.float(), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)


def inv_freq(base: float, dim: int) -> Tensor:
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def apply_rope(x: Tensor, angles: Tensor, mscale: float = 1.0) -> Tensor:
    """rope_utils._apply_rotary_pos_emb_bshd: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * (angles.cos() * mscale) + torch.cat([-x2, x1], dim=-1) * (angles.sin() * mscale)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
              softcap: float | None = None) -> Tensor:
    """Causal softmax attention on [heads, tokens, dim] -> [tokens, heads * v_dim]. `window` is megatron-core's
    left window (utils.get_sliding_window_causal_mask with window_size (left, 0)): query i sees keys j with
    i - left <= j <= i, i.e. left + 1 keys. `softcap`: scores -> cap * tanh(scores / cap) before the mask."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    hidden = j > i
    if window is not None:
        hidden |= j < i - window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1).reshape(n, -1)


def is_window_layer(args: Args, i: int) -> bool:
    """utils.is_layer_window_attention (layer_number is 1-based there)."""
    if not args.get("window_size"):
        return False
    freq = args.get("window_attn_skip_freq")
    if freq is None:
        return True
    if isinstance(freq, int):
        return (i + 1) % freq != 0
    return bool(freq[i])


# ------------------------------------------------------------------------------------------------ Gemma 2 / Gemma 3

def gemma_logits(t: Tensors, args: Args, ids: Tensor) -> Tensor:
    """Gemma 2 / 3 text (Megatron-Bridge gemma2_provider / gemma3_provider): embedding x sqrt(hidden), zero-centred
    RMSNorm everywhere, fused QKV per query group, post-attention and post-MLP norms (TERowParallelLinearLayerNorm:
    the norm after linear_proj / linear_fc2), tanh GeGLU (fast_gelu), scale query_pre_attn_scalar^-1/2, attention
    and final logit soft-capping when set, a sliding window on the window layers (Gemma 3: their own rope base),
    Gemma 3's q/k norms. Tied output layer unless untie_embeddings_and_output_weights."""
    eps, hidden = args["norm_epsilon"], args["hidden_size"]
    heads, groups, d = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"]
    per_group = heads // groups
    scale = args["query_pre_attn_scalar"] ** -0.5
    positions = torch.arange(len(ids))

    def norm(x: Tensor, w: Tensor) -> Tensor:
        return rms_norm(x, w, eps, zero_centered=True)

    embedding = t["embedding.word_embeddings.weight"]
    x = embedding[ids] * hidden ** 0.5
    for i in range(args["num_layers"]):
        def w(name: str, i: int = i) -> Tensor:
            return layer(t, i, name)

        window = is_window_layer(args, i)
        base = args.get("rope_local_base_freq", args["rotary_base"]) if window else args["rotary_base"]
        angles = rope_freqs(positions, inv_freq(base, d))

        h = norm(x, w("self_attention.linear_qkv.layer_norm_weight"))
        qkv = (h @ w("self_attention.linear_qkv.weight").T).view(-1, groups, per_group + 2, d)
        q = qkv[:, :, :per_group].reshape(-1, heads, d)  # rows per group g: [q heads of g, k_g, v_g]
        k, v = qkv[:, :, per_group], qkv[:, :, per_group + 1]
        if args.get("qk_layernorm"):
            q = norm(q, w("self_attention.q_layernorm.weight"))
            k = norm(k, w("self_attention.k_layernorm.weight"))
        q, k = apply_rope(q.transpose(0, 1), angles), apply_rope(k.transpose(0, 1), angles)
        k, v = k.repeat_interleave(per_group, 0), v.transpose(0, 1).repeat_interleave(per_group, 0)
        a = attention(q, k, v, scale, args["window_size"][0] if window else None,
                      args.get("attn_logit_softcapping"))
        a = a @ w("self_attention.linear_proj.weight").T
        x = x + norm(a, w("self_attention.linear_proj.post_layernorm.weight"))

        h = norm(x, w("mlp.linear_fc1.layer_norm_weight"))
        m = gated_mlp(h, w("mlp.linear_fc1.weight"), w("mlp.linear_fc2.weight"),
                      lambda g: F.gelu(g, approximate="tanh"))
        x = x + norm(m, w("mlp.linear_fc2.post_layernorm.weight"))

    x = norm(x, t["decoder.final_layernorm.weight"])
    out = t["output_layer.weight"] if args.get("untie_embeddings_and_output_weights") else embedding
    logits = x @ out.T
    cap = args.get("final_logit_softcapping")
    return cap * torch.tanh(logits / cap) if cap else logits


# ---------------------------------------------------------------------------------------------------- DeepSeek-V3

def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """yarn_rotary_pos_embedding._yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope(args: Args, positions: Tensor) -> tuple[Tensor, float]:
    """The angles of the decoupled rope dims and their mscale: plain rope, or YarnRotaryEmbedding.get_emb."""
    dim, base = args["qk_pos_emb_head_dim"], float(args["rotary_base"])
    if args.get("rope_type") != "yarn":
        return rope_freqs(positions, inv_freq(base, dim)), 1.0
    factor, original = args["rotary_scaling_factor"], args["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(args["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    extrapolated = inv_freq(base, dim)
    freqs = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return rope_freqs(positions, freqs), yarn_mscale(factor, args["mscale"]) / yarn_mscale(factor,
                                                                                          args["mscale_all_dim"])


def mla(x: Tensor, t: Tensors, args: Args, i: int, angles: Tensor, mscale: float) -> Tensor:
    """MLASelfAttention (multi_latent_attention.py): low-rank q (linear_q_down_proj, its norm = linear_q_up_proj's
    layer_norm_weight, linear_q_up_proj) or linear_q_proj; linear_kv_down_proj -> [kv latent, k rope dims shared
    by all heads]; the latent normed (linear_kv_up_proj's layer_norm_weight) and up-projected per head to
    [k nope dims, v]; rope on the rope dims only, de-interleaved first (rope_utils: multi_latent_attention);
    softmax scale yarn_mscale(factor, mscale_all_dim)^2 / sqrt(q head dim)."""
    eps, heads = args["norm_epsilon"], args["num_attention_heads"]
    nope, rope, v_dim, rank = args["qk_head_dim"], args["qk_pos_emb_head_dim"], args["v_head_dim"], args["kv_lora_rank"]

    def w(name: str) -> Tensor:
        return layer(t, i, f"self_attention.{name}")

    if args.get("q_lora_rank"):
        q = rms_norm(x @ w("linear_q_down_proj.weight").T, w("linear_q_up_proj.layer_norm_weight"), eps)
        q = q @ w("linear_q_up_proj.weight").T
    else:
        q = x @ w("linear_q_proj.weight").T
    q_nope, q_rope = q.view(-1, heads, nope + rope).transpose(0, 1).split([nope, rope], -1)
    latent, k_rope = (x @ w("linear_kv_down_proj.weight").T).split([rank, rope], -1)
    kv = rms_norm(latent, w("linear_kv_up_proj.layer_norm_weight"), eps) @ w("linear_kv_up_proj.weight").T
    k_nope, v = kv.view(-1, heads, nope + v_dim).transpose(0, 1).split([nope, v_dim], -1)

    def rotate(part: Tensor) -> Tensor:
        return apply_rope(torch.cat([part[..., 0::2], part[..., 1::2]], -1), angles, mscale)

    q = torch.cat([q_nope, rotate(q_rope)], -1)
    k = torch.cat([k_nope, rotate(k_rope).expand(heads, -1, -1)], -1)
    factor = args.get("rotary_scaling_factor", 1.0) if args.get("rope_type") == "yarn" else 1.0
    scale = yarn_mscale(factor, args.get("mscale_all_dim", 0.0)) ** 2 / math.sqrt(nope + rope)
    return attention(q, k, v, scale) @ w("linear_proj.weight").T


def route(x: Tensor, t: Tensors, args: Args, i: int) -> Tensor:
    """TopKRouter with moe_router_score_function sigmoid (moe_utils.topk_routing_with_score_function): the expert
    bias picks the experts (group_limited_topk: groups ranked by the sum of their top topk/group_topk scores),
    the unbiased scores weight them, renormalized (top k > 1) and scaled. Returns [tokens, experts] weights."""
    experts, top_k = args["num_experts"], args["moe_router_topk"]
    groups, group_top = args.get("moe_router_num_groups") or 1, args.get("moe_router_group_topk") or 1
    scores = torch.sigmoid(x @ layer(t, i, "mlp.router.weight").T)
    choice = scores + layer(t, i, "mlp.router.expert_bias")
    by_group = choice.view(len(x), groups, -1).topk(top_k // group_top, dim=-1).values.sum(-1)
    kept = torch.zeros_like(by_group).scatter(1, by_group.topk(group_top, dim=-1).indices, 1.0)
    kept = kept.repeat_interleave(experts // groups, dim=1)
    top = choice.masked_fill(kept == 0, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, top)
    if top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * (args.get("moe_router_topk_scaling_factor") or 1.0)
    return torch.zeros_like(scores).scatter(1, top, weights)


def moe(x: Tensor, t: Tensors, args: Args, i: int) -> Tensor:
    """MoELayer: the routed experts (SwiGLU, experts on the leading axis as torch_dist saves them) weighted by
    the router, plus the shared experts on every token."""
    weights = route(x, t, args, i)
    fc1 = layer(t, i, "mlp.experts.experts.linear_fc1.weight")
    fc2 = layer(t, i, "mlp.experts.experts.linear_fc2.weight")
    out = gated_mlp(x, layer(t, i, "mlp.shared_experts.linear_fc1.weight"),
                    layer(t, i, "mlp.shared_experts.linear_fc2.weight"), F.silu)
    for e in range(args["num_experts"]):
        out = out + weights[:, e:e + 1] * gated_mlp(x, fc1[e], fc2[e], F.silu)
    return out


def is_moe_layer(args: Args, i: int) -> bool:
    """moe_layer_freq: a list (1 = MoE) or every Nth layer."""
    freq = args.get("moe_layer_freq", 1)
    return bool(freq[i]) if isinstance(freq, list) else i % freq == 0


def deepseek_logits(t: Tensors, args: Args, ids: Tensor) -> Tensor:
    """DeepSeek-V3 (Megatron-Bridge deepseek/common.py): MLA, then a dense SwiGLU MLP on the first-k layers (its
    norm fused into linear_fc1) or the MoE block (pre_mlp_layernorm) on the others; untied output layer."""
    eps = args["norm_epsilon"]
    angles, mscale = mla_rope(args, torch.arange(len(ids)))
    x = t["embedding.word_embeddings.weight"][ids]
    for i in range(args["num_layers"]):
        x = x + mla(rms_norm(x, layer(t, i, "input_layernorm.weight"), eps), t, args, i, angles, mscale)
        if is_moe_layer(args, i):
            x = x + moe(rms_norm(x, layer(t, i, "pre_mlp_layernorm.weight"), eps), t, args, i)
        else:
            h = rms_norm(x, layer(t, i, "mlp.linear_fc1.layer_norm_weight"), eps)
            x = x + gated_mlp(h, layer(t, i, "mlp.linear_fc1.weight"), layer(t, i, "mlp.linear_fc2.weight"), F.silu)
    x = rms_norm(x, t["decoder.final_layernorm.weight"], eps)
    out = t["output_layer.weight"] if args.get("untie_embeddings_and_output_weights") else \
        t["embedding.word_embeddings.weight"]
    return x @ out.T


def logits(folder: str, ids: Tensor) -> Tensor:
    """The reference logits [tokens, vocab] of the Megatron checkpoint at `folder` on one sequence of token ids."""
    t, args = read_megatron(folder)
    if args.get("multi_latent_attention"):
        return deepseek_logits(t, args, ids)
    if args.get("apply_layernorm_1p") and args.get("query_pre_attn_scalar"):
        return gemma_logits(t, args, ids)
    raise ValueError(f"{folder}: the reference forward covers Gemma 2/3 and DeepSeek-V3 only")
