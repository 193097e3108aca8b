"""Ops: the kernel behind every op a model calls, resolved once at start-up by kernels.dispatch
for the device, the weight formats and the override settings, then handed to the model when it is
built (layers keep a reference; nothing is looked up per call and nothing changes afterwards)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cluster.common.errors import UnsupportedSettingError
from kernels import dispatch
from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref, write_kv_cache
from kernels.deepseek_v4_ref import (compress_decode_paged_ref, compress_decode_ref, compress_store_ref, hc_post_ref,
                                     hc_pre_ref, indexer_topk_ref, norm_rope_ref, route_ref, sparse_attention_ref)
from kernels.linear import linear_ref
from kernels.moe import fused_moe_ref
from kernels.norm import rms_norm_ref
from kernels.qkv_prepare import qkv_prepare_ref
from kernels.rotary import apply_rotary_ref
from kernels.sampling import apply_top_k_top_p_min_p_ref
from kernels.spec_decode import accept_and_draft_rows_ref, verify_rows_ref

@dataclass(frozen=True)
class Ops:
    """The kernel of every op a model calls; its fields are those ``kernels.dispatch.OP_SPECS``
    names (tests/kernels/test_dispatch.py checks they match), each defaulting to the op's
    reference."""

    attention: Callable[..., torch.Tensor] = paged_attention_ref
    kv_cache_write: Callable[..., None] = write_kv_cache
    qkv_prepare: Callable[..., torch.Tensor] = qkv_prepare_ref
    rms_norm: Callable[..., Any] = rms_norm_ref
    rotary: Callable[..., torch.Tensor] = apply_rotary_ref
    silu_and_mul: Callable[..., torch.Tensor] = silu_and_mul_ref
    moe: Callable[..., torch.Tensor] = fused_moe_ref
    draft_moe: Callable[..., torch.Tensor] = fused_moe_ref
    sampling: Callable[..., torch.Tensor] = apply_top_k_top_p_min_p_ref
    #: DeepSeek-V4: sparse attention (window + compressed entries + sinks), lightning indexer top-k.
    v4_sparse_attention: Callable[..., torch.Tensor] = sparse_attention_ref
    v4_indexer: Callable[..., torch.Tensor] = indexer_topk_ref
    #: DeepSeek-V4: a compressor's pools after one token per row (decode and verify steps).
    v4_compress_decode: Callable[..., Any] = compress_decode_ref
    #: DeepSeek-V4: the same over the paged state group in place, with the gates' slot bias (decode steps).
    v4_compress_decode_paged: Callable[..., Any] = compress_decode_paged_ref
    #: DeepSeek-V4: a decode step's completed entries normalised, rotated and stored.
    v4_compress_store: Callable[..., None] = compress_store_ref
    #: DeepSeek-V4: a row's RMS norm and trailing RoPE (and the window's KV write) in one op.
    v4_norm_rope: Callable[..., torch.Tensor] = norm_rope_ref
    #: DeepSeek-V4: the MoE router after its gate projection (scores, top-k or hash, weights).
    v4_route: Callable[..., Any] = route_ref
    #: DeepSeek-V4: the hyper-connections around every block (collapse + Sinkhorn mixing, spread).
    v4_hc_pre: Callable[..., Any] = hc_pre_ref
    v4_hc_post: Callable[..., torch.Tensor] = hc_post_ref
    #: Dense projections (``gated=True``: a SwiGLU MLP's fused gate/up projection and its activation).
    linear: Callable[..., torch.Tensor] = linear_ref
    #: Speculative decoding's device bookkeeping (a verify step's rows; its acceptance and the
    #: draft head's next rows): the engine's, resolved with the model's.
    spec_verify_rows: Callable[..., None] = verify_rows_ref
    spec_accept_draft_rows: Callable[..., Any] = accept_and_draft_rows_ref
    #: The resolution, one dict per component (logged at start-up, served at /v1/backends).
    table: tuple[dict[str, Any], ...] = field(default=(), compare=False)


REFERENCE_OPS = Ops()


def base_components() -> list[tuple[str, str, str, str]]:
    """(component, op, weight format, role) every model family needs (from kernels.dispatch)."""
    return dispatch.base_components()


def resolve_ops(components: Sequence[tuple[str, str, str, str]], device: torch.device, *,
                attention_backend: str = "auto", moe_backend: str = "auto",
                draft_moe_backend: str = "auto") -> Ops:
    """Choose every component's kernel; refuse, naming op, format, role and device, any choice the
    device cannot run (UnsupportedSettingError, at start-up)."""
    capability = dispatch.device_capability(device)
    specs = []
    for name, op, fmt, role in components:
        override, flag = dispatch.override_for(op, role, attention_backend=attention_backend,
                                               moe_backend=moe_backend, draft_moe_backend=draft_moe_backend)
        specs.append(dispatch.ComponentSpec(name, op, fmt, role, override, flag))
    try:
        choices = dispatch.resolve_components(specs, capability)
    except dispatch.KernelUnavailableError as exc:
        raise UnsupportedSettingError(str(exc), param=_first_flag(specs)) from exc
    fields: dict[str, Any] = {}
    for spec in specs:
        key = dispatch.OPS_FIELDS.get((spec.op, spec.role))
        if key is not None:
            fields.setdefault(key, choices[spec.name].fn)
    table = tuple({"component": name, **choice.as_dict()} for name, choice in choices.items())
    return replace(REFERENCE_OPS, **fields, table=table)


def _first_flag(specs: Sequence[dispatch.ComponentSpec]) -> str | None:
    return next((s.override_flag.split()[0] for s in specs if s.override != "auto" and s.override_flag), None)
