"""Locate the pieces of a `torch.save` zip archive by reading its headers, never its tensor data.

A torch.save file (and every DCP tensor record) is an uncompressed zip: `<archive>/data.pkl`
describes the objects, `<archive>/data/<key>` holds each storage's raw bytes. `read_archive`
returns where each storage's bytes start, and the unpickled `data.pkl` with `TensorRef`
stand-ins in place of tensors.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from . import dtypes, unpickle
from .confinement import max_metadata_bytes
from .errors import FormatError
from .index import ByteRange, count, counts, short
from .rangeread import RangeReader

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature .. extra length (30 bytes)
_LOCAL_SIG = 0x04034B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_CENTRAL_SIG = 0x02014B50
_EOCD_SIG = b"PK\x05\x06"
_EOCD64_LOC_SIG = b"PK\x06\x07"
HEAD_READ = 4096  # bytes read from an archive's start to find its first members
TAIL_READ = 65536 + 22  # bytes read from an archive's end to find its zip directory (a comment fits in it)
SHORT_TAIL = 4096  # ... read first: a zip without a comment ends in its directory's end records


@dataclass(frozen=True)
class Member:
    name: str
    data_offset: int  # absolute offset of the member's bytes in the file
    size: int


@dataclass
class Archive:
    """A parsed torch.save archive: its members and the object tree of data.pkl."""

    uri: str
    members: dict[str, Member]
    obj: Any
    storages: dict[str, Member] = field(init=False)

    def __post_init__(self) -> None:
        # storage key -> the first member named `data/<key>` or `.../data/<key>`: one look-up per tensor
        self.storages = {}
        for name, member in self.members.items():
            folder, _, key = name.rpartition("/")
            if folder == "data" or folder.endswith("/data"):
                self.storages.setdefault(key, member)

    def storage(self, key: str) -> Member:
        if key in self.storages:
            return self.storages[key]
        raise FormatError(f"{self.uri}: storage data/{key} is missing from the archive; the file is damaged",
                          uri=self.uri)


class _Reads:
    """The reads of one archive, served from the bytes already read of it (its head, its tail) when they hold
    them: a record's directory, local headers and descriptors lie in those, and each read of the reader costs
    its checks and look-ups (a DCP record from object storage: about 25 reads)."""

    def __init__(self, reader: RangeReader, uri: str) -> None:
        self.reader = reader
        self.uri = uri
        self.held: list[tuple[int, bytes]] = []

    def read(self, offset: int, length: int) -> bytes:
        for start, data in self.held:
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start: offset - start + length]
        return self.reader.read(self.uri, offset, length)

    def keep(self, offset: int, length: int) -> bytes:
        """Read `length` bytes at `offset` and keep them for the reads after."""
        data = self.read(offset, length)
        self.held.append((offset, data))
        return data


def _zip64_sizes(extra: bytes, comp: int, uncomp: int, offset: int | None = None) -> tuple[int, int, int | None]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            body = extra[pos + 4: pos + 4 + length]
            values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            if uncomp == 0xFFFFFFFF and values:
                uncomp = values.pop(0)
            if comp == 0xFFFFFFFF and values:
                comp = values.pop(0)
            if offset is not None and offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
            break
        pos += 4 + length
    return comp, uncomp, offset


def _walk_local_headers(head: bytes, base: int, limit: int) -> tuple[list[Member], bool]:
    """Walk local headers from the start of an archive; stop at the first storage member.

    Returns (members, complete): complete is False when the walk could not finish from `head`.
    """
    members: list[Member] = []
    pos = 0
    while pos + _LOCAL.size <= len(head):
        fields = _LOCAL.unpack_from(head, pos)
        if fields[0] != _LOCAL_SIG:
            return members, False
        flags, method, comp, uncomp, name_len, extra_len = (fields[2], fields[3], fields[7], fields[8],
                                                            fields[9], fields[10])
        name_end = pos + _LOCAL.size + name_len
        if method != 0 or name_end + extra_len > len(head) or (flags & 0x08 and comp == 0):
            return members, False
        name = head[pos + _LOCAL.size: name_end].decode("utf-8", "replace")
        comp, uncomp, _ = _zip64_sizes(head[name_end: name_end + extra_len], comp, uncomp)
        data_start = name_end + extra_len
        members.append(Member(name, base + data_start, comp))
        if "/data/" in name or name.startswith("data/"):
            return members, True
        pos = data_start + comp
        if flags & 0x08:  # a data descriptor follows the data (ckpt-service writes sizes up front too)
            zip64 = comp >= 0xFFFFFFFF
            pos += 24 if zip64 else 16
        if pos >= limit:
            break
    return members, bool(members) and any(m.name.endswith("data.pkl") for m in members)


def _needs_zip64(tail: bytes, at: int) -> bool:
    """Whether the end of central directory record at `at` of `tail` leaves its counts to a zip64 record."""
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    return cd_offset == 0xFFFFFFFF or entries == 0xFFFF or cd_size == 0xFFFFFFFF


def _damaged(label: str, what: str) -> FormatError:
    return FormatError(f"{label}: damaged zip directory ({what}); the file is damaged or not a PyTorch checkpoint")


def _central_members(reads: _Reads, base: int, length: int, label: str) -> list[Member]:
    """Members from the zip's central directory; every size and offset is checked against `length` (the
    archive's real extent) before anything is read or allocated."""
    # the end records are looked for in the last SHORT_TAIL bytes first (where they are unless the zip has a
    # comment), then in the last TAIL_READ: the last signature in a suffix is the last one in the longer read
    tail_len = min(length, SHORT_TAIL)
    while True:
        tail = reads.keep(base + length - tail_len, tail_len)
        at = tail.rfind(_EOCD_SIG)
        zip64 = at >= 0 and at + 22 <= len(tail) and _needs_zip64(tail, at)
        loc = tail.rfind(_EOCD64_LOC_SIG, 0, at) if zip64 else 0
        if (at >= 0 and loc >= 0) or tail_len == min(length, TAIL_READ):
            break
        tail_len = min(length, TAIL_READ)
    if at < 0 or at + 22 > len(tail):
        raise FormatError(f"{label}: not a torch.save archive (no zip directory); "
                          "the file is damaged or not a PyTorch checkpoint")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    if zip64:
        if loc < 0 or loc + 20 > at:
            raise _damaged(label, "zip64 locator missing")
        (eocd64_offset,) = struct.unpack_from("<Q", tail, loc + 8)
        if eocd64_offset + 56 > length:
            raise _damaged(label, "zip64 record outside the archive")
        eocd64 = reads.read(base + eocd64_offset, 56)
        if eocd64[:4] != b"PK\x06\x06":
            raise _damaged(label, "bad zip64 record")
        entries, cd_size, cd_offset = struct.unpack_from("<QQQ", eocd64, 32)
    if cd_offset + cd_size > length:
        raise _damaged(label, f"directory of {cd_size} bytes at {cd_offset} lies outside the {length}-byte archive")
    if cd_size > max_metadata_bytes() or entries * _CENTRAL.size > cd_size:
        raise _damaged(label, f"{entries} entries in a {cd_size}-byte directory")
    directory = reads.read(base + cd_offset, cd_size)
    members: list[Member] = []
    starts: list[int] = []
    names: set[str] = set()
    pos = 0
    for _ in range(entries):
        if pos + _CENTRAL.size > len(directory):
            raise _damaged(label, "entries run past the directory")
        fields = _CENTRAL.unpack_from(directory, pos)
        if fields[0] != _CENTRAL_SIG:
            raise _damaged(label, "bad entry signature")
        comp, uncomp, name_len, extra_len, comment_len, local_offset = (fields[8], fields[9], fields[10],
                                                                       fields[11], fields[12], fields[16])
        name = directory[pos + 46: pos + 46 + name_len].decode("utf-8", "replace")
        if name in names:
            raise _damaged(label, f"member {name!r} is listed twice")
        names.add(name)
        extra = directory[pos + 46 + name_len: pos + 46 + name_len + extra_len]
        comp, uncomp, local_offset = _zip64_sizes(extra, comp, uncomp, local_offset)
        if fields[4] != 0 or comp != uncomp:
            raise FormatError(f"{label}: zip member {name!r} is compressed (or its sizes disagree); torch.save "
                              "archives store members uncompressed, so the file was re-packed or is damaged")
        if local_offset is None or local_offset + _LOCAL.size > length:
            raise _damaged(label, f"member {name!r} starts outside the archive")
        data_offset = _local_data_offset(reads, base, local_offset, length, name,
                                         directory[pos + 46: pos + 46 + name_len], label)
        members.append(Member(name, data_offset, comp))
        starts.append(base + local_offset)
        pos += 46 + name_len + extra_len + comment_len
    # each member's data must end where the next header (or the directory) starts, but for a data descriptor
    # that repeats its size: a shifted start (a damaged length field) cannot pass
    bounds = sorted([*starts, base + cd_offset])
    for member in members:
        end = member.data_offset + member.size
        at = bisect_left(bounds, member.data_offset)  # the first bound at or after the data: O(log n) each
        nxt = bounds[at] if at < len(bounds) else base + cd_offset
        if end > nxt or (nxt > end and not _is_descriptor(reads.read(end, min(nxt - end, 24)), nxt - end,
                                                           member.size)):
            raise _damaged(label, f"member {member.name!r} does not end where the next entry starts")
    return members


