"""Ahead-of-time compilation of Triton kernels for a GPU architecture on a machine without one
(Triton ships ptxas): proves a kernel builds for sm_90 / sm_120 and reports its shared memory.

Must run in a process without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` builds no
compilable function). Arguments may be ``meta`` tensors: only dtypes and alignment matter."""
from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

#: Shared memory a block may use on sm_120 (consumer/workstation Blackwell): 99 KB.
SM120_SHARED_LIMIT = 101376


def compile_for(kernel: Any, capability: tuple[int, int], *args: Any, **kwargs: Any) -> Any:
    """Compile ``kernel`` (a JITFunction, possibly under autotune/heuristics decorators) for ``capability`` with the
    given call arguments (constexprs and launch options such as ``num_warps`` as kwargs)."""
    fn = kernel
    while not isinstance(fn, JITFunction):  # unwrap autotune / heuristics decorators
        fn = fn.fn
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args,
                                                          specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
