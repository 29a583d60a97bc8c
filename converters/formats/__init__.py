"""Format registry and detection: a name -> reader table, and a look at a path that picks the name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .. import storage
from ..errors import FormatError, OptionError, SourceError, reading
from ..index import CheckpointIndex
from ..jsonsafe import read_json
from ..names import TORCH_INDEX, TORCH_SUFFIXES
from ..targets import check_complete
from .base import BaseReader
from .dcp import METADATA, dcp_subfolders


@dataclass(frozen=True)
class FormatSpec:
    """A registered format: its reader class (or "module:Class" for an optional one) and how to get it."""

    name: str
    target: type[BaseReader] | str
    install: str | None = None  # the pip command that provides an optional format's dependencies
    specificity: int = 0  # see BaseReader.specificity: `detect` takes the most specific format that says yes
    one_file: bool = False  # its folder sniff means "the one file in it": never for a folder that holds folders

    def load(self) -> type[BaseReader]:
        if not isinstance(self.target, str):
            return self.target
        module, cls = self.target.split(":")
        try:
            return getattr(importlib.import_module(module), cls)
        except ImportError as exc:
            hint = f"; install it with `{self.install}`" if self.install else ""
            raise OptionError(f"format {self.name!r} needs {exc.name or module}, which is not installed{hint}") \
                from None


#: name -> format, in the order names are listed (CLI help, the job schema's choices)
FORMATS: dict[str, FormatSpec] = {}
#: the names `detect` tries, in order: the first reader whose `sniff` says yes names the format
DETECT_ORDER: list[str] = []
#: the public view: name -> spec; iterating gives the names
READERS = FORMATS


def register_format(name: str, cls: type[BaseReader] | str, *, detect: bool = True, before: str | None = None,
                    install: str | None = None, specificity: int | None = None, one_file: bool = False) -> None:
    """Add a format. `detect`: try its `sniff` in `detect` (after every earlier one of the same specificity, or
    just `before` another); `specificity` (default: the class's own) ranks it above generic formats whatever the
    order; `one_file`: its folder sniff takes a folder for the one file in it, which `detect` refuses for a folder
    that also holds folders (a layout); `cls` as "module:Class" makes it optional: imported when used, with `install`
    named if that fails."""
    if name in FORMATS:
        raise ValueError(f"format {name!r} is already registered")
    if specificity is None:
        specificity = 0 if isinstance(cls, str) else cls.specificity
    FORMATS[name] = FormatSpec(name, cls, install, specificity, one_file)
    if detect:
        DETECT_ORDER.insert(DETECT_ORDER.index(before) if before else len(DETECT_ORDER), name)


def reader_class(name: str) -> type[BaseReader]:
    if name not in FORMATS:
        raise OptionError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name].load()


def _sniffers() -> list[tuple[str, type[BaseReader]]]:
    """The detected formats, most specific first (a stable sort: then in DETECT_ORDER)."""
    found = []
    for name in sorted(DETECT_ORDER, key=lambda n: -FORMATS[n].specificity):
        try:
            found.append((name, FORMATS[name].load()))
        except OptionError:  # an optional format whose package is missing cannot be the one
            continue
    return found


def _missing(uri: str) -> SourceError:
    if not storage.is_local(uri):
        bucket = uri.split("://", 1)[0] + "://" + uri.split("://", 1)[1].split("/", 1)[0]
        if not storage.exists(bucket):
            return SourceError(f"{uri}: no such bucket {bucket}; create it or fix the URI", uri=uri)
    return SourceError(f"{uri}: does not exist; check the path", uri=uri)


def detect(uri: str) -> str:
    """Name the format of the checkpoint at `uri`, or raise an error that says what to point at."""
    if not storage.exists(uri):
        raise _missing(uri)
    names = storage.listdir(uri) if storage.isdir(uri) else None
    with reading(uri):
        for name, cls in _sniffers():
            if cls.sniff(uri, names):
                if names is not None and FORMATS[name].one_file and TORCH_INDEX not in names:
                    _refuse_layout(uri, names, name)
                return name
    if names is None:
        if storage.basename(uri) == METADATA:
            raise FormatError(f"{uri}: point at the folder that holds .metadata, not the file itself", uri=uri)
        raise FormatError(f"{uri}: unknown file type; pass source_format with one of {', '.join(FORMATS)}", uri=uri,
                          option="source_format")
    subfolders = dcp_subfolders(uri, names)
    if subfolders:
        raise FormatError(f"{uri}: no .metadata here; this looks like the parent of DCP checkpoints. Point at "
                          f"one of the sub-folders: {', '.join(subfolders)}", uri=uri)
    torch_files = [n for n in names if n.endswith(TORCH_SUFFIXES)]
    if torch_files:
        raise FormatError(f"{uri}: several torch.save files ({', '.join(torch_files[:5])}) and no index; "
                          "point at one file", uri=uri)
    raise FormatError(f"{uri}: no checkpoint found (no .metadata, .safetensors, .pt/.bin or rank files); "
                      "point at the checkpoint folder", uri=uri)


def _refuse_layout(uri: str, names: list[str], fmt: str) -> None:
    """A folder is never taken for one of its files: beside sub-folders that file is part of a layout no format
    here recognised (e.g. a DeepSpeed universal folder whose `zero/` is missing its pieces)."""
    folders = sorted(n for n in names if not n.startswith(".") and storage.isdir(storage.join(uri, n)))
    if folders:
        raise FormatError(f"{uri}: holds the folder(s) {', '.join(folders[:5])} beside its one {fmt} file, so it is "
                          "a checkpoint layout, not that file; point at the file itself or pass source_format",
                          uri=uri, option="source_format")


def index_files(uri: str) -> list[str]:
    """The data files an HF index (`*.index.json`) names in its `weight_map`, each confined to its folder."""
    doc = read_json(uri)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise FormatError(f"{uri}: weight_map must be a JSON object of tensor name -> file name; the index is "
                          "damaged", uri=uri)
    base = storage.parent(uri)
    return [storage.member(base, name, f"{uri} (weight_map)") for name in sorted(set(weight_map.values()))]


def open_reader(uri: str, fmt: str | None = None, reader: storage.RangeReader | None = None) -> BaseReader:
    name = fmt or detect(uri)
    cls = reader_class(name)
    with reading(uri):
        return cls(uri, reader or storage.RangeReader())


def load_index(uri: str, fmt: str | None = None, locate: bool = True,
               reader: storage.RangeReader | None = None, complete: bool = True) -> CheckpointIndex:
    """Read the index of the checkpoint at `uri` (metadata only; tensor bytes stay where they are)."""
    uri = uri.rstrip("/") if len(uri) > 1 else uri
    if complete:
        with reading(uri):
            check_complete(uri)
    own = reader is None
    reader = reader or storage.RangeReader()
    try:
        source = open_reader(uri, fmt, reader)
        with reading(uri):
            index = source.index(locate=locate)
    finally:
        if own:  # the index holds byte ranges, not descriptors: close what reading it opened
            reader.close()
    if not index.tensors and not index.objects:
        raise FormatError(f"{uri}: the checkpoint holds no entries", uri=uri)
    return index


def _register_builtin() -> None:
    from .accelerate import AccelerateReader
    from .dcp import DcpReader
    from .deepspeed import DeepSpeedModuleReader, DeepSpeedReader
    from .deepspeed_universal import DeepSpeedUniversalReader
    from .lightning import LightningReader
    from .megatron import MegatronReader
    from .rankfiles import RankFilesReader
    from .safetensors import SafetensorsReader
    from .torchsave import TorchSaveReader

    # specificity: 0 a generic file format, 1 a framework's folder layout, 2 a layout built on another one
    for name, cls, detected, level in (
            ("dcp", DcpReader, True, 1), ("accelerate", AccelerateReader, True, 1),
            ("hf-dcp", SafetensorsReader, False, 0), ("safetensors", SafetensorsReader, True, 0),
            ("torch", TorchSaveReader, True, 0), ("rank-files", RankFilesReader, True, 0),
            ("megatron", MegatronReader, True, 2), ("lightning", LightningReader, True, 2),
            ("deepspeed", DeepSpeedReader, True, 1), ("deepspeed-module", DeepSpeedModuleReader, False, 1),
            ("deepspeed-universal", DeepSpeedUniversalReader, True, 2)):
        register_format(name, cls, detect=detected, specificity=level, one_file=name == "torch")
    # a folder can match several sniffs: `detect` tries the most specific first (`BaseReader.specificity`), then
    # this order
    DETECT_ORDER[:] = ["megatron", "lightning", "deepspeed-universal", "dcp", "deepspeed", "accelerate",
                       "safetensors", "torch", "rank-files"]


_register_builtin()