def _is_descriptor(data: bytes, gap: int, size: int) -> bool:
    """True when the `gap` bytes after a member are its data descriptor (crc, sizes), with or without signature."""
    body = data[4:] if data[:4] == b"PK\x07\x08" else data
    if len(data) != gap or len(body) not in (12, 20):
        return False
    return struct.unpack_from("<I" if len(body) == 12 else "<Q", body, 4)[0] == size


def _local_data_offset(reads: _Reads, base: int, local_offset: int, length: int, name: str,
                       central_name: bytes, label: str) -> int:
    """Where a member's data starts, from its local header, which must agree with the directory: same name, an
    extra field made of whole records (a flipped length would shift the data silently)."""
    lf = _LOCAL.unpack(reads.read(base + local_offset, _LOCAL.size))
    name_len, extra_len = lf[9], lf[10]
    if lf[0] != _LOCAL_SIG or local_offset + _LOCAL.size + name_len + extra_len > length:
        raise _damaged(label, f"member {name!r} has no local header")
    rest = reads.read(base + local_offset + _LOCAL.size, name_len + extra_len)
    if rest[:name_len] != central_name:
        raise _damaged(label, f"member {name!r} is named differently in its local header")
    extra, at = rest[name_len:], 0
    while at + 4 <= len(extra):
        at += 4 + struct.unpack_from("<H", extra, at + 2)[0]
    if at != len(extra):
        raise _damaged(label, f"member {name!r} has a malformed extra field")
    return base + local_offset + _LOCAL.size + name_len + extra_len


