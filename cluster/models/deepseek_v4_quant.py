"""DeepSeek-V4 quantized checkpoints: which quantization configs are understood, and how one
checkpoint weight plus its companion tensors becomes a ``kernels.quant.QuantizedWeight``.

Tensors describe their own format, so checkpoints that mix formats across modules (FP8 attention,
NVFP4 routed experts, an MXFP4 MTP layer) load module by module:
- plain: a bfloat16 / float16 / float32 ``weight``, no scale;
- ``fp8_block``: a float8_e4m3fn ``weight`` with 128x128 block scales ``scale`` (released) or
  ``weight_scale_inv`` (transformers), float32 or ue8m0 (float8_e8m0fnu / uint8 exponents);
- ``mxfp4``: a packed int8/uint8 ``weight`` (two e2m1 per byte) with e8m0 ``scale`` per 32;
- ``nvfp4``: a packed uint8 ``weight`` with float8_e4m3fn ``weight_scale`` per 16 and the float32
  global ``weight_scale_2`` (ModelOpt); ``input_scale`` (static activation scale) is not used.
``quantization_config`` must name a known method (``fp8`` as DeepSeek and transformers write it,
``modelopt`` with NVFP4 / MXFP4 / MIXED_PRECISION, ``mxfp4``); anything else stops loading.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cluster.common.errors import ModelLoadError
from kernels.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP, QuantizedWeight

#: Companion tensors of a quantized ``<base>.weight``, by suffix after ``<base>.``.
SCALE_SUFFIXES = ("scale", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PACKED_DTYPES = (torch.int8, torch.uint8)
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
#: ``expert_dtype`` values (DeepSeek's "fp4" is MXFP4) -> the routed experts' format.
_EXPERT_DTYPES: dict[str | None, str] = {None: "plain", "bf16": "plain", "fp8": "fp8_block", "fp4": "mxfp4",
                                         "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
_MODELOPT_ALGOS = {"NVFP4": "nvfp4", "MXFP4": "mxfp4"}


@dataclass(frozen=True)
class QuantScheme:
    """What config.json declares (for validation and logging; tensors carry their own format)."""

    method: str | None
    formats: frozenset[str]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantScheme:
        qc = config.get("quantization_config")
        if qc is None:
            return cls(None, frozenset())
        if not isinstance(qc, dict):
            raise ModelLoadError("quantization_config in config.json is not an object")
        method = qc.get("quant_method")
        if method == "fp8":
            return cls(method, frozenset({"fp8_block", _fp8_expert_format(qc, config)}) - {"plain"})
        if method == "modelopt":
            return cls(method, frozenset(_modelopt_formats(qc)))
        if method == "mxfp4":
            return cls(method, frozenset({"mxfp4"}))
        raise ModelLoadError(f"unknown quantization format {method!r} (quantization_config.quant_method); "
                             "supported: fp8 (128x128 block scales, fp8/fp4 experts), modelopt (NVFP4, MXFP4, "
                             "MIXED_PRECISION), mxfp4")


def expert_kernel_format(config: dict[str, Any], role: str) -> str:
    """The format the routed experts of the main model (``role="main"``) or of the MTP layer
    (``"draft"``) are stored in, as config.json declares it: what their MoE kernel must run."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return "bf16"
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = _fp8_expert_format(qc, config)
        return "bf16" if fmt == "plain" else fmt
    if method == "mxfp4":
        return "mxfp4"
    if method == "modelopt":
        if qc.get("quant_algo") != "MIXED_PRECISION":
            return _MODELOPT_ALGOS.get(str(qc.get("quant_algo")), "bf16")
        for pattern, entry in (qc.get("quantized_layers") or {}).items():
            is_mtp = str(pattern).startswith("mtp.")
            if "experts" in str(pattern) and is_mtp == (role == "draft") and isinstance(entry, dict):
                return _MODELOPT_ALGOS.get(str(entry.get("quant_algo")), "bf16")
    return "bf16"


