"""`ckptctl`: inspect, convert, export, verify, reshard and sample checkpoints from the shell (`offline`),
queue the same as jobs on a server (`client`), manage checkpoints there (`manage`: tags, aliases, runs,
rules, retention and GC), and run the service (`service`).

The job commands' flags come from the request models (`ckpt_service.job_requests`). Nothing here
imports the HTTP app (`api`) until `ckptctl serve` runs.
"""

from __future__ import annotations

from importlib import import_module

from .common import app

__all__ = ["app", "main"]

for _module in ("offline", "client", "manage", "service"):  # each registers its commands on `app`, in this order
    import_module(f"{__name__}.{_module}")


def main() -> None:
    app()
