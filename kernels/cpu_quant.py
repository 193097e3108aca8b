"""Weight-only quantized matmuls on the CPU: what keeps a GGUF file's 4- and 8-bit weights
quantized in memory, so a decode step reads about 0.6 bytes per weight instead of 4.

- ``Q4Weight``: 4-bit weights in groups of ``group_size`` along the input dimension, each group
  with a scale and a minimum (llama.cpp's Q4_1: ``w = d * q + m``, ``q`` in 0..15), repacked once
  at load for torch's CPU int4 kernel (``torch._weight_int4pack_mm_for_cpu``, AVX-512 / AVX2).
  Its convention is ``w = (q - 8) * scale + zero``, so ``scale = d`` and ``zero = m + 8 d``: the
  4-bit codes are kept exactly; the scale and zero are stored in bfloat16 (the kernel's dtype).
- ``Q8Weight``: 8-bit weights with one scale per output row (``torch._weight_int8pack_mm``),
  for the logits projection of a file whose embedding is already quantized (Q8_0: one scale
  per 32 weights; repacking to one per row rounds each weight again, by at most half a step of
  its row's scale).

Both kernels take bfloat16 activations and return bfloat16; the callers here convert from and
back to the model's float32 at the boundary, so everything else (norms, attention, residuals)
stays float32.

Where ``kernels.cpu_native`` runs (x86-64 with AVX2 and a C compiler), a weight also keeps its
file's blocks (``native``: Q4_1 with float16 scales and minimums, Q8_0 for the logits) and few-row
calls take the native kernel instead (float32 in and out, activations rounded to 16 bits per block
of 32; about 2x faster than the int4 kernel at one row on an AVX2 core, and closer to float32).
Its ``dense`` copy is then the blocks' exact float32, fed the same rounded activations, so a
many-row GEMM computes the native kernel's numbers up to the order of its sums: a request's tokens
do not depend on how many rows share its step. Where the native VNNI kernel runs (AVX-512 VNNI), it
takes every row count and no dense copy is kept: the same numbers whatever the rows, bit for bit.

Both kernels cost about one pass over the weight per 4-8 rows of activations (their time grows
with the rows: 12x from 1 to 32 rows for a [3072, 576] projection on this machine's AVX-512 core),
while a bfloat16 GEMM over the dequantized weight costs about the same from 4 rows to 32 (oneDNN).
So a weight may also carry ``dense``, its bfloat16 dequantization, used from ``DENSE_FROM_ROWS``
rows of activations on (batched decode, prefill chunks, verify batches of several requests);
fewer rows read the 4-bit codes. Where oneDNN has no native bfloat16 GEMM (no AVX-512 BF16 or
AMX: ``dense_dtype``), ``dense`` is float32 instead, fed the same bfloat16-rounded activations
and rounded back to bfloat16, from more rows (``dense_from_rows``): an emulated bfloat16 GEMM
there is slower than the int4 kernel (gate_up [3072, 576] at 256 rows on an AVX2 core: 45 ms,
against 11 ms int4 and 5.7 ms float32; cpu-linear-2026-12-04-avx2.json). The crossovers are
measured by bench/cpu_linear.py. The references (``*_ref``) dequantize to float32 and multiply
as ``F.linear``, for tests.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.activation import silu_and_mul_ref

GROUP_SIZE = 32
#: Rows of activations from which a weight's bfloat16 ``dense`` copy is faster than the int4
#: kernel (bench/cpu_linear.py on an AVX-512 BF16 core: a tie at 8 rows for SmolLM2's
#: projections, 2x faster at 16) ...
DENSE_FROM_ROWS = 9
#: ... and than the int8 logits kernel (1.4x faster at 8 rows, 3.6x at 32).
DENSE_LOGITS_FROM_ROWS = 8
#: The same for a float32 ``dense`` copy (no native bfloat16 GEMM; cpu-linear-2026-12-04-avx2.json:
#: a tie with the int4 kernel at about 14 rows, the int8 logits kernel's at about 28).
FLOAT32_DENSE_FROM_ROWS = 16
FLOAT32_DENSE_LOGITS_FROM_ROWS = 32
#: The same against the native kernels (cpu-linear-2026-12-05-avx2-native.json, an AVX2 core: the
#: native Q4_1 kernel is ahead of the float32 GEMM fed its rounded activations up to 16 rows, level
#: at 32 and behind at 64; the native Q8_0 logits are 1.2x ahead at 64 rows, 1.1x behind at 128).
NATIVE_DENSE_FROM_ROWS = 32
NATIVE_DENSE_LOGITS_FROM_ROWS = 96


def native_bfloat16_gemm() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (AVX-512 BF16, AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of a weight's ``dense`` copy: bfloat16 where oneDNN multiplies bfloat16 natively,
    else float32 (see the module docstring)."""
    return torch.bfloat16 if native_bfloat16_gemm() else torch.float32


