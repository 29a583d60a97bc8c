"""How the test tools start their training ranks, and how a rank ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist


def end_rank() -> NoReturn:
    """Leave the process group once every rank got here, then end the process at once: gloo's threads (and DCP's
    staging threads) still alive at interpreter teardown can abort a rank whose work is done and saved
    ("terminate called without an active exception", SIGABRT), which fails a run that succeeded."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(target: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run `target(rank, world_size, *args)` in `world_size` processes joined over gloo on a free loopback port."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(target, args=(world_size, *args), nprocs=world_size)


def run_tool(module: str, out: Path) -> Path:
    """Run a training tool of the tests (`python -m tests.MODULE OUT`: it spawns its ranks and saves under OUT) from
    the repository root; OUT once it succeeded."""
    proc = subprocess.run([sys.executable, "-m", f"tests.{module}", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
