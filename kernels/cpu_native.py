"""The native CPU matmuls of ``cpu_native.c``: GGUF's Q4_1 and Q8_0 blocks times float32
activations rounded to 16 bits per block of 32, as integer dot products on AVX2 (llama.cpp's way
on such a core, with 16-bit activations where it takes 8: see the C file's header).

The C file is compiled once per source version with the system C compiler (``$CC``, else ``cc``)
into the user's cache directory and loaded with ctypes, so it needs no torch headers and builds in
about a second. Where it cannot run (not x86-64, no AVX2/FMA/F16C, no compiler, a failed build, or
``PD_CPU_NATIVE=0``), ``status()`` says why and the callers keep torch's kernels: nothing here is
required.

Layouts: one row per output feature, of ``nb = in_features / 32`` blocks, GGUF's bytes per block
with the scales apart from the codes (so the kernel converts them 8 at a time):
- Q4_1 (20 bytes a block): ``d [nb]`` and ``m [nb]`` float16, then codes ``[nb, 16]`` (byte ``j``:
  code ``j`` in the low nibble, ``j + 16`` in the high); ``w = d * q + m``, ``q`` in 0..15.
- Q8_0 (34 bytes a block): ``d [nb]`` float16, then codes ``[nb, 32]`` int8 in -127..127; ``w = d * q``.
The scales lead each row so that it is read front to back.

On a CPU with AVX-512 VNNI (``vnni_status``), new blocks are also repacked (``pack_vnni``: groups of
16 output features, codes as bytes, float32 scales) for the C file's VNNI kernel, which then takes
every call: 2-3x the AVX2 kernel's speed at 1 to 256 rows on SmolLM2's shapes, so there is no
crossover to a GEMM, and a row's numbers are the same whatever the rows beside it, in decode steps
and prompt chunks alike. Its activation codes stop at 32639 (``QMAX_VNNI``: two signed bytes).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

QK = 32
QMAX = 32767.0  # activations: 16-bit codes per block of 32
_ABI = 8
QMAX_VNNI = 32639.0  # the VNNI kernel's activation codes: 127 * 256 + 127, two signed bytes
_VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
_SOURCE = Path(__file__).with_name("cpu_native.c")
# -ffp-contract=off: the rotation must round each product and sum as torch does (no fused multiply-adds
# but the ones written as such)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


class NativeUnavailable(RuntimeError):
    """The native CPU kernels cannot run here (the message says why)."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    base = os.environ.get("PD_CPU_NATIVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pd-cluster")
    return Path(base)


def _build(source: bytes) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise NativeUnavailable("no C compiler (set CC, or install gcc)")
    digest = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    cache = _cache_dir()
    target = cache / f"cpu_native-{digest}.so"
    if target.exists():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "pd-cluster"
        cache.mkdir(parents=True, exist_ok=True)
        target = cache / target.name
    # Build beside the target and rename: replicas starting at once never load a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, "-o", partial, str(_SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise NativeUnavailable(f"{compiler} failed to build cpu_native.c: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def _library() -> ctypes.CDLL:
    if os.environ.get("PD_CPU_NATIVE", "1") == "0":
        raise NativeUnavailable("turned off (PD_CPU_NATIVE=0)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeUnavailable(f"the native kernels are written for x86-64 AVX2; this CPU is {platform.machine()}")
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        raise NativeUnavailable(f"this CPU lacks {', '.join(sorted(missing))}")
    lib = ctypes.CDLL(str(_build(_SOURCE.read_bytes())))
    if lib.pd_native_abi() != _ABI:
        raise NativeUnavailable("the built library does not match this module (ABI)")
    for name in ("pd_q4_1_matmul", "pd_q8_0_matmul"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.pd_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    lib.pd_rms_norm.restype = ctypes.c_int
    p = ctypes.c_void_p
    lib.pd_round_activations.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, ctypes.c_int]
    lib.pd_round_activations.restype = ctypes.c_int
    lib.pd_rope_kv_write.argtypes = [p, p, ctypes.c_int64, p, p, p]
    lib.pd_decode_attention.argtypes = [p, p, ctypes.c_int64, p, p, p]
    lib.pd_decode_attention_layer.argtypes = [p, p, ctypes.c_int64, p, p, p, p]
    for fn in (lib.pd_rope_kv_write, lib.pd_decode_attention, lib.pd_decode_attention_layer):
        fn.restype = ctypes.c_int
    lib.pd_vnni_pack.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, p, ctypes.c_int]
    lib.pd_vnni_pack.restype = ctypes.c_int
    lib.pd_vnni_matmul.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, ctypes.c_int64, p, ctypes.c_int, ctypes.c_int]
    lib.pd_vnni_matmul.restype = ctypes.c_int
    return lib


