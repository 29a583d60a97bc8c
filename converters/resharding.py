"""Reshard any checkpoint into a DCP folder laid out for a target world size (model and optimizer).

Optimizer state travels with its parameter: each per-parameter state tensor is split by the layout
under the parameter's name, so `exp_avg` lands on the same rank, in the same box, as its weight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import dtypes, storage
from .certificate import Ledger, certify
from .classify import optimizer_owners
from .config import EngineConfig, use
from .copier import DEFAULT_MEMORY_LIMIT, Copier, Progress
from .errors import OptionError
from .formats import load_index
from .framework_layouts import FrameworkLayout, framework_layout, read_side_file
from .index import CheckpointIndex, TensorEntry
from .layouts import make_layout
from .output import Output, open_output
from .plan import Execution, PartResult, execute
from .transforms import KeyOptions, apply
from .verification import VerifyReport, verify_output
from .writers.dcp import Piece, plan_dcp
from .writers.objects import load_object


@dataclass
class ReshardOptions:
    world_size: int
    layout: str = "fsdp2"
    dim_rules: list[tuple[str, int]] = field(default_factory=list)
    source_format: str | None = None
    keys: KeyOptions = field(default_factory=lambda: KeyOptions(only="all"))  # the training state, as stored
    dtype: str | None = None
    dtype_optim: bool = False
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    overwrite: bool = False
    verify: bool = False
    execution: Execution = field(default_factory=Execution)  # local threads, or Ray tasks (default: the config's)
    output_layout: str = "auto"  # the source framework's folder layout (framework_layouts), or "flat": one DCP
    stats: bool = False  # the certificate holds the statistics of source and output side by side

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise OptionError(f"world_size {self.world_size}: must be a positive integer", option="world_size")
        self.dtype = dtypes.cast_target(self.dtype)
        if self.dtype_optim and self.dtype is None:
            raise OptionError("dtype_optim needs `dtype`", option="dtype_optim")


@dataclass
class ReshardResult:
    target: str
    world_size: int
    outputs: list[tuple[str, int]]
    report: list[str]
    verify: VerifyReport | None = None
    parts: list[PartResult] = field(default_factory=list)  # per output file: size, CRC-32, node (not in to_dict)

    def to_dict(self) -> dict:
        return {"target": self.target, "world_size": self.world_size,
                "outputs": [{"name": n, "bytes": b} for n, b in self.outputs], "report": self.report,
                "verify": self.verify.to_dict() if self.verify else None}


def reshard(source: str, target: str, options: ReshardOptions,
            on_progress: Callable[[Progress], None] | None = None,
            reader: storage.RangeReader | None = None, config: EngineConfig | None = None) -> ReshardResult:
    """Reshard `source` into `target` under `config` (default: the engine config in force)."""
    with use(config):
        return _reshard(source, target, options, on_progress, reader)


@storage.with_io_errors
def _reshard(source: str, target: str, options: ReshardOptions, on_progress: Callable[[Progress], None] | None,
             reader: storage.RangeReader | None) -> ReshardResult:
    storage.check_target(target, options.overwrite)
    layout = make_layout(options.layout, options.dim_rules)
    own_reader = reader is None
    reader = reader or storage.RangeReader()
    try:
        index = load_index(source, options.source_format, reader=reader)
        view, report, parts = apply(index, options.keys, reader)
        if not view.tensors:
            raise OptionError(f"{source}: no tensors selected (`only` {options.keys.only})")
        for obj in view.objects.values():  # resolve values now, so renamed param lists are final
            obj.value, obj.data = load_object(obj, reader), None
        owners = optimizer_owners(view, parts)  # each state tensor is laid out as its parameter
        kept = framework_layout(index, view, options.world_size, options.output_layout, reader)

        def cast_for(entry: TensorEntry) -> str | None:
            optimizer = parts[entry.name].optimizer
            return options.dtype if (not optimizer or options.dtype_optim) else None

        copier = Copier(reader, options.memory_limit, Progress(total_bytes=view.total_bytes,
                                                               total_tensors=len(view.tensors),
                                                               callback=on_progress))
        copier.ledger = Ledger(index.uri, index.format, options.stats)
        plan: list[list[Piece]] = [[] for _ in range(options.world_size)]
        uneven = 0
        for name, entry in view.tensors.items():
            fqn = owners.get(name) or parts[name].fqn or name
            out_dtype = copier.out_dtype(entry, cast_for(entry))
            boxes = layout.boxes(fqn, entry.shape, options.world_size)
            uneven += bool(entry.shape) and None in boxes
            for rank, box in enumerate(boxes):
                if box is not None:
                    plan[rank].append(Piece(name, entry, box, out_dtype))
        copier.progress.pieces = dict(Counter(piece.name for pieces in plan for piece in pieces))
        copier.progress.total_tensors = len(copier.progress.pieces)
        if uneven:
            report.append(f"{uneven} tensors have fewer rows than {options.world_size} ranks: some ranks hold empty "
                          "shards of them, as FSDP2 does")
        empty = sum(1 for pieces in plan if not pieces)
        if empty:
            report.append(f"{empty} of {options.world_size} ranks hold no tensor data at all")
        with open_output(target, options.overwrite, "dcp") as out:
            results, verified = write_layout(kept, view, plan, copier, cast_for, out, options, index.uri, target)
            report.extend(kept.report() if kept.framework != "dcp" else [])
            certify(out, copier, view)
            result = ReshardResult(target, options.world_size, [(n, f["bytes"]) for n, f in out.files.items()],
                                   report, parts=results, verify=verified)
        report.extend(reader.fetch_note())
        return result
    finally:
        if own_reader:
            reader.close()


def write_layout(kept: FrameworkLayout, view: CheckpointIndex, plan: list[list[Piece]], copier: Copier,
                 cast_for: Callable[[TensorEntry], str | None], out: Output, options: ReshardOptions, source: str,
                 target: str) -> tuple[list[PartResult], VerifyReport | None]:
    """Write each DCP folder of the layout (its entries, their pieces) and copy its side files into `out`;
    with --verify, read every folder back."""
    results: list[PartResult] = []
    reports: list[VerifyReport] = []
    for folder, names in kept.folders.items():
        keep = set(names)
        sub = replace(view, tensors={n: t for n, t in view.tensors.items() if n in keep},
                      objects={n: o for n, o in view.objects.items() if n in keep})
        dcp_plan = plan_dcp(sub, copier, [[p for p in pieces if p.name in keep] for pieces in plan], cast_for,
                            folder)
        execute(dcp_plan, out, copier, options.execution)
        results += dcp_plan.results
        if options.verify:
            reports.append(verify_output(sub, storage.join(out.root, folder) if folder else out.root, "dcp",
                                         copier.reader, cast_ok=options.dtype is not None,
                                         memory_limit=options.memory_limit, target=target))
    for name, origin in kept.copies.items():
        with out.open(name) as fh:
            fh.write(read_side_file(source, origin))
    if kept.framework != "dcp":
        out.about["layout"] = kept.about()
    return results, (merged(reports) if reports else None)


def merged(reports: list[VerifyReport]) -> VerifyReport:
    """One report for the folders of an output, each verified on its own (all passed: a failure raised)."""
    first = reports[0]
    for other in reports[1:]:
        first.compared += other.compared
        first.compared_bytes += other.compared_bytes
        first.cast += other.cast
    if len(reports) > 1:
        first.notes.append(f"verified {len(reports)} DCP folders one by one")
    return first
