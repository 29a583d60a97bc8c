"""`ckptctl`: inspect, convert, export, verify, reshard and sample checkpoints from the shell (`offline`),
queue the same as jobs on a server (`client`), manage checkpoints there (`manage`: tags, aliases, runs,
rules, retention and GC), and run the service (`service`).

The job commands' flags come from the request models (`ckpt_service.job_requests`). Nothing here
imports the HTTP app (`api`) until `ckptctl serve` runs, and an offline command loads only `offline`:
`main` registers the other modules' commands only when the command line names none of its commands
(`app`, taken from this package, always has every command).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

from ..job_requests import REQUESTS
from . import common

__all__ = ["app", "main"]

#: the modules that register commands on `common.app`, in this order
MODULES = ("offline", "client", "manage", "service")
#: the commands `offline` registers: one per request model, and `sample`
OFFLINE_COMMANDS = frozenset({*REQUESTS, "sample"})


def load(names: tuple[str, ...] = MODULES) -> None:
    for name in names:
        import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> Any:
    if name == "app":
        load()
        return common.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    args = sys.argv[1:]
    load(("offline",) if args and args[0] in OFFLINE_COMMANDS else MODULES)
    common.app()
