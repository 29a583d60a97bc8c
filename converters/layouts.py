"""Sharding layouts for `reshard`: which box of each tensor each rank holds.

A layout is a small named policy: `boxes(fqn, shape, world_size)` returns, per rank, the box that
rank owns, or None. `fsdp2` is FSDP2's `fully_shard`: dim-0 pieces with `torch.chunk` sizes (ranks
past the end get nothing). Adding FSDP1 flat-param order or tensor-parallel splits is one more class.
"""

from __future__ import annotations

import re
from typing import Protocol

from .errors import OptionError
from .tensorio import Box


class Layout(Protocol):
    name: str

    def boxes(self, fqn: str, shape: tuple[int, ...], world_size: int) -> list[Box | None]: ...


def chunk_bounds(dim_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, length) of `rank`'s piece under `torch.chunk(dim_size, world_size)` semantics."""
    step = -(-dim_size // world_size) if dim_size else 0
    start = min(rank * step, dim_size)
    return start, max(0, min(step, dim_size - start))


class Fsdp2Layout:
    """Dim-0 chunks like FSDP2, with `--shard-dim-rule REGEX=DIM` overrides per parameter name."""

    name = "fsdp2"

    def __init__(self, dim_rules: list[tuple[str, int]] | None = None) -> None:
        self.rules = []
        for pattern, dim in dim_rules or []:
            try:
                self.rules.append((re.compile(pattern), int(dim)))
            except re.error as exc:
                raise OptionError(f"shard_dim_rule {pattern}={dim}: bad regular expression ({exc})",
                                  option="shard_dim_rule") from None

    def dim(self, fqn: str, shape: tuple[int, ...]) -> int:
        for pattern, dim in self.rules:
            if pattern.search(fqn):
                if not -len(shape) <= dim < len(shape):
                    raise OptionError(f"shard_dim_rule {pattern.pattern}={dim}: {fqn!r} has only {len(shape)} "
                                      "dimensions", option="shard_dim_rule")
                return dim % len(shape)
        return 0

    def boxes(self, fqn: str, shape: tuple[int, ...], world_size: int) -> list[Box | None]:
        if not shape:  # scalars (e.g. optimizer `step`) are replicated: rank 0 writes them
            return [((), ())] + [None] * (world_size - 1)
        dim = self.dim(fqn, shape)
        out: list[Box | None] = []
        for rank in range(world_size):
            start, length = chunk_bounds(shape[dim], world_size, rank)
            if length == 0:
                out.append(None)
                continue
            offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(length if d == dim else s for d, s in enumerate(shape))
            out.append((offsets, sizes))
        return out


LAYOUTS = {"fsdp2": Fsdp2Layout}


def make_layout(name: str, dim_rules: list[tuple[str, int]] | None = None) -> Layout:
    if name not in LAYOUTS:
        raise OptionError(f"layout {name}: choose one of {', '.join(LAYOUTS)}", option="layout")
    return LAYOUTS[name](dim_rules)


def parse_dim_rules(values: list[str]) -> list[tuple[str, int]]:
    rules = []
    for value in values:
        pattern, sep, dim = value.rpartition("=")
        if not sep or not dim.lstrip("-").isdigit():
            raise OptionError(f"shard_dim_rule {value!r}: expected REGEX=DIM, e.g. 'lm_head\\.weight$=1'",
                              option="shard_dim_rule")
        rules.append((pattern, int(dim)))
    return rules
