"""The FP8 schemes and the `quantization_config` each writes into config.json, exactly as llm-compressor
(0.14, compressed-tensors 0.20.1) writes it after `oneshot(recipe=QuantizationModifier(scheme=...))`.

    FP8_DYNAMIC  weights per output channel (scale [out, 1]), activations dynamic per token
    FP8_BLOCK    weights per 128x128 block (scale [ceil(out/128), ceil(in/128)]), activations dynamic per 128-group
    FP8_TENSOR   weights per tensor (scale [1]), weight-only (activations left in high precision: W8A16)

llm-compressor's static `FP8` preset also needs input scales from calibration data (its `oneshot` refuses to
run without a dataset), so a weight-only export cannot write it; FP8_TENSOR is the per-tensor scheme instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionError

#: the compressed-tensors release whose layout these configs and tensors match
CT_VERSION = "0.20.1"
BLOCK = (128, 128)


@dataclass(frozen=True)
class Scheme:
    name: str
    strategy: str  # "channel", "block" or "tensor": how weight scales are grouped
    input_activations: dict | None


_FP8_ARGS = {"num_bits": 8, "symmetric": True, "type": "float"}
SCHEMES = {
    "FP8_DYNAMIC": Scheme("FP8_DYNAMIC", "channel",
                          {"dynamic": True, "group_size": None, "strategy": "token", **_FP8_ARGS}),
    "FP8_BLOCK": Scheme("FP8_BLOCK", "block",
                        {"dynamic": True, "group_size": 128, "strategy": "group", **_FP8_ARGS}),
    "FP8_TENSOR": Scheme("FP8_TENSOR", "tensor", None),
}


def scheme(name: str) -> Scheme:
    """The scheme called `name` (case-insensitive), or one OptionError naming the choices."""
    found = SCHEMES.get(str(name).upper())
    if found is not None:
        return found
    if str(name).upper() == "FP8":
        raise OptionError("scheme FP8: llm-compressor's static FP8 needs input scales calibrated on data, which a "
                          "weight-only export cannot make; choose FP8_TENSOR (per-tensor weight scales, weight-only), "
                          "FP8_DYNAMIC or FP8_BLOCK", field="scheme")
    raise OptionError(f"scheme {name}: unknown; choose {', '.join(SCHEMES)}", field="scheme")


def weights_args(chosen: Scheme) -> dict:
    args: dict = {"dynamic": False, "group_size": None, "num_bits": 8, "observer": "memoryless_minmax",
                  "strategy": chosen.strategy, "symmetric": True, "type": "float"}
    if chosen.strategy == "block":
        args["block_structure"] = list(BLOCK)
    return dict(sorted(args.items()))


def quantization_config(chosen: Scheme, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for `chosen`; `ignore` names the Linear modules left unquantized."""
    inputs = dict(sorted(chosen.input_activations.items())) if chosen.input_activations is not None else None
    # llm-compressor infers the format: "float-quantized" with FP8 activations, "naive-quantized" weight-only
    fmt = "float-quantized" if inputs is not None else "naive-quantized"
    group = {"format": fmt, "input_activations": inputs, "output_activations": None,
             "targets": ["Linear"], "weights": weights_args(chosen)}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore), "kv_cache_scheme": None, "moe_sparsity_config": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": CT_VERSION}
