"""Models call dense projections through ``ops.linear``: with the Triton linear (compiled on a GPU,
the interpreter on CPU) a projection and a SwiGLU MLP (gated gate/up projection, then down) give
the reference's results, for decode-sized batches (the Triton kernel) and larger ones (torch with
the Triton SwiGLU)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cluster.models.layers import GatedMLP, Linear
from cluster.models.ops import REFERENCE_OPS
from kernels.triton_linear import MAX_ROWS, linear_triton

TRITON_OPS = replace(REFERENCE_OPS, linear=linear_triton)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fill(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * (2 if p.dim() > 1 else 0.5))


@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS + 4])
def test_gated_mlp_with_the_triton_linear_matches_the_reference(rows: int) -> None:
    ref = GatedMLP(48, 40, bias=False, dtype=torch.bfloat16, ops=REFERENCE_OPS)
    tri = GatedMLP(48, 40, bias=False, dtype=torch.bfloat16, ops=TRITON_OPS)
    _fill(ref, 1)
    tri.load_state_dict(ref.state_dict())
    ref, tri = ref.to(DEVICE), tri.to(DEVICE)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEVICE)
    want, got = ref(x).float(), tri(x).float()
    assert not got.isnan().any() and want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=3e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("bias", [False, True])
def test_linear_module_passes_bias_and_leading_dims(bias: bool) -> None:
    ref = Linear(32, 24, bias, torch.bfloat16, REFERENCE_OPS)
    tri = Linear(32, 24, bias, torch.bfloat16, TRITON_OPS)
    _fill(ref, 2)
    tri.load_state_dict(ref.state_dict())
    ref, tri = ref.to(DEVICE), tri.to(DEVICE)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    want, got = ref(x).float(), tri(x).float()
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
