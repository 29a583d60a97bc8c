"""Reader for Megatron-core `dist_checkpointing` folders (torch_dist backend), the Megatron-LM `iter_NNNNNNN/`
folders around them and NeMo 2 checkpoints (`weights/` + `context/`).

The tensors are plain DCP (`.metadata` + `__R_S.distcp`), read by `DcpReader`; names stay as stored.
Transformer layers are stacked (`decoder.layers.w` has a leading layer dimension), which the index
records in `stacked` so that a clean export splits them per layer. `common.pt` (args, iteration, ...)
is read through the Megatron stand-ins of the allow-list unpickler and carried as training state.
"""

from __future__ import annotations

import re
from typing import Any

from .. import storage
from ..errors import FormatError, reading
from ..index import CheckpointIndex, short
from ..jsonsafe import MAX_DEPTH, check_strings, read_json, read_text
from ..torchzip import read_archive
from ..unpickle import MEGATRON_ALLOWED, Stub
from .dcp import METADATA, DcpReader
from .torchsave import add_entries

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
_ITERATION = re.compile(r"[0-9]{1,12}")
_STACKED = re.compile(r"^((?:[^.]+\.)*?layers\.)(?!\d+\.)")
_NAMESPACES = ("argparse.Namespace", "types.SimpleNamespace",
               "megatron.core.optimizer.optimizer_config.OptimizerConfig")


def is_megatron(uri: str, names: list[str]) -> bool:
    """A dist checkpoint folder, a Megatron-LM save folder, or a NeMo 2 checkpoint folder."""
    if "metadata.json" in names and (METADATA in names or COMMON in names):
        return True
    if LATEST in names:
        return True
    return "weights" in names and "context" in names and storage.exists(storage.join(uri, "weights", "metadata.json"))


def locate(uri: str) -> tuple[str, str | None, str]:
    """(the dist checkpoint folder, the NeMo `context/` folder or None, who wrote it)."""
    names = storage.listdir(uri)
    if "weights" in names and "context" in names:
        return storage.join(uri, "weights"), storage.join(uri, "context"), "NeMo 2"
    if LATEST in names:
        path = storage.join(uri, LATEST)
        text = read_text(path, "'release' or an iteration number")
        sub = "release" if text == "release" else f"iter_{int(text):07d}" if _ITERATION.fullmatch(text) else None
        if sub is None:
            raise FormatError(f"{path}: does not hold 'release' or an iteration number "
                              "(up to 12 digits); point at one of the iter_NNNNNNN folders", uri=path)
        if sub not in names:
            raise FormatError(f"{path}: names iteration {text!r} but there is no {sub} folder; point at one of the "
                              "iter_NNNNNNN folders", uri=path)
        return storage.join(uri, sub), None, f"Megatron-LM ({sub})"
    parent = storage.parent(uri)
    if storage.basename(uri) == "weights" and storage.exists(storage.join(parent, "context")):
        return uri, storage.join(parent, "context"), "NeMo 2"
    return uri, None, "Megatron-core dist_checkpointing"


def _plain(value: Any) -> Any:
    """Namespaces and config objects in common.pt become dicts of their fields (writable, readable)."""
    if isinstance(value, Stub) and value.qualname in _NAMESPACES:
        state = value.state[0] if isinstance(value.state, tuple) else value.state
        return {k: _plain(v) for k, v in (state or {}).items()}
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


class MegatronReader(DcpReader):
    format = "megatron"
    locate_remote = True  # layer-stacked tensors are cut into per-layer views, which need located bytes

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        self.root = uri
        folder, self.context, self.producer = locate(uri)
        super().__init__(folder, reader)

    def _check_backend(self) -> None:
        path = storage.join(self.uri, "metadata.json")
        if not storage.exists(path):
            if any(n.startswith("mp_rank_") for n in storage.listdir(self.uri)):
                raise FormatError(f"{self.uri}: a legacy Megatron-LM checkpoint (mp_rank_XX folders), not a "
                                  "dist checkpoint; re-save it with --ckpt-format torch_dist", uri=self.uri)
            raise FormatError(f"{self.uri}: no metadata.json, so this is not a Megatron-core dist checkpoint",
                              uri=self.uri)
        meta = read_json(path)
        backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
        if backend != "torch_dist":
            raise FormatError(f"{path}: sharded_backend {short(backend)} is not supported (only torch_dist); "
                              "re-save the checkpoint with the torch_dist backend", uri=path)

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return is_megatron(uri, names)

    def read(self, locate: bool = True) -> CheckpointIndex:
        self._check_backend()
        index = super().read(locate)
        sub = self.uri[len(self.root):].strip("/")
        index.uri, index.format, index.producer = self.root, self.format, self.producer
        index.files = ["metadata.json", *index.files]
        for name, entry in index.tensors.items():
            match = _STACKED.match(name)
            if match and entry.shape:
                index.stacked[name] = match.group(1)
        common = storage.join(self.uri, COMMON)
        if storage.exists(common):
            archive = read_archive(self.reader, common, allowed=MEGATRON_ALLOWED)
            if not isinstance(archive.obj, dict):
                raise FormatError(f"{common}: holds a {type(archive.obj).__name__}, not a dict", uri=common)
            index.training_state.update(add_entries(index, archive, _plain(archive.obj)))
            index.files.append(COMMON)
        if sub:
            index.files = [f"{sub}/{f}" for f in index.files]
        return index

    def model_config(self, index: CheckpointIndex) -> tuple[dict[str, Any], str]:
        """The model's Megatron config (TransformerConfig / Megatron-LM argument names) and where it came from."""
        if self.context is not None:
            with reading(f"{self.context}/model.yaml"):
                return _nemo_config(self.context), f"{self.context}/model.yaml"
        args = {name[len("args."):]: e.value for name, e in index.objects.items()
                if name.startswith("args.") and e.value is not None}
        if not args:
            raise FormatError(f"{self.root}: no model config found (no args in {COMMON}, no NeMo context/); "
                              "the architecture cannot be read from the tensors alone", uri=self.root)
        return args, f"{storage.join(self.uri, COMMON)} args"


def _nemo_config(context: str) -> dict[str, Any]:
    path = storage.join(context, "model.yaml")
    if not storage.exists(path):
        raise FormatError(f"{context}: no model.yaml; the NeMo 2 checkpoint's context/ is incomplete")
    import yaml

    try:
        doc = yaml.safe_load(storage.read_all(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise FormatError(f"{path}: not valid YAML{at}; the NeMo context is damaged", uri=path) from None
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: no `config:` mapping with the model's settings", uri=path)
    check_strings(config, path, "the model config", MAX_DEPTH)
    return config
