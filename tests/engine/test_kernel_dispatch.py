"""The engine resolves every component's kernel at start-up through kernels.dispatch: the choice
is exposed, each override setting takes effect (the draft role's too), and an impossible choice
stops start-up with a message naming op, format, role and device, before anything runs."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from cluster.common.errors import UnsupportedSettingError
from kernels import dispatch
from kernels.triton_attention import paged_attention_triton
from kernels.triton_moe import fused_moe_triton
from tests.deepseek_factories import copy_checkpoint, edit_config, make_v4_checkpoint, random_mtp_tensors
from tests.factories import make_checkpoint, mixed_prompts

MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
         "quantized_layers": {"layers.*.ffn.experts.*": {"quant_algo": "NVFP4"},
                              "mtp.0.ffn.experts.*": {"quant_algo": "MXFP4"}}}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    """A bf16 DeepSeek-V4 with an MTP layer."""
    path = str(tmp_path_factory.mktemp("v4"))
    model = make_v4_checkpoint(path, "csa_hca", num_nextn_predict_layers=1)
    file = os.path.join(path, "model.safetensors")
    save_file(load_file(file) | random_mtp_tensors(model.config.to_dict()), file, metadata={"format": "pt"})
    return path


def by_component(llm: LLM) -> dict[str, dict]:
    return {row["component"]: row for row in llm.engine.backends()}


def test_cpu_resolves_every_component_to_the_references(llama_dir):
    table = by_component(LLM(llama_dir, block_size=4))
    graphs = table.pop("cuda_graphs")  # not a kernel: whether decode replays graphs, and why not
    assert graphs["impl"] == "off" and "the device is cpu" in graphs["reason"]
    warmup = table.pop("prefill_warmup")  # not a kernel either: the start-up prefill warm-up
    assert warmup["impl"] == "off" and "not needed on cpu" in warmup["reason"]
    assert set(table) == {"attention", "kv_cache_write", "qkv_prepare", "rms_norm", "rotary", "silu_and_mul",
                          "sampler", "linear", "spec_verify_rows", "spec_accept_draft_rows"}
    assert all(row["impl"] == "torch" and row["device"] == "cpu" for row in table.values())


def test_attention_backend_override_takes_effect(llama_dir):
    """attention_backend=triton on the CPU runs the Triton kernels in Triton's interpreter (the
    tests set TRITON_INTERPRET=1): the same greedy tokens as the references."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = mixed_prompts(300, (5, 19), seed=2)
    reference = LLM(llama_dir, block_size=4).generate(prompts, params)
    llm = LLM(llama_dir, block_size=4, attention_backend="triton")
    table = by_component(llm)
    assert table["attention"]["impl"] == table["kv_cache_write"]["impl"] == table["qkv_prepare"]["impl"] == "triton"
    assert table["rms_norm"]["impl"] == "torch" and "attention_backend" in table["attention"]["reason"]
    assert llm.engine.model.layers[0].self_attn.ops.attention is paged_attention_triton
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]


def test_unknown_or_impossible_attention_backend_is_refused(llama_dir):
    with pytest.raises(UnsupportedSettingError, match=r"unknown kernel 'flash9'.*attention_backend"):
        LLM(llama_dir, attention_backend="flash9")


def test_moe_overrides_per_role(v4_dir):
    llm = LLM(v4_dir, block_size=4, draft_moe_backend="triton")
    table = by_component(llm)
    assert table["moe"]["impl"] == "torch" and table["moe"]["role"] == "main"
    assert table["mtp.moe"]["impl"] == "triton" and table["mtp.moe"]["role"] == "draft"
    assert "draft_moe_backend" in table["mtp.moe"]["reason"]
    model = llm.engine.model
    assert model.mtp[0].ffn.moe_kernel is fused_moe_triton
    assert model.layers[0].ffn.moe_kernel is not fused_moe_triton
    # the draft's kernel really runs: same result as the main model's reference kernel
    ffn = model.mtp[0].ffn
    x = torch.randn(5, model.args.hidden_size)
    weights, ids = ffn.gate(x, torch.arange(5))
    ref = model.layers[-1].ffn.moe_kernel(x, ffn.experts.w13, ffn.experts.w2, weights, ids, ffn.clamp)
    torch.testing.assert_close(ffn.moe_kernel(x, ffn.experts.w13, ffn.experts.w2, weights, ids, ffn.clamp),
                               ref, rtol=1e-4, atol=1e-4)
    # moe_backend applies to the main model; the draft inherits it only while its own is auto
    inherited = by_component(LLM(v4_dir, block_size=4, moe_backend="triton"))
    assert inherited["moe"]["impl"] == "triton" and inherited["mtp.moe"]["impl"] == "triton"
    assert "inherited" in inherited["mtp.moe"]["reason"]


def test_the_founding_failure_is_refused_at_start_up(v4_dir, tmp_path, monkeypatch):
    """An sm_100-only MoE kernel chosen for the MXFP4 MTP draft of a mixed NVFP4/MXFP4 checkpoint on
    an sm_120 GPU: refused before anything loads, naming op, format, role and device."""
    path = copy_checkpoint(v4_dir, str(tmp_path / "mixed"))
    edit_config(path, lambda c: c.update(quantization_config=MIXED))
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (12, 0))
    with pytest.raises(UnsupportedSettingError) as info:
        LLM(path, block_size=4, draft_moe_backend="flashinfer_trtllm")
    message = str(info.value)
    for words in ("mtp.moe", "'moe'", "format mxfp4", "role draft", "sm_120", "built only for sm_100",
                  "draft_moe_backend"):
        assert words in message, (words, message)
    assert "format nvfp4" not in message  # the main model's MoE (auto) was fine
    assert info.value.param == "draft_moe_backend"
