"""GGUF weights kept quantized on the CPU: the int4 / int8 weight-only kernels against their
float32 references, the Q4_1 codes read from the file exactly, and the embedded default served
on them by default, with the same greedy tokens as the float32 path on the README's prompts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster import LLM, SamplingParams
from cluster.models.gguf import read_gguf
from cluster.models.registry import resolve_model_path
from kernels import cpu_native
from kernels.cpu_quant import (can_pack_q4, int4_cpu_available, linear_q4, linear_q4_ref, linear_q8, pack_q4,
                               pack_q8_rows, q4_matmul, q8_dequantize_ref)

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="torch has no CPU int4 weight-only kernel")

README_CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
                [{"role": "user", "content": "Tell me about Paris."}]]
README_PROMPTS = ["Write a short story about a robot who learns to paint. Describe the colors it sees."]


def _random_q4(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    minimum = -torch.rand(n, k // 32, generator=g) * 0.1
    return codes, scale, minimum


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("gated", [False, True])
def test_int4_linear_matches_its_dequantized_reference(rows, gated):
    codes, scale, minimum = _random_q4(64, 96)
    weight = pack_q4(codes, scale, minimum)
    x = torch.randn(rows, 96)
    bias = torch.randn(64)
    got = linear_q4(x, weight, bias, gated=gated)
    ref = linear_q4_ref(x, codes, weight, bias, gated=gated)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # the kernel returns bfloat16: its rounding, not more
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_the_dense_copies_are_float32_where_the_cpu_has_no_bfloat16_gemm(native, monkeypatch):
    """Without a native bfloat16 GEMM (an AVX2 core: oneDNN emulates it, slower than the int4
    kernel), the dense copies are float32: the bfloat16 dequantization's values, fed the same
    bfloat16-rounded activations, their products rounded to bfloat16 as the bfloat16 GEMM's are,
    so both dtypes give the same products within float32 summation order."""
    from kernels import cpu_quant
    monkeypatch.setattr(cpu_quant, "native_bfloat16_gemm", lambda: native)
    cpu_quant.dense_dtype.cache_clear()
    try:
        codes, scale, minimum = _random_q4(64, 96, seed=5)
        weight = pack_q4(codes, scale, minimum, dense=True)
        q8 = pack_q8_rows(torch.randn(64, 96), dense=True)
        want = torch.bfloat16 if native else torch.float32
        assert weight.dense.dtype == want and q8.dense.dtype == want
        assert torch.equal(weight.dense.to(torch.bfloat16).to(want), weight.dense)  # bfloat16 values
        x = torch.randn(cpu_quant.dense_from_rows() + 7, 96)
        got = cpu_quant.q4_matmul(x, weight)
        assert got.dtype == torch.bfloat16
        bf16 = torch.nn.functional.linear(x.to(torch.bfloat16), weight.dense.to(torch.bfloat16))
        assert (got.float() - bf16.float()).abs().max() <= 1e-2 * bf16.float().abs().max()
        assert linear_q8(x, q8).dtype == torch.float32
    finally:
        monkeypatch.undo()
        cpu_quant.dense_dtype.cache_clear()


@pytest.mark.parametrize("gated", [False, True])
def test_many_rows_take_the_bfloat16_dequantization_and_few_the_int4_codes(gated, monkeypatch):
    from kernels import cpu_quant
    codes, scale, minimum = _random_q4(64, 96, seed=3)
    plain, dense = pack_q4(codes, scale, minimum), pack_q4(codes, scale, minimum, dense=True)
    assert plain.dense is None and dense.dense is not None and dense.dense.dtype == cpu_quant.dense_dtype()
    bias = torch.randn(64)
    few = torch.randn(cpu_quant.dense_from_rows() - 1, 96)
    assert torch.equal(linear_q4(few, dense, bias, gated=gated), linear_q4(few, plain, bias, gated=gated))
    many = torch.randn(cpu_quant.dense_from_rows() + 7, 96)
    got = linear_q4(many, dense, bias, gated=gated)
    ref = linear_q4_ref(many, codes, dense, bias, gated=gated)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()  # bfloat16 weights and output
    # q4_matmul (the lean decode step's product): bfloat16 out, the same kernel choice, and a forced one
    assert torch.equal(q4_matmul(few, dense), q4_matmul(few, plain)) and q4_matmul(few, dense).dtype == torch.bfloat16
    assert torch.equal(q4_matmul(many, dense).float() + bias, linear_q4(many, dense, bias))
    forced = F.linear(few.to(torch.bfloat16).to(dense.dense.dtype), dense.dense).to(torch.bfloat16)
    assert torch.equal(q4_matmul(few, dense, dense=True), forced)
    calls = []
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(a) or None)
    linear_q4(many, dense, bias, gated=gated)
    assert not calls  # the int4 kernel is not called for many rows
    q4_matmul(many, dense, dense=False)
    assert len(calls) == 1  # forced onto the int4 codes whatever the rows
    w = torch.randn(64, 96)
    q8, q8d = pack_q8_rows(w), pack_q8_rows(w, dense=True)
    x = torch.randn(cpu_quant.dense_logits_from_rows() + 4, 96)
    ref8 = x.to(torch.bfloat16).float() @ q8_dequantize_ref(q8).t()
    assert (linear_q8(x, q8d) - ref8).abs().max() <= 2e-2 * ref8.abs().max()
    assert torch.equal(linear_q8(x[:2], q8d), linear_q8(x[:2], q8))


def test_int4_packing_keeps_the_codes_and_rounds_only_scales_to_bfloat16():
    codes, scale, minimum = _random_q4(32, 64, seed=1)
    weight = pack_q4(codes, scale, minimum)
    exact = (codes.float().reshape(32, 2, 32) * scale[..., None] + minimum[..., None]).reshape(32, 64)
    from kernels.cpu_quant import q4_dequantize_ref
    stored = q4_dequantize_ref(codes, weight)
    # per weight: the bfloat16 rounding of scale and zero (2**-8 relative), nothing from the codes
    step = scale.repeat_interleave(32, dim=1)
    assert (stored - exact).abs().max() <= (2 ** -8) * (exact.abs().max() + 16 * step.max())
    assert weight.nbytes < 32 * 64 * 4 / 5  # about 0.6 bytes per weight, not 4


def test_int4_packing_refuses_shapes_the_kernel_cannot_take():
    assert can_pack_q4(16, 32) and not can_pack_q4(8, 32) and not can_pack_q4(16, 48)
    codes, scale, minimum = _random_q4(8, 32)
    with pytest.raises(ValueError, match="does not fit"):
        pack_q4(codes, scale, minimum)


def test_int8_rows_match_their_reference():
    w = torch.randn(48, 64)
    q8 = pack_q8_rows(w)
    assert (q8_dequantize_ref(q8) - w).abs().max() <= 0.51 * (w.abs().amax(1) / 127).max() * 1.01
    x = torch.randn(2, 64)
    ref = x.to(torch.bfloat16).float() @ q8_dequantize_ref(q8).t()
    got = linear_q8(x, q8)
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_gguf_q4_1_codes_dequantize_to_the_float32_tensors_exactly():
    checkpoint = read_gguf(resolve_model_path("smollm2"))
    full = dict(checkpoint.tensors())
    seen = 0
    for name, blocks in checkpoint.q4_1_tensors():
        assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
        assert torch.equal(blocks.dequantize(), full[name]), name  # q/k rows unpermuted the same way
        seen += 1
    assert seen == 7 * 30  # every projection of SmolLM2's 30 layers is Q4_1 in this file
    assert checkpoint.tensor_types()["model.embed_tokens.weight"] == "Q8_0"


@pytest.fixture(scope="module")
def quantized():
    return LLM("smollm2")


@pytest.fixture(scope="module")
def exact():
    return LLM("smollm2", dtype="float32")


def test_default_cpu_engine_keeps_the_4_bit_weights_and_says_so(quantized, exact):
    model = quantized.engine.model
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.quantized is not None and linear.weight.numel() == 0
    table = {row["component"]: row for row in model.kernel_choices() if row["component"] in ("linear", "logits")}
    native, vnni = cpu_native.available(), cpu_native.vnni_available()
    kind = "native_vnni" if vnni else "native"
    assert table["logits"]["impl"] == (f"{kind}_q8_0_cpu" if native else "torch_int8pack_cpu")
    assert table["linear"]["impl"] == (f"{kind}_q4_1_cpu" if native else "torch_int4pack_cpu")
    assert (layer.mlp.gate_up_proj.quantized.native is not None) == native
    assert (model.quantized_logits.native is not None) == native
    # the VNNI kernel takes every row count: no dense copies beside it
    assert (layer.mlp.gate_up_proj.quantized.native is not None and
            layer.mlp.gate_up_proj.quantized.native.vnni is not None) == vnni
    assert (layer.mlp.gate_up_proj.quantized.dense is None) == vnni
    assert (model.quantized_logits.dense is None) == vnni
    norms = [row for row in model.kernel_choices() if row["component"] == "rms_norm"]
    assert len(norms) == 1 and norms[0]["impl"] == ("native_cpu" if native else "torch")
    assert (layer.input_layernorm.ops.rms_norm is cpu_native.rms_norm) == native
    assert (model.cpu_decode.native_norm) == native  # the lean step takes the layers' norm
    for component in ("attention", "qkv_prepare"):  # decode attention, rotation and KV write
        rows = [row for row in model.kernel_choices() if row["component"] == component]
        assert len(rows) == 1 and (rows[0]["impl"] == "native_cpu") == native, rows
    assert (layer.self_attn.ops.attention is cpu_native.paged_attention) == native
    assert model.cpu_decode.native_attention == native  # one native call per layer in the lean step
    # dtype="float32": the exact path, every weight dequantized
    assert exact.engine.model.layers[0].mlp.gate_up_proj.quantized is None
    assert exact.engine.model.quantized_logits is None
    assert not any(row["impl"].endswith("_cpu") and row["component"] in ("linear", "logits")
                   for row in exact.engine.model.kernel_choices())


def test_without_the_native_kernels_the_engine_takes_torchs_and_says_why(monkeypatch, caplog):
    """No AVX2 or no C compiler (emulated here): torch's int4 / int8 kernels, said in the kernel
    table and the log, and the same greedy tokens as the float32 path still."""
    monkeypatch.setattr(cpu_native, "status", lambda: (False, "this CPU lacks avx2"))
    with caplog.at_level("WARNING"):
        llm = LLM("smollm2")
    table = {row["component"]: row for row in llm.engine.model.kernel_choices()}
    assert table["linear"]["impl"] == "torch_int4pack_cpu" and table["logits"]["impl"] == "torch_int8pack_cpu"
    assert "fell back from the native kernel: this CPU lacks avx2" in table["linear"]["reason"]
    assert "fell back from the native kernel: this CPU lacks avx2" in table["logits"]["reason"]
    assert "native CPU kernels do not run here (this CPU lacks avx2)" in caplog.text
    assert llm.engine.model.layers[0].mlp.gate_up_proj.quantized.native is None
    assert table["rms_norm"]["impl"] == "torch" and not llm.engine.model.cpu_decode.native_norm
    assert table["attention"]["impl"] == "torch" and not llm.engine.model.cpu_decode.native_attention
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert len(llm.chat(README_CHATS[0], params)[0].outputs[0].token_ids) > 3


def test_quantized_greedy_tokens_equal_the_float32_path_on_the_readme_prompts(quantized, exact):
    """The README's two chats answered to their end (up to 64 tokens): the same greedy tokens.
    (Past an answer's end, with ignore_eos, or on a raw prompt that makes the model write chat
    markup, the two part after 10-20 tokens where its top logits are nearly tied;
    bench/engine.py reports how far each agrees with the other and with llama.cpp.)"""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    for chat in README_CHATS:
        want = exact.chat(chat, params)[0].outputs[0]
        got = quantized.chat(chat, params)[0].outputs[0]
        assert got.token_ids == want.token_ids, (chat, got.text, want.text)
        assert len(got.token_ids) > 5


def test_quantized_batches_equal_single_requests(quantized):
    """Batched decode on the int4 kernel gives each request the tokens it gets alone."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [f"{i}. {README_PROMPTS[0]}" for i in range(4)]
    alone = [quantized.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in quantized.generate(prompts, params)] == alone


