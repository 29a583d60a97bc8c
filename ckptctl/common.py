"""What every `ckptctl` command shares: the app, the consoles, one-line errors with their exit codes, the
progress bar, the job commands' flags, generated from the request models (`job_requests`), and the help and
usage style of every command (`Command`: `SOURCE TARGET`, `--limit INTEGER`, switches without a type).

Away from a terminal (a pipe, a file), output is never wrapped or cut: long lines stay whole and tables are
one tab-separated record per line."""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, get_args

import typer
from pydantic import ValidationError
from typer.core import TyperArgument, TyperCommand

from ckpt_service.job_requests import REQUESTS, JobRequest, build, default_of, flag_of, problems, shape
from ckpt_service.service_errors import exit_code, worded
from ckpt_service.units import exact
from converters import CkptError

if TYPE_CHECKING:
    from rich.console import Console

#: help fills the terminal's width (click caps it at 80 unless told otherwise)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  context_settings={"max_content_width": 400},
                  help="Convert, reshard, export and verify sharded PyTorch checkpoints, offline and streaming.")


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


# -- flags from the request models -----------------------------------------------------------------


def cli_type(annotation: Any) -> Any:
    """The command-line type of a model field: bool, int, float, list[str], or str (choices and sizes, which
    the model checks)."""
    return {"bool": bool, "int": int, "float": float, "list": list[str]}.get(shape(annotation).kind, str)


def choices_of(annotation: Any) -> tuple[str, ...]:
    """The values a choice field takes (`Literal[...] | None` included), else ()."""
    return shape(annotation).choices


def default_words(model: type[JobRequest], name: str, kind: Any, default: Any) -> str:
    """A field's default as help text: `Default: 5GB.`, `Default: --clean-keys.`; nothing for an off switch or
    an empty list."""
    decls = flag_of(model, name).decls[0].split("/")
    if kind is bool:
        if default is None:
            unset = flag_of(model, name).unset
            return f" Default: {unset}." if unset else ""
        if len(decls) == 1:
            return " Default: on." if default else ""
        return f" Default: {decls[0] if default else decls[1]}."
    if default in (None, []):
        return ""
    return f" Default: {exact(default) if isinstance(default, int) and kind is str else default}."


def option_parameters(model: type[JobRequest]) -> list[inspect.Parameter]:
    """One keyword parameter per model field, with the field's flag, help and default. Options other than
    flags default to None ("not given"), so the model's default applies; the help says that default in words.
    Choices are listed as the value's placeholder, lists are repeatable flags."""
    params = []
    for name, info in model.model_fields.items():
        kind = cli_type(info.annotation)
        default = default_of(info)
        if info.is_required():
            value = inspect.Parameter.empty
        elif kind is bool:
            value = default
        else:
            value = None
        choices = choices_of(info.annotation)
        metavar = flag_of(model, name).metavar or ("[" + "|".join(choices) + "]" if choices else None)
        text = (info.description or "") + (" Repeatable." if kind == list[str] else "") + \
            ("" if info.is_required() else default_words(model, name, kind, default))
        option = typer.Option(*flag_of(model, name).decls, help=text.strip(), show_default=False, metavar=metavar)
        annotation: Any = Annotated[kind if value is inspect.Parameter.empty or kind is bool else kind | None, option]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value, annotation=annotation))
    return params


def request_from(model: type[JobRequest], values: dict[str, Any]) -> Any:
    """The request model from command-line values; a refusal is one line naming the flag (exit 2)."""
    try:
        return build(model.kind, values)
    except ValidationError as exc:
        name, message = problems(exc)[0]
        decl = flag_of(model, name).decls[0].split("/")[0] if name in model.model_fields else name
        fail(f"{decl}: {message}")


def job_command(group: typer.Typer, model: type[JobRequest], arguments: list[tuple[str, str]],
                extras: list[inspect.Parameter], run: Callable[..., None], name: str | None = None,
                help: str | None = None) -> None:
    """Register `run(request, *arguments, **extras)` as command `name` of `group`, taking `arguments`
    (name, help) positionally, the model's options as flags, then the `extras` parameters."""
    positional = [inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    annotation=Annotated[str, typer.Argument(help=text, show_default=False)])
                  for arg, text in arguments]
    params = positional + option_parameters(model) + extras

    def command(**kwargs: Any) -> None:
        values = {field: kwargs.pop(field) for field in model.model_fields}
        request = request_from(model, values)
        run(request, *(kwargs.pop(arg) for arg, _ in arguments), **kwargs)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = help or model.__doc__
    command.__name__ = name or model.kind
    group.command(name or model.kind)(command)


def keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    """An extra command parameter (e.g. `quiet: Quiet = False`) for `job_command`."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


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
