"""Train a tiny random Llama with the Hugging Face `Trainer` under Accelerate FSDP on CPU (gloo), for the tests.

`python -m torch.distributed.run --nproc-per-node N tests/hf_trainer_tool.py FSDP_VERSION OUT STEPS [RESUME]`:
trains to STEPS (saving a sharded checkpoint, `OUT/checkpoint-STEPS/`), resuming from RESUME with
`Trainer.train(resume_from_checkpoint=RESUME)` when given; rank 0 writes the logged losses to `OUT/losses.json`.
The model is built from a config (no download); dropout is off, so the only randomness is the seeded sampler.
"""

from __future__ import annotations

import json
import sys

import torch
from ranks import end_rank  # run as a script: its own folder (tests/) is first on sys.path
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class CpuFsdpTrainer(Trainer):
    """Trainer itself; Accelerate turns FSDP on only for GPU-like devices (a MULTI_CPU state never gets its FSDP
    plugin), so this marks the state FSDP with the plugin the Trainer built from `fsdp_config`, as on a GPU, and
    names the device `cpu` (FSDP1 compares it with its parameters' device)."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        state = AcceleratorState()
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        PartialState().device = state.device = torch.device("cpu")  # not cpu:RANK, which FSDP1 refuses
        self.is_fsdp_enabled = True


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(version: str, out: str, steps: str, resume: str | None = None) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=int(steps), per_device_train_batch_size=2,
                             learning_rate=1e-2, logging_steps=1, save_steps=int(steps), save_strategy="steps",
                             report_to=[], seed=0, fsdp="full_shard",
                             fsdp_config={"version": int(version), "state_dict_type": "SHARDED_STATE_DICT",
                                          "sync_module_states": False})
    trainer = CpuFsdpTrainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    if trainer.args.process_index == 0:
        losses = {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
        with open(f"{out}/losses.json", "w") as fh:
            json.dump(losses, fh)
    end_rank()


if __name__ == "__main__":
    main(*sys.argv[1:])
