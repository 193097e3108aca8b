"""GGUF checkpoints: reads a llama.cpp GGUF file (llama, qwen2, qwen3 architectures) into what the
model registry needs: an HF-style config dict, float32 tensors under HF names (dequantized one at a
time, so memory holds one tensor beyond the model), and a tokenizer rebuilt from the metadata.

It follows transformers' GGUF loader (modeling_gguf_pytorch_utils.py, integrations/gguf/) so that
the two give the same weights and the same token ids, without importing transformers at run time.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from cluster.common.errors import ModelLoadError, UnsupportedArchitectureError
from cluster.models import gguf_reader
from cluster.models.gguf_reader import GGUFTensor
from cluster.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Architecture:
    hf_name: str
    #: llama.cpp's converter interleaves the rotary halves of Q/K rows for llama (its rope kernel
    #: rotates adjacent pairs); qwen files keep HF's layout because llama.cpp runs them in NEOX mode.
    permuted_qk: bool
    #: Qwen2 always has q/k/v biases; for llama the file's tensors say.
    qkv_bias: bool | None


_ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", permuted_qk=True, qkv_bias=None),
    "qwen2": _Architecture("Qwen2ForCausalLM", permuted_qk=False, qkv_bias=True),
    "qwen3": _Architecture("Qwen3ForCausalLM", permuted_qk=False, qkv_bias=False),
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<suffix>weight|bias)")

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as transformers' GGUF loader has them; any other
# value keeps GPT-2's regex (ByteLevel's own), which is also what transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# What a malformed file makes the reader or numpy raise (bad magic, short reads, bad shapes).
_READ_ERRORS = (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError)


@dataclass
class GGUFCheckpoint:
    """A parsed GGUF file; ``tensors()`` dequantizes lazily from the memory-mapped file."""

    path: str
    config: dict[str, Any]
    tokenizer: Tokenizer | None
    #: The file's tensors in file order (their data mapped, read on use).
    _tensors: list[GGUFTensor] = field(repr=False)
    #: HF name of each tensor, in file order.
    hf_names: list[str] = field(repr=False)

    @property
    def num_tensors(self) -> int:
        return len(self.hf_names)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF layout) for every tensor in the file, in file order."""
        permute = _ARCHITECTURES[self.config["model_type"]].permuted_qk
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        for tensor, name in zip(self._tensors, self.hf_names):
            weights = _dequantize(tensor, self.path)
            if permute and ".self_attn.q_proj." in name:
                weights = _unpermute_rotary(weights, heads)
            elif permute and ".self_attn.k_proj." in name:
                weights = _unpermute_rotary(weights, kv_heads)
            yield name, weights


    def tensor_types(self) -> dict[str, str]:
        """HF name -> the file's type for that tensor (``"Q4_1"``, ``"Q8_0"``, ``"F32"``...)."""
        return {name: t.tensor_type.name for t, name in zip(self._tensors, self.hf_names)}

    def q4_1_tensors(self) -> Iterator[tuple[str, Q41Blocks]]:
        """(HF name, its 4-bit codes, scales and minimums, undequantized) for every Q4_1 tensor,
        in HF layout (q/k rows unpermuted as ``tensors()`` does)."""
        permute = _ARCHITECTURES[self.config["model_type"]].permuted_qk
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        for tensor, name in zip(self._tensors, self.hf_names):
            if tensor.tensor_type != GGMLQuantizationType.Q4_1:
                continue
            blocks = _q4_1_blocks(tensor, self.path)
            if permute and ".self_attn.q_proj." in name:
                blocks = blocks.map(lambda t: _unpermute_rotary(t, heads))
            elif permute and ".self_attn.k_proj." in name:
                blocks = blocks.map(lambda t: _unpermute_rotary(t, kv_heads))
            yield name, blocks


@dataclass(frozen=True)
class Q41Blocks:
    """A Q4_1 tensor ``[N, K]`` as stored: per group of 32 along K, ``w = scale * code + minimum``."""

    codes: torch.Tensor    # [N, K] uint8, 0..15
    scale: torch.Tensor    # [N, K / 32] float32 (stored as float16)
    minimum: torch.Tensor  # [N, K / 32] float32 (stored as float16)

    def map(self, fn: Any) -> Q41Blocks:
        """The same rows rearranged by ``fn`` (a function of a tensor's leading dimension)."""
        return Q41Blocks(fn(self.codes), fn(self.scale), fn(self.minimum))

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        grouped = self.codes.float().reshape(n, k // Q4_1_GROUP, Q4_1_GROUP)
        return (grouped * self.scale[..., None] + self.minimum[..., None]).reshape(n, k)


Q4_1_GROUP = 32


def _q4_1_blocks(tensor: GGUFTensor, path: str) -> Q41Blocks:
    """Split a Q4_1 tensor's bytes: each block of 32 weights is float16 d, float16 m, then 16
    bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31."""
    n, k = (int(d) for d in reversed(tensor.shape.tolist()))
    try:
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // Q4_1_GROUP, 4 + Q4_1_GROUP // 2)
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"{path}: cannot read tensor {tensor.name!r}: {exc}") from exc
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., 4:]
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).reshape(n, k)
    return Q41Blocks(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d), torch.from_numpy(m))


def read_gguf(path: str) -> GGUFCheckpoint:
    """Parse ``path``'s metadata and tensor index; raise ModelLoadError if it is not a usable GGUF."""
    try:
        metadata, tensors = gguf_reader.read(path)
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}", param="model") from exc
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHITECTURES))}")
    tensor_names = [t.name for t in tensors]
    hf_names = [_hf_tensor_name(name, path) for name in tensor_names]
    try:
        config = _build_config(arch, metadata, set(tensor_names), path)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: malformed GGUF metadata: {exc}", param="model") from exc
    return GGUFCheckpoint(path, config, _build_tokenizer(metadata, path), tensors, hf_names)


