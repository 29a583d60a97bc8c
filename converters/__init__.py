"""The conversion engine: read sharded PyTorch checkpoints, convert, reshard and verify them offline.

The names below are the public API; everything else is internal and may change. The errors load with the
package; every other name loads its module on first use (PEP 562), so that a command imports only what it runs.
"""

from __future__ import annotations

import sys
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import (
    CkptError,
    FormatError,
    OptionError,
    SourceError,
    TargetError,
    UnsafePickleError,
    VerifyError,
)

if TYPE_CHECKING:
    from .api import ConvertOptions, ConvertResult, convert, inspect, verify
    from .config import EngineConfig, PickleLimits
    from .copier import Progress
    from .formats import READERS, detect, load_index, register_format
    from .formats.base import BaseReader
    from .index import CheckpointIndex
    from .reshard import ReshardOptions, ReshardResult, reshard
    from .transforms import KeyOptions
    from .verify import VerifyReport
    from .writers import WRITERS

#: public name -> the module (relative to this package) that defines it
_LAZY = {
    "ConvertOptions": "api", "ConvertResult": "api", "convert": "api", "inspect": "api", "verify": "api",
    "EngineConfig": "config", "PickleLimits": "config",
    "Progress": "copier", "READERS": "formats", "detect": "formats", "load_index": "formats",
    "register_format": "formats", "BaseReader": "formats.base", "CheckpointIndex": "index",
    "ReshardOptions": "reshard", "ReshardResult": "reshard", "reshard": "reshard", "KeyOptions": "transforms",
    "VerifyReport": "verify", "WRITERS": "writers",
}

__all__ = [
    "READERS", "WRITERS", "BaseReader", "CheckpointIndex", "CkptError", "ConvertOptions", "ConvertResult",
    "EngineConfig", "FormatError", "KeyOptions", "OptionError", "PickleLimits", "Progress", "ReshardOptions",
    "ReshardResult", "SourceError", "TargetError", "UnsafePickleError", "VerifyError", "VerifyReport", "convert",
    "detect", "inspect", "load_index", "register_format", "reshard", "verify",
]


class _Package(ModuleType):
    """`verify` and `reshard` name both a submodule and a public function: the function wins, as it did when
    this package imported everything at once, so the import system's binding of the submodule is skipped."""

    def __setattr__(self, name: str, value: Any) -> None:
        if _LAZY.get(name) is not None and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # not a public name: `from converters import storage` goes on to import the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
