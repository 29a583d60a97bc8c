"""The pieces of a SentencePiece tokenizer.model (a protobuf `ModelProto`), read without sentencepiece or protobuf:
field 1 of the model is the repeated `SentencePiece` {1: piece (string), 2: score (float), 3: type (enum)};
everything else is skipped. A damaged file is refused in one line.
"""

from __future__ import annotations

import struct

from ..errors import FormatError

#: SentencePiece's piece types (and llama.cpp's SentencePieceTokenTypes, the same numbers).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class _Damaged(Exception):
    pass


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise _Damaged
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one message; length-delimited values as bytes."""
    out: list[tuple[int, int, int | bytes]] = []
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = int.from_bytes(data[at: at + 8], "little"), at + 8
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at: at + size], at + size
        elif wire == 5:
            value, at = int.from_bytes(data[at: at + 4], "little"), at + 4
        else:
            raise _Damaged
        if at > len(data):
            raise _Damaged
        out.append((number, wire, value))
    return out


def pieces(data: bytes, uri: str) -> list[tuple[str, float, int]]:
    """(piece, score, type) of each piece of the tokenizer.model bytes `data`, in id order."""
    try:
        found = []
        for number, wire, value in _fields(data):
            if number != 1 or wire != 2:
                continue
            piece, score, kind = "", 0.0, NORMAL
            assert isinstance(value, bytes)
            for n, w, v in _fields(value):
                if n == 1 and w == 2 and isinstance(v, bytes):
                    piece = v.decode("utf-8")
                elif n == 2 and w == 5 and isinstance(v, int):
                    score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                elif n == 3 and w == 0 and isinstance(v, int):
                    kind = v
            found.append((piece, score, kind))
    except (_Damaged, UnicodeDecodeError):
        found = []
    if not found:
        raise FormatError(f"{uri} (tokenizer.model): not a SentencePiece model (no pieces could be read); replace "
                          "the file", uri=uri, key="tokenizer.model")
    return found
