"""Small DeepSeek-V4 factories for tests: random checkpoints saved by transformers'
``DeepseekV4ForCausalLM.save_pretrained`` (weights drawn at a visible scale), HF greedy decoding,
quantized copies of a checkpoint (FP8 block, MXFP4, NVFP4, mixed, with an MTP layer), and the
released DeepSeek-V4-Flash config."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kernels.quant import QuantizedWeight, dequantize, quantize

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

#: Small configurations with windows and compression ratios that prompts of 3..60 tokens cross.
CONFIGS: dict[str, dict[str, Any]] = {
    "sliding": dict(num_hidden_layers=2, layer_types=[SWA, SWA], mlp_layer_types=["hash_moe", "moe"],
                    sliding_window=6),
    "csa_hca": dict(num_hidden_layers=4, layer_types=[SWA, CSA, HCA, CSA],
                    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], sliding_window=8,
                    compress_rates={CSA: 4, HCA: 8}, index_topk=3,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                     "beta_fast": 32, "beta_slow": 1}),
    "hca_csa": dict(num_hidden_layers=3, layer_types=[HCA, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
                    sliding_window=5, compress_rates={CSA: 2, HCA: 16}, index_topk=2, o_groups=4),
}

#: The released DeepSeek-V4-Flash config.json (the fields that size the model and its KV state).
V4_FLASH_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000,
    "compress_rope_theta": 160000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                                    "original_max_position_embeddings": 65536, "type": "yarn"},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
    "tie_word_embeddings": False, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def v4_config(name: str, **overrides: Any) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
        q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, o_groups=2, o_lora_rank=16,
        index_n_heads=16, index_head_dim=16, partial_rotary_factor=0.25, max_position_embeddings=1024,
        eos_token_id=1, bos_token_id=0)
    return transformers.DeepseekV4Config(**{**common, **CONFIGS[name], **overrides})


def make_v4_checkpoint(path: str, name: str, seed: int = 0, **overrides: Any) -> Any:
    """Save a random ``name`` model to ``path``; returns the transformers model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(v4_config(name, **overrides)).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif pname.endswith(("norm.weight", "layernorm.weight")):
                p.normal_(1.0, 0.2)
            elif pname.endswith(("scale", "hc_scale")):
                p.normal_(1.0, 0.3)
            else:  # sinks, position biases, hyper-connection biases
                p.normal_(0.0, 0.5)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
            elif bname.endswith("tid2eid"):  # distinct experts per token, as a trained table has
                b.copy_(torch.rand(b.shape[0], model.config.n_routed_experts).argsort(-1)[:, :b.shape[1]])
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation through transformers' own cache (no logits processors: ``generate``'s
    ``min_new_tokens`` would ban the EOS token, which random models like to predict)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        cache = getattr(out, "cache", None)  # transformers < 5.2x calls it past_key_values
        kwargs = {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}
        out = model(torch.tensor([tokens[-1:]]), use_cache=True, **kwargs)
    return tokens


def engine_logits(llm: Any, request_id: str, ids: list[int], start: int, chunk: int) -> torch.Tensor:
    """Logits at positions ``start..len(ids)-1`` of request ``request_id`` (its blocks grow as
    needed), computed ``chunk`` tokens at a time through the engine's model runner."""
    from cluster import SamplingParams
    from cluster.engine.request import Request
    from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput

    eng = llm.engine
    req = Request(request_id, ids, SamplingParams())
    pieces = []
    for pos in range(start, len(ids), chunk):
        n = min(chunk, len(ids) - pos)
        assert eng.kv.allocate(request_id, pos + n)
        sched = SchedulerOutput([ScheduledRequest(req, pos, n, request_id, ids[pos:pos + n])],
                                {request_id: eng.kv.block_tables(request_id)})
        hidden, _ = eng.runner.forward(sched)
        pieces.append(eng.model.compute_logits(hidden))
    return torch.cat(pieces)


def copy_checkpoint(src: str, dst: str) -> str:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def edit_tensors(path: str, edit: Any) -> None:
    """Apply ``edit(dict of tensors)`` to the checkpoint's single safetensors file."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(path: str, edit: Any) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    edit(config)
    with open(file, "w") as f:
        json.dump(config, f)


_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_MATRIX = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj|main_proj)"
                     r"\.weight$")


def _store(out: dict[str, torch.Tensor], name: str, q: QuantizedWeight) -> None:
    base = name.removesuffix(".weight")
    if q.fmt == "fp8_block":
        assert q.scale is not None
        ue8m0 = q.scale.dtype == torch.uint8  # released checkpoints store ue8m0 scales as float8_e8m0fnu
        out[name], out[f"{base}.scale"] = q.data, q.scale.view(torch.float8_e8m0fnu) if ue8m0 else q.scale
    elif q.fmt == "mxfp4":
        assert q.scale is not None
        out[name], out[f"{base}.scale"] = q.data.view(torch.int8), q.scale.view(torch.float8_e8m0fnu)
    else:
        assert q.scale is not None and q.global_scale is not None
        out[name], out[f"{base}.weight_scale"] = q.data, q.scale
        out[f"{base}.weight_scale_2"] = q.global_scale.reshape(())


def quantize_tensors(tensors: dict[str, torch.Tensor], matrix_fmt: str | None, expert_fmt: str | None,
                     mtp_expert_fmt: str | None = None, fp8_scale: str = "ue8m0"
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(quantized checkpoint tensors, the same weights dequantized): attention / shared-expert /
    MTP projections in ``matrix_fmt``, routed experts in ``expert_fmt`` (MTP experts in
    ``mtp_expert_fmt``); None leaves a kind of tensor in float32."""
    quantized: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        is_expert = _EXPERT.search(name) is not None
        fmt = (mtp_expert_fmt if name.startswith("mtp.") else expert_fmt) if is_expert else \
            matrix_fmt if _MATRIX.search(name) else None
        if fmt is None:
            quantized[name] = plain[name] = t
            continue
        q = quantize(t.float(), fmt, fp8_scale=fp8_scale if fmt == "fp8_block" else "float32")
        _store(quantized, name, q)
        plain[name] = dequantize(q, torch.float32)
    return quantized, plain


