"""Reader/writer conformance: every format reads what the framework's own writer made, and what we write
loads, byte for byte, in the framework's own loader. Small checkpoints made in-process; edge tensors
included (0-d, empty, float8, complex, unsigned)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import ClassVar

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from converters import CheckpointIndex, ConvertOptions, KeyOptions, convert, detect, load_index
from converters.copier import Copier
from converters.output import open_output
from converters.plan import execute
from converters.rangeread import RangeReader
from converters.tensorio import read_box
from converters.writers import WRITERS


def _edge_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(2, 3, generator=g, dtype=torch.complex64),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "i64": torch.tensor([-(2**62), 7]),
        "flag": torch.tensor([True, False]),
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read(index: CheckpointIndex, name: str) -> bytes:
    entry = index.tensors[name]
    out = memoryview(bytearray(entry.nbytes))
    with RangeReader() as reader:
        read_box(reader, entry, ((0,) * len(entry.shape), entry.shape), out)
    return bytes(out)


class ReaderContract:
    """Subclass per format: `save` writes `tensors` with the framework's own writer."""

    format: ClassVar[str]
    skip: ClassVar[frozenset[str]] = frozenset()  # edge tensors the framework cannot write

    def save(self, tensors: dict[str, torch.Tensor], where: Path) -> Path:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in _edge_tensors().items() if k not in self.skip}

    def test_detected_and_read_exactly(self, tmp_path: Path) -> None:
        tensors = self.tensors()
        path = self.save(tensors, tmp_path / "ckpt")
        assert detect(str(path)) == self.format
        index = load_index(str(path))
        assert index.format == self.format
        assert sorted(index.tensors) == sorted(tensors)
        for name, t in tensors.items():
            entry = index.tensors[name]
            assert entry.dtype == str(t.dtype).removeprefix("torch."), name
            assert entry.shape == tuple(t.shape), name
            assert _read(index, name) == _bytes(t), name


class TestTorchSave(ReaderContract):
    format = "torch"

    def save(self, tensors: dict[str, torch.Tensor], where: Path) -> Path:
        where.mkdir()
        torch.save(tensors, where / "model.pt")
        return where / "model.pt"


class TestSafetensors(ReaderContract):
    format = "safetensors"

    def save(self, tensors: dict[str, torch.Tensor], where: Path) -> Path:
        where.mkdir()
        safetensors.torch.save_file(tensors, str(where / "model.safetensors"))
        return where


class TestDcp(ReaderContract):
    format = "dcp"

    def save(self, tensors: dict[str, torch.Tensor], where: Path) -> Path:
        dcp.save(tensors, checkpoint_id=str(where))
        return where


# ----------------------------------------------------------------------------- writers


def _source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = _edge_tensors()
    torch.save(tensors, tmp_path / "src.pt")
    return tmp_path / "src.pt", tensors


def _load_back(fmt: str, root: Path) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        return safetensors.torch.load_file(str(root / "model.safetensors"))
    if fmt == "torch":
        return torch.load(root, weights_only=True)
    state = {name: torch.empty_like(t) for name, t in _edge_tensors().items()}
    dcp.load(state, checkpoint_id=str(root))
    return state


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_writer_output_loads_in_the_consumer(fmt: str, tmp_path: Path) -> None:
    """Each writer in the table, called through the table: the consumer's loader gets the same bytes."""
    src, tensors = _source(tmp_path)
    index = load_index(str(src))
    target = tmp_path / ("out.pt" if fmt == "torch" else "out")
    with RangeReader() as reader, open_output(str(target), False, fmt, single_file=fmt == "torch") as out:
        copier = Copier(reader)
        execute(WRITERS[fmt](index, out, copier, cast_to=None, max_shard_size=1 << 30, metadata={}), out, copier)
    loaded = _load_back(fmt, target)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert _bytes(loaded[name]) == _bytes(t), name


_GOLDEN = {
    "mixed": {"b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a.bias": torch.ones(3),
              "c.step": torch.tensor(7, dtype=torch.int64), "d.half": torch.zeros(5, dtype=torch.float16)},
    "edge": _edge_tensors(),
}


@pytest.mark.parametrize("case", sorted(_GOLDEN))
def test_safetensors_bytes_are_the_reference_writers(case: str, tmp_path: Path) -> None:
    """Golden bytes: for the same dict, our whole file equals what `safetensors.torch.save_file` writes
    (header, tensor order, alignment padding and data)."""
    tensors = _GOLDEN[case]
    torch.save(tensors, tmp_path / "src.pt")
    convert(str(tmp_path / "src.pt"), str(tmp_path / "ours.safetensors"),
            ConvertOptions(keys=KeyOptions(only="all", clean=False)))
    safetensors.torch.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    ours, theirs = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "theirs.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", theirs[:8])
    assert json.loads(ours[8:8 + n]) == json.loads(theirs[8:8 + n])
    assert ours[:8 + n] == theirs[:8 + n]
    assert ours == theirs
