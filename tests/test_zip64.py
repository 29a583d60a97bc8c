"""Outputs past 4 GiB (zip64 members and offsets, one tensor over 4 GiB), hole-aware copies and CRC-32.

The big sources are sparse safetensors files (a real header, the data section a hole but for a few marked
values, some past 4 GiB): they take a few KB of disk, and so do the outputs, because uncast copies skip holes.
Everything written is read back by torch itself (`torch.load(weights_only=True, mmap=True)`).
"""

from __future__ import annotations

import json
import os
import random
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from converters.certificate import Ledger, joined_crcs
from converters.checksum import crc32, crc32_combine, crc32_zeros
from converters.copier import Copier, SourceRange, data_runs
from converters.errors import SourceError
from converters.index import TensorEntry
from converters.rangeread import RangeReader

from .conftest import ckptctl

GiB = 1 << 30
U32 = 0xFFFFFFFF
_ST_DTYPES = {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}

# name -> (dtype, shape, {flat element index: value}); values sit past 4 GiB into the output where they can
Tensors = dict[str, tuple[torch.dtype, tuple[int, ...], dict[int, float]]]


@pytest.fixture
def sparse_dir(tmp_path: Path) -> Path:
    """`tmp_path`, when its filesystem keeps holes (else the test would write gigabytes: skip)."""
    probe = tmp_path / "probe"
    with open(probe, "wb") as fh:
        fh.truncate(GiB)
    blocks, fd = os.stat(probe).st_blocks, os.open(probe, os.O_RDONLY)
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
        holes = False  # a 1 GiB hole that reports data: no SEEK_DATA support
    except OSError:
        holes = True
    finally:
        os.close(fd)
        probe.unlink()
    if blocks or not holes:
        pytest.skip(f"{tmp_path}: the filesystem does not keep sparse files (SEEK_DATA/SEEK_HOLE)")
    return tmp_path


def sparse_safetensors(path: Path, tensors: Tensors) -> None:
    """A safetensors file whose data section is a hole except for the marked values; checked with safe_open."""
    header, at = {}, 0
    for name, (dtype, shape, _) in tensors.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        base = fh.tell()
        fh.truncate(base + at)
        for name, (dtype, _, marks) in tensors.items():
            start = base + header[name]["data_offsets"][0]
            for index, value in marks.items():
                fh.seek(start + index * dtype.itemsize)
                fh.write(torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes())
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)


def assert_marked(got: dict[str, torch.Tensor], tensors: Tensors) -> None:
    """Shape, dtype, every mark, and zeros beside each mark (where the source is a hole)."""
    assert sorted(got) == sorted(tensors)
    for name, (dtype, shape, marks) in tensors.items():
        flat = got[name].reshape(-1)
        assert got[name].dtype == dtype and tuple(got[name].shape) == shape, name
        for index, value in marks.items():
            assert flat[index].item() == value, (name, index)
            for near in (index - 1, index + 1):
                if 0 <= near < flat.numel() and near not in marks:
                    assert flat[near].item() == 0, (name, near)


def assert_marked_file(path: Path, tensors: Tensors) -> None:
    """`assert_marked` for a safetensors file, read value by value through safe_open slices."""
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, (dtype, shape, marks) in tensors.items():
            view = f.get_slice(name)
            assert view.get_shape() == list(shape) and view.get_dtype() == _ST_DTYPES[dtype], name
            for index, value in marks.items():
                at = [int(i) for i in torch.unravel_index(torch.tensor(index), shape)]
                assert view[tuple(slice(i, i + 1) for i in at)].item() == value, (name, index)


def expected_crc(tensor_bytes: int, dtype: torch.dtype, marks: dict[int, float]) -> int:
    """CRC-32 of a member holding zeros but for `marks`: zlib over the marks, zero runs by `crc32_zeros`
    (itself checked against zlib in `test_crc32_zeros_matches_zlib`)."""
    crc, at = 0, 0
    for index in sorted(marks):
        data = torch.tensor([marks[index]], dtype=dtype).view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(data, crc32_zeros(index * dtype.itemsize - at, crc))
        at = index * dtype.itemsize + len(data)
    return crc32_zeros(tensor_bytes - at, crc)


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_crc32_matches_zlib() -> None:
    rng = random.Random(17)
    data = rng.randbytes(1 << 20)
    for start in (0, 1, 0xFFFFFFFF, rng.getrandbits(32)):
        assert crc32(data, start) == zlib.crc32(data, start)
        assert crc32(memoryview(data)[3:70001], start) == zlib.crc32(data[3:70001], start)


