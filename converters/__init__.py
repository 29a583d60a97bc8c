"""The conversion engine: read sharded PyTorch checkpoints, convert, reshard and verify them offline.

The names below are the public API; everything else is internal and may change. The errors load with the
package; every other name loads its module on first use (PEP 562), so that a command imports only what it runs.
"""

from __future__ import annotations

from importlib import import_module
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
    from . import dtypes, storage
    from .adapters import adapter_info, export_adapter, export_merged
    from .archive import ArchiveResult, list_archives
    from .archive import archive as archive_checkpoint
    from .archive import gc as archive_gc
    from .archive import restore as restore_archive
    from .baseline import BaselineReport, compare_baseline, record_baseline
    from .certificate import sidecar as manifest_sidecar
    from .certificate_check import CertificateReport, NoChecksums, scrub
    from .classify import index_kinds
    from .config import ContextThread, EngineConfig, PickleLimits
    from .config import install as install_config
    from .config import use as use_config
    from .copier import DEFAULT_MEMORY_LIMIT, Progress
    from .formats import READERS, detect, load_index, register_format
    from .formats.base import BaseReader
    from .formats.deepspeed import source_for as deepspeed_source
    from .gguf_export import export_gguf
    from .hf_families.importer import ImportResult, import_hf
    from .index import CheckpointIndex
    from .layouts import parse_dim_rules
    from .names import tmp_prefix
    from .operations import DEFAULT_SHARD_SIZE, ConvertOptions, ConvertResult, convert, inspect, verify
    from .output import remove_tree
    from .pathsafety import has_control, segments_below
    from .quantize import export_fp8
    from .resharding import ReshardOptions, ReshardResult, reshard
    from .staged import through_merged
    from .stats import DiffResult, ScanResult, diff, layer_of, scan
    from .stats.guards import check as check_bounds
    from .stats.guards import parse_bounds
    from .transforms import KeyOptions
    from .verification import VerifyReport, check_certificate
    from .writers import WRITERS

#: public name -> the module (relative to this package) that defines it, or (module, name there) when the public
#: name says more than the module's own; the public modules (`storage`: URIs and filesystems, `dtypes`: dtype
#: names) are in _MODULES
_LAZY: dict[str, str | tuple[str, str]] = {
    "ConvertOptions": "operations", "ConvertResult": "operations", "convert": "operations",
    "inspect": "operations", "verify": "operations", "DEFAULT_SHARD_SIZE": "operations", "index_kinds": "classify",
    "ContextThread": "config", "EngineConfig": "config", "PickleLimits": "config",
    "install_config": ("config", "install"), "use_config": ("config", "use"),
    "DEFAULT_MEMORY_LIMIT": "copier", "Progress": "copier",
    "READERS": "formats", "detect": "formats", "load_index": "formats", "register_format": "formats",
    "BaseReader": "formats.base", "deepspeed_source": ("formats.deepspeed", "source_for"),
    "CheckpointIndex": "index", "parse_dim_rules": "layouts", "tmp_prefix": "names", "remove_tree": "output",
    "has_control": "pathsafety", "segments_below": "pathsafety",
    "ReshardOptions": "resharding", "ReshardResult": "resharding", "reshard": "resharding",
    "KeyOptions": "transforms", "VerifyReport": "verification", "WRITERS": "writers",
    "adapter_info": "adapters", "export_adapter": "adapters", "export_merged": "adapters", "export_fp8": "quantize",
    "import_hf": "hf_families.importer", "ImportResult": "hf_families.importer", "export_gguf": "gguf_export",
    "scan": "stats", "diff": "stats", "ScanResult": "stats", "DiffResult": "stats", "through_merged": "staged",
    "layer_of": "stats", "check_certificate": "verification", "scrub": "certificate_check",
    "parse_bounds": "stats.guards", "check_bounds": ("stats.guards", "check"),
    "CertificateReport": "certificate_check", "NoChecksums": "certificate_check", "BaselineReport": "baseline",
    "record_baseline": "baseline", "compare_baseline": "baseline", "manifest_sidecar": ("certificate", "sidecar"),
    "archive_checkpoint": ("archive", "archive"), "restore_archive": ("archive", "restore"),
    "archive_gc": ("archive", "gc"), "list_archives": "archive", "ArchiveResult": "archive",
}
_MODULES = ("dtypes", "storage")

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "DEFAULT_SHARD_SIZE",
    "READERS",
    "WRITERS",
    "ArchiveResult",
    "BaseReader",
    "BaselineReport",
    "CertificateReport",
    "CheckpointIndex",
    "CkptError",
    "ContextThread",
    "ConvertOptions",
    "ConvertResult",
    "DiffResult",
    "EngineConfig",
    "FormatError",
    "ImportResult",
    "KeyOptions",
    "NoChecksums",
    "OptionError",
    "PickleLimits",
    "Progress",
    "ReshardOptions",
    "ReshardResult",
    "ScanResult",
    "SourceError",
    "TargetError",
    "UnsafePickleError",
    "VerifyError",
    "VerifyReport",
    "adapter_info",
    "archive_checkpoint",
    "archive_gc",
    "check_bounds",
    "check_certificate",
    "compare_baseline",
    "convert",
    "deepspeed_source",
    "detect",
    "diff",
    "dtypes",
    "export_adapter",
    "export_fp8",
    "export_gguf",
    "export_merged",
    "has_control",
    "import_hf",
    "index_kinds",
    "inspect",
    "install_config",
    "layer_of",
    "list_archives",
    "load_index",
    "manifest_sidecar",
    "parse_bounds",
    "parse_dim_rules",
    "record_baseline",
    "register_format",
    "remove_tree",
    "reshard",
    "restore_archive",
    "scan",
    "scrub",
    "segments_below",
    "storage",
    "through_merged",
    "tmp_prefix",
    "use_config",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return import_module(f".{name}", __name__)  # the import system binds it as this package's attribute
    where = _LAZY.get(name)
    if where is None:  # not a public name: `from converters import writers` goes on to import the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = (where, name) if isinstance(where, str) else where
    value = getattr(import_module(f".{module}", __name__), attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
