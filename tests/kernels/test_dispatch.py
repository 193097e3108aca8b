"""Kernel dispatch: resolution for every op, format and role on simulated devices (CPU, sm_80,
sm_90, sm_100, sm_120); every override takes effect, for the draft role too; an override the
device cannot run is refused with a message naming op, format, role and device."""
from __future__ import annotations

import dataclasses

import pytest

from kernels import dispatch
from kernels.dispatch import (OP_FORMATS, OPS, ROLES, ComponentSpec, KernelUnavailableError,
                              override_for, resolve, resolve_all, resolve_components)

CAPABILITIES = [None, (8, 0), (9, 0), (10, 0), (12, 0)]
ALL_CASES = [(op, fmt, role) for op in OPS for fmt in OP_FORMATS[op] for role in ROLES]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=dispatch.sm_name)
@pytest.mark.parametrize("op,fmt,role", ALL_CASES)
def test_auto_resolution(capability: dispatch.Capability, op: str, fmt: str, role: str) -> None:
    choice = resolve(op, fmt=fmt, capability=capability, role=role)
    assert choice.impl_name == ("torch" if capability is None else "triton")
    assert (choice.op, choice.fmt, choice.role, choice.capability) == (op, fmt, role, capability)
    assert callable(choice.fn) and choice.reason.startswith("auto")


def test_auto_skips_the_uninstalled_sm100_kernel_and_says_so() -> None:
    choice = resolve("moe", fmt="mxfp4", capability=(10, 0), role="draft")
    assert choice.impl_name == "triton"
    assert "flashinfer_trtllm" in choice.reason and "not installed" in choice.reason


@pytest.mark.parametrize("capability", CAPABILITIES[1:], ids=dispatch.sm_name)
def test_external_kernel_only_where_built(monkeypatch: pytest.MonkeyPatch,
                                         capability: dispatch.Capability) -> None:
    """Even once installed, the sm_100-only kernel is chosen on sm_100 alone, and refused
    (never chosen, never silently replaced) elsewhere: the founding failure on sm_120."""
    _install_flashinfer(monkeypatch)
    for fmt in ("mxfp4", "nvfp4"):
        auto = resolve("moe", fmt=fmt, capability=capability, role="draft")
        assert auto.impl_name == ("flashinfer_trtllm" if capability == (10, 0) else "triton")
        if capability == (10, 0):
            continue
        with pytest.raises(KernelUnavailableError) as err:
            resolve("moe", fmt=fmt, capability=capability, role="draft",
                    override="flashinfer_trtllm", override_flag="draft_moe_backend")
        message = str(err.value)
        for part in ("'moe'", fmt, "role draft", dispatch.sm_name(capability), "built only for sm_100",
                     "draft_moe_backend"):
            assert part in message, (part, message)
    assert resolve("moe", fmt="bf16", capability=(10, 0)).impl_name == "triton"  # no bf16 there


@pytest.mark.parametrize("capability", CAPABILITIES, ids=dispatch.sm_name)
@pytest.mark.parametrize("op,fmt,role", ALL_CASES)
def test_overrides_take_effect_or_are_refused(capability: dispatch.Capability, op: str, fmt: str,
                                              role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a real device: no interpreter to fall back on
    for impl in dispatch.REGISTRY[op]:
        runnable = impl.refusal(fmt, capability) is None
        if runnable:
            choice = resolve(op, fmt=fmt, capability=capability, role=role, override=impl.name)
            assert choice.impl_name == impl.name and choice.reason.startswith("override")
            continue
        with pytest.raises(KernelUnavailableError) as err:
            resolve(op, fmt=fmt, capability=capability, role=role, override=impl.name)
        message = str(err.value)
        for part in (repr(op), fmt, f"role {role}", dispatch.sm_name(capability), impl.name):
            assert part in message, (part, message)


def test_triton_refused_on_cpu_and_old_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="needs a CUDA GPU"):
        resolve("attention", capability=None, override="triton")
    with pytest.raises(KernelUnavailableError, match="needs sm_80 or newer"):
        resolve("rms_norm", capability=(7, 5), override="triton")
    assert resolve("rms_norm", capability=(7, 5)).impl_name == "torch"


def test_explicit_triton_runs_in_the_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TRITON_INTERPRET=1 an explicit triton choice runs on the CPU (tests); auto never picks it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("attention", capability=None, override="triton").impl_name == "triton"
    assert resolve("attention", capability=None).impl_name == "torch"
    with pytest.raises(KernelUnavailableError, match="needs a CUDA GPU"):  # only triton is interpreted
        resolve("moe", fmt="mxfp4", capability=None, override="flashinfer_trtllm")


def test_unknown_names_are_refused() -> None:
    with pytest.raises(KernelUnavailableError, match="unknown kernel 'cutlass'"):
        resolve("moe", fmt="bf16", capability=(9, 0), override="cutlass")
    with pytest.raises(KernelUnavailableError, match="no format 'int4'"):
        resolve("moe", fmt="int4", capability=(9, 0))
    with pytest.raises(KernelUnavailableError, match="unknown op"):
        resolve("conv", capability=(9, 0))


