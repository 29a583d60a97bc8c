"""A real S3-compatible server for the object-storage tests: `python -m moto.server` on loopback.

`MotoServer` starts the server as a subprocess on a free port, waits (bounded) until it answers and stops
it; the `s3` fixture points the AWS environment (and so `ckptctl` subprocesses) at it, gives each test a
fresh bucket and clears the cached filesystem instances before and after the test.

Import the fixtures into a test module by their function names (the fixtures are named `s3_server`/`s3`):

    from .s3server import S3, s3_fixture, s3_server_fixture  # noqa: F401
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckpt_service.helpers import free_port

START_TIMEOUT = 30.0
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"




# moto 5 reads (and copies) a whole object for every ranged GET (`FakeKey.value`), so a request costs the
# object's size, not the range's, as it does on S3. With `ranged_reads`, the server keeps each object's bytes
# once read (dropped when the object is rewritten) and a ranged GET costs its range: benchmarks that compare
# ranged readers with whole-object ones need it; tests do not.
_RANGED_READS = """
from moto.s3.models import FakeKey
plain = FakeKey.value
def get(self):
    if self.__dict__.get("_bytes") is None:
        self.__dict__["_bytes"] = plain.fget(self)
    return self.__dict__["_bytes"]
def put(self, value):
    self.__dict__["_bytes"] = None
    plain.fset(self, value)
FakeKey.value = property(get, put)
"""

# moto 5's `complete_multipart_upload` copies the whole object five times in Python (into a bytearray, to
# bytes, into the checksum builder's bytearray, to bytes again, then into the key's file), serially, after
# the last part: 3.4 s of the server's one core for a 400 MB object, 1.9 s for four of 100 MB (superlinear),
# where S3 completes in time proportional to the number of parts. With `s3_complete` (which implies
# `ranged_reads`), completion copies nothing: it validates the parts and computes the ETag and the checksum
# as moto does (a whole-object CRC combined from the parts' own, computed as each part arrives, as S3 does),
# and the key keeps the parts as received, joined once when the object is first read. For benchmarks, which
# time uploads, not the server's bookkeeping.
_S3_COMPLETE = """
import zlib as _zlib
from converters.checksum import crc32_combine as _crc32_combine
from moto.s3 import models as _m
from moto.s3 import utils as _u
from moto.utilities.utils import md5_hash as _md5
class Parts:
    def __init__(self, values):
        self.values = values
    def __len__(self):
        return sum(len(v) for v in self.values)
def get_joined(self, ranged_get=FakeKey.value.fget):
    if isinstance(self.__dict__.get("_bytes"), Parts):
        self.__dict__["_bytes"] = b"".join(self.__dict__["_bytes"].values)
    return ranged_get(self)
def put_joined(self, value, plain_put=FakeKey.value.fset):
    if isinstance(value, Parts):  # a completed multipart upload: its parts, as they are
        self.__dict__["_bytes"] = value
        self.contentsize = len(value)
        return
    plain_put(self, value)
FakeKey.value = property(get_joined, put_joined)
def set_part(self, part_id, value, plain_set_part=_m.FakeMultipart.set_part):
    part = plain_set_part(self, part_id, value)
    if isinstance(value, bytes):  # the bytes received are the part's value: completion takes them as they are
        part.__dict__["_bytes"] = value
        part.__dict__["_crc32"] = _zlib.crc32(value)  # as S3 keeps each part's checksum
    return part
_m.FakeMultipart.set_part = set_part
def full_checksum(parts, algorithm):
    if algorithm == "CRC32" or (algorithm == "CRC64NVME" and not _u.HAS_CRT):  # moto's CRC32 fallback
        crc = 0  # the parts' CRCs combined, as S3 does
        for part in parts:
            value = part.value
            own = part.__dict__.get("_crc32")
            if own is None:
                crc = _zlib.crc32(value, crc)
            else:
                crc = _crc32_combine(crc, own, len(value))
        return _u.base64.b64encode(crc.to_bytes(4, "big"))
    return _u.compute_checksum(b"".join(part.value for part in parts), algorithm)
