"""Loading DeepSeek-V4 checkpoints: the released layout (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``mtp.K.*``, ``.scale`` companions) and the one transformers'
``save_pretrained`` writes (the same names under ``model.``, with ``model.embed_tokens``,
``model.hc_head.hc_fn``, ``head.weight`` and ``attn.norm`` for ``attn.kv_norm``).

Weights are streamed: a weight is copied as soon as it and its companion scales have all been
seen (``deepseek_v4_quant`` decides when that is and what format it is), dequantized to the model's
dtype. Per-expert weights land in the stacked ``w13``/``w2``: dequantized, or, for experts kept in
their checkpoint format (``deepseek_v4_experts``: CUDA), as they come, stacked once all are seen.
A tensor the model does not expect, one of the wrong shape or format, a scale without its weight,
or an expected tensor the checkpoint lacks stops loading with a ModelLoadError naming it. MTP
weights are loaded and kept when the checkpoint has them (all of them); a checkpoint without any
``mtp.*`` tensor loads without them.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from cluster.common.errors import ModelLoadError
from cluster.models.deepseek_v4_experts import Experts, ExpertStack
from cluster.models.deepseek_v4_quant import PLAIN_DTYPES, SCALE_SUFFIXES, is_complete, to_quantized
from kernels.quant import dequantize

logger = logging.getLogger(__name__)

_ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")
_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w13|w2)$")


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in the released layout (the model's own parameter names)."""
    name = name.removeprefix("model.")
    name = _ALIASES.get(name, name)
    return _KV_NORM.sub(r"\1.kv_norm.weight", name)


@dataclass(frozen=True)
class ExpertSlot:
    """Expert ``expert``'s part ``half`` (w1: 0, w3: 1, w2: 0) of a natively stored stack."""

    stack: ExpertStack
    expert: int
    half: int


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter (or buffer), a slice of one, or a slot of a
    natively stored expert stack."""

    dest: torch.Tensor | None
    #: A matrix weight that may come quantized (with companion scales).
    matrix: bool
    slot: ExpertSlot | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.slot is not None:
            return self.slot.stack.half_shape
        assert self.dest is not None
        return tuple(self.dest.shape)


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint name -> destination, for every tensor the model loads."""
    targets: dict[str, Target] = {}
    for pname, param in model.named_parameters():
        experts = _EXPERTS.match(pname)
        if experts is None:
            targets[pname] = Target(param.data, param.dim() == 2 and pname.endswith(".weight"))
            continue
        prefix, which = experts.groups()
        for e in range(param.shape[0]):
            if which == "w2":
                targets[f"{prefix}.{e}.w2.weight"] = Target(param.data[e], True)
            else:
                inter = param.shape[1] // 2
                targets[f"{prefix}.{e}.w1.weight"] = Target(param.data[e, :inter], True)
                targets[f"{prefix}.{e}.w3.weight"] = Target(param.data[e, inter:], True)
    for bname, buf in model.named_buffers():
        if bname.endswith("tid2eid"):
            targets[bname] = Target(buf, False)
    for mname, module in model.named_modules():
        if isinstance(module, Experts) and module.native:
            for which, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
                stack = module.stack(which, f"{mname}.{which}")
                for e in range(module.shapes[which][0]):
                    for half, part in enumerate(parts):
                        targets[f"{mname}.{e}.{part}.weight"] = Target(None, True, ExpertSlot(stack, e, half))
    return targets


def load_deepseek_v4_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                             total: int | None = None, desc: str = "Loading weights") -> None:
    loader = _Loader(checkpoint_targets(model))
    for raw, tensor in tqdm(weights, total=total, desc=desc, unit="tensor", leave=False):
        loader.add(raw, tensor)
    loader.finish(model)


class _Loader:
    def __init__(self, targets: dict[str, Target]) -> None:
        self.targets = targets
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.raw_names: dict[str, str] = {}
        self.loaded: set[str] = set()

    def add(self, raw: str, tensor: torch.Tensor) -> None:
        name = canonical_name(raw)
        base, _, suffix = name.rpartition(".")
        weight_name = f"{base}.weight"
        if suffix in ("weight", *SCALE_SUFFIXES) and weight_name in self.targets:
            parts = self.pending.setdefault(base, {})
            if suffix in parts:
                raise ModelLoadError(f"tensor {raw!r} appears twice in the checkpoint")
            parts[suffix] = tensor
            if suffix == "weight":
                self.raw_names[weight_name] = raw
            if is_complete(parts):
                self._copy_weight(weight_name, self.pending.pop(base))
            return
        target = self.targets.get(name)
        if target is None or target.dest is None:
            raise ModelLoadError(f"unexpected tensor {raw!r} in the checkpoint (shape {tuple(tensor.shape)})")
        self._copy(raw, name, tensor, target.dest)

    def _copy_weight(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        target, raw = self.targets[name], self.raw_names.get(name, name)
        weight = parts["weight"]
        if not target.matrix:
            if weight.dtype not in PLAIN_DTYPES or len(parts) > 1:
                raise ModelLoadError(f"tensor {raw!r} must be a plain float tensor, got {weight.dtype} "
                                     f"with {sorted(parts)}")
            assert target.dest is not None
            self._copy(raw, name, weight, target.dest)
            return
        quantized = to_quantized(raw, parts, target.shape)
        if target.slot is not None:
            target.slot.stack.add(raw, target.slot.expert, target.slot.half, quantized)
        else:
            assert target.dest is not None
            target.dest.copy_(dequantize(quantized, target.dest.dtype))
        self.loaded.add(name)

    def _copy(self, raw: str, name: str, tensor: torch.Tensor, dest: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelLoadError(f"tensor {raw!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if dest.is_floating_point() != tensor.is_floating_point() or tensor.dtype not in (*PLAIN_DTYPES, torch.int64,
                                                                                          torch.int32):
            raise ModelLoadError(f"tensor {raw!r} has dtype {tensor.dtype}, expected {dest.dtype}")
        dest.copy_(tensor.to(dest.dtype))
        self.loaded.add(name)

    def finish(self, model: nn.Module) -> None:
        for base, parts in self.pending.items():
            if "weight" not in parts:
                raise ModelLoadError(f"scale tensor(s) {', '.join(f'{base}.{s}' for s in sorted(parts))} "
                                     f"without their weight {base}.weight")
            name = f"{base}.weight"
            to_quantized(self.raw_names.get(name, name), parts, self.targets[name].shape)  # raises
            raise ModelLoadError(f"tensor {name!r} is missing companion scale tensors (has {sorted(parts)})")
        expected = set(self.targets)
        if not any(name.startswith("mtp.") for name in self.loaded):
            mtp = getattr(model, "mtp", None)
            if mtp is not None and len(mtp):
                logger.info("checkpoint has no MTP weights: the model loads without its MTP layer(s)")
                model.mtp = nn.ModuleList()  # type: ignore[assignment]
                if getattr(model, "dspark", None) is not None:  # nor its DSpark stages
                    model.dspark = None
            expected = {name for name in expected if not name.startswith("mtp.")}
        missing = sorted(expected - self.loaded)
        if missing:
            shown = ", ".join(repr(m) for m in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise ModelLoadError(f"checkpoint is missing tensor(s) {shown}{more}")
        for module in model.modules():
            if isinstance(module, Experts):
                module.finish_loading()