def test_override_for_roles() -> None:
    flags = dict(attention_backend="torch", moe_backend="triton", draft_moe_backend="auto")
    assert override_for("attention", "draft", **flags) == ("torch", "attention_backend")
    assert override_for("kv_cache_write", "main", **flags) == ("torch", "attention_backend")
    assert override_for("moe", "main", **flags) == ("triton", "moe_backend")
    value, source = override_for("moe", "draft", **flags)
    assert value == "triton" and source is not None and "inherited" in source
    flags["draft_moe_backend"] = "torch"
    assert override_for("moe", "draft", **flags) == ("torch", "draft_moe_backend")
    assert override_for("moe", "main", **flags) == ("triton", "moe_backend")
    assert override_for("rms_norm", "main", **flags) == ("auto", None)


def _engine_specs(attention: str, moe: str, draft_moe: str) -> list[ComponentSpec]:
    """What an engine builds: NVFP4 main model with an MXFP4 MTP draft."""
    flags = dict(attention_backend=attention, moe_backend=moe, draft_moe_backend=draft_moe)
    specs = []
    for name, op, fmt, role in [("attn", "attention", "bf16", "main"),
                                ("kv_write", "kv_cache_write", "bf16", "main"),
                                ("experts", "moe", "nvfp4", "main"),
                                ("mtp.attn", "attention", "bf16", "draft"),
                                ("mtp.experts", "moe", "mxfp4", "draft"),
                                ("norm", "rms_norm", "bf16", "main")]:
        override, flag = override_for(op, role, **flags)
        specs.append(ComponentSpec(name, op, fmt, role, override, flag))
    return specs


def test_resolve_all_table_and_draft_override() -> None:
    table = resolve_all(_engine_specs("auto", "torch", "triton"), (12, 0))
    by_name = {row["component"]: row for row in table}
    assert by_name["experts"]["impl"] == "torch" and by_name["mtp.experts"]["impl"] == "triton"
    assert by_name["attn"]["impl"] == "triton" and by_name["mtp.attn"]["device"] == "sm_120"
    assert set(by_name["norm"]) == {"component", "op", "format", "role", "impl", "device", "reason"}
    draft_inherits = resolve_components(_engine_specs("auto", "torch", "auto"), (12, 0))
    assert draft_inherits["mtp.experts"].impl_name == "torch"


def test_start_up_refuses_the_founding_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """sm_120 box, draft forced to the sm_100-only kernel: refused at start-up, all components
    that fail listed, never replaced by another kernel."""
    _install_flashinfer(monkeypatch)
    with pytest.raises(KernelUnavailableError) as err:
        resolve_all(_engine_specs("auto", "flashinfer_trtllm", "flashinfer_trtllm"), (12, 0))
    message = str(err.value)
    assert "experts:" in message and "mtp.experts:" in message and "sm_120" in message
    assert "draft_moe_backend" in message and "format mxfp4" in message
    ok = resolve_all(_engine_specs("auto", "flashinfer_trtllm", "triton"), (10, 0))
    assert {r["component"]: r["impl"] for r in ok}["mtp.experts"] == "triton"


def test_tuple_specs_accepted() -> None:
    table = resolve_all([("attn", "attention", "bf16", "main", "torch")], (9, 0))
    assert table[0]["impl"] == "torch" and table[0]["reason"].startswith("override")


def _install_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    impls = [dataclasses.replace(i, installed=lambda: True) if i.name == "flashinfer_trtllm" else i
             for i in dispatch.REGISTRY["moe"]]
    monkeypatch.setitem(dispatch.REGISTRY, "moe", impls)


def test_every_op_is_declared_once_and_the_models_op_set_matches():
    """kernels.dispatch.OP_SPECS is the one declaration: the registry, the formats, the attention
    override set and the models' Ops fields derive from it, and each Ops field defaults to the
    reference its spec names."""
    import dataclasses
    import importlib

    from cluster.models.ops import REFERENCE_OPS, Ops
    assert list(dispatch.REGISTRY) == list(OPS) == [s.name for s in dispatch.OP_SPECS]
    fields = {f.name for f in dataclasses.fields(Ops)} - {"table"}
    assert fields == set(dispatch.OPS_FIELDS.values())
    for spec in dispatch.OP_SPECS:
        reference = getattr(importlib.import_module(spec.reference[0]), spec.reference[1])
        for _, field_name in spec.fields:
            assert getattr(REFERENCE_OPS, field_name) is reference, (spec.name, field_name)
        assert [i.name for i in dispatch.REGISTRY[spec.name]][:2] == ["torch", "triton"]
        assert all(i.op == spec.name for i in dispatch.REGISTRY[spec.name])
