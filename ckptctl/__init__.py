"""`ckptctl`: inspect, convert, export, verify, reshard and sample checkpoints from the shell (`offline`),
queue the same as jobs on a server (`server_commands`), manage checkpoints there (`manage`: tags, aliases, runs,
rules, retention and GC), and run the service (`serving`).

The job commands and their flags come from the job kinds' declarations (`ckpt_service.job_kinds`) and
their request models (`ckpt_service.job_requests`). A run builds only what its command line names (`main`):
`ckptctl CMD ...` imports CMD's modules (`listing.COMMANDS`) and builds CMD alone, its flags and its request
model, no other command's; `ckptctl --help` lists the commands from `listing.COMMANDS` without importing any
of them. Nothing here imports the HTTP app (`api`) until `ckptctl serve` runs. `app`, taken from this
package, always has every command.
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
    from typer.main import get_command_name

    from . import common
    from .listing import COMMANDS
finally:
    gc.enable()

__all__ = ["app", "main"]

#: the modules that register commands on `common.app`, in this order
MODULES = ("offline", "server_commands", "manage", "serving")
#: the commands `offline` registers: one per job kind, `sample`, and the archive tier's
OFFLINE_COMMANDS = frozenset(name for name, entry in COMMANDS.items() if entry.modules == ("offline",))


def load(names: tuple[str, ...] = MODULES) -> None:
    for name in names:
        import_module(f"{__name__}.{name}")
    common.plain_commands(common.app)


def build(args: list[str]) -> None:
    """Make what `ckptctl ARGS` runs: for a command, its modules and that command alone; for the group's help or
    options, nothing (the help lists `COMMANDS`); for any other word, every command (click then suggests the
    nearest names)."""
    name = args[0] if args else "-"
    if name not in COMMANDS:
        load(() if name.startswith("-") else MODULES)
        return
    common.invoked = name
    load(COMMANDS[name].modules)
    app = common.app
    app.registered_commands = [c for c in app.registered_commands
                               if (c.name or get_command_name(getattr(c.callback, "__name__", ""))) == name]
    app.registered_groups = [g for g in app.registered_groups if g.name == name]


def __getattr__(name: str) -> Any:
    if name == "app":
        load()
        return common.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    args = sys.argv[1:]
    gc.disable()
    try:
        build(args)
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
