"""FP8 weight quantization into the compressed-tensors layout (llm-compressor's FP8 schemes): `export_fp8`."""

from .config import SCHEMES, quantization_config
from .export import Fp8Result, export_fp8

__all__ = ["SCHEMES", "Fp8Result", "export_fp8", "quantization_config"]
