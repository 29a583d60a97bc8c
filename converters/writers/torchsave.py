"""Write one `torch.save` file of the full state dict, streamed storage by storage (no torch import)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .. import dtypes, picklewriter
from ..copier import Copier
from ..index import CheckpointIndex, ObjectEntry, TensorEntry
from ..output import Output
from ..plan import Plan
from ..zipwriter import ZipWriter, serial_id
from .objects import writable_object


def nest(pairs: list[tuple[tuple[str, ...], Any]]) -> dict:
    """Rebuild nested dicts from key paths; dicts whose keys are 0..n-1 from a list become lists."""
    root: dict = {}
    for path, value in pairs:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any, key: str = "") -> Any:
    """`param_groups` become lists again; integer parameter ids under `state` become ints again."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v, k) for k, v in node.items()}
    if key == "param_groups" and all(k.isdigit() for k in node):
        return [node[k] for k in sorted(node, key=int)]
    if key == "state" and node and all(k.isdigit() for k in node):
        return {int(k): v for k, v in node.items()}
    return node


@dataclass
class TorchPart:
    """The one `torch.save` file: its pickle (entries nested by their paths) and one record per tensor."""

    tensors: list[TensorEntry]
    objects: list[ObjectEntry]
    cast_to: str | None
    name: str = ""
    serial: str = field(default_factory=serial_id)  # the archive's id, chosen by the plan

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors)

    def run(self, out: Output, copier: Copier, pool: ThreadPoolExecutor | None = None) -> None:
        pairs: list[tuple[tuple[str, ...], Any]] = []
        storages = []
        for i, entry in enumerate(self.tensors):
            dtype = copier.out_dtype(entry, self.cast_to)
            pairs.append((entry.path, picklewriter.tensor(str(i), dtype, entry.shape)))
            storages.append((str(i), entry, dtype))
        for obj in self.objects:
            pairs.append((obj.path, writable_object(obj, copier.reader)))
        root = nest(pairs)
        with out.open(self.name) as fh:
            note = partial(copier.note, fh.fileno()) if out.local else None
            zw = ZipWriter(fh, archive="archive", start=0, note=note)
            zw.add("data.pkl", picklewriter.dumps(root))
            sizes = [dtypes.numel(entry.shape) * dtypes.itemsize(dtype) for _, entry, dtype in storages]
            if out.local and pool is not None:
                # a local file: lay every record out first, then fill them side by side (as safetensors does)
                slots = [zw.reserve(f"data/{key}", size) for (key, _, _), size in zip(storages, sizes)]
                fh.flush()
                crcs = copier.write_many(fh.fileno(), [(slot.data_at, entry, self.cast_to)
                                                       for slot, (_, entry, _) in zip(slots, storages)],
                                         pool, checksum=True)
                for slot, crc in zip(slots, crcs):
                    zw.settle(slot, crc)
            else:  # a stream (object storage): records in order, a remote source read ahead
                with copier.in_order([(entry, self.cast_to, None) for _, entry, _ in storages]) as streams:
                    for (key, _, _), stream, size in zip(storages, streams, sizes):
                        zw.write_member(f"data/{key}", stream, size, copier.copy_range)
            zw.add_torch_records(self.serial)
            zw.close()


def plan_torch(index: CheckpointIndex, *, cast_to: str | None) -> Plan:
    """Nest entries by their paths: a flat {fqn: tensor} dict for a model, `model`/`optim` dicts for both.
    One file, so one part (a zip archive is written front to back)."""
    return Plan("torch", [TorchPart(list(index.tensors.values()), list(index.objects.values()), cast_to)])
