"""Inputs that make the work grow faster than the input, through the real `ckptctl`: each must be read or refused
with one line (exit code 2) in bounded time and memory.

- a torch.save zip whose directory repeats an entry (the member-bounds check was quadratic in the entries);
- pickles that build far more objects than their bytes justify (empty sets: ~340 bytes of memory per byte);
- tensor views that claim more elements than their storage holds (a 4-byte storage seen as 65536 x 65536).
"""

from __future__ import annotations

import os
import pickle
import resource
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from converters import pickle_vm, unpickle
from converters.errors import FormatError

TIMEOUT = 30  # seconds; each case takes under 3 s when the work is bounded


def run_cli(args: list[str], address_space: int = 1 << 30, env: dict[str, str] | None = None,
            timeout: int = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """The real `ckptctl` in a subprocess, its address space capped at `address_space` bytes."""
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_CPU, (timeout, timeout))

    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=timeout,
                          preexec_fn=limits)


def refused(proc: subprocess.CompletedProcess[str], *expect: str) -> str:
    """The one error line of a refusal (exit code 2), which must hold each of `expect`."""
    said = f"exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"
    assert proc.returncode == 2, said
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), said
    for text in expect:
        assert text in lines[0], said
    return lines[0]


# --- zip directories ----------------------------------------------------------------------------------------


def _directory(raw: bytes) -> tuple[int, list[bytes]]:
    """(offset, records) of a zip's central directory."""
    at = raw.rfind(b"PK\x05\x06")
    entries, _, offset = struct.unpack_from("<HII", raw, at + 10)
    records, pos = [], offset
    for _ in range(entries):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, pos + 28)
        end = pos + 46 + name_len + extra_len + comment_len
        records.append(raw[pos:end])
        pos = end
    return offset, records


def _write_directory(path: Path, body: bytes, offset: int, records: list[bytes]) -> None:
    """Replace the directory of the zip `body` (it starts at `offset`) with `records` (zip64 when that many)."""
    directory, n = b"".join(records), len(records)
    if n < 0xFFFF:
        end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(directory), offset, 0)
    else:
        end = (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(directory), offset)
               + struct.pack("<IIQI", 0x07064B50, 0, offset + len(directory), 1)
               + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    path.write_bytes(body[:offset] + directory + end)


