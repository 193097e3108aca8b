"""Triton top-k / top-p / min-p filter against the sort-based reference."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import apply_top_k_top_p_min_p_ref
from kernels.triton_sampling import apply_top_k_top_p_min_p_triton

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _filters(n: int, vocab: int) -> dict[str, torch.Tensor]:
    return {
        "top_k": torch.tensor([0, 1, 5, vocab, 37, -1, 2, 300][:n], device=DEVICE),
        "top_p": torch.tensor([1.0, 0.9, 0.5, 0.3, 0.999, 0.05, 1.0, 0.8][:n], device=DEVICE),
        "min_p": torch.tensor([0.0, 0.05, 0.0, 0.2, 0.01, 0.0, 0.5, 0.1][:n], device=DEVICE),
    }


@pytest.mark.parametrize("use", [("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p"),
                                 ("top_k", "top_p", "min_p")])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_filters_match_reference(use: tuple[str, ...], vocab: int) -> None:
    torch.manual_seed(0)
    n = 8
    logits = 3 * torch.randn(n, vocab, device=DEVICE)
    logits[3, :10] = float("-inf")  # already-masked tokens stay masked
    f = _filters(n, vocab)
    args = {name: (f[name] if name in use else None) for name in ("top_k", "top_p", "min_p")}
    ref = apply_top_k_top_p_min_p_ref(logits, **args)
    out = apply_top_k_top_p_min_p_triton(logits, **args)
    assert not out.isnan().any()
    if args["top_p"] is not None:
        # top_p == 1 means "off"; the reference's float32 cumsum can exceed 1 over a large
        # vocabulary and drop a few tail tokens there, so those rows expect no top-p at all.
        ref_off = apply_top_k_top_p_min_p_ref(logits, **dict(args, top_p=None))
        ref = torch.where((args["top_p"] >= 1.0)[:, None], ref_off, ref)
    assert torch.equal(out.isinf(), ref.isinf()), (out.isinf() != ref.isinf()).sum(-1)
    kept = ~ref.isinf()
    assert torch.equal(out[kept], ref[kept])


def test_no_filters_is_identity() -> None:
    logits = torch.randn(2, 10, device=DEVICE)
    assert apply_top_k_top_p_min_p_triton(logits, None, None, None) is logits


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_real_vocab() -> None:
    torch.manual_seed(1)
    logits = 4 * torch.randn(64, 151936, device="cuda")
    k = torch.randint(1, 100, (64,), device="cuda")  # full-vocab top-p: float cumsum ties
    p = torch.rand(64, device="cuda") * 0.5 + 0.5
    ref = apply_top_k_top_p_min_p_ref(logits, k, p, None)
    out = apply_top_k_top_p_min_p_triton(logits, k, p, None)
    assert torch.equal(out.isinf(), ref.isinf())
