"""Fused MoE: the Triton alignment against the sort-based one, and the Triton fused MoE for every
weight format against the reference on the dequantized weights (outputs and scratch buffers
poisoned)."""
from __future__ import annotations

import pytest
import torch

from kernels.moe import fused_moe_ref, max_aligned_blocks, moe_align_ref
from kernels.quant import QuantizedWeight, dequantize, quantize
from kernels.triton_moe import fused_moe_triton, moe_align
from kernels.triton_moe_align import moe_align_and_pair, paired_columns
from tests.kernels.poison import poisoned_allocations

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _routing(num_tokens: int, top_k: int, num_experts: int,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g).softmax(-1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 1, 4, 16), (5, 2, 6, 16), (40, 3, 7, 16), (70, 2, 3, 64), (3, 4, 200, 16), (33, 6, 256, 32)])
def test_align_matches_reference(num_tokens: int, top_k: int, num_experts: int,
                                 block_m: int) -> None:
    _, ids = _routing(num_tokens, top_k, num_experts)
    ref = moe_align_ref(ids, num_experts, block_m)
    with poisoned_allocations():
        out = moe_align(ids, num_experts, block_m)
    for name, a, b in zip(("sorted_ids", "expert_ids", "num_padded"), out, ref):
        assert torch.equal(a.cpu(), b.cpu()), name


def test_align_contract() -> None:
    num_tokens, top_k, num_experts, block_m = 37, 3, 9, 16
    _, ids = _routing(num_tokens, top_k, num_experts, seed=1)
    sorted_ids, expert_ids, num_padded = (t.cpu() for t in moe_align_ref(ids, num_experts, block_m))
    pairs = num_tokens * top_k
    assert sorted_ids.numel() == max_aligned_blocks(pairs, num_experts, block_m) * block_m
    used = sorted_ids[: int(num_padded)]
    assert sorted(used[used < pairs].tolist()) == list(range(pairs))  # every pair once
    flat = ids.flatten().cpu()
    for b in range(int(num_padded) // block_m):
        rows = used[b * block_m:(b + 1) * block_m]
        rows = rows[rows < pairs]
        assert (flat[rows.long()] == expert_ids[b]).all()
    assert (expert_ids[int(num_padded) // block_m:] == -1).all()


def _weights(fmt: str, num_experts: int, hidden: int, inter: int, seed: int,
             fp8_scale: str = "float32") -> tuple[object, object]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    if fmt == "fp32":
        return w13.to(DEVICE), w2.to(DEVICE)
    if fmt == "bf16_tensor":
        return w13.to(DEVICE, torch.bfloat16), w2.to(DEVICE, torch.bfloat16)
    return (quantize(w13.to(DEVICE), fmt, fp8_scale=fp8_scale),
            quantize(w2.to(DEVICE), fmt, fp8_scale=fp8_scale))


def _check_moe(x: torch.Tensor, w13: object, w2: object, weights: torch.Tensor, ids: torch.Tensor,
               clamp: float | None) -> None:
    ref = fused_moe_ref(x.float(), dequantize(w13), dequantize(w2), weights, ids, clamp)  # type: ignore[arg-type]
    with poisoned_allocations():
        out = fused_moe_triton(x, w13, w2, weights, ids, clamp)  # type: ignore[arg-type]
    assert out.dtype == x.dtype and out.shape == x.shape
    assert not out.isnan().any(), "unwritten rows reached the output"
    err = (out.float() - ref).norm() / ref.norm()
    # bf16 / fp16 rounding of activations and outputs; float32 multiplies in float32 (GPU: FMA
    # order differs from the reference's)
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(x.dtype, 1e-4 if ON_GPU else 1e-5)
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("fmt,fp8_scale", [("fp32", "float32"), ("bf16_tensor", "float32"),
                                           ("bf16", "float32"), ("fp8_block", "float32"),
                                           ("fp8_block", "ue8m0"), ("mxfp4", "float32"),
                                           ("nvfp4", "float32")])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_formats(fmt: str, fp8_scale: str, x_dtype: torch.dtype) -> None:
    num_experts, hidden, inter, num_tokens, top_k = 5, 128, 64, 7, 2
    w13, w2 = _weights(fmt, num_experts, hidden, inter, seed=2, fp8_scale=fp8_scale)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=3)
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(x_dtype)
    _check_moe(x, w13, w2, weights, ids, clamp=None)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "mxfp4", "nvfp4"])
