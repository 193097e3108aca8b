"""Triton helpers that dequantize weight tiles in registers (layouts: ``kernels.quant``).

Two decoders per format, chosen by the ``FAST`` constexpr:
- ``FAST`` (GPU): e2m1 -> bf16 by placing bits (inline PTX, about two instructions per value,
  below); float8_e4m3fn through the hardware conversion (needs sm_89+; via float32, since
  Triton's direct fp8 -> bf16 emits an sm_90-only cvt); e8m0 scales by a shift into the bf16
  exponent.
- portable (interpreter; fp8 on sm_80/86): integer bit operations into float16, then float32
  (e4m3 byte -> fp16 bits ``(b & 0x80) << 8 | (b & 0x7F) << 7`` times ``2**8``; e2m1 nibble ->
  fp16 bits ``(n & 0x8) << 12 | (n & 0x7) << 9`` times ``2**14``; e8m0 -> fp32 bits
  ``e << 23``).

fp4 tiles (both decoders, so the interpreter checks the same bookkeeping):
- come back in *paired column order*: within each 8 columns, ``0 4 1 5 2 6 3 7``. The fast
  decoder builds bf16 pairs from nibbles 16 bits apart in a 32-bit word (one multiply places a
  nibble's sign and magnitude bits at once); putting them back in order would cost a byte
  permute per pair. A dot product does not care about the order of K as long as both operands
  share it. The activations are stored in the same order (in memory, once: reordering a tile
  inside the GEMM would happen in every warp's MMA fragments): :func:`fp4_paired_source`,
  :func:`fp4_paired_position`.
- come back times ``2**-FP4_SHIFT``; the GEMM multiplies its float32 accumulator by
  ``2**FP4_SHIFT`` (exact). Placed e2m1 bits read as bf16 are ``2**-126`` times the value (the
  0.5 code lands on a bf16 subnormal, which bf16 multiplies keep), and a single bf16 factor per
  group must bring them back: ``2**(126 - FP4_SHIFT)`` times the group scale stays a normal
  bf16 for every e4m3 scale and for e8m0 bytes 65..191 (scales ``2**-62 .. 2**64``), and the
  scaled weights stay normal bf16. Outside that e8m0 range (no quantizer produces it) values
  under- or overflow; the portable decoder matches within it.
Weights arrive as uint8 views (fp8 tensors viewed as bytes). Two scales are left to the GEMM
kernels, which apply them to the float32 accumulator where they are exact and cheap: the fp8
block scale (uniform over a tile that sits inside one 128x128 block) and the nvfp4 global
scale.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Format codes passed to kernels as the ``FMT`` constexpr.
FMT_CODES = {"bf16": 0, "fp8_block": 1, "mxfp4": 2, "nvfp4": 3}
#: fp4 tiles are ``2**-FP4_SHIFT`` times the weights (module docstring).
FP4_SHIFT = 63
FP4_ACC_SCALE = tl.constexpr(2.0 ** FP4_SHIFT)
_FP4_TILE_SCALE = tl.constexpr(2.0 ** -FP4_SHIFT)
# e8m0 byte s -> bf16 bits of 2**(s - 127 + 126 - FP4_SHIFT): exponent field s + 126 - FP4_SHIFT.
_E8M0_BF16_BIAS = tl.constexpr(126 - FP4_SHIFT)
_E4M3_BF16_FACTOR = tl.constexpr(2.0 ** (126 - FP4_SHIFT))

# Four bytes = eight e2m1 values e0..e7 (element 2j in the low nibble of byte j, so nibble k is
# e_k) -> four bf16 pairs (e0, e4), (e1, e5), (e2, e6), (e3, e7) in $0..$3. For the pair of
# nibbles k and k + 4 (bits 4k.. and 4k + 16..), mask them, multiply by 2**a + 2**b to make two
# non-overlapping shifted copies (sign bit 3 -> 15 and 19 -> 31; magnitude bits 0..2 -> 6..8 and
# 16..18 -> 22..24), keep those bits. Nibbles 2, 3, 6, 7 go through the word shifted right by 8.
# The result is sign | e1 e0 m placed at the low exponent / top mantissa bits: 2**-126 times the
# e2m1 value (0.5 is the bf16 subnormal 0x0040).
_E2M1_PAIRS_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 t, y;
and.b32 t, $4, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 $0, t, 0x81C081C0;
and.b32 t, $4, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 $1, t, 0x81C081C0;
shr.u32 y, $4, 8;
and.b32 t, y, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 $2, t, 0x81C081C0;
and.b32 t, y, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 $3, t, 0x81C081C0;
}
""")