def storage_range(label: str, name: str, ref: unpickle.TensorRef, member: Member, uri: str) -> ByteRange:
    """The bytes of tensor `ref` inside its storage `member`, refused when they reach outside it or claim more
    than it holds (a broadcast, overlapping strides: a 4-byte storage seen as 65536 x 65536 would be reported,
    and exported, as 17 GB)."""
    item = dtypes.itemsize(ref.dtype)
    n = dtypes.numel(counts(ref.shape, label, f"shape of {name!r}"))
    offset = count(ref.offset, label, f"storage offset of {name!r}")
    if len(ref.stride) != len(ref.shape) or any(st < 0 for st in ref.stride):
        raise FormatError(f"{label}: tensor {name!r} has strides {short(ref.stride)} for shape "
                          f"{list(ref.shape)}; the file is damaged")
    if n and any(size > 1 and st == 0 for size, st in zip(ref.shape, ref.stride)):
        raise FormatError(f"{label}: tensor {name!r} is a broadcast (strides {list(ref.stride)} for shape "
                          f"{list(ref.shape)}): {n * item} bytes viewed from a storage of {member.size}; save it "
                          "with .contiguous()", uri=label, key=name)
    if n * item > member.size:
        raise FormatError(f"{label}: tensor {name!r} claims {n * item} bytes (shape {list(ref.shape)}, strides "
                          f"{list(ref.stride)}) from a storage of {member.size}; the file is damaged", uri=label,
                          key=name)
    contiguous = ref.is_contiguous()
    span = n if contiguous else dtypes.strided_span(ref.shape, ref.stride)
    start = member.data_offset + offset * item
    if start + span * item > member.data_offset + member.size:
        raise FormatError(f"{label}: tensor {name!r} reaches past its storage; the file is damaged")
    return ByteRange(uri, start, span * item, None if contiguous else ref.stride)


