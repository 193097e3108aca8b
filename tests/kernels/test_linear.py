"""Skinny linear (decode projections, optional fused SwiGLU prologue) against its reference."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref
from kernels.triton_linear import MAX_ROWS, linear_ref, linear_triton, skinny_linear
from tests.kernels.poison import poisoned_allocations

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    """float32 product of the activation as the unfused pair rounds it (SwiGLU in x's dtype)."""
    a = silu_and_mul_ref(x) if swiglu else x
    return torch.nn.functional.linear(a.float(), w.float(), None if b is None else b.float())


def _check(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    assert not out.isnan().any(), "unwritten or NaN outputs"
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert scale > 0.1, "reference must not be near zero"
    assert err <= 2e-2 * scale, (err, scale, k)


@pytest.mark.parametrize("rows", [1, 3, 16, 21])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_reference(rows: int, swiglu: bool, bias: bool) -> None:
    torch.manual_seed(rows)
    n, k = 40, 72  # neither a multiple of the tiles: masked edges in N and K
    x = torch.randn(rows, 2 * k if swiglu else k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16) if bias else None
    with poisoned_allocations():
        out = skinny_linear(x, w, b, swiglu=swiglu)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _check(out, _reference(x, w, b, swiglu), k)


def test_strided_rows_and_leading_dims() -> None:
    """x may be a row-strided view; linear_triton keeps leading dims."""
    torch.manual_seed(5)
    k, n = 64, 48
    base = torch.randn(4, 3 * k, device=DEVICE, dtype=torch.bfloat16)
    x = base[:, k:2 * k]  # stride(0) = 3k
    w = (torch.randn(n, k, device=DEVICE) / 8).to(torch.bfloat16)
    _check(skinny_linear(x, w), _reference(x, w, None, False), k)
    x3 = torch.randn(2, 3, k, device=DEVICE, dtype=torch.bfloat16)
    out = linear_triton(x3, w)
    assert out.shape == (2, 3, n)
    _check(out, _reference(x3, w, None, False), k)


def test_many_rows_go_to_the_matrix_product() -> None:
    """Above MAX_ROWS linear_triton computes with torch (and the Triton SwiGLU); same results."""
    torch.manual_seed(6)
    k, n = 32, 24
    x = torch.randn(MAX_ROWS + 5, 2 * k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / 6).to(torch.bfloat16)
    out = linear_triton(x, w, swiglu=True)
    torch.testing.assert_close(out.float(), linear_ref(x, w, swiglu=True).float(), rtol=2e-2, atol=2e-2)


def test_float32_activations_use_the_reference_path() -> None:
    x = torch.randn(2, 16, device=DEVICE)
    w = torch.randn(8, 16, device=DEVICE)
    torch.testing.assert_close(linear_triton(x, w), torch.nn.functional.linear(x, w))


def test_wrong_width_is_refused() -> None:
    x = torch.randn(1, 30, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(8, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="swiglu"):
        skinny_linear(x, w, swiglu=True)
    with pytest.raises(ValueError, match="columns"):
        skinny_linear(x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 8, 32])
@pytest.mark.parametrize("shape", [(6144, 4096, False), (4096, 4096, False), (24576, 4096, False),
                                   (4096, 12288, True)])
def test_gpu_decode_projections(rows: int, shape: tuple[int, int, bool]) -> None:
    """Qwen3-8B's projections at decode batch sizes, autotuned configs."""
    n, k, swiglu = shape
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    with poisoned_allocations():
        out = skinny_linear(x, w, swiglu=swiglu)
    _check(out, _reference(x, w, None, swiglu), k)
