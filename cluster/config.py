"""Configuration: one frozen dataclass per concern, plus parsing from ``key=value`` arguments, YAML
and environment. Components take the narrowest config they need; values only known at run time
(a model's context length, the number of KV blocks that fit) make a new config with
``dataclasses.replace``, never a mutation."""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.common.errors import UnsupportedSettingError

Role = Literal["colocated", "prefill", "decode"]
TransferBackendName = Literal["auto", "ipc", "nixl", "nccl", "local"]
SpeculativeMethod = Literal["none", "ngram", "draft_head", "mtp", "dspark"]
#: The most draft tokens one verify step checks.
MAX_SPECULATIVE_TOKENS = 16
#: num_speculative_tokens where it is not set, by device type. On a CPU a verify step's 1 + k rows
#: go through the 4-bit projection kernel, whose cost jumps from 4 rows to 5: SmolLM2 on 2 cores
#: gained more at k=3 than at k=4 with both draft sources (bench/results/spec-decode-cpu-2026-12-04-k3.json
#: against -vocab.json: n-gram 1.22x against 1.13x, the draft head 1.08x against 0.82x). On a GPU
#: the draft head gained more at k=4 (spec-decode-smollm2-h200-2026-12-04-vocab-k4.json, -k3.json).
DEFAULT_SPECULATIVE_TOKENS = {"cpu": 3, "cuda": 4}


