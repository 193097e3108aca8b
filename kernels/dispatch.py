"""Kernel dispatch: one table of implementations per op, resolved per (op, weight format, device
capability, role) at start-up, refusing whatever the device cannot run.

Implementations (``REGISTRY``):
- ``torch``: the pure-torch references; run everywhere (CPU and any GPU).
- ``triton``: the Triton kernels; need CUDA and sm_80+. They contain no wgmma/tcgen05-specific
  code and pick tiles that fit 99 KB of shared memory, so they run on sm_90 and sm_120. fp8
  weights run on every sm_80+ device: decoded by the hardware e4m3 conversion on sm_89+ and by
  integer bit operations (slower) on sm_80/86; MXFP4/NVFP4 are decoded in registers everywhere.
- ``flashinfer_trtllm``: an external MoE kernel (MXFP4/NVFP4) built only for sm_100 and not
  installed in this build. It is registered so that choosing it for another architecture (the
  founding failure: an sm_100-only MoE kernel picked for an sm_120 MTP draft) is refused here,
  with a clear message, instead of crashing at run time.

Resolution: ``override="auto"`` picks the highest-priority implementation the device can run;
an explicit override the device cannot run raises :class:`KernelUnavailableError` naming the op,
format, role, device and reason. An explicit override never falls back silently.

Overrides per role (:func:`override_for`): attention (the KV-cache write, DeepSeek-V4's sparse
attention and its lightning indexer too: :data:`ATTENTION_OPS`) follow ``attention_backend`` for
both roles; MoE follows ``moe_backend`` for the main model and
``draft_moe_backend`` for the draft, which inherits ``moe_backend`` only when it is itself
``"auto"`` (then an inherited explicit choice is as strict as a direct one). Other ops resolve
``auto``.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Capability = tuple[int, int] | None
ROLES = ("main", "draft")
WEIGHT_FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4")


class KernelUnavailableError(RuntimeError):
    """A kernel was requested (or is needed) that this device cannot run."""


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of an op. ``capabilities`` (exact archs) is for builds that exist only
    for some architectures; ``min_capability`` for portable GPU code."""

    name: str
    op: str
    formats: tuple[str, ...]
    load: Callable[[], Callable[..., Any]]
    priority: int
    needs_cuda: bool = False
    min_capability: tuple[int, int] | None = None
    capabilities: tuple[tuple[int, int], ...] | None = None
    installed: Callable[[], bool] = field(default=lambda: True)
    requirement: str = ""

    def refusal(self, fmt: str, capability: Capability, interpreted: bool = False) -> str | None:
        """Why this implementation cannot run ``fmt`` on ``capability``; None if it can.
        ``interpreted``: CUDA-only Triton code may run on the CPU in Triton's interpreter."""
        reasons = []
        if fmt not in self.formats:
            reasons.append(f"it does not support format {fmt} (supports {', '.join(self.formats)})")
        if self.needs_cuda and capability is None and not (interpreted and self.name == "triton"):
            reasons.append("it needs a CUDA GPU and this device is the CPU")
        elif self.capabilities is not None and capability not in self.capabilities:
            archs = ", ".join(sm_name(c) for c in self.capabilities)
            reasons.append(f"it is built only for {archs}")
        elif self.min_capability is not None and capability is not None \
                and capability < self.min_capability:
            reasons.append(f"it needs {sm_name(self.min_capability)} or newer")
        if not self.installed():
            reasons.append(f"it is not installed{f' ({self.requirement})' if self.requirement else ''}")
        return "; ".join(reasons) or None


@dataclass(frozen=True)
class KernelChoice:
    op: str
    fmt: str
    role: str
    impl_name: str
    fn: Callable[..., Any]
    reason: str
    capability: Capability = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for the start-up log and the HTTP endpoint."""
        return {"op": self.op, "format": self.fmt, "role": self.role, "impl": self.impl_name,
                "device": sm_name(self.capability), "reason": self.reason}


@dataclass(frozen=True)
class ComponentSpec:
    """A model component that needs a kernel; ``override_flag`` names the setting the override
    came from (for messages)."""

    name: str
    op: str
    fmt: str = "bf16"
    role: str = "main"
    override: str = "auto"
    override_flag: str | None = None


def sm_name(capability: Capability) -> str:
    return "cpu" if capability is None else f"sm_{capability[0]}{capability[1]}"


def device_capability(device: torch.device | str | None) -> Capability:
    """``(major, minor)`` of a CUDA device, None for the CPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _from(module: str, name: str) -> Callable[[], Callable[..., Any]]:
    def load() -> Callable[..., Any]:
        return getattr(importlib.import_module(module), name)
    return load


