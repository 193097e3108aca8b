"""``load_format="dummy"``: a model served from config.json alone with random weights, the same for
a seed (so every replica of a disaggregated deployment holds the same model), at the shapes and
expert formats the config declares."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.common.errors import ModelLoadError, UnsupportedSettingError
from cluster.models.deepseek_v4 import DeepseekV4ForCausalLM
from cluster.models.deepseek_v4_config import DeepseekV4Args
from cluster.models.dummy import init_dummy_weights, random_experts
from kernels.quant import QuantizedWeight, dequantize
from tests.deepseek_factories import make_v4_checkpoint
from tests.factories import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def without_weights(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(dst, name))
    return dst


@pytest.fixture(scope="module")
def llama_config_dir(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(src, "llama", seed=2)
    return without_weights(src, str(tmp_path_factory.mktemp("cfg") / "llama"))


def test_llama_from_config_alone_is_deterministic_per_seed(llama_config_dir):
    first = LLM(llama_config_dir, block_size=4, load_format="dummy")
    again = LLM(llama_config_dir, block_size=4, load_format="dummy")
    other = LLM(llama_config_dir, block_size=4, load_format="dummy", seed=1)
    tokens = [llm.generate(["a dummy model"], GREEDY)[0].outputs[0].token_ids for llm in (first, again, other)]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]
    w = first.engine.model.layers[0].mlp.down_proj.weight
    assert abs(w.float().std().item() * math.sqrt(w.shape[1]) - 1.0) < 0.05  # N(0, 1/fan_in)
    assert torch.all(first.engine.model.layers[0].input_layernorm.weight == 1.0)
    assert not torch.equal(w, other.engine.model.layers[0].mlp.down_proj.weight)


def test_without_dummy_the_missing_weights_are_an_error(llama_config_dir):
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(llama_config_dir, block_size=4)


def test_unknown_load_format_is_refused(llama_config_dir):
    with pytest.raises(UnsupportedSettingError, match="load_format"):
        LLM(llama_config_dir, load_format="random")


def test_deepseek_v4_from_config_alone_generates(tmp_path):
    src = str(tmp_path / "v4")
    make_v4_checkpoint(src, "csa_hca")
    llm = LLM(without_weights(src, str(tmp_path / "cfg")), block_size=4, load_format="dummy")
    out = llm.generate([[5, 17, 3, 9]], GREEDY)[0].outputs[0]  # the small V4 test model has no tokenizer
    assert len(out.token_ids) == 6
    tid2eid = llm.engine.model.layers[0].ffn.gate.tid2eid
    assert all(len(set(row)) == len(row) for row in tid2eid.tolist())  # distinct experts per token


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block", "bf16"])
def test_native_experts_are_drawn_in_the_declared_format(fmt):
    gen = torch.Generator().manual_seed(0)
    w = random_experts((5, 64, 256), fmt, torch.bfloat16, torch.device("cpu"), gen, chunk=2)
    if fmt == "bf16":
        assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
    else:
        assert isinstance(w, QuantizedWeight) and w.fmt == fmt and w.shape == (5, 64, 256)
    values = dequantize(w, torch.float32)
    assert values.shape == (5, 64, 256)
    assert abs(values.std().item() * 16 - 1.0) < 0.1  # N(0, 1/K), K = 256


def test_native_experts_of_a_v4_model_follow_its_config(tmp_path):
    """Where experts stay native (CUDA), the dummy model gets quantized experts in the config's
    format, and runs (here on the CPU, through the reference MoE)."""
    from tests.deepseek_factories import v4_config
    config = v4_config("sliding").to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    model = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf(config), torch.float32, native_experts=True)
    init_dummy_weights(model, config, seed=3)
    experts = model.layers[1].ffn.experts
    assert isinstance(experts.w13, QuantizedWeight) and experts.w13.fmt == "mxfp4"
    assert experts.w13.shape == experts.shapes["w13"] and experts.w2.shape == experts.shapes["w2"]


def test_a_kv_budget_the_window_groups_use_up_is_refused_by_name(tmp_path):
    """DeepSeek-V4's window and state groups are sized for max_num_seqs first; a budget they use
    up leaves the growing groups nothing, and start-up says so (not a bare pool error)."""
    src = str(tmp_path / "v4")
    make_v4_checkpoint(src, "csa_hca")
    path = without_weights(src, str(tmp_path / "cfg"))
    with pytest.raises(UnsupportedSettingError, match="kv_cache_memory_bytes") as info:
        LLM(path, block_size=4, load_format="dummy", kv_cache_memory_bytes=64 << 10, max_num_seqs=64)
    assert info.value.param == "kv_cache_memory_bytes"
