"""Lossless chunk encodings, chosen per chunk by a quick trial: raw, zstd of the bytes, or zstd of the bytes
split into byte planes (byte k of every element together: floating-point exponent bytes compress well).

A stored chunk is one tag byte, then for byte planes one itemsize byte, then the payload. SOME_PLANES (what
`encode` writes for split elements): tag, itemsize, a mask byte (bit k: plane k is compressed), then each
plane in order, compressed ones as a 4-byte little-endian length and a zstd frame, the others raw, then the
bytes after the last whole element. Only the planes a trial finds compressible go through zstd (a weight's
mantissa planes do not compress: they are copied, not compressed and decompressed)."""

from __future__ import annotations

import numpy as np
import zstandard

RAW, ZSTD, PLANES, SOME_PLANES = 0, 1, 2, 3
LEVEL = 1  # zstd's fastest regular level: ~850 MB/s a core, within 1-2% of level 3 on weights
TRIAL = 64 << 10  # bytes of the chunk tried
KEEP = 0.97  # compressed must be under this share of raw to be kept
# A byte plane (exponent bytes) is mostly literals: a small match finder that takes only long matches (7+ bytes)
# compresses it 2-3x faster than level 1 and a little smaller (0.34 against 0.37 of raw on fp32 and bf16 weights).
PLANE_PARAMS = zstandard.ZstdCompressionParameters(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                                                   target_length=0, strategy=zstandard.STRATEGY_FAST)


