"""Make real Megatron-core checkpoints on CPU (gloo) for the tests, and read them back with Megatron itself.

`python tests/megatron_tool.py save OUT`: a small Llama-style GPTModel (RMSNorm, SwiGLU, GQA, rope, untied)
at TP=2 x PP=2 on 4 processes, saved with `dist_checkpointing.save` twice: as Megatron-LM lays it out
(`OUT/megatron/latest_checkpointed_iteration.txt`, `iter_0000007/`, args in common.pt) and as NeMo 2
does (`OUT/nemo/weights/` with `module.`-prefixed keys, `context/model.yaml`).
`python tests/megatron_tool.py load CKPT PREFIX REF`: one process builds the same model at TP=1 x PP=1 and
loads the checkpoint with `dist_checkpointing.load` (Megatron's own resharding); saves {stored key, layer}
-> tensor to REF.

Megatron's CUDA calls are stubbed (`torch.cuda.synchronize`, `torch.cuda.current_device`); the
`__main__` guard is needed by its writer's spawned manager process.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, ROPE_BASE, EPS = 4, 64, 8, 2, 96, 128, 32, 10000.0, 1e-5


def _stub_cuda() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _model(tp: int, pp: int, pp_rank: int) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=FFN, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, use_cpu_initialization=True,
                               normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False,
                               pipeline_dtype=torch.float32, layernorm_epsilon=EPS, hidden_dropout=0.0,
                               attention_dropout=0.0)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pp_rank == 0,
                    post_process=pp_rank == pp - 1, position_embedding_type="rope", rotary_base=int(ROPE_BASE),
                    share_embeddings_and_output_weights=False)


def megatron_args() -> argparse.Namespace:
    """What Megatron-LM's common.pt holds under `args` (the model part, plus its enum-valued arguments)."""
    import signal

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS, normalization="RMSNorm",
        norm_epsilon=EPS, swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=int(ROPE_BASE), rotary_percent=1.0, max_position_embeddings=SEQ,
        seq_length=SEQ, padded_vocab_size=VOCAB, params_dtype=torch.float32, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2, attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
        exit_signal=signal.SIGTERM)


NEMO_YAML = f"""_target_: nemo.collections.llm.gpt.model.llama.LlamaModel
config:
  _target_: nemo.collections.llm.gpt.model.llama.LlamaConfig
  activation_func:
    _call_: false
    _target_: torch.nn.functional.silu
  add_bias_linear: false
  gated_linear_unit: true
  normalization: RMSNorm
  num_layers: {LAYERS}
  hidden_size: {HIDDEN}
  ffn_hidden_size: {FFN}
  num_attention_heads: {HEADS}
  num_query_groups: {GROUPS}
  kv_channels: null
  layernorm_epsilon: {EPS}
  position_embedding_type: rope
  rotary_base: {int(ROPE_BASE)}
  rotary_percent: 1.0
  seq_length: {SEQ}
  share_embeddings_and_output_weights: false
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 2
"""


def _save_worker(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    _stub_cuda()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = _model(2, 2, parallel_state.get_pipeline_model_parallel_rank())
    torch.manual_seed(100 + rank)
    with torch.no_grad():  # untrained layer norms are all ones: make every value distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    mlm = os.path.join(out, "megatron", "iter_0000007")
    nemo = os.path.join(out, "nemo", "weights")
    for path in (mlm, nemo):
        os.makedirs(path, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": megatron_args(), "iteration": 7,
                             "checkpoint_version": 3.0}, mlm)
    dist_checkpointing.save({"model": model.sharded_state_dict(prefix="module.")}, nemo)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "megatron", "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write("7")
        os.makedirs(os.path.join(out, "nemo", "context"))
        with open(os.path.join(out, "nemo", "context", "model.yaml"), "w") as fh:
            fh.write(NEMO_YAML)
    dist.destroy_process_group()


def load(ckpt: str, prefix: str, ref: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    _stub_cuda()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    sharded = _model(1, 1, 0).sharded_state_dict(prefix=prefix)
    keys = {k: v.key for k, v in sharded.items() if "_extra_state" not in k}  # module name -> stored name
    loaded = dist_checkpointing.load(sharded, ckpt)
    out = {}
    for k, key in keys.items():
        layer = re.search(r"\.layers\.(\d+)\.", k)
        out[key if layer is None else f"{key}@{layer.group(1)}"] = loaded[k].clone()
    torch.save(out, ref)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "save":
        import torch.multiprocessing as mp

        mp.spawn(_save_worker, args=(4, sys.argv[2], int(sys.argv[3])), nprocs=4)
    else:
        load(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
