"""A PEFT LoRA trained under Accelerate's FSDP (FSDP1, SHARDED_STATE_DICT) on CPU (gloo) and saved with
`accelerator.save_state`, for tests/test_adapters.py.

`python -m torch.distributed.run --nproc-per-node 2 tests/adapter_accelerate_tool.py BASE OUT`: trains an rsLoRA
on q/v/up projections with lm_head in modules_to_save on the base for 2 AdamW steps and saves Accelerate's state
(`OUT/checkpoint/`: `pytorch_model_fsdp_0/`, `optimizer_0/`, ...); rank 0 then writes, from the full state dict
gathered with torch.distributed.checkpoint, OUT/trained.safetensors (the trained model's logits on the test's
tokens), OUT/merged_by_peft.safetensors (`merge_and_unload()`) and OUT/lora.json.

(The HF Trainer's own checkpoint of a PEFT model under FSDP1 SHARDED_STATE_DICT holds no LoRA tensor at all:
accelerate 1.16's `save_fsdp_model(adapter_only=True)` keeps only the modules_to_save copy, so it cannot serve.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from ranks import end_rank  # run as a script: its own folder (tests/) is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.adapter_job import LORA
from tests.test_adapters import TOKENS

#: tests.adapter_job's LoRA without DoRA: PEFT's DoRA layer needs its own FSDP wrap policy (its forward reads
#: lora_A's weight shape, which FSDP1 flattens when the whole model is one unit)
TRAINER_LORA = {**LORA, "use_dora": False}


def _model(base: str) -> torch.nn.Module:
    import peft.tuners.lora.torchao as peft_torchao
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    peft_torchao.is_torchao_available = lambda: False  # type: ignore[assignment]  # see tests/test_adapters.py
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(**TRAINER_LORA))  # type: ignore[arg-type]


def mark_fsdp(plugin: Any = None) -> Any:
    """Accelerate turns FSDP on only for GPU-like devices (a MULTI_CPU state never gets its FSDP plugin, and
    preparing an optimizer sets MULTI_CPU again): mark the state FSDP with the plugin, as on a GPU, on the `cpu`
    device (tests/hf_trainer_tool.py does the same for the Trainer). Returns the plugin."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin or FullyShardedDataParallelPlugin(
        fsdp_version=1, state_dict_type="SHARDED_STATE_DICT", use_orig_params=True, sync_module_states=False)
    PartialState().device = state.device = torch.device("cpu")
    return state.fsdp_plugin


def main(base: str, out: str) -> None:
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    acc = Accelerator(cpu=True)
    plugin = mark_fsdp()
    model = acc.prepare(_model(base))
    optim = acc.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    mark_fsdp(plugin)
    torch.manual_seed(1 + acc.process_index)
    for _ in range(2):
        batch = torch.randint(0, 64, (2, 8))
        acc.backward(model(input_ids=batch, labels=batch).loss)
        optim.step()
        optim.zero_grad()
    acc.save_state(f"{out}/checkpoint")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if acc.is_main_process:
        from safetensors.torch import save_file

        trained = _model(base)
        trained.load_state_dict(full)
        trained.eval()
        with torch.no_grad():
            save_file({"logits": trained(input_ids=TOKENS).logits.contiguous()}, f"{out}/trained.safetensors")
        merged = trained.merge_and_unload().state_dict()
        save_file({k: v.contiguous() for k, v in merged.items()}, f"{out}/merged_by_peft.safetensors")
        Path(out, "lora.json").write_text(json.dumps({"lora_alpha": LORA["lora_alpha"],
                                                      "use_rslora": LORA["use_rslora"]}))
    end_rank()


if __name__ == "__main__":
    main(*sys.argv[1:])