def test_a_prompts_answer_does_not_depend_on_its_chunking_or_a_prefix_hit(quantized):
    """The few-row kernel and the dense GEMM round differently (the native kernel and the float32
    GEMM only in their order of sums), and a prompt chunked or partly supplied by the prefix cache
    has chunks of every size: prompt rows take the GEMM whatever their count (decode steps the
    kernel their rows suit), so the README's question gets one answer however its prompt was
    computed."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    chat = README_CHATS[0]
    want = quantized.chat(chat, params)[0].outputs[0].token_ids
    again = quantized.chat(chat, params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want
    n = len(again.prompt_token_ids)
    for chunk in (8, n - 5, n - 1):  # chunks of 8, a last chunk of 5 rows, of one row
        llm = LLM("smollm2", max_num_batched_tokens=chunk, enable_prefix_caching=False)
        assert llm.chat(chat, params)[0].outputs[0].token_ids == want, chunk


def test_float_projections_quantized_as_q4_1_stay_close_and_skip_what_the_kernel_cannot_take():
    """A draft head's float projections over a quantized target: rounded per group of 32 to codes
    0..15 with a scale and minimum, they give the float layer's outputs to within 4-bit rounding;
    a shape the kernel does not take stays float."""
    from cluster.models.cpu_quant import quantize_float_linears
    from cluster.models.layers import Linear
    torch.manual_seed(0)
    module = torch.nn.ModuleDict({"ok": Linear(64, 48, False, torch.float32), "odd": Linear(40, 24, False, torch.float32)})
    for lin in module.values():
        lin.weight.data.normal_(0.0, 0.05)
    x = torch.randn(5, 64)
    want = F.linear(x, module["ok"].weight)
    assert quantize_float_linears(module) == 1
    assert module["ok"].quantized is not None and module["odd"].quantized is None
    for rows in (1, 5):  # the int4 kernel and the bfloat16 dequantization
        kernel, dense = module["ok"](x[:rows], dense=False), module["ok"](x[:rows], dense=True)
        err = (kernel - want[:rows]).norm() / want[:rows].norm()
        assert 0 < err < 0.15, (rows, err)  # 16 levels per group of 32: about 9% for normal weights
        torch.testing.assert_close(kernel, dense, rtol=2e-2, atol=2e-2)  # one weight, two kernels
    assert quantize_float_linears(module) == 0  # nothing left to quantize
