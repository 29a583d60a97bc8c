"""Human units: sizes ("5GB", decimal as Hugging Face counts shards; "256MiB", binary; or plain bytes) and
durations ("90m", "36h", "7d", or plain seconds)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, overload

from pydantic import BeforeValidator

from converters import OptionError

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise OptionError(f"size {text!r}: write a number with an optional unit, e.g. 5GB, 256MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def exact(n: int) -> str:
    """`n` bytes in the largest unit that divides it exactly (5000000000 -> 5GB, 268435456 -> 256MiB)."""
    for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
        scale = _UNITS[unit.upper()]
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


@overload
def when(value: float) -> datetime: ...
@overload
def when(value: None) -> None: ...
def when(value: float | None) -> datetime | None:
    """A stored time (seconds since the epoch) as an aware UTC datetime; None stays None."""
    return None if value is None else datetime.fromtimestamp(value, tz=timezone.utc)


_DURATION = re.compile(r"^(\d{1,9})([smhdw]?)$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: int | float | str) -> float:
    """Seconds, or a number with s/m/h/d/w (`36h`, `7d`)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value).strip())
    if not match:
        raise ValueError("write seconds or a duration such as 90m, 36h or 7d")
    return float(int(match[1]) * _SECONDS[match[2]])


def _duration_or_none(value: Any) -> Any:
    return None if value is None else parse_duration(value)


#: A settings or request field given in seconds or as a duration (`Annotated[float | None, DURATION]`).
DURATION = BeforeValidator(_duration_or_none)
