"""One exception tree for the engine and the service. Every message names the file or key and says what to do.

    CkptError                (fields: `uri`, `key`, `field`, `option` where known; picklable with them)
    ├── SourceError          the input is missing, unreadable or not what it claims to be
    │   ├── FormatError      no known layout, or the layout is damaged (bad metadata, truncated data)
    │   └── UnsafePickleError a pickle references a class outside the allow-list
    ├── TargetError          the output cannot be written (exists, disk full, bad name)
    ├── OptionError          a bad option or combination of options
    ├── VerifyError          a verification found differences (`report` holds them when known)
    └── ckpt_service.service_errors  the service's errors (ServiceError, SettingsError, ClientError, ...)

Exit codes are mapped in one table (`ckpt_service.service_errors.EXIT_CODES`), HTTP statuses in another
(`api/http_errors.py`).

`field` names the option or request field an error is about, as a path into the request (`options.overwrite`,
`target`): data, not words. Each interface renders it in its own (`ckpt_service.service_errors.worded`): the CLI says
`--overwrite`, REST keeps `options.overwrite` in the message and in its error body's `fields`.

`option` names the engine option an error is about by its option name (`memory_limit`), which is also the job
request's option name; the message writes that name once, as a word, and no interface's spelling of it; other
options a message suggests are named in backticks (`only`). The CLI shows their flags in their place
(`--memory-limit`, `said_as`), REST the request fields (`options.memory_limit`, also the error's field).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


_TOKEN = re.compile(r"[A-Za-z0-9_.:\-]{1,40}")
_NAMED = re.compile(r"`([a-z][a-z0-9_]*)`")  # an option named in a message, in backticks


def short(value: Any, limit: int = 60) -> str:
    """A value from a damaged file, described for an error line without quoting the file's bytes: numbers, short
    tokens (a dtype code) and short lists of numbers (a shape) as they are; other text, bytes and containers by
    their kind and length."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
        return text if len(text) <= limit else f"a {len(text)}-digit number"
    if isinstance(value, str):
        return repr(value) if _TOKEN.fullmatch(value) else f"a string of {len(value)} characters"
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    if isinstance(value, list | tuple) and len(value) <= 8 and all(
            isinstance(v, bool | int | float) or v is None for v in value):
        text = repr(list(value))
        if len(text) <= limit:
            return text
    if isinstance(value, list | tuple | dict | set | frozenset):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {getattr(value, 'qualname', type(value).__name__)}"


class CkptError(Exception):
    """Root of every error raised on purpose. `uri` and `key` name the file and the entry, `field` the request
    field (`options.overwrite`), `option` the engine option (`memory_limit`), where known."""

    def __init__(self, *args: Any, uri: str | None = None, key: str | None = None, field: str | None = None,
                 option: str | None = None) -> None:
        super().__init__(*args)
        self.uri, self.key, self.field, self.option = uri, key, field, option

    def said_as(self, word: Callable[[str], str | None]) -> str:
        """The message in an interface's words: its option, where that name first stands as a word, and each
        option named in backticks (`only`), as `word(name)` spells it; a name `word` does not know stays."""
        text, option = str(self), self.option
        subject = word(option) if option else None
        if option and subject:
            text = re.sub(rf"(?<![\w./`-]){re.escape(option)}(?![\w/`-])", lambda _: subject, text, count=1)
        return _NAMED.sub(lambda m: word(m.group(1)) or m.group(0), text)

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt without calling __init__, so subclasses with other constructors cross process boundaries too
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class SourceError(CkptError):
    """The input is missing or unreadable."""


class FormatError(SourceError):
    """The input is not a checkpoint of a known layout, or is damaged."""


class UnsafePickleError(FormatError):
    """A pickle asked for a class outside the allow-list; nothing was imported or run."""


class TargetError(CkptError):
    """The output cannot be written."""


class OptionError(CkptError):
    """A bad option or combination of options."""


class VerifyError(CkptError):
    """Two checkpoints differ; `report` is the comparison, where one was made."""

    def __init__(self, *args: Any, report: Any = None, uri: str | None = None, key: str | None = None) -> None:
        super().__init__(*args, uri=uri, key=key)
        self.report = report


@contextmanager
def reading(where: str) -> Iterator[None]:
    """A reader's boundary: any exception that is not a CkptError (nor an OSError, which the commands translate)
    becomes one FormatError naming `where`. The exception's own text is left out: it may quote the file's bytes."""
    try:
        yield
    except (CkptError, OSError):
        raise
    except RecursionError:
        raise FormatError(f"{where}: nested too deeply to read; the checkpoint is damaged or hostile",
                          uri=where) from None
    except MemoryError:
        raise FormatError(f"{where}: reading its metadata needs more memory than this process may use; the "
                          "checkpoint is damaged or hostile", uri=where) from None
    except Exception as exc:
        raise FormatError(f"{where}: cannot be read ({type(exc).__name__} in its metadata); the checkpoint is "
                          "damaged or not in a layout this tool reads", uri=where) from None
