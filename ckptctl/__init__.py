"""`ckptctl`: inspect, convert, export, verify, reshard and sample checkpoints from the shell (`offline`),
queue the same as jobs on a server (`server_commands`), manage checkpoints there (`manage`: tags, aliases, runs,
rules, retention and GC), and run the service (`serving`).

The job commands and their flags come from the job kinds' declarations (`ckpt_service.job_kinds`) and
their request models (`ckpt_service.job_requests`). Nothing here
imports the HTTP app (`api`) until `ckptctl serve` runs, and an offline command loads only `offline`:
`main` registers the other modules' commands only when the command line names none of its commands
(`app`, taken from this package, always has every command).
"""

from __future__ import annotations

import gc
import sys
from importlib import import_module
from typing import Any

gc.disable()  # start-up makes many long-lived objects and no garbage: no collection passes over them (30 ms)
try:
    import typer
    from typer._click import exceptions as click  # typer vendors click

    from ckpt_service.job_kinds import names

    from . import common
finally:
    gc.enable()

__all__ = ["app", "main"]

#: the modules that register commands on `common.app`, in this order
MODULES = ("offline", "server_commands", "manage", "serving")
#: the commands `offline` registers: one per job kind, `sample`, and the archive tier's
OFFLINE_COMMANDS = frozenset({*names(), "sample", "archive", "restore", "archives", "archive-gc"})


def load(names: tuple[str, ...] = MODULES) -> None:
    for name in names:
        import_module(f"{__name__}.{name}")
    common.plain_commands(common.app)


def __getattr__(name: str) -> Any:
    if name == "app":
        load()
        return common.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    args = sys.argv[1:]
    gc.disable()
    try:
        load(("offline",) if args and args[0] in OFFLINE_COMMANDS else MODULES)
    finally:
        gc.freeze()  # what start-up made lives as long as the process: later collections skip it
        gc.enable()
    try:
        code = common.app(standalone_mode=False, prog_name="ckptctl")
    except click.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help() if exc.ctx else "", err=True)
        code = 2
    except click.UsageError as exc:  # a missing or malformed argument: one line, like every other refusal
        hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
        common.say_error(f"{exc.format_message()}{hint}")
        code = 2
    except typer.Abort:
        common.say_error("interrupted; nothing was left behind")
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