@triton.jit
def e4m3_to_f32(b):
    b16 = b.to(tl.uint16)
    bits = ((b16 & 0x80) << 8) | ((b16 & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def e2m1_to_f32(n):
    n16 = n.to(tl.uint16)
    bits = ((n16 & 0x8) << 12) | ((n16 & 0x7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_f32(e):
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_bf16(packed):
    """uint8 ``[BLOCK_N, B]`` -> bf16 ``[BLOCK_N, 2 * B]`` in paired order, ``2**-126`` times the
    values. Each group of four bytes yields (e0, e4, e1, e5) and (e2, e6, e3, e7) as two outputs,
    interleaved back per group (a register renaming, no data movement)."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    BYTES: tl.constexpr = packed.shape[1]
    first, last = tl.inline_asm_elementwise(_E2M1_PAIRS_TO_BF16_PTX, "=r,=r,=r,=r,r", [packed],
                                            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                            pack=4)
    first = tl.reshape(first, [BLOCK_N, BYTES // 4, 4])
    last = tl.reshape(last, [BLOCK_N, BYTES // 4, 4])
    both = tl.permute(tl.join(first, last), (0, 1, 3, 2))  # [BLOCK_N, BYTES // 4, 2, 4]
    return tl.reshape(both, [BLOCK_N, 2 * BYTES])


@triton.jit
def _pair_order(x):
    """Columns of ``x [M, K]`` (K a multiple of 8) in the order fp4 tiles come in: within each 8
    columns, ``0 4 1 5 2 6 3 7``."""
    M: tl.constexpr = x.shape[0]
    K: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, [M, K // 8, 2, 4]), (0, 1, 3, 2)), [M, K])


@triton.jit
def fp4_paired_source(i):
    """The natural column found at column ``i`` of paired order."""
    r = i % 8
    return i - r + (r % 2) * 4 + r // 2


@triton.jit
def fp4_paired_position(n):
    """The column of paired order that natural column ``n`` goes to."""
    r = n % 8
    return n - r + (r % 4) * 2 + r // 4


@triton.jit
def fp8_row_scale(s_ptr, rows, row_mask, k0, stride_sn, SCALE_UE8M0: tl.constexpr):
    """fp8_block scales ``[BLOCK_N]`` (float32) of ``rows`` in the 128-column block of ``k0``."""
    s = tl.load(s_ptr + (rows.to(tl.int64) // 128) * stride_sn + k0 // 128, mask=row_mask, other=0)
    if SCALE_UE8M0:
        return e8m0_to_f32(s)
    return s.to(tl.float32)


@triton.jit
def load_weight_tile(w_ptr, s_ptr, rows, row_mask, k0, K, stride_wn, stride_sn,
                     FMT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     FAST: tl.constexpr):
    """Rows ``rows [BLOCK_N]`` of one expert's weight ``[N, K]`` (``w_ptr``/``s_ptr`` already at
    the expert), columns ``k0 .. k0 + BLOCK_K``: a ``[BLOCK_N, BLOCK_K]`` tile, masked entries 0.
    Plain weights come back as stored; fp8_block without its block scale (bf16 when ``FAST``,
    else float32); fp4 formats with their group scales but without the nvfp4 global scale, in
    paired column order and times ``2**-FP4_SHIFT`` (bf16 when ``FAST``, else float32). fp4
    formats need ``BLOCK_K`` to be a multiple of their group."""
    rows64 = rows.to(tl.int64)
    if FMT == 2 or FMT == 3:
        tile = _load_fp4_tile(w_ptr, s_ptr, rows64, row_mask, k0, K, stride_wn, stride_sn, FMT,
                              BLOCK_K, EVEN_K, FAST)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask = row_mask[:, None]
        else:
            mask = row_mask[:, None] & (offs_k < K)[None, :]
        tile = tl.load(w_ptr + rows64[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
        if FMT == 1:
            if FAST:
                tile = tile.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
            else:
                tile = e4m3_to_f32(tile)
    return tile


@triton.jit
def _load_fp4_tile(w_ptr, s_ptr, rows64, row_mask, k0, K, stride_wn, stride_sn,
                   FMT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   FAST: tl.constexpr):
    GROUP: tl.constexpr = 32 if FMT == 2 else 16
    BLOCK_N: tl.constexpr = rows64.shape[0]
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    if EVEN_K:
        b_mask = row_mask[:, None]
        g_mask = row_mask[:, None]
    else:
        b_mask = row_mask[:, None] & (offs_b < K // 2)[None, :]
        g_mask = row_mask[:, None] & (offs_g < K // GROUP)[None, :]
    packed = tl.load(w_ptr + rows64[:, None] * stride_wn + offs_b[None, :], mask=b_mask,
                     other=0)  # [BLOCK_N, BLOCK_K // 2] uint8
    s = tl.load(s_ptr + rows64[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0)
    if FAST:
        values = _e2m1_to_bf16(packed)  # 2**-126 times the e2m1 values
        if FMT == 2:
            scale = ((s.to(tl.uint16) + _E8M0_BF16_BIAS) << 7).to(tl.bfloat16, bitcast=True)
        else:
            scale = (s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                     * _E4M3_BF16_FACTOR).to(tl.bfloat16)
    else:
        values = _pair_order(tl.reshape(tl.join(e2m1_to_f32(packed & 0xF),
                                                   e2m1_to_f32(packed >> 4)), [BLOCK_N, BLOCK_K]))
        if FMT == 2:
            scale = e8m0_to_f32(s) * _FP4_TILE_SCALE
        else:
            scale = e4m3_to_f32(s) * _FP4_TILE_SCALE
    grouped = tl.reshape(values, [BLOCK_N, BLOCK_K // GROUP, GROUP]) * scale[:, :, None]
    return tl.reshape(grouped, [BLOCK_N, BLOCK_K])
