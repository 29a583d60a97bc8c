"""Storage's modules: the range reader's pools run under the caller's engine config (so its read roots confine
reads made in them), remote errors are told apart by exception type, and the one completeness check."""

from __future__ import annotations

import errno
import uuid
from collections.abc import Iterator

import fsspec
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from converters import storage
from converters.config import EngineConfig, current, use
from converters.errors import SourceError, TargetError
from converters.names import MANIFEST, WRITING
from converters.rangeread import RangeReader
from converters.remote import translate_errors
from converters.targets import check_complete, is_incomplete


@pytest.fixture
def memory() -> Iterator[str]:
    """A fresh folder on fsspec's in-memory filesystem (a remote URI: reads go through the remote path)."""
    root = f"memory://t-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{root}/allowed/a.bin", b"0123456789")
    fs.pipe_file(f"{root}/other/b.bin", b"abcdefghij")
    yield root
    fs.rm(root, recursive=True)


def test_reader_pools_run_under_the_callers_config(memory: str) -> None:
    config = EngineConfig(read_roots=(f"{memory}/allowed",))
    with RangeReader() as reader, use(config):
        assert reader.map(lambda _: current(), [1, 2, 3]) == [config, config, config]
    with RangeReader() as reader:
        assert reader.map(lambda _: current(), [1, 2]) == [EngineConfig(), EngineConfig()]


def test_confined_reads_in_the_reader_pools_are_refused(memory: str) -> None:
    allowed, other = f"{memory}/allowed/a.bin", f"{memory}/other/b.bin"
    with RangeReader() as reader, use(EngineConfig(read_roots=(f"{memory}/allowed",))):
        assert reader.map(lambda uri: reader.read(uri, 2, 3), [allowed, allowed]) == [b"234", b"234"]
        with pytest.raises(SourceError) as err:
            reader.map(lambda uri: reader.read(uri, 0, 4), [allowed, other])
        assert str(err.value) == (f"{other}: resolves outside the storage roots this process may read; "
                                  "refusing to read it")
        with pytest.raises(SourceError, match="outside the storage roots"):  # each range checked in a fetch thread
            reader.prefetch(other, [(0, 4), (4, 4)], 0, 2)
        assert reader.requests == 1  # the block of a.bin, once; nothing of b.bin was fetched


def _client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "server text"}}, "GetObject")


def _translated(exc: BaseException, writing: bool = False) -> str:
    with pytest.raises(TargetError if writing else SourceError) as err, translate_errors("s3://b/k", writing):
        raise exc
    return str(err.value)


def _caused(exc: OSError, cause: BaseException) -> OSError:
    exc.__cause__ = cause  # as s3fs's translate_boto_error keeps the ClientError
    return exc


@pytest.mark.parametrize(("exc", "said"), [
    (_caused(FileNotFoundError("The specified bucket does not exist"), _client_error("NoSuchBucket")),
     "s3://b/k: no such bucket; create it or fix the URI"),
    (_caused(FileNotFoundError("The specified key does not exist"), _client_error("NoSuchKey")),
     "s3://b/k: no such file or prefix"),
    (FileNotFoundError("s3://b/k"), "s3://b/k: no such file or prefix"),
    (_caused(PermissionError("Access Denied"), _client_error("AccessDenied")),
     "s3://b/k: access denied; check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) and the bucket policy"),
    (_caused(OSError(errno.EBUSY, "Please reduce your request rate"), _client_error("SlowDown")),
     "s3://b/k: the storage service kept throttling requests; retry later"),
    (NoCredentialsError(), "s3://b/k: no credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"),
    (_caused(OSError(errno.EIO, "weird"), _client_error("InternalError")),
     "s3://b/k: storage error (OSError: [Errno 5] weird)"),
])
def test_remote_errors_by_type(exc: BaseException, said: str) -> None:
    assert _translated(exc) == said


def test_unreachable_endpoint_by_type() -> None:
    said = "s3://b/k: storage endpoint unreachable ({}); check AWS_ENDPOINT_URL or the network"
    assert _translated(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), writing=True) == \
        said.format("http://127.0.0.1:9")
    assert _translated(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) == \
        said.format("the endpoint the AWS settings name")
    with pytest.raises(ValueError), translate_errors("s3://b/k"):  # not a storage error: not translated
        raise ValueError("a bug")


def test_one_completeness_check(memory: str) -> None:
    fs = fsspec.filesystem("memory")
    out = f"{memory}/out"
    fs.pipe_file(f"{out}/{WRITING}", b"{}")
    fs.pipe_file(f"{out}/model.safetensors", b"12345")
    assert is_incomplete(out) and storage.is_incomplete(out)
    with pytest.raises(SourceError) as err:
        check_complete(out)
    assert str(err.value) == (f"{out}: incomplete output (an upload started but never finished: no "
                              "ckpt-manifest.json); re-run the job that writes it")
    fs.pipe_file(f"{out}/{MANIFEST}", b'{"files": {"model.safetensors": {"bytes": 5, "crc32": 0}}}')
    assert not is_incomplete(out)
    check_complete(out)
    fs.pipe_file(f"{out}/{MANIFEST}", b'{"files": {"model.safetensors": {"bytes": 6, "crc32": 0}}}')
    with pytest.raises(SourceError) as err:
        check_complete(out)
    assert str(err.value) == (f"{out}/model.safetensors: missing or not the size ckpt-manifest.json records; the "
                              "output is damaged, re-run the job that wrote it")
    assert storage.check_target(out, overwrite=True)
    with pytest.raises(TargetError) as refused:
        storage.check_target(out, overwrite=False)
    assert str(refused.value) == f"{out}: already exists; pass --overwrite to replace it, or choose another target"
