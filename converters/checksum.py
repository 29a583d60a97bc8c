"""CRC-32 (IEEE, as zip and the output manifest use), at memory bandwidth.

`crc32` is ISA-L's (python-isal, carry-less multiply: about 9 GB/s here against 1.4 GB/s for zlib's; it
releases the GIL like zlib's), or zlib's where isal is not installed: same values either way.
`crc32_zeros` extends a CRC over a run of zero bytes without reading them (a hole in a sparse file),
by multiplying in GF(2) as zlib's crc32_combine does: O(log n) steps instead of n bytes; `crc32_combine`
joins the CRCs of two pieces (an upload's parts) into the whole's.
"""

from __future__ import annotations

from functools import lru_cache

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    from zlib import crc32 as _crc32

_POLY = 0xEDB88320  # x^32 + ... reflected, as zlib
_ONES = 0xFFFFFFFF


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The running CRC-32 `value` extended over `data` (any contiguous buffer), as `zlib.crc32`."""
    return _crc32(data, value)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (bit-reflected, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


@lru_cache(maxsize=1024)  # the same lengths recur (16 MiB blocks, equal tensors): each costs ~30 products once
def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: the operator that shifts a CRC register over n zero bytes."""
    p, k = 1 << 31, 3  # x^0; a byte is 2^3 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_zeros(n: int, value: int = 0) -> int:
    """`crc32(bytes(n), value)` without touching n bytes: the register (value with its final inversion undone)
    is multiplied by x^(8n), then inverted again."""
    if n <= 0:
        return value
    return _multmodp(_x8nmodp(n), value ^ _ONES) ^ _ONES


def crc32_combine(crc: int, more: int, length: int) -> int:
    """The CRC-32 of a + b from `crc` (a's), `more` (b's) and b's `length`, reading neither, as zlib's
    crc32_combine: crc(a + b) = crc(b) ^ shift(crc(a)) ^ shift(0), shifting over `length` zero bytes."""
    return more ^ crc32_zeros(length, crc) ^ _zeros_crc(length)


@lru_cache(maxsize=1024)
def _zeros_crc(length: int) -> int:
    """The CRC-32 of `length` zero bytes (the lengths `crc32_combine` joins over recur)."""
    return crc32_zeros(length)
