"""DeepSeek-V4 checkpoints: the released config, its KV footprint, quantized weights (FP8 block
with ue8m0 or float scales, MXFP4 and NVFP4 experts, a mixed checkpoint with an MXFP4 MTP layer)
against transformers run from the dequantized weights, and loading errors that name the tensor
or the format."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM
from cluster.common.errors import ModelLoadError
from cluster.common.kv_spec import kv_bytes_per_token
from cluster.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Args
from cluster.models.deepseek_v4_kv import deepseek_v4_kv_specs
from cluster.models.deepseek_v4_quant import QuantScheme
from tests.deepseek_factories import (V4_FLASH_CONFIG, copy_checkpoint, edit_config, edit_tensors, engine_logits,
                                      make_v4_checkpoint, quantize_tensors, random_mtp_tensors)
from tests.factories import mixed_prompts

FP8_UE8M0 = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
             "activation_scheme": "dynamic"}
SCHEMES = {  # name: (matrix format, routed expert format, MTP expert format, quantization_config)
    "fp8_ue8m0": ("fp8_block", "fp8_block", None, FP8_UE8M0),
    "fp8_float": ("fp8_block", None, None, {**FP8_UE8M0, "scale_fmt": "float"}),
    "mxfp4": ("fp8_block", "mxfp4", None, {**FP8_UE8M0, "expert_dtype": "fp4"}),
    "nvfp4": (None, "nvfp4", None, {"quant_method": "modelopt", "quant_algo": "NVFP4"}),
    "mixed": ("fp8_block", "nvfp4", "mxfp4", {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                              "quantized_layers": {"layers.*.ffn.experts.*": {"quant_algo": "NVFP4"},
                                                                   "mtp.0.ffn.experts.*": {"quant_algo": "MXFP4"}}}),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("csa_hca"))
    return path, make_v4_checkpoint(path, "csa_hca")


def write_checkpoint(src: str, dst: str, tensors: dict[str, torch.Tensor], quantization: dict | None) -> str:
    copy_checkpoint(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    edit_config(dst, lambda c: c.update(quantization_config=quantization) if quantization else None)
    return dst


# --- the released config and its KV state --------------------------------------------------------


def test_released_config_is_understood():
    import transformers

    args = DeepseekV4Args.from_hf(V4_FLASH_CONFIG)
    assert args.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and args.layer_types[-1] == CSA
    assert (args.num_csa_layers, args.num_hca_layers, args.csa_ratio, args.hca_ratio) == (21, 20, 4, 128)
    assert args.hash_layers[:4] == (True, True, True, False) and args.mtp_layer_types == (SLIDING,)
    assert args.rope_dim == 64 and args.main_rope.yarn is None and args.compress_rope.theta == 160000
    hf_rope = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(
        transformers.DeepseekV4Config(**V4_FLASH_CONFIG))
    torch.testing.assert_close(args.compress_rope.inv_freq(64), hf_rope.compress_inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(args.main_rope.inv_freq(64), hf_rope.main_inv_freq, rtol=1e-6, atol=0)
    assert QuantScheme.from_config(V4_FLASH_CONFIG).formats == {"fp8_block", "mxfp4"}


def test_v4_flash_kv_bytes_per_token():
    """V4-Flash, bf16 KV, block size 16, at 1M tokens of context: 6,880 bytes per token grow with
    the context (CSA entries + indexer keys every 4 tokens in 21 layers, HCA entries every 128 in
    20), plus a fixed 5.9 MB (the 128-token windows of 43 layers and two float32 compressor
    checkpoints) -> 6,885.7 B/token, 15.6% of the 44,032 B/token a plain full-attention cache of
    the same width (one 512-wide K=V entry per token per layer) takes: 6.4x smaller."""
    args = DeepseekV4Args.from_hf(V4_FLASH_CONFIG)
    specs = deepseek_v4_kv_specs(args, 16, "bfloat16")
    layers, window, d, di, bf16, f32 = 43, 128, 512, 128, 2, 4
    csa, hca = 21, 20
    growing = csa * (d + di) * bf16 / 4 + hca * d * bf16 / 128
    fixed = layers * window * d * bf16 + csa * 2 * 2 * (d + di) * f32 + hca * 2 * d * f32
    full_attention = layers * d * bf16
    context = 1 << 20
    got = kv_bytes_per_token(specs, context)
    assert growing == 6880 and full_attention == 44032
    assert got == pytest.approx(growing + fixed / context, rel=1e-12)
    assert round(got, 1) == 6885.7
    assert full_attention / got > 6.39


# --- quantized checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_checkpoint_matches_dequantized_model(base, tmp_path, scheme):
    import transformers

    src, original = base
    matrix_fmt, expert_fmt, mtp_fmt, quantization = SCHEMES[scheme]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if mtp_fmt is not None:
        tensors |= random_mtp_tensors(original.config.to_dict())
    quantized, plain = quantize_tensors(tensors, matrix_fmt, expert_fmt, mtp_fmt,
                                        fp8_scale="float32" if scheme == "fp8_float" else "ue8m0")
    qdir = write_checkpoint(src, str(tmp_path / "q"), quantized, quantization)
    ddir = write_checkpoint(src, str(tmp_path / "d"), plain, None)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ddir).float().eval()
    llm = LLM(qdir, block_size=4)
    ids = mixed_prompts(512, (40,))[0]
    ours = engine_logits(llm, "q", ids, 0, 16)
    with torch.no_grad():
        ref, unquantized = hf(torch.tensor([ids])).logits[0], original(torch.tensor([ids])).logits[0]
    spread = (ref.max() - ref.min()).item()
    assert (ours - ref).abs().max().item() < 1e-4 * spread
    assert (unquantized - ref).abs().max().item() > 1e-3 * spread  # quantization did change the weights
    if mtp_fmt is not None:
        mtp = llm.engine.model.mtp[0]
        assert torch.equal(mtp.attn.wq_a.weight, plain["mtp.0.attn.wq_a.weight"])
        inter = mtp.ffn.experts.w13.shape[1] // 2
        assert torch.equal(mtp.ffn.experts.w13[3, inter:], plain["mtp.0.ffn.experts.3.w3.weight"])
        assert torch.equal(mtp.hc_head_fn, plain["mtp.0.hc_head_fn"])


def test_checkpoint_without_mtp_loads_without_it(base):
    llm = LLM(base[0], block_size=4)
    assert len(llm.engine.model.mtp) == 0


# --- errors ------------------------------------------------------------------------------------------


def broken(base, tmp_path, edit=None, config=None) -> str:
    path = copy_checkpoint(base[0], str(tmp_path / "broken"))
    if edit is not None:
        edit_tensors(path, edit)
    if config is not None:
        edit_config(path, config)
    return path


def test_missing_tensor_is_named(base, tmp_path):
    path = broken(base, tmp_path, lambda t: t.pop("model.layers.1.attn.indexer.wq_b.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) 'layers\.1\.attn\.indexer\.wq_b\.weight'"):
        LLM(path)


def test_misshaped_tensor_is_named(base, tmp_path):
    path = broken(base, tmp_path, lambda t: t.update({"model.layers.2.attn.compressor.ape": torch.zeros(3, 32)}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.attn\.compressor\.ape.*\(3, 32\)"):
        LLM(path)


def test_unknown_quantization_format_is_named(base, tmp_path):
    path = broken(base, tmp_path, config=lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}))
    with pytest.raises(ModelLoadError, match="unknown quantization format 'awq'"):
        LLM(path)
    path = broken(base, tmp_path, config=lambda c: c.update(quantization_config={**FP8_UE8M0, "expert_dtype": "fp3"}))
    with pytest.raises(ModelLoadError, match="expert_dtype='fp3'"):
        LLM(path)


def test_unknown_tensor_format_is_named(base, tmp_path):
    name = "model.layers.0.attn.wq_a.weight"
    path = broken(base, tmp_path, lambda t: t.update({name: t[name].to(torch.float8_e5m2)}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.attn\.wq_a\.weight.*float8_e5m2"):
        LLM(path)


def test_quantized_weight_without_scale_is_named(base, tmp_path):
    name = "model.layers.3.attn.wo_b.weight"
    path = broken(base, tmp_path, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.attn\.wo_b\.weight.*fp8_block"):
        LLM(path)


def test_misshaped_scale_is_named(base, tmp_path):
    name = "model.layers.1.ffn.experts.2.w1"

    def edit(t):
        q, _ = quantize_tensors({f"{name}.weight": t[f"{name}.weight"]}, None, "nvfp4")
        q[f"{name}.weight_scale"] = q[f"{name}.weight_scale"][:, :2].contiguous()
        t.update(q)

    with pytest.raises(ModelLoadError, match=r"experts\.2\.w1\.weight scale' \(nvfp4\) has shape \(32, 2\)"):
        LLM(broken(base, tmp_path, edit))


def test_partial_mtp_layer_is_named(base, tmp_path):
    def edit(t):
        mtp = random_mtp_tensors(base[1].config.to_dict())
        del mtp["mtp.0.ffn.experts.5.w2.weight"]
        t.update(mtp)

    with pytest.raises(ModelLoadError, match=r"mtp\.0\.ffn\.experts\.5\.w2\.weight"):
        LLM(broken(base, tmp_path, edit))
