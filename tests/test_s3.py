"""Object storage (issue 5) against a real S3-compatible server (moto's server mode) on loopback.


A real FSDP2 DCP checkpoint goes into a bucket; export, reshard and verify run S3 -> S3, S3 -> local and
local -> S3 and must produce the bytes of the local conversion; bytes fetched are measured with the engine's
RangeReader counters; an upload killed half way leaves a prefix that readers refuse, and a re-run repairs it;
storage failures give one plain line and exit code 2; `memory://` works as source and target.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError
from safetensors.torch import load as load_safetensors

from converters import ConvertOptions, ReshardOptions, convert, reshard, storage
from converters import verify as verify_api
from converters.errors import SourceError
from converters.formats import load_index
from converters.transforms import KeyOptions

from .conftest import Sample, Samples, assert_same_tensors, ckptctl
from .s3server import (  # noqa: F401  (fixtures s3 and s3_server)
    AWS_UNSET,
    S3,
    MotoServer,
    aws_env,
    boto3_client,
    clear_fs_caches,
    free_port,
    point_at,
    s3_fixture,
    s3_server_fixture,
)

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop

MANIFEST = "ckpt-manifest.json"
MARKER = ".ckpt-writing"
WAIT = 60.0  # bound on every wait for a subprocess to reach a state


# --- helpers --------------------------------------------------------------------------------------


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_output(got: dict[str, bytes], want: dict[str, bytes], label: str = "") -> None:
    """Same file names and bytes; the manifests agree on every file's size (timestamps and checksums aside),
    and every checksum a manifest records is the CRC-32 of that file."""
    assert sorted(got) == sorted(want), label
    for name in want:
        if name != MANIFEST:
            assert got[name] == want[name], f"{label}: {name} differs from the local conversion"
    assert MARKER not in got
    assert manifest_sizes(got) == manifest_sizes(want)


def manifest_sizes(files: dict[str, bytes]) -> dict[str, int]:
    """The sizes `ckpt-manifest.json` records, each checked against the file (and its CRC-32 when recorded)."""
    recorded = json.loads(files[MANIFEST])["files"]
    for name, info in recorded.items():
        assert info["bytes"] == len(files[name]), name
        if "crc32" in info:
            assert info["crc32"] == zlib.crc32(files[name]), name
    return {name: info["bytes"] for name, info in recorded.items()}


def safetensors_tensors(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            out.update(load_safetensors(data))
    return out


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """The command failed with exit code 2 and one stderr line holding `words`."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def stop_when(check: Callable[[], bool], proc: subprocess.Popen[str], what: str, timeout: float = WAIT) -> None:
    """Leave `proc` stopped (SIGSTOP) once `check()` holds; `check` runs only while it is stopped, so however
    long a check takes, the process cannot run past the moment looked for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)
        if check():
            return
        proc.send_signal(signal.SIGCONT)
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"ckptctl ended ({proc.returncode}) before {what}: {stderr}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextmanager
def running_ckptctl(*args: str) -> Iterator[subprocess.Popen[str]]:
    """`ckptctl ARGS` in the background; killed (and reaped) on the way out if it is still running."""
    # Ctrl-C as a terminal delivers it: the child must not inherit an ignored SIGINT from this process (an
    # earlier test's framework may have left it ignored, and a Python started so never raises KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT)


class CountingReader(storage.RangeReader):
    """The engine's RangeReader, also remembering the largest single remote request."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def _fetch(self, uri: str, start: int, end: int) -> bytes:
        data = super()._fetch(uri, start, end)
        self.largest = max(self.largest, len(data))
        return data


