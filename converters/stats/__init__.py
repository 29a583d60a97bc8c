"""Know what is inside a checkpoint: per-tensor statistics (`scan`) and differences between two (`diff`),
streamed in bounded blocks with float64 accumulation."""

from .diffs import DiffResult, LayerDiff, TensorDiff, diff, layer_of
from .moments import SUPPORTED, TensorStats
from .stats import ScanResult, scan

__all__ = ["SUPPORTED", "DiffResult", "LayerDiff", "ScanResult", "TensorDiff", "TensorStats", "diff", "layer_of",
           "scan"]
