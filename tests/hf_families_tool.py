"""Make real Megatron-core checkpoints of Hugging Face models for tests/test_hf_families.py.

`python tests/hf_families_tool.py ROOT PORT FAMILY...`: for each family, reads the tiny HF model saved at
ROOT/hf/FAMILY (config.json + model.safetensors), builds megatron-core's own GPTModel (local spec) from the
HF config, copies the HF weights in through the inverse mapping written here from megatron-core's documented
layout (fused QKV rows per query group = [q heads of g, k_g, v_g]; linear_fc1 = cat([gate, up]); router +
experts), saves it with `dist_checkpointing.save` as Megatron-LM lays it out (ROOT/megatron/FAMILY/
latest_checkpointed_iteration.txt, iter_0000001/ with `args` in common.pt), and writes Megatron's own
forward logits on the test tokens to ROOT/megatron/FAMILY/logits.pt.
`load CKPT OUT TP EP PP PORT`: megatron-core's dist_checkpointing.load of an import at TP/EP/PP, its logits.
`fsdp2 ROOT PORT FAMILY...`: dcp.load of `import --to dcp` outputs into FSDP2-wrapped transformers models at 2
gloo ranks, their logits and full state.
`extra-states CONFIG_JSON OUT PORT`: megatron-core's `_extra_state` keys for a DeepSeek-V3 config's layers.

One process, gloo, world size 1, CPU; Megatron's CUDA calls are stubbed as in tests/megatron_tool.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

IDS = [[3, 17, 90, 42, 5, 77, 0, 64, 8, 33, 71, 12]]


def _stub_cuda() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _args(hf: dict) -> dict:
    """The Megatron-LM arguments of the HF model (what common.pt's `args` holds)."""
    heads = hf["num_attention_heads"]
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    args = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads, group_query_attention=True,
                num_query_groups=hf["num_key_value_heads"],
                kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, normalization="RMSNorm",
                norm_epsilon=hf["rms_norm_eps"], swiglu=True, add_bias_linear=False,
                add_qkv_bias=hf["model_type"] == "qwen2", qk_layernorm=hf["model_type"] in ("qwen3", "qwen3_moe"),
                untie_embeddings_and_output_weights=not hf["tie_word_embeddings"], position_embedding_type="rope",
                rotary_base=int(hf["rope_parameters"]["rope_theta"]), rotary_percent=1.0,
                max_position_embeddings=hf["max_position_embeddings"], seq_length=64,
                padded_vocab_size=hf["vocab_size"], params_dtype=torch.float32, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1)
    if experts:
        args.update(num_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                    # softmax over all experts, then the top k without renormalizing (Qwen-MoE's norm_topk_prob off)
                    moe_router_pre_softmax=hf["model_type"] != "mixtral" and not hf.get("norm_topk_prob"))
    return args


def _model(args: dict, tp: int = 1, ep: int = 1, pp: int = 1, stage: int = 0) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = args.get("num_experts")
    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"], use_cpu_initialization=True, normalization="RMSNorm",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=args["add_qkv_bias"], qk_layernorm=args["qk_layernorm"], layernorm_epsilon=args["norm_epsilon"],
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, num_moe_experts=experts,
        moe_router_topk=args.get("moe_router_topk", 2), moe_ffn_hidden_size=args.get("moe_ffn_hidden_size"),
        moe_router_pre_softmax=args.get("moe_router_pre_softmax", False), moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather")
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=args["qk_layernorm"],
                                    normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args["padded_vocab_size"],
                    max_sequence_length=args["max_position_embeddings"], position_embedding_type="rope",
                    rotary_base=args["rotary_base"],
                    share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
                    pre_process=stage == 0, post_process=stage == pp - 1)