def pin_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP outputs hold random ids (save_id, zip serialization_id), as torch's do: pin them so that two runs
    can be compared byte for byte."""
    import converters.writers.dcp
    import converters.zipwriter

    fixed = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=0x5EED))
    monkeypatch.setattr(converters.writers.dcp, "uuid", fixed)
    monkeypatch.setattr(converters.zipwriter, "uuid", fixed)


@pytest.fixture(scope="module")
def dcp(fsdp2: dict[str, Sample]) -> Sample:
    return fsdp2["fsdp2-dcp"]


@pytest.fixture(scope="module")
def big(samples: Samples) -> Path:
    """A 50MB model-only FSDP2 DCP checkpoint (world size 2) made by `ckptctl sample`."""
    path = samples.root / "s3-50MB"
    if not path.exists():
        ckptctl("sample", path, "--world-size", "2", "--size", "50MB", "--model-only")
    return path


EXPORT_ARGS = ("--dtype", "bfloat16", "--max-shard-size", "100KB", "--quiet")


@pytest.fixture(scope="module")
def local_export(dcp: Sample, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("local-export") / "export"
    ckptctl("export", dcp.path, out, *EXPORT_ARGS)
    return local_files(out)


# --- export / reshard / verify: every route gives the local bytes ----------------------------------------


@pytest.mark.parametrize("route", ["s3-s3", "s3-local", "local-s3"])
def test_export_over_s3_equals_local_export(route: str, s3: S3, dcp: Sample, local_export: dict[str, bytes],
                                           tmp_path: Path) -> None:
    src = s3.upload(dcp.path, "run/step_1") if route.startswith("s3") else str(dcp.path)
    target = s3.uri("exports/step_1") if route.endswith("s3") else str(tmp_path / "export")
    proc = ckptctl("export", src, target, *EXPORT_ARGS)
    assert "wrote" in proc.stdout
    got = s3.files("exports/step_1") if route.endswith("s3") else local_files(Path(target))
    assert len([n for n in got if n.endswith(".safetensors")]) > 1  # sharded: several uploads and an index
    assert_same_output(got, local_export)
    want = {k: v.to(torch.bfloat16) for k, v in dcp.ref()["model"].items()}
    assert_same_tensors(safetensors_tensors(got), want)
    if route == "s3-s3":  # verify with both sides on S3: a cast export differs exactly, matches within atol
        assert not verify_api(src, target, keys=KeyOptions(only="model", nest=False)).ok
        proc = ckptctl("verify", src, target, "--only", "model", "--atol", "0.01")
        assert proc.stdout.startswith("OK")


def test_reshard_over_s3_equals_local_reshard(s3: S3, dcp: Sample, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pin_ids(monkeypatch)
    src = s3.upload(dcp.path, "run/step_1")
    options = ReshardOptions(world_size=3, keys=KeyOptions(only="all"))
    reshard(str(dcp.path), str(tmp_path / "local"), options)
    want = local_files(tmp_path / "local")
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", MANIFEST} == set(want)
    routes = {"s3-s3": (src, s3.uri("ws3")), "s3-local": (src, str(tmp_path / "from-s3")),
              "local-s3": (str(dcp.path), s3.uri("ws3-from-local"))}
    for route, (source, target) in routes.items():
        result = reshard(source, target, options)
        assert result.world_size == 3
        got = s3.files(target.split("/", 3)[3]) if target.startswith("s3://") else local_files(Path(target))
        assert_same_output(got, want, route)
    # verify with both sides on S3, through the command
    proc = ckptctl("verify", src, s3.uri("ws3"), "--only", "all")
    assert proc.stdout.startswith("OK identical")
    # the resharded tensors, read back from S3, are the unsharded model's and optimizer's
    full = tmp_path / "full.pt"
    convert(s3.uri("ws3"), str(full), ConvertOptions(to="torch", keys=KeyOptions(only="all", clean=True)))
    got, ref = torch.load(full, weights_only=True), dcp.ref()
    assert_same_tensors(got["model"], ref["model"])
    for fqn, state in ref["optim"]["state"].items():
        assert_same_tensors(got["optim"]["state"][fqn], state)


def test_verify_s3_checkpoint_against_local_reference(s3: S3, dcp: Sample) -> None:
    src = s3.upload(dcp.path, "run/step_1")
    report = verify_api(src, str(dcp.path))
    assert report.ok, report.summary()
    proc = ckptctl("verify", src, dcp.reference, "--only", "model")
    assert proc.stdout.startswith("OK identical")


def test_manifest_matches_local_output(s3: S3, dcp: Sample, tmp_path: Path) -> None:
    """Same files and sizes; uploads also carry each file's CRC-32 (computed as the bytes stream through).

    Local outputs are written in the kernel or at offsets by several threads; their CRC-32s (the certificate's)
    are read back through the page cache after the write: the same values."""
    convert(str(dcp.path), str(tmp_path / "export"))
    convert(str(dcp.path), s3.uri("export"))
    local = json.loads((tmp_path / "export" / MANIFEST).read_bytes())
    remote = json.loads(s3.get(f"export/{MANIFEST}"))
    assert {n: f["bytes"] for n, f in local["files"].items()} == {n: f["bytes"] for n, f in remote["files"].items()}
    for name, info in remote["files"].items():
        assert info["crc32"] == zlib.crc32((tmp_path / "export" / name).read_bytes()) == local["files"][name]["crc32"]


# --- bytes fetched vs bytes needed ---------------------------------------------------------------------


def fetch_counts(source: str, target: str) -> dict[str, Any]:
    reader = CountingReader()
    convert(source, target, ConvertOptions(), reader=reader)
    ratio = reader.fetched / reader.requested
    print(f"\n{source}: fetched {reader.fetched} bytes in {reader.requests} requests for {reader.requested} "
          f"needed (ratio {ratio:.2f}); largest request {reader.largest}")
    return {"fetched": reader.fetched, "requested": reader.requested, "requests": reader.requests,
            "largest": reader.largest, "ratio": ratio}


def test_bytes_fetched_tiny_checkpoint(s3: S3, dcp: Sample, tmp_path: Path,
                                       record_property: Callable[[str, object], None]) -> None:
    src = s3.upload(dcp.path, "run/step_1")
    counts = fetch_counts(src, str(tmp_path / "export"))
    record_property("fetched_over_needed", round(counts["ratio"], 3))
    data_bytes = sum(p.stat().st_size for p in dcp.path.glob("*.distcp"))
    # records far below MIN_REQUEST: the block cache turns ~1400 small reads into one request per MiB block
    assert counts["fetched"] <= data_bytes
    assert counts["requests"] <= sum(-(-p.stat().st_size // storage.MIN_REQUEST) for p in dcp.path.glob("*.distcp"))


@pytest.fixture(scope="module")
def big_counts(big: Path, s3_server: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Counters of one S3 -> local export of the 50MB checkpoint (its own bucket, environment set by hand)."""
    with pytest.MonkeyPatch.context() as mp:
        client, bucket = point_at(s3_server.endpoint, mp, "big")
        for path in sorted(big.iterdir()):
            client.upload_file(str(path), bucket, f"big/{path.name}")
        counts = fetch_counts(f"s3://{bucket}/big", str(tmp_path_factory.mktemp("big") / "export"))
        clear_fs_caches()
    counts["data_file_sizes"] = {p.name: p.stat().st_size for p in big.glob("*.distcp")}
    return counts


def test_bytes_fetched_large_records_bounded(big_counts: dict[str, Any],
                                             record_property: Callable[[str, object], None]) -> None:
    record_property("fetched_over_needed", round(big_counts["ratio"], 3))
    # ranged reads: no request pulls a whole data file (25MB each), and the total stays within a bound
    assert big_counts["largest"] < min(big_counts["data_file_sizes"].values())
    assert big_counts["ratio"] < 4.0


@pytest.fixture(scope="module")
def large_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint whose every record is ~8 MiB (torch.distributed.checkpoint.save in one process)."""
    import torch.distributed.checkpoint as dist_cp

    path = tmp_path_factory.mktemp("large-records") / "dcp"
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(2048, 1024 + i, generator=generator) for i in range(6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dist_cp.save(state, checkpoint_id=str(path))
    return path


def test_bytes_fetched_records_much_larger_than_min_request(s3: S3, large_records: Path, tmp_path: Path,
                                                            record_property: Callable[[str, object], None]) -> None:
    src = s3.upload(large_records, "run/large")
    counts = fetch_counts(src, str(tmp_path / "export"))
    record_property("fetched_over_needed", round(counts["ratio"], 3))
    assert counts["ratio"] < 1.5
    assert counts["largest"] < (large_records / "__0_0.distcp").stat().st_size


def test_bytes_fetched_large_records_near_needed(big_counts: dict[str, Any]) -> None:
    assert big_counts["ratio"] < 1.5


# --- interrupted, cancelled and repeated uploads ---------------------------------------------------------


def test_killed_upload_is_incomplete_and_rerun_repairs_it(s3: S3, big: Path) -> None:
    target = s3.uri("exports/step_2000")
    args = ("export", str(big), target, "--max-shard-size", "4MB", "--quiet")

    def marker_and_a_shard() -> bool:
        keys = s3.keys("exports/step_2000")
        return MARKER in keys and any(k.endswith(".safetensors") for k in keys)

    with running_ckptctl(*args) as proc:
        stop_when(marker_and_a_shard, proc, "the marker and a first uploaded shard")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=WAIT) == -signal.SIGKILL
    keys = s3.keys("exports/step_2000")
    assert MARKER in keys and MANIFEST not in keys
    assert any(k.endswith(".safetensors") for k in keys)
    assert storage.is_incomplete(target)
    # readers refuse the prefix and say why
    one_line_error(ckptctl("inspect", target, check=False), "incomplete output")
    with pytest.raises(SourceError, match="incomplete output"):
        verify_api(target, str(big))
    # the next attempt produces a good output
    ckptctl(*args, "--overwrite")
    files = s3.files("exports/step_2000")
    assert MARKER not in files and MANIFEST in files
    manifest = json.loads(files[MANIFEST])["files"]
    assert sorted(manifest) == sorted(n for n in files if n != MANIFEST)
    for name, info in manifest.items():
        assert info["bytes"] == len(files[name]) and info["crc32"] == zlib.crc32(files[name]), name
    clear_fs_caches()  # this process listed the prefix while it was incomplete (see test_listing_is_fresh...)
    report = verify_api(target, str(big), keys=KeyOptions(only="model"))
    assert report.ok, report.summary()


def test_rerun_without_overwrite_replaces_incomplete_prefix(s3: S3, dcp: Sample) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key=f"exports/step_1/{MARKER}", Body=b'{"started": 0}')
    s3.client.put_object(Bucket=s3.bucket, Key="exports/step_1/model-00001-of-00002.safetensors", Body=b"partial")
    assert storage.is_incomplete(s3.uri("exports/step_1"))
    proc = ckptctl("export", dcp.path, s3.uri("exports/step_1"), "--quiet", check=False)
    assert proc.returncode == 0, proc.stderr


def test_listing_is_fresh_after_another_process_finishes(s3: S3, dcp: Sample) -> None:
    s3.upload(dcp.path, "run/step_1")
    s3.client.put_object(Bucket=s3.bucket, Key=f"run/step_1/{MARKER}", Body=b'{"started": 0}')
    with pytest.raises(SourceError, match="incomplete output"):
        load_index(s3.uri("run/step_1"))
    # another process (a worker) finishes the upload: manifest last, marker removed
    files = {p.name: {"bytes": p.stat().st_size} for p in dcp.path.iterdir()}
    s3.client.put_object(Bucket=s3.bucket, Key=f"run/step_1/{MANIFEST}", Body=json.dumps({"files": files}).encode())
    s3.client.delete_object(Bucket=s3.bucket, Key=f"run/step_1/{MARKER}")
    assert load_index(s3.uri("run/step_1")).tensors


def test_cancelled_upload_removes_what_it_uploaded(s3: S3, big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the (single, multipart) output is being uploaded: exit 130 and an empty prefix."""
    target = s3.uri("exports/cancelled")
    # one part in flight, and the process looked at while it is stopped: the whole 50 MB upload takes well
    # under a second, which a listing on a busy machine could take while the export ran on
    monkeypatch.setenv("CKPT_UPLOAD_PARALLEL", "1")
    with running_ckptctl("export", str(big), target, "--quiet") as proc:
        stop_when(lambda: MARKER in s3.keys("exports/cancelled"), proc, "the marker")
        assert MANIFEST not in s3.keys("exports/cancelled"), "the export finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=WAIT) == 130
        assert "nothing was left behind" in (proc.stderr.read() if proc.stderr else "")
    assert s3.keys("exports/cancelled") == []


def interrupt_during(monkeypatch: pytest.MonkeyPatch, method: str, key_suffix: str) -> threading.Event:
    """Deliver Ctrl-C to the main thread while it waits for the first s3 `method` call on a key ending in
    `key_suffix`; that call goes on (in fsspec's I/O thread) one second later. The event is set once it landed."""
    from fsspec.asyn import sync_wrapper
    from s3fs import S3FileSystem

    original = S3FileSystem._call_s3
    main = threading.main_thread().ident
    landed = threading.Event()
    fired: list[str] = []

    async def interrupting(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == method and str(kwargs.get("Key", "")).endswith(key_suffix) and not fired:
            fired.append(kwargs["Key"])
            assert main is not None
            signal.pthread_kill(main, signal.SIGINT)
            await asyncio.sleep(1.0)
            try:
                return await original(self, name, *args, **kwargs)
            finally:
                landed.set()
        return await original(self, name, *args, **kwargs)

    monkeypatch.setattr(S3FileSystem, "_call_s3", interrupting)
    monkeypatch.setattr(S3FileSystem, "call_s3", sync_wrapper(interrupting))
    return landed


def convert_interrupted(source: str, target: str, options: ConvertOptions) -> str | None:
    """Run `convert`; the name of the exception it raised (None if it finished)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        convert(source, target, options)
    except BaseException as exc:  # KeyboardInterrupt expected; anything else is reported by name
        return type(exc).__name__
    finally:
        signal.signal(signal.SIGINT, previous)
    return None


def test_interrupt_during_a_shard_upload_leaves_nothing(s3: S3, dcp: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    landed = interrupt_during(monkeypatch, "put_object", ".safetensors")
    raised = convert_interrupted(str(dcp.path), s3.uri("exports/step_1"), ConvertOptions(max_shard_size=100_000))
    assert raised == "KeyboardInterrupt"
    assert landed.wait(timeout=WAIT)
    time.sleep(0.2)
    left = s3.keys("exports/step_1")
    assert left == [], f"left behind after the interrupt: {left}"


def test_interrupt_during_a_multipart_upload_leaves_no_open_upload(s3: S3, big: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    landed = interrupt_during(monkeypatch, "create_multipart_upload", ".safetensors")
    raised = convert_interrupted(str(big), s3.uri("exports/big"), ConvertOptions())
    assert landed.wait(timeout=WAIT)
    time.sleep(0.2)
    left = s3.keys("exports/big")
    assert (raised, left) == ("KeyboardInterrupt", [])
    # the create_multipart_upload in flight when Ctrl-C came lands after it: the discard waits for it and
    # aborts the upload it opened (converters/upload.py MultipartWriter.discard)
    uploads = [u["Key"] for u in s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]
    assert uploads == [], f"multipart uploads left open: {uploads}"


# --- plain-word errors -----------------------------------------------------------------------------------


def test_missing_bucket(s3: S3, dcp: Sample, tmp_path: Path) -> None:
    missing = f"no-such-{uuid.uuid4().hex[:8]}"
    one_line_error(ckptctl("export", f"s3://{missing}/run/step_1", tmp_path / "out", check=False),
                   "no such bucket", missing)
    one_line_error(ckptctl("export", dcp.path, f"s3://{missing}/exports/step_1", check=False), "no such bucket")
    assert not (tmp_path / "out").exists()


def test_unreachable_endpoint(s3: S3, dcp: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's default retries take ~10 s per command
    one_line_error(ckptctl("inspect", s3.uri("run/step_1"), check=False), "endpoint unreachable", endpoint)
    one_line_error(ckptctl("export", dcp.path, s3.uri("exports/step_1"), check=False), "endpoint unreachable",
                   endpoint)


def test_wrong_credentials(dcp: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second server that enforces IAM authentication after the 4 set-up calls made here."""
    with MotoServer({"INITIAL_NO_AUTH_ACTION_COUNT": "4"}, log_dir=str(tmp_path)) as server:
        iam = boto3_client(server.endpoint, "iam")
        iam.create_user(UserName="trainer")  # 1
        key = iam.create_access_key(UserName="trainer")["AccessKey"]  # 2
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))  # 3
        boto3_client(server.endpoint).create_bucket(Bucket="locked")  # 4: from here on, requests are checked
        good = boto3_client(server.endpoint, access_key=key["AccessKeyId"], secret_key=key["SecretAccessKey"])
        for path in sorted(dcp.path.iterdir()):
            good.upload_file(str(path), "locked", f"run/step_1/{path.name}")
        assert good.head_object(Bucket="locked", Key="run/step_1/.metadata")["ContentLength"] > 0
        bad = boto3_client(server.endpoint, access_key=key["AccessKeyId"], secret_key="wrong", attempts=1)
        with pytest.raises(ClientError) as denied:
            bad.head_object(Bucket="locked", Key="run/step_1/.metadata")
        assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        for access_key, secret in ((key["AccessKeyId"], "wrong-secret"), ("AKIAIOSFODNN7NOSUCHK", "wrong-secret")):
            for name, value in aws_env(server.endpoint, access_key, secret).items():
                monkeypatch.setenv(name, value)
            one_line_error(ckptctl("inspect", "s3://locked/run/step_1", check=False), "access denied",
                           "s3://locked/run/step_1")
            one_line_error(ckptctl("export", dcp.path, "s3://locked/exports/step_1", check=False), "access denied")
        objects = good.list_objects_v2(Bucket="locked").get("Contents", [])
        assert sorted(o["Key"] for o in objects) == sorted(f"run/step_1/{p.name}" for p in dcp.path.iterdir())


# --- memory:// -----------------------------------------------------------------------------------------


@pytest.fixture
def memory_fs() -> Iterator[Any]:
    import fsspec

    clear_fs_caches()
    try:
        yield fsspec.filesystem("memory")
    finally:
        clear_fs_caches()


def test_memory_source_and_target(memory_fs: Any, dcp: Sample, tmp_path: Path) -> None:
    mem = memory_fs
    for path in sorted(dcp.path.iterdir()):
        mem.pipe_file(f"memory://ckpts/run/{path.name}", path.read_bytes())
    options = ConvertOptions(dtype="bfloat16", max_shard_size=100_000)
    convert("memory://ckpts/run", "memory://ckpts/export", options)
    convert(str(dcp.path), str(tmp_path / "export"), options)
    got = {storage.basename(p): bytes(mem.cat_file(p)) for p in mem.ls("memory://ckpts/export", detail=False)}
    assert_same_output(got, local_files(tmp_path / "export"))
    report = verify_api("memory://ckpts/export", str(tmp_path / "export"), keys=KeyOptions(only="model"))
    assert report.ok, report.summary()