@dataclass(frozen=True)
class ModelConfig:
    #: HF-style directory, a .gguf file, or the embedded default's name "smollm2".
    model: str = "smollm2"
    #: "float32", "bfloat16" or "float16"; None: bfloat16 on CUDA, float32 on CPU with a GGUF
    #: file's 4-bit projections kept quantized (cluster.models.cpu_quant; "float32" dequantizes all).
    dtype: str | None = None
    #: "cpu", "cuda", "cuda:N"; None: CUDA when present, else CPU.
    device: str | None = None
    #: None: the model's own limit (max_position_embeddings), capped at 8192 on CPU.
    max_model_len: int | None = None
    seed: int = 0
    #: Kernel choices ("auto" resolves per device capability; see kernels.dispatch).
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    draft_moe_backend: str = "auto"
    #: Use CUDA graphs for decode batches on CUDA.
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    #: "auto": weights from the checkpoint; "dummy": random weights at the config's shapes and
    #: formats (benchmarks at real widths; the directory needs config.json and, to serve text,
    #: a tokenizer, but no weights).
    load_format: str = "auto"
    #: Speculative decoding on decode (and colocated) engines; prefill engines never draft.
    #: "none"; "ngram" (prompt lookup: the tokens that followed the latest earlier match of the
    #: context's last n tokens, n from prompt_lookup_max down to prompt_lookup_min);
    #: "draft_head" (a one-layer head over the model's last hidden state, Llama family: prefill
    #: engines run it over the prompt and hand its state to decode); "mtp" (DeepSeek-V4's MTP
    #: layer, the same way); "dspark" (DeepSeek-V4-Flash-0731 / V4.1's DSpark drafter: one block of
    #: up to dspark_block_size drafts per step; its state travels in the KV blocks).
    speculative_method: SpeculativeMethod = "none"
    #: Draft tokens proposed per step (k): each verify step computes 1 + k positions. None: 4 on
    #: a GPU, 3 on a CPU (DEFAULT_SPECULATIVE_TOKENS; the engine resolves it).
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    #: draft_head weights (a safetensors file from bench/train_draft_head.py); None: the head
    #: shipped for the model (cluster/models/draft_heads: "smollm2").
    speculative_model: str | None = None
    #: draft_head's vocabulary (the tokens it may draft, from bench/draft_vocab.py): None: the
    #: file next to the head's weights (``<head>.vocab.safetensors``) where there is one, else the
    #: whole vocabulary; "full": the whole vocabulary; else a path. Drafting over the tokens the
    #: model writes most costs a fraction of the whole LM head; outputs never change (the verify
    #: step decides every token), acceptance only by the answer tokens outside the set.
    speculative_draft_vocab: str | None = None
    #: How draft_head and mtp draft for a sampled request (temperature > 0): "coupled" (default)
    #: draws each draft from the head's distribution at the request's temperature with the noise
    #: the target's own draw at that position uses (drawn ahead), so a draft equals the target's
    #: token wherever their distributions agree; "greedy" drafts the head's argmax. Outputs are
    #: the same either way (seeded ones token for token); acceptance is not.
    speculative_draft_sampling: str = "coupled"
    #: dspark: a block's drafts stop at the first whose confidence head gives it less than this
    #: chance of acceptance (sigmoid); 0 (default): every block verifies all its drafts.
    dspark_confidence_threshold: float = 0.0
    #: dspark on a GPU: each block replays a captured CUDA graph (cluster/engine/dspark_graphs.py)
    #: instead of launching its kernels from Python (on by default: the GPU gate runs them,
    #: gpucheck-h200-2026-12-05-*.json); off, ``/v1/backends`` says so.
    dspark_cuda_graphs: bool = True
    #: mtp (and draft_head on a model with several KV groups: DeepSeek-V4's six) with
    #: ``async_scheduling`` on a GPU: verify steps run pipelined (spec_pipeline.py: the rows of
    #: every group laid out, the compressors' accepted states committed and the next drafts
    #: launched on the device). On by default since the GPU gate ran them (gpucheck at 9f81b9f on
    #: an H200 and fa659ec on an H100); ``false`` runs the verify steps of such a model
    #: synchronously, and ``/v1/backends`` says so. Models of one KV group pipeline regardless.
    pipelined_verify_kv_groups: bool = True
    #: On a GPU: at start-up, one prompt of each power-of-two length from 1 token up to the step's
    #: token budget runs through the model (into KV blocks freed right after), so the Triton
    #: autotuning and compilation that each length bucket of the prefill kernels triggers happens
    #: before serving, not inside the first step that brings a prompt of that size (a stall of
    #: up to a second for every request in that step). The tuned configs persist on disk, so a
    #: replica restarting on the same machine warms up in a fraction of the time. Off: the first
    #: prompt of each bucket pays for it, and ``/v1/backends`` says so.
    prefill_warmup: bool = True

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, (None, "float32", "bfloat16", "float16"))
        _choice("load_format", self.load_format, ("auto", "dummy"))
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _choice("speculative_method", self.speculative_method, typing.get_args(SpeculativeMethod))
        _choice("speculative_draft_sampling", self.speculative_draft_sampling, ("coupled", "greedy"))
        if not 0.0 <= self.dspark_confidence_threshold < 1.0:
            raise UnsupportedSettingError(
                f"dspark_confidence_threshold must be in [0, 1), got {self.dspark_confidence_threshold}",
                param="dspark_confidence_threshold")
        _positive("num_speculative_tokens", self.num_speculative_tokens, allow_none=True)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise UnsupportedSettingError(
                f"num_speculative_tokens={self.num_speculative_tokens} exceeds {MAX_SPECULATIVE_TOKENS}",
                param="num_speculative_tokens")
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise UnsupportedSettingError(
                f"prompt_lookup_max={self.prompt_lookup_max} is below prompt_lookup_min={self.prompt_lookup_min}",
                param="prompt_lookup_max")
        if self.tensor_parallel_size != 1:
            raise UnsupportedSettingError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not implemented yet; only 1 is",
                param="tensor_parallel_size")


