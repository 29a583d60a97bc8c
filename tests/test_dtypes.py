"""Every dtype torch saves: read from torch.save and dcp.save, written back so that torch itself loads it.

The checkpoints are made here with torch.save / dcp.save (random bit patterns, so NaNs and odd
float8 codes are included); outputs are loaded with torch.load(weights_only=True), dcp.load and
safetensors' safe_open and compared bit for bit.
"""

from __future__ import annotations

import io
import pickletools
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converters import dtypes

from .conftest import ckptctl

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

DTYPES = dtypes.names()
BITS = [d for d in DTYPES if d.startswith("bits")]  # torch.save holds them; DCP cannot
SAFETENSORS = [d for d in DTYPES if d not in BITS and d not in
               ("complex128", "complex32", "float8_e8m0fnu", "float4_e2m1fn_x2")]
LONG_KEY = "k" * 800


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype).reshape(shape)


def state_dict(with_bits: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {f"t_{d}": _random(getattr(torch, d), (3, 4), gen) for d in DTYPES if with_bits or d not in BITS}
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 5)
    sd[LONG_KEY] = torch.arange(6, dtype=torch.int64)
    fsdp1_style = torch.arange(4, dtype=torch.float32)
    fsdp1_style._has_been_cloned = True  # type: ignore[attr-defined]  # pickled via _rebuild_from_type_v2, as FSDP1
    sd["fsdp1_style"] = fsdp1_style
    return sd


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (bitwise, so NaN payloads count); torch.equal where defined."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name[:40]
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name[:40]
        if tensor.dtype in (torch.float32, torch.int64, torch.bool, torch.complex64, torch.bfloat16):
            assert torch.equal(got[name], tensor), name[:40]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dtypes")
    torch.save(state_dict(), root / "all.pt")
    assert b"_rebuild_from_type_v2" in _data_pkl(root / "all.pt")
    dcp.save(state_dict(with_bits=False), checkpoint_id=root / "dcp")
    return {"torch": root / "all.pt", "dcp": root / "dcp"}


def _dcp_load(path: Path, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=path)
    return got


@pytest.mark.parametrize("source", ["torch", "dcp"])
def test_convert_to_torch_loads_in_torch(sources: dict[str, Path], tmp_path: Path, source: str) -> None:
    out = tmp_path / "out.pt"
    ckptctl("convert", sources[source], out, "--to", "torch", "-q")
    assert_exact(torch.load(out, weights_only=True, mmap=True), state_dict(with_bits=source == "torch"))


def test_reshard_loads_in_dcp(sources: dict[str, Path], tmp_path: Path) -> None:
    ckptctl("reshard", sources["dcp"], tmp_path / "ws3", "--world-size", "3", "-q")
    want = state_dict(with_bits=False)
    assert_exact(_dcp_load(tmp_path / "ws3", want), want)


def test_reshard_of_torch_save_loads_in_dcp_and_refuses_bits(sources: dict[str, Path], tmp_path: Path) -> None:
    proc = ckptctl("reshard", sources["torch"], tmp_path / "bad", "--world-size", "2", "-q", check=False)
    assert proc.returncode == 2 and "bits" in proc.stderr and "torch.distributed.checkpoint cannot" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
    ckptctl("reshard", sources["torch"], tmp_path / "ok", "--world-size", "2", "--exclude", "t_bits*", "-q")
    want = state_dict(with_bits=False)
    assert_exact(_dcp_load(tmp_path / "ok", want), want)


def test_export_exact_where_safetensors_can_and_one_line_refusal_where_not(sources: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    from safetensors import safe_open

    proc = ckptctl("export", sources["torch"], tmp_path / "all", "-q", check=False)
    assert proc.returncode == 2 and "'t_complex128' is complex128, which safetensors cannot hold" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "all").exists()
    excludes = [arg for d in DTYPES if d not in SAFETENSORS for arg in ("--exclude", f"t_{d}")]
    ckptctl("export", sources["dcp"], tmp_path / "st", "-q", *excludes)
    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as fh:
        got = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    want = {k: v for k, v in state_dict(with_bits=False).items() if k.removeprefix("t_") not in DTYPES
            or k.removeprefix("t_") in SAFETENSORS}
    assert_exact(got, want)


def _globals_and_storages(pkl: bytes) -> tuple[list[str], list[tuple]]:
    """The GLOBAL names in order of first use, and the persistent ids (storage type, location, size)."""
    names: list[str] = []
    pids: list[tuple] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(pkl):
        if op.name == "GLOBAL" and arg not in names:
            names.append(arg)
        elif op.name in ("BINUNICODE", "SHORT_BINUNICODE"):
            strings.append(arg)
        elif op.name == "BINPERSID":
            pids.append(tuple(strings[-2:]))
    return names, pids


def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2fnuz", "uint16", "uint64",
                                   "complex32", "complex128", "bool", "bits8"])
def test_writer_emits_the_pickle_torch_save_writes(tmp_path: Path, dtype: str) -> None:
    """Same globals (UntypedStorage + dtype for the new dtypes, never an invented *Storage class)."""
    tensor = _random(getattr(torch, dtype), (2, 3), torch.Generator().manual_seed(1))
    torch.save({"x": tensor}, tmp_path / "src.pt")
    ckptctl("convert", tmp_path / "src.pt", tmp_path / "out.pt", "--to", "torch", "-q")
    theirs, ours = _globals_and_storages(_data_pkl(tmp_path / "src.pt")), _globals_and_storages(
        _data_pkl(tmp_path / "out.pt"))
    assert ours == theirs
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["x"].view(torch.uint8),
                       tensor.view(torch.uint8))


def test_dtype_table_covers_every_dtype_torch_saves() -> None:
    for dtype in {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}:
        try:
            buf = io.BytesIO()
            torch.save(torch.empty(2, dtype=dtype), buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
        except (RuntimeError, KeyError, TypeError):  # quantized, uint1..7, int1..7: torch cannot either
            continue
        assert dtypes.canonical(str(dtype)) == str(dtype).removeprefix("torch."), dtype
    for name in DTYPES:
        dtype = getattr(torch, name)
        assert dtypes.itemsize(name) == torch.empty(0, dtype=dtype).element_size(), name
        typed = torch.storage._dtype_to_storage_type_map().get(dtype)
        assert dtypes.storage_class(name) == typed, name
    buf = io.BytesIO()
    torch.save(torch.zeros(1, dtype=torch.float8_e4m3fn), buf)
    assert b"Float8" not in buf.getvalue()
