"""The job commands' flags, made from the request models (`ckpt_service.job_requests`): one flag per option,
with its help and default in words, and the request built from the values given (a refusal names the flag).
Only a command that takes a request imports this module (and the request models)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from ckpt_service.job_requests import JobRequest, build, default_of, flag_of, problems, shape
from ckpt_service.units import exact

from . import common
from .common import app, fail


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


@contextmanager
def no_pydantic_plugins() -> Iterator[None]:
    """Validators made in the block look up no pydantic plugins: the look-up reads every installed package's entry
    points (15-20 ms of a command's start-up), and a command line has no use for them (typer makes its own
    parameters' validators so)."""
    saved = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYDANTIC_DISABLE_PLUGINS"]
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = saved


def request_from(model: type[JobRequest], values: dict[str, Any]) -> Any:
    """The request model from command-line values; a refusal is one line naming the flag (exit 2)."""
    try:
        with no_pydantic_plugins():
            return build(model.kind, values)
    except ValidationError as exc:
        name, message = problems(exc)[0]
        decl = flag_of(model, name).decls[0].split("/")[0] if name in model.model_fields else name
        fail(f"{decl}: {message}")


def job_command(group: typer.Typer, model: type[JobRequest], arguments: list[tuple[str, str]],
                extras: list[inspect.Parameter], run: Callable[..., None], name: str | None = None,
                help: str | None = None) -> None:
    """Register `run(request, *arguments, **extras)` as command `name` of `group`, taking `arguments`
    (name, help) positionally, the model's options as flags, then the `extras` parameters (nothing when this
    process runs another top-level command: `common.invoked`)."""
    if group is app and common.invoked is not None and (name or model.kind) != common.invoked:
        return
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
