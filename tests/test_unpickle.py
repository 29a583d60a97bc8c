"""The closed unpickler: hostile pickles are refused quickly and import nothing; honest torch pickles are read.

Hostile pickles are written opcode by opcode (the way an attacker would); honest ones are made with
torch.save, dcp.save and FSDP1 in a subprocess.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converters.config import EngineConfig, use
from converters.errors import FormatError, UnsafePickleError
from converters.formats.torchsave import flatten
from converters.unpickle import loads, torch_storage_loader

from .conftest import ckptctl

CANARY = "canary_ckpt_module"
PROTO = b"\x80\x02"


def g(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


ODICT = g("collections", "OrderedDict") + b")R"
STORAGE = b"(" + s("storage") + g("torch", "FloatStorage") + s("0") + s("cpu") + b"K\x04tQ"
UNTYPED = b"(" + s("storage") + g("torch.storage", "UntypedStorage") + s("0") + s("cpu") + b"K\x10tQ"
V2 = g("torch._utils", "_rebuild_tensor_v2")
V3 = g("torch._utils", "_rebuild_tensor_v3")
MD = "torch.distributed.checkpoint.metadata"


def tensor_args(storage: bytes, offset: bytes = b"K\x00", size: bytes = b"K\x04\x85", stride: bytes = b"K\x01\x85",
                extra: bytes = b"") -> bytes:
    return b"(" + storage + offset + size + stride + b"\x89" + ODICT + extra + b"t"


# Each one tries to change an allow-listed global or an already referenced object, or calls a
# rebuild function with the wrong argument types. Each must fail with FormatError.
ATTACKS: dict[str, bytes] = {
    "BUILD sets torch.Size.__module__": g("torch", "Size") + b"}" + s("__module__") + s(CANARY) + b"sb.",
    "BUILD slots on torch.Size": g("torch", "Size") + b"N}" + s("__module__") + s(CANARY) + b"s\x86b.",
    "BUILD on OrderedDict class": g("collections", "OrderedDict") + b"}" + s("__module__") + s(CANARY) + b"sb.",
    "BUILD on a rebuild function": V2 + b"}" + s("__module__") + s(CANARY) + b"sb.",
    "SETITEM on torch.Size": g("torch", "Size") + s("__module__") + s(CANARY) + b"s.",
    "APPEND to torch.Size": g("torch", "Size") + s(CANARY) + b"a.",
    "BUILD on a plain dict": b"}}b.",
    "BUILD on a list": b"]}b.",
    "BUILD on a tensor": V2 + tensor_args(STORAGE) + b"R}b.",
    "OrderedDict state set twice": ODICT + b"}" + s("a") + b"Nsb}" + s("b") + b"Nsb.",
    "OrderedDict state not a dict": ODICT + s("x") + b"b.",
    "DCP stub state set twice": g(MD, "Metadata") + b")\x81}b}b.",
    "DCP stub state of wrong type": g(MD, "Metadata") + b")\x81" + s("x") + b"b.",
    "list appended to itself": b"]" + put(0) + get(0) + b"a.",
    "referenced dict mutated": b"}" + put(0) + b"]" + get(0) + b"a0" + get(0) + s("k") + s("v") + b"s.",
    "referenced list extended": b"]" + put(0) + b"]" + get(0) + b"a0" + get(0) + b"(K\x01e.",
    "SETITEM on a tuple": b"K\x01\x85K\x00K\x01s.",
    "SETITEMS on a list": b"](K\x00K\x01u.",
    "APPEND on a dict": b"}K\x01a.",
    "global stored as a value": b"}" + s("x") + g("torch", "Size") + b"s.",
    "global returned": g("torch", "Size") + b".",
    "REDUCE on a non-callable": s("x") + b")R.",
    "REDUCE with non-tuple args": g("torch", "Size") + b"NR.",
    "NEWOBJ on a function": g("torch", "Size") + b")\x81.",
    "v2 with a string storage": V2 + tensor_args(s("x")) + b"R.",
    "v2 with negative offset": V2 + tensor_args(STORAGE, offset=b"J\xff\xff\xff\xff") + b"R.",
    "v2 with string size": V2 + tensor_args(STORAGE, size=s("4")) + b"R.",
    "v2 view past its storage": V2 + tensor_args(STORAGE, size=b"K\x05\x85") + b"R.",
    "v2 size/stride rank differ": V2 + tensor_args(STORAGE, size=b"K\x02K\x02\x86") + b"R.",
    "v2 with hooks": V2 + b"(" + STORAGE + b"K\x00K\x04\x85K\x01\x85\x89}" + s("h") + b"Nst" + b"R.",
    "v2 with conjugate metadata": V2 + tensor_args(STORAGE, extra=b"}" + s("conj") + b"\x88s") + b"R.",
    "v2 with untyped storage": V2 + tensor_args(UNTYPED) + b"R.",
    "v3 with typed storage": V3 + tensor_args(STORAGE, extra=g("torch", "float32")) + b"R.",
    "v3 with string dtype": V3 + tensor_args(UNTYPED, extra=s("float32")) + b"R.",
    "from_type_v2 with builtins.set": g("torch._tensor", "_rebuild_from_type_v2") + b"(" + V2
    + g("builtins", "set") + tensor_args(STORAGE) + b"}tR.",
    "from_type_v2 with a string func": g("torch._tensor", "_rebuild_from_type_v2") + b"(" + s("f")
    + g("torch", "Tensor") + tensor_args(STORAGE) + b"}tR.",
    "parameter of a string": g("torch._utils", "_rebuild_parameter") + b"(" + s("x") + b"\x89" + ODICT + b"tR.",
    "torch.Size of strings": g("torch", "Size") + s("a") + b"\x85\x85R.",
    "torch.device of an int": g("torch", "device") + b"K\x05\x85R.",
    "layout of garbage": g("torch.serialization", "_get_layout") + s("os.system") + b"\x85R.",
    "encode of an int": g("_codecs", "encode") + b"K\x01" + s("latin1") + b"\x86R.",
    "OrderedDict with items": g("collections", "OrderedDict") + b"]\x85R.",
    "BytesIO with a string": g("_io", "BytesIO") + b")\x81" + s("x") + b"K\x00N\x87b.",
    "storage key escapes": b"(" + s("storage") + g("torch", "FloatStorage") + s("../x") + s("cpu") + b"K\x04tQ.",
    "storage location garbage": b"(" + s("storage") + g("torch", "FloatStorage") + s("0") + s("a b") + b"K\x04tQ.",
    "storage of a dtype": b"(" + s("storage") + g("torch", "float32") + s("0") + s("cpu") + b"K\x04tQ.",
    "persistent id not storage": s("module") + b"Q.",
    "hash flooding int keys": b"}(" + b"".join(b"\x8a\x09" + (i * (2**61 - 1)).to_bytes(9, "little") + b"N"
                                                for i in range(1, 4)) + b"u.",
    "hash flooding set": g("builtins", "set") + b"](" + b"\x8a\x09" + (2**61 - 1).to_bytes(9, "little") + b"e\x85R.",
    "unknown opcode": b"i" + b"os\nsystem\n.",
    "truncated": b"X\xff\x00\x00\x00abc",
    "no STOP": b"K\x01",
    "stack underflow": b"t.",
}


def _load(data: bytes) -> object:
    return loads(PROTO + data, "evil.pkl", persistent=torch_storage_loader("evil.pkl"))


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on sys.path (and in the working directory) that leaves a marker when imported."""
    marker = tmp_path / "imported"
    (tmp_path / f"{CANARY}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return marker


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_refused(name: str, canary: Path) -> None:
    start = time.process_time()  # CPU time: what the input costs, whatever else the machine runs
    with pytest.raises(FormatError, match=r"evil\.pkl"):
        _load(ATTACKS[name])
    assert time.process_time() - start < 1
    assert CANARY not in sys.modules and not canary.exists()


def test_unknown_global_is_unsafe_and_not_imported(canary: Path) -> None:
    with pytest.raises(UnsafePickleError, match=rf"{CANARY}\.run"):
        _load(g(CANARY, "run") + b")R.")
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        _load(b"\x8c\x05posix\x8c\x06system\x93.")
    assert CANARY not in sys.modules and not canary.exists()


def _torch_file(path: Path, pkl: bytes) -> Path:
    """A torch.save archive (a real one, made by torch) whose data.pkl is replaced by `pkl`."""
    buf = io.BytesIO()
    torch.save({"w": torch.ones(4)}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pkl if info.filename.endswith("data.pkl") else src.read(info))
    return path


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
def test_cli_refuses_global_mutation_in_one_line(canary: Path, tmp_path: Path) -> None:
    """The issue's attack: a state dict whose value is torch.Size with __module__ bent to a local module,
    which a writer would then pickle (importing the module). Refused; nothing imported or written."""
    pkl = PROTO + b"}(" + s("w") + V2 + tensor_args(STORAGE) + b"R" + s("size") + g("torch", "Size") + b"}" \
        + s("__module__") + s(CANARY) + b"sbu."
    src = _torch_file(tmp_path / "evil.pt", pkl)
    for command in (["convert", src, tmp_path / "out.pt", "--to", "torch"], ["reshard", src, tmp_path / "re",
                                                                             "--world-size", "2"]):
        proc = subprocess.run([sys.executable, "-m", "ckptctl", *map(str, command)], capture_output=True,
                              text=True, cwd=tmp_path, timeout=120, env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "evil.pt" in proc.stderr
    assert not canary.exists() and not (tmp_path / "out.pt").exists() and not (tmp_path / "re").exists()


def test_billion_laughs_fails_fast() -> None:
    """40 levels, each a list holding the previous one twice: 2**40 elements to walk, from 400 bytes."""
    data = b"]" + put(0)
    for i in range(1, 41):
        data += b"0](" + get(i - 1) + get(i - 1) + b"e" + put(i)
    assert len(data) < 1024
    start = time.process_time()  # CPU time: what the input costs, whatever else the machine runs
    with pytest.raises(FormatError, match="shared references"):
        _load(data + b".")
    assert time.process_time() - start < 1


@pytest.mark.parametrize("data", [
    b"(" * 200_000 + b")" + b"t" * 200_000 + b".",  # MARKs
    b"]" * 200_000 + b"a" * 199_999 + b".",  # stack
    b"]" + put(0) + b"".join(b"0]" + get(i) + b"a" + put(i + 1) for i in range(200_000)) + b".",  # memo chain
], ids=["marks", "stack", "memo-chain"])
def test_deep_nesting_is_a_format_error_not_recursion(data: bytes) -> None:
    start = time.process_time()  # CPU time: what the input costs, whatever else the machine runs
    with pytest.raises(FormatError, match="levels of nesting"):
        _load(data)
    assert time.process_time() - start < 2


@pytest.mark.parametrize(("var", "data", "message"), [
    ("CKPT_MAX_PICKLE_MEMO", b"N" + b"".join(put(i) for i in range(2000)) + b".", "memo entries"),
    ("CKPT_MAX_PICKLE_OBJECTS", b"](" + b"K\x01" * 2000 + b"e.", "objects"),
    ("CKPT_MAX_PICKLE_BYTES", b"](" + b"K\x01" * 2000 + b"e.", "larger than the limit"),
    ("CKPT_MAX_PICKLE_SHARED", b"](" + b"K\x01" * 10 + b"e" + put(0) + b"0(" + get(0) * 200 + b"t.",
     "shared references"),
])
def test_limits_are_settings(var: str, data: bytes, message: str) -> None:
    _load(data)  # fine with the defaults
    with use(EngineConfig.from_env({var: "1000"})), pytest.raises(FormatError, match=f"{message}.*{var}|{var}"):
        _load(data)


def test_flatten_is_iterative() -> None:
    node: dict = {"leaf": 1}
    for _ in range(5000):
        node = {"x": [node]}
    (path, value), = flatten(node).items()
    assert len(path) == 10_001 and value == 1


# ---------------------------------------------------------------------------------------------- honest files


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
def test_fsdp1_full_and_world_size_1_sharded_state_dicts_export(tmp_path: Path) -> None:
    """FSDP1 at world size 1 (gloo): FULL_STATE_DICT rank-0 torch.save and SHARDED_STATE_DICT (NO_SHARD)
    pickle tensors through _rebuild_from_type_v2(..., torch.Tensor, ...); both export exactly."""
    script = f"""
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig
dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), use_orig_params=True,
             device_id=torch.device("cpu"))
with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
    full = model.state_dict()
torch.save(full, "{tmp_path}/full.pt")
with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
    torch.save(model.state_dict(), "{tmp_path}/sharded.pt")
torch.save({{k: v.detach().clone() for k, v in full.items()}}, "{tmp_path}/reference.pt")
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    from safetensors.torch import load_file

    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert b"_rebuild_from_type_v2" in zipfile.ZipFile(tmp_path / "full.pt").read("full/data.pkl")
    for name in ("full", "sharded"):
        ckptctl("export", tmp_path / f"{name}.pt", tmp_path / f"{name}-out", "-q")
        got = load_file(tmp_path / f"{name}-out" / "model.safetensors")
        assert sorted(got) == sorted(reference)
        for key, tensor in reference.items():
            assert torch.equal(got[key], tensor), key


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
def test_bytesio_entry_survives_reshard_and_convert(tmp_path: Path) -> None:
    """torchtitan's TrainState keeps losses as an io.BytesIO holding a torch.save of its own; DCP stores it as a
    byte entry. Reshard and convert carry its bytes unchanged (the inner torch.save is never unpickled)."""
    inner = io.BytesIO()
    torch.save([1.5, 2.5], inner)
    losses = io.BytesIO(inner.getvalue() + b"\x00trailing")
    losses.seek(7)
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    dcp.save({"model": {"w": weight}, "train_state": {"step": 3, "losses": losses}}, checkpoint_id=tmp_path / "src")
    ckptctl("reshard", tmp_path / "src", tmp_path / "ws2", "--world-size", "2", "--only", "all", "--keep-keys", "-q")
    state = {"model": {"w": torch.zeros(4, 3)}, "train_state": {"step": 0, "losses": io.BytesIO()}}
    dcp.load(state, checkpoint_id=tmp_path / "ws2")
    assert torch.equal(state["model"]["w"], weight) and state["train_state"]["step"] == 3
    assert state["train_state"]["losses"].getvalue() == losses.getvalue()
    assert state["train_state"]["losses"].tell() == 7
    ckptctl("convert", tmp_path / "src", tmp_path / "out.pt", "--to", "torch", "--only", "all", "--keep-keys", "-q")
    with torch.serialization.safe_globals([io.BytesIO]):
        back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert back["train_state"]["losses"].getvalue() == losses.getvalue()
    assert torch.equal(back["model"]["w"], weight)


CUDA_FIXTURE = Path(__file__).parent / "data" / "cuda0.pt"


def test_storages_saved_on_cuda_are_read_on_cpu(tmp_path: Path) -> None:
    """tests/data/cuda0.pt is a torch.save whose storages carry location `cuda:0`, made by
    `make_cuda_fixture` below (torch.save with torch.serialization.location_tag answering "cuda:0":
    exactly the pickle torch writes for a CUDA storage, without a GPU)."""
    want = cuda_fixture_state()
    assert torch.load(CUDA_FIXTURE, weights_only=True, map_location="cpu").keys() == want.keys()
    with zipfile.ZipFile(CUDA_FIXTURE) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    assert pkl.count(b"cuda:0") >= 1 and b"cpu" not in pkl
    ckptctl("convert", CUDA_FIXTURE, tmp_path / "out.pt", "--to", "torch", "-q")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key


def cuda_fixture_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) / 7, "b": torch.arange(8, dtype=torch.bfloat16),
            "f8": (torch.arange(16, dtype=torch.float32) / 4).to(torch.float8_e4m3fn), "step": torch.tensor(5)}


def make_cuda_fixture(path: Path = CUDA_FIXTURE) -> None:
    """Write tests/data/cuda0.pt (run `python -c "from tests.test_unpickle import make_cuda_fixture as m; m()"`)."""
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(cuda_fixture_state(), path)
    finally:
        torch.serialization.location_tag = original