def dense_from_rows(native: bool = False) -> int:
    """Rows of activations from which a projection takes its ``dense`` copy (its dtype's crossover,
    or the native kernel's where the weight keeps its blocks)."""
    if native:
        return NATIVE_DENSE_FROM_ROWS
    return DENSE_FROM_ROWS if dense_dtype() is torch.bfloat16 else FLOAT32_DENSE_FROM_ROWS


def dense_logits_from_rows(native: bool = False) -> int:
    """Rows from which the logits projection takes its ``dense`` copy."""
    if native:
        return NATIVE_DENSE_LOGITS_FROM_ROWS
    return DENSE_LOGITS_FROM_ROWS if dense_dtype() is torch.bfloat16 else FLOAT32_DENSE_LOGITS_FROM_ROWS


def dense_linear(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 times ``dense``'s transpose, in ``dense``'s dtype, rounded to
    bfloat16 (a bfloat16 GEMM's result, whichever dtype computes it)."""
    return F.linear(x.to(torch.bfloat16).to(dense.dtype), dense).to(torch.bfloat16)


def int4_cpu_available() -> bool:
    """Whether this torch build has the CPU int4 and int8 weight-only kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass(frozen=True)
class Q4Weight:
    packed: torch.Tensor        # torch._convert_weight_to_int4pack_for_cpu of the [N, K] codes
    scales_zeros: torch.Tensor  # [K / group, N, 2] bfloat16: (scale, zero)
    group_size: int
    out_features: int
    in_features: int
    #: The weight dequantized to bfloat16 ``[N, K]`` (for ``DENSE_FROM_ROWS`` rows and more), or None.
    dense: torch.Tensor | None = None
    #: The file's Q4_1 blocks for ``cpu_native`` (float16 scales and minimums, GGUF's own), which
    #: then takes the rows below ``dense_from_rows()`` instead of the int4 kernel; or None.
    native: cpu_native.NativeBlocks | None = None

    @property
    def nbytes(self) -> int:
        """Bytes a few-row call reads: the native blocks where kept, else the int4 codes and scales."""
        if self.native is not None:
            return self.native.nbytes
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


@dataclass(frozen=True)
class Q8Weight:
    codes: torch.Tensor   # [N, K] int8
    scales: torch.Tensor  # [N] bfloat16
    #: The weight dequantized to bfloat16 (for ``DENSE_LOGITS_FROM_ROWS`` rows and more), or None.
    dense: torch.Tensor | None = None
    #: Q8_0 blocks for ``cpu_native`` (one float16 scale per 32 weights: a Q8_0 file's embedding
    #: exactly), which then takes the rows below ``dense_logits_from_rows()``; or None.
    native: cpu_native.NativeBlocks | None = None

    @property
    def nbytes(self) -> int:
        if self.native is not None:
            return self.native.nbytes
        return self.codes.numel() + self.scales.numel() * 2


def can_pack_q4(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    """Shapes the CPU int4 kernel takes: whole groups along K, K even, N a multiple of 16."""
    return in_features % group_size == 0 and in_features % 2 == 0 and out_features % 16 == 0


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
            group_size: int = GROUP_SIZE, dense: bool = False, native: bool = False) -> Q4Weight:
    """``codes [N, K]`` in 0..15, ``scale`` and ``minimum [N, K / group_size]``: the weight is
    ``scale * codes + minimum`` group by group (Q4_1's d and m). ``dense``: also keep the
    bfloat16 dequantization (from the same bfloat16 scales and zeros) for many-row calls.
    ``native``: also keep Q4_1 blocks (scales and minimums in float16) for ``cpu_native``, which
    few-row calls then take (needs ``group_size`` 32 and ``cpu_native.available()``)."""
    n, k = codes.shape
    if not can_pack_q4(n, k, group_size):
        raise ValueError(f"a [{n}, {k}] weight does not fit the CPU int4 kernel (group {group_size})")
    if scale.shape != (n, k // group_size) or minimum.shape != scale.shape:
        raise ValueError(f"scale/minimum must be [{n}, {k // group_size}], got {tuple(scale.shape)}")
    scale32, minimum32 = scale.float(), minimum.float()
    zero = minimum32 + 8 * scale32
    scales_zeros = torch.stack([scale32.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    weight = Q4Weight(packed, scales_zeros, group_size, n, k)
    if not native:
        dense_copy = (q4_dequantize_ref(codes, weight).to(torch.bfloat16).to(dense_dtype()).contiguous()
                      if dense else None)
        return Q4Weight(packed, scales_zeros, group_size, n, k, dense_copy)
    if group_size != cpu_native.QK:
        raise ValueError(f"the native kernel takes groups of {cpu_native.QK}, not {group_size}")
    blocks = cpu_native.pack_q4_1(codes, scale, minimum)
    # Beside the native kernel, the dense copy is the blocks' exact float32 (see ``q4_matmul``); the VNNI
    # kernel takes every row count (faster than the GEMM at 256 rows too), so it needs none.
    dense_copy = cpu_native.dequantize(blocks) if dense and blocks.vnni is None else None
    return Q4Weight(packed, scales_zeros, group_size, n, k, dense_copy, blocks)


def q4_dequantize_ref(codes: torch.Tensor, weight: Q4Weight) -> torch.Tensor:
    """The float32 weight ``weight`` holds (with its bfloat16 scales and zeros), from ``codes``."""
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    scale = weight.scales_zeros[..., 0].float().t()  # [N, K / g]
    zero = weight.scales_zeros[..., 1].float().t()
    grouped = codes.float().reshape(n, k // g, g)
    return ((grouped - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


def q4_matmul(x: torch.Tensor, weight: Q4Weight, dense: bool | None = None) -> torch.Tensor:
    """``x [T, K]`` (any float dtype) times ``weight``'s transpose -> ``[T, N]``: the bfloat16 GEMM
    over ``weight.dense`` when it exists and ``dense`` says so (None: from ``dense_from_rows()`` rows
    on), else the native Q4_1 kernel where the weight keeps its blocks (float32 out), else torch's
    int4 kernel (bfloat16 out, its own dtype)."""
    native = weight.native is not None
    if weight.dense is not None and (dense or (dense is None and x.shape[0] >= dense_from_rows(native))):
        if native:  # the native kernel's numbers, summed by a float32 GEMM
            return F.linear(cpu_native.round_activations(x), weight.dense)
        return dense_linear(x, weight.dense)
    if weight.native is not None:
        return cpu_native.matmul(x, weight.native)
    return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), weight.packed, weight.group_size,
                                             weight.scales_zeros)


def linear_q4(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None, *,
              gated: bool = False, dense: bool | None = None) -> torch.Tensor:
    """``x [T, K]`` (any float dtype) -> ``[T, N]`` in ``x``'s dtype; ``gated``: the weight is
    ``[gate; up]`` and the result ``silu(gate) * up``. ``dense``: take the bfloat16 GEMM whatever
    the rows (None: from ``dense_from_rows()`` rows on)."""
    y = q4_matmul(x, weight, dense).to(x.dtype)
    if bias is not None:
        y = y + bias
    return silu_and_mul_ref(y) if gated else y


def pack_q8_rows(weight: torch.Tensor, dense: bool = False, native: bool = False) -> Q8Weight:
    """``weight [N, K]`` as int8 codes with one scale per row (max |w| / 127); ``dense``: also
    keep their bfloat16 dequantization for many-row calls; ``native``: also keep Q8_0 blocks of
    ``weight`` itself (a scale per 32) for ``cpu_native``, which few-row calls then take."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    scale_bf16 = scale.to(torch.bfloat16)
    codes = (w / scale_bf16.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    q8 = Q8Weight(codes.contiguous(), scale_bf16.contiguous())
    if not native:
        dense_copy = q8_dequantize_ref(q8).to(torch.bfloat16).to(dense_dtype()).contiguous() if dense else None
        return Q8Weight(q8.codes, q8.scales, dense_copy)
    blocks = cpu_native.pack_q8_0(w)
    return Q8Weight(q8.codes, q8.scales, cpu_native.dequantize(blocks) if dense and blocks.vnni is None else None,
                    blocks)


def q8_dequantize_ref(weight: Q8Weight) -> torch.Tensor:
    return weight.codes.float() * weight.scales.float()[:, None]


def linear_q8(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """``x [T, K]`` -> ``[T, N]`` in ``x``'s dtype."""
    if weight.dense is not None and x.shape[0] >= dense_logits_from_rows(weight.native is not None):
        if weight.native is not None:
            return F.linear(cpu_native.round_activations(x), weight.dense).to(x.dtype)
        return dense_linear(x, weight.dense).to(x.dtype)
    if weight.native is not None:
        return cpu_native.matmul(x, weight.native).to(x.dtype)
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), weight.codes, weight.scales).to(x.dtype)


def linear_q4_ref(x: torch.Tensor, codes: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None,
                  *, gated: bool = False) -> torch.Tensor:
    """``linear_q4`` in float32 from the dequantized weight (activations rounded to bfloat16 as
    the kernel takes them)."""
    y = F.linear(x.to(torch.bfloat16).float(), q4_dequantize_ref(codes, weight), None if bias is None else bias.float())
    return silu_and_mul_ref(y) if gated else y
