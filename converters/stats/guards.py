"""Guards on a scan: bounds on per-tensor statistics that a rule's job, an alias move or a conversion requires
before it goes ahead (`require`, with `require_finite` as the bound `finite`).

A bound is one short string, the same on the command line (`--require "max_abs<=100"`) and over REST (a list
of strings):

    finite                      no tensor holds a NaN or an infinity
    STAT<=LIMIT[:GLOB]          every tensor (whose name matches GLOB) has STAT at most LIMIT
    STAT>=LIMIT[:GLOB]          ... at least LIMIT (e.g. `l2>=1e-6:*.weight`: no weight was zeroed)

STAT is `max_abs` (the largest |value|, from min and max), `l2` (the tensor's L2 norm) or `std` (its standard
deviation). A tensor holding NaN or Inf breaks every bound on it (its true statistic is NaN or infinite), and
a bound whose GLOB matches no tensor is broken too (a misspelt glob checks nothing). Only the statistics are
needed (`converters.stats.scan`'s results, or their JSON), so the check is the same everywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ..errors import OptionError
from .moments import TensorStats

STATISTICS = ("max_abs", "l2", "std")
SYNTAX = "finite, or STAT<=LIMIT[:GLOB] / STAT>=LIMIT[:GLOB] with STAT one of max_abs, l2, std"
_BOUND = re.compile(r"^\s*([A-Za-z_0-9]+)\s*(<=|>=)\s*([^:\s]+)\s*(?::\s*(\S.*?))?\s*$")
SHOWN = 5  # tensors named per broken bound


@dataclass(frozen=True)
class Bound:
    """One guard: `stat` is "finite" (no limit) or a statistic of `STATISTICS`, `upper` whether `limit` is a
    maximum (<=) or a minimum (>=), `glob` the tensor names it applies to (None: all)."""

    stat: str
    limit: float = 0.0
    upper: bool = True
    glob: str | None = None

    def __str__(self) -> str:
        if self.stat == "finite":
            return "finite"
        limit = f"{self.limit:g}" if float(f"{self.limit:g}") == self.limit else repr(self.limit)
        text = f"{self.stat}{'<=' if self.upper else '>='}{limit}"
        return f"{text}:{self.glob}" if self.glob else text

    def applies(self, name: str) -> bool:
        return self.glob is None or fnmatchcase(name, self.glob)

    def holds(self, value: float) -> bool:
        return value <= self.limit if self.upper else value >= self.limit  # NaN holds neither


FINITE = Bound("finite")


def parse_bound(text: str) -> Bound:
    """One bound from its string (module docstring); OptionError naming it and the syntax otherwise."""
    if text.strip().lower() == "finite":
        return FINITE
    match = _BOUND.match(text)
    if match is None:
        raise OptionError(f"bound {text!r}: write {SYNTAX}", option="require")
    stat, op, number, glob = match.groups()
    if stat not in STATISTICS:
        raise OptionError(f"bound {text!r}: unknown statistic {stat!r}; choose one of {', '.join(STATISTICS)}",
                          option="require")
    try:
        limit = float(number)
    except ValueError:
        raise OptionError(f"bound {text!r}: limit {number!r} is not a number (e.g. 100 or 1e4)",
                          option="require") from None
    if not math.isfinite(limit) or limit < 0:
        raise OptionError(f"bound {text!r}: limit {number!r} must be a finite number >= 0", option="require")
    return Bound(stat, limit, op == "<=", glob)


def parse_bounds(texts: Iterable[str], require_finite: bool = False) -> list[Bound]:
    """The bounds of a request: its `require` strings, and `finite` for `require_finite` (once)."""
    bounds = [parse_bound(text) for text in texts]
    if require_finite and FINITE not in bounds:
        bounds.insert(0, FINITE)
    return bounds


def _number(value: Any) -> float | None:
    """A statistic as stored: a number, None, or a string for a float64 overflow (`json_number`)."""
    if value is None:
        return None
    return float(value)


def statistic(row: Mapping[str, Any], stat: str) -> float | None:
    """`stat` of one tensor's statistics (a `TensorStats.to_dict()` row): over all its elements, so NaN when
    it holds a NaN and infinite when it holds an infinity (std: NaN); None when there is nothing to measure."""
    if int(row.get("nan", 0)):
        return math.nan
    if int(row.get("posinf", 0)) or int(row.get("neginf", 0)):
        return math.nan if stat == "std" else math.inf
    if stat == "max_abs":
        low, high = _number(row.get("min")), _number(row.get("max"))
        return None if low is None or high is None else max(abs(low), abs(high))
    return _number(row.get(stat))


@dataclass(frozen=True)
class Broken:
    """A bound that did not hold: the tensors (name, value) that broke it, all of them in scan order."""

    bound: Bound
    tensors: tuple[tuple[str, float], ...]

    def __str__(self) -> str:
        if self.bound.glob is not None and not self.tensors:
            return f"no tensor matching {self.bound.glob} ({self.bound})"
        names = [name for name, _ in self.tensors]
        more = f", ... (+{len(names) - SHOWN})" if len(names) > SHOWN else ""
        if self.bound.stat == "finite":
            return f"NaN or Inf in {len(names)} tensor(s) ({', '.join(names[:SHOWN])}{more})"
        shown = ", ".join(f"{name} {self.bound.stat}={value:.6g}" for name, value in self.tensors[:SHOWN])
        return f"{len(names)} tensor(s) {'over' if self.bound.upper else 'under'} {self.bound}: {shown}{more}"


def check(bounds: Iterable[Bound], tensors: Iterable[TensorStats | Mapping[str, Any]]) -> list[Broken]:
    """The bounds the tensors' statistics break (none: the guard passes)."""
    rows = [t.to_dict() if isinstance(t, TensorStats) else t for t in tensors]
    broken: list[Broken] = []
    for bound in bounds:
        matched = False
        bad: list[tuple[str, float]] = []
        for row in rows:
            name = str(row["name"])
            if not bound.applies(name):
                continue
            matched = True
            if bound.stat == "finite":
                if int(row.get("nan", 0)) + int(row.get("posinf", 0)) + int(row.get("neginf", 0)):
                    bad.append((name, math.nan))
                continue
            value = statistic(row, bound.stat)
            if value is not None and not bound.holds(value):
                bad.append((name, value))
        if bad or (bound.glob is not None and not matched):
            broken.append(Broken(bound, tuple(bad)))
    return broken
