"""DeepSeek-V4 through its resolved kernels: the sparse attention and the lightning indexer are
dispatch ops (``attention_backend`` switches them, and the model then runs the Triton kernels, here
in the interpreter, to the references' logits), and routed experts kept in their checkpoint format
(the CUDA path, forced here on the CPU) give the logits of the dequantized model."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM
from cluster.models import deepseek_v4_experts
from cluster.models.deepseek_v4_experts import ExpertStack
from cluster.models.deepseek_v4 import kernel_components
from kernels.quant import QuantizedWeight, dequantize, quantize_nvfp4
from kernels.deepseek_v4_ref import (compress_decode_ref, compress_store_ref, hc_post_ref, hc_pre_ref, norm_rope_ref,
                                     route_ref)
from kernels.triton_deepseek_v4_compressor import compress_decode_triton, compress_store_triton
from kernels.triton_deepseek_v4_attention import sparse_attention_triton
from kernels.triton_deepseek_v4_hc import hc_post_triton, hc_pre_triton
from kernels.triton_deepseek_v4_indexer import indexer_topk_triton
from kernels.triton_deepseek_v4_rope import norm_rope_triton
from kernels.triton_deepseek_v4_router import route_triton
from tests.deepseek_factories import (V4_FLASH_CONFIG, copy_checkpoint, edit_config, engine_logits,
                                      make_v4_checkpoint, quantize_tensors, random_mtp_tensors)
from tests.factories import mixed_prompts

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
         "quantized_layers": {"layers.*.ffn.experts.*": {"quant_algo": "NVFP4"},
                              "mtp.0.ffn.experts.*": {"quant_algo": "MXFP4"}}}
SCHEMES = {  # name: (matrix format, routed expert format, MTP expert format, quantization_config)
    "mxfp4": ("fp8_block", "mxfp4", None, {**FP8, "expert_dtype": "fp4"}),
    "fp8": ("fp8_block", "fp8_block", None, FP8),
    "mixed": ("fp8_block", "nvfp4", "mxfp4", MIXED),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("csa_hca"))
    make_v4_checkpoint(path, "csa_hca")
    return path


def test_kernel_components_list_what_v4_calls():
    names = {c[0] for c in kernel_components(V4_FLASH_CONFIG)}
    assert names == {"rms_norm", "silu_and_mul", "sampler", "v4_sparse_attention", "v4_indexer", "moe",
                     "mtp.moe", "v4_hc_pre", "v4_hc_post", "v4_compress_decode", "v4_compress_decode_paged",
                     "v4_compress_store", "v4_norm_rope", "v4_route",
                     "spec_verify_rows", "spec_accept_draft_rows"}  # its verify steps' (pipelined: in graphs)
    sliding = dict(V4_FLASH_CONFIG, compress_ratios=[0] * 44, num_nextn_predict_layers=0)
    assert "v4_indexer" not in {c[0] for c in kernel_components(sliding)}


def test_attention_backend_runs_the_triton_v4_kernels(v4_dir):
    """attention_backend=triton switches both V4 attention ops; prefill in chunks that split
    compression windows, then decode rows, give the references' logits."""
    ids = mixed_prompts(512, (21,))[0]
    reference = engine_logits(LLM(v4_dir, block_size=4), "r", ids, 0, 7)
    llm = LLM(v4_dir, block_size=4, attention_backend="triton")
    table = {row["component"]: row for row in llm.engine.backends()}
    assert table["v4_sparse_attention"]["impl"] == table["v4_indexer"]["impl"] == "triton"
    assert "attention_backend" in table["v4_indexer"]["reason"] and table["moe"]["impl"] == "torch"
    attn = llm.engine.model.layers[1].attn
    assert attn.attention_kernel is sparse_attention_triton and attn.indexer.select_kernel is indexer_topk_triton
    ours = torch.cat([engine_logits(llm, "r", ids[:18], 0, 7), engine_logits(llm, "r", ids, 18, 1)])
    spread = (reference.max() - reference.min()).item()
    assert (ours - reference).abs().max().item() < 1e-4 * spread


