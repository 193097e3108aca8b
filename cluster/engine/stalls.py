"""What holds a step besides its own work: Triton compiling a kernel inside it (a shape the start-up
warm-up missed), and Python's cyclic garbage collector (a full collection walks every object the
process holds, torch's and Ray's included, while the step waits for the GIL).

:class:`StallWatch` counts both, process-wide, and :meth:`StallWatch.since` says how much of each
fell between two marks (the engine marks around every step). :func:`freeze_heap` moves every object
alive at the end of start-up out of the collector's reach (``gc.freeze``), as a serving replica
does once its engine is built, so a later full collection walks only what serving allocated.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kernels import compile_watch
from kernels.compile_watch import Compilation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mark:
    compiles: int
    gc_seconds: float
    gc_collections: int


@dataclass
class Stalls:
    """What fell between two marks: the compilations, and the seconds and number of collections."""
    compilations: list[Compilation] = field(default_factory=list)
    gc_seconds: float = 0.0
    gc_collections: int = 0

    @property
    def compile_seconds(self) -> float:
        return sum(c.seconds for c in self.compilations)

    def describe(self) -> str:
        """"" when nothing stalled, else e.g. ``0.61 s compiling 2 Triton kernels (_prefill_kernel x2),
        0.02 s in 1 garbage collection``."""
        parts = []
        if self.compilations:
            names = Counter(c.kernel for c in self.compilations)
            kinds = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in names.items())
            parts.append(f"{self.compile_seconds:.2f} s compiling {len(self.compilations)} Triton kernels ({kinds})")
        if self.gc_collections:
            parts.append(f"{self.gc_seconds:.2f} s in {self.gc_collections} garbage collections")
        return ", ".join(parts)


class _GcClock:
    """Seconds spent in the cyclic collector, all generations, since it was installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self.slowest = 0.0
        self._began: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            took = time.perf_counter() - self._began
            self._began = None
            self.seconds += took
            self.collections += 1
            self.slowest = max(self.slowest, took)


_lock = threading.Lock()
_gc_clock: _GcClock | None = None


def _install_gc_clock() -> _GcClock:
    global _gc_clock
    with _lock:
        if _gc_clock is None:
            _gc_clock = _GcClock()
            gc.callbacks.append(_gc_clock)
        return _gc_clock


class StallWatch:
    """Marks and differences of the process's compilations and collections (cheap: a step reads
    three numbers)."""

    def __init__(self) -> None:
        compile_watch.install()
        self._gc = _install_gc_clock()

    def mark(self) -> Mark:
        return Mark(compile_watch.compiles(), self._gc.seconds, self._gc.collections)

    def since(self, mark: Mark) -> Stalls:
        compiles = compile_watch.compiles()
        return Stalls(compile_watch.compiled_since(mark.compiles) if compiles > mark.compiles else [],
                      self._gc.seconds - mark.gc_seconds, self._gc.collections - mark.gc_collections)

    @property
    def slowest_gc_seconds(self) -> float:
        return self._gc.slowest


def freeze_heap() -> int:
    """Collect once, then freeze every surviving object out of the collector's generations (what a
    serving replica does after start-up: its model, Ray's and torch's modules are alive for good,
    and a full collection that walks them holds a step for up to a second). Says so, and returns
    how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of the garbage collector's reach", frozen)
    return frozen
