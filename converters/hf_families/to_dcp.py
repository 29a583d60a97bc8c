"""`import --to dcp`: a Hugging Face folder as a torch.distributed.checkpoint folder laid out for N FSDP2 ranks,
the start of an FSDP2 run from a HF model.

The keys are the HF parameter names, which is what `get_model_state_dict` of a `fully_shard`-wrapped
transformers model has (FSDP2 keeps the module's names). A tied model's safetensors hold the embedding once,
but the wrapped model's state_dict names it twice: `lm_head.weight` is written as a second record of the same
bytes, so `dcp.load` finds every key; a MoE block's experts are fused as transformers' modules hold them
(`fused_experts`). Each tensor is cut in dim-0 `torch.chunk` pieces as `fully_shard` shards
it (dcp.load reads the folder at any world size). config.json and the folder's generation config and tokenizer
files are copied beside the DCP files, so the run builds its model from the folder itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from fnmatch import fnmatch
from itertools import count
from typing import Any

from .. import storage
from ..certificate import Ledger, certify
from ..copier import Copier, Progress
from ..errors import FormatError
from ..formats import load_index
from ..index import CheckpointIndex, TensorEntry
from ..layouts import make_layout
from ..output import open_output
from ..plan import Execution, execute
from ..sidefiles import collect
from ..stacking import concat
from ..writers.dcp import Piece, plan_dcp
from .table import Family
from .transforms import stack

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def fsdp2_view(hf: CheckpointIndex, family: Family, hf_config: dict[str, Any],
               where: str) -> tuple[CheckpointIndex, list[str]]:
    """The HF tensors under the names a FSDP2-wrapped model's state_dict has (experts fused, a tied head
    added), and a report."""
    tensors, notes = fused_experts(dict(hf.tensors), family, hf.uri)
    # planner paths as dcp.save records a flat state_dict's keys: each whole
    tensors = {n: replace(t, path=(n,)) for n, t in tensors.items()}
    if HEAD not in tensors and EMBEDDING in tensors:
        if hf_config.get("tie_word_embeddings") is False:
            raise FormatError(f"{hf.uri}: no {HEAD!r} and {where} says tie_word_embeddings is false; the folder "
                              "lacks the output layer (add it, or set tie_word_embeddings to true if the model ties "
                              "it)")
        tensors[HEAD] = replace(tensors[EMBEDDING], name=HEAD, path=(HEAD,))
        notes.append(f"tied embeddings: {HEAD} written as a copy of {EMBEDDING} (the wrapped model's state_dict has "
                     "both)")
    return replace(hf, tensors=tensors, objects={}), notes


def fused_experts(tensors: dict[str, TensorEntry], family: Family,
                  uri: str) -> tuple[dict[str, TensorEntry], list[str]]:
    """transformers (5.x) keeps a MoE block's experts fused where its files keep one tensor per expert:
    `mlp.experts.gate_up_proj` = the experts' cat([gate, up]) stacked, `mlp.experts.down_proj` = their down
    stacked, and the block is `mlp` whatever the files call it (Mixtral's `block_sparse_moe`). The per-expert
    rules of the family's table name the file's tensors; they become those two, as views."""
    rules = [r for r in family.layer if r.per_expert]
    layers = 0
    for i in count():
        at = f"model.layers.{i}."
        if not any(name.startswith(at) for name in tensors):
            break
        blocks = set()
        for r in rules:
            if at + r.hf[0].format(e=0) not in tensors:
                continue  # a dense layer (DeepSeek's first k)
            blocks.add(r.hf[0].split(".experts.", 1)[0])
            target = at + "mlp.experts." + ("gate_up_proj" if len(r.hf) == 2 else "down_proj")
            experts = []
            for e in count():
                names = [at + n.format(e=e) for n in r.hf]
                if not all(n in tensors for n in names):
                    break
                experts.append(concat(target, [tensors.pop(n) for n in names]))
            tensors[target] = stack(target, experts)
        for block in blocks - {"mlp"}:  # the router and any other tensor of the block
            for name in [n for n in tensors if n.startswith(f"{at}{block}.")]:
                new = f"{at}mlp." + name[len(f"{at}{block}."):]
                tensors[new] = replace(tensors.pop(name), name=new)
        layers += bool(blocks)
    left = [n for n in tensors if any(fnmatch(n, "model.layers.*." + r.hf[0].replace("{e}", "*")) for r in rules)]
    if left:
        raise FormatError(f"{uri}: {left[0]!r} is not one of experts 0..N-1 of its layer (an expert is missing "
                          "before it); nothing was written")
    notes = [f"fused the experts of {layers} MoE layers into mlp.experts.gate_up_proj and down_proj, as "
             "transformers' modules hold them"] if layers else []
    return tensors, notes


def write_fsdp2(source: str, target: str, hf_config: dict[str, Any], where: str, family: Family, world_size: int,
                overwrite: bool, memory_limit: int, execution: Execution) -> tuple[list[tuple[str, int]], list[str]]:
    """Write the DCP folder; return its files and the report."""
    layout = make_layout("fsdp2", [])
    reader = storage.RangeReader()
    try:
        hf = load_index(source, None, reader=reader)
        view, notes = fsdp2_view(hf, family, hf_config, where)
        copier = Copier(reader, memory_limit, Progress(total_bytes=view.total_bytes, total_tensors=len(view.tensors)))
        copier.ledger = Ledger(hf.uri, hf.format, False)
        plan: list[list[Piece]] = [[] for _ in range(world_size)]
        for name, entry in view.tensors.items():
            for rank, box in enumerate(layout.boxes(name, entry.shape, world_size)):
                if box is not None:
                    plan[rank].append(Piece(name, entry, box, entry.dtype))
        copier.progress.pieces = dict(Counter(piece.name for pieces in plan for piece in pieces))
        with open_output(target, overwrite, "dcp") as out:
            execute(plan_dcp(view, copier, plan, lambda entry: None), out, copier, execution)
            side = collect(source, source, None)
            for name, data in side.data.items():
                with out.open(name) as fh:
                    fh.write(data)
            certify(out, copier, view)
            outputs = [(n, f["bytes"]) for n, f in out.files.items()]
        report = [f"imported {family.architecture} as a DCP checkpoint for {world_size} FSDP2 rank(s): "
                  f"{len(view.tensors)} tensors under the HF names (dcp.load reads it at any world size)", *notes,
                  "carried side files: " + (", ".join(side.data) or "none")]
        report.extend(reader.fetch_note())
        return outputs, report
    finally:
        reader.close()