def test_triton_hyper_connections_and_compressor_steps_give_the_reference_logits(v4_dir):
    """Every block (and a GPU's resolution: the Triton kernels) runs the hyper-connections through
    ``Ops.v4_hc_pre`` / ``v4_hc_post``, its compressors' decode steps through
    ``Ops.v4_compress_decode`` and its norms + RoPE (queries, KV entry and its window write,
    output, indexer queries, the chunk path's entries) through ``Ops.v4_norm_rope`` and its router
    (learned and hash layers) through ``Ops.v4_route``: swapped for
    the Triton kernels (interpreted here), prefill in chunks then decode rows (across compression
    windows) give the references' logits."""
    ids = mixed_prompts(512, (21,))[0]
    reference = engine_logits(LLM(v4_dir, block_size=4), "r", ids, 0, 7)
    llm = LLM(v4_dir, block_size=4)
    table = {row["component"]: row for row in llm.engine.backends()}
    assert table["v4_hc_pre"]["impl"] == table["v4_hc_post"]["impl"] == "torch"  # auto on the CPU
    blocks = llm.engine.model.layers
    assert all(b.hc_pre is hc_pre_ref and b.hc_post is hc_post_ref for b in blocks)
    assert all(b.attn.compress_kernel is compress_decode_ref and b.attn.store_kernel is compress_store_ref
               for b in blocks)
    assert table["v4_compress_decode"]["impl"] == table["v4_compress_store"]["impl"] == "torch"
    assert table["v4_norm_rope"]["impl"] == "torch" and all(b.attn.norm_rope is norm_rope_ref for b in blocks)
    assert table["v4_route"]["impl"] == "torch" and all(b.ffn.gate.route is route_ref for b in blocks)
    assert {b.ffn.gate.hash_routed for b in blocks} == {True, False}
    for block in blocks:
        block.hc_pre, block.hc_post = hc_pre_triton, hc_post_triton
        block.attn.compress_kernel, block.attn.store_kernel = compress_decode_triton, compress_store_triton
        block.attn.norm_rope, block.ffn.gate.route = norm_rope_triton, route_triton
        if block.attn.indexer is not None:
            block.attn.indexer.norm_rope = norm_rope_triton
    ours = torch.cat([engine_logits(llm, "r", ids[:18], 0, 7), engine_logits(llm, "r", ids, 18, 1)])
    spread = (reference.max() - reference.min()).item()
    assert (ours - reference).abs().max().item() < 1e-4 * spread


