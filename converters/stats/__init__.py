"""Know what is inside a checkpoint: per-tensor statistics (`scan`) and differences between two (`diff`),
streamed in bounded blocks with float64 accumulation."""

from .moments import SUPPORTED, TensorStats
from .stats import ScanResult, scan

__all__ = ["SUPPORTED", "ScanResult", "TensorStats", "scan"]
