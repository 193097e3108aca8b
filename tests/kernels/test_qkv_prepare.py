"""The fused attention-input kernel (norms, rotary, KV write) against its reference, on random
inputs with poisoned outputs: with and without per-head norms, neox and interleaved rotary, padded
slots, strided paged caches."""
from __future__ import annotations

import pytest
import torch

from kernels.qkv_prepare import qkv_prepare_ref
from kernels.rotary import rope_cos_sin, rope_inv_freq
from kernels.triton_qkv_prepare import qkv_prepare_triton

ON_GPU = torch.cuda.is_available()


def make_case(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, t: int, rot: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    cos, sin = rope_cos_sin(rope_inv_freq(rot, 10000.0), torch.randint(0, 500, (t,), generator=gen))
    storage = torch.full((9, 3, 2, 4, hkv, d), float("nan"), dtype=dtype)  # [blocks, layers, k/v, page, H, D]
    slots = torch.randperm(36, generator=gen)[:t].to(torch.int64)
    slots[0] = -1  # a padding row writes nothing
    norms = (torch.rand(d, generator=gen) + 0.5).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype)
    return qkv, cos.to(device), sin.to(device), storage.to(device), slots.to(device), [n.to(device) for n in norms]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 12])
def test_matches_reference_on_cpu(norm, interleaved, rot):
    hq, hkv, d, t = 4, 2, 16, 5
    qkv, cos, sin, storage, slots, (qn, kn) = make_case("cpu", torch.float32, hq, hkv, d, t, rot)
    ref_store, got_store = storage.clone(), storage.clone()
    kwargs = dict(q_norm=qn if norm else None, k_norm=kn if norm else None, eps=1e-6, interleaved=interleaved)
    ref = qkv_prepare_ref(qkv, hq, hkv, d, cos, sin, ref_store[:, 1, 0], ref_store[:, 1, 1], slots, **kwargs)
    got = qkv_prepare_triton(qkv, hq, hkv, d, cos, sin, got_store[:, 1, 0], got_store[:, 1, 1], slots, **kwargs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_store, ref_store, rtol=1e-5, atol=1e-5, equal_nan=True)
    written = got_store[:, 1].isnan().logical_not().sum().item()
    assert written == 2 * (t - 1) * hkv * d  # every real slot, k and v; the padding row none


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("norm", [True, False])
def test_matches_reference_on_gpu_bf16(norm):
    hq, hkv, d, t = 32, 8, 128, 37
    qkv, cos, sin, storage, slots, (qn, kn) = make_case("cuda", torch.bfloat16, hq, hkv, d, t, 128)
    storage = torch.full((64, 3, 2, 16, hkv, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:t]
    ref_store, got_store = storage.clone(), storage.clone()
    kwargs = dict(q_norm=qn if norm else None, k_norm=kn if norm else None)
    ref = qkv_prepare_ref(qkv, hq, hkv, d, cos, sin, ref_store[:, 2, 0], ref_store[:, 2, 1], slots, **kwargs)
    got = qkv_prepare_triton(qkv, hq, hkv, d, cos, sin, got_store[:, 2, 0], got_store[:, 2, 1], slots, **kwargs)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_store, ref_store, rtol=2e-2, atol=2e-2, equal_nan=True)
