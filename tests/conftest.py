"""Test-wide set-up: without a GPU, Triton kernels run in Triton's CPU interpreter, whichever test
directory imports them first. ``TRITON_INTERPRET`` must be set before anything imports triton,
hence at import time here (pytest imports conftest files before test modules)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _bound_gpu_kv_cache(limit: int) -> None:
    """``bench/gpucheck.py`` runs the gpu test files in parallel processes on one GPU: an engine
    that is not told its KV cache size takes ``limit`` bytes there, not 90% of the GPU's free
    memory (which would leave the other processes nothing)."""
    from cluster.engine.engine import LLMEngine

    default = LLMEngine._default_kv_bytes

    def bounded(self: LLMEngine) -> int:
        return min(default(self), limit) if self.device.type == "cuda" else default(self)

    LLMEngine._default_kv_bytes = bounded  # type: ignore[method-assign]


if os.environ.get("PD_TEST_GPU_KV_BYTES"):
    _bound_gpu_kv_cache(int(os.environ["PD_TEST_GPU_KV_BYTES"]))


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalar tensors into ints with ``int(array)``, which NumPy
    >= 2.4 refuses for 1-element arrays (triton-lang/triton#9171, fixed upstream by #9172); loops
    with tensor bounds (``range(start, end)``) hit it. Apply the upstream fix."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_squeezes_index", False):
        return

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._squeezes_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched



if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()
