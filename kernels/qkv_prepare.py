"""Attention input preparation, pure-torch reference: from a fused QKV projection, optional
per-head RMSNorm of q and k (Qwen3), rotary embedding of q and k, and the write of k and v into
the paged KV cache; returns the prepared queries. One op, so the GPU path can be one kernel
instead of five small ones per layer."""
from __future__ import annotations

import torch

from kernels.attention import write_kv_cache
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref


def qkv_prepare_ref(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                    interleaved: bool = False) -> torch.Tensor:
    """``qkv [T, (Hq + 2 Hkv) * D]`` -> queries ``[T, Hq, D]`` (normed, rotated); k (normed,
    rotated) and v go to the cache at ``slot_mapping [T]`` (slots < 0 skipped). ``cos/sin
    [T, rot // 2]`` float32. The norms apply when their weights ``[D]`` are given."""
    t = qkv.shape[0]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    v = qkv[:, q_size + kv_size:].reshape(t, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        q = rms_norm_ref(q.reshape(t, num_q_heads, head_dim), q_norm, eps)[0]
        k = rms_norm_ref(k.reshape(t, num_kv_heads, head_dim), k_norm, eps)[0]
        q, k = apply_rotary_ref(q, cos, sin, interleaved), apply_rotary_ref(k, cos, sin, interleaved)
    else:  # q's and k's heads side by side: one rotation for both (each head's rows alike)
        qk = apply_rotary_ref(qkv[:, :q_size + kv_size].reshape(t, num_q_heads + num_kv_heads, head_dim), cos, sin,
                              interleaved)
        q, k = qk[:, :num_q_heads].contiguous(), qk[:, num_q_heads:]
    write_kv_cache(k_cache, v_cache, slot_mapping, k, v)
    return q