@pytest.mark.slow
@pytest.mark.parametrize("entries", [65_534, 300_000])
def test_zip_directory_repeating_an_entry_is_refused_at_once(entries: int, tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    raw = path.read_bytes()
    offset, records = _directory(raw)
    _write_directory(path, raw, offset, records + [records[0]] * (entries - len(records)))
    refused(run_cli(["inspect", str(path)]), str(path), "'model/data.pkl' is listed twice")


@pytest.mark.slow
def test_zip_of_300000_members_is_read_in_seconds(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    with zipfile.ZipFile(path, "a") as archive:  # torch.save archives are stored (uncompressed) zips
        for i in range(300_000):
            archive.writestr(f"model/extra/{i}", b"")
    proc = run_cli(["inspect", str(path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tensors: 1" in proc.stdout and "total_bytes: 16 " in proc.stdout, proc.stdout


# --- pickles that build more than their size justifies -------------------------------------------------------


def _empty_sets(n: int) -> bytes:
    """A pickle of {"x": [set(), set(), ...]}: one byte per set, each about 216 bytes of memory (and bookkeeping)."""
    return b"\x80\x04}(\x8c\x01x](" + b"\x8f" * n + b"eu."


def _torch_file_with_pickle(path: Path, pkl: bytes) -> None:
    """A torch.save archive whose data.pkl is `pkl` (the other members as torch writes them)."""
    torch.save({"w": torch.arange(4.0)}, path)
    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members:
            archive.writestr(name, pkl if name.endswith("/data.pkl") else data)


def _dcp_with_metadata(folder: Path, pkl: bytes) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(folder))
    (folder / ".metadata").write_bytes(pkl)
    return folder / ".metadata"


@pytest.mark.slow
def test_data_pkl_of_empty_sets_is_refused_within_its_budget(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    _torch_file_with_pickle(path, _empty_sets(1 << 20))  # 1 MiB: 354 MB of memory before
    refused(run_cli(["inspect", str(path)], address_space=1 << 30), str(path), "memory budget",
            "CKPT_MAX_PICKLE_MEMORY")


@pytest.mark.slow
def test_dcp_metadata_of_empty_sets_is_refused_within_its_budget(tmp_path: Path) -> None:
    metadata = _dcp_with_metadata(tmp_path / "ckpt", _empty_sets(3 << 20))  # 3 MiB: 1.1 GB before
    refused(run_cli(["inspect", str(tmp_path / "ckpt")], address_space=1 << 30), str(metadata), "memory budget")


@pytest.mark.slow
def test_running_out_of_memory_in_a_pickle_is_one_line(tmp_path: Path) -> None:
    """A budget raised past the memory there is: the MemoryError is one line naming the file, exit code 2 (what
    was built is dropped first: it was kept while the error was shown, which then failed with a traceback)."""
    metadata = _dcp_with_metadata(tmp_path / "ckpt", _empty_sets(8 << 20))
    proc = run_cli(["inspect", str(tmp_path / "ckpt")], address_space=2 << 30,
                   env={"CKPT_MAX_PICKLE_MEMORY": str(1 << 40)}, timeout=90)
    refused(proc, str(metadata), "needs more memory than is available")


def test_memory_budget_is_a_setting() -> None:
    from converters.config import EngineConfig, use

    data = _empty_sets(100_000)  # 100 kB, 40 MB of objects: within the floor every pickle is allowed
    assert len(unpickle.loads(data, "x")["x"]) == 100_000
    with use(EngineConfig.from_env({"CKPT_MAX_PICKLE_MEMORY": str(10 << 20)})), \
            pytest.raises(FormatError, match="x: the pickle of 100012 bytes builds more than 10485760 bytes"):
        unpickle.loads(data, "x")


def test_honest_dcp_metadata_is_well_within_its_budget() -> None:
    """DCP's `.metadata` is the densest honest pickle we know (many small objects per byte): it is charged well
    under the bytes per byte of pickle that the budget allows."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    tensors, storage = {}, {}
    for i in range(200):
        fqn = f"model.layers.{i}.mlp.weight"
        offsets = [torch.Size([j * 64, 0]) for j in range(16)]
        tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([1024, 1024]),
                                             [ChunkStorageMetadata(o, torch.Size([64, 1024])) for o in offsets])
        for j, o in enumerate(offsets):
            storage[MetadataIndex(fqn, o, j)] = _StorageInfo(f"__{j}_0.distcp", i * 100_000, 131_772)
    data = pickle.dumps(Metadata(state_dict_metadata=tensors, storage_data=storage))
    machine = pickle_vm.Interpreter(data, "x", unpickle.BASE_ALLOWED)
    assert len(machine.load().get("state_dict_metadata")) == 200
    assert machine.spent < len(data) * pickle_vm.MEMORY_PER_BYTE / 1.5, machine.spent / len(data)


# --- views larger than their storage -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("command", "view", "expect"), [
    ("inspect", lambda: torch.zeros(1).expand(65536, 65536), "is a broadcast"),
    ("export", lambda: torch.zeros(1).expand(65536, 65536), "is a broadcast"),
    ("export", lambda: torch.zeros(3).expand(4, 2, 3), "is a broadcast"),
    ("export", lambda: torch.zeros(131071).as_strided((65536, 65536), (1, 1)), "claims 17179869184 bytes")],
    ids=["broadcast-inspect", "broadcast-export", "small-broadcast", "overlap"])
def test_view_claiming_more_than_its_storage_is_refused(command: str, view: object, expect: str,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4.0), "big": view()}, path)  # type: ignore[operator]
    out = tmp_path / "out"
    proc = run_cli([command, str(path)] + ([str(out)] if command == "export" else []))
    refused(proc, str(path), "tensor 'big'", expect)
    assert not out.exists()


def test_record_pickles_kept_for_reuse_are_small(tmp_path: Path) -> None:
    """DCP records' data.pkl are unpickled once per distinct bytes and kept: a padded one (any size up to the
    metadata cap, thousands of records) is read but never kept, so a process does not keep what it read."""
    from converters import torchzip
    from converters.rangeread import RangeReader

    path = tmp_path / "record.pt"
    torch.save(torch.arange(4.0), path)
    with zipfile.ZipFile(path) as archive:
        pkl = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    padding = b"X" + struct.pack("<I", 1 << 20) + b"p" * (1 << 20) + b"0"  # a 1 MiB string, popped
    _torch_file_with_pickle(path, pkl[:2] + padding + pkl[2:])
    torchzip._RECORD_PICKLES.clear()
    archive = torchzip.read_archive(RangeReader(), str(path), single_storage=True)
    assert isinstance(archive.obj, unpickle.TensorRef) and archive.obj.shape == (4,)
    assert not torchzip._RECORD_PICKLES
