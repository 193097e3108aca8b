"""Quantized weight formats: documented layouts on hand-made bytes, quantize/dequantize round
trips, and the Triton in-register decoders against the torch dequantization for every byte."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.quant import (E2M1_VALUES, FORMATS, QuantizedWeight, dequantize, e2m1_to_float,
                           float_to_e2m1, pack_fp4, quantize, unpack_fp4)
from kernels.triton_quant import FMT_CODES, FP4_SHIFT, load_weight_tile
from kernels.triton_support import INTERPRET

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def test_e2m1_codes_and_nibble_order() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_to_float(codes)
    assert values[:8].tolist() == list(E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.equal(float_to_e2m1(values), torch.where(codes == 8, 0, codes))  # -0 -> +0
    packed = pack_fp4(codes)
    assert packed[0].item() == 0x10 and packed[1].item() == 0x32  # element 2j = low nibble
    assert torch.equal(unpack_fp4(packed), codes)


def test_mxfp4_layout_by_hand() -> None:
    data = torch.zeros(2, 32, dtype=torch.uint8)  # N=2 rows, K=64
    data[0, 0] = 0x21  # k=0 -> 0.5, k=1 -> 1.0
    data[1, 31] = 0xF7  # k=62 -> 6.0, k=63 -> -6.0
    scale = torch.tensor([[127, 128], [126, 125]], dtype=torch.uint8)  # [N, K // 32]
    w = dequantize(QuantizedWeight("mxfp4", data, scale))
    assert w.shape == (2, 64)
    assert w[0, :2].tolist() == [0.5, 1.0] and w[1, 62:].tolist() == [6.0 / 4, -6.0 / 4]
    assert w.abs().sum() == 0.5 + 1.0 + 3.0


def test_nvfp4_and_fp8_scales_by_hand() -> None:
    data = torch.full((1, 8), 0x22, dtype=torch.uint8)  # K=16, all 1.0
    scale = torch.tensor([[0.75]]).to(torch.float8_e4m3fn)
    w = dequantize(QuantizedWeight("nvfp4", data, scale, torch.tensor(2.0)))
    assert torch.all(w == 1.5)
    fp8 = torch.full((130, 130), 2.0).to(torch.float8_e4m3fn)
    ue8m0 = torch.tensor([[130, 126], [127, 0]], dtype=torch.uint8)  # 8, 0.5, 1, 2**-127
    w = dequantize(QuantizedWeight("fp8_block", fp8, ue8m0))
    assert w[0, 0] == 16 and w[127, 128] == 1 and w[128, 127] == 2 and w[129, 129] == 2 * 2.0 ** -127
    w = dequantize(QuantizedWeight("fp8_block", fp8, torch.tensor([[3.0, 1.0], [1.0, 1.0]])))
    assert w[127, 127] == 6 and w[127, 128] == 2


@pytest.mark.parametrize("fmt,fp8_scale,tol", [("bf16", "float32", 1e-2), ("fp8_block", "float32", 4e-2),
                                               ("fp8_block", "ue8m0", 4e-2), ("mxfp4", "float32", 0.16),
                                               ("nvfp4", "float32", 0.12)])
def test_round_trip(fmt: str, fp8_scale: str, tol: float) -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 160, 256) * torch.logspace(-2, 0, 256)  # varied magnitudes along K
    q = quantize(w, fmt, fp8_scale=fp8_scale)
    assert q.shape == w.shape and q.fmt == fmt
    d = dequantize(q)
    assert (d - w).norm() / w.norm() < tol
    again = dequantize(quantize(d, fmt, fp8_scale=fp8_scale))
    assert torch.equal(again, d)  # representable weights survive exactly
    assert torch.equal(dequantize(q.expert(1)), d[1])


def test_format_validation() -> None:
    with pytest.raises(ValueError, match="unknown weight format"):
        QuantizedWeight("int4", torch.zeros(1))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48), "mxfp4")
    assert FORMATS == ("bf16", "fp8_block", "mxfp4", "nvfp4")


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, FMT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    tile = load_weight_tile(w_ptr, s_ptr, rows, rows < N, k0, K, stride_wn, stride_sn, FMT,
                            BLOCK_K, True, FAST)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + offs_k[None, :], tile.to(tl.float32),
             mask=(rows < N)[:, None] & (offs_k < K)[None, :])


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("fast", [False, True])
def test_triton_decoders_cover_every_byte(fmt: str, fast: bool) -> None:
    """All 256 byte values (and scale bytes) through the in-register decoder. The tile leaves out
    the fp8 block scale and the nvfp4 global scale (applied on the accumulator); fp4 tiles come
    in paired column order (0 4 1 5 2 6 3 7 within each 8) and ``2**-FP4_SHIFT`` times the
    weights, exactly."""
    if fast and (INTERPRET or not ON_GPU):
        pytest.skip("the fast decoders (inline PTX, hardware fp8) need a GPU")
    if fast and fmt != "mxfp4" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("hardware e4m3 conversion needs sm_89+")
    n, k = 16, 512
    g = torch.Generator().manual_seed(0)
    if fmt == "fp8_block":
        raw = torch.arange(n * k, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, k)
        raw[raw == 0x7F] = 0  # NaN encodings are not weights
        raw[raw == 0xFF] = 0
        data, scale = raw, torch.ones(1, k // 128)
        expected = raw.view(torch.float8_e4m3fn).float()
    else:
        data = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, k // 2)
        if fmt == "mxfp4":
            scale = torch.randint(100, 150, (n, k // 32), dtype=torch.uint8, generator=g)
        else:
            scale = (torch.rand(n, k // 16, generator=g) * 4).to(torch.float8_e4m3fn)
        expected = dequantize(QuantizedWeight(fmt, data, scale, torch.tensor(1.0)))
        paired = expected.view(n, k // 8, 2, 4).transpose(-1, -2).reshape(n, k)
        expected = paired * 2.0 ** -FP4_SHIFT
    data, scale = data.to(DEVICE), scale.to(DEVICE)
    s = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    out = torch.full((n, k), float("nan"), device=DEVICE)
    _decode_kernel[(1, k // 64)](data, s, out, n, k, data.stride(0), s.stride(0),
                                 FMT=FMT_CODES[fmt], BLOCK_N=16, BLOCK_K=64, FAST=fast)
    assert torch.equal(out.cpu(), expected)
