"""`import`: a Hugging Face folder (safetensors + config.json) of a family in the table as a Megatron-core
torch_dist checkpoint, laid out as Megatron-LM saves one: `latest_checkpointed_iteration.txt` ("release") and
`release/` with the DCP files, `metadata.json` (the torch_dist backend) and `common.pt` (the Megatron-LM `args`).
The HF folder's generation_config.json, tokenizer and chat template files (`sidefiles.NAMES` but config.json) are
copied as they are to the Megatron folder's root, beside latest_checkpointed_iteration.txt: where Megatron-LM's
--tokenizer-model can point, and the first folder `export --to-hf` looks in, so a round trip keeps them.

The table is read backwards: each rule's HF tensors are joined by the inverse transform (fused QKV per query
group, gate/up) and stacked over experts and layers under the names megatron-core's GPTModel saves, all as
views of the HF files, so the copy streams like every other output.
`into` dcp (`ckptctl import --to dcp`) writes the start of an FSDP2 run instead: the HF names as they are, in a
DCP folder (`to_dcp`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..config import EngineConfig, use
from ..copier import DEFAULT_MEMORY_LIMIT, Copier, Progress
from ..errors import FormatError, OptionError
from ..formats import load_index
from ..index import CheckpointIndex, ObjectEntry, TensorEntry
from ..jsonsafe import read_json
from ..output import open_output
from ..plan import Execution, Plan, execute
from ..sidefiles import CONFIG, collect
from ..writers.dcp import Piece, plan_dcp
from ..writers.torchsave import TorchPart
from .config import ModelConfig, megatron_args, read_megatron
from .mapping import AUTO, applies, check
from .table import FAMILIES, TOP, Family, Rule
from .to_dcp import write_fsdp2
from .transforms import INVERSE, Shape, stack

MEGATRON, DCP = "megatron", "dcp"
TARGETS = (MEGATRON, DCP)
RELEASE = "release"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}


@dataclass
class ImportResult:
    target: str
    family: str
    outputs: list[tuple[str, int]]
    report: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"target": self.target, "family": self.family,
                "outputs": [{"name": n, "bytes": b} for n, b in self.outputs], "report": self.report}


def family_of(hf: dict[str, Any], where: str, name: str = AUTO) -> Family:
    """The table's family for a HF config (its model_type), or the one named."""
    if name != AUTO:
        if name not in FAMILIES:
            raise OptionError(f"family {name}: choose one of {', '.join((AUTO, *FAMILIES))}", option="family")
        return FAMILIES[name]
    model_type = hf.get("model_type")
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    raise OptionError(f"{where}: model_type {model_type!r} has no family in the table ({', '.join(FAMILIES)}); "
                      "nothing was written", option="family")


def _megatron_name(r: Rule) -> str:
    """The name megatron-core's GPTModel saves the rule's tensor under (the table lists it first)."""
    return next(n for n in r.megatron if "{e}" not in n)


def _join(hf: CheckpointIndex, r: Rule, shape: Shape, at: str, name: str, e: int | None = None) -> TensorEntry:
    parts = []
    for n in r.hf:
        key = at + (n.format(e=e) if e is not None else n)
        if key not in hf.tensors:
            raise FormatError(f"{hf.uri}: no {key!r}; the config.json describes a model that has it")
        parts.append(hf.tensors[key])
    return INVERSE[r.transform](parts, shape, name)


def megatron_view(hf: CheckpointIndex, family: Family, cfg: dict[str, Any], where: str) -> CheckpointIndex:
    """The HF tensors under megatron-core's stored names and layouts (layer-stacked), as views."""
    mc = read_megatron(cfg, where)
    check(family, mc, where)
    shape = mc.shape
    used: set[str] = set()
    tensors: dict[str, TensorEntry] = {}

    for r in TOP:
        if applies(r, mc):
            name = r.megatron[0]
            tensors[name] = _join(hf, r, shape, "", name)
            used.update(r.hf)
    for r in family.layer:
        layers = []
        for i in range(shape.layers):
            if not applies(r, mc, i):
                continue
            at = f"model.layers.{i}."
            # a family whose layers differ is saved per layer (`decoder.layers.{i}.`), the others layer-stacked
            name = f"decoder.layers.{i}." if family.per_layer_keys else "decoder.layers."
            name += _megatron_name(r)
            if r.per_expert:
                entry = stack(name, [_join(hf, r, shape, at, name, e) for e in range(shape.experts)])
                used.update(at + n.format(e=e) for n in r.hf for e in range(shape.experts))
            else:
                entry = _join(hf, r, shape, at, name)
                used.update(at + n for n in r.hf)
            if family.per_layer_keys:
                tensors[name] = entry
            else:
                layers.append(entry)
        if layers:
            tensors[layers[0].name] = stack(layers[0].name, layers)
    objects = {name: ObjectEntry(name, value=[None], path=(name,)) for name in extra_states(family, mc)}
    left = [n for n in hf.tensors if n not in used and not (mc.tied and n == "lm_head.weight")]
    if left:
        raise FormatError(f"{hf.uri}: tensors with no Megatron counterpart in the {family.name} table: "
                          f"{', '.join(left[:5])}; nothing was written")
    return CheckpointIndex(uri=hf.uri, format="megatron", tensors=tensors, objects=objects)


