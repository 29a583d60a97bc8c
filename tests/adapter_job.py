"""A PEFT LoRA training run under FSDP2 (fully_shard) at 2 gloo ranks, for tests/test_adapters.py.

    python -m tests.adapter_job BASE_DIR OUT_DIR

Trains rsLoRA + DoRA on q/v/up projections with lm_head in modules_to_save for 2 AdamW steps, saves the model
with torch.distributed.checkpoint (`get_model_state_dict`) to OUT_DIR/checkpoint, and on rank 0 writes what the
test compares with: OUT_DIR/trained.safetensors (the trained model's logits on the test's tokens, computed in
this process), OUT_DIR/merged_by_peft.safetensors (`merge_and_unload()` of the trained model) and OUT_DIR/lora.json
(the LoraConfig's alpha and rsLoRA, which the weights do not hold).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

LORA = dict(r=4, lora_alpha=16, use_rslora=True, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"],
            modules_to_save=["lm_head"])


def _model(base: str) -> torch.nn.Module:
    import peft.tuners.lora.torchao as peft_torchao
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    peft_torchao.is_torchao_available = lambda: False  # type: ignore[assignment]  # see tests/test_adapters.py
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(**LORA))  # type: ignore[arg-type]


def job(rank: int, world_size: int, base: str, out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.ranks import end_rank

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = _model(base)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        batch = torch.randint(0, 64, (2, 8))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "checkpoint"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_oracles(base, full, out)
    end_rank()


def save_oracles(base: str, full: dict[str, torch.Tensor], out: Path) -> None:
    """What the tests compare with, from the trained PEFT model's full state: its logits on TOKENS, PEFT's own
    merge_and_unload() and the LoRA settings the weights do not carry."""
    from safetensors.torch import save_file

    from tests.test_adapters import TOKENS

    trained = _model(base)
    trained.load_state_dict(full)
    trained.eval()
    with torch.no_grad():
        save_file({"logits": trained(input_ids=TOKENS).logits.contiguous()}, out / "trained.safetensors")
    merged = trained.merge_and_unload().state_dict()
    save_file({k: v.contiguous() for k, v in merged.items()}, out / "merged_by_peft.safetensors")
    (out / "lora.json").write_text(json.dumps({"lora_alpha": LORA["lora_alpha"], "use_rslora": LORA["use_rslora"]}))


def _spawn(rank: int, world_size: int, base: str, out: str) -> None:
    job(rank, world_size, base, Path(out))


if __name__ == "__main__":
    from tests.ranks import spawn

    spawn(_spawn, 2, sys.argv[1], sys.argv[2])