# --- tensors ------------------------------------------------------------------------------------

def _hf_tensor_name(name: str, path: str) -> str:
    match = _TENSOR_NAME.fullmatch(name)
    if match is not None:
        base, suffix, layer = match["base"], match["suffix"], match["layer"]
        if layer is None and base in _TOP_LEVEL_NAMES:
            return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
        if layer is not None and base in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{suffix}"
    if name == "rope_freqs.weight":
        # Llama 3.1-style rope scaling, stored only as per-frequency factors: the config has no way
        # to say it, and dropping it would silently change every position's rotation.
        raise UnsupportedArchitectureError(f"{path}: GGUF rope frequency factors (rope_freqs.weight, "
                                           "llama3 rope scaling) are not supported")
    raise UnsupportedArchitectureError(f"{path}: GGUF tensor {name!r} has no counterpart in the llama family")


def _dequantize(tensor: GGUFTensor, path: str) -> torch.Tensor:
    # GGUF lists dimensions fastest-first (ggml's ne[0] is the row length); torch wants them reversed.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type == GGMLQuantizationType.Q4_1 and len(shape) == 2:
        # torch over the split blocks: the same float32 products and sums as gguf.quants, 2.4x faster
        return _q4_1_blocks(tensor, path).dequantize()
    try:
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                             f"which the gguf package cannot dequantize ({exc})") from exc
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"{path}: cannot read tensor {tensor.name!r}: {exc}") from exc
    # F32 tensors come back as read-only views of the memory map; torch needs its own copy.
    if weights.dtype != np.float32 or not weights.flags.writeable:
        weights = np.array(weights, dtype=np.float32)
    return torch.from_numpy(weights)


def _unpermute_rotary(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: per head, rows ``(2, d/2)`` were stored as ``(d/2, 2)``."""
    half = weights.shape[0] // num_heads // 2
    rest = weights.shape[1:]
    # [heads, half, 2, *rest] -> [heads, 2, half, *rest]
    return weights.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weights.shape).contiguous()


# --- config -------------------------------------------------------------------------------------

def _build_config(arch: str, metadata: dict[str, Any], tensor_names: set[str], path: str) -> dict[str, Any]:
    spec = _ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}", param="model")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    rope_dim = metadata.get(f"{arch}.rope.dimension_count")
    # llama.cpp writes key_length only where the head is not hidden/heads wide (qwen3); for llama,
    # transformers takes the rope width as the head width, which is what llama.cpp's converter wrote.
    head_dim = int(metadata.get(f"{arch}.attention.key_length")
                   or (rope_dim if arch == "llama" else None) or hidden // heads)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedArchitectureError(
            f"{path}: partial rotary embedding (rope width {rope_dim} of head width {head_dim}) is not supported")
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF metadata states no vocabulary size", param="model")
    qkv_bias = spec.qkv_bias if spec.qkv_bias is not None else "blk.0.attn_q.bias" in tensor_names
    config: dict[str, Any] = {
        "architectures": [spec.hf_name],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope_parameters(arch, metadata),
        "max_position_embeddings": int(key("context_length")),
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": qkv_bias,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch != "llama":
        config["use_sliding_window"] = False
    return config


def _rope_parameters(arch: str, metadata: dict[str, Any]) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        # Passed through so that the model refuses a scaling it does not implement, by name.
        rope["rope_type"] = scaling
        rope["factor"] = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
    return rope


# --- tokenizer ----------------------------------------------------------------------------------

def _build_tokenizer(metadata: dict[str, Any], path: str) -> Tokenizer | None:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        # Sentencepiece ("llama") and other vocabularies are not rebuilt yet; the model still
        # loads and serves token ids, as an HF directory without tokenizer.json does.
        logger.warning("%s: GGUF tokenizer model %r is not supported (only byte-level BPE, 'gpt2'); "
                       "loading without a tokenizer", path, kind)
        return None
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens", param="model")
    backend = _byte_level_backend(tokens, metadata.get("tokenizer.ggml.merges") or [],
                                  metadata.get("tokenizer.ggml.token_type") or [],
                                  metadata.get("tokenizer.ggml.pre"))

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    # Every id llama.cpp stops on that the file names (eot/eom exist for llama3-style chat).
    stop_ids = [metadata[f"tokenizer.ggml.{k}"] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
                if f"tokenizer.ggml.{k}" in metadata]
    return Tokenizer.build(backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                           chat_template=metadata.get("tokenizer.chat_template"),
                           add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                           extra_eos_token_ids=list(dict.fromkeys(int(i) for i in stop_ids)))


def _byte_level_backend(tokens: list[str], merges: list[str], token_types: list[int],
                        pre: str | None) -> HFTokenizer:
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # A token written with characters outside the byte alphabet (a raw space, say) is respelled
    # byte by byte, as the BPE model only ever sees byte-alphabet strings.
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8")): index
             for index, tok in enumerate(tokens)}
    pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) must match whole and count as special; one spelled outside
    # the byte alphabet is a llama.cpp mislabel, skipped as transformers skips it.
    control = [AddedToken(tok, normalized=False, special=True)
               for tok, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL and set(tok) <= spelled]
    backend.add_special_tokens(control)
    user_defined = [AddedToken(tok, normalized=False, special=False)
                    for tok, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab]
    backend.add_tokens(user_defined)
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}
