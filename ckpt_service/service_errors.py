"""Errors of the service layer (jobs, store, registry, storage roots, auth, settings, client).

One tree with the engine's, rooted at `converters.errors.CkptError` (every class is picklable with its
fields, since jobs cross process boundaries):

    CkptError
    ├── (engine) SourceError, TargetError, OptionError, VerifyError, ...
    ├── ServiceError
    │   ├── InvalidRequest      a job spec or registry request the engine would refuse (HTTP 422); names the field
    │   ├── Unauthorized        no token, or an unknown one (HTTP 401)
    │   ├── Forbidden           the token's scope is too small (HTTP 403)
    │   │   └── OutsideRoots    a URI outside the configured storage roots (HTTP 403)
    │   ├── NotFound            no such job or checkpoint (HTTP 404)
    │   ├── Conflict            the request clashes with the current state (HTTP 409)
    │   ├── TooMany             over a limit that frees up with time (HTTP 429, with Retry-After)
    │   │   ├── QueueFull       too many queued jobs
    │   │   └── TooManyStreams  too many open event streams, in total or for one token
    │   ├── PayloadTooLarge     a request body over the limit (HTTP 413)
    │   ├── StoreError          the job store is unreachable (HTTP 503)
    │   │   ├── StoreDamaged    its file fails the integrity check; the message says how to restore it
    │   │   └── SchemaTooNew    the database was written by a newer ckpt-service
    │   └── SettingsError       settings that cannot be used (one line per problem)
    ├── ClientError             `ckptctl` could not get an answer from a server (`status` 0) or was refused
    └── SampleJobError          a sample-checkpoint training job failed (`ckptctl sample`)

The API maps the tree to HTTP statuses in one table (`api/http_errors.py`); the CLI maps it to exit codes
in one table here (`EXIT_CODES`).
"""

from __future__ import annotations

from converters import CkptError


class ServiceError(CkptError):
    """Root of the service layer's errors. Messages are one line and never contain secrets."""


class InvalidRequest(ServiceError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message, field=field)


class Unauthorized(ServiceError):
    pass


class Forbidden(ServiceError):
    pass


class OutsideRoots(Forbidden):
    def __init__(self, message: str, field: str | None = None, uri: str | None = None) -> None:
        super().__init__(message, field=field, uri=uri)


class NotFound(ServiceError):
    pass


class Conflict(ServiceError):
    pass


class TooMany(ServiceError):
    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(TooMany):
    pass


class TooManyStreams(TooMany):
    pass


class PayloadTooLarge(ServiceError):
    pass


class StoreError(ServiceError):
    pass


class StoreDamaged(StoreError):
    pass


class SchemaTooNew(StoreError):
    pass


class SettingsError(ServiceError):
    """Settings that cannot be used; the message lists every problem, one per line."""


class ClientError(CkptError):
    """The server refused a request (`status` > 0) or could not be reached (`status` 0); `field` is the request
    field its error body names first."""

    def __init__(self, status: int, kind: str, message: str, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.status, self.kind, self.message = status, kind, message

    def __str__(self) -> str:
        return f"{self.message} (HTTP {self.status})" if self.status else self.message


class SampleJobError(CkptError):
    """A sample-checkpoint training job failed; the message holds each rank's error."""


#: exception class -> `ckptctl` exit code. The first match in order wins (subclasses first); 0 is success,
#: 1 "ran, and the answer is no" (checkpoints differ, a followed job did not succeed).
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (KeyboardInterrupt, 130),
    (CkptError, 2),  # VerifyError from --verify included: the output was removed, nothing was written
]
DIFFERENT = 1  #: `ckptctl verify` found differences; `--wait`/`--follow` saw a job end other than succeeded


def worded(message: str, field: str | None, name: str | None) -> str:
    """`message` with the request field it names (`options.overwrite`, written as REST says it) put in another
    interface's words (`--overwrite`); unchanged when there is no field or no other name for it."""
    return message.replace(field, name) if field and name else message


def exit_code(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return 1
