"""Reader for DeepSpeed ZeRO checkpoints (stages 1, 2 and 3; fp32, fp16 and bf16 training).

A DeepSpeed save folder holds `latest` (the tag) and one folder per tag (`global_stepN/`) with
`mp_rank_00_model_states.pt` (stages 1/2) or `zero_pp_rank_R_mp_rank_00_model_states.pt` (stage 3) and
`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`. The fp32 master weights and Adam state live in flat
per-rank partitions. The index rebuilds every parameter the way DeepSpeed's `zero_to_fp32` does
(group order from `param_shapes`, per-parameter alignment paddings, stage 3's per-parameter
`ceil(numel / world)` partitions, frozen parameters from `frozen_param_fragments`, tied parameters from
`shared_params`, buffers from `module`), but as byte ranges into the partitions: a parameter's elements
are a run of flat elements, cut into row-major boxes (`flatparts`), each one contiguous in a file.
Nothing is loaded whole and nothing of DeepSpeed is imported: its classes are stand-ins below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from .. import dtypes, storage
from ..errors import FormatError, OptionError
from ..index import CheckpointIndex, Chunk, ObjectEntry, TensorEntry
from ..jsonsafe import read_text
from ..torchzip import Archive, read_archive
from ..unpickle import BASE_ALLOWED, Stub, TensorRef, Token, enum_int, stub_token
from .base import BaseReader
from .flatparts import Flat, Piece, entry_of, locate
from .torchsave import tensor_entry

_DS = "deepspeed"
_STAGE = f"{_DS}.runtime.zero.config.ZeroStageEnum"
_STUBS = [
    f"{_DS}.utils.tensor_fragment.fragment_address",  # a dataclass: (numel, start) as BUILD state
    f"{_DS}.runtime.fp16.loss_scaler.LossScaler",
    f"{_DS}.runtime.fp16.loss_scaler.DynamicLossScaler",
    f"{_DS}.runtime.zero.config.DeepSpeedZeroConfig",
    f"{_DS}.runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig",
    f"{_DS}.runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig",
    f"{_DS}.runtime.config.DeepSpeedConfig",
]
ALLOWED: dict[str, Any] = {
    **BASE_ALLOWED,
    **{name: stub_token(name) for name in _STUBS},
    _STAGE: Token(_STAGE, enum_int("ZeroStageEnum")),
}

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
_TAG = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
WEIGHTS = ("fp32", "module")


def read_latest(uri: str, name: str = "latest") -> str:
    """The tag named by `uri/<name>` (`latest`, or `latest_universal`: a short text file), or "" when it is not
    one."""
    path = storage.join(uri, name)
    if storage.isdir(path):
        return ""
    try:
        return read_text(path, "a tag folder name")
    except FormatError:
        return ""


def is_deepspeed_folder(uri: str, names: list[str]) -> bool:
    """A DeepSpeed tag folder (optim states files) or the save folder above it (`latest` names a tag folder)."""
    if any(_OPTIM.match(n) for n in names):
        return True
    if "latest" in names:
        tag = read_latest(uri)
        return bool(_TAG.match(tag)) and tag in names
    return False


def _get(obj: Any, key: Any, where: str) -> Any:
    value = obj.get(key) if isinstance(obj, dict | Stub) else None
    if value is None:
        raise FormatError(f"{where}: no {key!r}; not a DeepSpeed ZeRO checkpoint as DeepSpeed 0.x writes it")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, tuple | list) and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    raise FormatError(f"{where}: a parameter shape is {type(value).__name__}, not a torch.Size; the file is damaged")


@dataclass
class _Rank:
    path: str
    archive: Archive
    osd: dict  # optimizer_state_dict: DeepSpeed's own state (partitions, paddings, base optimizer state)


class DeepSpeedReader(BaseReader):
    format = "deepspeed"

    def __init__(self, uri: str, reader: storage.RangeReader, tag: str | None = None,
                 weights: str = "fp32") -> None:
        if weights not in WEIGHTS:
            raise FormatError(f"weights {weights}: choose fp32 (master weights) or module (16-bit weights)",
                              option="weights")
        super().__init__(uri, reader)
        self.tag = tag
        self.weights = weights

    # ------------------------------------------------------------------ folder

    def folder(self) -> str:
        """The tag folder: `uri` itself, `uri/<tag>`, or `uri/<contents of latest>`."""
        names = storage.listdir(self.uri)
        tag = self.tag
        if tag is None and any(_OPTIM.match(n) or _MODEL.match(n) for n in names):
            return self.uri
        if tag is None:
            if "latest" not in names:
                tags = sorted(n for n in names if storage.isdir(storage.join(self.uri, n)))
                raise FormatError(f"{self.uri}: no 'latest' file and no DeepSpeed files here; point at a tag folder "
                                  f"({', '.join(tags[:5]) or 'none found'}) or pass `tag`", uri=self.uri)
            tag = read_latest(self.uri)
        if not _TAG.fullmatch(tag) or tag in (".", ".."):
            raise FormatError(f"{storage.join(self.uri, 'latest')}: does not hold a tag folder name (up to 200 "
                              "letters, digits, '_', '.' or '-'); fix 'latest' or pass `tag`", uri=self.uri)
        folder = storage.join(self.uri, tag)
        if not storage.isdir(folder):
            raise FormatError(f"{folder}: the tag folder is missing; pass `tag` with one that exists", uri=folder)
        return folder

    def _files(self, folder: str) -> tuple[dict[int, str], dict[int, str], str | None]:
        names = storage.listdir(folder)
        optim: dict[int, str] = {}
        model3: dict[int, str] = {}
        for name in names:
            m = _OPTIM.match(name) or _MODEL3.match(name) or _MODEL.match(name)
            if m and m.group("mp") != "00":
                raise FormatError(f"{storage.join(folder, name)}: a tensor-parallel DeepSpeed save (mp_rank_"
                                  f"{m.group('mp')}); only mp_rank_00 (no tensor or pipeline parallelism) is "
                                  "supported: convert it with DeepSpeed's ds_to_universal first")
            if name.startswith("layer_") and name.endswith("model_states.pt"):
                raise FormatError(f"{storage.join(folder, name)}: a pipeline-parallel DeepSpeed save; only plain "
                                  "ZeRO data parallelism is supported")
            if m and _OPTIM.match(name):
                optim[int(m.group("rank"))] = storage.join(folder, name)
            elif m and _MODEL3.match(name):
                model3[int(m.group("rank"))] = storage.join(folder, name)
        model = storage.join(folder, "mp_rank_00_model_states.pt") if "mp_rank_00_model_states.pt" in names else None
        for kind, files in (("optim_states", optim), ("model_states", model3)):
            missing = sorted(set(range(len(files))) - set(files))
            if missing:
                raise FormatError(f"{folder}: zero_pp_rank_{missing[0]}_mp_rank_00_{kind}.pt is missing (found "
                                  f"ranks {sorted(files)}); copy every rank's file", uri=folder)
        return optim, model3, model

    # ------------------------------------------------------------------ index

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return is_deepspeed_folder(uri, names)

    def read(self, locate: bool = True) -> CheckpointIndex:
        folder = self.check_where = self.folder()
        optim_files, model3_files, model_file = self._files(folder)
        index = CheckpointIndex(uri=self.uri, format=self.format)
        try:
            if self.weights == "module":
                self._module_index(index, folder, model3_files, model_file)
            else:
                self._fp32_index(index, folder, optim_files, model3_files, model_file)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise FormatError(f"{folder}: not a DeepSpeed ZeRO checkpoint as DeepSpeed writes it "
                              f"({type(exc).__name__} in its fields); the files are damaged", uri=folder) from None
        return index

    def _archive(self, path: str) -> Archive:
        archive = read_archive(self.reader, path, allowed=ALLOWED)
        if not isinstance(archive.obj, dict):
            raise FormatError(f"{path}: holds a {type(archive.obj).__name__}, not a DeepSpeed state dict", uri=path)
        return archive

    def _module_index(self, index: CheckpointIndex, folder: str, model3: dict[int, str],
                      model_file: str | None) -> None:
        if model_file is None:
            raise FormatError(f"{folder}: a ZeRO-3 save keeps no 16-bit module weights (they are partitioned); "
                              "export the fp32 master weights (leave out `weights` module)", uri=folder)
        archive = self._archive(model_file)
        module = _get(archive.obj, "module", model_file)
        index.files = [storage.basename(model_file)]
        index.producer = f"DeepSpeed {archive.obj.get('ds_version', '?')} module weights"
        for name, ref in module.items():
            if isinstance(ref, TensorRef):
                index.tensors[name] = tensor_entry(name, ref, archive)
                index.tensors[name].path = (name,)

    def _fp32_index(self, index: CheckpointIndex, folder: str, optim_files: dict[int, str],
                    model3_files: dict[int, str], model_file: str | None) -> None:
        if not optim_files:
            raise FormatError(f"{folder}: no zero_pp_rank_*_optim_states.pt files; this is not a ZeRO checkpoint "
                              "(for the 16-bit weights alone pass `weights` module)", uri=folder)
        ranks = [self._rank(optim_files[r]) for r in range(len(optim_files))]
        stage = _get(ranks[0].osd, "zero_stage", ranks[0].path)
        world = ranks[0].osd.get("partition_count")
        world = max(world) if isinstance(world, list) else world
        if world != len(ranks):
            raise FormatError(f"{folder}: the optimizer states say {world} ranks but {len(ranks)} optim_states files "
                              "are here; copy every rank's file (or remove files of an older save)", uri=folder)
        models = [self._archive(model3_files[r]) for r in range(len(model3_files))] if stage == 3 else []
        if stage == 3 and len(models) != world:
            raise FormatError(f"{folder}: ZeRO-3 needs one model_states file per rank ({world}), found {len(models)}",
                              uri=folder)
        if stage != 3 and model_file is None:
            raise FormatError(f"{folder}: mp_rank_00_model_states.pt is missing; copy it from the save", uri=folder)
        model = models[0] if stage == 3 else self._archive(model_file)  # type: ignore[arg-type]  # set: checked above
        state = model.obj
        index.world_size = world
        index.files = sorted(storage.basename(p) for p in [*optim_files.values(), *model3_files.values(),
                                                          *([model_file] if model_file else [])])
        index.producer = f"DeepSpeed {state.get('ds_version', '?')} ZeRO-{stage}"
        # zero_to_fp32's order: buffers, frozen parameters, trainable parameters, tied parameters
        buffer_names = set(state.get("buffer_names") or ())
        for name, ref in _get(state, "module", model.uri).items():
            if name in buffer_names and isinstance(ref, TensorRef):
                index.tensors[name] = tensor_entry(name, ref, model)
                index.tensors[name].path = (name,)
                if ref.dtype in ("bfloat16", "float16"):
                    index.notes.append(f"buffer {name} is stored in {ref.dtype}; DeepSpeed's zero_to_fp32 "
                                       "upcasts it to float32 (same values)")
        self._frozen(index, state, models if stage == 3 else [model], stage)
        groups = self._trainable(index, ranks, state, stage, world)
        for tied, source in (state.get("shared_params") or {}).items():
            if source in index.tensors:
                index.tensors[tied] = TensorEntry(tied, index.tensors[source].dtype, index.tensors[source].shape,
                                                  list(index.tensors[source].chunks), path=(tied,))
        self._param_groups(index, ranks[0], groups, stage)
        left = [n for n in _get(state, "module", model.uri) if n not in index.tensors]
        if left:
            index.notes.append(f"{len(left)} module entries ({', '.join(left[:3])}) have no fp32 master copy in this "
                               "save, so DeepSpeed's zero_to_fp32 leaves them out too; --weights module (--from "
                               "deepspeed-module) reads the 16-bit module weights, which include them")
        # the layout of FSDP2's `dcp.load({"model": ..., "optim": ...})`, so `reshard --only all` resumes;
        # export strips the `model.` container, which leaves the module's own names
        index.tensors = {e.name: e for e in (replace(e, name=f"model.{n}", path=("model", n)) if len(e.path) == 1
                                             else e for n, e in index.tensors.items())}

    def _rank(self, path: str) -> _Rank:
        archive = self._archive(path)
        osd = _get(archive.obj, "optimizer_state_dict", path)
        if not isinstance(osd, dict):
            raise FormatError(f"{path}: optimizer_state_dict is a {type(osd).__name__}, not a dict", uri=path)
        return _Rank(path, archive, osd)

    def _flat(self, archive: Archive, ref: Any, what: str) -> Flat:
        if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or not ref.is_contiguous():
            raise FormatError(f"{archive.uri}: {what} is not a flat 1-D tensor; the file is damaged", uri=archive.uri)
        return Flat(tensor_entry(what, ref, archive).chunks[0].data, ref.dtype)

    def _frozen(self, index: CheckpointIndex, state: dict, models: list[Archive], stage: int) -> None:
        shapes = state.get("frozen_param_shapes") or {}
        for name, shape in shapes.items():
            shape = _shape(shape, f"{models[0].uri} frozen_param_shapes[{name}]")
            refs = [_get(m.obj.get("frozen_param_fragments") or {}, name, f"{m.uri} frozen_param_fragments")
                    for m in models]
            _fresh(index, name, models[0].uri)
            if stage != 3:  # the whole parameter, as stored
                entry = tensor_entry(name, refs[0], models[0])
                index.tensors[name] = TensorEntry(name, entry.dtype, shape, [Chunk(
                    (0,) * len(shape), shape, entry.chunks[0].data)], path=(name,))
                if entry.numel != dtypes.numel(shape):
                    raise FormatError(f"{models[0].uri}: frozen parameter {name} holds {entry.numel} elements, its "
                                      f"shape {list(shape)} needs {dtypes.numel(shape)}; the file is damaged")
                continue
            flats = [self._flat(m, r, f"frozen_param_fragments[{name}]") for m, r in zip(models, refs)]
            index.tensors[name] = entry_of(name, shape, locate(flats, 0, dtypes.numel(shape)), (name,))

    def _trainable(self, index: CheckpointIndex, ranks: list[_Rank], state: dict, stage: int,
                   world: int) -> list[list[str]]:
        """Add every trainable parameter and its Adam state; return the names in each flat group."""
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
        flats = [[self._flat(r.archive, t, f"{key}[{g}]") for g, t in enumerate(_get(r.osd, key, r.path))]
                 for r in ranks]
        opt_states = [_get(r.osd, base_key, r.path).get("state") or {} for r in ranks]
        kinds = sorted({k for s in opt_states[0].values() for k, v in s.items()
                        if isinstance(v, TensorRef) and len(v.shape) == 1})
        state_flats = {kind: [[self._flat(r.archive, _get(_get(s, g, r.path), kind, r.path), f"{kind}[{g}]")
                               for g in range(len(flats[0]))] for r, s in zip(ranks, opt_states)] for kind in kinds}
        steps = {g: s.get("step") for g, s in opt_states[0].items()}
        shapes = _get(state, "param_shapes", "model states")
        if isinstance(shapes, dict):
            shapes = [shapes]
        paddings = ranks[0].osd.get("param_alignment_paddings")
        groups: list[list[str]] = []
        if stage == 3:
            rank_offset = 0
            sizes = [f.numel for f in flats[0]]
            by_group: dict[int, list[str]] = {}
            for group_shapes in shapes:
                for name, shape in group_shapes.items():
                    shape = _shape(shape, f"param_shapes[{name}]")
                    numel = dtypes.numel(shape)
                    part = -(-numel // world)
                    g = _group_at(sizes, rank_offset)

                    def pieces(per_rank: list[list[Flat]], start: int = rank_offset, n: int = part) -> list[Piece]:
                        return [p for rank_flats in per_rank for p in locate(rank_flats, start, n)]

                    self._add(index, name, shape, pieces, flats, state_flats, steps.get(g), ranks[0])
                    rank_offset += part
                    by_group.setdefault(g, []).append(name)
            if rank_offset != sum(sizes):
                raise FormatError(f"{ranks[0].path}: the parameters take {rank_offset} of {sum(sizes)} elements of "
                                  "each partition; the checkpoint does not match its param_shapes")
            return [by_group.get(g, []) for g in range(len(sizes))]
        for g, group_shapes in enumerate(shapes):
            offset, names = 0, []
            group_flats = [[r[g] for r in flats]]
            pads = paddings[g] if paddings is not None else [0] * len(group_shapes)
            for (name, shape), pad in zip(group_shapes.items(), pads):
                shape = _shape(shape, f"param_shapes[{name}]")
                numel = dtypes.numel(shape)

                def group_pieces(per_group: list[list[Flat]], start: int = offset, n: int = numel,
                                 grp: int = g) -> list[Piece]:
                    return locate([r[grp] for r in per_group], start, n)

                self._add(index, name, shape, group_pieces, flats, state_flats, steps.get(g), ranks[0])
                offset += numel + pad
                names.append(name)
            align = 2 * world
            avail = sum(f.numel for f in group_flats[0])
            if -(-offset // align) * align != -(-avail // align) * align:
                raise FormatError(f"{ranks[0].path}: group {g} parameters take {offset} of {avail} elements; the "
                                  "checkpoint does not match its param_shapes")
            groups.append(names)
        return groups

    def _add(self, index: CheckpointIndex, name: str, shape: tuple[int, ...], pieces: Any,
             flats: list[list[Flat]], state_flats: dict[str, list[list[Flat]]], step: Any, rank0: _Rank) -> None:
        _fresh(index, name, rank0.path)
        index.tensors[name] = entry_of(name, shape, pieces(flats), (name,))
        for kind, per_rank in state_flats.items():
            path = ("optim", "state", name, kind)
            index.tensors[".".join(path)] = entry_of(".".join(path), shape, pieces(per_rank), path)
        if isinstance(step, TensorRef):
            path = ("optim", "state", name, "step")
            entry = tensor_entry(".".join(path), step, rank0.archive)
            entry.path = path
            index.tensors[entry.name] = entry
        elif step is not None:
            path = ("optim", "state", name, "step")
            index.objects[".".join(path)] = ObjectEntry(".".join(path), value=step, path=path)

    def _param_groups(self, index: CheckpointIndex, rank0: _Rank, groups: list[list[str]], stage: int) -> None:
        base = rank0.osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
        for i, group in enumerate(base.get("param_groups") or []):
            ids = group.get("params") or []
            params = [n for g in ids if isinstance(g, int) and 0 <= g < len(groups) for n in groups[g]]
            for key, value in [*((k, v) for k, v in group.items() if k != "params"), ("params", params)]:
                path = ("optim", "param_groups", str(i), key)
                index.objects[".".join(path)] = ObjectEntry(".".join(path), value=value, path=path)


def _fresh(index: CheckpointIndex, name: str, where: str) -> None:
    """Refuse a parameter named twice (param_shapes groups, frozen_param_shapes, buffers): one would hide the other."""
    if name in index.tensors:
        raise FormatError(f"{where}: parameter {name!r} is listed twice (in param_shapes, frozen_param_shapes or "
                          "the module's buffers); the checkpoint is damaged", uri=where, key=name)


def _group_at(sizes: list[int], offset: int) -> int:
    """Index of the flat group (of `sizes` elements each, concatenated) that holds element `offset`."""
    base = 0
    for g, size in enumerate(sizes):
        if offset < base + size:
            return g
        base += size
    return max(0, len(sizes) - 1)





class DeepSpeedModuleReader(DeepSpeedReader):
    """`--from deepspeed-module` (`--weights module`): the 16-bit module weights of the model states file."""

    def __init__(self, uri: str, reader: storage.RangeReader, tag: str | None = None) -> None:
        super().__init__(uri, reader, tag, weights="module")


def source_for(source: str, fmt: str | None, tag: str | None, weights: str | None) -> tuple[str, str | None]:
    """Apply the CLI's `--tag` and `--weights` to a source: (the tag folder, the format to read it as)."""
    if tag is not None:
        if not _TAG.match(tag) or tag in (".", ".."):
            raise OptionError(f"tag {tag}: a tag is a folder name such as global_step100", option="tag")
        root, source = source.rstrip("/"), storage.join(source.rstrip("/"), tag)
        if not storage.isdir(source):
            tags = sorted(n for n in storage.listdir(root) if storage.isdir(storage.join(root, n))) \
                if storage.isdir(root) else []
            raise OptionError(f"tag {tag}: no folder {source}; tags there: {', '.join(tags[:8]) or 'none'}",
                              option="tag")
    if weights is None or weights == "fp32":
        return source, fmt
    if weights != "module":
        raise OptionError(f"weights {weights}: choose fp32 (the master weights) or module (the 16-bit weights)",
                          option="weights")
    if fmt not in (None, "deepspeed", "deepspeed-module"):
        raise OptionError(f"weights module reads DeepSpeed checkpoints, not `source_format` {fmt}", option="weights")
    return source, "deepspeed-module"
