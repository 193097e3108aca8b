"""Triton RMSNorm (+ residual), rotary embedding and SwiGLU against their references."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rope_cos_sin, rope_inv_freq
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_norm import rms_norm_triton
from kernels.triton_rotary import apply_rotary_triton

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any()
    tol = 1e-5 if ref.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm(dtype: torch.dtype, with_residual: bool, hidden: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    res = torch.randn_like(x) if with_residual else None
    ref, ref_res = rms_norm_ref(x, w, 1e-6, res)
    out, out_res = rms_norm_triton(x, w, 1e-6, res)
    _close(out, ref)
    if with_residual:
        assert ref_res is not None and out_res is not None
        _close(out_res, ref_res)
    else:
        assert out_res is None


@pytest.mark.gpu  # the GPU gate runs it compiled too (and on the CPU through the interpreter)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_out_dtype_rounds_the_float32_product_once(with_residual: bool) -> None:
    """DeepSeek-V4's norms: bf16 rows, a float32 weight. ``out_dtype=bf16`` writes exactly what
    casting the float32 product would (one rounding, no copy kernel), in every implementation."""
    from kernels import cpu_native
    torch.manual_seed(3)
    x = torch.randn(6, 4096, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(4096, device=DEVICE)
    res = torch.randn_like(x) if with_residual else None
    impls = [rms_norm_ref, rms_norm_triton] + ([cpu_native.rms_norm] if DEVICE == "cpu" else [])
    for impl in impls:
        wide, wide_res = impl(x, w, 1e-6, res)
        narrow, narrow_res = impl(x, w, 1e-6, res, out_dtype=torch.bfloat16)
        assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
        if impl is rms_norm_triton and not ON_GPU:  # the interpreter truncates bf16 casts: one ulp
            torch.testing.assert_close(narrow, wide.to(torch.bfloat16), rtol=2 ** -7, atol=0)
        else:  # compiled, Triton's float downcasts round to nearest even, as torch's
            assert torch.equal(narrow, wide.to(torch.bfloat16)), impl.__name__
        assert (narrow_res is None) == (res is None) and (res is None or torch.equal(narrow_res, wide_res))
    _close(rms_norm_triton(x, w, 1e-6, res, out_dtype=torch.bfloat16)[0],
           rms_norm_ref(x, w, 1e-6, res, out_dtype=torch.bfloat16)[0])


def test_rms_norm_per_head_strided() -> None:
    """Qwen3's q/k norm: normalize each head of a strided ``[T, H, D]`` view."""
    torch.manual_seed(1)
    qkv = torch.randn(7, 6, 32, device=DEVICE)
    q = qkv[:, :4]
    w = torch.randn(32, device=DEVICE)
    _close(rms_norm_triton(q, w, 1e-5)[0], rms_norm_ref(q, w, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16, 12])
def test_rotary(dtype: torch.dtype, interleaved: bool, rotary_dim: int) -> None:
    torch.manual_seed(2)
    head_dim, heads = 32, 3
    fused = torch.randn(9, heads + 2, head_dim, device=DEVICE).to(dtype)
    x = fused[:, 1:1 + heads]  # a strided view, as q out of a fused projection
    positions = torch.randint(0, 4000, (9,), device=DEVICE)
    cos, sin = rope_cos_sin(rope_inv_freq(rotary_dim, 10000.0), positions)
    _close(apply_rotary_triton(x, cos, sin, interleaved), apply_rotary_ref(x, cos, sin, interleaved))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clamp", [None, 0.7])
def test_silu_and_mul(dtype: torch.dtype, clamp: float | None) -> None:
    torch.manual_seed(3)
    x = (2 * torch.randn(3, 4, 2 * 48, device=DEVICE)).to(dtype)
    _close(silu_and_mul_triton(x, clamp), silu_and_mul_ref(x, clamp))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_real_shapes() -> None:
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    _close(rms_norm_triton(x, w, 1e-6, res)[0], rms_norm_ref(x, w, 1e-6, res)[0])
    q = torch.randn(512, 32, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(rope_inv_freq(128, 5e5), torch.arange(512, device="cuda"))
    _close(apply_rotary_triton(q, cos, sin), apply_rotary_ref(q, cos, sin))
    h = torch.randn(512, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    _close(silu_and_mul_triton(h, 10.0), silu_and_mul_ref(h, 10.0))
