"""FusedRows: projections of one input as one GEMM, with each member's weight a view of it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cluster.models.layers import FusedRows, Linear


def _linears(*outs: int, k: int = 24, dtype: torch.dtype = torch.float64) -> list[Linear]:
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n in outs:
        layer = Linear(k, n, False, dtype)
        layer.weight.data.copy_(torch.randn(n, k, generator=gen, dtype=dtype))
        layers.append(layer)
    return layers


def test_members_become_views_and_products_match() -> None:
    layers = _linears(5, 7, 3)
    expected_weights = [layer.weight.detach().clone() for layer in layers]
    fused = FusedRows([(layer, "weight") for layer in layers])
    assert fused.active and fused.fused is not None and fused.fused.shape == (15, 24)
    for layer, w in zip(layers, expected_weights):
        assert torch.equal(layer.weight, w)  # the values survive the fusion
        assert layer.weight.untyped_storage().data_ptr() == fused.fused.untyped_storage().data_ptr()
    x = torch.randn(4, 24, dtype=torch.float64)
    outs = fused(x)
    assert [o.shape for o in outs] == [(4, 5), (4, 7), (4, 3)]
    for out, w in zip(outs, expected_weights):
        torch.testing.assert_close(out, x @ w.T, rtol=1e-12, atol=1e-12)
    # one product, sliced: a member's output has the fused row stride
    assert outs[1].stride(0) == 15


def test_loading_into_a_member_lands_in_the_fused_weight() -> None:
    layers = _linears(4, 6)
    fused = FusedRows([(layer, "weight") for layer in layers])
    new = torch.randn(6, 24, dtype=torch.float64)
    layers[1].weight.data.copy_(new)  # what the checkpoint loader does
    x = torch.randn(3, 24, dtype=torch.float64)
    torch.testing.assert_close(fused(x)[1], x @ new.T, rtol=1e-12, atol=1e-12)


def test_a_replaced_weight_is_fused_again() -> None:
    layers = _linears(4, 6)
    fused = FusedRows([(layer, "weight") for layer in layers])
    new = torch.randn(4, 24, dtype=torch.float64)
    layers[0].weight = nn.Parameter(new.clone(), requires_grad=False)  # no longer a view
    x = torch.randn(2, 24, dtype=torch.float64)
    out = fused(x)
    torch.testing.assert_close(out[0], x @ new.T, rtol=1e-12, atol=1e-12)
    assert fused.active and layers[0].weight.data_ptr() == fused.fused.data_ptr()


def test_groups_put_members_side_by_side() -> None:
    layers = _linears(2, 3, 3)
    fused = FusedRows([(layer, "weight") for layer in layers])
    x = torch.randn(5, 24, dtype=torch.float64)
    first, gate_up = fused(x, groups=[1, 2])
    torch.testing.assert_close(gate_up, torch.cat([layers[1](x), layers[2](x)], -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first, layers[0](x), rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError):
        fused(x, groups=[1, 1])


@pytest.mark.parametrize("why", ["bias", "dtype", "width"])
def test_members_that_cannot_share_a_gemm_keep_their_own(why: str) -> None:
    if why == "bias":
        a, b = Linear(8, 3, True, torch.float64), Linear(8, 4, False, torch.float64)
        a.bias.data.normal_()
    elif why == "dtype":
        a, b = Linear(8, 3, False, torch.float64), Linear(8, 4, False, torch.float32)
    else:
        a, b = Linear(8, 3, False, torch.float64), Linear(6, 4, False, torch.float64)
    for layer in (a, b):
        layer.weight.data.normal_()
    fused = FusedRows([(a, "weight"), (b, "weight")])
    assert not fused.active and fused.fused is None
    if why != "bias":
        return
    x = torch.randn(2, 8, dtype=torch.float64)
    out = fused(x.to(a.weight.dtype))
    torch.testing.assert_close(out[0], a(x.to(a.weight.dtype)))


def test_a_bare_parameter_member() -> None:
    """The MoE gate's weight is a module's parameter, not a Linear."""
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(3, 24, dtype=torch.float64), requires_grad=False)
    expected = holder.weight.detach().clone()
    (layer,) = _linears(5)
    fused = FusedRows([(holder, "weight"), (layer, "weight")])
    x = torch.randn(2, 24, dtype=torch.float64)
    gate, rest = fused(x)
    torch.testing.assert_close(gate, x @ expected.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rest, layer(x), rtol=1e-12, atol=1e-12)


def test_v4_kernel_table_reports_the_fused_projections() -> None:
    """CSA / HCA / sliding layers: the attention's projections of ``h`` (and, with an indexer, of
    the low-rank query), the gate's with the shared expert's; each a group, each reported."""
    from cluster.models.deepseek_v4 import build_deepseek_v4
    from tests.deepseek_factories import v4_config

    config = v4_config("csa_hca").to_dict()
    with torch.device("cpu"):
        model = build_deepseek_v4(config, torch.float32)
    (row,) = [r for r in model.kernel_choices() if r["component"] == "fused_projections"]
    from cluster.models.deepseek_v4_attention import DeepseekV4Attention
    from cluster.models.deepseek_v4_moe import DeepseekV4MoE
    attns = [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]
    moes = [m for m in model.modules() if isinstance(m, DeepseekV4MoE) and m.shared_experts is not None]
    groups = len(attns) + sum(a.indexer is not None for a in attns) + len(moes)
    assert len(attns) >= 4 and groups >= 10
    assert row["impl"] == "fused" and row["reason"].startswith(f"{groups} of {groups} groups"), row
    csa = model.layers[1].attn
    assert csa.h_proj.sizes == [csa.wq_a.out_features, csa.wkv.out_features,
                                *(2 * [csa.compressor.wkv.out_features]),
                                *(2 * [csa.indexer.compressor.wkv.out_features]), csa.indexer.num_heads]
    # a quantized-like change (a member replaced by a weight of another dtype) is reported
    csa.wkv.weight = nn.Parameter(csa.wkv.weight.detach().double(), requires_grad=False)
    (row,) = [r for r in model.kernel_choices() if r["component"] == "fused_projections"]
    assert row["impl"] == "partly fused" and row["reason"].startswith(f"{groups - 1} of {groups}"), row