def random_mtp_tensors(config: dict[str, Any], seed: int = 1) -> dict[str, torch.Tensor]:
    """Released-layout tensors of one MTP layer (sliding attention, learned routing) for ``config``."""
    g = torch.Generator().manual_seed(seed)
    h, d, q = config["hidden_size"], config["head_dim"], config["q_lora_rank"]
    heads, e, i, n = config["num_attention_heads"], config["n_routed_experts"], config["moe_intermediate_size"], \
        config["hc_mult"]
    groups, rank = config["o_groups"], config["o_lora_rank"]
    shapes = {"attn.wq_a.weight": (q, h), "attn.q_norm.weight": (q,), "attn.wq_b.weight": (heads * d, q),
              "attn.wkv.weight": (d, h), "attn.kv_norm.weight": (d,), "attn.attn_sink": (heads,),
              "attn.wo_a.weight": (groups * rank, heads * d // groups), "attn.wo_b.weight": (h, groups * rank),
              "attn_norm.weight": (h,), "ffn_norm.weight": (h,), "ffn.gate.weight": (e, h), "ffn.gate.bias": (e,),
              "ffn.shared_experts.w1.weight": (i, h), "ffn.shared_experts.w2.weight": (h, i),
              "ffn.shared_experts.w3.weight": (i, h), "e_proj.weight": (h, h), "h_proj.weight": (h, h),
              "enorm.weight": (h,), "hnorm.weight": (h,), "norm.weight": (h,), "hc_head_fn": (n, n * h),
              "hc_head_base": (n,), "hc_head_scale": (1,)}
    for kind in ("attn", "ffn"):
        shapes |= {f"hc_{kind}_fn": ((2 + n) * n, n * h), f"hc_{kind}_base": ((2 + n) * n,), f"hc_{kind}_scale": (3,)}
    for x in range(e):
        shapes |= {f"ffn.experts.{x}.w1.weight": (i, h), f"ffn.experts.{x}.w2.weight": (h, i),
                   f"ffn.experts.{x}.w3.weight": (i, h)}
    return {f"mtp.0.{k}": torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}


def random_dspark_tensors(config: dict[str, Any], num_stages: int, num_targets: int, rank: int,
                          seed: int = 2) -> dict[str, torch.Tensor]:
    """Released-layout tensors of a DSpark drafter (DeepSeek-V4-Flash-0731: ``mtp.<s>.*`` V4
    blocks on the sliding path with learned routing; ``main_proj``/``main_norm`` on stage 0; the
    hyper head, ``norm``, Markov and confidence heads on the last) for ``config``."""
    g = torch.Generator().manual_seed(seed)
    h, v, n = config["hidden_size"], config["vocab_size"], config["hc_mult"]
    block = {k.removeprefix("mtp.0."): t.shape for k, t in random_mtp_tensors(config, seed).items()
             if not k.removeprefix("mtp.0.").startswith(("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head"))}
    out: dict[str, torch.Tensor] = {}
    for s in range(num_stages):
        shapes = dict(block)
        if s == 0:
            shapes |= {"main_proj.weight": (h, num_targets * h), "main_norm.weight": (h,)}
        if s == num_stages - 1:
            shapes |= {"norm.weight": (h,), "hc_head_fn": (n, n * h), "hc_head_base": (n,), "hc_head_scale": (1,),
                       "markov_head.markov_w1.weight": (v, rank), "markov_head.markov_w2.weight": (v, rank),
                       "confidence_head.proj.weight": (1, h + rank)}
        for k, shape in shapes.items():
            t = torch.randn(shape, generator=g) * 0.1
            if k.endswith("norm.weight") or k.endswith("scale"):
                t = 1.0 + t * 2
            out[f"mtp.{s}.{k}"] = t
    return out


def add_dspark(path: str, config: dict[str, Any], targets: list[int], num_stages: int = 3, block: int = 5,
               rank: int = 8, noise: int = 7, seed: int = 2, **keys: Any) -> dict[str, torch.Tensor]:
    """Write a random DSpark drafter into the checkpoint at ``path`` (and its ``dspark_*`` keys)."""
    tensors = random_dspark_tensors(config, num_stages, len(targets), rank, seed)
    edit_tensors(path, lambda t: t.update(tensors))

    def keys_of(c: dict[str, Any]) -> None:
        c.update(dspark_block_size=block, dspark_target_layer_ids=list(targets), dspark_markov_rank=rank,
                 dspark_noise_token_id=noise, num_nextn_predict_layers=1, **keys)
        if num_stages != len(targets):
            c["n_mtp_layers"] = num_stages
    edit_config(path, keys_of)
    return tensors
