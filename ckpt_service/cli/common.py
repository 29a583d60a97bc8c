"""What every `ckptctl` command shares: the app, the consoles, one-line errors with their exit codes, the
progress bar, and the job commands' flags, generated from the request models (`job_requests`)."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Union, get_args, get_origin

import typer
from pydantic import ValidationError

from converters import CkptError

from ..errors import exit_code
from ..job_requests import JobRequest, build, default_of, flag_of, plain, problems
from ..units import exact

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
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
        return self.made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)


out = LazyConsole()
err = LazyConsole(stderr=True)


def make_table(*headers: str) -> Table:
    """A rich table with these column headers (rich.table loads only when a command prints one)."""
    from rich.table import Table

    return Table(*headers)


Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print a JSON document.")]
From = Annotated[str | None, typer.Option("--from", help="Force the source format.")]


def fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def errors() -> Iterator[None]:
    """Errors raised on purpose become one line on stderr and their exit code (`errors.EXIT_CODES`)."""
    try:
        yield
    except CkptError as exc:
        fail(str(exc), exit_code(exc))
    except KeyboardInterrupt as exc:
        fail("interrupted; nothing was left behind", exit_code(exc))


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
    annotation = plain(annotation)
    args = [annotation]
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
    if len(args) == 1:
        if args[0] in (bool, int, float):
            return args[0]
        if get_origin(args[0]) is list:
            return list[str]
    return str


def option_parameters(model: type[JobRequest]) -> list[inspect.Parameter]:
    """One keyword parameter per model field, with the field's flag, help and default. Options other than
    flags default to None ("not given"), so the model's default applies; the help shows that default."""
    params = []
    for name, info in model.model_fields.items():
        kind = cli_type(info.annotation)
        default = default_of(info)
        if info.is_required():
            value, shown = inspect.Parameter.empty, False
        elif kind is bool:
            value, shown = default, True
        else:
            value = None
            shown = False if default in (None, []) else exact(default) if isinstance(default, int) and \
                kind is str else str(default)
        option = typer.Option(*flag_of(model, name).decls, help=info.description, show_default=shown)
        annotation = Annotated[kind if value is inspect.Parameter.empty or kind is bool else kind | None, option]
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