def _not_integrated() -> Callable[..., Any]:
    raise KernelUnavailableError("flashinfer_trtllm has no integration in this build")


@dataclass(frozen=True)
class OpSpec:
    """One op, declared once: its pure-torch reference (runs everywhere), its portable Triton
    kernel (CUDA, sm_80+), the weight formats it takes, which setting overrides it, the models'
    ``Ops`` field that holds it per role, and the component every model family resolves it
    under. The dispatch table (``REGISTRY``) and the models' op set (cluster.models.ops) derive
    from ``OP_SPECS``; adding an op is one entry here and its typed ``Ops`` field."""

    name: str
    reference: tuple[str, str]
    triton: tuple[str, str]
    formats: tuple[str, ...] = ("bf16",)
    #: ``attention_backend`` overrides it, for both roles (else see ``override_for``).
    attention: bool = False
    #: (role, Ops field) pairs: where a resolved kernel goes in the models' op set.
    fields: tuple[tuple[str, str], ...] = ()
    #: The component name every model family resolves it under (None: only the families that
    #: use the op declare a component for it).
    base_component: str | None = None
    #: Implementations beyond torch and triton (builds for some architectures only).
    extra: tuple[KernelImpl, ...] = ()


#: An external MoE kernel built only for sm_100 and not installed in this build: registered so
#: that choosing it for another architecture is refused with a clear message (the founding failure).
_FLASHINFER_MOE = KernelImpl(
    "flashinfer_trtllm", "moe", ("mxfp4", "nvfp4"), lambda: _not_integrated, priority=100,
    needs_cuda=True, capabilities=((10, 0),), installed=lambda: False,
    requirement="an sm_100 flashinfer build; no integration in this build")

OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec("attention", ("kernels.attention", "paged_attention_ref"),
           ("kernels.triton_attention", "paged_attention_triton"), attention=True,
           fields=(("main", "attention"),), base_component="attention"),
    OpSpec("kv_cache_write", ("kernels.attention", "write_kv_cache"),
           ("kernels.triton_attention", "write_kv_cache_triton"), attention=True,
           fields=(("main", "kv_cache_write"),), base_component="kv_cache_write"),
    OpSpec("qkv_prepare", ("kernels.qkv_prepare", "qkv_prepare_ref"),
           ("kernels.triton_qkv_prepare", "qkv_prepare_triton"), attention=True,
           fields=(("main", "qkv_prepare"),), base_component="qkv_prepare"),
    OpSpec("moe", ("kernels.moe", "fused_moe_ref"), ("kernels.triton_moe", "fused_moe_triton"),
           formats=WEIGHT_FORMATS, fields=(("main", "moe"), ("draft", "draft_moe")), extra=(_FLASHINFER_MOE,)),
    OpSpec("rms_norm", ("kernels.norm", "rms_norm_ref"), ("kernels.triton_norm", "rms_norm_triton"),
           fields=(("main", "rms_norm"),), base_component="rms_norm"),
    OpSpec("rotary", ("kernels.rotary", "apply_rotary_ref"), ("kernels.triton_rotary", "apply_rotary_triton"),
           fields=(("main", "rotary"),), base_component="rotary"),
    OpSpec("silu_and_mul", ("kernels.activation", "silu_and_mul_ref"),
           ("kernels.triton_activation", "silu_and_mul_triton"),
           fields=(("main", "silu_and_mul"),), base_component="silu_and_mul"),
    OpSpec("sampling", ("kernels.sampling", "apply_top_k_top_p_min_p_ref"),
           ("kernels.triton_sampling", "apply_top_k_top_p_min_p_triton"),
           fields=(("main", "sampling"),), base_component="sampler"),
    OpSpec("v4_sparse_attention", ("kernels.deepseek_v4_ref", "sparse_attention_ref"),
           ("kernels.triton_deepseek_v4_attention", "sparse_attention_triton"), attention=True,
           fields=(("main", "v4_sparse_attention"),)),
    OpSpec("v4_indexer", ("kernels.deepseek_v4_ref", "indexer_topk_ref"),
           ("kernels.triton_deepseek_v4_indexer", "indexer_topk_triton"), attention=True,
           fields=(("main", "v4_indexer"),)),
    OpSpec("v4_compress_decode", ("kernels.deepseek_v4_ref", "compress_decode_ref"),
           ("kernels.triton_deepseek_v4_compressor", "compress_decode_triton"),
           fields=(("main", "v4_compress_decode"),)),
    OpSpec("v4_compress_decode_paged", ("kernels.deepseek_v4_ref", "compress_decode_paged_ref"),
           ("kernels.triton_deepseek_v4_compressor", "compress_decode_paged_triton"),
           fields=(("main", "v4_compress_decode_paged"),)),
    OpSpec("v4_compress_store", ("kernels.deepseek_v4_ref", "compress_store_ref"),
           ("kernels.triton_deepseek_v4_compressor", "compress_store_triton"),
           fields=(("main", "v4_compress_store"),)),
    OpSpec("v4_norm_rope", ("kernels.deepseek_v4_ref", "norm_rope_ref"),
           ("kernels.triton_deepseek_v4_rope", "norm_rope_triton"), fields=(("main", "v4_norm_rope"),)),
    OpSpec("v4_route", ("kernels.deepseek_v4_ref", "route_ref"),
           ("kernels.triton_deepseek_v4_router", "route_triton"), fields=(("main", "v4_route"),)),
    OpSpec("v4_hc_pre", ("kernels.deepseek_v4_ref", "hc_pre_ref"),
           ("kernels.triton_deepseek_v4_hc", "hc_pre_triton"), fields=(("main", "v4_hc_pre"),)),
    OpSpec("v4_hc_post", ("kernels.deepseek_v4_ref", "hc_post_ref"),
           ("kernels.triton_deepseek_v4_hc", "hc_post_triton"), fields=(("main", "v4_hc_post"),)),
    OpSpec("linear", ("kernels.linear", "linear_ref"), ("kernels.triton_linear", "linear_triton"),
           fields=(("main", "linear"),), base_component="linear"),
    OpSpec("spec_verify_rows", ("kernels.spec_decode", "verify_rows_ref"),
           ("kernels.triton_spec_decode", "verify_rows_triton"),
           fields=(("main", "spec_verify_rows"),), base_component="spec_verify_rows"),
    OpSpec("spec_accept_draft_rows", ("kernels.spec_decode", "accept_and_draft_rows_ref"),
           ("kernels.triton_spec_decode", "accept_and_draft_rows_triton"),
           fields=(("main", "spec_accept_draft_rows"),), base_component="spec_accept_draft_rows"),
)

OPS = tuple(spec.name for spec in OP_SPECS)
#: Ops that ``attention_backend`` overrides (for both roles).
ATTENTION_OPS = tuple(spec.name for spec in OP_SPECS if spec.attention)
#: Formats each op accepts ("bf16" = unquantized, whatever the float dtype).
OP_FORMATS: dict[str, tuple[str, ...]] = {spec.name: spec.formats for spec in OP_SPECS}
#: (op, role) -> the field of the models' Ops that holds its kernel.
OPS_FIELDS: dict[tuple[str, str], str] = {(spec.name, role): f for spec in OP_SPECS for role, f in spec.fields}


def base_components() -> list[tuple[str, str, str, str]]:
    """(component, op, weight format, role) every model family resolves."""
    return [(spec.base_component, spec.name, "bf16", "main") for spec in OP_SPECS if spec.base_component]


def _build_registry() -> dict[str, list[KernelImpl]]:
    registry: dict[str, list[KernelImpl]] = {}
    for spec in OP_SPECS:
        registry[spec.name] = [
            KernelImpl("torch", spec.name, spec.formats, _from(*spec.reference), priority=0),
            KernelImpl("triton", spec.name, spec.formats, _from(*spec.triton), priority=50,
                       needs_cuda=True, min_capability=(8, 0), installed=_has_triton,
                       requirement="pip install triton"),
            *spec.extra,
        ]
    return registry


REGISTRY: dict[str, list[KernelImpl]] = _build_registry()