def _inverse(hf: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """HF tensors -> megatron-core GPTModel (local spec) parameter names and layouts."""
    heads, groups, d = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"]
    per = heads // groups
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if args["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(args["num_layers"]):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."

        def fused(kind: str, a: str = a) -> torch.Tensor:
            q, k, v = (hf[f"{a}self_attn.{p}_proj.{kind}"] for p in "qkv")
            q = q.reshape(groups, per * d, *q.shape[1:])
            k = k.reshape(groups, d, *k.shape[1:])
            v = v.reshape(groups, d, *v.shape[1:])
            return torch.cat([q, k, v], 1).reshape(-1, *q.shape[2:])

        out[f"{m}self_attention.linear_qkv.weight"] = fused("weight")
        if args["add_qkv_bias"]:
            out[f"{m}self_attention.linear_qkv.bias"] = fused("bias")
        if args["qk_layernorm"]:
            out[f"{m}self_attention.q_layernorm.weight"] = hf[f"{a}self_attn.q_norm.weight"]
            out[f"{m}self_attention.k_layernorm.weight"] = hf[f"{a}self_attn.k_norm.weight"]
        out[f"{m}self_attention.linear_proj.weight"] = hf[f"{a}self_attn.o_proj.weight"]
        out[f"{m}input_layernorm.weight"] = hf[f"{a}input_layernorm.weight"]
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{a}post_attention_layernorm.weight"]
        if args.get("num_experts"):
            moe = f"{a}block_sparse_moe." if f"{a}block_sparse_moe.gate.weight" in hf else f"{a}mlp."
            names = ("w1", "w3", "w2") if "block_sparse_moe" in moe else ("gate_proj", "up_proj", "down_proj")
            out[f"{m}mlp.router.weight"] = hf[f"{moe}gate.weight"]
            for e in range(args["num_experts"]):
                gate, up, down = (hf[f"{moe}experts.{e}.{n}.weight"] for n in names)
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([gate, up])
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down
        else:
            out[f"{m}mlp.linear_fc1.weight"] = torch.cat([hf[f"{a}mlp.gate_proj.weight"], hf[f"{a}mlp.up_proj.weight"]])
            out[f"{m}mlp.linear_fc2.weight"] = hf[f"{a}mlp.down_proj.weight"]
    return out


# families whose layers megatron-core's local spec cannot build on CPU (Gemma's post-norms live in Megatron-Bridge's
# own modules; megatron-core 0.16's local MLA spec passes k_channels to the local DotProductAttention, which takes no
# such argument: only Transformer Engine's builds MLA): saved as the tensors megatron-core's torch_dist layout holds
# (TE names, as Megatron-Bridge's gemma2_bridge.py and deepseek/common.py list them), with no Megatron forward
RAW = ("gemma2", "gemma3", "deepseek_v3")


def _gemma_args(hf: dict) -> dict:
    """Megatron-Bridge's Gemma provider settings in Megatron-LM argument names (apply_layernorm_1p = zero-centered
    gamma; window_attn_skip_freq as a list, 1 = sliding window)."""
    rope = hf["rope_parameters"]
    full = rope.get("full_attention", rope)
    args = _args({**hf, "model_type": "llama", "rope_parameters": full})
    args.update(apply_layernorm_1p=True, activation_func="fast_gelu", qk_layernorm=hf["model_type"] == "gemma3_text",
                query_pre_attn_scalar=hf["query_pre_attn_scalar"], rotary_base=int(full["rope_theta"]),
                window_size=(hf["sliding_window"] - 1, 0),  # left keys besides the query's own
                window_attn_skip_freq=[int(t == "sliding_attention") for t in hf["layer_types"]])
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(name) is not None:
            args[name] = hf[name]
    if "sliding_attention" in rope:
        args["rope_local_base_freq"] = int(rope["sliding_attention"]["rope_theta"])
    return args


def _gemma_tensors(hf: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """HF Gemma tensors -> megatron-core names (TE spec) and layouts, one entry per layer."""
    out = _inverse(hf, {**args, "num_experts": 0})
    for i in range(args["num_layers"]):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[f"{m}self_attention.linear_qkv.layer_norm_weight"] = out.pop(f"{m}input_layernorm.weight")
        out[f"{m}self_attention.linear_proj.post_layernorm.weight"] = out.pop(f"{m}pre_mlp_layernorm.weight")
        out[f"{m}mlp.linear_fc1.layer_norm_weight"] = hf[f"{a}pre_feedforward_layernorm.weight"]
        out[f"{m}mlp.linear_fc2.post_layernorm.weight"] = hf[f"{a}post_feedforward_layernorm.weight"]
    return out


def _deepseek_args(hf: dict) -> dict:
    """Megatron-Bridge's DeepSeek-V3 provider settings (deepseek/common.py) in Megatron-LM argument names."""
    args = _args({**hf, "model_type": "llama", "num_local_experts": hf["n_routed_experts"]})
    layers, first = hf["num_hidden_layers"], hf["first_k_dense_replace"]
    args.update(multi_latent_attention=True, q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
                qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
                v_head_dim=hf["v_head_dim"], rope_type="rope",
                moe_shared_expert_intermediate_size=hf["n_shared_experts"] * hf["moe_intermediate_size"],
                moe_layer_freq=[0] * first + [1] * (layers - first), moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_num_groups=hf["n_group"],
                moe_router_group_topk=hf["topk_group"], moe_router_topk_scaling_factor=hf["routed_scaling_factor"],
                moe_router_pre_softmax=False)
    rope = hf["rope_parameters"]
    if rope.get("rope_type") == "yarn":  # MLATransformerConfig's YaRN fields
        args.update(rope_type="yarn", rotary_scaling_factor=rope["factor"], beta_fast=rope["beta_fast"],
                    beta_slow=rope["beta_slow"], mscale=rope["mscale"], mscale_all_dim=rope["mscale_all_dim"],
                    original_max_position_embeddings=rope["original_max_position_embeddings"])
    return args


def _deepseek_tensors(hf: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 tensors -> megatron-core's MLA / MoE names (TE spec; Megatron-Bridge deepseek/common.py),
    experts on a leading axis as torch_dist saves them."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    attention = {"input_layernorm.weight": "input_layernorm.weight",
                 "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
                 "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
                 "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
                 "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
                 "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
                 "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
                 "self_attention.linear_proj.weight": "self_attn.o_proj.weight"}
    for i, moe in enumerate(args["moe_layer_freq"]):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({m + k: hf[a + v] for k, v in attention.items()})
        if not moe:
            out[f"{m}mlp.linear_fc1.layer_norm_weight"] = hf[f"{a}post_attention_layernorm.weight"]
            out[f"{m}mlp.linear_fc1.weight"] = torch.cat([hf[f"{a}mlp.gate_proj.weight"], hf[f"{a}mlp.up_proj.weight"]])
            out[f"{m}mlp.linear_fc2.weight"] = hf[f"{a}mlp.down_proj.weight"]
            continue
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{a}post_attention_layernorm.weight"]
        out[f"{m}mlp.router.weight"] = hf[f"{a}mlp.gate.weight"]
        out[f"{m}mlp.router.expert_bias"] = hf[f"{a}mlp.gate.e_score_correction_bias"]
        experts = range(args["num_experts"])
        out[f"{m}mlp.experts.experts.linear_fc1.weight"] = torch.stack([torch.cat(
            [hf[f"{a}mlp.experts.{e}.gate_proj.weight"], hf[f"{a}mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        out[f"{m}mlp.experts.experts.linear_fc2.weight"] = torch.stack(
            [hf[f"{a}mlp.experts.{e}.down_proj.weight"] for e in experts])
        out[f"{m}mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[f"{a}mlp.shared_experts.gate_proj.weight"], hf[f"{a}mlp.shared_experts.up_proj.weight"]])
        out[f"{m}mlp.shared_experts.linear_fc2.weight"] = hf[f"{a}mlp.shared_experts.down_proj.weight"]
    return out


def make_raw(root: str, family: str) -> None:
    """`dist_checkpointing.save` of ShardedTensors as megatron-core's TransformerBlock shards its layers: key
    `decoder.layers.<name>` with the layer on a prepended axis (offset i of num_layers); or, for layers that
    differ (DeepSeek's first-k dense: non_homogeneous_layers), `decoder.layers.<i>.<name>` per layer."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from safetensors.torch import load_file

    with open(os.path.join(root, "hf", family, "config.json")) as fh:
        hf_config = json.load(fh)
    weights = load_file(os.path.join(root, "hf", family, "model.safetensors"))
    if family == "deepseek_v3":
        args = _deepseek_args(hf_config)
        tensors = _deepseek_tensors(weights, args)
        # one multi-token prediction layer's norms (megatron-core's MTP names), which HF's class has no place for
        args["mtp_num_layers"] = 1
        for name in ("enorm", "hnorm"):
            tensors[f"mtp.layers.0.{name}.weight"] = torch.full((hf_config["hidden_size"],), 0.5)
    else:
        args = _gemma_args(hf_config)
        tensors = _gemma_tensors(weights, args)
    layers = args["num_layers"]
    state = {}
    for name, tensor in tensors.items():
        if name.startswith("decoder.layers.") and family != "deepseek_v3":
            i, rest = name[len("decoder.layers."):].split(".", 1)
            key = f"decoder.layers.{rest}"
            state[name] = ShardedTensor.from_rank_offsets(key, tensor.contiguous(), (0, int(i), layers),
                                                          replica_id=0, prepend_axis_num=1)
        else:
            state[name] = ShardedTensor.from_rank_offsets(name, tensor.contiguous(), replica_id=0)
    ckpt = os.path.join(root, "megatron", family, "iter_0000001")
    os.makedirs(ckpt)
    dist_checkpointing.save({"model": state, "args": argparse.Namespace(**args), "iteration": 1,
                             "checkpoint_version": 3.0}, ckpt)
    with open(os.path.join(root, "megatron", family, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    with open(os.path.join(root, "logits", f"{family}.json"), "w") as fh:
        json.dump({k: list(v) if isinstance(v, tuple) else v for k, v in args.items() if k != "params_dtype"}, fh)


def make(root: str, family: str) -> None:
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    if family in RAW:
        make_raw(root, family)
        return
    with open(os.path.join(root, "hf", family, "config.json")) as fh:
        hf_config = json.load(fh)
    args = _args(hf_config)
    model = _model(args)
    weights = _inverse(load_file(os.path.join(root, "hf", family, "model.safetensors")), args)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
    logits = _forward(model)
    out = os.path.join(root, "megatron", family)
    ckpt = os.path.join(out, "iter_0000001")
    os.makedirs(ckpt)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": argparse.Namespace(**args),
                             "iteration": 1, "checkpoint_version": 3.0}, ckpt)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    torch.save(logits.float().clone(), os.path.join(root, "logits", f"{family}.pt"))
    with open(os.path.join(root, "logits", f"{family}.json"), "w") as fh:
        json.dump({k: v for k, v in args.items() if k != "params_dtype"}, fh)


def _forward(model: torch.nn.Module, before: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron's forward on IDS (causal attention); a later pipeline stage starts from `before`, the hidden
    states of the stage before it."""
    model.eval()
    # attention forks the CUDA RNG tracker for dropout; on CPU with dropout 0 in eval there is nothing to fork
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # megatron-core 0.16 without Transformer Engine leaves te_general_gemm undefined in the router's matmul
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    ids = torch.tensor(IDS)
    seq = ids.shape[1]
    if before is not None:
        model.set_input_tensor(before)
    with torch.no_grad():
        return model(ids, torch.arange(seq)[None], torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1))


def _load_worker(rank: int, world: int, ckpt: str, out: str, tp: int, ep: int, pp: int, port: int) -> None:
    """Build the GPTModel at TP=tp x PP=pp (or EP=ep) from the args our import wrote to common.pt, load the
    checkpoint with Megatron's own `dist_checkpointing.load`, run the forward through the pipeline stages (hidden
    states sent from one to the next) and save the logits (first rank of the last stage) to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    _stub_cuda()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             pipeline_model_parallel_size=pp)
    args = torch.load(os.path.join(ckpt, "common.pt"), weights_only=True)["args"]
    stage = parallel_state.get_pipeline_model_parallel_rank()
    model = _model(args, tp, ep, pp, stage)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)  # every key, as Megatron-LM asks
    assert loaded["args"]["num_layers"] == args["num_layers"]  # and common.pt beside them
    model.load_state_dict(loaded["model"])
    before = None
    if stage > 0:
        before = torch.empty(len(IDS[0]), 1, args["hidden_size"])
        dist.recv(before, parallel_state.get_pipeline_model_parallel_prev_rank())
    logits = _forward(model, before).contiguous()
    if stage < pp - 1:
        dist.send(logits, parallel_state.get_pipeline_model_parallel_next_rank())
        dist.destroy_process_group()
        return
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits, group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, -1)
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(logits.float().clone(), out)
    dist.destroy_process_group()


def _fsdp2_worker(rank: int, world: int, root: str, port: int, families: list[str]) -> None:
    """For each family: a transformers model built from the config.json `import --to dcp` carried (random
    weights), wrapped with FSDP2's fully_shard per decoder layer and whole, loaded with dcp.load from
    ROOT/FAMILY (get_model_state_dict / set_model_state_dict, every key asked for); rank 0 saves its forward
    logits on IDS and its full state_dict to ROOT/FAMILY.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
    from tests.ranks import end_rank

    dist.init_process_group("gloo", rank=rank, world_size=world)
    for family in families:
        ckpt = os.path.join(root, family)
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32).eval()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state)
        with torch.no_grad():
            logits = model(torch.tensor(IDS)).logits
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"logits": logits, "state": {k: v.clone() for k, v in full.items()}}, ckpt + ".pt")
    end_rank()


def extra_state_keys(config_json: str, out: str) -> None:
    """megatron-core's own `_extra_state` keys for a DeepSeek-V3 config's layers (dense first k, then MoE with
    shared experts: a per-layer block spec, so the `decoder.layers.{i}.` keys): megatron-core 0.16 builds MLA only
    with Transformer Engine (the local spec's DotProductAttention takes no k_channels), so the attention here is
    the local spec's standard one; its linear modules are keyed as MLA's are (Column/RowParallelLinear). Written
    as a JSON list to OUT."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    with open(config_json) as fh:
        hf = json.load(fh)
    args = _deepseek_args(hf)
    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], use_cpu_initialization=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, num_moe_experts=args["num_experts"],
        moe_router_topk=args["moe_router_topk"], moe_ffn_hidden_size=args["moe_ffn_hidden_size"],
        moe_shared_expert_intermediate_size=args["moe_shared_expert_intermediate_size"],
        moe_layer_freq=args["moe_layer_freq"], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config, False, "RMSNorm"),
                     vocab_size=args["padded_vocab_size"], max_sequence_length=args["max_position_embeddings"],
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    keys = sorted(v.unique_key for v in nested_values(model.sharded_state_dict()) if isinstance(v, ShardedObject))
    with open(out, "w") as fh:
        json.dump(keys, fh)


def main() -> None:
    if sys.argv[1] == "extra-states":  # extra-states CONFIG_JSON OUT PORT
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        _stub_cuda()
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        extra_state_keys(sys.argv[2], sys.argv[3])
        dist.destroy_process_group()
        return
    if sys.argv[1] == "fsdp2":  # fsdp2 ROOT PORT FAMILY...: 2 gloo ranks load ROOT/FAMILY (DCP) into FSDP2
        import torch.multiprocessing as mp

        mp.spawn(_fsdp2_worker, args=(2, sys.argv[2], int(sys.argv[3]), sys.argv[4:]), nprocs=2)
        return
    if sys.argv[1] == "load":  # load CKPT OUT TP EP PP PORT (EP with TP = PP = 1)
        import torch.multiprocessing as mp

        ckpt, out = sys.argv[2], sys.argv[3]
        tp, ep, pp, port = (int(a) for a in sys.argv[4:8])
        world = ep if ep > 1 else tp * pp
        mp.spawn(_load_worker, args=(world, ckpt, out, tp, ep, pp, port), nprocs=world)
        return
    root, port, families = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    _stub_cuda()
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    os.makedirs(os.path.join(root, "logits"), exist_ok=True)
    for family in families:
        make(root, family)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
