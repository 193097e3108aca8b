"""The founding case on a simulated sm_120: a checkpoint with NVFP4 routed experts in the main
model and MXFP4 experts in its MTP layer, experts kept in their formats (as on a GPU), the device
capability patched to 12.0, speculative decoding with the MTP layer. Spies on the MoE kernels
record which kernel each call reached and the format of the experts it got: the draft's MoE runs
a kernel that can run on sm_120 (the Triton one, interpreted here; never the sm_100-only build),
``draft_moe_backend`` and ``moe_backend`` each take effect for the draft, ``/v1/backends`` names
the draft's row, an impossible choice stops start-up, and greedy output with the MTP layer
drafting equals the output without speculation."""
from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.common.errors import UnsupportedSettingError
from cluster.models import deepseek_v4_experts
from kernels import dispatch, moe, triton_moe
from kernels.quant import QuantizedWeight
from tests.deepseek_factories import make_v4_checkpoint
from tests.factories import mixed_prompts
from tests.models.test_deepseek_v4_ops import _checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = mixed_prompts(512, (7, 13), seed=3)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, one_thread):
    src = str(tmp_path_factory.mktemp("csa_hca"))
    make_v4_checkpoint(src, "csa_hca")
    return _checkpoint(src, str(tmp_path_factory.mktemp("mixed")), "mixed")


@pytest.fixture
def sm120(monkeypatch):
    """An sm_120 device whose experts stay in their checkpoint formats; every MoE call recorded
    as (kernel, format of the experts it got)."""
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (12, 0))
    monkeypatch.setattr(deepseek_v4_experts, "keeps_native_experts", lambda device: True)
    calls: list[tuple[str, str]] = []

    def spy(name, fn):
        def call(x, w13, *args, **kwargs):
            calls.append((name, w13.fmt if isinstance(w13, QuantizedWeight) else "dense"))
            return fn(x, w13, *args, **kwargs)
        return call
    monkeypatch.setattr(triton_moe, "fused_moe_triton", spy("triton", triton_moe.fused_moe_triton))
    monkeypatch.setattr(moe, "fused_moe_ref", spy("torch", moe.fused_moe_ref))
    return calls


def mtp_llm(path: str, **kwargs) -> LLM:
    return LLM(path, block_size=4, attention_backend="torch", speculative_method="mtp", num_speculative_tokens=2,
               **kwargs)


def test_auto_runs_each_moe_in_its_own_format_on_a_kernel_sm_120_has(mixed, sm120):
    want = [o.outputs[0].token_ids for o in LLM(mixed, block_size=4, attention_backend="torch").generate(PROMPTS, PARAMS)]
    sm120.clear()
    llm = mtp_llm(mixed)
    rows = {r["component"]: r for r in llm.engine.backends()}
    assert rows["moe"]["impl"] == rows["mtp.moe"]["impl"] == "triton"
    assert rows["mtp.moe"]["device"] == "sm_120" and rows["mtp.moe"]["format"] == "mxfp4"
    assert rows["moe"]["format"] == "nvfp4" and rows["mtp.moe"]["role"] == "draft"
    assert "flashinfer_trtllm" in rows["mtp.moe"]["reason"]  # considered, skipped: built only for sm_100
    assert rows["speculative_decoding"]["impl"] == "mtp"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == want
    assert ("triton", "mxfp4") in sm120 and ("triton", "nvfp4") in sm120
    assert not any(kernel == "torch" for kernel, _ in sm120)
    assert llm.engine.spec_stats.num_drafts > 0 and llm.engine.kv.usage == 0.0


def test_draft_moe_backend_takes_effect_for_the_draft_only(mixed, sm120):
    llm = mtp_llm(mixed, draft_moe_backend="torch")
    llm.generate(PROMPTS[:1], PARAMS)
    assert set(sm120) == {("triton", "nvfp4"), ("torch", "mxfp4")}  # the main model's on Triton, the draft's not
    rows = {r["component"]: r for r in llm.engine.backends()}
    assert rows["mtp.moe"]["impl"] == "torch" and "draft_moe_backend" in rows["mtp.moe"]["reason"]


def test_moe_backend_is_inherited_by_the_draft_while_its_own_is_auto(mixed, sm120):
    llm = mtp_llm(mixed, moe_backend="torch")
    llm.generate(PROMPTS[:1], PARAMS)
    assert set(sm120) == {("torch", "nvfp4"), ("torch", "mxfp4")}
    sm120.clear()
    llm = mtp_llm(mixed, moe_backend="torch", draft_moe_backend="triton")
    llm.generate(PROMPTS[:1], PARAMS)
    assert set(sm120) == {("torch", "nvfp4"), ("triton", "mxfp4")}


