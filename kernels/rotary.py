"""Rotary position embedding: cos/sin tables (with rope scaling) and their application.

Two layouts: ``neox`` (rotate halves, HF Llama/Qwen) and ``interleaved`` (rotate even/odd pairs,
DeepSeek)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, object] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` in float32, with ``rope_scaling`` types default and llama3."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])  # type: ignore[arg-type]
        low = float(scaling.get("low_freq_factor", 1.0))  # type: ignore[arg-type]
        high = float(scaling.get("high_freq_factor", 4.0))  # type: ignore[arg-type]
        old_len = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [T]`` -> ``cos, sin [T, rotary_dim // 2]`` in float32."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x [T, H, D]``; the rest pass through.

    Computed in float32, returned in ``x``'s dtype.
    """
    rot = cos.shape[-1] * 2
    xr, rest = x[..., :rot].float(), x[..., rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = out.to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
