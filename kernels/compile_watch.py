"""Which Triton kernels this process compiled, and how long each took.

Triton compiles a kernel the first time it meets a new specialisation of its arguments (an integer
that is 1 or a multiple of 16, a new constexpr, an autotuner's every config for a new key), and an
autotuner benchmarks its configs then too. Inside a served step that holds every request in the
step: the engine reads :func:`compiles` around each step and says which kernels compiled in it.

:func:`install` chains two of Triton's runtime hooks (``knobs.runtime.jit_cache_hook``, called
before a compilation, and ``jit_post_compile_hook``, after it) onto whatever hooks were set, once
per process. It costs nothing on a launch that finds its kernel compiled: Triton calls neither hook
then. Under the CPU interpreter nothing compiles and the count stays 0.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Compilation:
    """One compilation: the kernel's name, the seconds it took (0 where its start was not seen)."""
    kernel: str
    seconds: float


_lock = threading.Lock()
_events: list[Compilation] = []
_started = threading.local()
_installed = False


def _kernel_name(fn: Any) -> str:
    name = getattr(fn, "name", None)
    return str(name) if name else repr(fn)


def _chain(previous: Any, ours: Any) -> Any:
    def hook(*args: Any, **kwargs: Any) -> Any:
        ours(*args, **kwargs)
        return previous(*args, **kwargs) if previous is not None else None
    return hook


def _before(*, key: Any = None, **_: Any) -> None:
    stack = getattr(_started, "stack", None)
    if stack is None:
        stack = _started.stack = []
    stack.append(time.perf_counter())


def _after(*, fn: Any = None, **_: Any) -> None:
    stack = getattr(_started, "stack", None)
    seconds = time.perf_counter() - stack.pop() if stack else 0.0
    with _lock:
        _events.append(Compilation(_kernel_name(fn), seconds))


def install() -> bool:
    """Start counting this process's Triton compilations (idempotent). False where Triton has no
    runtime hooks (an older Triton, or none installed): the count then stays 0."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
            runtime = knobs.runtime
            previous_before, previous_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return False
        runtime.jit_cache_hook = _chain(previous_before, _before)
        runtime.jit_post_compile_hook = _chain(previous_after, _after)
        _installed = True
        return True


def compiles() -> int:
    """How many compilations this process has finished since :func:`install`."""
    return len(_events)


def compiled_since(count: int) -> list[Compilation]:
    """The compilations after the first ``count`` (a value :func:`compiles` returned)."""
    with _lock:
        return list(_events[count:])