def split_planes(data: bytes | memoryview, itemsize: int) -> bytes:
    n = len(data) - len(data) % itemsize
    elements = np.frombuffer(data, np.uint8, n).reshape(-1, itemsize)
    planes = np.empty((itemsize, n // itemsize), np.uint8)
    for k in range(itemsize):  # plane by plane: a strided read, 3-5x faster than one transposed copy
        planes[k] = elements[:, k]
    return planes.tobytes() + bytes(data[n:])


def join_planes(data: bytes, itemsize: int) -> bytes | memoryview:
    n = len(data) - len(data) % itemsize
    planes = np.frombuffer(data, np.uint8, n).reshape(itemsize, -1)
    elements = np.empty(n, np.uint8)
    _join_into(list(planes), elements)
    return memoryview(elements.data) if n == len(data) else elements.tobytes() + data[n:]


def _join_into(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Byte k of every element taken from planes[k] (uint8 arrays of one length), written into `out` (uint8,
    len(planes) times that length). Two planes (bf16, fp16) are joined as little-endian 16-bit words, high byte
    shifted over the low one (two vectorised passes, 2-3x the per-plane strided copies); wider elements plane by
    plane (numpy has nothing faster for them)."""
    if len(planes) == 2:
        words = out.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype="<u2")
        np.bitwise_or(words, planes[0], out=words)
        return
    elements = out.reshape(-1, len(planes))
    for k, plane in enumerate(planes):
        elements[:, k] = plane


def _trial_slice(data: bytes | memoryview, itemsize: int) -> bytes | memoryview:
    if len(data) <= TRIAL:
        return data
    start = (len(data) // 2) // itemsize * itemsize
    return data[start:start + TRIAL]


def _planes(data: bytes | memoryview, itemsize: int) -> np.ndarray:
    """The whole elements of `data` as an (itemsize, n) array of byte planes."""
    n = len(data) - len(data) % itemsize
    elements = np.frombuffer(data, np.uint8, n).reshape(-1, itemsize)
    planes = np.empty((itemsize, n // itemsize), np.uint8)
    for k in range(itemsize):
        planes[k] = elements[:, k]
    return planes


Parts = list[bytes | memoryview]


def encode(data: bytes | memoryview, itemsize: int) -> bytes:
    """The smallest of raw, zstd and (for 2-, 4- and 8-byte elements) byte planes of which those that compress
    are zstd'ed, judged on a sample."""
    return b"".join(encode_parts(data, itemsize))


def encode_parts(data: bytes | memoryview, itemsize: int) -> Parts:
    """`encode`'s answer as the parts to write one after the other (no copy to join them)."""
    compressor = zstandard.ZstdCompressor(level=LEVEL)
    sample = _trial_slice(data, itemsize)
    whole = len(compressor.compress(sample))
    if itemsize in (2, 4, 8) and len(sample) >= 4 * itemsize:
        trial = _planes(sample, itemsize)
        planar = zstandard.ZstdCompressor(compression_params=PLANE_PARAMS)
        sizes = [len(planar.compress(plane)) for plane in trial]
        packed = [k for k in range(itemsize) if sizes[k] < trial.shape[1] * KEEP]
        planes_size = sum(sizes[k] if k in packed else trial.shape[1] for k in range(itemsize))
        if packed and planes_size < min(whole, len(sample) * KEEP):
            return _some_planes(data, itemsize, packed)
    if whole < len(sample) * KEEP:
        out = compressor.compress(data)
        if len(out) < len(data):
            return [bytes([ZSTD]), out]
    return [bytes([RAW]), data]


def _some_planes(data: bytes | memoryview, itemsize: int, packed: list[int]) -> Parts:
    compressor = zstandard.ZstdCompressor(compression_params=PLANE_PARAMS)
    planes = _planes(data, itemsize)
    mask = sum(1 << k for k in packed)
    parts: Parts = [bytes([SOME_PLANES, itemsize, mask])]
    for k in range(itemsize):
        if k in packed:
            frame = compressor.compress(planes[k])
            parts += [len(frame).to_bytes(4, "little"), frame]
        else:
            parts.append(memoryview(planes[k]))
    parts.append(memoryview(data)[planes.size:])
    return parts if sum(len(p) for p in parts) < len(data) + 1 else [bytes([RAW]), data]


def _join_some(stored: bytes | memoryview, length: int, out: np.ndarray | None) -> memoryview:
    itemsize, mask = stored[1], stored[2]
    if itemsize not in (2, 4, 8):
        raise ValueError("bad itemsize")
    view = memoryview(stored)
    count = length // itemsize
    out = np.empty(length, np.uint8) if out is None else out[:length]
    decompressor = zstandard.ZstdDecompressor()
    at = 3
    planes: list[np.ndarray] = []
    for k in range(itemsize):
        if mask >> k & 1:
            size = int.from_bytes(view[at:at + 4], "little")
            plane: bytes | memoryview = decompressor.decompress(view[at + 4:at + 4 + size], max_output_size=count)
            at += 4 + size
        else:
            plane, at = view[at:at + count], at + count
        if len(plane) != count:
            raise ValueError("wrong length")
        planes.append(np.frombuffer(plane, np.uint8))
    _join_into(planes, out[:count * itemsize])
    tail = view[at:]
    if len(tail) != length - count * itemsize:
        raise ValueError("wrong length")
    out[count * itemsize:] = np.frombuffer(tail, np.uint8)
    return memoryview(out.data)


def decode(stored: bytes | memoryview, length: int, out: np.ndarray | None = None) -> bytes | memoryview:
    """The raw bytes of a stored chunk of `length` bytes; ValueError when it is not a chunk this module wrote.
    With `out` (a uint8 array of at least `length` bytes) they are in out[:length] (split planes joined there,
    other encodings copied there), unless they are not `length` bytes long (a damaged chunk)."""
    data = _decode(stored, length, out if out is not None and len(out) >= length else None)
    if out is None or len(out) < length or len(data) != length:
        return data
    if not np.may_share_memory(np.frombuffer(data, np.uint8), out):
        out[:length] = np.frombuffer(data, np.uint8)
    return memoryview(out[:length].data)


def _decode(stored: bytes | memoryview, length: int, out: np.ndarray | None) -> bytes | memoryview:
    if not stored:
        raise ValueError("empty")
    tag = stored[0]
    if tag == RAW:
        return memoryview(stored)[1:]
    if tag == ZSTD:
        return zstandard.ZstdDecompressor().decompress(stored[1:], max_output_size=length)
    if tag == PLANES and len(stored) > 1 and stored[1] in (2, 4, 8):
        planes = zstandard.ZstdDecompressor().decompress(stored[2:], max_output_size=length)
        if len(planes) != length:
            raise ValueError("wrong length")
        return join_planes(planes, stored[1])
    if tag == SOME_PLANES and len(stored) > 2:
        return _join_some(stored, length, out)
    raise ValueError(f"unknown encoding {tag}")
