"""Test-wide set-up: without a GPU, Triton kernels run in Triton's CPU interpreter, whichever test
directory imports them first. ``TRITON_INTERPRET`` must be set before anything imports triton,
hence at import time here (pytest imports conftest files before test modules)."""
from __future__ import annotations

import gc
import os

import pytest
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


# Tests that start Ray (a local instance, Serve's proxy on a port, `serve run`, `serve build`) or time
# a served run. Under pytest-xdist (the README's test command runs two workers) they all go to one
# worker, one after another: two Ray instances at once would share /tmp/ray's session and contend
# for ports, and a served timing beside another Ray run would measure the other run.
RAY_TESTS = ("tests/e2e/", "tests/router/test_serve_routing.py", "tests/router/test_planner.py",
             "tests/router/test_planner_simulation.py", "tests/deploy/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = str(config.rootpath)
    for item in items:
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if path.startswith(RAY_TESTS):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(autouse=True)
def _collect_cycles():
    """Collect reference cycles after every test. Tests wrap engines' methods in closures and
    spies that refer back to the engine (a cycle): freed only by a full collection, which CPython
    runs rarely in a process this size, so every such engine's KV cache (1 GiB on the CPU) stayed
    alive across tests. The DeepSeek-V4 speculation files grew this process by 18 GiB and a CI run
    was killed for memory."""
    yield
    gc.collect()
