"""The conversion engine: read sharded PyTorch checkpoints, convert, reshard and verify them offline.

The names below are the public API; everything else is internal and may change."""

from .api import ConvertOptions, ConvertResult, convert, inspect, verify
from .copier import Progress
from .errors import (
    CkptError,
    FormatError,
    OptionError,
    SourceError,
    TargetError,
    UnsafePickleError,
    VerifyError,
)
from .formats import READERS, detect, load_index, register_format
from .formats.base import BaseReader
from .index import CheckpointIndex
from .reshard import ReshardOptions, ReshardResult, reshard
from .transforms import KeyOptions
from .verify import VerifyReport
from .writers import WRITERS

__all__ = [
    "READERS", "WRITERS", "BaseReader", "CheckpointIndex", "CkptError", "ConvertOptions", "ConvertResult",
    "FormatError", "KeyOptions", "OptionError", "Progress", "ReshardOptions", "ReshardResult", "SourceError",
    "TargetError", "UnsafePickleError", "VerifyError", "VerifyReport", "convert", "detect", "inspect",
    "load_index", "register_format", "reshard", "verify",
]
