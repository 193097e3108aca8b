"""Triton helpers that dequantize weight tiles in registers (layouts: ``kernels.quant``).

Two decoders per format, chosen by the ``FAST`` constexpr:
- ``FAST`` (GPU): e2m1 -> bf16 through a byte-permute lookup table in inline PTX (eight values
  in about twenty instructions, signs included); float8_e4m3fn through the hardware conversion
  (needs sm_89+; via float32, since Triton's direct fp8 -> bf16 emits an sm_90-only cvt); e8m0
  scales by a shift into the bf16 exponent. An e2m1 value times its e8m0
  or e4m3 group scale is exact in bf16.
- portable (interpreter; fp8 on sm_80/86): integer bit operations into float16, then float32
  (e4m3 byte -> fp16 bits ``(b & 0x80) << 8 | (b & 0x7F) << 7`` times ``2**8``; e2m1 nibble ->
  fp16 bits ``(n & 0x8) << 12 | (n & 0x7) << 9`` times ``2**14``; e8m0 -> fp32 bits
  ``e << 23``).
The e8m0 shift decodes exponent byte 0 as 0 (not 2**-127) and 255 as inf (not NaN); neither
occurs in quantized weights. Weights arrive as uint8 views (fp8 tensors viewed as bytes). Two
scales are left to the GEMM kernels, which apply them to the float32 accumulator where they are
exact and cheap: the fp8 block scale (uniform over a tile that sits inside one 128x128 block)
and the nvfp4 global scale.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Format codes passed to kernels as the ``FMT`` constexpr.
FMT_CODES = {"bf16": 0, "fp8_block": 1, "mxfp4": 2, "nvfp4": 3}

# Four bytes = eight e2m1 values e0..e7 (element 2j in the low nibble of byte j) -> bf16 pairs in
# K order: (e0, e1), (e2, e3) in $0, $1 (first output) and (e4, e5), (e6, e7) in $2, $3 (second).
# lt*/ht* are lookup tables of the low/high bytes of bf16(0, .5, 1, 1.5, 2, 3, 4, 6): prmt picks
# bytes by the 3-bit magnitude; the sign (bit 3 of a nibble) reaches bit 15 of its bf16 through
# prmt's sign-replicate mode (bit 7 of a byte: odd elements in x, even ones in x << 4).
_E2M1_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 x, m, m2, lt0, lt1, ht0, ht1, lb0, hb0, lb1, hb1, r4, s;
mov.b32 x, $4;
mov.b32 lt0, 0xC0800000;
mov.b32 lt1, 0xC0804000;
mov.b32 ht0, 0x3F3F3F00;
mov.b32 ht1, 0x40404040;
and.b32 m, x, 0x77777777;
shr.u32 m2, m, 16;
shl.b32 r4, x, 4;
prmt.b32 lb0, lt0, lt1, m;
prmt.b32 hb0, ht0, ht1, m;
prmt.b32 lb1, lt0, lt1, m2;
prmt.b32 hb1, ht0, ht1, m2;
prmt.b32 $0, lb0, hb0, 0x5140;
prmt.b32 s, r4, x, 0xC080;
lop3.b32 $0, $0, s, 0x80008000, 0xF8;
prmt.b32 $1, lb0, hb0, 0x7362;
prmt.b32 s, r4, x, 0xD090;
lop3.b32 $1, $1, s, 0x80008000, 0xF8;
prmt.b32 $2, lb1, hb1, 0x5140;
prmt.b32 s, r4, x, 0xE0A0;
lop3.b32 $2, $2, s, 0x80008000, 0xF8;
prmt.b32 $3, lb1, hb1, 0x7362;
prmt.b32 s, r4, x, 0xF0B0;
lop3.b32 $3, $3, s, 0x80008000, 0xF8;
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
    """uint8 ``[BLOCK_N, B]`` -> bf16 ``[BLOCK_N, 2 * B]``, element ``2j`` = low nibble of byte
    ``j``. Each group of four bytes yields its first and last four values as two outputs,
    interleaved back per group (a register renaming, no data movement)."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    BYTES: tl.constexpr = packed.shape[1]
    first, last = tl.inline_asm_elementwise(_E2M1_TO_BF16_PTX, "=r,=r,=r,=r,r", [packed],
                                            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                            pack=4)
    first = tl.reshape(first, [BLOCK_N, BYTES // 4, 4])
    last = tl.reshape(last, [BLOCK_N, BYTES // 4, 4])
    both = tl.permute(tl.join(first, last), (0, 1, 3, 2))  # [BLOCK_N, BYTES // 4, 2, 4]
    return tl.reshape(both, [BLOCK_N, 2 * BYTES])


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
    else float32); fp4 formats with their group scales but without the nvfp4 global scale (bf16
    when ``FAST``, else float32). fp4 formats need ``BLOCK_K`` to be a multiple of their group."""
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
        values = _e2m1_to_bf16(packed)
        if FMT == 2:
            scale = (s.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
        else:
            scale = s.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
    else:
        values = tl.reshape(tl.join(e2m1_to_f32(packed & 0xF), e2m1_to_f32(packed >> 4)),
                            [BLOCK_N, BLOCK_K])
        if FMT == 2:
            scale = e8m0_to_f32(s)
        else:
            scale = e4m3_to_f32(s)
    grouped = tl.reshape(values, [BLOCK_N, BLOCK_K // GROUP, GROUP]) * scale[:, :, None]
    return tl.reshape(grouped, [BLOCK_N, BLOCK_K])