def read_archive(reader: RangeReader, uri: str, offset: int = 0, length: int | None = None,
                 allowed: dict[str, Any] | None = None, label: str | None = None,
                 single_storage: bool = False) -> Archive:
    """Parse the torch.save archive stored at `uri[offset:offset+length]`.

    `single_storage` (DCP records) lets the parser stop at the first storage, found from the head
    of the archive in one read; otherwise the zip directory lists every member.
    """
    label = label or uri
    if length is None:
        length = reader.file_size(uri) - offset
    reads = _Reads(reader, uri)
    head = reads.keep(offset, min(length, HEAD_READ))
    members, complete = _walk_local_headers(head, offset, length) if single_storage else ([], False)
    if not complete:
        members = _central_members(reads, offset, length, label)
    for member in members:
        if member.data_offset + member.size > offset + length:
            raise FormatError(f"{label}: zip member {member.name!r} reaches past the end of the archive; the file is "
                              "truncated or damaged")
    by_name = {m.name: m for m in members}
    pkl = next((m for m in members if m.name.endswith("data.pkl")), None)
    if pkl is None:
        raise FormatError(f"{label}: not a torch.save archive (no data.pkl)")
    if pkl.size > max_metadata_bytes():
        raise FormatError(f"{label}: data.pkl is {pkl.size} bytes, more than the limit for metadata; the file is "
                          "damaged (if it is genuine, raise CKPT_MAX_METADATA_BYTES)")
    pkl_bytes = reads.read(pkl.data_offset, pkl.size)
    # a DCP record, read with the default allow-list; one of a tensor's size (a padded one is not kept)
    cached = single_storage and allowed is None and len(pkl_bytes) <= _RECORD_PICKLE_BYTES
    obj = _RECORD_PICKLES.get(pkl_bytes) if cached else None
    if obj is None:
        obj = unpickle.loads(pkl_bytes, label, allowed, unpickle.torch_storage_loader(label))
        if cached and isinstance(obj, unpickle.TensorRef):
            if len(_RECORD_PICKLES) >= _RECORD_PICKLES_MAX:
                _RECORD_PICKLES.clear()  # rare: more distinct records than this; threads may share the dict
            _RECORD_PICKLES[pkl_bytes] = obj
    return Archive(uri, by_name, obj)


# A DCP record's data.pkl (one tensor) is the same bytes for every record of the same dtype, shape and strides
# (the layers of a model, on every rank): the same bytes unpickle to the same frozen TensorRef, so each
# distinct one is read once.
_RECORD_PICKLES: dict[bytes, unpickle.TensorRef] = {}
_RECORD_PICKLES_MAX = 4096
_RECORD_PICKLE_BYTES = 4096  # a record's data.pkl is about 300 bytes: the cache holds 16 MiB at most


def record_tensor(reader: RangeReader, record: ByteRange, name: str, dtype: str, sizes: tuple[int, ...]) -> ByteRange:
    """The bytes of the one tensor a DCP record (a torch.save archive at `record`) holds, checked against what
    `.metadata` says of it (`dtype`, `sizes`)."""
    label = f"{record.uri}@{record.offset}"
    archive = read_archive(reader, record.uri, record.offset, record.length, label=label, single_storage=True)
    ref = archive.obj
    if not isinstance(ref, unpickle.TensorRef):
        raise FormatError(f"{label}: record for {name!r} holds no tensor")
    if ref.shape != sizes or ref.dtype != dtype:
        raise FormatError(f"{label}: record for {name!r} is {ref.dtype}{list(ref.shape)}, metadata says "
                          f"{dtype}{list(sizes)}; the checkpoint is damaged")
    return storage_range(label, name, ref, archive.storage(ref.storage.key), record.uri)
