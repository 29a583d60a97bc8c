"""Object storage I/O at link speed (issue 17), against a real S3 server (moto's server mode) on loopback.

Uploads: `converters.upload.MultipartWriter` cuts a sequential stream into parts and uploads K at a time
(the part count is visible in the object's ETag, `"<md5>-N"`; the most parts in flight in `Slots.peak`); a
small file is one PUT; a failure aborts the multipart upload (no object, no open upload). Reads: a large
remote range is fetched as several requests in parallel, byte for byte what was needed. The checkpoints
are made with torch.distributed.checkpoint.save in this process; part sizes are shrunk to S3's minimum
(5 MiB) so that a few MiB of data make several parts.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from converters import ConvertOptions, convert, rangeread, storage, tensorio, upload
from converters.config import EngineConfig, use
from converters.errors import FormatError, SourceError, TargetError
from converters.formats import load_index
from converters.formats.dcp import DcpReader
from converters.index import ByteRange, Chunk, TensorEntry
from converters.output import open_output
from converters.tensorio import located

from .s3server import S3, s3_fixture, s3_server_fixture  # noqa: F401  (fixtures s3 and s3_server)

MIB = 1024 * 1024
PART = 5 * MIB  # S3's smallest part


def payload(nbytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def open_uploads(s3: S3) -> list[str]:
    return [u["Key"] for u in s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]


def part_count(s3: S3, key: str) -> int:
    """Parts of a completed object, from its ETag (`"md5-N"` for a multipart upload; a plain PUT: 1)."""
    etag = s3.client.head_object(Bucket=s3.bucket, Key=key)["ETag"].strip('"')
    return int(etag.split("-")[1]) if "-" in etag else 1


@pytest.fixture
def slots_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[upload.Slots]]:
    """Every `Slots` an output makes (each output's parts in flight), with part size S3's minimum."""
    made: list[upload.Slots] = []

    class Recorded(upload.Slots):
        def __init__(self, count: int) -> None:
            super().__init__(count)
            made.append(self)

    monkeypatch.setattr(upload, "Slots", Recorded)
    monkeypatch.setattr(upload, "UPLOAD_BLOCK", PART)
    yield made


def write_in_pieces(fh: Any, data: bytes, piece: int = 3 * MIB + 17) -> None:
    view = memoryview(data)
    for at in range(0, len(data), piece):
        fh.write(view[at: at + piece])


def test_large_file_uploads_k_parts_at_once(s3: S3, slots_seen: list[upload.Slots]) -> None:
    data = payload(4 * PART + 123)
    with use(EngineConfig(upload_parallel=2)), \
            open_output(s3.uri("out/one.bin"), overwrite=False, kind="test", single_file=True) as out, \
            out.open() as fh:
        write_in_pieces(fh, data)
    assert s3.get("out/one.bin") == data
    assert part_count(s3, "out/one.bin") == 5
    (slots,) = slots_seen
    assert (slots.count, slots.peak, slots.busy) == (2, 2, 0)  # two parts in flight, never more
    assert out.files == {"one.bin": {"bytes": len(data), "crc32": zlib.crc32(data)}}
    assert open_uploads(s3) == []


def test_small_file_is_one_put_and_files_share_the_slots(s3: S3, slots_seen: list[upload.Slots]) -> None:
    small, large = payload(PART - 1, 1), payload(2 * PART, 2)
    with open_output(s3.uri("out"), overwrite=False, kind="test") as out:
        with out.open("small.bin") as fh:
            write_in_pieces(fh, small)
        with out.open("large.bin") as fh:
            write_in_pieces(fh, large)
    assert (s3.get("out/small.bin"), s3.get("out/large.bin")) == (small, large)
    assert (part_count(s3, "out/small.bin"), part_count(s3, "out/large.bin")) == (1, 2)
    assert len(slots_seen) == 1 and slots_seen[0].count == EngineConfig().upload_parallel == 4
    assert s3.keys("out") == ["ckpt-manifest.json", "large.bin", "small.bin"]


def test_multipart_upload_opens_while_its_first_part_fills(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file past S3's smallest part opens its multipart upload before its first part is full (the part goes
    out as soon as it is); one that ends before the part is full is that upload's only part. Below the
    smallest part a file stays one PUT."""
    monkeypatch.setattr(upload, "UPLOAD_BLOCK", 3 * PART)
    below, one_part = payload(upload.MIN_PART - 1, 4), payload(2 * PART, 5)
    with open_output(s3.uri("out"), overwrite=False, kind="test") as out:
        with out.open("below.bin") as fh:
            write_in_pieces(fh, below, PART // 2)
            assert fh.create is None
        with out.open("one-part.bin") as fh:
            fh.write(one_part[:upload.MIN_PART])
            assert fh.create is not None and fh.parts == []  # opened, nothing sent yet
            fh.create.result()
            assert open_uploads(s3) == ["out/one-part.bin"]
            fh.write(one_part[upload.MIN_PART:])
    assert (s3.get("out/below.bin"), s3.get("out/one-part.bin")) == (below, one_part)
    assert (part_count(s3, "out/below.bin"), part_count(s3, "out/one-part.bin")) == (1, 1)
    assert "-" in s3.client.head_object(Bucket=s3.bucket, Key="out/one-part.bin")["ETag"]  # a multipart upload
    assert open_uploads(s3) == []
    assert out.files == {"below.bin": {"bytes": len(below), "crc32": zlib.crc32(below)},
                         "one-part.bin": {"bytes": len(one_part), "crc32": zlib.crc32(one_part)}}


def test_producer_waits_while_k_parts_are_in_flight(s3: S3, slots_seen: list[upload.Slots]) -> None:
    """Memory stays at (K + 1) parts: with K = 1 every part waits for the one before it to land."""
    data = payload(3 * PART, 3)
    with use(EngineConfig(upload_parallel=1)), \
            open_output(s3.uri("out/k1.bin"), overwrite=False, kind="test", single_file=True) as out, out.open() as fh:
        write_in_pieces(fh, data)
        writer = fh
        assert len(writer.parts) == 3 and all(f.done() for f in writer.parts[:2])
    assert s3.get("out/k1.bin") == data
    assert slots_seen[0].peak == 1


def test_failure_aborts_the_multipart_upload(s3: S3, slots_seen: list[upload.Slots]) -> None:
    with (pytest.raises(RuntimeError, match="producer failed"),
          open_output(s3.uri("out"), overwrite=False, kind="test") as out, out.open("big.bin") as fh):
        write_in_pieces(fh, payload(3 * PART + 1))
        raise RuntimeError("producer failed")
    assert s3.keys("out") == []
    assert open_uploads(s3) == []


def test_missing_bucket_is_one_line_and_leaves_no_upload(s3: S3, slots_seen: list[upload.Slots]) -> None:
    target = f"s3://{s3.bucket}-missing/out/big.bin"
    with (pytest.raises(TargetError, match="no such bucket"),
          open_output(target, overwrite=False, kind="test", single_file=True) as out, out.open() as fh):
        write_in_pieces(fh, payload(3 * PART))


def test_memory_target_keeps_fsspecs_writer() -> None:
    from .s3server import clear_fs_caches

    clear_fs_caches()
    try:
        with open_output("memory://bucket/out", overwrite=False, kind="test") as out, out.open("a.bin") as fh:
            assert not isinstance(fh.raw, upload.MultipartWriter)
            fh.write(b"abc")
        fs, _ = storage.filesystem("memory://")
        assert fs.cat_file("memory://bucket/out/a.bin") == b"abc"
    finally:
        clear_fs_caches()


def test_large_range_is_fetched_in_parallel_requests(s3: S3) -> None:
    data = payload(5 * storage.READ_CHUNK // 2, 4)  # 2.5 chunks: three requests of a third each
    s3.client.put_object(Bucket=s3.bucket, Key="src/blob", Body=data)
    with storage.RangeReader() as reader:
        view = memoryview(bytearray(len(data) - 100))
        reader.readinto(s3.uri("src/blob"), 100, view)
        assert bytes(view) == data[100:]
        assert (reader.requests, reader.fetched, reader.requested) == (3, len(data) - 100, len(data) - 100)
        assert reader.read(s3.uri("src/blob"), 7, storage.MIN_REQUEST) == data[7: 7 + storage.MIN_REQUEST]
        assert reader.requests == 4


def test_large_read_reuses_blocks_fetched_for_small_reads(s3: S3) -> None:
    """A record's header and the zip directory after it share blocks with its data: those bytes are not
    fetched twice."""
    block = storage.MIN_REQUEST
    data = payload(8 * block, 5)
    s3.client.put_object(Bucket=s3.bucket, Key="src/blob", Body=data)
    uri = s3.uri("src/blob")
    with storage.RangeReader() as reader:
        assert reader.read(uri, 1000, 30) == data[1000:1030]  # block 0, whole
        assert reader.read(uri, 5 * block + 7, 30) == data[5 * block + 7: 5 * block + 37]  # block 5
        assert (reader.requests, reader.fetched) == (2, 2 * block)
        view = memoryview(bytearray(5 * block))
        reader.readinto(uri, 1030, view)  # head from block 0, tail from block 5, the middle fetched
        assert bytes(view) == data[1030: 1030 + 5 * block]
        assert (reader.requests, reader.fetched) == (3, 2 * block + 4 * block)
        assert reader.requested == 60 + 5 * block


class CountingReader(storage.RangeReader):
    """A RangeReader that records the most remote requests it had in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.peak = 0
        self._count = threading.Lock()

    def _fetch(self, uri: str, start: int, end: int) -> bytes:
        with self._count:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(0.02)  # a round trip's worth, so that overlapping requests do overlap
            return super()._fetch(uri, start, end)
        finally:
            with self._count:
                self.in_flight -= 1


def test_threads_that_want_one_block_send_one_request(s3: S3) -> None:
    """Index reads run side by side: threads that miss the same block wait for one request."""
    data = payload(2 * storage.MIN_REQUEST, 6)
    s3.client.put_object(Bucket=s3.bucket, Key="src/blob", Body=data)
    uri = s3.uri("src/blob")
    start = threading.Barrier(8)
    got: dict[int, bytes] = {}

    def read(i: int) -> None:
        start.wait()
        got[i] = reader.read(uri, 100 * i, 50)

    with CountingReader() as reader:
        threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert got == {i: data[100 * i: 100 * i + 50] for i in range(8)}
        assert (reader.requests, reader.fetched) == (1, storage.MIN_REQUEST)


def test_dcp_index_reads_record_headers_side_by_side(s3: S3, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the index locates every record (Megatron's layer views need it), each record's header is one small
    read: from object storage they are sent several at a time, and the index is the local one's, chunk for
    chunk."""
    path = tmp_path / "dcp"
    _dcp_of_many_records(path)
    src = s3.upload(path, "many")
    local = load_index(str(path))
    monkeypatch.setattr(DcpReader, "locate_remote", True)
    with CountingReader() as reader:
        remote = load_index(src, reader=reader)
    assert reader.peak > 1
    assert list(remote.tensors) == list(local.tensors)
    for name, entry in local.tensors.items():
        assert [(c.offsets, c.sizes, c.data.offset, c.data.length) for c in remote.tensors[name].chunks] == \
            [(c.offsets, c.sizes, c.data.offset, c.data.length) for c in entry.chunks]


def test_dcp_records_are_located_when_read_with_their_header_in_the_same_request(s3: S3, tmp_path: Path) -> None:
    """From object storage the DCP index reads no record; an export then fetches each record once, its header
    with its tensor, and the records it reads close together with it: the 12 records (3 MiB back to back,
    read in another order than they lie in) in one request; it writes what the local export writes."""
    path = tmp_path / "dcp"
    _dcp_of_many_records(path)
    src = s3.upload(path, "many")
    local = load_index(str(path))
    with CountingReader() as reader:
        remote = load_index(src, reader=reader)
        assert reader.requests == 0
        assert all(c.data.record for e in remote.tensors.values() for c in e.chunks)
        convert(src, str(tmp_path / "remote.safetensors"), reader=reader)
        assert sum(len(e.chunks) for e in local.tensors.values()) == 12
        assert reader.requests == 1
        assert reader.fetched <= 1.05 * reader.requested
        for name, entry in local.tensors.items():  # located as the local index locates them
            assert [located(reader, remote.tensors[name], c).offset for c in remote.tensors[name].chunks] == \
                [c.data.offset for c in entry.chunks]
        assert reader.requests == 1
    convert(str(path), str(tmp_path / "local.safetensors"))
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "remote.safetensors"))
    generator = torch.Generator().manual_seed(1)
    assert all(torch.equal(got[f"layers.{i}.weight"], torch.randn(64, 1024, generator=generator)) for i in range(12))


def _save_dcp(path: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dist_cp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_cp.save(state, checkpoint_id=str(path))


def _layers(count: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Layers of a weight (rows x 1024 fp32) and a small bias each: large records with a small one after each."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(count):
        state[f"l{i}.w"] = torch.randn(rows, 1024, generator=generator)
        state[f"l{i}.b"] = torch.randn(16, generator=generator)
    return state


def _exported_equal(path: Path, got: Path, want: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    convert(str(path), str(got.parent / "local.safetensors"))
    assert got.read_bytes() == (got.parent / "local.safetensors").read_bytes()
    loaded = load_file(str(got))
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], v) for k, v in want.items())


def test_small_records_are_fetched_with_the_large_record_before_them(s3: S3, tmp_path: Path) -> None:
    """A bias record after each weight record: a torch file, whose records are read by several threads at
    once, fetches each weight with its bias (one request per layer); an export, which reads in its file's
    order, fetches the records it reads close together in one request (the 4 layers, 2 MiB back to back,
    read in another order than they lie in); every byte once."""
    state = _layers(4, 128, 2)  # 512 KiB weights
    _save_dcp(tmp_path / "dcp", state)
    src = s3.upload(tmp_path / "dcp", "layers")
    records = [c.data for e in load_index(str(tmp_path / "dcp"), locate=False).tensors.values() for c in e.chunks]
    with CountingReader() as reader:
        convert(src, str(tmp_path / "out.pt"), ConvertOptions(to="torch"), reader=reader)
        assert reader.requests == 4
        assert reader.fetched == sum(r.length for r in records) <= 1.05 * reader.requested
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    with CountingReader() as reader:
        convert(src, str(tmp_path / "out.safetensors"), reader=reader)
        assert reader.requests == 1
        assert reader.fetched == sum(r.length for r in records) <= 1.05 * reader.requested
    _exported_equal(tmp_path / "dcp", tmp_path / "out.safetensors", state)


def test_a_large_record_is_fetched_as_head_and_tail_with_the_small_ones_after_it(
        s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record larger than a read chunk: its head with the tensor's first chunk, its tail (the zip directory)
    with the small record after it, and the middle, three requests per layer; the small record, read first
    (the export goes by name: `l0.b` before `l0.w`), is fetched alone, not with the large one."""
    monkeypatch.setattr(rangeread, "READ_CHUNK", MIB)
    monkeypatch.setattr(tensorio, "READ_CHUNK", MIB)
    monkeypatch.setattr(tensorio, "GROUP_BYTES", MIB)  # a 2 MiB record groups with no other large one
    state = _layers(3, 512, 3)  # 2 MiB weights
    _save_dcp(tmp_path / "dcp", state)
    src = s3.upload(tmp_path / "dcp", "large")
    with CountingReader() as reader:
        convert(src, str(tmp_path / "out.safetensors"), reader=reader)
        assert reader.requests == 3 * (3 + 1)
        assert reader.fetched <= 1.05 * reader.requested
    _exported_equal(tmp_path / "dcp", tmp_path / "out.safetensors", state)


def test_export_from_model_and_optimizer_fetches_only_the_model(s3: S3, tmp_path: Path) -> None:
    """Records that are not read are never fetched, even when they lie between records that are."""
    model = _layers(3, 128, 4)
    generator = torch.Generator().manual_seed(5)
    optim = {"state": {k: {"exp_avg": torch.randn(v.shape, generator=generator), "step": torch.tensor(3.0)}
                       for k, v in model.items()}, "param_groups": [{"lr": 0.1, "params": sorted(model)}]}
    _save_dcp(tmp_path / "dcp", {"model": model, "optim": optim})
    src = s3.upload(tmp_path / "dcp", "both")
    with CountingReader() as reader:
        convert(src, str(tmp_path / "out.safetensors"), ConvertOptions(export=True), reader=reader)
        model_bytes = sum(v.numel() * 4 for v in model.values())
        assert model_bytes <= reader.fetched <= 1.05 * model_bytes
    _exported_equal(tmp_path / "dcp", tmp_path / "out.safetensors", model)


def test_reshard_from_s3_fetches_each_record_once_and_equals_the_local_one(
        s3: S3, dcp_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records split between target ranks (1 -> 3) are fetched once, by whichever rank reads them first; the
    output is the local reshard's, byte for byte (DCP's random ids pinned)."""
    import types
    import uuid

    import converters.writers.dcp
    import converters.zipwriter
    from converters import ReshardOptions, reshard

    fixed = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=0x5EED))
    monkeypatch.setattr(converters.writers.dcp, "uuid", fixed)
    monkeypatch.setattr(converters.zipwriter, "uuid", fixed)
    src = s3.upload(dcp_source, "reshard")
    with CountingReader() as reader:
        reshard(src, str(tmp_path / "remote"), ReshardOptions(world_size=3), reader=reader)
        sizes = sum(p.stat().st_size for p in dcp_source.glob("*.distcp"))
        assert reader.fetched <= sizes and reader.fetched <= 1.05 * reader.requested
    reshard(str(dcp_source), str(tmp_path / "local"), ReshardOptions(world_size=3))
    names = sorted(p.name for p in (tmp_path / "local").iterdir() if p.name != "ckpt-manifest.json")
    assert len(names) >= 4 and names == sorted(p.name for p in (tmp_path / "remote").iterdir()
                                               if p.name != "ckpt-manifest.json")
    for name in names:
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    import torch.distributed.checkpoint as dist_cp

    generator = torch.Generator().manual_seed(0)  # the source's values (dcp_source)
    want = {f"layers.{i}.weight": torch.randn(1024, 2048 + i, generator=generator) for i in range(3)}
    want["bias"] = torch.randn(1000, generator=generator)
    got = {name: torch.zeros_like(tensor) for name, tensor in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_cp.load(got, checkpoint_id=str(tmp_path / "remote"))  # its consumer's own loader
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_a_remote_source_is_listed_once_per_command_and_a_missing_file_still_named(
        s3: S3, dcp_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a checkpoint from object storage asks the service about its files once: one listing of the
    folder, no HEAD per file, however many times detection, checks and reads ask; a file the metadata names
    but the listing lacks is still refused, naming it."""
    from s3fs import S3FileSystem

    from converters import ReshardOptions, reshard

    src = s3.upload(dcp_source, "run/step_1")
    key = src.split("://", 1)[1].split("/", 1)[1]
    asked: list[tuple[str, str]] = []
    original = S3FileSystem._call_s3

    async def counting(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        where = kwargs.get("Key") or kwargs.get("Prefix") or ""
        if method in ("head_object", "list_objects_v2") and where.startswith(key):
            asked.append((method, where))
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(S3FileSystem, "_call_s3", counting)
    convert(src, str(tmp_path / "out.safetensors"))
    reshard(src, str(tmp_path / "resharded"), ReshardOptions(world_size=3))
    assert asked == [("list_objects_v2", key + "/")] * 2  # once per command
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{key}/__0_0.distcp")
    with pytest.raises(SourceError, match=r"__0_0\.distcp"):
        convert(src, str(tmp_path / "again.safetensors"))


def test_records_of_one_shape_are_unpickled_once_and_still_checked(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve records of one dtype and shape hold the same data.pkl: it is unpickled once; each record is still
    located and checked against the metadata (a record zeroed is refused as before)."""
    from converters import torchzip, unpickle

    path = tmp_path / "dcp"
    _dcp_of_many_records(path)
    torchzip._RECORD_PICKLES.clear()
    loads: list[str] = []
    original = unpickle.loads

    def counting(data: bytes, source: str, *args: Any) -> Any:
        loads.append(source)
        return original(data, source, *args)

    monkeypatch.setattr(unpickle, "loads", counting)
    index = load_index(str(path))
    assert len(index.tensors) == 12 and len([s for s in loads if "@" in s]) == 1
    _damage_records(path, 5)
    with pytest.raises(FormatError):
        load_index(str(path))


def test_a_record_whose_shape_contradicts_the_metadata_is_refused_when_its_pickle_is_cached(
        tmp_path: Path) -> None:
    """Crafted: `.metadata` gives one of twelve same-shape tensors another shape of the same size. Its record's
    data.pkl is byte for byte the others' (already unpickled and kept), and it is still checked and refused."""
    import pickle

    import torch.distributed.checkpoint as dist_cp

    from converters import torchzip

    path = tmp_path / "dcp"
    _dcp_of_many_records(path)
    metadata = dist_cp.FileSystemReader(str(path)).read_metadata()  # the framework's own reader
    tensor = metadata.state_dict_metadata["layers.7.weight"]
    tensor.size = torch.Size((128, 512))
    tensor.chunks[0].sizes = torch.Size((128, 512))
    with open(path / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)  # as DCP writes it
    torchzip._RECORD_PICKLES.clear()
    with pytest.raises(FormatError, match=r"layers\.7\.weight.*float32\[64, 1024\].*float32\[128, 512\]"):
        load_index(str(path))


def test_group_records_joins_back_to_back_records_of_the_selection_only() -> None:
    """A large record takes the small ones after it; small ones before any large one group alone; a gap of
    unselected bytes, another file, or another large record starts a new group."""
    big, small = tensorio.MIN_REQUEST, 100
    layout = [("a", 0, small), ("b", small, big), ("c", small + big, small), ("d", 2 * small + big, small),
              ("e", 2 * small + big + 8192, small), ("f", 3 * small + big + 8192, big)]
    tensors = {name: _record_entry("s3://b/x/__0_0.distcp", offset, length) for name, offset, length in layout}
    tensors["g"] = _record_entry("s3://b/x/__1_0.distcp", small, small)
    grouped = {name: e.chunks[0].data.record for name, e in tensorio.group_records(tensors).items()}
    assert grouped == {"a": (0, small, 1), "b": (small, big + 2 * small, 3), "c": (small, big + 2 * small, 3),
                       "d": (small, big + 2 * small, 3), "e": (2 * small + big + 8192, small, 1),
                       "f": (3 * small + big + 8192, big, 1), "g": (small, small, 1)}


def test_group_records_in_read_order_joins_large_records_read_close_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the order they are read in, large records join too, while the group stays within GROUP_BYTES and
    its records are read within GROUP_WINDOW bytes of its first: a record read far later starts a new group,
    and so does one that would make the group too large."""
    monkeypatch.setattr(tensorio, "GROUP_BYTES", 4 * MIB)
    monkeypatch.setattr(tensorio, "GROUP_WINDOW", 2 * MIB)
    uri, big = "s3://b/x/__0_0.distcp", MIB
    tensors = {name: _record_entry(uri, i * big, big) for i, name in enumerate("abcdefg")}
    order = ["a", "b", "g", "c", "d", "e", "f"]  # read at 0, 1, 3, 4, 5, 6 MiB; g at 2 MiB

    def groups() -> dict[str, tuple[int, int, int] | None]:
        positions = tensorio.read_positions([[(tensors[name], None) for name in order]])
        return {name: e.chunks[0].data.record for name, e in tensorio.group_records(tensors, positions).items()}

    assert groups() == {"a": (0, 2 * big, 2), "b": (0, 2 * big, 2), "c": (2 * big, 3 * big, 3),
                        "d": (2 * big, 3 * big, 3), "e": (2 * big, 3 * big, 3), "f": (5 * big, big, 1),
                        "g": (6 * big, big, 1)}
    monkeypatch.setattr(tensorio, "GROUP_WINDOW", 100 * MIB)  # now only the size ends a group
    assert groups() == {**dict.fromkeys("abcd", (0, 4 * big, 4)), **dict.fromkeys("efg", (4 * big, 3 * big, 3))}
    assert all(r[2] == 1 for r in (e.chunks[0].data.record for e in tensorio.group_records(tensors).values()))


def _record_entry(uri: str, offset: int, length: int) -> TensorEntry:
    return TensorEntry("t", "uint8", (length,), [Chunk((0,), (length,), ByteRange(uri, offset, length,
                                                                                  record=(offset, length, 1)))])


def _dcp_of_many_records(path: Path) -> None:
    import torch.distributed.checkpoint as dist_cp

    generator = torch.Generator().manual_seed(1)
    state = {f"layers.{i}.weight": torch.randn(64, 1024, generator=generator) for i in range(12)}  # 256 KiB each
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_cp.save(state, checkpoint_id=str(path))


def _damage_records(path: Path, *which: int) -> list[ByteRange]:
    """Zero records `which` of rank file 0 (a crafted or damaged file); returns every record, in index order."""
    records = [c.data for e in load_index(str(path), locate=False).tensors.values() for c in e.chunks]
    with open(path / "__0_0.distcp", "r+b") as fh:
        for i in which:
            fh.seek(records[i].offset)
            fh.write(bytes(records[i].length))
    return records


def test_damaged_records_read_side_by_side_fail_as_when_read_in_a_row(s3: S3, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two records zeroed: the remote index, locating records side by side, refuses the checkpoint with the
    local one's error, naming the first damaged record in index order."""
    path = tmp_path / "dcp"
    _dcp_of_many_records(path)
    records = _damage_records(path, 7, 3)
    with pytest.raises(FormatError) as local:
        load_index(str(path))
    src = s3.upload(path, "damaged")
    monkeypatch.setattr(DcpReader, "locate_remote", True)
    with pytest.raises(FormatError) as remote:
        load_index(src, reader=CountingReader())
    assert f"@{records[3].offset}:" in str(local.value)
    assert str(remote.value) == str(local.value).replace(str(path), src)


def test_damaged_record_located_when_read_fails_the_export_by_name_and_leaves_nothing(s3: S3,
                                                                                      tmp_path: Path) -> None:
    """A zeroed record found only when the export reads it: the same one-line error as the local index gives,
    naming that record, and no output (local or on S3)."""
    path = tmp_path / "dcp"
    _dcp_of_many_records(path)
    records = _damage_records(path, 5)
    with pytest.raises(FormatError) as local:
        load_index(str(path))
    src = s3.upload(path, "damaged")
    for target in (str(tmp_path / "out.safetensors"), s3.uri("out")):
        with pytest.raises(FormatError) as remote:
            convert(src, target)
        assert f"@{records[5].offset}:" in str(remote.value)
        assert str(remote.value) == str(local.value).replace(str(path), src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]
    assert s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="out").get("KeyCount", 0) == 0
    assert open_uploads(s3) == []


def test_crafted_shard_header_read_side_by_side_is_refused_by_name(s3: S3, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(4):
        save_file({f"w{i}": torch.zeros(4)}, str(folder / f"model-{i + 1:05d}-of-00004.safetensors"))
    bad = folder / "model-00003-of-00004.safetensors"
    bad.write_bytes((1 << 40).to_bytes(8, "little") + bad.read_bytes()[8:])  # a header "1 TiB" long
    src = s3.upload(folder, "crafted")
    with pytest.raises(FormatError, match="model-00003-of-00004.safetensors: not a safetensors file "
                                          r"\(header length 1099511627776 is implausible\)"):
        load_index(src, reader=CountingReader())


def test_safetensors_shard_headers_are_read_side_by_side(s3: S3, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "shards"
    folder.mkdir()
    want = {f"w{i}": torch.full((8, 8), float(i)) for i in range(6)}
    for i in range(6):
        save_file({f"w{i}": want[f"w{i}"]}, str(folder / f"model-{i + 1:05d}-of-00006.safetensors"))
    src = s3.upload(folder, "shards")
    with CountingReader() as reader:
        index = load_index(src, reader=reader)
    assert reader.peak > 1
    assert sorted(index.tensors) == sorted(want)
    convert(src, str(tmp_path / "out.safetensors"))
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items()) and got.keys() == want.keys()


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint of ~24 MiB (torch.distributed.checkpoint.save in one process)."""
    import torch.distributed.checkpoint as dist_cp

    path = tmp_path_factory.mktemp("s3io") / "dcp"
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(1024, 2048 + i, generator=generator) for i in range(3)}
    state["bias"] = torch.randn(1000, generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dist_cp.save(state, checkpoint_id=str(path))
    return path


def test_export_s3_to_s3_equals_local_and_fetches_what_it_needs(s3: S3, dcp_source: Path, tmp_path: Path,
                                                               slots_seen: list[upload.Slots]) -> None:
    convert(str(dcp_source), str(tmp_path / "local"))
    src = s3.upload(dcp_source, "run/step_1")
    reader = storage.RangeReader()
    convert(src, s3.uri("export"), ConvertOptions(), reader=reader)
    want = (tmp_path / "local" / "model.safetensors").read_bytes()
    assert s3.get("export/model.safetensors") == want
    assert part_count(s3, "export/model.safetensors") == -(-len(want) // PART)
    tensor_bytes = 4 * (1024 * (2048 + 2049 + 2050) + 1000)
    assert tensor_bytes <= reader.requested <= tensor_bytes + 256 * 1024  # the tensors and a little metadata
    assert reader.fetched <= 1.05 * reader.requested
    assert slots_seen[0].peak >= 2
    assert open_uploads(s3) == []


def test_a_part_body_sent_twice_sends_every_byte_twice(s3: S3) -> None:
    """An upload part's body (`upload.Part`) goes out without a copy and is rewound before every attempt, so
    that a retry of the request (s3fs and botocore send the same body again) sends it whole: two requests
    with one body store the same bytes."""
    from fsspec.asyn import sync

    fs, _ = storage.filesystem(s3.uri())
    data = random.Random(7).randbytes(3 * MIB)
    body = upload.Part(data)

    async def put(key: str) -> None:
        await upload._send_part(fs, "put_object", upload._crc32_param(upload._crc32(body)), Bucket=s3.bucket,
                                Key=key, Body=body)

    sync(fs.loop, put, "first")
    sync(fs.loop, put, "again")
    assert s3.get("first") == s3.get("again") == data


def test_a_part_goes_out_with_its_crc32_which_the_server_keeps(s3: S3) -> None:
    """A part carries the CRC-32 we computed, which the server keeps as the object's checksum; botocore computes
    none of its own: a value we give is the one sent (moto records it unchecked; S3 refuses a mismatch)."""
    import base64
    import zlib

    from fsspec.asyn import sync

    fs, _ = storage.filesystem(s3.uri())
    data = random.Random(8).randbytes(MIB + 5)
    body = upload.Part(data)
    checksum = upload._crc32_param(upload._crc32(body))
    assert base64.b64decode(checksum) == zlib.crc32(data).to_bytes(4, "big")

    async def put(key: str, value: str) -> None:
        await upload._send_part(fs, "put_object", value, Bucket=s3.bucket, Key=key, Body=body)

    def stored(key: str) -> str:
        return str(s3.client.head_object(Bucket=s3.bucket, Key=key, ChecksumMode="ENABLED")["ChecksumCRC32"])

    sync(fs.loop, put, "good", checksum)
    assert stored("good") == checksum
    assert s3.get("good") == data
    other = base64.b64encode((zlib.crc32(data) ^ 1).to_bytes(4, "big")).decode()
    sync(fs.loop, put, "sent-as-given", other)
    assert stored("sent-as-given") == other


def test_a_client_that_sends_checksums_only_when_required_sends_none(s3: S3) -> None:
    """Stores that refuse S3's checksum headers are reached with `request_checksum_calculation="when_required"`
    (botocore's own switch, also AWS_REQUEST_CHECKSUM_CALCULATION): then no part carries our checksum either."""
    import s3fs
    from fsspec.asyn import sync

    fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True,
                           config_kwargs={"request_checksum_calculation": "when_required"})
    data = random.Random(9).randbytes(MIB)
    body = upload.Part(data)

    async def put(key: str) -> None:
        await upload._send_part(fs, "put_object", upload._crc32_param(upload._crc32(body) ^ 1), Bucket=s3.bucket,
                                Key=key, Body=body)

    sync(fs.loop, put, "plain")
    assert s3.get("plain") == data
    assert "ChecksumCRC32" not in s3.client.head_object(Bucket=s3.bucket, Key="plain", ChecksumMode="ENABLED")


def test_read_ahead_keeps_order_reads_ahead_within_its_budget_and_stops_its_producers() -> None:
    """Blocks come in stream order while later streams already run, each in a buffer of its own; the bytes
    read and not yet used stay within the budget, which never holds back the stream the consumer waits for
    (one block larger than the whole budget included); an error comes in order and stops every producer."""
    from concurrent.futures import ThreadPoolExecutor

    from converters.readahead import Budget, ReadAhead

    started: list[int] = []

    def stream(i: int, fail: bool = False, size: int = 10) -> Any:
        def blocks(buffer: Any) -> Iterator[memoryview]:
            started.append(i)
            for j in range(3):
                if fail and j == 1:
                    raise ValueError(f"stream {i} failed")
                view = buffer(size)
                view[0] = 10 * i + j
                yield view
        return blocks

    with ThreadPoolExecutor(3) as pool:
        budget = Budget(45)
        streams = [stream(i) for i in range(4)] + [stream(4, size=100)]
        got, held = [], []
        with ReadAhead(pool, streams, budget) as ahead:
            for i in range(len(streams)):
                for block in ahead.blocks(i):
                    if not got:
                        deadline = time.monotonic() + 10
                        while budget.used < 40 and time.monotonic() < deadline:
                            time.sleep(0.01)  # the streams after the first read ahead while its block is in use
                        assert budget.used == 40 and len(started) >= 2  # 4 blocks of 10: a 5th would pass 45
                    held.append(block)  # a block stays valid after the next one: its buffer is its own
                    got.append(block[0])
                    assert budget.used <= 100 + 10  # the one large block, taken when the consumer waits for it
        assert got == [10 * i + j for i in range(5) for j in range(3)]
        assert [b[0] for b in held] == got
        assert budget.used == 0 and budget.peak <= 110 and budget.kept == 0  # blocks under Budget.KEEP are not kept
        seen = []
        with pytest.raises(ValueError, match="stream 1 failed"), \
                ReadAhead(pool, [stream(0), stream(1, fail=True), stream(2)], budget) as ahead:
            for i in range(3):
                for block in ahead.blocks(i):
                    seen.append(block[0])
        assert seen == [0, 1, 2, 10]
        assert budget.used == 0
        pool.submit(lambda: None).result(timeout=10)  # no producer left blocked in the pool


def test_failed_part_upload_during_s3_to_s3_export_stops_and_leaves_nothing(
        s3: S3, dcp_source: Path, slots_seen: list[upload.Slots], monkeypatch: pytest.MonkeyPatch) -> None:
    """The third part fails (after s3fs's retries): the export stops its read-ahead threads, aborts the upload
    and removes the prefix; the error names the target."""
    from s3fs import S3FileSystem

    src = s3.upload(dcp_source, "run/step_1")
    original = S3FileSystem._call_s3

    async def failing(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part" and kwargs["PartNumber"] == 3:
            raise PermissionError("part 3 refused")
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(S3FileSystem, "_call_s3", failing)
    with pytest.raises(TargetError, match="access denied"):
        convert(src, s3.uri("export"), ConvertOptions())
    assert s3.keys("export") == []
    assert open_uploads(s3) == []


def test_upload_whose_create_an_interrupt_lost_is_aborted_when_it_lands(
        s3: S3, slots_seen: list[upload.Slots], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C right after the main thread handed `create_multipart_upload` to the loop loses its future: the
    request still lands, and the coroutine aborts the upload it opened, since the writer was discarded."""
    handed = upload.MultipartWriter._submit

    def interrupted(self: upload.MultipartWriter, coro: Any) -> Any:
        future = handed(self, coro)
        if coro.cr_code.co_name == "_create":
            raise KeyboardInterrupt  # after the hand-over, before the writer kept the future
        return future

    monkeypatch.setattr(upload.MultipartWriter, "_submit", interrupted)
    with (pytest.raises(KeyboardInterrupt),
          open_output(s3.uri("out/lost.bin"), overwrite=False, kind="test", single_file=True) as out,
          out.open() as fh):
        write_in_pieces(fh, payload(2 * PART))
    time.sleep(1.0)  # the create's reply, and the abort after it
    assert open_uploads(s3) == []
    assert s3.keys("out") == []