def test_the_sm_100_only_kernel_for_the_draft_stops_start_up(mixed, sm120):
    with pytest.raises(UnsupportedSettingError) as info:
        mtp_llm(mixed, draft_moe_backend="flashinfer_trtllm")
    for words in ("mtp.moe", "format mxfp4", "role draft", "sm_120", "built only for sm_100", "draft_moe_backend"):
        assert words in str(info.value), words
    assert not sm120  # refused before any MoE ran


def test_the_drafts_and_verify_steps_moe_shapes_are_among_those_built_for_sm_120():
    """At DeepSeek-V4-Flash's routing (256 experts, top 6), the MTP layer's MoE (one row per
    drafting request) and a verify step's (1 + k rows per request) take the Triton kernel's
    smallest expert block at every batch a decode replica runs; tests/kernels/test_portability.py
    builds that kernel, and every block size it picks, for sm_120 within its 99 KB."""
    for batch in (1, 8, 32, 64, 128):
        for k in (1, 2, 3):
            assert triton_moe._block_m(batch * 6, 256) == 16  # the draft's passes
            assert triton_moe._block_m(batch * (1 + k) * 6, 256) == 16  # the verify step


def mtp_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions 1 .. n-1 of ``ids``, teacher-forced (the engine's target
    forward over the prompt, then one pass of the layer over it)."""
    from cluster.engine.request import Request
    from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
    engine, drafter = llm.engine, llm.engine.runner.drafter
    n = len(ids)
    assert engine.kv.allocate("mtp-probe", n)
    tables = engine.kv.block_tables("mtp-probe")
    sched = SchedulerOutput([ScheduledRequest(Request("mtp-probe", ids, PARAMS), 0, n, "mtp-probe", ids)],
                            {"mtp-probe": tables})
    try:
        with torch.no_grad():
            streams, _ = engine.runner.forward(sched)
            g = drafter._pass([(1, n - 1, tables[0])], torch.tensor(ids[1:]), streams[:-1])
            return drafter.head.draft_logits(g).float()
    finally:
        engine.kv.free("mtp-probe")


MTP_SCHEMES = {  # name: (matrices, routed experts, MTP experts, quantization_config)
    "fp8": ("fp8_block", "fp8_block", "fp8_block", "fp8"),
    "mxfp4": ("fp8_block", "mxfp4", "mxfp4", "mxfp4"),
    "mixed": ("fp8_block", "nvfp4", "mxfp4", "mixed"),
}


@pytest.mark.parametrize("scheme", ["bf16", *MTP_SCHEMES])
def test_quantized_mtp_logits_are_close_to_the_dequantized_models(tmp_path, monkeypatch, scheme):
    """The MTP layer on each weight format: bf16 against float32; FP8-block, MXFP4 and mixed
    NVFP4/MXFP4 experts kept in their formats (through the MoE kernel, as on a GPU) against the
    same checkpoint dequantized at load."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from tests.deepseek_factories import copy_checkpoint, edit_config, quantize_tensors, random_mtp_tensors
    from tests.models.test_deepseek_v4_ops import SCHEMES, _share_nvfp4_global_scales
    src = str(tmp_path / "plain")
    make_v4_checkpoint(src, "csa_hca")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors")) | random_mtp_tensors(config)
    ids = mixed_prompts(512, (25,), seed=8)[0]
    if scheme == "bf16":
        save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
        edit_config(src, lambda c: c.update(num_nextn_predict_layers=1))
        want = mtp_logits(mtp_llm(src, dtype="float32"), ids)
        got = mtp_logits(mtp_llm(src, dtype="bfloat16"), ids)
        # bfloat16 rounding, every op of the target and the layer; a random layer's logits are flat
        assert ((got - want).norm() / want.norm()).item() < 5e-2
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
        return
    matrix, experts, mtp_experts, quantization = MTP_SCHEMES[scheme]
    quantized, _ = quantize_tensors(tensors, matrix, experts, mtp_experts)
    _share_nvfp4_global_scales(tensors, quantized)
    path = copy_checkpoint(src, str(tmp_path / scheme))
    save_file(quantized, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    edit_config(path, lambda c: c.update(quantization_config=SCHEMES[quantization][3], num_nextn_predict_layers=1))
    want = mtp_logits(mtp_llm(path), ids)  # dequantized at load (the CPU default)
    monkeypatch.setattr(deepseek_v4_experts, "keeps_native_experts", lambda device: True)
    native = mtp_llm(path)
    # (fp8 at this tiny width: w1's last 128-row scale block would hold w3's rows, so w13 is dequantized)
    assert native.engine.model.mtp[0].ffn.experts.w2.fmt == mtp_experts
    got = mtp_logits(native, ids)
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().max().item() < 1e-4 * spread
    assert torch.equal(got.argmax(-1), want.argmax(-1))
