"""How the test tools start their training ranks, and how a rank ends."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
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