def _checkpoint(src: str, dst: str, scheme: str) -> str:
    matrix_fmt, expert_fmt, mtp_fmt, quantization = SCHEMES[scheme]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if mtp_fmt is not None:
        with open(os.path.join(src, "config.json")) as f:
            tensors |= random_mtp_tensors(json.load(f))
    quantized, _ = quantize_tensors(tensors, matrix_fmt, expert_fmt, mtp_fmt)
    _share_nvfp4_global_scales(tensors, quantized)
    copy_checkpoint(src, dst)
    save_file(quantized, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    edit_config(dst, lambda c: c.update(quantization_config=quantization,
                                        num_nextn_predict_layers=1 if mtp_fmt else 0))
    return dst


def _share_nvfp4_global_scales(plain: dict[str, torch.Tensor], quantized: dict[str, torch.Tensor]) -> None:
    """Quantize each NVFP4 expert's w1 and w3 as one weight, so they share one global scale (as
    ModelOpt exports them; the ``w1``/``w3`` names stay separate)."""
    for name in [n for n in quantized if n.endswith(".w1.weight_scale_2")]:
        w1, w3 = (name.replace("w1.weight_scale_2", f"{w}.weight") for w in ("w1", "w3"))
        joint = quantize_nvfp4(torch.cat([plain[w1], plain[w3]]).float())
        assert joint.scale is not None and joint.global_scale is not None
        rows = plain[w1].shape[0]
        for part, (lo, hi) in ((w1, (0, rows)), (w3, (rows, 2 * rows))):
            base = part.removesuffix(".weight")
            quantized[part], quantized[f"{base}.weight_scale"] = joint.data[lo:hi].clone(), joint.scale[lo:hi].clone()
            quantized[f"{base}.weight_scale_2"] = joint.global_scale.reshape(()).clone()


def test_nvfp4_halves_with_their_own_global_scales_are_rescaled():
    """w1 and w3 quantized apart (two global scales): stacked against the larger one, each block
    scale rounded once more to e4m3 (within its 3-bit mantissa)."""
    w1, w3 = torch.randn(2, 32, 64), 3 * torch.randn(2, 32, 64)
    stack = ExpertStack("w13", (2, 64, 64), 2, torch.float32, torch.device("cpu"))
    for e in range(2):
        stack.add("w1", e, 0, quantize_nvfp4(w1[e]))
        stack.add("w3", e, 1, quantize_nvfp4(w3[e]))
    stacked = stack.finish()
    assert isinstance(stacked, QuantizedWeight) and stacked.fmt == "nvfp4" and stacked.global_scale.shape == (2,)
    apart = torch.stack([torch.cat([dequantize(quantize_nvfp4(w1[e])), dequantize(quantize_nvfp4(w3[e]))])
                         for e in range(2)])
    got = dequantize(stacked)
    assert torch.equal(got[:, 32:], apart[:, 32:])  # w3 has the larger global scale: untouched
    assert ((got - apart).abs() <= apart.abs() / 16 + 1e-6).all()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_native_experts_match_the_dequantized_model(v4_dir, tmp_path, monkeypatch, scheme):
    path = _checkpoint(v4_dir, str(tmp_path / scheme), scheme)
    ids = mixed_prompts(512, (30,))[0]
    dequantized = LLM(path, block_size=4)
    assert isinstance(dequantized.engine.model.layers[1].ffn.experts.w13, torch.nn.Parameter)
    reference = engine_logits(dequantized, "q", ids, 0, 16)
    monkeypatch.setattr(deepseek_v4_experts, "keeps_native_experts", lambda device: True)
    llm = LLM(path, block_size=4)
    model = llm.engine.model
    experts = model.layers[1].ffn.experts
    if scheme == "fp8":  # I = 32: w1's last 128-row scale block would hold w3's rows: w13 dequantized
        assert isinstance(experts.w13, torch.Tensor) and experts.w13.dtype == torch.float32
        assert isinstance(experts.w2, QuantizedWeight) and experts.w2.fmt == "fp8_block"
    else:
        assert isinstance(experts.w13, QuantizedWeight) and isinstance(experts.w2, QuantizedWeight)
        assert experts.w13.fmt == experts.w2.fmt == SCHEMES[scheme][1]
        assert experts.w13.data.dtype == torch.uint8 and experts.w13.data.shape[-1] == model.args.hidden_size // 2
    if scheme == "mixed":
        assert model.mtp[0].ffn.experts.w13.fmt == "mxfp4"
    ours = engine_logits(llm, "q", ids, 0, 16)
    spread = (reference.max() - reference.min()).item()
    assert (ours - reference).abs().max().item() < 1e-5 * spread


def test_experts_of_one_layer_in_two_formats_are_refused(v4_dir, tmp_path, monkeypatch):
    from cluster.common.errors import ModelLoadError

    path = _checkpoint(v4_dir, str(tmp_path / "mxfp4"), "mxfp4")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.2.ffn.experts.5.w2"
    plain = {k: v for k, v in load_file(os.path.join(v4_dir, "model.safetensors")).items() if k.startswith(name)}
    nv, _ = quantize_tensors(plain, None, "nvfp4")
    del tensors[f"{name}.scale"]
    tensors |= nv
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(deepseek_v4_experts, "keeps_native_experts", lambda device: True)
    with pytest.raises(ModelLoadError, match=r"experts\.5\.w2\.weight.*nvfp4.*mxfp4"):
        LLM(path, block_size=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_native_experts_and_triton_kernels_match_the_references(v4_dir, tmp_path):
    """On CUDA by default: MXFP4 experts stay packed and every V4 op runs its Triton kernel. Two
    bf16 runs of a random model differ by more than rounding (the indexer's top-k and the router's
    expert choice are discrete, so a last-bit difference can select another entry), so the Triton
    path is held to the float32 torch reference no worse than torch's own bf16 path is."""
    path = _checkpoint(v4_dir, str(tmp_path / "mxfp4"), "mxfp4")
    ids = mixed_prompts(512, (45,))[0]

    def logits(llm: LLM) -> torch.Tensor:
        return torch.cat([engine_logits(llm, "r", ids[:40], 0, 13), engine_logits(llm, "r", ids, 40, 1)]).float()
    truth = logits(LLM(path, block_size=16, dtype="float32", attention_backend="torch", moe_backend="torch"))
    torch_bf16 = logits(LLM(path, block_size=16, dtype="bfloat16", attention_backend="torch", moe_backend="torch"))
    llm = LLM(path, block_size=16, dtype="bfloat16")
    table = {row["component"]: row["impl"] for row in llm.engine.backends()}
    assert table.pop("cuda_graphs") == "captured"  # the rows that are not a kernel's choice
    assert table.pop("fused_projections") == "fused"
    assert table.pop("prefill_warmup") == "warmed"
    assert all(impl == "triton" for impl in table.values()), table
    assert isinstance(llm.engine.model.layers[1].ffn.experts.w13, QuantizedWeight)
    got = logits(llm)
    assert not got.isnan().any()

    def rel(x: torch.Tensor) -> float:
        return ((x - truth).norm() / truth.norm()).item()
    print(f"relative error to float32: triton bf16 {rel(got):.4f}, torch bf16 {rel(torch_bf16):.4f}")
    assert rel(got) < max(1.5 * rel(torch_bf16), 1e-2)
    agree = (got.argmax(-1) == truth.argmax(-1)).float().mean().item()
    assert agree >= (torch_bf16.argmax(-1) == truth.argmax(-1)).float().mean().item() - 0.05 and agree > 0.85