def test_fused_moe_clamp_partial_blocks_and_big_expert_blocks(fmt: str) -> None:
    """Clamped SwiGLU, K not a multiple of the tile (fp8 blocks partial), many tokens per expert
    (64-row expert blocks)."""
    num_experts, num_tokens, top_k = 2, 70, 2
    hidden, inter = (96, 64) if fmt == "mxfp4" else (80, 48)  # K % 32 != 0 where allowed
    w13, w2 = _weights(fmt, num_experts, hidden, inter, seed=4)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=5)
    x = 3 * torch.randn(num_tokens, hidden, device=DEVICE)
    _check_moe(x, w13, w2, weights, ids, clamp=0.5)


@pytest.mark.parametrize("fmt13,fmt2", [("fp8_block", "mxfp4"), ("nvfp4", "bf16"),
                                         ("mxfp4", "nvfp4")])
def test_fused_moe_mixed_formats(fmt13: str, fmt2: str) -> None:
    """w13 and w2 in different formats: the paired column order of fp4 GEMM activations (x for
    w13, act for w2) follows each GEMM's own format."""
    num_experts, hidden, inter, num_tokens, top_k = 4, 128, 64, 5, 2
    w13, _ = _weights(fmt13, num_experts, hidden, inter, seed=10)
    _, w2 = _weights(fmt2, num_experts, hidden, inter, seed=11)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=12)
    x = torch.randn(num_tokens, hidden + 8, device=DEVICE)[:, :hidden]  # strided rows
    _check_moe(x, w13, w2, weights, ids, clamp=None)


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_align_launch_writes_paired_activations(num_tokens: int) -> None:
    """The alignment launch's copy of x in paired column order (within each 8 columns:
    0 4 1 5 2 6 3 7), rows strided, poisoned output."""
    hidden = 48
    x = torch.randn(num_tokens, hidden + 16, device=DEVICE)[:, :hidden]
    _, ids = _routing(num_tokens, 2, 8, seed=13)
    expected = x[:, [8 * (c // 8) + [0, 4, 1, 5, 2, 6, 3, 7][c % 8] for c in range(hidden)]]
    assert torch.equal(paired_columns(x), expected)
    with poisoned_allocations():
        *aligned, x_paired = moe_align_and_pair(ids, 8, 16, x)
    assert x_paired is not None and torch.equal(x_paired, expected)
    for a, b in zip(aligned, moe_align_ref(ids, 8, 16)):
        assert torch.equal(a.cpu(), b.cpu())


def test_nvfp4_single_global_scale_and_expert_slices() -> None:
    """A QuantizedWeight built by a loader from per-expert tensors: stacked data, one scalar
    global scale for the whole stack."""
    num_experts, hidden, inter = 3, 64, 32
    w13, w2 = _weights("nvfp4", num_experts, hidden, inter, seed=6)
    assert isinstance(w13, QuantizedWeight) and isinstance(w2, QuantizedWeight)
    assert w13.global_scale is not None and w13.global_scale.shape == (num_experts,)
    shared = QuantizedWeight("nvfp4", w13.data, w13.scale, w13.global_scale.max())
    weights, ids = _routing(4, 2, num_experts, seed=7)
    x = torch.randn(4, hidden, device=DEVICE)
    _check_moe(x, shared, w2, weights, ids, clamp=None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_gpu_real_shapes(fmt: str, num_tokens: int) -> None:
    num_experts, hidden, inter, top_k = 32, 4096, 2048, 6
    w13, w2 = _weights(fmt, num_experts, hidden, inter, seed=8)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=9)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    _check_moe(x, w13, w2, weights, ids, clamp=7.0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_float32_and_float16_activations(fmt: str, dtype: torch.dtype, num_tokens: int = 13) -> None:
    """Models run in float32 or float16 on the GPU too: the fp4 tiles' scaled values are below
    float16's range and float32 must not be rounded to tensor-float32, so these dtypes multiply
    in float32 (small DeepSeek-V4 test shapes, and a clamp)."""
    num_experts, hidden, inter, top_k = 8, 64, 32, 2
    w13, w2 = _weights(fmt, num_experts, hidden, inter, seed=10)
    if fmt == "fp32":  # plain weights in the activations' dtype
        w13, w2 = w13.to(dtype), w2.to(dtype)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=11)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    _check_moe(x, w13, w2, weights, ids, clamp=7.0)
