"""Remote storage through fsspec: the filesystem for a URI, and its errors in plain words.

Errors are told apart by exception type: `FileNotFoundError` / `PermissionError` (fsspec's and s3fs's own
translation of S3 error codes), botocore's `ClientError` error code (s3fs keeps it as the translated error's
`__cause__`), botocore's connection and credential error classes, and Python's `ConnectionError`. Text is
matched in one place only, `_said_in_text`, for errors that arrive as a bare `OSError` whose chain carries no
typed cause (some fsspec backends re-raise a connection failure or a missing bucket that way).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from .errors import CkptError, SourceError, TargetError

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs (pip install gcsfs)", "gcs": "gcs (pip install gcsfs)",
           "az": "azure (pip install adlfs)", "abfs": "azure (pip install adlfs)"}
#: botocore `ClientError` codes (S3 error responses) by what they mean here
_NO_BUCKET = frozenset({"NoSuchBucket"})
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                        "ServiceUnavailable", "503"})


@lru_cache(maxsize=64)
def _fs(protocol: str) -> Any:
    import fsspec

    try:
        try:  # listings must be fresh: another process may finish an upload while this one runs
            return fsspec.filesystem(protocol, use_listings_cache=False)
        except TypeError:
            return fsspec.filesystem(protocol)
    except ImportError:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'ckpt-service[{extra}]'" if extra == "s3" else (f"install {extra}" if extra else
                                                                             "install its fsspec package")
        raise SourceError(f"{protocol}:// URIs need an extra package: {hint}") from None
    except ValueError:
        raise SourceError(f"{protocol}:// is not a storage protocol fsspec knows") from None


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) for a remote URI."""
    protocol = uri.split("://", 1)[0]
    return _fs(protocol), uri


def remote_call(uri: str, method: str, **kwargs: Any) -> Any:
    """`fs.<method>(uri)` on the URI's filesystem, with storage errors in plain words."""
    fs, path = filesystem(uri)
    with translate_errors(uri):
        return getattr(fs, method)(path, **kwargs)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, as a traceback shows them (each once)."""
    seen: set[int] = set()
    item: BaseException | None = exc
    while item is not None and id(item) not in seen:
        seen.add(id(item))
        yield item
        item = item.__cause__ or (None if item.__suppress_context__ else item.__context__)


def _client_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore `ClientError` in `exc`'s chain (its `response["Error"]["Code"]`)."""
    for item in _chain(exc):
        response = getattr(item, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            code = response["Error"].get("Code")
            return None if code is None else str(code)
    return None


def _botocore_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(connection failures, missing credentials) as botocore's classes; empty when botocore is absent."""
    try:
        from botocore import exceptions as b
    except ImportError:
        return (), ()
    return ((b.ConnectionError, b.ConnectionClosedError),
            (b.NoCredentialsError, b.PartialCredentialsError, b.CredentialRetrievalError))


def _aiohttp_types() -> tuple[type[BaseException], ...]:
    try:
        from aiohttp import ClientConnectionError
    except ImportError:
        return ()
    return (ClientConnectionError,)


def _said_in_text(exc: BaseException, *words: str) -> bool:
    """The one text match: for a bare OSError whose chain holds no typed cause, its message is all there is."""
    text = f"{type(exc).__name__}: {exc}"
    return any(word in text for word in words)


def _meaning(exc: BaseException) -> str | None:
    """What a storage exception means: 'no-bucket', 'missing', 'denied', 'unreachable', 'throttled',
    'credentials', 'other' (another OSError), or None (not a storage error: let it through)."""
    connect, credentials = _botocore_types()
    chain = list(_chain(exc))
    code = _client_code(exc)
    if any(isinstance(e, credentials) for e in chain):
        return "credentials"
    if any(isinstance(e, connect + _aiohttp_types() + (ConnectionError,)) for e in chain):
        return "unreachable"
    if code in _NO_BUCKET:
        return "no-bucket"
    if code in _THROTTLED:
        return "throttled"
    if isinstance(exc, FileNotFoundError):
        if code is None and _said_in_text(exc, "NoSuchBucket", "bucket", "Bucket"):
            return "no-bucket"
        return "missing"
    if isinstance(exc, PermissionError):
        return "denied"
    if isinstance(exc, OSError):
        if code is None and _said_in_text(exc, "Could not connect", "EndpointConnectionError"):
            return "unreachable"
        if code is None and _said_in_text(exc, "SlowDown", "Throttl", "503"):
            return "throttled"
        return "other"
    return None


@contextmanager
def translate_errors(uri: str, writing: bool = False) -> Iterator[None]:
    """Turn storage exceptions into one-line errors that say what failed, in plain words."""
    kind = TargetError if writing else SourceError
    try:
        yield
    except CkptError:
        raise
    except Exception as exc:
        meaning = _meaning(exc)
        if meaning is None:
            raise
        raise kind(f"{uri}: {_say(meaning, exc)}") from None


def _say(meaning: str, exc: BaseException) -> str:
    if meaning == "no-bucket":
        return "no such bucket; create it or fix the URI"
    if meaning == "missing":
        return "no such file or prefix"
    if meaning == "denied":
        return "access denied; check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) and the bucket policy"
    if meaning == "credentials":
        return "no credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
    if meaning == "unreachable":
        return f"storage endpoint unreachable ({_endpoint(exc)}); check AWS_ENDPOINT_URL or the network"
    if meaning == "throttled":
        return "the storage service kept throttling requests; retry later"
    return f"storage error ({type(exc).__name__}: {exc})"


def _endpoint(exc: BaseException) -> str:
    """The endpoint a connection failure names (botocore's errors carry it as `endpoint_url`; aiohttp's as
    `host` and `port`)."""
    for item in _chain(exc):
        details = getattr(item, "kwargs", None)  # botocore's format arguments
        url = details.get("endpoint_url") if isinstance(details, dict) else None
        if isinstance(url, str) and url:
            return url
        host, port = getattr(item, "host", None), getattr(item, "port", None)
        if isinstance(host, str) and host:
            return f"{host}:{port}" if port else host
    return "the endpoint the AWS settings name"
