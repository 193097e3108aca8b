"""What every Triton kernel module shares: whether kernels run under the CPU interpreter
(``TRITON_INTERPRET=1``), autotune config lists that collapse to one config there, and device
facts (multiprocessor count, shared memory per block) used by launch heuristics.

Under the interpreter, bf16 arithmetic and ``tl.dot`` on bf16 are unreliable, so kernels take an
``UPCAST`` constexpr (``INTERPRET``) and compute in float32 when it is set. The environment
variable must be set before this module is first imported.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
#: ``PD_KERNELS_PORTABLE_DECODE=1`` turns off the inline-PTX / hardware weight decoders of
#: ``kernels.triton_quant`` (a debugging switch: the portable decoders are slower, same results).
PORTABLE_DECODE: bool = os.environ.get("PD_KERNELS_PORTABLE_DECODE") == "1"


@triton.jit
def exact_dot(a, b, acc=None):
    """``tl.dot``, multiplied in full float32 precision when the operands are float32: Triton's
    default rounds float32 operands to tf32 (about 1e-3 relative), enough to flip the V4 indexer's
    top-k or a near-tied greedy token against the CPU path on long prompts. Other dtypes compile
    exactly as ``tl.dot`` (the branch is resolved at compile time)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


def autotune_configs(configs: list[triton.Config], interpreted: triton.Config) -> list[triton.Config]:
    """The configs to autotune over: ``configs`` on a GPU, exactly ``interpreted`` under the
    interpreter (where benchmarking is meaningless and every config costs test time). Every
    autotuner here keeps its results on disk (``cache_results``, beside Triton's compile cache):
    a replica that restarts on the same machine neither compiles nor benchmarks again."""
    return [interpreted] if INTERPRET else configs


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory_per_block() -> int:
    """Shared memory a block may use on the current GPU (99 KB on sm_120, 227 KB on sm_90); without
    a GPU, sm_90's, the most of any target (configs are then only compiled, never launched)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))
    return 227 * 1024


def staged_tile_bytes(config: triton.Config, *tile_bytes: float) -> int:
    """Shared memory a pipelined K loop holds for ``config``: ``num_stages - 1`` stages of the
    tiles each iteration loads (``tile_bytes``, one per tile). Autotuners prune configs with it
    against :func:`shared_memory_per_block`."""
    return int((config.num_stages - 1) * sum(tile_bytes))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small fixed number on CPU (interpreter)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels vectorize along the last dim; other dims may be strided views."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")
