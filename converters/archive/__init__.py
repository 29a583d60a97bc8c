"""The archive tier: checkpoints kept as content-addressed, deduplicated, losslessly compressed chunks on any
fsspec location, restored byte for byte.

- `archive(source, store)`: cuts each file at its tensors' byte ranges (`chunking`), stores each distinct chunk
  once (`chunks/<h[:2]>/<h>`, h its BLAKE3 hash (`hashing`), compressed by `codec` where that pays), writes
  `manifests/<id>.json`;
- `restore(store, id, target)`: the files back, every chunk's hash checked (a damaged chunk: one line naming
  it and the archives that use it), a local target's files written in place through direct I/O (`direct`);
- `gc(store)`: deletes chunks no manifest references, safe under concurrent archives (`collect`);
- `list_archives(store)`."""

from .archiving import ArchiveResult, archive
from .collect import GcResult, gc
from .restoring import list_archives, restore

__all__ = ["ArchiveResult", "GcResult", "archive", "gc", "list_archives", "restore"]
