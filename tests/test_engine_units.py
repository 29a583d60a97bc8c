"""In-process unit tests of the engine's shared mechanisms: the format registry and detection, tensor I/O,
zip64 records (written and parsed), the dtype/stride helpers, the error mapping and progress callbacks."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from converters import (
    BaseReader,
    CheckpointIndex,
    FormatError,
    OptionError,
    Progress,
    SourceError,
    TargetError,
    detect,
    dtypes,
    load_index,
    register_format,
    storage,
    tensorio,
    torchzip,
)
from converters.copier import Copier, SourceRange
from converters.formats import DETECT_ORDER, FORMATS, reader_class
from converters.formats.base import check_index
from converters.index import ByteRange, Chunk, TensorEntry
from converters.output import open_output
from converters.rangeread import RangeReader
from converters.writers.torchsave import TorchPart
from converters.zipwriter import ZipWriter

# ----------------------------------------------------------------------------- registry


class ToyReader(BaseReader):
    """A throwaway format: a folder with `weights.toy`, a JSON list of [name, dtype, shape, file, offset]."""

    format = "toy"

    @classmethod
    def sniff(cls, uri: str, names: list[str] | None) -> bool:
        return names is not None and "weights.toy" in names

    def read(self, locate: bool = True) -> CheckpointIndex:
        index = CheckpointIndex(uri=self.uri, format=self.format)
        for name, dtype, shape, file, offset in json.loads(Path(self.uri, "weights.toy").read_text()):
            entry = TensorEntry(name, dtype, tuple(shape), [])
            entry.chunks.append(Chunk((0,) * len(shape), tuple(shape),
                                      ByteRange(str(Path(self.uri, file)), offset, entry.nbytes)))
            index.tensors[name] = entry
        return index


@pytest.fixture
def toy() -> object:
    register_format("toy", ToyReader)
    yield
    del FORMATS["toy"]
    DETECT_ORDER.remove("toy")


def test_a_new_format_is_one_class_and_one_line(toy: object, tmp_path: Path) -> None:
    data = torch.arange(12, dtype=torch.int32)
    (tmp_path / "blob").write_bytes(data.numpy().tobytes())
    (tmp_path / "weights.toy").write_text(json.dumps([["w", "int32", [3, 4], "blob", 0]]))
    assert detect(str(tmp_path)) == "toy"
    index = load_index(str(tmp_path))
    out = memoryview(bytearray(48))
    with RangeReader() as reader:
        tensorio.read_box(reader, index.tensors["w"], ((0, 0), (3, 4)), out)
    assert bytes(out) == data.numpy().tobytes()
    # the base class runs the shared checks for the new format too: a chunk that does not tile its shape
    index = ToyReader(str(tmp_path), RangeReader()).read()
    index.tensors["w"].chunks[0] = Chunk((1, 0), (3, 4), index.tensors["w"].chunks[0].data)
    with pytest.raises(FormatError, match=r"chunk \(1, 0\)\+\(3, 4\) of 'w' lies outside its shape") as info:
        check_index(index, str(tmp_path))
    assert (info.value.uri, info.value.key) == (str(tmp_path), "w")
    (tmp_path / "weights.toy").write_text(json.dumps([["w", "int64", [3, 4], "blob", 0]]))  # 48 bytes, not 96
    index = ToyReader(str(tmp_path), RangeReader()).read()
    index.tensors["w"].chunks[0] = Chunk((0, 0), (3, 4), ByteRange(str(tmp_path / "blob"), 0, 48))
    with pytest.raises(FormatError, match=r"blob: chunk \(0, 0\) of 'w' holds 48 bytes, but int64\[3, 4\] needs 96"):
        check_index(index, str(tmp_path))


def test_registered_format_is_in_the_job_schema(tmp_path: Path) -> None:
    """The service derives its format choices from the registry: a format registered before it is imported
    is a valid `source_format` of every job kind."""
    code = ("from converters import BaseReader, register_format\n"
            "class ToyReader(BaseReader): format = 'toy'\n"
            "register_format('toy', ToyReader)\n"
            "from ckpt_service.job_requests import ConvertRequest as R\n"
            "print(R.model_validate({'source_format': 'toy'}).source_format, 'toy' in str(R.model_json_schema()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "toy True"


def test_register_format_refuses_duplicates_and_names_the_install() -> None:
    with pytest.raises(ValueError, match="format 'dcp' is already registered"):
        register_format("dcp", ToyReader)
    register_format("optional-toy", "no_such_package_xyz.reader:Reader", install="pip install no-such-package-xyz")
    try:
        with pytest.raises(OptionError, match=r"format 'optional-toy' needs no_such_package_xyz, which is not "
                                              r"installed; install it with `pip install no-such-package-xyz`"):
            reader_class("optional-toy")
        assert "optional-toy" in DETECT_ORDER  # detection skips it while its package is missing
    finally:
        del FORMATS["optional-toy"]
        DETECT_ORDER.remove("optional-toy")


# ----------------------------------------------------------------------------- detection


def _t() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 2)}


LAYOUTS = {
    "torch-file": (lambda p: torch.save(_t(), p / "model.pt"), "model.pt", "torch"),
    "torch-folder": (lambda p: torch.save(_t(), p / "model.bin"), "", "torch"),
    "rank-file": (lambda p: torch.save(_t(), p / "rank0.pt"), "rank0.pt", "rank-files"),
    "rank-folder": (lambda p: [torch.save(_t(), p / f"model_rank{r}.pt") for r in (0, 1)], "", "rank-files"),
    "safetensors-file": (lambda p: safetensors.torch.save_file(_t(), str(p / "m.safetensors")), "m.safetensors",
                         "safetensors"),
    "safetensors-folder": (lambda p: safetensors.torch.save_file(_t(), str(p / "m.safetensors")), "", "safetensors"),
    "dcp": (lambda p: dcp.save(_t(), checkpoint_id=str(p)), "", "dcp"),
    "lightning": (lambda p: (dcp.save(_t(), checkpoint_id=str(p)), torch.save({}, p / "meta.pt")), "", "lightning"),
    "accelerate": (lambda p: dcp.save(_t(), checkpoint_id=str(p / "pytorch_model_fsdp_0")), "", "accelerate"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_detect_names_each_layout(layout: str, tmp_path: Path) -> None:
    make, member, expected = LAYOUTS[layout]
    make(tmp_path)
    assert detect(str(tmp_path / member) if member else str(tmp_path)) == expected


@pytest.mark.parametrize(("make", "point", "message"), [
    (lambda p: dcp.save(_t(), checkpoint_id=str(p / "step1")), "", "looks like the parent of DCP checkpoints. "
     "Point at one of the sub-folders: step1"),
    (lambda p: [torch.save(_t(), p / n) for n in ("a.pt", "b.pt")], "", r"several torch.save files \(a.pt, b.pt\)"),
    (lambda p: (p / "notes.txt").write_text("x"), "", r"no checkpoint found \(no .metadata"),
    (lambda p: (p / "notes.txt").write_text("x"), "notes.txt", "unknown file type; pass source_format with one of dcp"),
    (lambda p: dcp.save(_t(), checkpoint_id=str(p)), ".metadata", "point at the folder that holds .metadata"),
    (lambda p: None, "missing", "does not exist; check the path"),
])
def test_detect_says_what_to_point_at(make: object, point: str, message: str, tmp_path: Path) -> None:
    make(tmp_path)  # type: ignore[operator]
    uri = str(tmp_path / point) if point else str(tmp_path)
    with pytest.raises(SourceError, match=message) as info:
        detect(uri)
    assert info.value.uri == uri


# ----------------------------------------------------------------------------- tensor I/O


def test_read_box_from_chunks_and_a_strided_view(tmp_path: Path) -> None:
    """A tensor in two row chunks, one stored transposed (strided): any box reads as torch slices it."""
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    top, bottom = full[:2].contiguous(), full[2:].t().contiguous()  # bottom stored column-major
    (tmp_path / "a").write_bytes(top.numpy().tobytes())
    (tmp_path / "b").write_bytes(b"\0" * 4 + bottom.numpy().tobytes())
    entry = TensorEntry("w", "float32", (6, 8), [
        Chunk((0, 0), (2, 8), ByteRange(str(tmp_path / "a"), 0, 64)),
        Chunk((2, 0), (4, 8), ByteRange(str(tmp_path / "b"), 4, 128, stride=(1, 4))),
    ])
    with RangeReader() as reader:
        for box in [((0, 0), (6, 8)), ((1, 2), (3, 5)), ((3, 0), (2, 8)), ((5, 7), (1, 1))]:
            out = memoryview(bytearray(dtypes.numel(box[1]) * 4))
            tensorio.read_box(reader, entry, box, out)
            (r, c), (h, w) = box
            assert bytes(out) == full[r:r + h, c:c + w].contiguous().numpy().tobytes(), box


def test_slabs_tile_the_shape_within_the_budget() -> None:
    boxes = list(tensorio.slabs((5, 3, 4), 4, 40))  # a 3x4 float32 row block is 48 bytes > 40: split deeper
    assert boxes[:2] == [((0, 0, 0), (1, 2, 4)), ((0, 2, 0), (1, 1, 4))]
    assert sum(dtypes.numel(s) for _, s in boxes) == 60
    assert all(dtypes.numel(s) * 4 <= 40 for _, s in boxes)
    assert list(tensorio.slabs((), 4, 1)) == [((), ())]
    assert list(tensorio.slabs((0, 3), 4, 100)) == []


@pytest.mark.parametrize(("src", "dst"), [("float32", "bfloat16"), ("float64", "float16"), ("float32", "float16"),
                                          ("bfloat16", "float32")])
def test_cast_rounds_as_torch(src: str, dst: str) -> None:
    values = torch.tensor([0.0, -1.5, 1 / 3, 65504.0, 1e6, 1e-8, float("inf"), float("nan"), 3.14159265358979],
                          dtype=getattr(torch, src))
    got = bytes(tensorio.cast(values.numpy().tobytes() if src != "bfloat16" else
                              values.view(torch.int16).numpy().tobytes(), src, dst))
    want = values.to(getattr(torch, dst))
    ours = torch.frombuffer(bytearray(got), dtype=want.dtype)
    assert torch.equal(ours.isnan(), want.isnan())  # NaN stays NaN (torch's NaN bits differ by path: not compared)
    keep = ~want.isnan()
    assert ours[keep].view(torch.uint8 if dst != "float32" else torch.int32).tolist() == \
        want[keep].view(torch.uint8 if dst != "float32" else torch.int32).tolist()


def test_stride_helpers() -> None:
    t = torch.empty(2, 3, 4)
    assert dtypes.row_major((2, 3, 4)) == t.stride()
    assert dtypes.is_row_major((2, 3, 4), t.stride()) and not dtypes.is_row_major((4, 3), t[0].t().stride())
    assert dtypes.is_row_major((2, 1, 4), (4, 99, 1))  # a size-1 dimension may have any stride
    span = dtypes.strided_span((3, 4), (10, 2))
    assert span == 27
    torch.empty(span).as_strided((3, 4), (10, 2))  # torch agrees: the view fits in `span` elements, not one fewer
    with pytest.raises(RuntimeError):
        torch.empty(span - 1).as_strided((3, 4), (10, 2))
    assert dtypes.strided_span((3, 0), (10, 2)) == 0


def test_damaged_safetensors_dtype_is_a_format_error(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "X99", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(FormatError, match=r"m.safetensors \('w'\): unsupported dtype 'X99'") as info:
        load_index(str(tmp_path / "m.safetensors"))
    assert (info.value.uri, info.value.key) == (str(tmp_path / "m.safetensors"), "w")


# ----------------------------------------------------------------------------- zip64


def test_zip64_extra_field_parsing() -> None:
    """Only the fields the header marks 0xFFFFFFFF come from the zip64 extra, in the spec's order; other
    extra blocks before it (torch's alignment padding) are skipped."""
    pad = struct.pack("<HH", 0x4246, 3) + b"ZZZ"
    both = pad + struct.pack("<HHQQQ", 1, 24, 5 << 32, 6 << 32, 7 << 32)
    assert torchzip._zip64_sizes(both, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF) == (6 << 32, 5 << 32, 7 << 32)
    offset_only = struct.pack("<HHQ", 1, 8, 9 << 32)
    assert torchzip._zip64_sizes(offset_only, 10, 10, 0xFFFFFFFF) == (10, 10, 9 << 32)
    assert torchzip._zip64_sizes(pad, 10, 11, 12) == (10, 11, 12)


def test_zip64_records_written_past_4gib_are_read_by_zipfile_and_by_us(tmp_path: Path) -> None:
    """A member over 4 GiB (a sparse hole, so no bytes are written) and one after it at an offset past 4 GiB:
    our writer's zip64 extras and end records are what Python's zipfile and our own reader parse."""
    big = (1 << 32) + 64
    path = tmp_path / "big.pt"
    with open(path, "wb") as fh:
        writer = ZipWriter(fh, "archive")
        writer.write_member("data/0", [SourceRange("/dev/zero", 0, big)], big, copy_range=lambda chunk, fd, at, crc: 0)
        writer.add("data/1", b"tail bytes")
        length = writer.close()
    assert path.stat().st_size == length and path.stat().st_blocks * 512 < 1 << 20  # sparse
    with zipfile.ZipFile(path) as zf:
        info = {i.filename: i for i in zf.infolist()}
        assert info["archive/data/0"].file_size == big
        assert info["archive/data/1"].header_offset > 1 << 32
        assert zf.read("archive/data/1") == b"tail bytes"  # CRC checked by zipfile
    with RangeReader() as reader:
        reads = torchzip._Reads(reader, str(path))
        members = {m.name: m for m in torchzip._central_members(reads, 0, length, "big.pt")}
        assert members["archive/data/0"].size == big
        tail = members["archive/data/1"]
        assert reader.read(str(path), tail.data_offset, tail.size) == b"tail bytes"


# ----------------------------------------------------------------------------- errors and progress


def test_source_side_os_error_names_the_source(tmp_path: Path) -> None:
    target = str(tmp_path / "out")
    with pytest.raises(SourceError, match=r"/src/a.bin: cannot read \(Input/output error\); check the source /src"), \
            storage.io_errors("/src", target):
        raise OSError(5, "Input/output error", "/src/a.bin")
    for name in (target + "/model.safetensors", str(tmp_path / ".out.tmp-1234abcd" / "x"), None):
        with pytest.raises(TargetError, match=r"/out: No space left on device") as info, \
                storage.io_errors("/src", target):
            raise OSError(28, "No space left on device", name)
        assert info.value.uri == target


def test_progress_callbacks_run_one_at_a_time() -> None:
    inside, overlaps, seen = [0], [0], []

    def callback(p: Progress) -> None:
        inside[0] += 1
        overlaps[0] += inside[0] > 1
        seen.append(p.done_bytes)
        time.sleep(0.0005)
        inside[0] -= 1

    progress = Progress(total_bytes=800, callback=callback)
    threads = [threading.Thread(target=lambda: [progress.add(1) for _ in range(100)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps[0] == 0
    assert seen == list(range(1, 801))  # each call sees the count of its own step


def test_torch_file_filled_in_parallel_equals_the_streamed_one(tmp_path: Path) -> None:
    """A local torch.save output is laid out first and its records filled side by side; the bytes must be
    exactly those the one-pass stream writes, every CRC-32 right (zipfile checks them), and torch must load it."""
    gen = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(257, 33, generator=gen), "b": torch.randn(5, generator=gen).to(torch.bfloat16),
             "c": torch.arange(12, dtype=torch.int64).reshape(3, 4), "d": torch.tensor(2.5),
             "e": torch.randn(1000, 7, generator=gen).to(torch.float16)}
    dcp.save(state, checkpoint_id=str(tmp_path / "src"))
    index = load_index(str(tmp_path / "src"))
    written = {}
    for name, threads in (("parallel.pt", 3), ("streamed.pt", 0)):
        target = tmp_path / name
        with RangeReader() as reader, open_output(str(target), False, "torch", single_file=True) as out:
            part = TorchPart(list(index.tensors.values()), [], None, serial="0" * 32)
            if threads:
                with ThreadPoolExecutor(threads) as pool:
                    part.run(out, Copier(reader), pool)
            else:
                part.run(out, Copier(reader), None)
        written[name] = target.read_bytes()
    assert written["parallel.pt"] == written["streamed.pt"]
    with zipfile.ZipFile(tmp_path / "parallel.pt") as archive:
        assert archive.testzip() is None
    loaded = torch.load(tmp_path / "parallel.pt", weights_only=True)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)


# --- pickles and manifests written fast: the same bytes as the reference writers ----------------------------


def test_pickle_writer_writes_the_bytes_the_pure_python_pickler_writes() -> None:
    """`picklewriter.dumps` writes common values itself, one call each: byte for byte what `pickle`'s own
    pure-Python pickler (the reference, which still writes the other values) writes, and Python reads it back."""
    import io
    import math
    import pickle

    from converters import picklewriter as pw
    from converters.unpickle import Device, DType, OpaqueBytes, OrderedDictStub, Size

    odict = OrderedDictStub()
    odict["w"] = [1, 2]
    odict.attrs = {"": {"version": 1}}
    plain = {"ints": [0, 1, 255, 256, 65535, 65536, -1, -129, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**70, -2**80],
             "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, 1e-300], "text": ["", "a", "\u00e9\u4e2d", "x" * 300],
             "flags": (None, True, False), "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
             "long": list(range(2001)), "wide": {f"k{i}": i for i in range(1001)}, "exact": list(range(1000)),
             "bytes": b"\x00\xff", "set": {1, 2}, "complex": 1 + 2j, "nested": {"a": [[{"b": ({},)}]]}}
    marked = {"plain": plain, "dtype": DType("bfloat16"), "size": Size((2, 3)), "device": Device("cuda:0"),
              "odict": odict, "bytesio": OpaqueBytes(b"data", 1),
              "record": pw.tensor("0", "float8_e4m3fn", (4, 8)), "legacy": pw.tensor("1", "float32", (3,)),
              "obj": pw.Obj(pw.Global("m", "C"), {"x": pw.Call(pw.Global("m", "f"), (1,))}),
              "pairs": pw.Pairs([(pw.Obj(pw.Global("m", "K"), {}), 1), ("k", 2)])}
    for value in (plain, marked):
        buf = io.BytesIO()
        reference = pw._Pickler(buf, protocol=2)
        reference.fast = True
        reference.dump(value)
        assert pw.dumps(value) == buf.getvalue()
    assert pickle.loads(pw.dumps(plain)) == plain
    assert pw.tensor_pickle("0", "float32", (3,)) == pw.dumps(pw.tensor("0", "float32", (3,)))
    with pytest.raises(FormatError, match="entry 'x': cannot write a object value"):
        pw.dumps({"a": [object()]}, label="entry 'x'")


def test_manifest_json_is_the_text_json_dumps_writes() -> None:
    import math

    from converters.jsonsafe import dumps_indented

    doc = {"s": "a\"\\\n\u00e9\ud800", "n": [None, True, False, 0, -7, 2**70, 0.1, -0.0, math.inf, -math.inf],
           "e": [[], {}, ()], "t": (1, (2, [3, {"x": {}}])), 3: "int key", 2.5: "float key", True: "bool key",
           None: "none key", "nan": math.nan}
    assert dumps_indented(doc) == json.dumps(doc, indent=2)
    with pytest.raises(TypeError, match="set is not JSON serializable"):  # handed to json.dumps, which refuses it
        dumps_indented({"x": {1, 2}})
