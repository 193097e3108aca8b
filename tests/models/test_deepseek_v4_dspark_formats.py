"""The DSpark drafter in the founding case's formats on a simulated sm_120: NVFP4 routed experts in
the main model, MXFP4 in the drafter's stages (as DeepSeek-V4-Flash-0731 ships FP4 draft experts),
FP8 block projections (``main_proj`` too), experts kept in their formats, the device capability
patched to 12.0. Spies on the MoE kernels record which kernel each call reached and the format of
the experts it got: the drafter's MoE (every stage's, every block) runs a kernel sm_120 has (the
Triton one, interpreted here; never the sm_100-only build), ``draft_moe_backend`` takes effect for
the drafter only, an impossible choice stops start-up by name, and greedy output with DSpark
drafting equals the output without speculation; the quantized drafter's block logits are close to
the dequantized one's."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from cluster.common.errors import UnsupportedSettingError
from kernels import triton_moe
from tests.deepseek_factories import add_dspark, copy_checkpoint, edit_config, make_v4_checkpoint, quantize_tensors
from tests.factories import mixed_prompts
from tests.models.test_deepseek_v4_mtp_formats import sm120  # noqa: F401 - the fixture
from tests.models.test_deepseek_v4_ops import _share_nvfp4_global_scales

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = mixed_prompts(512, (7, 13), seed=3)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
         "quantized_layers": {"layers.*.ffn.experts.*": {"quant_algo": "NVFP4"},
                              "mtp.*.ffn.experts.*": {"quant_algo": "MXFP4"}}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_thread):
    """(the mixed-format checkpoint, the same weights before quantization)."""
    src = str(tmp_path_factory.mktemp("dspark_src"))
    hf = make_v4_checkpoint(src, "csa_hca")
    add_dspark(src, hf.config.to_dict(), [1, 2, 3])
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, _ = quantize_tensors(tensors, "fp8_block", "nvfp4", "mxfp4")
    _share_nvfp4_global_scales(tensors, quantized)
    assert quantized["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    mixed = copy_checkpoint(src, str(tmp_path_factory.mktemp("dspark_mixed")))
    save_file(quantized, os.path.join(mixed, "model.safetensors"), metadata={"format": "pt"})
    edit_config(mixed, lambda c: c.update(quantization_config=MIXED))
    return mixed, src


def dspark_llm(path: str, **kwargs) -> LLM:
    return LLM(path, block_size=4, attention_backend="torch", speculative_method="dspark", num_speculative_tokens=5,
               **kwargs)


def test_auto_runs_each_moe_in_its_own_format_on_a_kernel_sm_120_has(checkpoints, sm120):
    mixed, _ = checkpoints
    want = [o.outputs[0].token_ids for o in LLM(mixed, block_size=4, attention_backend="torch").generate(PROMPTS, PARAMS)]
    sm120.clear()
    llm = dspark_llm(mixed)
    rows = {r["component"]: r for r in llm.engine.backends()}
    assert rows["moe"]["impl"] == rows["mtp.moe"]["impl"] == "triton"
    assert rows["mtp.moe"]["device"] == "sm_120" and rows["mtp.moe"]["format"] == "mxfp4"
    assert rows["moe"]["format"] == "nvfp4" and rows["mtp.moe"]["role"] == "draft"
    assert "flashinfer_trtllm" in rows["mtp.moe"]["reason"]  # considered, skipped: built only for sm_100
    assert rows["speculative_decoding"]["impl"] == "dspark"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == want
    assert ("triton", "mxfp4") in sm120 and ("triton", "nvfp4") in sm120
    assert not any(kernel == "torch" for kernel, _ in sm120)
    runner = llm.engine.runner.drafter
    # every block ran each of the 3 stages' MoE in the drafter's format
    assert sum(1 for call in sm120 if call == ("triton", "mxfp4")) == 3 * runner.num_blocks > 0
    assert llm.engine.kv.usage == 0.0


def test_draft_moe_backend_takes_effect_for_the_drafter_only(checkpoints, sm120):
    mixed, _ = checkpoints
    llm = dspark_llm(mixed, draft_moe_backend="torch")
    llm.generate(PROMPTS[:1], PARAMS)
    assert set(sm120) == {("triton", "nvfp4"), ("torch", "mxfp4")}
    rows = {r["component"]: r for r in llm.engine.backends()}
    assert rows["mtp.moe"]["impl"] == "torch" and "draft_moe_backend" in rows["mtp.moe"]["reason"]


def test_the_sm_100_only_kernel_for_the_drafter_stops_start_up(checkpoints, sm120):
    mixed, _ = checkpoints
    with pytest.raises(UnsupportedSettingError) as info:
        dspark_llm(mixed, draft_moe_backend="flashinfer_trtllm")
    for words in ("mtp.moe", "format mxfp4", "role draft", "sm_120", "built only for sm_100", "draft_moe_backend"):
        assert words in str(info.value), words
    assert not sm120


def test_the_blocks_moe_shapes_are_among_those_built_for_sm_120():
    """At DeepSeek-V4-Flash-0731's drafter routing (256 experts, top 6), a block's MoE (5 rows per
    drafting request) and its verify step's (6 rows per request) take the Triton kernel's
    smallest expert block up to batch 128 (tests/kernels/test_portability.py builds that kernel,
    and every block size it picks, for sm_120 within its 99 KB)."""
    for batch in (1, 8, 32, 64, 128):
        assert triton_moe._block_m(batch * 5 * 6, 256) == 16
        assert triton_moe._block_m(batch * 6 * 6, 256) in (16, 32)


def block_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    from cluster.engine.request import Request
    from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
    engine = llm.engine
    assert engine.kv.allocate("probe", len(ids) + 5)
    tables = engine.kv.block_tables("probe")
    sched = SchedulerOutput([ScheduledRequest(Request("probe", ids[:-1], SamplingParams()), 0, len(ids) - 1,
                                              "probe", ids[:-1])], {"probe": tables})
    model = engine.model
    with torch.no_grad():
        engine.runner.forward(sched)
        _, logits, _ = engine.runner.drafter.drafter.draft_block(
            model.embed, model.head_logits, model.rope, engine.runner.kv_caches, torch.tensor([tables[0]]),
            torch.tensor([ids[-1]]), torch.tensor([len(ids) - 1]))
    return logits[0]


def test_quantized_drafter_logits_are_close_to_the_dequantized_models(checkpoints, monkeypatch):
    """The mixed checkpoint's block, experts kept in their formats (through the MoE kernel, as on
    a GPU), against the same checkpoint dequantized at load (the CPU default)."""
    from cluster.models import deepseek_v4_experts
    mixed, _ = checkpoints
    ids = mixed_prompts(512, (30,), seed=9)[0]
    want = block_logits(dspark_llm(mixed), ids)
    monkeypatch.setattr(deepseek_v4_experts, "keeps_native_experts", lambda device: True)
    native = dspark_llm(mixed)
    assert all(stage.ffn.experts.w2.fmt == "mxfp4" for stage in native.engine.model.mtp)
    got = block_logits(native, ids)
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().max().item() < 1e-4 * spread
    assert torch.equal(got.argmax(-1), want.argmax(-1))
