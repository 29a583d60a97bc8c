"""The checkpoint model every reader produces and every writer consumes: names, shapes, byte locations.

A `CheckpointIndex` holds no tensor data. Each tensor is a global shape and dtype plus the
chunks that tile it; each chunk says where its bytes live (`ByteRange`, optionally strided).
Non-tensor values (optimizer hyper-parameters, step counters) are `ObjectEntry`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Any

from . import dtypes
from .errors import FormatError, short

OPTIM_CONTAINERS = ("optim", "optimizer", "optimizer_state_dict", "optim_state_dict")
OPTIM_SECTIONS = ("state", "param_groups")
MODEL_CONTAINERS = ("model", "module", "state_dict", "model_state_dict")


@dataclass(frozen=True)
class ByteRange:
    """Raw tensor bytes: `length` bytes of `uri` from `offset`.

    With `stride` set, the bytes are a strided view (element strides, starting at `offset`),
    as torch.save keeps non-contiguous tensors; otherwise they are row-major contiguous.

    With `record` set, the range is a whole DCP record (a torch.save archive of one tensor) and the tensor's
    own bytes inside it are found when it is first read (`tensorio.located`): from object storage, the
    record's header then comes in the same request as its data. `record` is (offset, length, count) of the
    group of records read together that it belongs to (`tensorio.group_records`; alone: its own range, 1).
    """

    uri: str
    offset: int
    length: int
    stride: tuple[int, ...] | None = None
    record: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Chunk:
    """A box of the global tensor (`offsets`, `sizes`) and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: ByteRange

    @property
    def numel(self) -> int:
        return dtypes.numel(self.sizes)


