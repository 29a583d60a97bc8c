"""Errors of the service layer (jobs, store, registry, storage roots, auth).

    ServiceError
    ├── InvalidRequest      a job spec or registry request the engine would refuse (HTTP 422); names the field
    ├── Unauthorized        no token, or an unknown one (HTTP 401)
    ├── Forbidden           the token's scope is too small (HTTP 403)
    │   └── OutsideRoots    a URI outside the configured storage roots (HTTP 403)
    ├── NotFound            no such job or checkpoint (HTTP 404)
    ├── Conflict            the request clashes with the current state (HTTP 409)
    ├── TooMany             over a limit that frees up with time (HTTP 429, with Retry-After)
    │   ├── QueueFull       too many queued jobs
    │   └── TooManyStreams  too many open event streams, in total or for one token
    ├── PayloadTooLarge     a request body over the limit (HTTP 413)
    └── StoreError          the job store is unreachable (HTTP 503)
        ├── StoreDamaged    its file fails the integrity check; the message says how to restore it
        └── SchemaTooNew    the database was written by a newer ckpt-service

Engine errors (`converters.errors.CkptError`) pass through unchanged; the API maps both trees to
statuses in one table (`api/errors.py`).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Root of the service layer's errors. Messages are one line and never contain secrets."""


class InvalidRequest(ServiceError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Unauthorized(ServiceError):
    pass


class Forbidden(ServiceError):
    pass


class OutsideRoots(Forbidden):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


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
