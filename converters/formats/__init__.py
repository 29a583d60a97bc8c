"""Format registry and detection: a name -> reader table, and a look at a path that picks the name."""

from __future__ import annotations

import importlib
import json
import re
from typing import Any, Protocol

from .. import storage
from ..errors import FormatError, OptionError, SourceError
from ..index import CheckpointIndex

READERS: dict[str, str] = {
    "dcp": "converters.formats.dcp:DcpReader",
    "accelerate": "converters.formats.accelerate:AccelerateReader",
    "hf-dcp": "converters.formats.safetensors:SafetensorsReader",
    "safetensors": "converters.formats.safetensors:SafetensorsReader",
    "torch": "converters.formats.torchsave:TorchSaveReader",
    "rank-files": "converters.formats.rankfiles:RankFilesReader",
    "megatron": "converters.formats.megatron:MegatronReader",
    "lightning": "converters.formats.lightning:LightningReader",
    "deepspeed": "converters.formats.deepspeed:DeepSpeedReader",
    "deepspeed-module": "converters.formats.deepspeed:DeepSpeedModuleReader",
}
RANK_FILE = re.compile(r"^(?P<stem>.*?)_?rank_?(?P<rank>\d+)\.(?:pt|pth|bin)$")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class Reader(Protocol):
    format: str

    def index(self, locate: bool = True) -> CheckpointIndex: ...


def reader_class(name: str) -> type:
    if name not in READERS:
        raise OptionError(f"unknown format {name!r}; choose one of {', '.join(READERS)}")
    module, cls = READERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _dcp_subfolders(uri: str, names: list[str]) -> list[str]:
    return [n for n in names if storage.isdir(storage.join(uri, n))
            and storage.exists(storage.join(uri, n, ".metadata"))]


def detect(uri: str) -> str:
    """Name the format of the checkpoint at `uri`, or raise an error that says what to point at."""
    if not storage.exists(uri):
        if not storage.is_local(uri):
            bucket = uri.split("://", 1)[0] + "://" + uri.split("://", 1)[1].split("/", 1)[0]
            if not storage.exists(bucket):
                raise SourceError(f"{uri}: no such bucket {bucket}; create it or fix the URI")
        raise SourceError(f"{uri}: does not exist; check the path")
    name = storage.basename(uri)
    if not storage.isdir(uri):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            return "safetensors"
        if RANK_FILE.match(name):
            return "rank-files"
        if name.endswith(_TORCH_SUFFIXES) or name.endswith(".bin.index.json"):
            return "torch"
        if name == ".metadata":
            raise FormatError(f"{uri}: point at the folder that holds .metadata, not the file itself")
        raise FormatError(f"{uri}: unknown file type; pass --from with one of {', '.join(READERS)}")
    names = storage.listdir(uri)
    from .megatron import is_megatron

    if is_megatron(uri, names):
        return "megatron"
    if ".metadata" in names and "meta.pt" in names:
        return "lightning"
    if ".metadata" in names:
        return "dcp"
    from .deepspeed import is_deepspeed_folder

    if is_deepspeed_folder(uri, names):
        return "deepspeed"
    if "model.safetensors.index.json" in names:
        return "safetensors"
    if any(n.endswith(".safetensors") for n in names) or "sharded" in names:
        return "safetensors"
    if "pytorch_model.bin.index.json" in names:
        return "torch"
    if any(RANK_FILE.match(n) for n in names):
        return "rank-files"
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    if len(torch_files) == 1:
        return "torch"
    subfolders = _dcp_subfolders(uri, names)
    if subfolders:
        models = [n for n in subfolders if n.startswith("pytorch_model_fsdp_")]
        if len(models) == 1:
            return "accelerate"
        raise FormatError(f"{uri}: no .metadata here; this looks like the parent of DCP checkpoints. Point at "
                          f"one of the sub-folders: {', '.join(subfolders)}")
    if torch_files:
        raise FormatError(f"{uri}: several torch.save files ({', '.join(torch_files[:5])}) and no index; "
                          "point at one file")
    raise FormatError(f"{uri}: no checkpoint found (no .metadata, .safetensors, .pt/.bin or rank files); "
                      "point at the checkpoint folder")


def read_json(uri: str) -> Any:
    """A JSON metadata file (size-capped), or a FormatError naming it."""
    try:
        return json.loads(storage.read_all(uri))
    except (ValueError, RecursionError):
        raise FormatError(f"{uri}: not valid JSON; the file is damaged (re-copy or re-export it)") from None


def index_files(uri: str) -> list[str]:
    """The data files an HF index (`*.index.json`) names in its `weight_map`, each confined to its folder."""
    doc = read_json(uri)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise FormatError(f"{uri}: weight_map must be a JSON object of tensor name -> file name; the index is "
                          "damaged")
    base = storage.parent(uri)
    return [storage.member(base, name, f"{uri} (weight_map)") for name in sorted(set(weight_map.values()))]


def open_reader(uri: str, fmt: str | None = None, reader: storage.RangeReader | None = None) -> Reader:
    name = fmt or detect(uri)
    return reader_class(name)(uri, reader or storage.RangeReader())


def check_complete(uri: str) -> None:
    """Refuse an output prefix whose upload never finished, or whose files differ from its manifest."""
    if storage.is_local(uri) or not storage.isdir(uri):
        return
    names = storage.listdir(uri)
    if "ckpt-manifest.json" not in names:
        if ".ckpt-writing" in names:
            raise SourceError(f"{uri}: incomplete output (an upload started but never finished: no "
                              "ckpt-manifest.json); re-run the job that writes it")
        return
    where = storage.join(uri, "ckpt-manifest.json")
    manifest = read_json(where)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise FormatError(f"{where}: files must be a JSON object of file name -> {{bytes, crc32}}; the manifest is "
                          "damaged")
    for name, info in files.items():
        path = storage.member(uri, name, f"{where} (files)")
        if not storage.exists(path) or storage.size(path) != info.get("bytes"):
            raise SourceError(f"{path}: missing or not the size ckpt-manifest.json records; the output is damaged, "
                              "re-run the job that wrote it")


def load_index(uri: str, fmt: str | None = None, locate: bool = True,
               reader: storage.RangeReader | None = None, complete: bool = True) -> CheckpointIndex:
    """Read the index of the checkpoint at `uri` (metadata only; tensor bytes stay where they are)."""
    uri = uri.rstrip("/") if len(uri) > 1 else uri
    if complete:
        check_complete(uri)
    own = reader is None
    reader = reader or storage.RangeReader()
    try:
        index = open_reader(uri, fmt, reader).index(locate=locate)
    finally:
        if own:  # the index holds byte ranges, not descriptors: close what reading it opened
            reader.close()
    if not index.tensors and not index.objects:
        raise FormatError(f"{uri}: the checkpoint holds no entries")
    return index
