"""HF tensor names -> the GGUF tensors llama.cpp's converter writes for them: names from gguf-py's own table
(`gguf.get_tensor_name_map`), the Q/K row permutation of llama-style rope (conversion/llama.py `permute`), and MoE
experts stacked into one [E, out, in] tensor per projection (per-expert tensors stacked, fused gate_up_proj split
in two on dim -2, as conversion/qwen.py does), in the order llama.cpp writes them.

A tensor is a list of `Part`s: boxes of source tensors, written one after the other in row-major order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from ..errors import FormatError
from ..index import TensorEntry
from .metadata import Family, rope_freqs

SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
#: Per-expert tensors, the order llama.cpp stacks their projections in, and the name it maps the stack by.
_EXPERTS = {
    "qwen": (re.compile(r"^(?P<layer>model\.layers\.(?P<bid>\d+)\.mlp\.experts)\.(?P<xid>\d+)\."
                        r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$"),
             ("down_proj", "gate_proj", "up_proj"), "{layer}.{x}.{proj}.weight", "{layer}.{proj}.weight"),
    "mixtral": (re.compile(r"^(?P<layer>model\.layers\.(?P<bid>\d+)\.block_sparse_moe\.experts)\.(?P<xid>\d+)\."
                           r"(?P<proj>w1|w2|w3)\.weight$"),
                ("w1", "w2", "w3"), "{layer}.{x}.{proj}.weight", "layers.{bid}.feed_forward.experts.{proj}.weight"),
}
_FUSED = re.compile(r"^(?P<layer>model\.layers\.\d+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(\.weight)?$")


@dataclass
class Part:
    entry: TensorEntry
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    heads: int = 0  # > 0: the rows are permuted as llama.cpp's LlamaModel.permute with this many heads


@dataclass
class Planned:
    name: str  # the GGUF name
    hf_name: str  # the source tensor (or the first of those stacked)
    shape: tuple[int, ...]  # torch order (GGUF's ne is this reversed)
    parts: list[Part] = field(default_factory=list)
    source_dtype: str = ""
    data: np.ndarray | None = None  # a tensor llama.cpp's converter computes (rope_freqs), instead of parts


def _whole(entry: TensorEntry, heads: int = 0) -> Part:
    return Part(entry, (0,) * len(entry.shape), entry.shape, heads)


def _bid(name: str) -> int | None:
    return next((int(p) for p in name.split(".") if p.isdecimal()), None)


def _heads(config: dict[str, Any], name: str, uri: str) -> int:
    n_head = config.get("num_attention_heads", config.get("n_heads"))
    n_kv = config.get("num_key_value_heads", config.get("n_kv_heads"))
    heads = n_head if name.rsplit(".", 2)[-2] == "q_proj" or n_kv is None or n_kv == n_head else n_kv
    if not isinstance(heads, int) or heads <= 0:
        raise FormatError(f"{uri} (config.json): no num_attention_heads to permute {name} with; fix config.json",
                          uri=uri, key=name)
    return heads


def plan(tensors: dict[str, TensorEntry], config: dict[str, Any], fam: Family, blocks: int,
         uri: str) -> list[Planned]:
    """The GGUF tensors for the source's `tensors` (HF names, in the order llama.cpp reads them)."""
    table = gguf.get_tensor_name_map(fam.arch, blocks)
    out: list[Planned] = []
    if (freqs := rope_freqs(config, fam, uri)) is not None:  # llama.cpp writes its computed tensors first
        out.append(Planned("rope_freqs.weight", "", tuple(freqs.shape), [], "float32", freqs))
    pending: dict[str, dict[str, TensorEntry]] = {}  # per-expert tensors of a layer, until all have come
    n_experts = config.get("num_local_experts", config.get("num_experts"))

    def mapped(hf_name: str) -> str:
        name = table.get_name(key=hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise FormatError(f"{uri}: tensor {hf_name} has no GGUF name in llama.cpp's {fam.name} table; export it "
                              "with llama.cpp's convert_hf_to_gguf.py or drop it", uri=uri, key=hf_name)
        return name

    def add(hf_name: str, shape: tuple[int, ...], parts: list[Part]) -> None:
        dtypes = {p.entry.dtype for p in parts}
        if len(dtypes) != 1:
            raise FormatError(f"{uri}: the experts stacked into {hf_name} have different dtypes "
                              f"({', '.join(sorted(dtypes))}); convert them to one dtype first", uri=uri, key=hf_name)
        out.append(Planned(mapped(hf_name), parts[0].entry.name, shape, parts, dtypes.pop()))

    for hf_name, entry in tensors.items():
        if hf_name.endswith(SKIPPED):
            continue
        experts = _EXPERTS.get(fam.experts)
        if experts and (m := experts[0].match(hf_name)):
            if not isinstance(n_experts, int) or n_experts <= 0:
                raise FormatError(f"{uri} (config.json): no num_experts for the expert tensor {hf_name}; fix "
                                  "config.json", uri=uri, key=hf_name)
            layer = pending.setdefault(m["layer"], {})
            layer[hf_name] = entry
            if len(layer) < n_experts * 3:
                continue
            for proj in experts[1]:
                names = [experts[2].format(layer=m["layer"], x=x, proj=proj) for x in range(n_experts)]
                missing = [n for n in names if n not in layer]
                if missing:
                    raise FormatError(f"{uri}: expert tensor {missing[0]} is missing; the checkpoint is incomplete",
                                      uri=uri, key=missing[0])
                shapes = {layer[n].shape for n in names}
                if len(shapes) != 1:
                    raise FormatError(f"{uri}: the experts of {m['layer']}.*.{proj} differ in shape; the checkpoint "
                                      "is damaged", uri=uri, key=names[0])
                add(experts[3].format(layer=m["layer"], bid=m["bid"], proj=proj), (n_experts, *shapes.pop()),
                    [_whole(layer[n]) for n in names])
            del pending[m["layer"]]
            continue
        if fam.experts == "qwen" and (m := _FUSED.match(hf_name)):
            if m["proj"] == "down_proj":
                add(f"{m['layer']}.down_proj.weight", entry.shape, [_whole(entry)])
                continue
            if len(entry.shape) != 3 or entry.shape[1] % 2:
                raise FormatError(f"{uri}: {hf_name} has shape {list(entry.shape)}, not [experts, 2*ff, hidden]; "
                                  "the checkpoint is damaged", uri=uri, key=hf_name)
            n_e, two_ff, hidden = entry.shape
            ff = two_ff // 2
            for proj, start in (("gate_proj", 0), ("up_proj", ff)):
                add(f"{m['layer']}.{proj}.weight", (n_e, ff, hidden),
                    [Part(entry, (e, start, 0), (1, ff, hidden)) for e in range(n_e)])
            continue
        heads = 0
        if fam.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = _heads(config, hf_name, uri)
            rows = entry.shape[0] if entry.shape else 0
            if rows % (heads * 2):
                raise FormatError(f"{uri}: {hf_name} has {rows} rows, not a multiple of 2 x {heads} heads; "
                                  "config.json does not match the weights", uri=uri, key=hf_name)
        add(hf_name, entry.shape, [_whole(entry, heads)])
    if pending:
        layer_name = next(iter(pending))
        raise FormatError(f"{uri}: the experts of {layer_name} are incomplete (expected {n_experts} x 3 tensors); "
                          "the checkpoint is incomplete", uri=uri, key=layer_name)
    return out