def _fp8_expert_format(qc: dict[str, Any], config: dict[str, Any]) -> str:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"unknown quantization format fp8 fmt={qc.get('fmt')!r} (only e4m3 is supported)")
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise ModelLoadError(f"unknown quantization format fp8 scale_fmt={qc.get('scale_fmt')!r} (float, ue8m0)")
    block = list(qc.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise ModelLoadError(f"unsupported quantization format fp8 weight_block_size={block} "
                             f"(only {FP8_BLOCK}x{FP8_BLOCK} blocks are supported)")
    expert = qc.get("expert_dtype", config.get("expert_dtype"))
    if expert not in _EXPERT_DTYPES:
        raise ModelLoadError(f"unknown quantization format expert_dtype={expert!r} "
                             f"(supported: {', '.join(str(k) for k in _EXPERT_DTYPES if k)})")
    return _EXPERT_DTYPES[expert]


def _modelopt_formats(qc: dict[str, Any]) -> set[str]:
    algo = qc.get("quant_algo")
    algos = [algo]
    if algo == "MIXED_PRECISION":
        layers = qc.get("quantized_layers") or {}
        algos = [entry.get("quant_algo") for entry in layers.values() if isinstance(entry, dict)]
    unknown = sorted({str(a) for a in algos if a not in _MODELOPT_ALGOS})
    if unknown:
        raise ModelLoadError(f"unknown quantization format {', '.join(unknown)} (modelopt quant_algo); "
                             f"supported: {', '.join(_MODELOPT_ALGOS)}, MIXED_PRECISION")
    return {_MODELOPT_ALGOS[str(a)] for a in algos}


def is_complete(parts: dict[str, torch.Tensor]) -> bool:
    """Whether a weight's tensors seen so far are all it needs (the rest may come later)."""
    weight = parts.get("weight")
    if weight is None:
        return False
    if weight.dtype in PLAIN_DTYPES:
        return True
    if weight.dtype in PACKED_DTYPES:
        nvfp4 = "weight_scale_2" in parts or parts.get("weight_scale", weight).dtype == torch.float8_e4m3fn
        if nvfp4:
            return "weight_scale" in parts and "weight_scale_2" in parts
    return any(k in parts for k in ("scale", "weight_scale_inv", "weight_scale"))


def to_quantized(name: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> QuantizedWeight:
    """``parts`` (suffix -> tensor) of checkpoint weight ``name`` (``<base>.weight``) -> its weight
    of logical ``shape [N, K]``; raises ModelLoadError naming the tensor and the format on anything
    that does not fit."""
    weight = parts["weight"]
    scales = {k: v for k, v in parts.items() if k not in ("weight", "input_scale")}
    if weight.dtype in PLAIN_DTYPES:
        if scales:
            raise ModelLoadError(f"tensor {name!r} is {weight.dtype} but comes with scale tensor(s) {sorted(scales)}")
        _check_shape(name, "plain", tuple(weight.shape), shape)
        return QuantizedWeight("bf16", weight)
    if weight.dtype == torch.float8_e4m3fn:
        scale = _first(parts, "scale", "weight_scale_inv", "weight_scale")
        if scale is None:
            raise ModelLoadError(f"tensor {name!r} is fp8_block (float8_e4m3fn) but has no block scale")
        _check_shape(name, "fp8_block", tuple(weight.shape), shape)
        blocks = (math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK))
        _check_shape(name + " scale", "fp8_block", tuple(scale.shape), blocks)
        if scale.dtype not in (torch.float32, *E8M0_DTYPES):
            raise ModelLoadError(f"tensor {name!r}: fp8_block scale dtype {scale.dtype} is not float32 or ue8m0")
        return QuantizedWeight("fp8_block", weight, _e8m0_as_uint8(scale))
    if weight.dtype in PACKED_DTYPES:
        return _fp4(name, weight.view(torch.uint8), parts, shape)
    raise ModelLoadError(f"tensor {name!r} has dtype {weight.dtype}, which is not a known weight format "
                         "(plain bf16/fp16/fp32, fp8_block, mxfp4, nvfp4)")


def _fp4(name: str, packed: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> QuantizedWeight:
    logical = (packed.shape[0], packed.shape[1] * 2)
    if "weight_scale_2" in parts:
        fmt, group, scale = "nvfp4", NVFP4_GROUP, parts.get("weight_scale")
        if scale is None or scale.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"tensor {name!r} is nvfp4 but its weight_scale is missing or not float8_e4m3fn")
    else:
        fmt, group, scale = "mxfp4", MXFP4_GROUP, _first(parts, "scale", "weight_scale", "weight_scale_inv")
        if scale is None or scale.dtype not in E8M0_DTYPES:
            raise ModelLoadError(f"tensor {name!r} is packed fp4 but has no e8m0 (mxfp4) or e4m3 + global "
                                 "(nvfp4) scales")
    _check_shape(name, fmt, logical, shape)
    _check_shape(name + " scale", fmt, tuple(scale.shape), (shape[0], shape[1] // group))
    if fmt == "mxfp4":
        return QuantizedWeight(fmt, packed, _e8m0_as_uint8(scale))
    global_scale = parts["weight_scale_2"].float()
    if global_scale.numel() != 1:
        raise ModelLoadError(f"tensor {name!r}: nvfp4 weight_scale_2 has shape {tuple(global_scale.shape)}, "
                             "expected one value")
    return QuantizedWeight(fmt, packed, scale, global_scale.reshape(()))


def _first(parts: dict[str, torch.Tensor], *keys: str) -> torch.Tensor | None:
    return next((parts[k] for k in keys if k in parts), None)


def _e8m0_as_uint8(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _check_shape(name: str, fmt: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ModelLoadError(f"tensor {name!r} ({fmt}) has shape {tuple(got)}, expected {tuple(want)}")