def complete(self, body):
    parts = []
    for number, etag in body:
        part = self.parts.get(number)
        if part is None or part.etag.replace('"', "") != etag.replace('"', ""):
            raise _m.InvalidPart()
        if parts and parts[-1].contentsize < _m.S3_UPLOAD_PART_MIN_SIZE:
            raise _m.EntityTooSmall()
        parts.append(part)
    if not parts:
        raise _m.MalformedXML
    values = [part.value for part in parts]
    builder = _m.MultipartChecksumBuilder(self.metadata.get("x-amz-checksum-algorithm"),
                                          self.metadata.get("x-amz-checksum-type"))
    if builder.checksum_type == "COMPOSITE":
        for value in values:
            builder.addPart(value)
        checksum = builder.build()
    else:
        checksum = (builder.checksum_type, full_checksum(parts, builder.checksum_algorithm).decode(), 1)
    etag = _md5()
    etag.update(b"".join(bytes.fromhex(part.etag.replace('"', "")) for part in parts))
    return Parts(values), f"{etag.hexdigest()}-{len(parts)}", checksum
_m.FakeMultipart.complete = complete
"""


class MotoServer:
    """`python -m moto.server -H 127.0.0.1 -p PORT` as a subprocess; `extra_env` goes into its environment;
    `ranged_reads`: ranged GETs cost their range (see _RANGED_READS); `s3_complete`: completing a multipart
    upload copies nothing, as on S3 (see _S3_COMPLETE)."""

    def __init__(self, extra_env: dict[str, str] | None = None, log_dir: str | None = None,
                 ranged_reads: bool = False, s3_complete: bool = False) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.extra_env = extra_env or {}
        self.patches = (_RANGED_READS if ranged_reads or s3_complete else "") + (
            _S3_COMPLETE if s3_complete else "")
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"moto-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_TIMEOUT) -> MotoServer:
        env = {**os.environ, **self.extra_env}
        serve = ["-H", "127.0.0.1", "-p", str(self.port)]
        command = [sys.executable, "-m", "moto.server", *serve]
        if self.patches:
            command = [sys.executable, "-c", f"{self.patches}\nfrom moto.server import main\nmain({serve!r})"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                # the dashboard is not an AWS action: it does not count towards INITIAL_NO_AUTH_ACTION_COUNT
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.endpoint} within {timeout:.0f}s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def aws_env(endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
    """The environment that points boto3/s3fs (and `ckptctl`) at `endpoint`, ignoring any user AWS config."""
    return {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": endpoint, "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


AWS_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")


def clear_fs_caches() -> None:
    """Forget cached filesystem instances (they hold clients built from the environment of their time)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from converters import remote

    remote._fs.cache_clear()
    for cls in (fsspec.AbstractFileSystem, *_s3fs_classes()):
        cls.clear_instance_cache()
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


def _s3fs_classes() -> list[Any]:
    try:
        import s3fs
    except ImportError:
        return []
    return [s3fs.S3FileSystem]


@dataclass
class S3:
    """A fresh bucket on the session's server, with boto3 helpers to put and look at objects."""

    endpoint: str
    bucket: str
    client: Any

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def upload(self, folder: Path, prefix: str) -> str:
        """Upload every file of `folder` (hidden ones too) under `prefix`; returns the prefix's URI."""
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                self.client.upload_file(str(path), self.bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
        return self.uri(prefix)

    def keys(self, prefix: str) -> list[str]:
        """Names under `prefix/` (relative to it), sorted."""
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{prefix}/"):
            out += [obj["Key"][len(prefix) + 1:] for obj in page.get("Contents", [])]
        return sorted(out)

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def files(self, prefix: str) -> dict[str, bytes]:
        return {name: self.get(f"{prefix}/{name}") for name in self.keys(prefix)}


def boto3_client(endpoint: str, service: str = "s3", access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY,
                 attempts: int = 3) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(service, endpoint_url=endpoint, region_name=REGION, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key,
                        config=Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=5,
                                      read_timeout=30))


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server for the whole session (no authentication: any credentials work)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    server = MotoServer(log_dir=str(tmp_path_factory.mktemp("moto"))).start()
    try:
        yield server
    finally:
        server.stop()


def point_at(endpoint: str, monkeypatch: pytest.MonkeyPatch, prefix: str) -> tuple[Any, str]:
    """Set the AWS environment to `endpoint` (this process and `ckptctl` subprocesses), drop cached
    filesystems, and create a fresh bucket named `prefix-<random>`: (boto3 client, bucket)."""
    for name in AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_env(endpoint).items():
        monkeypatch.setenv(name, value)
    clear_fs_caches()
    client = boto3_client(endpoint)
    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


@pytest.fixture(name="s3")
def s3_fixture(s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """AWS environment pointing at the session's server, and a fresh bucket."""
    client, bucket = point_at(s3_server.endpoint, monkeypatch, "ckpt")
    try:
        yield S3(s3_server.endpoint, bucket, client)
    finally:
        clear_fs_caches()
