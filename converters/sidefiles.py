"""The model's side files an export carries beside its weights, so that `from_pretrained(export)` loads it:
config (its `torch_dtype` / `dtype` set to what the export holds), generation config, tokenizer and chat
template.

They are looked for, each name in the first folder that has it, in `--config-from DIR` alone when given,
else in the checkpoint's folder, its NeMo `context/` (and `context/nemo_tokenizer/`), then the folder
above and the one above that (Accelerate and the HF Trainer keep them in `run/checkpoint-N/` or `run/`
beside `pytorch_model_fsdp_0/`). Every file is read through the confined opener (`storage.read_all`) under
a size cap, and every JSON file but tokenizer.json (tens of MB, copied as bytes) must be a JSON object;
anything else is refused with one line naming it.
They are written with the weights, inside the same atomic output.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import storage
from .errors import CkptError, FormatError, OptionError
from .jsonsafe import loads

CONFIG = "config.json"
#: The files carried, in the order they are reported.
NAMES = (CONFIG, "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
         "chat_template.json", "preprocessor_config.json")
#: What a model served with `from_pretrained` usually has; those not found are reported as missing.
EXPECTED = (CONFIG, "generation_config.json", "tokenizer_config.json")
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_JSON_CAP = 4 * 1024 * 1024
_FILE_CAP = 64 * 1024 * 1024  # a large vocabulary's tokenizer.json is tens of MB


@dataclass
class SideFiles:
    """The files found (name -> bytes to write, and the URI each came from) and the expected ones missing."""

    data: dict[str, bytes] = field(default_factory=dict)
    found_in: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"carried": dict(self.found_in), "missing": list(self.missing)}

    def report(self) -> str:
        carried = ", ".join(self.found_in) or "none"
        line = f"carried side files: {carried}"
        if self.missing:
            line += f"; missing: {', '.join(self.missing)} (pass --config-from DIR to take them from a folder)"
        return line


def _up(folder: str) -> str | None:
    """The folder above `folder`; None above a local root or a bucket."""
    if storage.is_local(folder):
        above = os.path.dirname(folder)
        return above if above != folder else None
    scheme, path = folder.split("://", 1)
    return f"{scheme}://{path.rsplit('/', 1)[0]}" if "/" in path.strip("/") else None


def _folders(source: str, config_from: str | None) -> list[str]:
    if config_from is not None:
        if not storage.isdir(config_from):
            raise OptionError(f"--config-from {config_from}: not a folder; point at the folder holding "
                              "config.json and the tokenizer files")
        return [config_from.rstrip("/")]
    base = os.path.abspath(storage.local_path(source)) if storage.is_local(source) else source.rstrip("/")
    folder = base if storage.isdir(base) else storage.parent(base)
    above = _up(folder)
    levels = [folder] + ([above] if above is not None else [])
    found = [folder] + [storage.join(level, *sub) for level in levels
                        for sub in (("context",), ("context", "nemo_tokenizer"))]
    for _ in range(2):  # the checkpoint's folder, then the two above it
        if above is None:
            break
        found.append(above)
        above = _up(above)
    return found


def _listing(folder: str) -> set[str]:
    """The names in `folder`; none when it is not there or lies outside the roots this job may read."""
    try:
        storage.check_roots(folder)
        return set(storage.listdir(folder)) if storage.isdir(folder) else set()
    except (CkptError, OSError, ValueError):
        return set()


def _json_object(uri: str, data: bytes) -> dict:
    doc = loads(data, uri)  # size, depth and text checked like every JSON file a checkpoint brings
    if not isinstance(doc, dict):
        raise FormatError(f"{uri}: not a JSON object; fix or remove it, or pass --config-from DIR with a good one",
                          uri=uri)
    return doc


def _with_dtype(uri: str, data: bytes, dtype: str | None) -> bytes:
    """config.json checked, with `torch_dtype` (and `dtype`, where the config has it) set to `dtype`."""
    doc = _json_object(uri, data)
    if dtype is None:
        return data
    doc["torch_dtype"] = dtype
    if "dtype" in doc:
        doc["dtype"] = dtype
    return (json.dumps(doc, indent=2) + "\n").encode()


def collect(source: str, config_from: str | None, dtype: str | None, skip: frozenset[str] = frozenset()
            ) -> SideFiles:
    """Find and read the side files for an export of `source` whose floating tensors are all `dtype` (None:
    mixed, config kept as it is); names in `skip` are written by the export itself (`--to-hf`'s config)."""
    found = SideFiles()
    wanted = [n for n in NAMES if n not in skip]
    for folder in _folders(source, config_from):
        present = _listing(folder)
        for name in [n for n in wanted if n in present and n not in found.data]:
            uri = storage.join(folder, name)
            small_json = name.endswith(".json") and name != "tokenizer.json"  # tokenizer.json: copied as bytes
            data = storage.read_all(uri, _JSON_CAP if small_json else _FILE_CAP)
            if name == CONFIG:
                data = _with_dtype(uri, data, dtype)
            elif small_json:
                _json_object(uri, data)
            found.data[name], found.found_in[name] = data, uri
    found.found_in = {n: found.found_in[n] for n in NAMES if n in found.found_in}
    found.missing = [n for n in EXPECTED if n not in found.data and n not in skip]
    if not any(n in found.data for n in TOKENIZERS):
        found.missing.append("tokenizer (tokenizer.json, tokenizer.model or vocab files)")
    return found
