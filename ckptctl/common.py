"""What every `ckptctl` command shares: the app, the consoles, one-line errors with their exit codes, the
progress bar, and the help and usage style of every command (`Command`: `SOURCE TARGET`, `--limit INTEGER`,
switches without a type). The job commands' flags, made from the request models, live in `flags`.

Away from a terminal (a pipe, a file), output is never wrapped or cut: long lines stay whole and tables are
one tab-separated record per line."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, get_args

import typer
from typer.core import TyperArgument, TyperCommand

from ckpt_service.service_errors import exit_code, worded
from converters import CkptError

from .listing import Listing

if TYPE_CHECKING:
    from rich.console import Console


#: help fills the terminal's width (click caps it at 80 unless told otherwise); the request models and their
#: flags load only with a command that uses them (`--help` lists the commands from `listing.COMMANDS`)
app = typer.Typer(cls=Listing, add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  context_settings={"max_content_width": 400},
                  help="Convert, reshard, export and verify sharded PyTorch checkpoints, offline and streaming.")


@app.callback()
def _group() -> None:
    # a callback makes typer build a group also when it holds one command (`ckptctl CMD` builds only CMD)
    pass


#: the one top-level command this process runs (`ckptctl CMD ...`), set by `ckptctl.main` before it imports
#: CMD's module: `flags.job_command` makes no other top-level command. None: every command (`ckptctl.app`)
invoked: str | None = None


class LazyConsole:
    """A rich Console made on first use, so that rich loads only when a command prints."""

    def __init__(self, stderr: bool = False) -> None:
        self.stderr = stderr
        self.made: Console | None = None

    def real(self) -> Console:
        """The Console itself (for rich objects that take one, such as a Progress)."""
        if self.made is None:
            from rich.console import Console

            self.made = Console(stderr=self.stderr)
            self.made.soft_wrap = not self.made.is_terminal  # a pipe gets whole lines
        return self.made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Console.print; `Records` go out as they are (rich would expand their tabs), and so does plain text away
        from a terminal (`_plain`: rich, 20 ms to load, is not needed to print a command's last line)."""
        stream = sys.stderr if self.stderr else sys.stdout
        if len(objects) == 1 and isinstance(objects[0], Records):
            stream.write("\n".join(objects[0].lines) + "\n")
            return
        text = self._plain(stream, objects, kwargs)
        if text is not None:
            stream.write(text + "\n")
            return
        self.real().print(*objects, **kwargs)

    def _plain(self, stream: Any, objects: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The line rich would print for `objects` when that is their text unchanged: one string, at most dimmed
        (`[dim]...[/]`), without markup, escapes, tabs, control characters or emoji codes, to a stream that is
        no terminal (none forced by the environment); else None."""
        if self.made is not None or set(kwargs) - {"highlight"} or len(objects) != 1 or type(objects[0]) is not str:
            return None
        if any(os.environ.get(name) for name in _FORCED) or stream.isatty():
            return None
        text = objects[0]
        if text.startswith("[dim]") and text.endswith("[/]"):
            text = text[5:-3]
        return None if _RICH.search(text) else text


#: what rich would render in a string (markup, escapes, tabs, control characters, `:emoji:` codes)
_RICH = re.compile(r"[\[\]\\\x00-\x09\x0b-\x1f\x7f]|:\S*?:")
#: environment variables that make rich style a stream that is no terminal
_FORCED = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")


out = LazyConsole()
err = LazyConsole(stderr=True)


class Records:
    """A table away from a terminal: a header line, then one record per line, cells whole and tab-separated
    (`LazyConsole.print` writes it)."""

    def __init__(self, *headers: str) -> None:
        self.lines = ["\t".join(headers)]

    def add_row(self, *cells: str) -> None:
        self.lines.append("\t".join(cell or "-" for cell in cells))


def make_table(*headers: str) -> Any:
    """A rich table with these column headers on a terminal, else `Records` (rich.table loads only when a
    command prints one)."""
    if not out.real().is_terminal:
        return Records(*headers)
    from rich.table import Table

    return Table(*headers)


def shown(value: Any) -> str:
    """A value for a line of output: `-` where it is unknown (never `None`)."""
    return "-" if value is None else str(value)


Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print a JSON document.")]
From = Annotated[str | None, typer.Option("--from", help="Force the source format.")]


def say_error(message: str) -> None:
    """The one line every refusal prints on stderr."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    say_error(message)
    raise typer.Exit(code)


def flag_name(field: str | None) -> str | None:
    """The flag of a job option named as a request field (`options.overwrite` -> `--overwrite`), else None."""
    from ckpt_service.job_requests import REQUESTS, flag_of

    name = (field or "").removeprefix("options.")
    for model in REQUESTS.values():
        if field and field.startswith("options.") and name in model.model_fields:
            return flag_of(model, name).decls[0].split("/")[0]
    return None


def in_cli_words(exc: CkptError) -> str:
    """An error's line as the command line says it: the engine option or the request field it names, as its flag."""
    return worded(exc.said_as(lambda name: flag_name(f"options.{name}")), exc.field, flag_name(exc.field))


@contextmanager
def errors() -> Iterator[None]:
    """Errors raised on purpose become one line on stderr and their exit code (`errors.EXIT_CODES`)."""
    try:
        yield
    except CkptError as exc:
        fail(in_cli_words(exc), exit_code(exc))
    except KeyboardInterrupt as exc:
        fail("interrupted; nothing was left behind", exit_code(exc))


@contextmanager
def engine_config(ray: str | None = None) -> Iterator[Any]:
    """Run the block under the engine config the `CKPT_*` variables describe, with `--ray ADDRESS` applied
    (a bad variable is one line naming it: run this inside `errors()`)."""
    from converters import EngineConfig
    from converters import use_config as use

    config = EngineConfig.from_env()
    if ray:
        config = config.replace(executor="ray", ray_address=ray)
    with use(config):
        yield config


@contextmanager
def progress_bar(quiet: bool) -> Iterator[Callable[[Any], None] | None]:
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=err.real(), transient=True) as bar:
        task = bar.add_task("converting", total=None)

        def update(p: Any) -> None:
            bar.update(task, completed=p.done_bytes, total=p.total_bytes or None)

        yield update


