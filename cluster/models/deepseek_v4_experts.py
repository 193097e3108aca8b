"""DeepSeek-V4 routed experts' storage: ``w13 [E, 2I, H]`` (each expert's ``w1`` rows, then its
``w3`` rows) and ``w2 [E, H, I]``, in one of two forms:

- dequantized (the CPU default): float parameters in the model dtype, filled while loading;
- native (the CUDA default, :func:`keeps_native_experts`): a ``kernels.quant.QuantizedWeight`` in
  the checkpoint's own format (MXFP4, NVFP4, FP8 128x128 blocks), stacked per expert the way
  ``kernels.triton_moe.fused_moe_triton`` reads it, so the fused MoE dequantizes in registers and
  only the packed bytes occupy memory. ``kernels.moe.fused_moe_ref`` takes the same objects, so
  the CPU can run this form too. Only the routed experts (main model and MTP) are kept native: the
  dense matrices (attention, shared expert; FP8 in released checkpoints) are dequantized to the
  model dtype everywhere.

:class:`ExpertStack` assembles one native stacked weight while loading. Its format is the first
expert tensor's; a layer whose experts mix formats stops loading with a message naming the tensor.
Two layouts cannot be stacked and fall back to a dequantized stack (same values, more memory):
plain float checkpoints (stacked as they are, in the model dtype) and FP8 ``w13`` when ``I`` is not
a multiple of 128 (``w1``'s last scale block would straddle into ``w3``). NVFP4 ``w13`` keeps one
global scale per expert: where ``w1`` and ``w3`` carry different ones, both halves are re-expressed
against the larger (their e4m3 block scales rescaled once, a logged approximation as in other
serving engines; exact when they agree, as ModelOpt exports them).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from cluster.common.errors import ModelLoadError
from cluster.models.deepseek_v4_config import DeepseekV4Args
from kernels.moe import MoEWeight
from kernels.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP, QuantizedWeight, dequantize

logger = logging.getLogger(__name__)


def keeps_native_experts(device: torch.device) -> bool:
    """Whether routed experts stay in their checkpoint format on ``device`` (CUDA: yes)."""
    return device.type == "cuda"


class ExpertStack:
    """One stacked expert weight ``[E, N, K]`` filled from per-expert checkpoint weights;
    ``halves`` = 2 for ``w13`` (``w1`` then ``w3``, each ``[N / 2, K]``), 1 for ``w2``."""

    def __init__(self, name: str, shape: tuple[int, int, int], halves: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.name, self.shape, self.halves, self.dtype, self.device = name, shape, halves, dtype, device
        self.fmt: str | None = None  # "plain" (dequantized) or a kernels.quant format
        self.data: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.half_global: torch.Tensor | None = None  # [E, halves] nvfp4 global scales

    @property
    def half_shape(self) -> tuple[int, int]:
        """Logical shape ``[N / halves, K]`` of one expert's part."""
        return self.shape[1] // self.halves, self.shape[2]

    def add(self, raw: str, expert: int, half: int, w: QuantizedWeight) -> None:
        """Place checkpoint weight ``raw`` (expert ``expert``'s part ``half``)."""
        if self.fmt is None:
            self._allocate(w)
        rows = slice(half * self.half_shape[0], (half + 1) * self.half_shape[0])
        assert self.data is not None
        if self.fmt == "plain":
            self.data[expert, rows] = dequantize(w, self.dtype)
            return
        if w.fmt != self.fmt or (w.scale is not None and self.scale is not None
                                 and w.scale.dtype != self.scale.dtype):
            got = f"{w.fmt} ({None if w.scale is None else w.scale.dtype} scales)"
            raise ModelLoadError(f"tensor {raw!r} is {got} but the other experts of {self.name} are {self.fmt} "
                                 f"({None if self.scale is None else self.scale.dtype} scales); one layer's "
                                 "experts must share a format")
        assert self.scale is not None and w.scale is not None
        self.data[expert, rows] = w.data.view(self.data.dtype)
        if self.fmt == "fp8_block":
            block_rows = slice(rows.start // FP8_BLOCK, -(-rows.stop // FP8_BLOCK))
            self.scale[expert, block_rows] = w.scale
            return
        self.scale[expert, rows] = w.scale
        if self.half_global is not None:
            assert w.global_scale is not None
            self.half_global[expert, half] = w.global_scale.float()

    def _allocate(self, w: QuantizedWeight) -> None:
        e, n, k = self.shape
        fmt = "plain" if w.fmt == "bf16" else w.fmt
        if fmt == "fp8_block" and self.halves == 2 and self.half_shape[0] % FP8_BLOCK:
            fmt = "plain"
        self.fmt = fmt
        if fmt == "plain":
            self.data = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            return
        assert w.scale is not None
        dev = self.device
        if fmt == "fp8_block":
            self.data = torch.empty(self.shape, dtype=torch.float8_e4m3fn, device=dev)
            self.scale = torch.empty((e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), dtype=w.scale.dtype, device=dev)
            return
        group = MXFP4_GROUP if fmt == "mxfp4" else NVFP4_GROUP
        self.data = torch.empty((e, n, k // 2), dtype=torch.uint8, device=dev)
        self.scale = torch.empty((e, n, k // group), dtype=w.scale.dtype, device=dev)
        if fmt == "nvfp4":
            self.half_global = torch.empty((e, self.halves), dtype=torch.float32, device=dev)

    def finish(self) -> MoEWeight:
        """The stacked weight, once every expert's parts were added."""
        assert self.fmt is not None and self.data is not None, f"{self.name}: no expert weight was loaded"
        if self.fmt == "plain":
            return self.data
        if self.half_global is None:
            return QuantizedWeight(self.fmt, self.data, self.scale)
        assert self.scale is not None
        common = self.half_global.amax(dim=1)  # [E]
        ratio = self.half_global / common[:, None]  # [E, halves], 1 where the halves agree
        if not bool((ratio == 1).all()):
            logger.warning("%s: w1 and w3 NVFP4 global scales differ; block scales rescaled to one "
                           "global scale per expert (approximate)", self.name)
            rows = self.half_shape[0]
            for half in range(self.halves):
                part = self.scale[:, half * rows:(half + 1) * rows]
                part.copy_((part.float() * ratio[:, half, None, None]).to(self.scale.dtype))
        return QuantizedWeight("nvfp4", self.data, self.scale, common)


class Experts(nn.Module):
    """The routed experts of one MoE: ``w13`` and ``w2`` (module docstring). ``native=None``
    decides by the device the model is built on (:func:`keeps_native_experts`)."""

    w13: MoEWeight | None
    w2: MoEWeight | None

    def __init__(self, args: DeepseekV4Args, dtype: torch.dtype, native: bool | None = None) -> None:
        super().__init__()
        e, i, h = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
        self.shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
        self.dtype = dtype
        self.device = torch.empty(0).device  # the device the model is being built on
        self.native = keeps_native_experts(self.device) if native is None else native
        self.stacks: dict[str, ExpertStack] = {}
        if self.native:
            self.w13 = self.w2 = None  # set by finish_loading (or directly, e.g. by benchmarks)
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)

    def stack(self, which: str, name: str) -> ExpertStack:
        """The loading stack of ``which`` ("w13" or "w2"), native form only."""
        if which not in self.stacks:
            self.stacks[which] = ExpertStack(name, self.shapes[which], 2 if which == "w13" else 1, self.dtype,
                                             self.device)
        return self.stacks[which]

    def finish_loading(self) -> None:
        for which, stack in self.stacks.items():
            setattr(self, which, stack.finish())
        self.stacks = {}
