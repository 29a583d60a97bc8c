"""Reader for DeepSpeed universal checkpoints (what `deepspeed.checkpoint.ds_to_universal` writes).

A universal tag folder holds the model states file(s) copied from the ZeRO save (`mp_rank_00_model_states.pt` for
ZeRO-1/2, `zero_pp_rank_R_mp_rank_00_model_states.pt` for ZeRO-3) and `zero/`: one folder per trainable parameter,
`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` (ZeRO-1/2 also `step.pt`), plus `zero/optimizer_state.pt`
(the param_groups, and for ZeRO-3 the per-group `step`). The root beside the tag folders names the latest one in
`latest_universal`. ZeRO-1/2 write each state as `{"param": tensor, "cat_dim": 0}`, ZeRO-3 as a bare tensor, flat
(1-D) for ZeRO-3: the shape comes from the model states' `param_shapes`. Every tensor is a byte range of its file;
nothing of DeepSpeed is imported. The names are the ZeRO reader's: `model.<param>`, `optim.state.<param>.<kind>`,
`optim.param_groups.<i>.<key>`, so `export` gives the fp32 masters and `reshard --only all` carries the Adam state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .. import dtypes, storage
from ..errors import FormatError
from ..index import CheckpointIndex, Chunk, ObjectEntry, TensorEntry
from ..torchzip import Archive
from ..unpickle import Stub, TensorRef
from .deepspeed import _MODEL, _MODEL3, _TAG, DeepSpeedReader, _fresh, _get, _shape, read_latest
from .torchsave import tensor_entry

ZERO = "zero"
LATEST = "latest_universal"
OPTIMIZER_STATE = "optimizer_state.pt"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def is_universal_tag(uri: str, names: list[str]) -> bool:
    """A universal tag folder: `zero/` beside the model states file(s) a ZeRO save keeps."""
    return ZERO in names and any(_MODEL.match(n) or _MODEL3.match(n) for n in names) \
        and storage.isdir(storage.join(uri, ZERO))


def latest_universal(uri: str) -> str:
    """The tag `uri/latest_universal` names, or "" when it is not a short text file."""
    return read_latest(uri, LATEST)


class DeepSpeedUniversalReader(DeepSpeedReader):
    format = "deepspeed-universal"
    specificity = 2  # over the ZeRO layout and the torch file its folder also holds

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        if is_universal_tag(uri, names):
            return True
        # beside `latest` (the ZeRO save, which may be newer) DeepSpeed's default load reads the ZeRO save, and so
        # does detection; --from deepspeed-universal, or the tag folder itself, reads the universal one
        tag = latest_universal(uri) if LATEST in names and "latest" not in names else ""
        return bool(_TAG.fullmatch(tag)) and tag in names

    def folder(self) -> str:
        names = storage.listdir(self.uri)
        if self.tag is None and ZERO in names and storage.isdir(storage.join(self.uri, ZERO)):
            return self.uri  # a tag folder (its model states file is checked when read)
        tag = self.tag
        if tag is None:
            if LATEST not in names:
                raise FormatError(f"{self.uri}: no '{LATEST}' file and no '{ZERO}/' folder here; point at a "
                                  "universal tag folder (what ds_to_universal wrote) or pass `tag`", uri=self.uri)
            tag = latest_universal(self.uri)
        if not _TAG.fullmatch(tag) or tag in (".", ".."):
            raise FormatError(f"{storage.join(self.uri, LATEST)}: does not hold a tag folder name (up to 200 "
                              f"letters, digits, '_', '.' or '-'); fix '{LATEST}' or pass `tag`", uri=self.uri)
        folder = storage.join(self.uri, tag)
        if not storage.isdir(folder) or not is_universal_tag(folder, storage.listdir(folder)):
            raise FormatError(f"{folder}: not a universal tag folder (no '{ZERO}/' beside the model states file); "
                              "run DeepSpeed's ds_to_universal again or pass `tag`", uri=folder)
        return folder

    def read(self, locate: bool = True) -> CheckpointIndex:
        folder = self.check_where = self.folder()
        index = CheckpointIndex(uri=self.uri, format=self.format)
        try:
            self._universal_index(index, folder)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise FormatError(f"{folder}: not a DeepSpeed universal checkpoint as ds_to_universal writes it "
                              f"({type(exc).__name__} in its fields); the files are damaged", uri=folder) from None
        return index

    def _model_files(self, folder: str) -> tuple[list[str], int]:
        names = storage.listdir(folder)
        model3 = {int(m.group("rank")): storage.join(folder, n) for n in names if (m := _MODEL3.match(n))}
        for name in names:
            m = _MODEL.match(name) or _MODEL3.match(name)
            if m and m.group("mp") != "00":
                raise FormatError(f"{storage.join(folder, name)}: a tensor-parallel universal checkpoint (mp_rank_"
                                  f"{m.group('mp')}); only mp_rank_00 is supported", uri=folder)
        if model3:
            missing = sorted(set(range(len(model3))) - set(model3))
            if missing:
                raise FormatError(f"{folder}: zero_pp_rank_{missing[0]}_mp_rank_00_model_states.pt is missing "
                                  f"(found ranks {sorted(model3)}); copy every rank's file", uri=folder)
            return [model3[r] for r in range(len(model3))], 3
        return [storage.join(folder, "mp_rank_00_model_states.pt")], 2

    def _universal_index(self, index: CheckpointIndex, folder: str) -> None:
        model_files, stage = self._model_files(folder)
        if not storage.exists(model_files[0]):
            raise FormatError(f"{model_files[0]}: missing; copy it from the universal checkpoint", uri=model_files[0])
        models = [self._archive(p) for p in model_files]
        state = models[0].obj
        world = state.get("dp_world_size")
        if stage == 3 and type(world) is int and world != len(models):
            raise FormatError(f"{folder}: the model states say {world} ranks but {len(models)} "
                              "zero_pp_rank_*_mp_rank_00_model_states.pt files are here; copy every rank's file",
                              uri=folder)
        zero = storage.join(folder, ZERO)
        optim_path = storage.join(zero, OPTIMIZER_STATE)
        if not storage.exists(optim_path):
            raise FormatError(f"{optim_path}: missing; copy it from what ds_to_universal wrote", uri=optim_path)
        optim = self._archive(optim_path)
        index.files = [*sorted(storage.basename(p) for p in model_files), f"{ZERO}/{OPTIMIZER_STATE}"]
        index.producer = f"DeepSpeed {state.get('ds_version', '?')} universal (from ZeRO-{stage})"
        buffer_names = set(state.get("buffer_names") or ())
        for name, ref in _get(state, "module", models[0].uri).items():
            if name in buffer_names and isinstance(ref, TensorRef):
                index.tensors[name] = tensor_entry(name, ref, models[0])
                index.tensors[name].path = (name,)
        self._frozen(index, state, models, stage)
        shapes = _get(state, "param_shapes", models[0].uri)
        groups = [shapes] if isinstance(shapes, dict) else list(shapes)
        base = optim.obj.get("optimizer_state_dict") if stage == 3 else optim.obj.get("base_optimizer_state")
        group_state = (base or {}).get("state") or {} if isinstance(base, dict) else {}
        names_by_group: list[list[str]] = []
        for g, group in enumerate(groups):
            names_by_group.append([])
            for name, shape in group.items():
                shape = _shape(shape, f"{models[0].uri} param_shapes[{name}]")
                self._param(index, zero, name, shape, _get(group_state, g, optim_path).get("step")
                            if stage == 3 else None, optim)
                names_by_group[-1].append(name)
        for tied, source in (state.get("shared_params") or {}).items():
            if source in index.tensors:
                index.tensors[tied] = TensorEntry(tied, index.tensors[source].dtype, index.tensors[source].shape,
                                                  list(index.tensors[source].chunks), path=(tied,))
        for i, group in enumerate(_get(optim.obj, "param_groups", optim_path)):
            ids = group.get("params") or []
            params = [n for g in ids if isinstance(g, int) and 0 <= g < len(names_by_group) for n in names_by_group[g]]
            for key, value in [*((k, v) for k, v in group.items() if k != "params"), ("params", params)]:
                path = ("optim", "param_groups", str(i), key)
                index.objects[".".join(path)] = ObjectEntry(".".join(path), value=value, path=path)
        # the layout of FSDP2's `dcp.load({"model": ..., "optim": ...})`, as the ZeRO reader names it
        index.tensors = {e.name: e for e in (replace(e, name=f"model.{n}", path=("model", n)) if len(e.path) == 1
                                             else e for n, e in index.tensors.items())}

    def _param(self, index: CheckpointIndex, zero: str, name: str, shape: tuple[int, ...], step: Any,
               optim: Archive) -> None:
        if "/" in name or name in (".", "..", "") or name.startswith("."):
            raise FormatError(f"{zero}: parameter name {name!r} is not a folder name; the model states are damaged",
                              uri=zero, key=name)
        _fresh(index, name, zero)
        where = storage.join(zero, name)
        for kind in STATES:
            path = storage.join(where, f"{kind}.pt")
            if not storage.exists(path):
                raise FormatError(f"{path}: missing; every trainable parameter has {', '.join(STATES)} in the "
                                  "universal checkpoint, run ds_to_universal again", uri=path)
            archive, ref = self._state_tensor(path)
            numel = dtypes.numel(shape)
            if dtypes.numel(ref.shape) != numel or not ref.is_contiguous():
                raise FormatError(f"{path}: holds {list(ref.shape)}, but parameter {name} is {list(shape)} "
                                  "(param_shapes); the universal checkpoint does not match its model states",
                                  uri=path, key=name)
            data = tensor_entry(kind, ref, archive).chunks[0].data
            key = name if kind == "fp32" else f"optim.state.{name}.{kind}"
            entry_path = (name,) if kind == "fp32" else ("optim", "state", name, kind)
            index.tensors[key] = TensorEntry(key, ref.dtype, shape, [Chunk((0,) * len(shape), shape, data)],
                                             path=entry_path)
        step_path = storage.join(where, "step.pt")
        owner = optim
        if step is None and storage.exists(step_path):
            owner = self._archive_any(step_path)
            step = owner.obj.get("param") if isinstance(owner.obj, dict) else owner.obj
        step_key = ("optim", "state", name, "step")
        if isinstance(step, TensorRef):
            entry = tensor_entry(".".join(step_key), step, owner)
            entry.path = step_key
            index.tensors[entry.name] = entry
        elif isinstance(step, int | float) and not isinstance(step, bool):
            index.objects[".".join(step_key)] = ObjectEntry(".".join(step_key), value=step, path=step_key)

    def _archive_any(self, path: str) -> Archive:
        from ..torchzip import read_archive
        from .deepspeed import ALLOWED

        return read_archive(self.reader, path, allowed=ALLOWED)

    def _state_tensor(self, path: str) -> tuple[Archive, TensorRef]:
        archive = self._archive_any(path)
        obj = archive.obj
        ref = obj.get("param") if isinstance(obj, dict | Stub) else obj
        if not isinstance(ref, TensorRef):
            raise FormatError(f"{path}: holds a {type(obj).__name__}, not a tensor (or {{'param': tensor}}); the "
                              "file is damaged, run ds_to_universal again", uri=path)
        return archive, ref
