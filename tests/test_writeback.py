"""Early writeback (`converters.writeback`): started once per `EVERY` bytes of each output file, never an error,
and a copy through the writers' window buffer writes the exact bytes, starting the writeback as windows land."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converters import writeback
from converters.copier import Copier
from converters.formats import load_index
from converters.rangeread import RangeReader


def _recording(monkeypatch: pytest.MonkeyPatch, every: int) -> list[tuple[int, int, int, int]]:
    calls: list[tuple[int, int, int, int]] = []
    real = writeback._SYNC_FILE_RANGE

    def record(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((fd, offset, length, flags))
        return real(fd, offset, length, flags) if real is not None else 0

    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", record)
    monkeypatch.setattr(writeback, "EVERY", every)
    monkeypatch.setattr(writeback, "_written", {})
    return calls


def test_writeback_starts_once_per_every_bytes_of_each_file(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording(monkeypatch, 100)
    for fd, n in ((7, 60), (8, 99), (7, 39), (7, 1), (8, 1), (7, 250), (7, 99)):
        writeback.landed(fd, n)
    # fd 7: 60+39+1 reaches 100, then 250 alone; fd 8: 99+1. Each start covers the whole file, asynchronously.
    assert calls == [(7, 0, 0, 2), (8, 0, 0, 2), (7, 0, 0, 2)]
    assert writeback._written == {7: 99, 8: 0}


def test_writeback_refused_or_missing_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(writeback, "EVERY", 1)
    monkeypatch.setattr(writeback, "_written", {})
    read, write = os.pipe()  # sync_file_range refuses a pipe (ESPIPE): -1, ignored
    try:
        writeback.landed(write, 1)
    finally:
        os.close(read)
        os.close(write)
    writeback.landed(write, 1)  # a closed fd (EBADF): ignored too
    with open(tmp_path / "f", "wb") as fh:
        fh.write(b"x" * 4096)
        fh.flush()
        writeback.landed(fh.fileno(), 4096)  # a real file: the call itself succeeds where there is one
        monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", None)  # no such call in this C library
        writeback.landed(fh.fileno(), 4096)
    assert (tmp_path / "f").read_bytes() == b"x" * 4096


def test_copy_starts_writeback_as_windows_land_and_writes_the_exact_bytes(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """A tensor several windows long (and not a multiple of one), then a small one: the file holds exactly their
    bytes, and its writeback was started once per window that landed (each window is more than `EVERY` here)."""
    calls = _recording(monkeypatch, 64 * 1024)
    gen = torch.Generator().manual_seed(36)
    state = {"w": torch.randn(3000, 401, generator=gen), "b": torch.randn(3, generator=gen)}
    dcp.save(state, checkpoint_id=str(tmp_path / "src"))
    index = load_index(str(tmp_path / "src"))
    with RangeReader() as reader, open(tmp_path / "out", "wb") as fh:
        copier = Copier(reader)
        at = 0
        for name in ("w", "b"):
            copier.write_at(fh.fileno(), at, index.tensors[name])
            at += state[name].numel() * 4
        fd = fh.fileno()
    assert (tmp_path / "out").read_bytes() == state["w"].numpy().tobytes() + state["b"].numpy().tobytes()
    windows = -(-3000 * 401 * 4 // copier_window())
    assert len(calls) == windows == 3 and {c[0] for c in calls} == {fd}


def copier_window() -> int:
    from converters import copier

    return copier._WINDOW



def test_sequential_writes_reach_the_kernel_in_steps_and_start_writeback(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """`Output.open` gives sequential writers (GGUF, DCP records, torch.save files) a `SteppedFile`: a large write
    reaches the kernel in `WRITE_STEP` pieces (larger ones make the page cache compact memory for big folios),
    small ones are still gathered by the file's buffer, every byte lands in order, and the writeback starts as
    they land."""
    from converters.output import open_output

    calls = _recording(monkeypatch, 512 << 10)
    sizes: list[int] = []

    class Counting(io.FileIO):  # the system calls the buffered file makes
        def write(self, data: Any) -> int:
            sizes.append(memoryview(data).nbytes)
            return super().write(data)

    payload = os.urandom(3 * writeback.WRITE_STEP + 1234)
    fh = writeback.SteppedFile(io.BufferedWriter(Counting(tmp_path / "f", "wb")))
    fh.write(b"head")
    fh.write(payload)
    fh.write(memoryview(payload)[:10])
    fh.close()
    assert (tmp_path / "f").read_bytes() == b"head" + payload + payload[:10]
    assert sizes == [4, *([writeback.WRITE_STEP] * 3), 1234 + 10]
    assert len(calls) == 1  # EVERY 512 KiB: reached once, by the big write
    with open_output(str(tmp_path / "o.bin"), False, "test", single_file=True) as out, out.open() as fh:
        assert isinstance(fh, writeback.SteppedFile)
        fh.write(payload)
    assert (tmp_path / "o.bin").read_bytes() == payload
