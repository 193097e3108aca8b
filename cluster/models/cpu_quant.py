"""GGUF weights kept quantized on the CPU (the embedded default's decode path).

A GGUF file's Q4_1 projections keep their blocks, after loading, for the native CPU kernel
(``kernels.cpu_native``: float16 scales and minimums as stored, AVX2 integer dot products), and
are also repacked for torch's int4 kernel, which takes their place where the native one cannot
run (no AVX2 or no C compiler: said in the log and the kernel table). The logits projection of a
tied, already quantized embedding (SmolLM2's Q8_0) becomes Q8_0 blocks for the native kernel
(exactly the file's) and int8 with one scale per row for torch's. Everything else (embedding lookup, norms, attention, residuals) stays float32.
A decode step of a few rows then reads about 95 MB of weights for SmolLM2-135M instead of 538;
from ``dense_from_rows()`` rows on (large batches, prefill chunks) each projection reads its
dequantization instead, kept next to the codes, whose GEMM grows more slowly with the rows.

Selected by ``dtype=None`` (the default) on a CPU; ``dtype="float32"`` keeps the exact float32
path (the one compared with transformers). GPUs never take it."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from cluster.models.layers import Linear
from cluster.models.loader import ParamTarget
from kernels import cpu_native
from kernels.attention import paged_attention_ref
from kernels.cpu_quant import (GROUP_SIZE, can_pack_q4, dense_dtype, dense_from_rows, dense_logits_from_rows,
                               int4_cpu_available, pack_q4, pack_q8_rows)
from kernels.qkv_prepare import qkv_prepare_ref

logger = logging.getLogger(__name__)

#: GGUF types of an embedding that is already quantized (its int8 repacking loses little more).
_QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


def quantize_for_cpu(net: nn.Module, checkpoint: Any) -> list[dict[str, Any]]:
    """Repack ``net``'s projections from ``checkpoint`` (a GGUFCheckpoint); returns the kernel
    table rows to report (one saying so when torch lacks the kernels and nothing was repacked)."""
    if not int4_cpu_available():
        logger.warning("this torch build has no CPU int4/int8 weight-only kernels: GGUF weights run "
                       "dequantized to float32 (about 6x more memory traffic per decode step)")
        return [{"component": "linear", "op": "linear", "format": "gguf", "impl": "torch", "device": "cpu",
                 "role": "main", "reason": "fell back: torch has no _weight_int4pack_mm_for_cpu"}]
    targets: dict[str, ParamTarget] = net.checkpoint_targets()
    by_param: dict[str, list[tuple[ParamTarget, Any]]] = {}
    for name, blocks in checkpoint.q4_1_tensors():
        target = targets.get(name)
        if target is not None and target.dim == 0:
            by_param.setdefault(target.param, []).append((target, blocks))
    modules = dict(net.named_modules())
    native, native_why = cpu_native.status()
    if not native:
        logger.warning("the native CPU kernels do not run here (%s): few-row steps take torch's int4/int8 kernels "
                       "instead (about 2x slower per decode step on an AVX2 core)", native_why)
    packed = kept = 0
    q4_bytes = dense_bytes = 0
    for param, parts in by_param.items():
        module = modules.get(param.removesuffix(".weight"))
        if not isinstance(module, Linear) or not param.endswith(".weight"):
            continue
        n, k = module.out_features, module.in_features
        covered = sum(t.size if t.size is not None else n for t, _ in parts)
        if covered != n or not can_pack_q4(n, k):
            kept += 1
            continue
        codes = torch.empty(n, k, dtype=torch.uint8)
        scale = torch.empty(n, k // GROUP_SIZE)  # Q4_1's groups are the kernel's
        minimum = torch.empty(n, k // GROUP_SIZE)
        for target, blocks in parts:
            rows = slice(target.offset, target.offset + (target.size if target.size is not None else n))
            codes[rows], scale[rows], minimum[rows] = blocks.codes, blocks.scale, blocks.minimum
        weight = pack_q4(codes, scale, minimum, dense=True, native=native)
        module.quantize(weight)
        packed += 1
        q4_bytes += weight.nbytes
        dense_bytes += weight.dense.numel() * weight.dense.element_size() if weight.dense is not None else 0
    vnni, vnni_why = cpu_native.vnni_status()
    if native and vnni:
        few = (f"the native VNNI kernel over the file's Q4_1 blocks repacked for 16 output features a register "
               f"({q4_bytes / 2**20:.0f} MiB; float16 scales and minimums as stored, activations "
               f"rounded to 16 bits per block of 32, AVX-512 VNNI integer dot products)")
        many = ("every row count takes it (decode steps, batches and prompt chunks alike: a row's numbers never "
                "depend on the rows beside it)")
    elif native:
        few = (f"the native Q4_1 kernel over the file's blocks ({q4_bytes / 2**20:.0f} MiB; float16 scales and "
               f"minimums as stored, activations rounded to 16 bits per block of 32, AVX2 integer dot products"
               f"; not the VNNI kernel: {vnni_why})")
        many = (f"from {dense_from_rows(True)} rows of activations on, a float32 GEMM over the blocks' exact "
                f"dequantization ({dense_bytes / 2**20:.0f} MiB) fed the same rounded activations: the native "
                f"kernel's numbers in another order of sums")
    else:
        few = (f"torch's int4 kernel ({q4_bytes / 2**20:.0f} MiB; scales and zeros in bfloat16, activations rounded "
               f"to bfloat16; fell back from the native kernel: {native_why})")
        many = (f"from {dense_from_rows()} rows of activations on, their bfloat16 dequantization as {_dense_name()} "
                f"({dense_bytes / 2**20:.0f} MiB, a GEMM that costs about the same for 4 rows as for 32"
                f"{_dense_why()})")
    rows = [{"component": "linear", "op": "linear", "format": "gguf_q4_1",
             "impl": ("native_vnni_q4_1_cpu" if vnni else "native_q4_1_cpu") if native else "torch_int4pack_cpu",
             "device": "cpu", "role": "main",
             "reason": f"{packed} projections keep the file's 4-bit codes: {few}; {many}"
                       + (f"; {kept} stay float32 (shapes the kernel does not take)" if kept else "")}]
    embed_type = checkpoint.tensor_types().get("model.embed_tokens.weight", "F32")
    if getattr(net, "lm_head", None) is None and embed_type in _QUANTIZED_TYPES and hasattr(net, "quantize_logits"):
        weight = net.embed_tokens.weight.detach()
        if weight.shape[0] % 16 == 0:
            q8 = pack_q8_rows(weight, dense=True, native=native and weight.shape[1] % cpu_native.QK == 0)
            net.quantize_logits(q8)
            if q8.native is not None and q8.native.vnni is not None:
                impl, fmt = "native_vnni_q8_0_cpu", f"gguf_{embed_type.lower()}->q8_0"
                reason = (f"the tied {embed_type} embedding as Q8_0 blocks ({q8.nbytes / 2**20:.0f} MiB repacked "
                          f"for the VNNI kernel; a Q8_0 file's exactly), the native VNNI kernel for every row count")
            elif q8.native is not None:
                impl, fmt = "native_q8_0_cpu", f"gguf_{embed_type.lower()}->q8_0"
                reason = (f"the tied {embed_type} embedding as Q8_0 blocks ({q8.nbytes / 2**20:.0f} MiB; a Q8_0 "
                          f"file's exactly), the native kernel; from {dense_logits_from_rows(True)} rows on, a "
                          f"float32 GEMM over their exact dequantization")
            else:
                impl, fmt = "torch_int8pack_cpu", f"gguf_{embed_type.lower()}->int8_row"
                reason = (f"the tied {embed_type} embedding as int8 with one scale per row ({q8.nbytes / 2**20:.0f} "
                          f"MiB)" + ("" if native else f"; fell back from the native kernel: {native_why}")
                          + f"; from {dense_logits_from_rows()} rows on, its bfloat16 dequantization as "
                          f"{_dense_name()}{_dense_why()}")
            rows.append({"component": "logits", "op": "linear", "format": fmt, "impl": impl, "device": "cpu",
                         "role": "main", "reason": reason})
    if packed and native:
        _native_ops(net)
    if packed and hasattr(net, "cpu_decode"):
        rows.append(_lean_decode(net))
    logger.info("CPU weights: %s", "; ".join(r["reason"] for r in rows))
    return rows


def quantize_float_linears(module: nn.Module) -> int:
    """Round every float projection of ``module`` (a draft head over a quantized target) to the
    CPU int4 kernel's format, as a GGUF file's Q4_1 would hold it: per group of 32 inputs a scale
    and a minimum, codes 0..15 (and the bfloat16 dequantization for many-row calls). Returns how
    many it quantized; shapes the kernel does not take stay float."""
    if not int4_cpu_available():
        return 0
    native = cpu_native.available()
    done = 0
    for linear in module.modules():
        if not isinstance(linear, Linear) or linear.quantized is not None:
            continue
        n, k = linear.out_features, linear.in_features
        if not can_pack_q4(n, k):
            continue
        groups = linear.weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        linear.quantize(pack_q4(codes.reshape(n, k), scale, lo, dense=True, native=native))
        done += 1
    return done


def _native_ops(net: nn.Module) -> None:
    """Give ``net`` the native norm, rotation + KV write and decode attention beside the GGUF
    weights' native kernels: every module sharing its ops takes them (so the layers and the lean
    decode step compute the same numbers), its kernel table saying so. Ops resolved to other
    kernels than the CPU references stay as they are."""
    old = net.ops
    rows = {"rms_norm": {"component": "rms_norm", "op": "rms_norm", "format": "float32", "impl": "native_cpu",
                         "device": "cpu", "role": "main",
                         "reason": "the native RMS norm with the GGUF weights' native kernels (one call per norm "
                                   "and its residual add, where the reference takes five torch ops)"}}
    fields: dict[str, Any] = {"rms_norm": cpu_native.rms_norm}
    if old.qkv_prepare is qkv_prepare_ref:
        fields["qkv_prepare"] = cpu_native.qkv_prepare
        rows["qkv_prepare"] = {"component": "qkv_prepare", "op": "qkv_prepare", "format": "float32",
                               "impl": "native_cpu", "device": "cpu", "role": "main",
                               "reason": "native rotation and KV write (the reference's numbers; q/k norms and "
                                         "interleaved rotation take the reference)"}
    if old.attention is paged_attention_ref:
        fields["attention"] = cpu_native.paged_attention
        rows["attention"] = {"component": "attention", "op": "attention", "format": "float32", "impl": "native_cpu",
                             "device": "cpu", "role": "main",
                             "reason": "native paged attention for decode steps (one task per sequence and KV "
                                       "head, a row's numbers whatever rows share the step); prompt rows take "
                                       "the torch reference"}
    table = tuple(rows.pop(r.get("component"), r) for r in old.table) + tuple(rows.values())
    ops = dataclasses.replace(old, **fields, table=table)
    for module in net.modules():
        if getattr(module, "ops", None) is old:
            module.ops = ops


def _lean_decode(net: nn.Module) -> dict[str, Any]:
    """Give ``net`` (a Llama-family model) its lean decode step where it applies; the table row
    says which path decode steps take and, if the layers, why."""
    from cluster.models.llama_cpu_decode import LlamaCpuDecode, unsupported_reason
    reason = unsupported_reason(net)
    row = {"component": "decode_step", "op": "decode_step", "format": "gguf_q4_1", "device": "cpu", "role": "main"}
    if reason is not None:
        logger.warning("CPU decode steps run layer by layer (the lean path does not apply: %s)", reason)
        return {**row, "impl": "layers", "reason": f"fell back: the lean decode step does not apply ({reason})"}
    net.cpu_decode = LlamaCpuDecode(net)
    return {**row, "impl": "lean_cpu_decode",
            "reason": "decode-only steps in one pass with fewer torch ops (shared per-step tables, fused norms, "
                      "one native call per layer for rotation, KV write and attention where the native kernels "
                      "run); same numbers as the layers"}


def _dense_name() -> str:
    return str(dense_dtype()).removeprefix("torch.")


def _dense_why() -> str:
    """Why the dense copies are not bfloat16, where they are not (``/v1/backends``)."""
    if dense_dtype() is torch.bfloat16:
        return ""
    return ("; float32 because this CPU has no native bfloat16 GEMM (no AVX-512 BF16 or AMX), where an emulated "
            "one is slower than the 4-bit kernel")
