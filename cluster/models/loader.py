"""Weight loading: reading HF-style directories (config.json, single or sharded safetensors) and
copying checkpoint tensors into a model's parameters by the model's own name map, with a clear
ModelLoadError naming any missing, unexpected-shape or unreadable tensor."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from cluster.common.errors import ModelLoadError


@dataclass(frozen=True)
class ParamTarget:
    """Where a checkpoint tensor goes: ``param`` rows ``[offset, offset + size)`` along ``dim``
    (whole parameter when ``size`` is None)."""

    param: str
    offset: int = 0
    size: int | None = None
    dim: int = 0


def read_config(model_dir: str) -> dict[str, object]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{model_dir}: no config.json (expected a HuggingFace-style model directory)",
                             param="model")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}", param="model") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object", param="model")
    return config


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelLoadError(f"{model_dir}: shard(s) named by the index are missing: {missing}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files", param="model")
    return [os.path.join(model_dir, f) for f in files]


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{path}: cannot read safetensors file: {exc}") from exc


def count_safetensors(model_dir: str) -> int:
    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            total += len(list(f.keys()))
    return total


def load_into(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
              targets: dict[str, ParamTarget], ignore: tuple[str, ...] = (),
              total: int | None = None, desc: str = "Loading weights") -> None:
    """Copy every checkpoint tensor to its target; fail naming the tensor on any mismatch, and
    name every expected tensor the checkpoint lacks."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, tensor in tqdm(weights, total=total, desc=desc, unit="tensor", leave=False):
        target = targets.get(name)
        if target is None:
            if any(name.endswith(suffix) or name.startswith(suffix) for suffix in ignore):
                continue
            raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint (shape {tuple(tensor.shape)})")
        param = params[target.param]
        dest = param.data if target.size is None else param.data.narrow(target.dim, target.offset, target.size)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ModelLoadError(f"checkpoint is missing tensor(s) {shown}{more}")