def _check(op: str, fmt: str, role: str) -> None:
    if op not in REGISTRY:
        raise KernelUnavailableError(f"unknown op {op!r}; known: {', '.join(REGISTRY)}")
    if fmt not in OP_FORMATS[op]:
        raise KernelUnavailableError(
            f"op {op!r} has no format {fmt!r} (role {role}); formats: {', '.join(OP_FORMATS[op])}")
    if role not in ROLES:
        raise KernelUnavailableError(f"unknown role {role!r} for op {op!r}; roles: {ROLES}")


def resolve(op: str, *, fmt: str = "bf16", capability: Capability, role: str = "main",
            override: str = "auto", override_flag: str | None = None) -> KernelChoice:
    """The implementation of ``op`` for weights in ``fmt`` on ``capability`` (None: CPU)."""
    _check(op, fmt, role)
    impls = REGISTRY[op]
    where = f"op {op!r} (format {fmt}, role {role}) on device {sm_name(capability)}"
    runnable = sorted((i for i in impls if i.refusal(fmt, capability) is None),
                      key=lambda i: -i.priority)
    if override == "auto":
        if not runnable:
            raise KernelUnavailableError(f"no kernel can run {where}")
        chosen = runnable[0]
        skipped = [f"{i.name}: {i.refusal(fmt, capability)}" for i in impls
                   if i.priority > chosen.priority and fmt in i.formats]
        reason = f"auto: best runnable on {sm_name(capability)}"
        if skipped:
            reason += " (skipped " + "; ".join(skipped) + ")"
        return KernelChoice(op, fmt, role, chosen.name, chosen.load(), reason, capability)
    by_name = {i.name: i for i in impls}
    flag = f" (set by {override_flag})" if override_flag else ""
    alternatives = ", ".join(["auto"] + [i.name for i in runnable])
    if override not in by_name:
        raise KernelUnavailableError(
            f"unknown kernel {override!r}{flag} for {where}; known: {', '.join(by_name)}; "
            f"runnable here: {alternatives}")
    # An explicit "triton" on the CPU runs in Triton's interpreter when it is on (tests); "auto"
    # never picks the interpreter.
    refusal = by_name[override].refusal(fmt, capability, interpreted=_interpreting())
    if refusal is not None:
        raise KernelUnavailableError(
            f"kernel {override!r}{flag} cannot run {where}: {refusal}. "
            f"Choose one of: {alternatives}")
    return KernelChoice(op, fmt, role, override, by_name[override].load(),
                        f"override {override!r}{flag}", capability)


def override_for(op: str, role: str, *, attention_backend: str = "auto", moe_backend: str = "auto",
                 draft_moe_backend: str = "auto") -> tuple[str, str | None]:
    """The override that applies to ``op`` for ``role`` and the setting it comes from (module
    docstring): the draft's MoE inherits ``moe_backend`` only when ``draft_moe_backend`` is auto."""
    if op in ATTENTION_OPS:
        return attention_backend, "attention_backend"
    if op == "moe":
        if role == "draft" and draft_moe_backend != "auto":
            return draft_moe_backend, "draft_moe_backend"
        if role == "draft" and moe_backend != "auto":
            return moe_backend, "moe_backend (inherited by the draft: draft_moe_backend is auto)"
        return moe_backend, "moe_backend"
    return "auto", None


def resolve_components(specs: Sequence[ComponentSpec | tuple[str, str, str, str, str]],
                       capability: Capability) -> dict[str, KernelChoice]:
    """Resolve every component at start-up; refuses with one error listing every component the
    device cannot serve."""
    choices: dict[str, KernelChoice] = {}
    errors: list[str] = []
    for spec in specs:
        if not isinstance(spec, ComponentSpec):
            spec = ComponentSpec(*spec)
        try:
            choices[spec.name] = resolve(spec.op, fmt=spec.fmt, capability=capability,
                                         role=spec.role, override=spec.override,
                                         override_flag=spec.override_flag)
        except KernelUnavailableError as e:
            errors.append(f"{spec.name}: {e}")
    if errors:
        raise KernelUnavailableError("kernel selection failed:\n  " + "\n  ".join(errors))
    return choices


def resolve_all(specs: Sequence[ComponentSpec | tuple[str, str, str, str, str]],
                capability: Capability) -> list[dict[str, Any]]:
    """:func:`resolve_components` as a table (one dict per component), for logs and endpoints."""
    return [{"component": name, **choice.as_dict()}
            for name, choice in resolve_components(specs, capability).items()]
