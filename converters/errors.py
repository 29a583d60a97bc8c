"""One exception tree for the engine and the service. Every message names the file or key and says what to do.

    CkptError                (fields: `uri`, `key` where known; picklable with them)
    ├── SourceError          the input is missing, unreadable or not what it claims to be
    │   ├── FormatError      no known layout, or the layout is damaged (bad metadata, truncated data)
    │   └── UnsafePickleError a pickle references a class outside the allow-list
    ├── TargetError          the output cannot be written (exists, disk full, bad name)
    ├── OptionError          a bad option or combination of options
    ├── VerifyError          a verification found differences (`report` holds them when known)
    └── ckpt_service.errors  the service's errors (ServiceError, SettingsError, ClientError, ...)

Exit codes are mapped in one table (`ckpt_service.errors.EXIT_CODES`), HTTP statuses in another
(`api/errors.py`).
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class CkptError(Exception):
    """Root of every error raised on purpose. `uri` and `key` name the file and the entry, where known."""

    def __init__(self, *args: Any, uri: str | None = None, key: str | None = None) -> None:
        super().__init__(*args)
        self.uri, self.key = uri, key

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