@dataclass(frozen=True)
class CacheConfig:
    #: Tokens per KV block.
    block_size: int = 16
    #: Exact number of KV blocks; overrides the memory-based sizing.
    num_kv_blocks: int | None = None
    #: Bytes of memory for the KV cache; None: gpu_memory_utilization on CUDA, 1 GiB on CPU.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise UnsupportedSettingError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
                param="gpu_memory_utilization")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    #: Resolved from the model at start-up (ModelConfig.max_model_len or the model's limit).
    max_model_len: int = 2048
    role: Role = "colocated"
    #: Requests that may wait for admission before new ones are refused (bounded queue).
    max_waiting: int = 1024
    #: Decode role: blocks reserved for a remote prefill that was abandoned stay out of use this
    #: long, so a prefill worker still writing into them cannot corrupt another request.
    remote_kv_grace_s: float = 2.0
    #: Pipelined decode on CUDA graphs: step N+1 is scheduled and launched before step N's tokens
    #: are read, so the host's work overlaps the GPU's (see LLMEngine). Outputs are the same.
    async_scheduling: bool = True
    #: Chunked prefill: a request schedules at most this many prompt tokens a step (vLLM's
    #: meaning), so a long prompt shares steps with the running requests' decode tokens; 0: up
    #: to the whole token budget.
    long_prefill_token_threshold: int = 0
    #: A step that carries prompt chunks is kept near this many seconds by sizing the chunks from
    #: the engine's own measured steps (Sarathi-Serve's TBT-sized token budget; see
    #: ``cluster.engine.scheduler.ChunkSizer``); 0: off. The decode role sets it from the ITL
    #: target (``local_prefill_itl_share``), so a prompt prefilled on a decode replica does not
    #: stall its decoding requests.
    prefill_step_target_s: float = 0.0
    #: What the learned chunk cap bounds: the prompt tokens of the whole step (True, the default:
    #: Sarathi-Serve's per-step budget, so k prompts prefilling at once still keep the step near
    #: the target; prompts in arrival order) or each prompt's chunk (False: with k prompts at once
    #: the sizer settles at steps about k times the target, since it learns from the step's total
    #: but caps each prompt).
    sized_chunks_per_step: bool = True
    #: A step slower than this many seconds counts in ``slow_steps_total`` (and sets the gauge
    #: ``slowest_step_seconds``) and logs a warning naming its shape, so a stall in serving (a
    #: kernel tuned or compiled mid-run, a host pause) is seen, not only felt in the tail
    #: latencies; None: 0.5 s on a GPU, off on a CPU (whose long prompt steps take seconds by
    #: nature); 0: off.
    slow_step_s: float | None = None

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("slow_step_s", self.slow_step_s, allow_none=True, allow_zero=True)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_zero=True)
        _positive("prefill_step_target_s", self.prefill_step_target_s, allow_zero=True)
        _positive("max_model_len", self.max_model_len)
        _positive("max_waiting", self.max_waiting)
        _choice("role", self.role, typing.get_args(Role))

    @property
    def prefill_only(self) -> bool:
        """Every request ends at its first token, its blocks held for the transfer (the prefill
        role: a decode worker generates the rest). Such an engine never decodes, so it captures
        no decode graphs, pipelines nothing and forks no sample's blocks. The engine reads this
        flag, never the role's name."""
        return self.role == "prefill"


@dataclass(frozen=True)
class TransferConfig:
    #: "auto": ipc when prefill and decode share a node, else nixl.
    backend: TransferBackendName = "auto"
    #: Seconds a transfer may take before the request fails (or falls back to prefill on decode).
    timeout_s: float = 30.0
    #: On a failed transfer, prefill on the decode worker instead of failing the request.
    fallback_to_local_prefill: bool = True
    #: Prompts shorter than this are prefilled on the decode worker itself; 0 disables that.
    local_prefill_threshold: int = 0
    #: Queue-aware conditional disaggregation (Dynamo prefills on the decode worker when the
    #: prefill queue is long): once every prefill replica in the ingress's cluster view reports
    #: at least this many requests waiting, new prompts are prefilled on their decode worker
    #: instead of joining the queue (a request's TTFT would be the queue's wait; the decode
    #: replica's steps carry the prompt's chunks instead). 0 disables that.
    local_prefill_queue_threshold: int = 16
    #: A decode replica prefilling a prompt itself sizes the prompt's chunks so that its steps
    #: take at most this share of ``target_itl_s`` (its decoding requests' inter-token latency
    #: stays within the target); 0: chunks up to the whole token budget.
    local_prefill_itl_share: float = 0.8

    def __post_init__(self) -> None:
        _choice("kv_transfer", self.backend, typing.get_args(TransferBackendName))
        if self.timeout_s <= 0:
            raise UnsupportedSettingError("kv_transfer_timeout_s must be > 0", param="kv_transfer_timeout_s")
        if self.local_prefill_threshold < 0:
            raise UnsupportedSettingError("local_prefill_threshold must be >= 0",
                                          param="local_prefill_threshold")
        if not 0 <= self.local_prefill_itl_share <= 1:
            raise UnsupportedSettingError("local_prefill_itl_share must lie in [0, 1]",
                                          param="local_prefill_itl_share")
        if self.local_prefill_queue_threshold < 0:
            raise UnsupportedSettingError("local_prefill_queue_threshold must be >= 0",
                                          param="local_prefill_queue_threshold")


