"""Integer settings read from the environment (`CKPT_…`), checked the same way everywhere."""

from __future__ import annotations

import os

from .errors import OptionError


def positive_int(var: str, default: int, unit: str) -> int:
    """`var` as a positive integer, `default` when unset or empty; a bad value is one line naming the setting."""
    text = os.environ.get(var, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise OptionError(f"{var}={text!r}: give a positive number of {unit}")
    return value