def test_crc32_zeros_matches_zlib() -> None:
    rng = random.Random(4)
    for n in (0, 1, 2, 3, 7, 8, 255, 4096, 65537, (1 << 20) + 3, 3 * (1 << 20) + 1):
        start = rng.getrandbits(32)
        assert crc32_zeros(n, start) == zlib.crc32(bytes(n), start), n
        assert crc32_zeros(n) == zlib.crc32(bytes(n)), n
    head = rng.randbytes(1000)
    assert crc32_zeros(5000, zlib.crc32(head)) == zlib.crc32(head + bytes(5000))


def test_crc32_combine_matches_zlib_over_the_joined_bytes() -> None:
    rng = random.Random(5)
    for a_len, b_len in ((0, 0), (0, 9), (9, 0), (1, 1), (1000, 4097), (1 << 20, 3)):
        a, b = rng.randbytes(a_len), rng.randbytes(b_len)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), b_len) == zlib.crc32(a + b), (a_len, b_len)


def _holey(path: Path) -> bytes:
    """A 2 MiB file: data [0, 8 KiB), hole, data [1 MiB, 1 MiB + 4 KiB), hole to the end. Returns its bytes."""
    rng = random.Random(9)
    dense = bytearray(2 << 20)
    dense[:8192] = rng.randbytes(8192)
    dense[1 << 20: (1 << 20) + 4096] = rng.randbytes(4096)
    with open(path, "wb") as fh:
        fh.write(dense[:8192])
        fh.seek(1 << 20)
        fh.write(dense[1 << 20: (1 << 20) + 4096])
        fh.truncate(len(dense))
    return bytes(dense)


def test_data_runs(sparse_dir: Path) -> None:
    _holey(sparse_dir / "src")
    fd = os.open(sparse_dir / "src", os.O_RDONLY)
    try:
        mib = 1 << 20
        assert [r[:3] for r in data_runs(fd, 0, 2 * mib)] == [
            (0, 8192, True), (8192, mib, False), (mib, mib + 4096, True), (mib + 4096, 2 * mib, False)]
        assert list(data_runs(fd, 100, 5000)) == [(100, 5000, True, 8192)]
        assert list(data_runs(fd, 9000, 10000)) == [(9000, 10000, False, 9000)]
    finally:
        os.close(fd)


@pytest.mark.parametrize(("offset", "length"), [(0, 2 << 20), (5000, (1 << 20) - 1000), (100_000, 1 << 20),
                                                ((1 << 20) + 10, 4000)])
def test_copy_range_skips_holes(sparse_dir: Path, offset: int, length: int) -> None:
    """The copy equals the source range byte for byte, with the source's CRC-32 and its full length (also when
    it ends in a hole), and allocates only the data runs."""
    dense = _holey(sparse_dir / "src")
    want = dense[offset: offset + length]
    with RangeReader() as reader, open(sparse_dir / "dst", "wb") as fh:
        fh.write(b"head")
        fh.flush()
        crc = Copier(reader).copy_range(SourceRange(str(sparse_dir / "src"), offset, length), fh.fileno(), 4, 77)
    assert crc == zlib.crc32(want, 77)
    assert (sparse_dir / "dst").read_bytes() == b"head" + want
    # the data runs (each may straddle one more block at this unaligned destination) and the last byte's block
    assert allocated(sparse_dir / "dst") <= 8192 + 4096 + 3 * 4096


@pytest.mark.parametrize(("offset", "length"), [(0, 2 << 20), (5000, (1 << 20) - 1000), (8192, 4096)])
def test_copy_range_with_statistics(sparse_dir: Path, offset: int, length: int) -> None:
    """With statistics the piece is read into a buffer and written from it: the same bytes, CRC-32 and (for a
    sparse piece) holes as the kernel copy, the values (holes read as zeros) counted as numpy counts them, and
    the output's CRC-32s noted block by block as the ledger joins them."""
    dense = _holey(sparse_dir / "src")
    want = dense[offset: offset + length]
    ledger = Ledger(str(sparse_dir), "safetensors", stats=True)
    entry = TensorEntry("t", "uint8", (length,), [])
    tally = ledger.open(entry, "uint8", None)
    with RangeReader() as reader, open(sparse_dir / "dst", "wb") as fh:
        fh.write(b"head")
        fh.flush()
        copier = Copier(reader)
        copier.ledger = ledger
        crc = copier.copy_range(SourceRange(str(sparse_dir / "src"), offset, length, 77, None, tally),
                                fh.fileno(), 4, 77)
        ledger.wrote_bytes(fh.fileno(), 0, b"head")
        noted = joined_crcs(next(iter(ledger.written.values())), 4 + length)
    assert crc == zlib.crc32(want, 77) == tally.src_crc
    assert (sparse_dir / "dst").read_bytes() == b"head" + want
    assert noted is not None and noted[0] == zlib.crc32(b"head" + want)
    if length > 8192:  # sparse pieces keep their holes
        assert allocated(sparse_dir / "dst") <= 8192 + 4096 + 3 * 4096
    moments = tally.moments()
    assert moments is not None
    got, values = moments[0].result(), np.frombuffer(want, np.uint8)
    assert (got.count, got.zeros, got.min, got.max) == (length, int((values == 0).sum()), values.min(), values.max())
    assert got.mean == pytest.approx(values.mean(), rel=1e-12)


