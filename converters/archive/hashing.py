"""Chunk addresses: BLAKE3 (format ckpt-archive/2; ~4x SHA-256's speed a core, and it releases the GIL), SHA-256
for manifests of format ckpt-archive/1 (still restored). Both give 64 hex digits, so both share `chunks/`."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import blake3

BLAKE3, SHA256 = "blake3", "sha256"


def _blake3(data: bytes | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


HASHES: dict[str, Callable[[bytes | memoryview], str]] = {BLAKE3: _blake3, SHA256: _sha256}
