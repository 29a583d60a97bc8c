"""The engine's adapter exports: `export_adapter` (the adapter alone, as a PEFT folder) and `export_merged` (the
base with the adapter merged into it, as PEFT's `merge_and_unload()` leaves it, as sharded safetensors).

Any source the engine reads (PEFT's own folder, a DCP/FSDP, Accelerate or DeepSpeed training checkpoint) is
opened through `load_index` under its wrapper-cleaned model names; the adapter is found by structure (`detect`).
The merged export writes each output file at known offsets: every base tensor is first copied into place by the
copier's ordinary path in one thread (through a window buffer when uncast: the kernel takes the output's new pages,
the dear part of writing a file, while torch is still being imported in the background), and a LoRA Linear is
then merged into its copy in row slabs of 1/128 of `memory_limit`, read back from the page cache, merged and
overwritten in place by two workers side by side (torch at one intra-op thread each); an embedding,
fan_in_fan_out or cast weight is computed from the source instead. Every CRC-32 of the certificate is taken as
the bytes are read or written (no read-back). 2.14 GB fp32 base + rank-64 LoRA on every Linear
(benchmarks/merge_adapter.py, 2 cores shared with other work): ~260 MB peak RSS (225 MB of it torch's import);
torch's import (1-1.5 CPU-s, which the copies overlap) and the GEMMs (52 GFLOP, ~0.75 CPU-s) are what the plain
export does not pay.
The output appears only when complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from importlib import import_module
from typing import TYPE_CHECKING

from .. import dtypes, storage
from ..certificate import Ledger, certify_derived
from ..checksum import crc32
from ..copier import DEFAULT_MEMORY_LIMIT, Copier
from ..errors import FormatError, OptionError
from ..formats import load_index
from ..index import CheckpointIndex, TensorEntry
from ..jsonsafe import read_json
from ..output import Output, open_output
from ..sidefiles import collect
from ..transforms import KeyOptions, apply
from ..writers.safetensors import write_shards
from .detect import Adapter, LoraModule, find_adapter
from .inspection import describe
from .lora_settings import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings, settings_for
from .peft_folder import adapter_config, config_bytes, saved_names
from .shard_writer import Computed, Item, Slab, Where, copied, write_file

if TYPE_CHECKING:
    import torch

    from . import merge

DEFAULT_SHARD_SIZE = 5 * 1000**3
MIN_SLAB = 1 << 20  # bytes: the smallest row slab a LoRA Linear is merged in (tests lower it)
SLAB_SHARE = 128  # a row slab is at most 1/SLAB_SHARE of memory_limit (two workspaces of a few slabs each)
#: the merged export's copier threads: its copies run while torch is imported, the longer of the two (~1.6 CPU-s
#: against ~1.2 for a 2.14 GB base), which a second copier would take a core from; the kernel writes one file one
#: writer at a time anyway
COPY_THREADS = 1
#: the fewest rows a slab has: MKL multiplies a product of 1-3 rows by another kernel, whose sums round otherwise
#: than the whole product's rows (torch 2.13, every rank and width tried), so such slabs would not be PEFT's bits
MIN_ROWS = 4


@dataclass
class AdapterResult:
    target: str
    adapter: dict  # `describe`
    outputs: list[tuple[str, int]]
    report: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"target": self.target, "adapter": self.adapter,
                "outputs": [{"name": n, "bytes": b} for n, b in self.outputs], "report": self.report}


@dataclass
class _Opened:
    index: CheckpointIndex  # model tensors, wrapper-cleaned
    adapter: Adapter
    settings: LoraSettings


def _open(source: str, reader: storage.RangeReader, source_format: str | None, adapter: str | None,
          settings: LoraSettings) -> _Opened:
    raw = load_index(source, source_format, reader=reader)
    index = apply(raw, KeyOptions(only="model"), reader).index
    saved_file = storage.basename(source.rstrip("/")) == ADAPTER_WEIGHTS or (
        storage.isdir(source) and storage.exists(storage.join(source.rstrip("/"), ADAPTER_WEIGHTS)))
    found = find_adapter(index, adapter, saved_file=saved_file)
    if found is None:
        raise FormatError(f"{source}: holds no LoRA adapter (no lora_A / lora_B tensors); export it with convert",
                          uri=source)
    for module in found.modules.values():  # rank and alpha known (or refused) before anything is written
        settings.scaling(module.name, module.rank)
    return _Opened(index, found, settings)


def _copier(reader: storage.RangeReader, memory_limit: int, threads: int = 2) -> Copier:
    """The copier of the tensors an export writes unchanged (uncast: in the kernel, no buffer), in `threads`
    threads with a sixteenth of the memory budget (casting slabs of 1/(48 x threads): torch and the merge's slabs
    have the rest)."""
    return Copier(reader, memory_limit // 16, threads=threads)


def _check_common(memory_limit: int, max_shard_size: int, target: str) -> None:
    if max_shard_size <= 0:
        raise OptionError("max_shard_size must be positive", field="max_shard_size")
    if memory_limit < 1024 * 1024:
        raise OptionError("memory_limit must be at least 1MiB", field="memory_limit")
    if target.endswith(".safetensors"):
        raise OptionError(f"{target}: an adapter export is a folder; name a folder", field="target")


@storage.with_io_errors
def export_adapter(source: str, target: str, *, adapter: str | None = None, alpha: float | None = None,
                   use_rslora: bool | None = None, fan_in_fan_out: bool | None = None,
                   base_model_name_or_path: str | None = None, adapter_config_from: str | None = None,
                   overwrite: bool = False, source_format: str | None = None,
                   memory_limit: int = DEFAULT_MEMORY_LIMIT) -> AdapterResult:
    """Write the LoRA adapter in `source` as a PEFT folder at `target`: adapter_model.safetensors (the adapter's
    tensors in their stored dtype, under PEFT's saved names) and adapter_config.json."""
    _check_common(memory_limit, DEFAULT_SHARD_SIZE, target)
    settings = settings_for(source, alpha, use_rslora, fan_in_fan_out, adapter_config_from)
    storage.check_target(target, overwrite)
    reader = storage.RangeReader()
    try:
        opened = _open(source, reader, source_format, adapter, settings)
        names = saved_names(opened.adapter)
        source_doc = read_json(settings.found_in) if settings.found_in else None
        doc = adapter_config(opened.adapter, settings, source_doc if isinstance(source_doc, dict) else None,
                             base_model_name_or_path or settings.base_model_name_or_path)
        items = [copied(out, opened.index.tensors[name], None) for out, name in names.items()]
        copier = _copier(reader, memory_limit)
        copier.ledger = Ledger(opened.index.uri, opened.index.format, derived="adapter")  # for the certificate
        with open_output(target, overwrite, "safetensors") as out:
            out.about["adapter_export"] = {"adapter": opened.adapter.name}
            written = _named(ADAPTER_WEIGHTS, write_file(out, ADAPTER_WEIGHTS, items, copier))
            with out.open(ADAPTER_CONFIG) as fh:
                fh.write(config_bytes(doc))
            certify_derived(out, copier.ledger, written if out.local else None)
            outputs = [(n, f["bytes"]) for n, f in out.files.items()]
        report = [f"adapter {opened.adapter.name!r}: {len(opened.adapter.modules)} LoRA modules, "
                  f"{len(opened.adapter.replaced)} modules_to_save tensors", *reader.fetch_note()]
        return AdapterResult(target, describe(opened.adapter, settings, opened.index.tensors), outputs, report)
    finally:
        reader.close()


def _named(file: str, crcs: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Tensor -> (its file, its CRC-32), as `certify_derived` takes them."""
    return {tensor: (file, crc) for tensor, crc in crcs.items()}


def _bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy().data.cast("B")


def _import_torch() -> threading.Thread:
    """Import torch (through `merge`) in the background: its second of imports overlaps reading the indexes,
    planning, and copying the tensors the merge leaves as they are."""
    thread = threading.Thread(target=import_module, args=(f"{__package__}.merge",), name="ckpt-import", daemon=True)
    thread.start()
    return thread


def row_slabs(rows: int, step: int) -> list[tuple[int, int]]:
    """(start, count) of each slab of `step` rows (at least MIN_ROWS) of a weight of `rows` rows; a last slab of
    fewer than MIN_ROWS joins the one before it."""
    step = max(step, MIN_ROWS)
    slabs = [(start, min(step, rows - start)) for start in range(0, rows, step)]
    if len(slabs) > 1 and slabs[-1][1] < MIN_ROWS:
        start, count = slabs[-2]
        slabs[-2:] = [(start, count + slabs[-1][1])]
    return slabs


class _Merger:
    """The merged tensors of one adapter: base weights from `base`, adapter tensors from `lora` (indexes of model
    tensors, both read through `reader`). A slab is computed in its worker thread's own workspace (reused from
    slab to slab: flat memory), by torch at one intra-op thread in each worker."""

    def __init__(self, reader: storage.RangeReader, lora: CheckpointIndex, adapter: Adapter, settings: LoraSettings,
                 cast_to: str | None, memory_limit: int) -> None:
        self.reader, self.lora, self.adapter, self.settings = reader, lora, adapter, settings
        self.cast_to, self.budget = cast_to, max(memory_limit // SLAB_SHARE, MIN_SLAB)
        self.local = threading.local()  # each worker's workspace
        self.threads: int | None = None  # torch's intra-op threads before the merge set them to one
        self.ledger: Ledger | None = None  # the certificate's record of what is read

    def _one_thread(self) -> None:
        """Torch at one intra-op thread (this thread, and MKL's setting for all): the slabs are small and two
        workers merge side by side, and on a busy machine torch's spinning workers cost several times the merge
        itself (2.3 GB base: 2.3 s with one thread, 9-19 s with two on 2 loaded cores). The first call records the
        setting `close` restores."""
        import torch

        if self.threads is None:
            self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def _space(self) -> merge.Workspace:
        """This worker thread's workspace (made, and torch set to one thread in it, on its first slab)."""
        from . import merge

        space: merge.Workspace | None = getattr(self.local, "space", None)
        if space is None:
            self._one_thread()
            space = self.local.space = merge.Workspace()
        return space

    def close(self) -> None:
        """Give torch its intra-op threads back."""
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
            self.threads = None

    def _out(self, tensor: torch.Tensor, space: merge.Workspace | None = None) -> memoryview:
        """The bytes of `tensor`, cast (into `space`: `copy_` rounds as `.to` does) when asked."""
        from . import merge

        if self.cast_to and tensor.dtype.is_floating_point and merge.torch_dtype(self.cast_to) != tensor.dtype:
            target = merge.torch_dtype(self.cast_to)
            tensor = space.get("out", tuple(tensor.shape), target).copy_(tensor) if space else tensor.to(target)
        return _bytes(tensor)

    def _read(self, name: str) -> torch.Tensor:
        return self._whole(self.lora.tensors[name])

    def _whole(self, entry: TensorEntry) -> torch.Tensor:
        """`entry` read whole (its bytes handed to the ledger)."""
        from . import merge

        tensor = merge.read_tensor(self.reader, entry)
        if self.ledger is not None:
            self.ledger.read_whole(entry, _bytes(tensor))
        return tensor

    def _row_slab(self, module: LoraModule, base: TensorEntry, a: torch.Tensor, magnitude: torch.Tensor | None,
                  where: Where | None, rows: tuple[int, int], crcs: list[tuple[int, int]]) -> memoryview:
        """Output rows [start, start + n) of a LoRA or DoRA Linear, in this worker's workspace; the base rows are
        read from the source, or from the base's copy in the output (`where`: its fd and offset); the CRC-32s of
        the rows read from the source go to `crcs` (for the certificate, joined in order later)."""
        from . import merge

        space = self._space()
        start, n = rows
        if where is None:
            weight = space.read("weight", self.reader, base, rows)
        else:
            row_bytes = dtypes.numel(base.shape[1:]) * dtypes.itemsize(base.dtype)
            weight = space.pread("weight", where[0], where[1] + start * row_bytes, (n, *base.shape[1:]), base.dtype)
        b = space.read("b", self.reader, self.lora.tensors[module.b], rows)
        if self.ledger is not None:
            crcs.extend((crc32(_bytes(tensor)), tensor.nbytes) for tensor in ((b,) if where else (weight, b)))
        delta = merge.delta_rows(a, b, self.settings.scaling(module.name, module.rank), space)
        if magnitude is not None:
            return self._out(merge.merge_dora(weight, delta, magnitude[start: start + n], False), space)
        return self._out(merge.merge_lora(weight, delta), space)

    def in_place(self, module: LoraModule, base: TensorEntry, out_dtype: str) -> bool:
        """Whether `module`'s base weight can be copied into the output as it is and merged there: merged in row
        slabs (a Linear, not fan_in_fan_out) and written in its own dtype."""
        return module.kind == "linear" and not self.settings.fan_in_fan_out and out_dtype == base.dtype

    def weight(self, module: LoraModule, base: TensorEntry, out_dtype: str) -> Callable[[Where | None], Computed]:
        """The merged weight: `where` (its base's copy in the output, when `in_place`) or None (read the source)."""
        scaling = self.settings.scaling(module.name, module.rank)
        fifo = self.settings.fan_in_fan_out and module.kind == "linear"
        size = dtypes.itemsize(out_dtype)

        def compute(where: Where | None) -> Computed:
            from . import merge

            self._one_thread()
            a = self._read(module.a)
            magnitude = self._read(module.magnitude) if module.magnitude else None
            if module.kind == "embedding" or fifo:
                def whole() -> memoryview:
                    weight = self._whole(base)
                    delta = merge.delta_weight(a, self._read(module.b), scaling, fifo, module.kind == "embedding")
                    return self._out(merge.merge_dora(weight, delta, magnitude, fifo) if magnitude is not None
                                     else merge.merge_lora(weight, delta))
                return Computed(iter([Slab(dtypes.numel(base.shape) * size, whole)]))
            rows_out, cols = base.shape
            parts = row_slabs(rows_out, self.budget // max(cols * 4, 1))
            crcs: list[list[tuple[int, int]]] = [[] for _ in parts]  # per slab: (CRC-32, bytes) of base, lora_B

            def slabs() -> Iterator[Slab]:
                for rows, read in zip(parts, crcs):
                    run = partial(self._row_slab, module, base, a, magnitude, where, rows, read)
                    yield Slab(rows[1] * cols * size, run)

            def done() -> None:
                if self.ledger is not None:  # (the copy's reads are the copier's)
                    entries = (self.lora.tensors[module.b],) if where else (base, self.lora.tensors[module.b])
                    tallies = [self.ledger.reading(e) for e in entries]
                    for slab in crcs:
                        for tally, (crc, nbytes) in zip(tallies, slab, strict=True):
                            tally.extend(crc, nbytes)
                    for tally in tallies:
                        tally.close()
                merge.release()  # DoRA's temporaries
            return Computed(slabs(), done)
        return compute

    def bias(self, module: LoraModule, base: TensorEntry, out_dtype: str) -> Callable[[Where | None], Computed]:
        scaling = self.settings.scaling(module.name, module.rank)

        def compute(_: Where | None) -> Computed:
            from . import merge

            assert module.b_bias
            b_bias = module.b_bias

            def run() -> memoryview:
                return self._out(merge.merge_bias(self._whole(base), self._read(b_bias), scaling))
            return Computed(iter([Slab(dtypes.numel(base.shape) * dtypes.itemsize(out_dtype), run)]))
        return compute


def _base_tensors(opened: _Opened, base: str | None, base_format: str | None,
                  reader: storage.RangeReader) -> dict[str, TensorEntry]:
    """Base weight name -> entry: the checkpoint's own base weights, or the separate base's with the checkpoint's
    copies (PEFT's saved embedding layers) over them."""
    own = {name: opened.index.tensors[where] for name, where in opened.adapter.base.items()}
    if base is None:
        if not own:
            raise OptionError(f"{opened.index.uri}: holds the adapter only, no base weights; pass base=DIR (--base), "
                              "the HF folder of the model it was trained on", field="base")
        return own
    index = apply(load_index(base, base_format, reader=reader), KeyOptions(only="model"), reader).index
    if find_adapter(index) is not None:
        raise OptionError(f"{base}: holds a LoRA adapter itself; pass the plain base model as base", field="base")
    return {**index.tensors, **{n: e for n, e in own.items() if n in index.tensors}}


def _check_base(opened: _Opened, tensors: dict[str, TensorEntry], where: str) -> None:
    """Every target and saved module is in the base, with the shape the adapter expects."""
    fifo = opened.settings.fan_in_fan_out
    for module in opened.adapter.modules.values():
        entry = tensors.get(module.weight)
        if entry is None:
            raise FormatError(f"{module.a}: the adapter targets {module.name}, which the base ({where}) does not have "
                              f"(no {module.weight}); pass the base model the adapter was trained on",
                              key=module.weight)
        if module.kind == "embedding":
            want: tuple[int, ...] = (module.in_features, module.out_features)
        else:
            want = (module.in_features, module.out_features) if fifo else (module.out_features, module.in_features)
        if entry.shape != want:
            raise FormatError(f"{module.weight}: base weight of shape {list(entry.shape)}, the adapter on "
                              f"{module.name} expects {list(want)}; pass the base model the adapter was trained on",
                              key=module.weight)
        if entry.dtype not in dtypes.FLOATING:
            raise FormatError(f"{module.weight}: a {entry.dtype} base weight cannot take a LoRA merge (a quantized "
                              "base?); merge into the unquantized base", key=module.weight)
        if module.b_bias and f"{module.name}.bias" not in tensors:
            raise FormatError(f"{module.b_bias}: the adapter has lora_bias but the base {module.name} has no bias; "
                              "pass the base model the adapter was trained on", key=module.b_bias)
    for name, saved in opened.adapter.replaced.items():
        if name not in tensors:
            raise FormatError(f"{saved}: modules_to_save replaces {name}, which the base ({where}) does not have; "
                              "pass the base model the adapter was trained on", key=name)


@storage.with_io_errors
def export_merged(source: str, target: str, base: str | None = None, *, adapter: str | None = None,
                  alpha: float | None = None, use_rslora: bool | None = None, fan_in_fan_out: bool | None = None,
                  adapter_config_from: str | None = None, dtype: str | None = None,
                  max_shard_size: int = DEFAULT_SHARD_SIZE, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                  overwrite: bool = False, config_from: str | None = None, source_format: str | None = None,
                  base_format: str | None = None) -> AdapterResult:
    """Write the base model with the LoRA adapter in `source` merged into it, as `merge_and_unload()` would, to
    `target` (sharded safetensors + index + the base's config and tokenizer files). The base: the checkpoint's
    own base weights, or the HF folder `base`."""
    _check_common(memory_limit, max_shard_size, target)
    cast_to = dtypes.cast_target(dtype)
    settings = settings_for(source, alpha, use_rslora, fan_in_fan_out, adapter_config_from)
    storage.check_target(target, overwrite)
    _import_torch()
    reader = storage.RangeReader()
    merger: _Merger | None = None
    try:
        opened = _open(source, reader, source_format, adapter, settings)
        tensors = _base_tensors(opened, base, base_format, reader)
        _check_base(opened, tensors, base or source)
        merger = _Merger(reader, opened.index, opened.adapter, settings, cast_to, memory_limit)
        merged_bias = {f"{m.name}.bias": m for m in opened.adapter.modules.values() if m.b_bias}
        items = []
        for name, entry in sorted(tensors.items()):
            out_dtype = cast_to if cast_to and entry.dtype in dtypes.FLOATING else entry.dtype
            module = opened.adapter.modules.get(name.rpartition(".")[0])
            if name in opened.adapter.replaced:
                saved = opened.index.tensors[opened.adapter.replaced[name]]
                if saved.shape != entry.shape:
                    raise FormatError(f"{opened.adapter.replaced[name]}: modules_to_save copy of shape "
                                      f"{list(saved.shape)}, the base {name} is {list(entry.shape)}; pass the base the "
                                      "adapter was trained on", key=name)
                items.append(copied(name, saved, cast_to))
            elif module is not None and name == module.weight:
                copy = entry if merger.in_place(module, entry, out_dtype) else None  # merged into its copy
                items.append(Item(name, out_dtype, entry.shape, copy, merger.weight(module, entry, out_dtype)))
            elif name in merged_bias:
                compute = merger.bias(merged_bias[name], entry, out_dtype)
                items.append(Item(name, out_dtype, entry.shape, compute=compute))
            else:
                items.append(copied(name, entry, cast_to))
        for item in items:
            dtypes.to_safetensors(item.dtype, item.name)
        side = collect(base or source, config_from, cast_to)
        with open_output(target, overwrite, "safetensors") as out:
            out.about["adapter_merge"] = {"adapter": opened.adapter.name, "dtype": cast_to}
            copier = _copier(reader, memory_limit, COPY_THREADS)
            copier.ledger = merger.ledger = Ledger(opened.index.uri, opened.index.format, derived="merge")
            written: dict[str, tuple[str, int]] = {}

            def write(o: Output, name: str, shard: list[Item]) -> None:
                written.update(_named(name, write_file(o, name, shard, copier)))
            write_shards(out, items, max_shard_size, write, side.data)
            certify_derived(out, copier.ledger, written if out.local else None)
            outputs = [(n, f["bytes"]) for n, f in out.files.items()]
        variants = ", ".join(sorted(opened.adapter.variants))
        report = [f"merged adapter {opened.adapter.name!r} ({variants}) into {len(opened.adapter.modules)} modules, "
                  f"{len(opened.adapter.replaced)} modules_to_save tensors replaced", side.report(),
                  *reader.fetch_note()]
        return AdapterResult(target, describe(opened.adapter, settings, opened.index.tensors), outputs, report)
    finally:
        if merger is not None:
            merger.close()
        reader.close()