@functools.cache
def status() -> tuple[bool, str]:
    """(available, why): whether the native kernels run here, and the reason (for logs and
    ``/v1/backends``)."""
    try:
        _library()
    except (NativeUnavailable, OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    return True, "built with the system C compiler (AVX2, FMA, F16C; OpenMP)"


def available() -> bool:
    return status()[0]


@functools.cache
def vnni_status() -> tuple[bool, str]:
    """(on, why): whether new blocks also get the AVX-512 VNNI layout, which every row count then
    takes (see the C file's VNNI section); ``PD_CPU_NATIVE_VNNI=0`` keeps the AVX2 kernel."""
    ok, why = status()
    if not ok:
        return False, why
    if os.environ.get("PD_CPU_NATIVE_VNNI", "1") == "0":
        return False, "turned off (PD_CPU_NATIVE_VNNI=0)"
    missing = _VNNI_FLAGS - _cpu_flags()
    if missing:
        return False, f"this CPU lacks {', '.join(sorted(missing))}"
    return True, "AVX-512 VNNI (vpdpbusd over 16 output features a register)"


def vnni_available() -> bool:
    return vnni_status()[0]


@dataclass(frozen=True)
class NativeBlocks:
    """A weight ``[out_features, in_features]`` in GGUF blocks (``fmt``: ``"q4_1"`` or ``"q8_0"``)."""
    data: torch.Tensor  # uint8 [out_features, in_features / 32 * block bytes]
    fmt: str
    out_features: int
    in_features: int
    #: The same weight repacked for the VNNI kernel (``pack_vnni``), which then takes every call; or None.
    vnni: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes a call reads: the VNNI layout where there is one, else the blocks."""
        return self.vnni.numel() if self.vnni is not None else self.data.numel()


def pack_vnni(blocks: NativeBlocks) -> NativeBlocks:
    """``blocks`` with their VNNI repacking (groups of 16 output features; the C file says the
    layout): 1.25 bytes a weight beside the blocks' 0.625 (Q4_1)."""
    lib = _library()
    n, k = blocks.out_features, blocks.in_features
    groups = -(-n // 16)
    out = torch.empty(groups * (k // QK) * lib.pd_vnni_block_bytes(), dtype=torch.uint8)
    rc = lib.pd_vnni_pack(blocks.data.data_ptr(), n, k, int(blocks.fmt == "q4_1"), out.data_ptr(),
                          torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"pd_vnni_pack failed ({rc})")
    return dataclasses.replace(blocks, vnni=out)


def _maybe_vnni(blocks: NativeBlocks, vnni: bool | None) -> NativeBlocks:
    return pack_vnni(blocks) if (vnni_available() if vnni is None else vnni) else blocks


def pack_q4_1(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              vnni: bool | None = None) -> NativeBlocks:
    """``codes [N, K]`` in 0..15, ``scale``/``minimum [N, K / 32]`` (rounded to float16, GGUF's
    own precision) as Q4_1 rows; ``vnni``: also repacked for the VNNI kernel (None: where it runs)."""
    n, k = codes.shape
    if k % QK or scale.shape != (n, k // QK) or minimum.shape != scale.shape:
        raise ValueError(f"a [{n}, {k}] Q4_1 weight needs K a multiple of {QK} and [{n}, {k // QK}] scales")
    c = codes.to(torch.uint8).reshape(n, k // QK, QK)
    qs = (c[..., : QK // 2] | (c[..., QK // 2:] << 4)).reshape(n, -1)  # [N, nb * 16]
    d = scale.to(torch.float16).contiguous().view(torch.uint8)        # [N, nb * 2]
    m = minimum.to(torch.float16).contiguous().view(torch.uint8)
    return _maybe_vnni(NativeBlocks(torch.cat([d, m, qs], dim=1).contiguous(), "q4_1", n, k), vnni)


def pack_q8_0(weight: torch.Tensor, vnni: bool | None = None) -> NativeBlocks:
    """``weight [N, K]`` as Q8_0 rows: per 32 a float16 scale ``max |w| / 127`` and codes
    ``round(w / d)``. A weight that came from Q8_0 blocks comes back exactly. ``vnni`` as in
    ``pack_q4_1``."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"a [{n}, {k}] Q8_0 weight needs K a multiple of {QK}")
    w = weight.float().reshape(n, k // QK, QK)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    d32 = d.float()[..., None]
    codes = torch.where(d32 > 0, w / d32.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(w))
    codes = codes.round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return _maybe_vnni(NativeBlocks(torch.cat([d.contiguous().view(torch.uint8), codes.view(torch.uint8)],
                                           dim=1).contiguous(), "q8_0", n, k), vnni)


def dequantize(weight: NativeBlocks) -> torch.Tensor:
    """The float32 weight the rows hold."""
    n, k = weight.out_features, weight.in_features
    nb = k // QK
    if weight.fmt == "q4_1":
        d = weight.data[:, : nb * 2].contiguous().view(torch.float16).float()
        m = weight.data[:, nb * 2: nb * 4].contiguous().view(torch.float16).float()
        qs = weight.data[:, nb * 4:].reshape(n, nb, 16)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        return (codes * d[..., None] + m[..., None]).reshape(n, k)
    d = weight.data[:, : nb * 2].contiguous().view(torch.float16).float()
    codes = weight.data[:, nb * 2:].contiguous().view(torch.int8).float().reshape(n, nb, QK)
    return (codes * d[..., None]).reshape(n, k)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` as the kernels round it: per block of 32, ``e * round(x / e)`` with
    ``e = max |x| / 32767`` (float32). A many-row GEMM over the dequantized weight fed these takes
    the kernels' numbers up to the order of its sums. One native call (``pd_round_activations``:
    about a tenth of a batch-32 decode step went to the eight torch ops of the reference), the
    same numbers bit for bit; the reference where the library does not run."""
    if available() and x.dim() == 2 and x.shape[1] % QK == 0:
        x = x.to(torch.float32).contiguous()
        y = torch.empty_like(x)
        if x.numel():
            rc = _library().pd_round_activations(x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr(),
                                                 torch.get_num_threads())
            if rc != 0:
                raise RuntimeError(f"pd_round_activations failed ({rc})")
        return y
    return round_activations_ref(x)


def _block_codes(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]``'s codes per block of 32, ``round(x * (qmax / amax))`` (``[M, K / 32, 32]``,
    float32 integers; torch evaluates ``qmax / amax`` as ``qmax * (1 / amax)``, as the C does), and
    their scales ``amax / qmax`` (``[M, K / 32, 1]``)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // QK, QK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, qmax / amax.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(amax))
    return (blocks * inv).round(), amax / qmax


def round_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """``round_activations`` in torch ops (the reference)."""
    codes, scale = _block_codes(x, QMAX)
    return (codes * scale).reshape(x.shape)


def matmul_ref(x: torch.Tensor, weight: NativeBlocks) -> torch.Tensor:
    """What ``matmul`` computes, in float64 from the same rounded activations (for tests): the
    VNNI kernel's codes where the weight has its layout, else the AVX2 kernel's."""
    xr = round_activations_vnni_ref(x) if weight.vnni is not None else round_activations_ref(x)
    return (xr.double() @ dequantize(weight).double().t()).float()


def vnni_codes_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VNNI kernel's activation codes of ``x [M, K]`` per block of 32, in -32639..32639, and
    their scales (``_block_codes`` at ``QMAX_VNNI``)."""
    return _block_codes(x, QMAX_VNNI)


def round_activations_vnni_ref(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` as the VNNI kernel rounds it: its codes times their scale, in float64 (exact)."""
    codes, scale = vnni_codes_ref(x)
    return (codes.double() * scale.double()).reshape(x.shape)


def matmul(x: torch.Tensor, weight: NativeBlocks) -> torch.Tensor:
    """``x [M, K]`` (float32) times ``weight``'s transpose -> ``[M, N]`` float32."""
    lib = _library()
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [M, {weight.in_features}], got {tuple(x.shape)}")
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    m = x.shape[0]
    y = x.new_empty((m, weight.out_features))
    if m == 0:
        return y
    if weight.vnni is not None:
        fn = lib.pd_vnni_matmul
        rc = fn(weight.vnni.data_ptr(), weight.out_features, weight.in_features, x.data_ptr(), m, y.data_ptr(),
                torch.get_num_threads(), int(weight.fmt == "q4_1"))
    else:
        fn = lib.pd_q4_1_matmul if weight.fmt == "q4_1" else lib.pd_q8_0_matmul
        rc = fn(weight.data.data_ptr(), weight.out_features, weight.in_features, x.data_ptr(), m, y.data_ptr(),
                torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{fn.__name__} failed ({rc})")
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kernels.norm.rms_norm_ref``'s contract, natively for float32 CPU rows: returns
    ``(norm(x + residual) * weight, x + residual)`` (without a residual the second is None): one
    call where the reference takes five torch ops. Other dtypes and devices take the reference.
    Each row's numbers are the same whatever the rows beside it."""
    if (x.dtype is not torch.float32 or weight.dtype is not torch.float32 or x.device.type != "cpu"
            or (residual is not None and residual.dtype is not torch.float32)
            or out_dtype not in (None, torch.float32)):
        from kernels.norm import rms_norm_ref
        return rms_norm_ref(x, weight, eps, residual, out_dtype)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous():
            residual = residual.expand_as(x).contiguous()
        summed = torch.empty_like(x)
    rc = _library().pd_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                                x.numel() // dim, dim, eps, out.data_ptr(),
                                None if summed is None else summed.data_ptr())
    if rc != 0:
        raise RuntimeError(f"pd_rms_norm failed ({rc})")
    return out, summed


# ---- decode attention over the paged KV cache, and the rotation + KV write before it ----

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _Attn(ctypes.Structure):
    """``pd_attn`` of the C file: one step's shapes, tables and cache layout."""
    _fields_ = [(name, ctypes.c_int64) for name in
                ("rows", "hq", "hk", "d", "rot", "block_size", "window", "block_stride", "entry_stride", "dtype",
                 "threads")] + [
        ("scale", ctypes.c_float), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("cs_stride", ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p)]


def cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int] | None:
    """(elements between blocks, between a block's entries, the C dtype code) of one layer's
    ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]``, or None where the kernels do not
    read that cache (another dtype or device, entries not contiguous, K and V laid out apart)."""
    code = _CACHE_DTYPES.get(k_cache.dtype)
    if (code is None or v_cache.dtype is not k_cache.dtype or k_cache.device.type != "cpu" or k_cache.dim() != 4
            or v_cache.stride() != k_cache.stride() or v_cache.shape != k_cache.shape
            or k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3]):
        return None
    return k_cache.stride(0), k_cache.stride(1), code


def _int_tensor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype is dtype and x.is_contiguous() else x.to(dtype).contiguous()


def _args(k_cache: torch.Tensor, layout: tuple[int, int, int], **fields: object) -> _Attn:
    """A ``pd_attn`` for one layer's cache (its layout from ``cache_layout``) and the step's other
    ``fields``; threads as torch's."""
    return _Attn(hk=k_cache.shape[2], block_size=k_cache.shape[1], block_stride=layout[0], entry_stride=layout[1],
                 dtype=layout[2], threads=torch.get_num_threads(), **fields)


def qkv_prepare(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                interleaved: bool = False) -> torch.Tensor:
    """``kernels.qkv_prepare.qkv_prepare_ref``'s contract in one native call for float32 rows on
    a CPU (the same numbers: each product and sum of the rotation rounded as torch rounds them,
    the cache's dtype rounded to nearest even). q/k norms, interleaved rotation, other dtypes and
    caches the kernels do not read take the reference."""
    layout = cache_layout(k_cache, v_cache)
    rows = qkv.shape[0]
    if (layout is None or q_norm is not None or k_norm is not None or interleaved or qkv.dtype is not torch.float32
            or qkv.dim() != 2 or qkv.stride(1) != 1 or cos.dtype is not torch.float32 or head_dim % 8
            or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or k_cache.shape[2] != num_kv_heads
            or rows == 0):
        from kernels.qkv_prepare import qkv_prepare_ref
        return qkv_prepare_ref(qkv, num_q_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, slot_mapping,
                               q_norm, k_norm, eps, interleaved)
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = _int_tensor(slot_mapping, torch.int64)
    a = _args(k_cache, layout, rows=rows, hq=num_q_heads, d=head_dim, rot=2 * cos.shape[-1], cos=cos.data_ptr(),
              sin=sin.data_ptr(), cs_stride=cos.shape[-1], slots=slots.data_ptr())
    q = qkv.new_empty((rows, num_q_heads, head_dim))
    rc = _library().pd_rope_kv_write(ctypes.byref(a), qkv.data_ptr(), qkv.stride(0), q.data_ptr(),
                                     k_cache.data_ptr(), v_cache.data_ptr())
    if rc != 0:
        raise RuntimeError(f"pd_rope_kv_write failed ({rc})")
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: object, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """``kernels.attention.paged_attention_ref``'s contract: one-query sequences (a decode step's,
    and a mixed step's decoding requests beside prompt chunks) of float32 queries over a cache
    the kernels read run natively in one call, one task per (sequence, KV head), each row's
    numbers the same whatever rows share the step; a mixed step's prompt rows take the
    reference per sequence, and other inputs the reference."""
    layout = cache_layout(k_cache, v_cache)
    if (layout is None or q.dtype is not torch.float32 or q.dim() != 3
            or q.shape[2] % 8 or q.stride(2) != 1 or q.stride(1) != q.shape[2]):
        from kernels.attention import paged_attention_ref
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window)  # type: ignore[arg-type]
    if not meta.decode_only:  # type: ignore[attr-defined]
        return _mixed_attention(q, k_cache, v_cache, meta, scale, sliding_window, layout)
    out = q.new_empty(q.shape)
    if q.shape[0] == 0:
        return out
    _decode_rows(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,  # type: ignore[attr-defined]
                 layout, out)
    return out


def _mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any, scale: float,
                     sliding_window: int | None, layout: tuple[int, int, int]) -> torch.Tensor:
    """A step of prompt chunks (or verified drafts) beside one-query rows: the one-query sequences'
    rows gathered into one native call (the reference's per-sequence loop cost a gather and an
    SDPA call for each, about 0.25 ms a sequence and layer on a CPU, more than the rest of the
    step), the others through the reference's per-sequence path."""
    from kernels.attention import attend_sequences
    starts = meta.query_start_loc_cpu
    single = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
    out = q.new_empty(q.shape)
    if single:
        rows = torch.tensor([starts[i] for i in single], dtype=torch.int64)
        seqs = torch.tensor(single, dtype=torch.int64)
        part = q.new_empty((len(single), *q.shape[1:]))
        _decode_rows(q.index_select(0, rows), k_cache, v_cache, meta.block_tables.index_select(0, seqs),
                     meta.seq_lens.index_select(0, seqs), scale, sliding_window, layout, part)
        out.index_copy_(0, rows, part)
    chosen = set(single)
    attend_sequences(q, k_cache, v_cache, meta, scale, sliding_window,
                     [i for i in range(meta.num_seqs) if i not in chosen], out)
    return out


def _decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens_t: torch.Tensor, scale: float, sliding_window: int | None, layout: tuple[int, int, int],
                 out: torch.Tensor) -> None:
    """One query row per sequence (``q [rows, Hq, D]`` contiguous), natively, into ``out``."""
    rows, hq, d = q.shape
    tables = _int_tensor(block_tables, torch.int32)
    seq_lens = _int_tensor(seq_lens_t, torch.int32)
    a = _args(k_cache, layout, rows=rows, hq=hq, d=d, window=sliding_window or 0, scale=scale,
              block_tables=tables.data_ptr(), bt_stride=tables.stride(0), seq_lens=seq_lens.data_ptr())
    rc = _library().pd_decode_attention(ctypes.byref(a), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                        v_cache.data_ptr(), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"pd_decode_attention failed ({rc})")


class DecodeAttention:
    """One decode step's attention for every layer of a model, natively: the step's tables set
    once, then per layer one call that rotates q and k, writes k and v to the cache and attends
    (the same numbers as ``qkv_prepare`` then ``paged_attention``). The tensors given must live
    until the step's last ``layer`` call."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        layout = cache_layout(k_cache, v_cache)
        if (layout is None or head_dim % 8 or cos.dtype is not torch.float32
                or k_cache.shape[2:] != (num_kv_heads, head_dim)):
            raise ValueError("the native decode attention does not read this cache or these shapes")
        rows = slot_mapping.shape[0]
        self._keep = (cos.contiguous(), sin.contiguous(), _int_tensor(slot_mapping, torch.int64),
                      _int_tensor(block_tables, torch.int32), _int_tensor(seq_lens, torch.int32))
        cos, sin, slots, tables, lens = self._keep
        self._args = _args(k_cache, layout, rows=rows, hq=num_q_heads, d=head_dim, rot=2 * cos.shape[-1],
                           scale=scale, cos=cos.data_ptr(), sin=sin.data_ptr(), cs_stride=cos.shape[-1],
                           slots=slots.data_ptr(), block_tables=tables.data_ptr(), bt_stride=tables.stride(0),
                           seq_lens=lens.data_ptr())
        self._ref = ctypes.byref(self._args)
        self._fn = _library().pd_decode_attention_layer
        self._q = torch.empty((rows, num_q_heads, head_dim))
        self.out = torch.empty((rows, num_q_heads * head_dim))

    def layer(self, qkv: torch.Tensor, k_cache_ptr: int, v_cache_ptr: int) -> torch.Tensor:
        """``qkv [rows, (Hq + 2 Hkv) D]`` float32 (rows contiguous) -> the attention's output
        ``[rows, Hq D]`` (one buffer, overwritten by the next call)."""
        rc = self._fn(self._ref, qkv.data_ptr(), qkv.stride(0), self._q.data_ptr(), k_cache_ptr, v_cache_ptr,
                      self.out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"pd_decode_attention_layer failed ({rc})")
        return self.out
