"""Model loading errors: unknown paths, unsupported architectures, missing or mis-shaped tensors
(the message names the tensor); sharded safetensors load."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from cluster.common.errors import ModelLoadError, UnsupportedArchitectureError
from tests.factories import hf_greedy, make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    model = make_checkpoint(path, "llama")
    return path, model


def copy_dir(src: str, dst: str) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as fi, open(os.path.join(dst, name), "wb") as fo:
            fo.write(fi.read())
    return dst


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/no/such/model")


def test_unsupported_architecture(checkpoint, tmp_path):
    path = copy_dir(checkpoint[0], str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["MambaForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedArchitectureError, match="MambaForCausalLM"):
        LLM(path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = copy_dir(checkpoint[0], str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(path)


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    path = copy_dir(checkpoint[0], str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.randn(3, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(3, 64\)"):
        LLM(path)


def test_sharded_checkpoint_loads(checkpoint, tmp_path):
    path, hf = checkpoint
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    llm = LLM(sharded, block_size=4)
    out = llm.generate([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, [4, 5, 6], 8)
