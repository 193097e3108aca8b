"""Quantized weight formats: exact layouts, pure-torch dequantization (the reference) and
quantizers (for tests and for model loaders).

A weight is logically ``[..., N, K]``: ``N`` output features by ``K`` input features, ``K`` being
the contraction dim and the last (contiguous) one, as in ``nn.Linear.weight``. Leading dims stack
experts: ``[E, N, K]``. Formats (``QuantizedWeight.fmt``):

``bf16``
    ``data [..., N, K]`` in a plain float dtype (bfloat16, float16 or float32). No scales.
``fp8_block``
    ``data [..., N, K]`` float8_e4m3fn; ``scale [..., ceil(N/128), ceil(K/128)]``, one per
    128x128 block (the last blocks may be partial), either float32 (the value itself) or uint8
    *ue8m0* (value ``2 ** (s - 127)``). ``w[n, k] = data[n, k] * scale[n // 128, k // 128]``.
``mxfp4`` (OCP microscaling)
    ``data [..., N, K // 2]`` uint8: two e2m1 values per byte along K, byte ``j`` holding element
    ``2j`` in its low nibble and ``2j + 1`` in its high nibble. An e2m1 nibble is a sign bit
    (``0x8``) and a 3-bit magnitude code indexing ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)``.
    ``scale [..., N, K // 32]`` uint8 e8m0, ``2 ** (s - 127)`` for elements
    ``32j .. 32j + 31`` along K. Needs ``K % 32 == 0``.
``nvfp4``
    ``data`` packed as mxfp4; ``scale [..., N, K // 16]`` float8_e4m3fn for elements
    ``16j .. 16j + 15``; ``global_scale`` float32, shape ``[]`` for one weight or ``[E]`` (one per
    expert) for ``[E, N, K]``. ``w = e2m1 * scale * global_scale`` (ModelOpt checkpoints call the
    global scale ``weight_scale_2``). Needs ``K % 16 == 0``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4")
FP8_BLOCK = 128
MXFP4_GROUP = 32
NVFP4_GROUP = 16
FP8_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight (or a stack of expert weights) in one of :data:`FORMATS`; layouts above."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}; known: {FORMATS}")
        if self.fmt != "bf16" and self.scale is None:
            raise ValueError(f"format {self.fmt} needs a scale tensor")
        if self.fmt == "nvfp4" and self.global_scale is None:
            raise ValueError("format nvfp4 needs a global_scale")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., N, K]``."""
        if self.fmt in ("mxfp4", "nvfp4"):
            return (*self.data.shape[:-1], self.data.shape[-1] * 2)
        return tuple(self.data.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def expert(self, index: int) -> QuantizedWeight:
        """The ``index``-th weight of a stacked ``[E, N, K]`` weight."""
        g = self.global_scale
        if g is not None and g.dim() > 0:
            g = g[index]
        return QuantizedWeight(self.fmt, self.data[index],
                               None if self.scale is None else self.scale[index], g)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def dequantize(w: QuantizedWeight | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[..., N, K]`` in ``dtype`` (float32 math)."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    if w.fmt == "bf16":
        return w.data.to(dtype)
    assert w.scale is not None
    if w.fmt == "fp8_block":
        n, k = w.data.shape[-2:]
        s = _scale_values(w.scale)
        s = s.repeat_interleave(FP8_BLOCK, -2)[..., :n, :].repeat_interleave(FP8_BLOCK, -1)[..., :k]
        return (w.data.float() * s).to(dtype)
    values = e2m1_to_float(unpack_fp4(w.data))
    group = MXFP4_GROUP if w.fmt == "mxfp4" else NVFP4_GROUP
    s = _scale_values(w.scale) if w.fmt == "mxfp4" else w.scale.float()
    out = values * s.repeat_interleave(group, -1)
    if w.fmt == "nvfp4":
        assert w.global_scale is not None
        g = w.global_scale.float()
        out = out * (g.view(-1, *([1] * (out.dim() - 1))) if g.dim() > 0 else g)
    return out.to(dtype)


def quantize(w: torch.Tensor, fmt: str, *, fp8_scale: str = "float32") -> QuantizedWeight:
    """Quantize a float weight ``[..., N, K]`` to ``fmt``; ``fp8_scale`` is "float32" or "ue8m0"."""
    if fmt == "bf16":
        return QuantizedWeight("bf16", w.to(torch.bfloat16))
    if fmt == "fp8_block":
        return quantize_fp8_block(w, scale_format=fp8_scale)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    raise ValueError(f"unknown weight format {fmt!r}; known: {FORMATS}")


def quantize_fp8_block(w: torch.Tensor, scale_format: str = "float32") -> QuantizedWeight:
    """float8_e4m3fn with one scale per 128x128 block (float32, or ue8m0 powers of two)."""
    if scale_format not in ("float32", "ue8m0"):
        raise ValueError(f"fp8 scale format must be float32 or ue8m0, got {scale_format!r}")
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    padded = torch.zeros(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    if scale_format == "ue8m0":
        exp = torch.ceil(torch.log2(amax.clamp(min=1e-30) / FP8_MAX)).clamp(-127, 127)
        scale_value = torch.exp2(exp)
        scale = (exp + 127).to(torch.uint8)
    else:
        scale_value = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scale = scale_value
    q = (blocks / scale_value[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    data = q.view(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k].to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8_block", data.contiguous(), scale.contiguous())


def quantize_mxfp4(w: torch.Tensor) -> QuantizedWeight:
    """e2m1 values in groups of 32 along K with e8m0 (power-of-two) scales."""
    groups = _groups(w, MXFP4_GROUP)  # [..., N, K // 32, 32]
    amax = groups.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax.clamp(min=1e-30) / E2M1_MAX)).clamp(-127, 127)
    codes = float_to_e2m1(groups / torch.exp2(exp)[..., None]).flatten(-2)
    return QuantizedWeight("mxfp4", pack_fp4(codes), (exp + 127).to(torch.uint8).contiguous())


def quantize_nvfp4(w: torch.Tensor, experts: bool | None = None) -> QuantizedWeight:
    """e2m1 values in groups of 16 along K with float8_e4m3fn scales and a float32 global scale,
    one per expert when ``w`` is ``[E, N, K]`` (``experts`` defaults to ``w.dim() == 3``)."""
    experts = w.dim() == 3 if experts is None else experts
    wf = w.float()
    amax_all = wf.abs().flatten(1).amax(-1) if experts else wf.abs().amax()
    global_scale = torch.where(amax_all > 0, amax_all / (FP8_MAX * E2M1_MAX), torch.ones_like(amax_all))
    g = global_scale.view(-1, 1, 1) if experts else global_scale  # broadcasts over [..., N, K // 16]
    groups = _groups(wf, NVFP4_GROUP)  # [..., N, K // 16, 16]
    scale = (groups.abs().amax(-1) / E2M1_MAX / g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = scale.float() * g
    scaled = groups / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    codes = float_to_e2m1(scaled).flatten(-2)
    return QuantizedWeight("nvfp4", pack_fp4(codes), scale.contiguous(), global_scale.float())


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the smaller magnitude, saturating at 6); uint8
    codes with the sign in bit 3."""
    mids = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    codes = torch.bucketize(x.abs().float(), mids).to(torch.uint8)
    return codes | ((x < 0).to(torch.uint8) << 3)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K // 2]`` bytes, element ``2j`` in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K // 2]`` bytes -> ``[..., K]`` codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales as they are; uint8 e8m0 / ue8m0 exponents as ``2 ** (s - 127)``."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    *lead, n, k = w.shape
    if k % group:
        raise ValueError(f"K={k} must be a multiple of {group} for this format")
    return w.float().reshape(*lead, n, k // group, group)
