"""The engine's public entry points: inspect, convert (to safetensors or torch) and verify.

Everything here is a plain library call: the CLI and the service call the same functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from . import dtypes, storage
from .certificate import Ledger, certify, write_sidecar
from .config import EngineConfig, use
from .consumer import check
from .copier import DEFAULT_MEMORY_LIMIT, Copier, Progress
from .errors import FormatError, OptionError
from .formats import load_index, read_json
from .hf_families.mapping import CHOICES as HF_CHOICES
from .index import CheckpointIndex
from .names import MANIFEST
from .output import open_output
from .plan import Execution, PartResult, execute
from .sidefiles import CONFIG, SideFiles, collect
from .transforms import KeyOptions, apply
from .verification import VerifyReport, find_tie, verify_indexes, verify_output
from .writers import WRITERS

OutputFormat = Literal["safetensors", "torch"]
DEFAULT_SHARD_SIZE = 5 * 1000**3


@dataclass
class ConvertOptions:
    to: OutputFormat = "safetensors"
    source_format: str | None = None
    keys: KeyOptions = field(default_factory=KeyOptions)
    dtype: str | None = None
    max_shard_size: int = DEFAULT_SHARD_SIZE
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    overwrite: bool = False
    drop_tied: list[str] = field(default_factory=list)
    verify: bool = False
    export: bool = False  # an export for serving: model weights only, never optimizer state
    to_hf: str | None = None  # a family (hf_families) or "auto": Megatron GPT -> HF names, layouts, config.json
    config_from: str | None = None  # an export's side files (config, tokenizer) from this folder (`sidefiles`)
    execution: Execution = field(default_factory=Execution)  # local threads, or Ray tasks (default: the config's)
    stats: bool = False  # the certificate holds the statistics of source and output side by side

    def __post_init__(self) -> None:
        if self.export and self.keys.only != "model":
            raise OptionError(f"only {self.keys.only}: an export holds the model weights alone; convert with `only` "
                              "all to keep optimizer and training state", option="only")
        if self.to not in ("safetensors", "torch"):
            raise OptionError(f"to {self.to}: choose safetensors or torch", option="to")
        self.dtype = dtypes.cast_target(self.dtype)
        if self.max_shard_size <= 0:
            raise OptionError("max_shard_size must be positive", option="max_shard_size")
        if self.memory_limit < 1024 * 1024:
            raise OptionError("memory_limit must be at least 1MiB", option="memory_limit")
        if self.to_hf is not None and self.to_hf not in HF_CHOICES:
            raise OptionError(f"to_hf {self.to_hf}: choose one of {', '.join(HF_CHOICES)}", option="to_hf")
        if self.config_from is not None and not self.export:
            raise OptionError("config_from applies to exports (their config and tokenizer files)", option="config_from")
        if self.to_hf and (self.to != "safetensors" or not self.keys.clean or self.keys.only != "model"):
            raise OptionError("to_hf writes the model weights as safetensors under clean names: leave `only`, `to` and "
                              "`clean_keys` at their defaults", option="to_hf")


@dataclass
class ConvertResult:
    target: str
    outputs: list[tuple[str, int]]
    report: list[str]
    skipped: list[str]
    verify: VerifyReport | None = None
    parts: list[PartResult] = field(default_factory=list)  # per output file: size, CRC-32, node (not in to_dict)
    side_files: SideFiles | None = None  # an export's config and tokenizer files

    def to_dict(self) -> dict:
        return {"target": self.target, "outputs": [{"name": n, "bytes": b} for n, b in self.outputs],
                "report": self.report, "skipped": self.skipped,
                "verify": self.verify.to_dict() if self.verify else None,
                "side_files": self.side_files.to_dict() if self.side_files else None}


def inspect(uri: str, source_format: str | None = None, config: EngineConfig | None = None) -> CheckpointIndex:
    """Metadata only: reads no tensor data (DCP records are not even opened)."""
    with use(config):
        return load_index(uri, source_format, locate=False)


def _drop_tied(index: CheckpointIndex, names: list[str], copier: Copier) -> dict[str, str]:
    ties: dict[str, str] = {}
    for name in names:
        if name not in index.tensors:
            raise OptionError(f"drop_tied {name}: no such tensor in the output; known names include "
                              f"{', '.join(list(index.tensors)[:5])}", option="drop_tied")
        partner = find_tie(index, name, copier.reader)
        if partner is None:
            raise OptionError(f"drop_tied {name}: no other tensor holds the same values, so dropping it would "
                              "lose data; leave it in", option="drop_tied")
        ties[name] = partner
        del index.tensors[name]
    return ties


def convert(source: str, target: str, options: ConvertOptions | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            reader: storage.RangeReader | None = None, config: EngineConfig | None = None) -> ConvertResult:
    """Convert the checkpoint at `source` into `target` (a folder, or a `.safetensors`/`.pt` file), under
    `config` (default: the engine config in force)."""
    with use(config):
        return _convert(source, target, options, on_progress, reader)


@storage.with_io_errors
def _convert(source: str, target: str, options: ConvertOptions | None,
             on_progress: Callable[[Progress], None] | None, reader: storage.RangeReader | None) -> ConvertResult:
    options = options or ConvertOptions()
    storage.check_target(target, options.overwrite)
    own_reader = reader is None
    reader = reader or storage.RangeReader()
    try:
        index = load_index(source, options.source_format, reader=reader)
        view, report, _ = apply(index, options.keys, reader)
        hf_config = None
        if options.to_hf:
            if target.endswith(".safetensors"):
                raise OptionError(f"to_hf writes a folder (weights and config.json), not {target}", option="to_hf")
            view, hf_config, notes = _to_hf(source, options, index, view, reader)
            report += notes
        skipped = []
        if options.to == "safetensors" and view.objects:
            skipped = sorted(view.objects)
            report.append(f"skipped {len(skipped)} non-tensor entries (safetensors holds tensors only): "
                          + ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
            view.objects = {}
        if not view.tensors and not view.objects:
            raise OptionError(f"{source}: nothing selected to write (`only` {options.keys.only}, "
                              "`include`/`exclude`); the checkpoint has: "
                              + ", ".join(sorted({n.split('.', 1)[0] for n in index.names()})))
        progress = Progress(total_bytes=sum(t.nbytes for t in view.tensors.values()),
                            total_tensors=len(view.tensors), callback=on_progress)
        copier = Copier(reader, options.memory_limit, progress)
        copier.ledger = Ledger(index.uri, index.format, options.stats)
        metadata: dict[str, str] = {}
        ties: dict[str, str] = {}
        if options.drop_tied:
            ties = _drop_tied(view, options.drop_tied, copier)
            metadata["tied_weights"] = json.dumps(ties)
            report.append("dropped tied " + ", ".join(f"{a} (= {b})" for a, b in ties.items()))
        single = options.to == "torch" or target.endswith(".safetensors")
        side = _side_files(source, options, view, copier, hf_config is not None) if options.export and not single \
            else None
        if side is not None:
            report.append(side.report())
        with open_output(target, options.overwrite, options.to, single_file=single) as out:
            if options.export:
                out.about["export"] = _export_record(options, list(ties))
            plan = WRITERS[options.to](view, out, copier, cast_to=options.dtype, max_shard_size=options.max_shard_size,
                                       metadata=metadata)
            execute(plan, out, copier, options.execution)
            if hf_config is not None:
                with out.open("config.json") as fh:
                    fh.write(json.dumps(hf_config, indent=2).encode())
            for name, data in (side.data if side else {}).items():
                with out.open(name) as fh:
                    fh.write(data)
            certify(out, copier, view)
            result = ConvertResult(target, [(n, f["bytes"]) for n, f in out.files.items()], report, skipped,
                                   parts=plan.results, side_files=side)
            if options.verify:
                result.verify = verify_output(view, out.root, options.to, reader, cast_ok=options.dtype is not None,
                                              memory_limit=options.memory_limit, target=target)
        write_sidecar(out, options.to)  # a single file's manifest and certificate, beside it once it is in place
        report.extend(reader.fetch_note())
        return result
    finally:
        if own_reader:
            reader.close()


def _side_files(source: str, options: ConvertOptions, view: CheckpointIndex, copier: Copier,
                has_config: bool) -> SideFiles:
    """The config and tokenizer files an export carries; the config's dtype is the one its floating tensors
    all have (None when they differ)."""
    floating = {copier.out_dtype(t, options.dtype) for t in view.tensors.values() if t.dtype in dtypes.FLOATING}
    dtype = floating.pop() if len(floating) == 1 else None
    return collect(source, options.config_from, dtype, frozenset({CONFIG}) if has_config else frozenset())


def _export_record(options: ConvertOptions, dropped: list[str]) -> dict:
    """What an export holds, for its manifest: the key mapping, cast and dropped ties that `verify` re-applies
    to the source to compare it with the export."""
    keys = options.keys
    return {"only": keys.only, "clean": keys.clean, "renames": [list(r) for r in keys.renames],
            "include": keys.include, "exclude": keys.exclude, "dtype": options.dtype, "dropped_tied": dropped,
            "to_hf": options.to_hf}


def _export_of(uri: str) -> tuple[str, dict] | None:
    """(manifest URI, its `export` record) when `uri` is a folder an export of ours wrote, else None."""
    where = storage.join(uri, MANIFEST)
    if not storage.isdir(uri) or not storage.exists(where):
        return None
    doc = read_json(where)
    record = doc.get("export") if isinstance(doc, dict) else None
    return (where, record) if isinstance(record, dict) else None


def _export_keys(where: str, record: dict) -> KeyOptions:
    try:
        return KeyOptions(only=record["only"], clean=bool(record["clean"]), nest=False,
                          renames=[(str(p), str(r)) for p, r in record["renames"]],
                          include=[str(x) for x in record["include"]], exclude=[str(x) for x in record["exclude"]])
    except (KeyError, TypeError, ValueError, OptionError):
        raise FormatError(f"{where}: its export record (only, clean, renames, include, exclude) is damaged; "
                          "re-export, or compare with `only`/`rename` as the export was made", uri=where) from None


def _to_hf(source: str, options: ConvertOptions, index: CheckpointIndex, view: CheckpointIndex,
           reader: storage.RangeReader) -> tuple[CheckpointIndex, dict, list[str]]:
    from .formats import open_reader
    from .hf_families import to_hf

    source_reader = open_reader(source.rstrip("/"), options.source_format or index.format, reader)
    if not hasattr(source_reader, "model_config"):
        raise OptionError(f"to_hf {options.to_hf} maps Megatron-core / NeMo GPT checkpoints; {source} is "
                          f"{index.format}", option="to_hf")
    config, where = source_reader.model_config(index)
    view, hf_config, report = to_hf(view, config, where, options.to_hf or "auto")
    if options.dtype:
        hf_config["torch_dtype"] = options.dtype
    return view, hf_config, report


def verify(a: str, b: str, *, keys: KeyOptions | None = None, atol: float = 0.0, rtol: float = 0.0,
           a_format: str | None = None, b_format: str | None = None,
           memory_limit: int = DEFAULT_MEMORY_LIMIT, config: EngineConfig | None = None) -> VerifyReport:
    """Compare two checkpoints tensor by tensor after the same key clean-up; then `b` (a DCP folder, a
    safetensors or torch file) read by its consumer's own loader must hold the same values as we read.

    Without `keys`, when `b` is an export of ours (its manifest says so), `a` is compared as the export saw
    it: its model weights under the export's names, cast as the export cast them, tied copies dropped.
    Runs under `config` (default: the engine config in force)."""
    with use(config):
        return _verify(a, b, keys, atol, rtol, a_format, b_format, memory_limit)


def _verify(a: str, b: str, keys: KeyOptions | None, atol: float, rtol: float, a_format: str | None,
            b_format: str | None, memory_limit: int) -> VerifyReport:
    reader = storage.RangeReader()
    try:
        a_index = load_index(a, a_format, reader=reader)
        b_index = load_index(b, b_format, reader=reader)
        export = _export_of(b_index.uri) if keys is None else None
        notes, cast_ok = [], atol > 0 or rtol > 0
        if export is None:
            keys = keys or KeyOptions(only="all", clean=True, nest=False)
            left, right = apply(a_index, keys, reader).index, apply(b_index, keys, reader).index
        else:
            where, record = export
            left = apply(a_index, _export_keys(where, record), reader).index
            right = apply(b_index, KeyOptions(only="all", clean=False, nest=False), reader).index
            if record.get("to_hf"):
                again = ConvertOptions(export=True, to_hf=str(record["to_hf"]), source_format=a_format)
                left = _to_hf(a, again, a_index, left, reader)[0]
            for name in record.get("dropped_tied") or []:
                left.tensors.pop(str(name), None)
            cast_ok = cast_ok or bool(record.get("dtype"))
            notes.append(f"{b} is an export (model weights only): compared what it holds, {a}'s model weights "
                         "under the export's names" + (f", cast to {record['dtype']}" if record.get("dtype") else ""))
        report = verify_indexes(left, right, reader, atol=atol, rtol=rtol, cast_ok=cast_ok,
                                memory_limit=memory_limit)
        report.notes = notes
        if report.ok:  # `b` is usually an output: its consumer must load it, with the same values
            report.consumer = check(b_index, b_index.uri, b_index.format, reader, memory_limit // 4)
        return report
    finally:
        reader.close()
