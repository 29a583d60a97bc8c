"""What `inspect` reports about a checkpoint, as a plain dict (the CLI prints it, the API returns it)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from converters import CheckpointIndex, CkptError, adapter_info, index_kinds, manifest_sidecar, storage
from converters import dtypes as dt


def rank_bytes(index: CheckpointIndex) -> dict[str, int]:
    """Bytes of tensor data per data file (per rank for DCP)."""
    per: Counter[str] = Counter()
    for entry in index.tensors.values():
        for chunk in entry.chunks:
            per[chunk.data.uri.rsplit("/", 1)[-1]] += chunk.numel * dt.itemsize(entry.dtype)
    return dict(sorted(per.items()))


MANIFEST = "ckpt-manifest.json"  # the manifest our folder outputs carry (converters' names.MANIFEST)
MAX_SIZED_FILES = 1000  # one stat (a HEAD on object storage) per file: bounded


def file_bytes(index: CheckpointIndex) -> dict[str, int | None]:
    """Bytes on disk of every file of the checkpoint (None where it cannot be read), the first 1000 files."""
    base = index.uri if storage.isdir(index.uri) else storage.parent(index.uri)
    sizes: dict[str, int | None] = {}
    for name in index.files[:MAX_SIZED_FILES]:
        try:
            sizes[name] = storage.size(storage.join(base, name))
        except CkptError:
            sizes[name] = None
    return sizes


def certificate_cover(index: CheckpointIndex) -> dict[str, Any] | None:
    """What the certificate in an output's manifest covers (tensors, output files with a CRC-32, source files
    read, statistics or not); None for a checkpoint without one. The manifest's own JSON, nothing imported: a
    folder's own, or the one beside a single-file output (`<file>.ckpt-manifest.json`)."""
    import json

    try:
        where = storage.join(index.uri, MANIFEST) if storage.isdir(index.uri) else manifest_sidecar(index.uri)
        if not storage.exists(where):
            return None
        doc = json.loads(storage.read_all(where))  # capped at the metadata limit
    except (CkptError, ValueError, RecursionError):
        return None
    cert = doc.get("certificate") if isinstance(doc, dict) else None
    if not isinstance(cert, dict) or not isinstance(cert.get("tensors"), dict):
        return None
    files = doc.get("files") if isinstance(doc.get("files"), dict) else {}
    sources = {str(r[0]) for pieces in cert["tensors"].values() if isinstance(pieces, list) for p in pieces
               if isinstance(p, dict) for r in p.get("ranges") or [] if isinstance(r, list) and r}
    return {"tensors": len(cert["tensors"]), "files": sum(isinstance(f, dict) and "crc32" in f for f in files.values()),
            "source_files": len(sources), "stats": isinstance(cert.get("stats"), dict)}


def summarize(index: CheckpointIndex, tensors: bool = False) -> dict[str, Any]:
    dtypes = Counter(t.dtype for t in index.tensors.values())
    kinds = index_kinds(index)
    out: dict[str, Any] = {
        "uri": index.uri,
        "format": index.format,
        "producer": index.producer,
        "world_size": index.world_size,
        "tensors": len(index.tensors),
        "objects": len(index.objects),
        "total_bytes": index.total_bytes,
        "dtypes": dict(dtypes.most_common()),
        "has_optimizer": any(p.optimizer for p in kinds.values()),
        "files": len(index.files),
        "file_bytes": file_bytes(index),
    }
    per = rank_bytes(index)
    if len(per) > 1:
        sizes = list(per.values())
        out["bytes_per_file"] = per
        out["balance"] = round(min(sizes) / max(sizes), 4) if max(sizes) else 1.0
    if index.objects:
        out["non_tensor_entries"] = sorted(index.objects)
    unclassified = sorted(name for name, p in kinds.items() if p.kind == "unknown")
    if unclassified:  # named like an optimizer, without its structure: never exported as model weights
        out["unclassified"] = unclassified
    adapter = adapter_info(index)
    if adapter is not None:
        out["adapter"] = adapter
    if index.notes:
        out["notes"] = list(index.notes)
    certificate = certificate_cover(index)
    if certificate is not None:
        out["certificate"] = certificate
    if tensors:
        out["tensor_table"] = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "chunks": len(t.chunks)}
            for t in index.tensors.values()]
    return out