# -- help and usage --------------------------------------------------------------------------------


def plain_metavar(param: Any) -> str:
    """How a parameter's value shows in help and usage, as most command lines write it: `SOURCE`, `INTEGER`,
    `[read|write|admin]`; nothing for a switch."""
    if param.metavar is not None:
        return str(param.metavar)
    if isinstance(param, TyperArgument):
        return str(param.name or "").upper()
    if param.is_flag:
        return ""
    described = param.type_descriptor
    if described.is_choice:
        return "[" + "|".join(map(str, described.choices or ())) + "]"
    annotation = get_args(described.annotation)[0] if described.is_list else described.annotation
    return {int: "INTEGER", float: "NUMBER"}.get(annotation, "PATH" if described.is_path else "TEXT")


class Command(TyperCommand):
    """A command whose help reads like a plain command line's: `Usage: ckptctl export [OPTIONS] SOURCE TARGET`,
    `--limit INTEGER`, `--overwrite` with no type, `--include GLOB` (repeatable)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            param.metavar = plain_metavar(param)
            if isinstance(param, TyperArgument):  # its name column says it all (typer would add `<str>`)
                param.display_type_rich = lambda ctx: None  # type: ignore[method-assign]

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = f"{param.metavar}..." if param.nargs != 1 else str(param.metavar)
                pieces.append(name if param.required else f"[{name}]")
        return pieces


def plain_commands(group: typer.Typer) -> None:
    """Give every command of `group` and its sub-groups the `Command` style (those that chose none), and
    click's plain help layout: rich's panels would cost every `--help` ~70 ms of imports (typer.rich_utils
    loads rich's markdown and syntax highlighting)."""
    group.rich_markup_mode = None
    for info in group.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = Command
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            plain_commands(sub.typer_instance)
