"""`export_gguf`: an HF-layout checkpoint (config.json + weights the engine reads, + tokenizer files) written as
one GGUF file for llama.cpp, key for key and byte for byte what llama.cpp's convert_hf_to_gguf.py writes from the
same folder (tests/test_gguf_export.py runs it as the oracle).

Families: Llama, Mistral and Mixtral (arch llama, Q/K rows permuted), Qwen2 (+ q/k/v bias), Qwen3 (+ q/k norm),
Qwen3-MoE; MoE experts stacked [E, out, in]. Types (`outtype`): f32, f16, bf16, q8_0. Tokenizers: byte-level BPE
(tokenizer.json) and SentencePiece (tokenizer.model).

Streaming: the header (metadata, token list, tensor infos) is built in memory; each tensor is then read, converted
and written in slabs of whole rows of about `memory_limit // 8` bytes through one reused buffer.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .. import storage
from ..certificate import Ledger, certify_derived, write_sidecar
from ..copier import DEFAULT_MEMORY_LIMIT
from ..errors import FormatError, OptionError
from ..modelview import model_view
from ..output import open_output
from ..sidefiles import CONFIG, collect
from . import metadata, names, quant, tokenizer
from .writer import HeaderWriter, Reader, write_data

__all__ = ["OUTTYPES", "GgufResult", "export_gguf"]

OUTTYPES = tuple(quant.OUTTYPES)
_META_SIDE = ("config.json", "generation_config.json")
README = "README.md"
_README_CAP = 1024 * 1024


@dataclass
class GgufResult:
    target: str
    architecture: str
    outtype: str
    tensors: int
    bytes: int
    types: dict[str, int] = field(default_factory=dict)  # GGUF tensor type -> how many tensors
    report: list[str] = field(default_factory=list)

    @property
    def outputs(self) -> list[tuple[str, int]]:
        """The one file written and its size, as every writer's result lists its outputs."""
        return [(storage.basename(self.target), self.bytes)]

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "architecture": self.architecture, "outtype": self.outtype,
                "outputs": [{"name": n, "bytes": b} for n, b in self.outputs],
                "tensors": self.tensors, "bytes": self.bytes, "types": dict(self.types), "report": self.report}


def _folder(source: str) -> str:
    base = os.path.abspath(storage.local_path(source)) if storage.is_local(source) else source.rstrip("/")
    return base if storage.isdir(base) else storage.parent(base)


def _model_card(folder: str) -> bytes | None:
    """The source folder's README.md (its YAML front matter: license, tags, base models... for general.*)."""
    uri = storage.join(folder, README)
    return storage.read_all(uri, _README_CAP) if storage.exists(uri) else None


def _general(writer: HeaderWriter, side: dict[str, bytes], source: str, folder: str) -> None:
    """general.type, name, size_label... as llama.cpp's converter derives them (gguf-py's Metadata heuristics
    over README.md, config.json, generation_config.json and the source folder's name)."""
    model_dir = Path(folder) / (storage.basename(_folder(source)) or "model")
    model_dir.mkdir()
    for name in (*_META_SIDE, README):
        if name in side:
            (model_dir / name).write_bytes(side[name])
    total, shared, expert, count = writer.get_total_parameter_count()
    try:
        meta = gguf.Metadata.load(None, model_dir, None, total)
    except Exception as exc:  # yaml.YAMLError (gguf-py reads the front matter with yaml.safe_load), bad values
        if not isinstance(exc, ValueError | TypeError | AttributeError | KeyError) and \
                not type(exc).__module__.startswith("yaml"):
            raise
        raise FormatError(f"{source} ({README}): its front matter cannot be read ({type(exc).__name__}); fix or "
                          "remove README.md", uri=source, key=README) from None
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)


@storage.with_io_errors
def export_gguf(source: str, target: str, outtype: str = "f16", *, overwrite: bool = False,
                memory_limit: int = DEFAULT_MEMORY_LIMIT, config_from: str | None = None,
                source_format: str | None = None, tokenizer_pre: str | None = None) -> GgufResult:
    """Write the HF-layout checkpoint `source` as the GGUF file `target` (tensor types per `outtype`)."""
    wanted, file_type = quant.outtype(outtype)
    if memory_limit < 1024 * 1024:
        raise OptionError("memory_limit must be at least 1MiB", field="memory_limit", option="memory_limit")
    if not target.endswith(".gguf"):
        raise OptionError(f"{target}: a GGUF export is one file; name it <name>.gguf", field="target")
    storage.check_target(target, overwrite)
    reader = storage.RangeReader()
    try:
        view = model_view(source, source_format, reader, "to export")
        side = collect(source, config_from, None)
        if CONFIG not in side.data:
            raise OptionError(f"{source}: no config.json beside the checkpoint; GGUF metadata comes from it: pass "
                              "config_from=DIR (the folder holding the model's config.json)", field="config_from",
                              option="config_from")
        config = tokenizer.json_object(side.data[CONFIG], CONFIG, source)
        fam = metadata.family(config, source)
        blocks = metadata.block_count(config, source)
        planned = names.plan(view.tensors, config, fam, blocks, source)
        odd = [p for p in planned if p.source_dtype not in quant.FLOATS]
        if odd:
            raise FormatError(f"{source}: tensor {odd[0].hf_name} is {odd[0].source_dtype}; the GGUF export takes "
                              "floating-point weights (dequantize the checkpoint first)", uri=source,
                              key=odd[0].hf_name)
        types = [quant.tensor_type(fam.arch, p.name, p.shape, wanted) for p in planned]
        writer = HeaderWriter(None, fam.name)
        for p, qtype in zip(planned, types, strict=True):
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), quant.nbytes(p.shape, qtype), qtype)
        card = _model_card(_folder(source))
        with tempfile.TemporaryDirectory(prefix="ckpt-gguf-") as folder:
            _general(writer, {**side.data, README: card} if card is not None else side.data, source, folder)
        metadata.add_parameters(writer, config, fam, file_type, source)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        embedding = next((p for p in planned if p.name == "token_embd.weight"), None)
        if embedding is None or len(embedding.shape) != 2:
            raise FormatError(f"{source}: no 2-D token embedding (model.embed_tokens.weight); llama.cpp needs it",
                              uri=source, key="model.embed_tokens.weight")
        tokenizer.add_vocab(writer, side.data, config, source, embedding.shape[0], tokenizer_pre,
                            add_space_prefix=fam.arch == gguf.MODEL_ARCH.LLAMA)
        header = writer.header()
        ledger = Ledger(view.uri, view.format, derived="gguf")  # what is read, for the certificate
        source_reader = Reader(reader, max(memory_limit // 32, 1024 * 1024), ledger)
        with open_output(target, overwrite, "gguf", single_file=True) as out:
            with out.open() as fh:
                fh.write(header)
                write_data(fh, planned, types, source_reader)
            size = sum(f["bytes"] for f in out.files.values()) if out.files else 0
            certify_derived(out, ledger)
        write_sidecar(out, "gguf")  # its manifest and certificate, beside it
        counts: dict[str, int] = {}
        for qtype in types:
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        report = [f"{fam.name} GGUF, {len(planned)} tensors ({', '.join(f'{n} {k}' for k, n in counts.items())})",
                  side.report()]
        report.extend(reader.fetch_note())
        return GgufResult(target, fam.name, outtype, len(planned), size, counts, report)
    finally:
        reader.close()
