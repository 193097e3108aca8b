"""Skinny linear (decode projections; gated: SwiGLU of a fused [gate; up] projection) against its
reference."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref
from kernels.linear import linear_ref
from kernels.triton_linear import MAX_ROWS, linear_triton, skinny_linear
from tests.kernels.poison import poisoned_allocations

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """The float32 product; gated: rounded to x's dtype and through SwiGLU as the unfused pair runs."""
    y = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    return silu_and_mul_ref(y.to(x.dtype)).float() if gated else y


def _check(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    assert not out.isnan().any(), "unwritten or NaN outputs"
    scale = ref.abs().max().item()
    assert scale > 0.1, "reference must not be near zero"
    # a few bf16 steps: the kernel sums in another order, and a gated output inherits the
    # rounding of its gate and up values
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=1e-2 * scale, msg=f"K={k}")


@pytest.mark.parametrize("rows", [1, 3, 16, 21])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_reference(rows: int, gated: bool, bias: bool) -> None:
    torch.manual_seed(rows)
    n, k = 40, 72  # neither a multiple of the tiles: masked edges in N and K
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(2 * n if gated else n, k, device=DEVICE) / k ** 0.5 * 2).to(torch.bfloat16)
    b = torch.randn(w.shape[0], device=DEVICE, dtype=torch.bfloat16) if bias else None
    with poisoned_allocations():
        out = skinny_linear(x, w, b, gated=gated)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _check(out, _reference(x, w, b, gated), k)


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


@pytest.mark.parametrize("rows", [3, MAX_ROWS + 5])
def test_linear_triton_matches_linear_ref(rows: int) -> None:
    """The op as models call it: the kernel up to MAX_ROWS rows, torch (and the Triton SwiGLU)
    above; both agree with the reference."""
    torch.manual_seed(6)
    k, n = 32, 24
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(2 * n, k, device=DEVICE) / 3).to(torch.bfloat16)
    out = linear_triton(x, w, gated=True)
    assert out.shape == (rows, n)
    _check(out, linear_ref(x, w, gated=True).float(), k)


def test_float32_activations_use_the_reference_path() -> None:
    x = torch.randn(2, 16, device=DEVICE)
    w = torch.randn(8, 16, device=DEVICE)
    torch.testing.assert_close(linear_triton(x, w), torch.nn.functional.linear(x, w))


def test_wrong_shapes_are_refused() -> None:
    x = torch.randn(1, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="odd"):
        skinny_linear(x, torch.randn(7, 16, dtype=torch.bfloat16, device=DEVICE), gated=True)
    with pytest.raises(ValueError, match="columns"):
        skinny_linear(x, torch.randn(8, 30, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 8, 32])
@pytest.mark.parametrize("shape", [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True),
                                   (4096, 12288, False)])
def test_gpu_decode_projections(rows: int, shape: tuple[int, int, bool]) -> None:
    """Qwen3-8B's projections at decode batch sizes (gate/up gated), autotuned configs."""
    n, k, gated = shape
    torch.manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5 * 2).to(torch.bfloat16)
    with poisoned_allocations():
        out = skinny_linear(x, w, gated=gated)
    _check(out, _reference(x, w, None, gated), k)