@dataclass(frozen=True)
class ClusterConfig:
    """Everything a deployment needs; built from ``key=value`` arguments by ``parse_cluster_args``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    prefill_replicas: int = 1
    decode_replicas: int = 1
    #: GPUs per replica; None: tensor_parallel_size on a CUDA machine, 0 on CPU.
    num_gpus: float | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    #: Seconds a request may take end to end before a 504 (per-request max via its own deadline).
    request_timeout_s: float = 600.0
    #: Largest HTTP body accepted, in bytes.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Requests in flight at the ingress before new ones get 503.
    max_inflight_requests: int = 512
    #: API keys (comma-separated; env ``CLUSTER_API_KEY``): when set, every ``/v1/*`` request
    #: needs ``Authorization: Bearer <one of them>`` (401 otherwise); ``/health`` stays open.
    api_key: str | None = None
    #: Origins allowed by CORS (comma-separated, ``*`` for any); None: no CORS headers.
    cors_allow_origins: str | None = None
    #: Let the planner (cluster.router.planner) change each role's replica count between these
    #: bounds, keeping p90 TTFT and inter-token latency under their targets.
    autoscale: bool = False
    min_replicas: int = 1
    max_replicas: int = 8
    target_ttft_s: float = 1.0
    target_itl_s: float = 0.1
    #: Prefill + decode replicas together never exceed this: the GPU budget in replicas (8 on one
    #: 8-GPU node at one GPU per replica). None: only max_replicas per role.
    max_total_replicas: int | None = None
    #: A role that scaled up waits this long before scaling up again (its new replica starts and
    #: the latency windows catch up).
    upscale_cooldown_s: float = 30.0
    #: After any change, this long passes before a role scales down or gives a replica away.
    downscale_cooldown_s: float = 120.0
    #: Under max_total_replicas, decode holds every GPU of the budget prefill does not (the
    #: planner's rule 9: spare decode replicas absorb bursts and are up when the mix shifts);
    #: False: idle GPUs go back to Ray.
    hold_budget: bool = True

    def __post_init__(self) -> None:
        _positive("prefill_replicas", self.prefill_replicas, allow_zero=True)
        _positive("decode_replicas", self.decode_replicas)
        _positive("max_inflight_requests", self.max_inflight_requests)
        self._check_autoscale()

    def _check_autoscale(self) -> None:
        _positive("min_replicas", self.min_replicas)
        _positive("max_replicas", self.max_replicas)
        _positive("max_total_replicas", self.max_total_replicas, allow_none=True)
        _positive("target_ttft_s", self.target_ttft_s)
        _positive("target_itl_s", self.target_itl_s)
        _positive("upscale_cooldown_s", self.upscale_cooldown_s, allow_zero=True)
        _positive("downscale_cooldown_s", self.downscale_cooldown_s, allow_zero=True)
        if self.max_replicas < self.min_replicas:
            raise UnsupportedSettingError(
                f"max_replicas={self.max_replicas} is below min_replicas={self.min_replicas}",
                param="max_replicas")
        if not self.autoscale:
            return
        roles = {"decode_replicas": self.decode_replicas}
        if self.prefill_replicas > 0 and self.transfer.backend != "local":  # local: prefill inside decode
            roles["prefill_replicas"] = self.prefill_replicas
        for name, count in roles.items():
            if not self.min_replicas <= count <= self.max_replicas:
                raise UnsupportedSettingError(
                    f"with autoscale, {name}={count} must lie in [min_replicas={self.min_replicas}, "
                    f"max_replicas={self.max_replicas}]", param=name)
        total = self.max_total_replicas
        if total is not None and (sum(roles.values()) > total or self.min_replicas * len(roles) > total):
            raise UnsupportedSettingError(
                f"max_total_replicas={total} is below the starting replicas ({sum(roles.values())}) or "
                f"the minimum of every role ({self.min_replicas * len(roles)})", param="max_total_replicas")


# --- parsing ------------------------------------------------------------------------------------

#: Fields set at run time, never by users: the resolved context length and each engine's role.
_DERIVED = {("scheduler", "max_model_len"), ("scheduler", "role")}


def _flat_fields() -> dict[str, tuple[str, str, Any]]:
    """Flat argument name -> (section, field, type). Sections: model, cache, scheduler, transfer,
    or "" (ClusterConfig itself)."""
    out: dict[str, tuple[str, str, Any]] = {}
    for section, cls in (("model", ModelConfig), ("cache", CacheConfig),
                         ("scheduler", SchedulerConfig), ("transfer", TransferConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in _DERIVED:
                continue
            name = f.name
            if section == "transfer":
                name = "kv_transfer" if f.name == "backend" else (
                    f.name if f.name in ("local_prefill_threshold", "local_prefill_queue_threshold",
                                         "local_prefill_itl_share", "fallback_to_local_prefill")
                    else f"kv_transfer_{f.name}")
            assert name not in out, f"setting {name} is defined twice"
            out[name] = (section, f.name, hints[f.name])
    hints = typing.get_type_hints(ClusterConfig)
    for f in dataclasses.fields(ClusterConfig):
        if f.name not in ("model", "cache", "scheduler", "transfer"):
            out[f.name] = ("", f.name, hints[f.name])
    return out


FLAT_FIELDS = _flat_fields()


def parse_cluster_args(args: dict[str, Any] | None = None, *, use_env: bool = True) -> ClusterConfig:
    """Build a ClusterConfig from flat ``key=value`` settings (strings or typed values).

    Environment variables ``CLUSTER_<KEY>`` fill settings not given in ``args``. Unknown keys and
    invalid values raise UnsupportedSettingError naming them.
    """
    settings: dict[str, Any] = {}
    if use_env:
        for key in FLAT_FIELDS:
            env = os.environ.get(f"CLUSTER_{key.upper()}")
            if env is not None:
                settings[key] = env
    settings.update(args or {})
    unknown = sorted(k for k in settings if k not in FLAT_FIELDS)
    if unknown:
        raise UnsupportedSettingError(
            f"unknown setting(s): {', '.join(unknown)}; known settings: {', '.join(sorted(FLAT_FIELDS))}",
            param=unknown[0])
    sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "transfer": {}, "": {}}
    for key, raw in settings.items():
        section, name, hint = FLAT_FIELDS[key]
        sections[section][name] = _coerce(key, raw, hint)
    try:
        return ClusterConfig(
            model=ModelConfig(**sections["model"]),
            cache=CacheConfig(**sections["cache"]),
            scheduler=SchedulerConfig(**sections["scheduler"]),
            transfer=TransferConfig(**sections["transfer"]),
            **sections[""],
        )
    except TypeError as exc:  # a value of the wrong type reached a validator
        raise UnsupportedSettingError(f"invalid settings: {exc}") from exc


def _coerce(key: str, raw: Any, hint: Any) -> Any:
    """Turn a CLI/env string into the field's type; pass typed values through after checking."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    allowed = [a for a in args if a is not type(None)] if args else [hint]
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null") and type(None) in args):
        if type(None) in args:
            return None
        raise UnsupportedSettingError(f"{key} may not be empty", param=key)
    if origin is Literal:
        if raw not in args:
            raise UnsupportedSettingError(f"{key}={raw!r} is not one of {list(args)}", param=key)
        return raw
    target = allowed[0]
    if typing.get_origin(target) is Literal:
        if raw not in typing.get_args(target):
            raise UnsupportedSettingError(
                f"{key}={raw!r} is not one of {list(typing.get_args(target))}", param=key)
        return raw
    try:
        if target is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if target is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(raw)
        if target is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        if target is str:
            if not isinstance(raw, (str, int, float)):
                raise ValueError(raw)
            return str(raw)
    except (TypeError, ValueError):
        raise UnsupportedSettingError(
            f"{key}={raw!r} is not a valid {getattr(target, '__name__', target)}", param=key) from None
    return raw


def resolve_speculative_tokens(config: ModelConfig, device_type: str) -> ModelConfig:
    """``config`` with ``num_speculative_tokens`` set: its own, else the device type's default."""
    if config.num_speculative_tokens is not None:
        return config
    return dataclasses.replace(config, num_speculative_tokens=DEFAULT_SPECULATIVE_TOKENS.get(device_type, 4))


def _positive(name: str, value: int | float | None, *, allow_none: bool = False,
              allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise UnsupportedSettingError(f"{name} must be {bound}, got {value!r}", param=name)


def _choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise UnsupportedSettingError(f"{name}={value!r} is not one of {list(choices)}", param=name)