@dataclass
class TensorEntry:
    """A tensor: `name` is the flat dotted key; `path` the nested keys it came from (see `split_path`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]
    path: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.path:
            self.path = split_path(self.name)

    @property
    def numel(self) -> int:
        return dtypes.numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)


@dataclass
class ObjectEntry:
    """A non-tensor value: either inline, or a torch.save blob at `data` (read with weights_only)."""

    name: str
    value: Any = None
    data: ByteRange | None = None
    path: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.path:
            self.path = split_path(self.name)


@dataclass
class CheckpointIndex:
    uri: str
    format: str
    producer: str | None = None
    world_size: int | None = None
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # layer-stacked tensors (Megatron): name -> the prefix the layer number goes after when unstacked
    stacked: dict[str, str] = field(default_factory=dict)
    # entries that are a framework's training state beside the model (Lightning meta.pt, Megatron common.pt)
    training_state: set[str] = field(default_factory=set)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def names(self) -> list[str]:
        return list(self.tensors) + list(self.objects)

    def has_optimizer(self) -> bool:
        from .classify import index_kinds

        return any(p.optimizer for p in index_kinds(self).values())


#: the most corner updates the overlap check may make (chunks x 2 ** split dimensions)
MAX_CORNERS = 1 << 22


def check_tiling(entry: TensorEntry, where: str) -> None:
    """Raise unless the chunks of `entry` cover its shape exactly once: each inside the shape, their sizes adding
    up to it, and no two overlapping (then no part is left uncovered either)."""
    total = 0
    for chunk in entry.chunks:
        if len(chunk.offsets) != len(entry.shape) or len(chunk.sizes) != len(entry.shape) or any(
                o < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.shape)):
            raise FormatError(f"{where}: chunk {chunk.offsets}+{chunk.sizes} of {entry.name!r} lies outside "
                              f"its shape {entry.shape}; the metadata is damaged", uri=where, key=entry.name)
        total += chunk.numel
    if total != entry.numel:
        raise FormatError(f"{where}: the chunks of {entry.name!r} cover {total} of {entry.numel} elements; "
                          "the checkpoint is missing ranks or is damaged", uri=where, key=entry.name)
    if len(entry.chunks) < 2 or not entry.numel:
        return
    dims = _split_dims(entry)
    if len(entry.chunks) << len(dims) > MAX_CORNERS:
        raise FormatError(f"{where}: {len(entry.chunks)} chunks of {entry.name!r} split {len(dims)} dimensions, too "
                          "many to check that they do not overlap; the metadata is damaged or hostile",
                          uri=where, key=entry.name)
    boxes = [(c.offsets, c.sizes) for c in entry.chunks if 0 not in c.sizes]
    if _signed_corners(boxes, dims) != _signed_corners([((0,) * len(entry.shape), entry.shape)], dims):
        raise FormatError(f"{where}: the chunks of {entry.name!r} overlap (some elements are stored twice, others "
                          "not at all); the metadata is damaged", uri=where, key=entry.name)


def _split_dims(entry: TensorEntry) -> list[int]:
    """The dimensions along which some chunk does not span the whole tensor."""
    return [d for d, size in enumerate(entry.shape)
            if any(c.offsets[d] or c.sizes[d] != size for c in entry.chunks)]


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _signed_corners(boxes: list[Box], dims: list[int]) -> dict[tuple[int, ...], int]:
    """The sum of the boxes' signed corners over `dims` (+1 or -1 at each corner, by the parity of the far ends
    it takes), zeros left out. The number of boxes that cover an element is the sum of the signed corners at or
    below it, so boxes tile a tensor exactly once if and only if their sum is the tensor's own corners: an exact
    check in O(boxes x 2 ** dims), whatever the number of dimensions."""
    signs = [(-1) ** sum(picks) for picks in product((0, 1), repeat=len(dims))]
    total: dict[tuple[int, ...], int] = {}
    for offsets, sizes in boxes:
        for corner, sign in zip(product(*[(offsets[d], offsets[d] + sizes[d]) for d in dims]), signs):
            total[corner] = total.get(corner, 0) + sign
    return {corner: sign for corner, sign in total.items() if sign}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(value: Any, where: str, what: str) -> int:
    """A non-negative integer read from a file (offset, length), or a FormatError naming `where` and `what`."""
    if not _is_int(value) or value < 0:
        raise FormatError(f"{where}: {what} is {short(value)}, expected a non-negative integer; the file is damaged")
    return value


def counts(value: Any, where: str, what: str) -> tuple[int, ...]:
    """A shape or offsets: a list/tuple of non-negative integers, or a FormatError naming `where` and `what`."""
    if not isinstance(value, tuple | list) or len(value) > 64 or not all(_is_int(v) and v >= 0 for v in value):
        raise FormatError(f"{where}: {what} is {short(value)}, expected a list of non-negative integers; the file "
                          "is damaged")
    return tuple(value)


def split_path(name: str) -> tuple[str, ...]:
    """Best guess of the nested keys behind a flat dotted name, used when the format does not record them.

    Optimizer entries keep the parameter FQN as one component:
    `optim.state.layers.0.w.exp_avg` -> (`optim`, `state`, `layers.0.w`, `exp_avg`);
    `optim.param_groups.0.lr` -> (`optim`, `param_groups`, `0`, `lr`). Model entries under a
    container split once (`model.layers.0.w` -> (`model`, `layers.0.w`)); others stay whole.
    """
    parts = name.split(".")
    container: tuple[str, ...] = ()
    if parts[0] in OPTIM_CONTAINERS and len(parts) > 1:
        container, parts = (parts[0],), parts[1:]
    if parts[0] == "state" and len(parts) >= 3:
        return (*container, "state", ".".join(parts[1:-1]), parts[-1])
    if parts[0] == "param_groups" and len(parts) >= 3:
        return (*container, "param_groups", parts[1], ".".join(parts[2:]))
    if container:
        return (*container, ".".join(parts))
    if parts[0] in MODEL_CONTAINERS and len(parts) > 1:
        return (parts[0], ".".join(parts[1:]))
    return (name,)