def test_copy_range_refuses_a_short_file(sparse_dir: Path) -> None:
    """A range past the end of a (sparse) source is a truncated file, never zeros."""
    _holey(sparse_dir / "src")
    with (RangeReader() as reader, open(sparse_dir / "dst", "wb") as fh,
          pytest.raises(SourceError, match=r"src: file is shorter .* truncated")):
        Copier(reader).copy_range(SourceRange(str(sparse_dir / "src"), 1 << 20, 2 << 20), fh.fileno(), 0)
    assert os.path.getsize(sparse_dir / "dst") == 0


def _zip64_members(path: Path) -> dict[str, zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as zf:
        return {info.filename.split("/", 1)[1]: info for info in zf.infolist()}


def test_one_tensor_over_4gib(sparse_dir: Path) -> None:
    """A 4.5 GiB uint8 tensor: to torch.save (a zip64 member), to DCP (a zip64 record), and both back to
    safetensors through our own zip reader; torch reads each output, values past 4 GiB included."""
    n = 4 * GiB + GiB // 2
    tensors: Tensors = {"big": (torch.uint8, (n,), {0: 1, 3 * GiB: 3, 4 * GiB + 5: 9, n - 1: 7})}
    src = sparse_dir / "big.safetensors"
    sparse_safetensors(src, tensors)

    ckptctl("convert", src, sparse_dir / "out.pt", "--to", "torch")
    assert_marked(torch.load(sparse_dir / "out.pt", weights_only=True, mmap=True), tensors)
    member = _zip64_members(sparse_dir / "out.pt")["data/0"]
    assert member.file_size == n and expected_crc(n, torch.uint8, tensors["big"][2]) == member.CRC
    assert allocated(sparse_dir / "out.pt") < 1 << 20  # the holes stayed holes

    ckptctl("reshard", src, sparse_dir / "dcp", "--world-size", "1")
    record = sparse_dir / "dcp" / "__0_0.distcp"  # one tensor, one rank: the record is the whole file
    assert_marked({"big": torch.load(record, weights_only=True, mmap=True)}, tensors)
    assert allocated(record) < 1 << 20
    ckptctl("convert", sparse_dir / "dcp", sparse_dir / "from-dcp.safetensors")  # the record's zip64 local header
    assert_marked_file(sparse_dir / "from-dcp.safetensors", tensors)

    ckptctl("convert", sparse_dir / "out.pt", sparse_dir / "back.safetensors")
    assert_marked_file(sparse_dir / "back.safetensors", tensors)
    assert allocated(sparse_dir / "back.safetensors") < 1 << 20


def test_member_offsets_past_4gib(sparse_dir: Path) -> None:
    """Several tensors filling 5.5 GiB: the later members start past 4 GiB (zip64 offsets in the directory);
    torch reads the archive, and so does our reader (torch -> safetensors)."""
    tensors: Tensors = {
        "a.weight": (torch.float32, (3, GiB // 4), {0: 1.5, GiB // 4 + 1: -2.0, 3 * (GiB // 4) - 1: 3.25}),
        "b.weight": (torch.bfloat16, (GiB // 2,), {5: 0.5, GiB // 2 - 1: -1.0}),
        "c.bias": (torch.int64, (5,), {0: 11, 4: -12}),
        "d.weight": (torch.float32, (GiB // 4, 2), {1: 6.0, GiB // 2 - 2: 7.0}),
        "e.bias": (torch.uint8, (3,), {1: 200}),
    }
    src = sparse_dir / "many.safetensors"
    sparse_safetensors(src, tensors)

    ckptctl("convert", src, sparse_dir / "out.pt", "--to", "torch")
    assert_marked(torch.load(sparse_dir / "out.pt", weights_only=True, mmap=True), tensors)
    members = _zip64_members(sparse_dir / "out.pt")
    past = sorted(name for name, info in members.items() if info.header_offset > U32)
    assert "data/0" not in past and len([name for name in past if name.startswith("data/")]) >= 2, past
    assert "version" in past and "byteorder" in past
    assert allocated(sparse_dir / "out.pt") < 1 << 20

    ckptctl("convert", sparse_dir / "out.pt", sparse_dir / "back.safetensors")
    assert_marked_file(sparse_dir / "back.safetensors", tensors)
