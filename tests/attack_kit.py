"""Honest small checkpoints of every reader, built in-process with torch's own writers, and tools to break them.

Shared by the attack suite (tests/test_attacks.py) and the fuzz test (tests/test_fuzz.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

READERS = ("dcp", "accelerate", "rank-files", "torch", "torch-index", "safetensors", "safetensors-sharded",
           "hf-dcp")


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=gen), "b": torch.arange(5, dtype=torch.float32),
            "e": torch.randn(3, 2, generator=gen).to(torch.bfloat16)}


def _dcp_save(state: dict[str, Any], folder: Path, **kwargs: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=None if kwargs else str(folder), **kwargs)


def build_bases(root: Path) -> dict[str, Path]:
    """One honest checkpoint per reader under `root`; returns reader -> path to point the tools at."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _state()
    out: dict[str, Path] = {}
    out["dcp"] = root / "dcp"
    _dcp_save({**state, "lr": 0.5}, out["dcp"])
    out["accelerate"] = root / "accelerate"
    _dcp_save({f"model.{k}": v for k, v in state.items()}, out["accelerate"] / "pytorch_model_fsdp_0")
    out["rank-files"] = root / "rank-files"
    out["rank-files"].mkdir()
    for rank in range(2):
        torch.save({"w": state["w"], "b": state["b"]}, out["rank-files"] / f"rank{rank}.pt")
    out["torch"] = root / "torch"
    out["torch"].mkdir()
    torch.save({**state, "step": 7}, out["torch"] / "model.pt")
    out["torch-index"] = root / "torch-index"
    out["torch-index"].mkdir()
    names = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    torch.save({"w": state["w"]}, out["torch-index"] / names[0])
    torch.save({"b": state["b"], "e": state["e"]}, out["torch-index"] / names[1])
    (out["torch-index"] / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": names[0], "b": names[1], "e": names[1]}}))
    out["safetensors"] = root / "safetensors"
    out["safetensors"].mkdir()
    save_file(state, out["safetensors"] / "model.safetensors")
    out["safetensors-sharded"] = root / "safetensors-sharded"
    out["safetensors-sharded"].mkdir()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({"w": state["w"]}, out["safetensors-sharded"] / names[0])
    save_file({"b": state["b"], "e": state["e"]}, out["safetensors-sharded"] / names[1])
    (out["safetensors-sharded"] / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": names[0], "b": names[1], "e": names[1]}}))
    out["hf-dcp"] = root / "hf-dcp"
    _dcp_save(state, out["hf-dcp"], storage_writer=HuggingFaceStorageWriter(str(out["hf-dcp"]),
                                                                           save_distributed=True))
    return out


def reference(base: Path) -> dict[str, torch.Tensor]:
    """What the honest checkpoint holds, read back with torch's own loaders (for comparing outputs)."""
    from safetensors.torch import load_file

    files = sorted(p for p in base.rglob("*") if p.is_file())
    out: dict[str, torch.Tensor] = {}
    if any(p.name == ".metadata" for p in files) and not any(p.suffix == ".safetensors" for p in files):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        folder = next(p.parent for p in files if p.name == ".metadata")
        md = FileSystemReader(str(folder)).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
                 if hasattr(m, "size")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(folder))
        return state
    for path in files:
        if path.suffix == ".safetensors":
            out.update(load_file(path))
        elif path.suffix in (".pt", ".bin"):
            loaded = torch.load(path, weights_only=True)
            out.update({k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)})
    return out


def data_file(base: Path, reader: str) -> Path:
    """The main data file of a checkpoint (the one attacks replace or damage)."""
    pick = {"dcp": "__0_0.distcp", "accelerate": "pytorch_model_fsdp_0/__0_0.distcp", "rank-files": "rank0.pt",
            "torch": "model.pt", "torch-index": "pytorch_model-00001-of-00002.bin",
            "safetensors": "model.safetensors", "safetensors-sharded": "model-00001-of-00002.safetensors"}
    if reader == "hf-dcp":
        return next(base.glob("*.safetensors"))
    return base / pick[reader]


def metadata_file(base: Path, reader: str) -> Path:
    """The file that names or describes the others (.metadata, an index, a header-bearing file)."""
    pick = {"dcp": ".metadata", "accelerate": "pytorch_model_fsdp_0/.metadata",
            "torch-index": "pytorch_model.bin.index.json",
            "safetensors-sharded": "model.safetensors.index.json"}
    return base / pick[reader] if reader in pick else data_file(base, reader)


# --- breaking tools ------------------------------------------------------------------------------------------


def edit_dcp_metadata(folder: Path, edit: Callable[[Any], None]) -> None:
    """Load our own (trusted) `.metadata` with torch, let `edit` change it, and write it back as torch does."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata()
    edit(md)
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(md, fh)


def set_storage(field: str, value: Any, fqn: str | None = None) -> Callable[[Any], None]:
    """An edit that sets `field` of the storage entries (all, or those of `fqn`)."""

    def edit(md: Any) -> None:
        for key, info in list(md.storage_data.items()):
            if fqn is None or key.fqn == fqn:
                md.storage_data[key] = dataclasses.replace(info, **{field: value})

    return edit


def safetensors_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + length]), raw[8 + length:]


def write_safetensors(path: Path, header: Any, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(path: Path, edit: Callable[[dict], Any]) -> None:
    header, data = safetensors_header(path)
    result = edit(header)
    write_safetensors(path, header if result is None else result, data)


def first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def truncate(path: Path, keep: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replace_with_link(path: Path, target: str | Path) -> None:
    path.unlink()
    path.symlink_to(target)


def zip_directory_claim(path: Path, cd_size: int = 0xFFFFFF00, zip64: bool = False) -> None:
    """Make a torch.save zip's end-of-central-directory claim a directory of `cd_size` bytes."""
    raw = bytearray(path.read_bytes())
    at = raw.rfind(b"PK\x05\x06")
    if zip64:
        struct.pack_into("<HHII", raw, at + 8, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
        at64 = raw.rfind(b"PK\x06\x06")
        struct.pack_into("<QQQ", raw, at64 + 32, 1 << 32, cd_size, 0)
    else:
        struct.pack_into("<II", raw, at + 12, cd_size, 0)
    path.write_bytes(bytes(raw))


def deflate_zip(path: Path) -> None:
    """Re-pack a torch.save zip with compressed members (torch.load refuses those; so must we)."""
    import zipfile

    with zipfile.ZipFile(path) as src:
        members = [(info.filename, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for name, data in members:
            dst.writestr(name, data)


def copy_base(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest, symlinks=True)
    return dest
