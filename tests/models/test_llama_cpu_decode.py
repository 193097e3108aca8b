"""The lean CPU decode step (cluster.models.llama_cpu_decode) against the layer-by-layer path it
replaces: every decode step checked bit for bit (final hidden states and the KV it writes) on
the embedded default and on random quantized Llama/Qwen2 models (biases, GQA, batches past the
dense crossover, requests joining and leaving); what it refuses; and that it is what decode
steps take by default and says so."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.models.cpu_quant import _lean_decode, quantize_float_linears
from cluster.models.llama_cpu_decode import LlamaCpuDecode, unsupported_reason
from kernels import cpu_native, cpu_quant
from kernels.cpu_quant import GROUP_SIZE, dense_from_rows, int4_cpu_available, pack_q4
from tests.factories import make_checkpoint

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="torch has no CPU int4 weight-only kernel")


@contextmanager
def checked_steps(model: Any) -> Iterator[list[int]]:
    """Run every lean step after the layers' computation of the same step (whose KV writes
    are the truth); assert the same hidden states and the same cache. Yields the batch sizes
    checked."""
    lean: LlamaCpuDecode = model.cpu_decode
    checked: list[int] = []

    def forward(input_ids: torch.Tensor, ctx: Any) -> torch.Tensor:
        model.cpu_decode = None
        try:
            want = model(input_ids, ctx)
        finally:
            model.cpu_decode = lean
        cache = ctx.kv_caches[0].clone()
        got = LlamaCpuDecode.forward(lean, input_ids, ctx)
        assert torch.equal(got, want), (got - want).abs().max()
        assert torch.equal(ctx.kv_caches[0], cache)
        checked.append(input_ids.shape[0])
        return got

    lean.forward = forward  # type: ignore[method-assign]
    try:
        yield checked
    finally:
        del lean.forward


def quantize_layers(model: Any) -> None:
    """Give every decoder projection of ``model`` Q4_1 weights (the float weights rounded to 4-bit
    codes with a scale and minimum per 32), as a GGUF file's would be, and the lean step."""
    assert quantize_float_linears(model.layers) == 4 * len(model.layers)
    row = _lean_decode(model)
    assert row["impl"] == "lean_cpu_decode", row


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2", kv_cache_memory_bytes=64 << 20)


def test_the_embedded_default_decodes_on_the_lean_path_and_says_so(smollm2):
    model = smollm2.engine.model
    assert isinstance(model.cpu_decode, LlamaCpuDecode)
    rows = [r for r in model.kernel_choices() if r["component"] == "decode_step"]
    assert rows and rows[0]["impl"] == "lean_cpu_decode"
    before = model.cpu_decode.num_steps
    out = smollm2.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8,
                                                                         ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    assert model.cpu_decode.num_steps - before == 7  # every decode step; the prompt took the layers
    assert LLM("smollm2", dtype="float32").engine.model.cpu_decode is None  # the exact path: the layers


def test_the_embedded_default_equals_the_layers_bit_for_bit(smollm2):
    """Batch 1, a batch whose requests finish at different steps (so the batch shrinks), and
    requests joining a running batch: each decode step's hidden states and KV writes equal."""
    model = smollm2.engine.model
    with checked_steps(model) as checked:
        smollm2.generate(["Write a short story about a robot."],
                         SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(5)]
        smollm2.generate([f"{i}. Tell me about Paris." for i in range(5)], params)
        smollm2.generate(["Hi", "A much longer prompt about the colors a robot sees when it paints."],
                         SamplingParams(temperature=0.8, seed=3, max_tokens=10))
    assert 1 in checked and 5 in checked and len(checked) > 25


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_random_quantized_models_equal_the_layers_bit_for_bit(tmp_path, family, monkeypatch):
    """Random Llama and Qwen2 (q/k/v biases) with GQA, untied head: batch 1, a batch past the
    dense crossover (its projections take the dense GEMM), long contexts over many blocks."""
    make_checkpoint(str(tmp_path), family)
    # the crossover brought down to 6 rows (the native kernels' is 32), so a small batch crosses it
    monkeypatch.setattr(cpu_quant, "NATIVE_DENSE_FROM_ROWS", 6)
    crossover = dense_from_rows(cpu_native.available())
    llm = LLM(str(tmp_path), max_num_seqs=16, block_size=16)
    model = llm.engine.model
    assert model.cpu_decode is None  # safetensors weights: nothing quantized, the layers
    quantize_layers(model)
    prompts = [[3 + i, 7, 11 + i, 5] * (1 + i) for i in range(crossover + 3)]
    with checked_steps(model) as checked:
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=40,
                                                                      ignore_eos=True))
        llm.generate(prompts,
                     [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(len(prompts))])
    assert 1 in checked and max(checked) >= crossover and min(checked) < crossover


def test_what_the_lean_step_does_not_take(tmp_path):
    """Qwen3's q/k norms keep the layers (said in the kernel table); prompt and verify steps
    always take the layers."""
    make_checkpoint(str(tmp_path), "qwen3")
    llm = LLM(str(tmp_path))
    model = llm.engine.model
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            linear.quantize(pack_q4(torch.zeros(linear.out_features, linear.in_features, dtype=torch.uint8),
                                    torch.ones(linear.out_features, linear.in_features // GROUP_SIZE),
                                    torch.zeros(linear.out_features, linear.in_features // GROUP_SIZE)))
    assert unsupported_reason(model) == "q/k norms (Qwen3)"
    row = _lean_decode(model)
    assert row["impl"] == "layers" and "q/k norms" in row["reason"] and model.cpu_decode is None
    with pytest.raises(ValueError, match="does not apply"):
        LlamaCpuDecode(model)


def test_prompt_and_verify_steps_take_the_layers(smollm2):
    lean = smollm2.engine.model.cpu_decode
    before = lean.num_steps
    # a prompt alone (max_tokens=1): one prefill step and no decode step
    smollm2.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=1))
    assert lean.num_steps == before
    spec = LLM("smollm2", kv_cache_memory_bytes=64 << 20, speculative_method="ngram", num_speculative_tokens=3)
    spec_lean = spec.engine.model.cpu_decode
    out = spec.generate(["a b c a b c a b c a b c"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    plain = smollm2.generate(["a b c a b c a b c a b c"],
                             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec.engine.runner.num_eager_steps > spec_lean.num_steps  # verify steps went through the layers
