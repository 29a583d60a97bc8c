"""Errors of the service layer (jobs, store, registry, storage roots, auth).

    ServiceError
    ├── InvalidRequest      a job spec or registry request the engine would refuse (HTTP 422); names the field
    ├── Unauthorized        no token, or an unknown one (HTTP 401)
    ├── Forbidden           the token's scope is too small (HTTP 403)
    │   └── OutsideRoots    a URI outside the configured storage roots (HTTP 403)
    ├── NotFound            no such job or checkpoint (HTTP 404)
    ├── Conflict            the request clashes with the current state (HTTP 409)
    ├── QueueFull           too many queued jobs (HTTP 429)
    ├── PayloadTooLarge     a request body over the limit (HTTP 413)
    └── StoreError          the job store is unreachable or damaged (HTTP 503)
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


class QueueFull(ServiceError):
    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PayloadTooLarge(ServiceError):
    pass


class StoreError(ServiceError):
    pass


class SchemaTooNew(StoreError):
    pass