def extra_states(family: Family, mc: ModelConfig) -> list[str]:
    """The `_extra_state` entries megatron-core saves beside each layer's linear modules (None for the local
    spec's layers, which Transformer Engine's layers also accept): a full model `dist_checkpointing.load`, as
    Megatron-LM does, asks for every one. Layer-stacked: keyed per layer (`shard_{i}_{L}`), per layer and expert
    (`shard_{i}.{e}_{L}.{E}`). A family saved per layer (DeepSeek-V3: `decoder.layers.{i}.`, no layer axis):
    `shard_0_1`, and per expert `shard_{e}_{E}`, for the modules that layer has (dense or MoE)."""
    shape = mc.shape
    names: list[str] = []
    for r in family.layer:
        module = _megatron_name(r).rsplit(".", 1)[0]
        if not module.rsplit(".", 1)[-1].startswith("linear_") or not _megatron_name(r).endswith(".weight"):
            continue
        for i in range(shape.layers):
            if family.per_layer_keys:
                if not applies(r, mc, i):
                    continue
                key = f"decoder.layers.{i}.{module}._extra_state/shard_"
                names += ([f"{key}{e}_{shape.experts}" for e in range(shape.experts)] if r.per_expert
                          else [f"{key}0_1"])
            elif r.per_expert:
                names += [f"decoder.layers.{module}._extra_state/shard_{i}.{e}_{shape.layers}.{shape.experts}"
                          for e in range(shape.experts)]
            else:
                names.append(f"decoder.layers.{module}._extra_state/shard_{i}_{shape.layers}")
    return names


def import_hf(source: str, target: str, family: str = AUTO, overwrite: bool = False,
              memory_limit: int = DEFAULT_MEMORY_LIMIT, execution: Execution | None = None,
              config: EngineConfig | None = None, into: str = MEGATRON, world_size: int | None = None) -> ImportResult:
    """Write the HF model at `source` as a Megatron-LM torch_dist save folder at `target` (`into` megatron), or
    as a DCP folder for `world_size` FSDP2 ranks under the HF names (`into` dcp, `to_dcp`)."""
    if into not in TARGETS:
        raise OptionError(f"into {into}: choose one of {', '.join(TARGETS)}", option="into")
    if world_size is not None and into != DCP:
        raise OptionError(f"world_size {world_size}: only an import into {DCP} is laid out for ranks (a Megatron "
                          "save loads at any TP/PP/EP)", option="world_size")
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise OptionError(f"world_size {world_size}: must be a positive integer", option="world_size")
    with use(config):
        return _import(source, target, family, overwrite, memory_limit, execution or Execution(), into,
                       world_size or 1)


@storage.with_io_errors
def _import(source: str, target: str, family_name: str, overwrite: bool, memory_limit: int,
            execution: Execution, into: str = MEGATRON, world_size: int = 1) -> ImportResult:
    storage.check_target(target, overwrite)
    where = storage.join(source, "config.json")
    if not storage.exists(where):
        raise FormatError(f"{source}: no config.json; a Hugging Face model folder holds one beside its weights",
                          uri=source)
    hf_config = read_json(where)
    if not isinstance(hf_config, dict):
        raise FormatError(f"{where}: not a JSON object", uri=where)
    family = family_of(hf_config, where, family_name)
    if into == DCP:
        outputs, report = write_fsdp2(source, target, hf_config, where, family, world_size, overwrite, memory_limit,
                                      execution)
        return ImportResult(target, family.name, outputs, report)
    args = megatron_args(hf_config, where)
    check(family, read_megatron(args, where), where)  # a config the table cannot express: before reading weights
    reader = storage.RangeReader()
    try:
        hf = load_index(source, None, reader=reader)
        view = megatron_view(hf, family, args, where)
        copier = Copier(reader, memory_limit, Progress(total_bytes=view.total_bytes, total_tensors=len(view.tensors)))
        pieces = [[Piece(n, e, ((0,) * len(e.shape), e.shape), e.dtype) for n, e in view.tensors.items()]]
        with open_output(target, overwrite, "dcp") as out:
            execute(plan_dcp(view, copier, pieces, lambda entry: None, RELEASE), out, copier, execution)
            objects = [ObjectEntry("args", value={k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}),
                       ObjectEntry("iteration", value=0), ObjectEntry("checkpoint_version", value=3.0)]
            execute(Plan("torch", [TorchPart([], objects, None, name=f"{RELEASE}/common.pt")]), out, copier, execution)
            side = collect(source, source, None, skip=frozenset({CONFIG}))
            for name, data in ((f"{RELEASE}/metadata.json", json.dumps(BACKEND).encode()),
                               ("latest_checkpointed_iteration.txt", RELEASE.encode()), *side.data.items()):
                with out.open(name) as fh:
                    fh.write(data)
            outputs = [(n, f["bytes"]) for n, f in out.files.items()]
        s = read_megatron(args, where).shape
        report = [f"imported {family.architecture} as Megatron-core torch_dist: {s.layers} layers, {s.heads} heads in "
                  f"{s.groups} query groups" + (f", {s.experts} experts" if s.experts else "")
                  + f" ({len(view.tensors)} layer-stacked tensors)"]
        report.append("carried side files: " + (", ".join(side.data) or "none (no generation_config.json or "
                                                                  "tokenizer files beside config.json)"))
        report.extend(reader.fetch_note())
        return ImportResult(target, family.name, outputs, report)
    finally:
        reader.close()
