"""A PEFT LoRA training run under DeepSpeed ZeRO-2 / ZeRO-3 (a real engine on CPU, 2 gloo ranks), for
tests/test_adapters.py.

    python -m tests.adapter_sources_job BASE_DIR OUT_DIR --stage {2,3}

Trains rsLoRA + DoRA on q/v/up projections with lm_head in modules_to_save (tests.adapter_job's LORA) for 2 Adam
steps with `deepspeed.initialize` on the PEFT model, saves with `engine.save_checkpoint(OUT_DIR/checkpoint)`, and
on rank 0 writes what the test compares with (the full trained parameters gathered with DeepSpeed's
GatheredParameters): OUT_DIR/trained.safetensors (the trained model's logits on the test's tokens),
OUT_DIR/merged_by_peft.safetensors (`merge_and_unload()`) and OUT_DIR/lora.json.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    torch.set_num_threads(1)
    import deepspeed

    from tests.adapter_job import _model, save_oracles
    from tests.ranks import end_rank

    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(args.base)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": args.stage, **({"stage3_param_persistence_threshold": 0}
                                                          if args.stage == 3 else {})}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                      if p.requires_grad], config=cfg)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        batch = torch.randint(0, 64, (2, 8))
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    engine.save_checkpoint(str(Path(args.out) / "checkpoint"))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        full = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        save_oracles(args.base, full, Path(args.out))
    end_rank()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(args, port), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
