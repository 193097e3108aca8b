"""DeepSeek-V4 configuration: ``DeepseekV4Args`` parsed from a checkpoint's config.json, in either
shape it ships in (the released checkpoints' ``compress_ratios`` / ``num_hash_layers`` /
``qk_rope_head_dim`` / ``rope_scaling`` fields, or the ``layer_types`` / ``compress_rates`` /
``mlp_layer_types`` / nested ``rope_parameters`` that transformers writes), resolved the way
transformers' ``DeepseekV4Config`` resolves them; and the YaRN inverse frequencies of the
compressed layers' RoPE."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cluster.common.errors import UnsupportedArchitectureError
from kernels.deepseek_v4_ref import SCORING_FUNCS

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class RopeArgs:
    """One RoPE flavour: ``theta`` plus optional YaRN (``factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``); ``attention_factor`` multiplies cos/sin (1.0 for V4's YaRN)."""

    theta: float
    yarn: tuple[float, int, float, float] | None = None
    attention_factor: float = 1.0

    def inv_freq(self, rope_dim: int) -> torch.Tensor:
        """``[rope_dim // 2]`` float32 inverse frequencies (YaRN as transformers computes it, with
        the correction range truncated to whole dims)."""
        exponents = torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim
        pos_freqs = self.theta ** exponents
        if self.yarn is None:
            return 1.0 / pos_freqs
        factor, original_len, beta_fast, beta_slow = self.yarn

        def correction_dim(rotations: float) -> float:
            return rope_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = float(max(math.floor(correction_dim(beta_fast)), 0))
        high = float(min(math.ceil(correction_dim(beta_slow)), rope_dim - 1))
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@dataclass(frozen=True)
class DSparkArgs:
    """The DSpark drafter of DeepSeek-V4-Flash-0731 / V4.1-Flash (``dspark_*`` config keys;
    cluster/models/deepseek_v4_dspark.py): ``num_stages`` draft layers under ``mtp.0..``, fed by
    the mean of the target's hyper-connection streams after each of ``target_layer_ids``, drafting
    ``block_size`` tokens per block (the newest token, then ``noise_token_id`` rows) through a
    Markov head of rank ``markov_rank``."""

    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    num_stages: int


@dataclass(frozen=True)
class DeepseekV4Args:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    #: Per layer: SLIDING, CSA or HCA. Every layer also attends its sliding window.
    layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float | None
    #: Per layer: routed by the ``tid2eid`` table (hash) rather than by the learned gate.
    hash_layers: tuple[bool, ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeArgs
    compress_rope: RopeArgs
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: The MTP (next-n) layers' attention types; their weights are loaded and kept.
    mtp_layer_types: tuple[str, ...]
    #: A DSpark drafter in place of MTP layers (its stages live under ``mtp.*``), or None.
    dspark: DSparkArgs | None = None

    def ratio(self, layer_type: str) -> int:
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[layer_type]

    @property
    def num_csa_layers(self) -> int:
        return self.layer_types.count(CSA)

    @property
    def num_hca_layers(self) -> int:
        return self.layer_types.count(HCA)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DeepseekV4Args:
        try:
            return _parse(config)
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedArchitectureError(f"DeepseekV4ForCausalLM: config.json lacks or mis-types {exc}") from exc


def _parse(config: dict[str, Any]) -> DeepseekV4Args:
    n = int(config.get("num_hidden_layers", 43))
    head_dim = int(config.get("head_dim", 512))
    if int(config.get("num_key_value_heads", 1)) != 1:
        raise UnsupportedArchitectureError("DeepSeek-V4 attention has one shared KV head (num_key_value_heads=1)")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {config.get('hidden_act')!r} is not supported (silu is)")
    scoring = str(config.get("scoring_func", "sqrtsoftplus"))
    if scoring not in SCORING_FUNCS:
        raise UnsupportedArchitectureError(f"scoring_func {scoring!r} is not supported ({', '.join(SCORING_FUNCS)})")
    rates = _compress_rates(config)
    all_types = _layer_types(config, rates, n)
    dspark = _dspark(config, all_types, n)
    n_mtp = 0 if dspark is not None else int(config.get("num_nextn_predict_layers", 0) or 0)
    mtp_types = tuple(all_types[n:n + n_mtp]) + (SLIDING,) * max(0, n_mtp - len(all_types[n:]))
    partial = config.get("partial_rotary_factor")
    if partial is None:
        partial = float(config.get("qk_rope_head_dim", 64)) / head_dim
    main_rope, compress_rope = _ropes(config)
    limit = config.get("swiglu_limit", 10.0)
    return DeepseekV4Args(
        vocab_size=int(config.get("vocab_size", 129280)),
        hidden_size=int(config.get("hidden_size", 4096)),
        num_layers=n,
        num_heads=int(config.get("num_attention_heads", 64)),
        head_dim=head_dim,
        rope_dim=int(head_dim * float(partial)),
        q_lora_rank=int(config.get("q_lora_rank", 1024)),
        o_groups=int(config.get("o_groups", 8)),
        o_lora_rank=int(config.get("o_lora_rank", 1024)),
        layer_types=tuple(all_types[:n]),
        csa_ratio=rates[CSA],
        hca_ratio=rates[HCA],
        sliding_window=int(config.get("sliding_window", 128)),
        index_n_heads=int(config.get("index_n_heads", 64)),
        index_head_dim=int(config.get("index_head_dim", 128)),
        index_topk=int(config.get("index_topk", 512)),
        n_routed_experts=int(config.get("n_routed_experts", 256)),
        n_shared_experts=int(config.get("n_shared_experts", 1)),
        num_experts_per_tok=int(config.get("num_experts_per_tok", 6)),
        moe_intermediate_size=int(config.get("moe_intermediate_size", 2048)),
        scoring_func=scoring,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
        swiglu_limit=None if limit is None else float(limit),
        hash_layers=_hash_layers(config, n),
        hc_mult=int(config.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(config.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(config.get("hc_eps", 1e-6)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=int(config.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        mtp_layer_types=mtp_types,
        dspark=dspark,
    )


def _dspark(config: dict[str, Any], all_types: list[str], n: int) -> DSparkArgs | None:
    """The DSpark drafter's settings, or None (no ``dspark_block_size``). Its stage count is not
    ``num_nextn_predict_layers`` (the released 0731 config says 1 for 3 stages): it is
    ``n_mtp_layers`` where given (DeepSeek's inference config), else the attention types listed
    past the model's layers (``compress_ratios`` has one entry per stage), else one stage per
    target layer; the loader checks it against the checkpoint's ``mtp.<i>`` prefixes."""
    block = int(config.get("dspark_block_size") or 0)
    if block <= 0:
        return None
    targets = tuple(int(t) for t in config.get("dspark_target_layer_ids") or ())
    if not targets or any(not 0 <= t < n for t in targets):
        raise UnsupportedArchitectureError(
            f"dspark_target_layer_ids must list layers of the model (0..{n - 1}), got {list(targets)}")
    for key in ("dspark_markov_rank", "dspark_noise_token_id"):
        if config.get(key) is None:
            raise UnsupportedArchitectureError(f"a DSpark config (dspark_block_size={block}) needs {key}")
    vocab = int(config.get("vocab_size", 129280))
    noise = int(config["dspark_noise_token_id"])
    if not 0 <= noise < vocab:
        raise UnsupportedArchitectureError(f"dspark_noise_token_id {noise} is outside the vocabulary ({vocab})")
    stages = int(config.get("n_mtp_layers") or 0) or (len(all_types) - n) or len(targets)
    if any(t != SLIDING for t in all_types[n:n + stages]):
        raise UnsupportedArchitectureError(
            f"DSpark stages attend a sliding window only (compress ratio 0); the config gives them "
            f"{list(all_types[n:n + stages])}")
    return DSparkArgs(block, targets, int(config["dspark_markov_rank"]), noise, stages)


def _compress_rates(config: dict[str, Any]) -> dict[str, int]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    rates.update({k: int(v) for k, v in (config.get("compress_rates") or {}).items()})
    if config.get("compress_rate_csa") is not None:
        rates[CSA] = int(config["compress_rate_csa"])
    if config.get("compress_rate_hca") is not None:
        rates[HCA] = int(config["compress_rate_hca"])
    if min(rates[CSA], rates[HCA]) < 1:
        raise UnsupportedArchitectureError(f"compression ratios must be >= 1, got {rates}")
    return rates


def _layer_types(config: dict[str, Any], rates: dict[str, int], n: int) -> list[str]:
    """Attention type per layer, then per MTP layer where the config lists them (the released
    ``compress_ratios`` has one entry per layer plus one per MTP layer)."""
    if config.get("layer_types") is not None:
        types = [str(t) for t in config["layer_types"]]
    elif config.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, 4: CSA, 128: HCA, rates[CSA]: CSA, rates[HCA]: HCA}
        types = []
        for r in config["compress_ratios"]:
            if int(r) not in by_ratio:
                raise UnsupportedArchitectureError(f"compress_ratios entry {r} is not 0, {rates[CSA]} or {rates[HCA]}")
            types.append(by_ratio[int(r)])
    else:  # transformers' default: two HCA layers, then CSA / HCA interleaved
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedArchitectureError(f"unknown DeepSeek-V4 layer type(s) {bad}; known: {LAYER_TYPES}")
    if len(types) < n:
        raise UnsupportedArchitectureError(f"{len(types)} layer types for {n} layers")
    return types


def _hash_layers(config: dict[str, Any], n: int) -> tuple[bool, ...]:
    mlp_types = config.get("mlp_layer_types")
    if mlp_types is not None:
        bad = sorted({t for t in mlp_types if t not in ("hash_moe", "moe")})
        if bad:
            raise UnsupportedArchitectureError(f"unknown mlp_layer_types {bad} (hash_moe, moe)")
        return tuple(t == "hash_moe" for t in mlp_types[:n])
    n_hash = int(config.get("num_hash_layers", 3))
    return tuple(i < n_hash for i in range(n))


def _ropes(config: dict[str, Any]) -> tuple[RopeArgs, RopeArgs]:
    """(main, compress): sliding-only layers use the main RoPE; compressed layers, their
    compressors and the indexer use the compress RoPE, the only one YaRN applies to."""
    params = config.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return (_rope(params["main"], config, default_theta=10000.0),
                _rope(params["compress"], config, default_theta=160000.0))
    scaling = {k: v for k, v in {**(config.get("rope_scaling") or {}), **params}.items()
               if k not in ("main", "compress", "rope_theta")}
    main = RopeArgs(float(config.get("rope_theta", 10000.0)))
    compress = _rope({**scaling, "rope_theta": config.get("compress_rope_theta", 160000.0)}, config, 160000.0)
    return main, compress


def _rope(params: dict[str, Any], config: dict[str, Any], default_theta: float) -> RopeArgs:
    theta = float(params.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return RopeArgs(theta)
    if kind != "yarn":
        raise UnsupportedArchitectureError(f"rope type {kind!r} is not supported for DeepSeek-V4 (default, yarn)")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(config.get("max_position_embeddings", 1)) / original
    yarn = (factor, original, float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1))
    return RopeArgs(theta, yarn, float(params.get("attention_factor", 1.0)))
