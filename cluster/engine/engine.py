"""LLMEngine: one device's engine. No threads, no network: the async and serving layers drive
``step()`` from outside. It is one class assembled from parts, each a file named for its concern:

    engine.py      start-up (load, KV cache plan, decode graphs) and introspection (backends, metrics)
    intake.py      requests in and out: validation, tokenizing, n samples and their forks, abort, deadlines
    step_loop.py   ``step()``: schedule, fill the runner's inputs, run, process tokens, collect deltas
    pipeline.py    pipelined decode: launch step N+1 before reading step N's tokens
    spec_pipeline.py  the same for verify steps: acceptance and the next proposal on the device
    remote_kv.py   requests whose prompt another worker prefills (decode role), quarantined blocks

Requests come in through ``add_request``/``add_group`` and leave as RequestOutput deltas (what
each step added); ``abort_request`` ends them in any state. Role differences are flags of the
SchedulerConfig (``prefill_only``), never role names."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from cluster.common.errors import UnsupportedSettingError
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_speculative_tokens
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.cuda_graphs import GraphStatus
from cluster.engine.draft_runner import DraftHeadRunner
from cluster.engine.model_runner import KVAllocator, ModelRunner, plan_num_blocks
from cluster.engine.intake import Intake
from cluster.engine.output_processor import OutputProcessor, RequestGroup
from cluster.engine.pipeline import InFlightStep, Pipelining
from cluster.engine.remote_kv import RemoteKV
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec_decode import Proposer, SpecDecodeStats, make_proposer
from cluster.engine.spec_pipeline import InFlightVerify, SpecPipelining
from cluster.engine.stalls import StallWatch
from cluster.engine.step_loop import StepLoop
from cluster.common.kv_spec import KVGroupSpec
from cluster.models.cpu_quant import quantize_float_linears
from cluster.models.draft_head import (DEFAULT_DRAFT_HEADS, HeadDrafter, default_draft_head_path, draft_vocab_path,
                                       load_draft_head, load_draft_vocab)
from cluster.models.ops import REFERENCE_OPS
from cluster.models.registry import LoadedModel, load_model
from kernels.compile_watch import Compilation

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
#: The largest decode graph captured for verify steps (rows: 1 + k per speculating request).
MAX_VERIFY_GRAPH_ROWS = 512
CPU_MAX_MODEL_LEN = 8192
#: ``SchedulerConfig.slow_step_s`` where it is not set, on a GPU (a CPU counts no slow steps).
DEFAULT_SLOW_STEP_S = 0.5
#: The KV owner of the start-up prefill warm-up's blocks (freed before any request arrives).
WARMUP_REQUEST_ID = "\x00prefill-warmup"


def warmup_lengths(budget: int) -> list[int]:
    """The prompt lengths the start-up warm-up runs: every power of two below ``budget``, then
    ``budget`` (the prefill kernels tune per power-of-two bucket of the query length)."""
    lengths = [1 << i for i in range(max(0, budget - 1).bit_length())]
    return lengths + [budget] if budget > 0 else []


def announce_graph_status(status: GraphStatus, device: torch.device, decodes: bool) -> None:
    """Log whether decode runs as CUDA graphs: a warning where a GPU decodes without them (the
    fast path fell back, or ``enforce_eager``), info otherwise (captured, a CPU, an engine that
    never decodes)."""
    if status.captured or device.type != "cuda" or not decodes:
        logger.info("decode CUDA graphs %s", status.describe())
    else:
        logger.warning("decode CUDA graphs are OFF (%s): every decode step launches its kernels from the "
                       "host, several times slower", status.reason)


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedSettingError(f"device={name!r} but no CUDA device is available", param="device")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def draft_head_kv_specs(specs: list[KVGroupSpec]) -> list[KVGroupSpec]:
    """The KV groups with the draft head's layer added to the full-attention group (the head's
    KV at a position depends on the same tokens as the model's: same blocks, same keys)."""
    if len(specs) != 1 or specs[0].kind != "full":
        raise UnsupportedSettingError(
            "speculative_method='draft_head' needs a model with one full-attention KV group (the Llama "
            f"family); this one has {', '.join(f'{s.name} ({s.kind})' for s in specs)}", param="speculative_method")
    return [dataclasses.replace(specs[0], num_layers=specs[0].num_layers + 1)]


class LLMEngine(Intake, StepLoop, Pipelining, SpecPipelining, RemoteKV):
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, loaded: LoadedModel | None = None,
                 kv_allocator: KVAllocator | None = None) -> None:
        self.cache_config = cache_config
        self.device = resolve_device(model_config.device)
        model_config = resolve_speculative_tokens(model_config, self.device.type)
        self.model_config = model_config
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        torch.manual_seed(model_config.seed)
        #: Seconds spent starting up, by phase (bench/startup_gpu.py and bench/gpucheck.py report them).
        self.startup_timings: dict[str, float] = {}
        self.stall_watch = StallWatch()
        startup = self.stall_watch.mark()
        start = time.perf_counter()
        self.loaded = loaded or load_model(model_config.model, self.device, self.dtype, {
            "attention_backend": model_config.attention_backend, "moe_backend": model_config.moe_backend,
            "draft_moe_backend": model_config.draft_moe_backend}, load_format=model_config.load_format,
            seed=model_config.seed, keep_quantized=model_config.dtype is None,
            mtp=model_config.speculative_method == "mtp", dspark=model_config.speculative_method == "dspark")
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.startup_timings["load_s"] = time.perf_counter() - start
        for choice in self.model.kernel_choices():
            logger.info("kernel for %s: %s (%s, %s role, %s format): %s", choice["component"], choice["impl"],
                        choice["device"], choice["role"], choice["format"], choice["reason"])
        self.scheduler_config = self._init_scheduler_config(scheduler_config)
        self._init_kv_cache()
        self.scheduler = Scheduler(self.scheduler_config, self.kv, cache_config.block_size)
        self.runner = ModelRunner(self.model, self.kv_specs, self.num_blocks, self.device, model_config.seed,
                                  kv_allocator)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler_config.max_model_len)
        self._init_speculation()
        self._warm_prefill()
        self._init_cuda_graphs()
        #: The Triton compilations and garbage collections of start-up (loading, warm-up, graphs).
        self.startup_stalls = self.stall_watch.since(startup)
        self.groups: dict[str, RequestGroup] = {}
        self._sample_group: dict[str, RequestGroup] = {}
        self._pending: list[RequestOutput] = []
        self._changed: dict[str, RequestGroup] = {}
        #: Blocks of abandoned remote prefills, freed once their grace period ends.
        self._quarantine: list[tuple[float, list[list[int]]]] = []
        #: (request id, tokens computed before, tokens computed) of every request in the last step.
        self.last_step: list[tuple[str, int, int]] = []
        self._in_flight: InFlightStep | None = None
        self._verify_in_flight: InFlightVerify | None = None
        #: Held samples' first tokens (and logprobs), drawn from sample 0's prompt logits here or
        #: by the prefill worker, until they fork (``_settle_held``).
        self._first_tokens: dict[str, tuple[int, PositionLogprobs | None]] = {}
        #: Samples that took another sample's prompt KV instead of computing it (metrics, tests).
        self.num_forked_samples = 0
        self._pipelined = (self.scheduler_config.async_scheduling and self.runner.graphs is not None
                           and not self.scheduler_config.prefill_only and self.proposer is None)
        #: Steps launched pipelined (verify steps among them) / run synchronously (metrics, tests).
        self.num_pipelined_steps = 0
        self.num_pipelined_verify_steps = 0
        self.num_sync_steps = 0
        slow = self.scheduler_config.slow_step_s
        self.slow_step_s = (DEFAULT_SLOW_STEP_S if self.device.type == "cuda" else 0.0) if slow is None else slow
        self.num_slow_steps = 0
        self.slowest_step_s = 0.0
        self._slow_steps_said = 0
        self._slow_step_logged_at = -float("inf")
        self.num_step_compiles = 0
        self.step_compilations: list[Compilation] = []
        self.step_compile_s = 0.0
        self.step_gc_s = 0.0
        self._compiles_logged_at = -float("inf")
        self._init_spec_pipelining()

    # --- start-up --------------------------------------------------------------------------------

    def _warm_prefill(self, force: bool = False) -> None:
        """On a GPU (or ``force``d), run a prompt of each power-of-two length up to the step's
        token budget (and the budget itself) through the model, so no served step waits for a
        prefill kernel's autotuning or compilation (``ModelConfig.prefill_warmup``). Said at
        start-up and in ``/v1/backends``: which lengths, how long, or why not."""
        #: The prompt lengths warmed at start-up (empty when off) and what ``/v1/backends`` says.
        self.prefill_warmup_lengths: list[int] = []
        if not self.model_config.prefill_warmup:
            self.prefill_warmup_status = "off (prefill_warmup=false): the first prompt of each length bucket tunes its kernels"
        elif self.device.type != "cuda" and not force:
            self.prefill_warmup_status = f"not needed on {self.device.type}: no kernel autotunes by prompt length there"
        else:
            budget = min(self.scheduler_config.max_num_batched_tokens, self.scheduler_config.max_model_len)
            lengths = warmup_lengths(budget)
            while lengths and not self.kv.allocate(WARMUP_REQUEST_ID, lengths[-1]):
                lengths.pop()  # a KV cache too small for the budget: warm what fits
            start = time.perf_counter()
            try:
                tables = self.kv.block_tables(WARMUP_REQUEST_ID) if lengths else []
                for n in lengths:
                    self.runner.warm_prefill(n, tables)
            finally:
                self.kv.free(WARMUP_REQUEST_ID)
            seconds = time.perf_counter() - start
            self.startup_timings["prefill_warmup_s"] = seconds
            self.prefill_warmup_lengths = lengths
            if lengths:
                self.prefill_warmup_status = (f"prompts of {lengths[0]}..{lengths[-1]} tokens ({len(lengths)} lengths) "
                                              f"warmed at start-up in {seconds:.1f} s")
            else:
                self.prefill_warmup_status = "skipped: the KV cache holds no prompt of one token"
        logger.info("prefill warm-up: %s", self.prefill_warmup_status)

    def _init_cuda_graphs(self) -> None:
        """Capture decode graphs (not for prefill-only engines, which never decode), and say
        loudly when decode runs without them."""
        if self.model_config.enforce_eager:
            self.runner.graph_status = GraphStatus(reason="enforce_eager is set")
            if self.runner.drafter is not None:
                self.runner.drafter.graph_status = GraphStatus(reason="enforce_eager is set")
        elif self.scheduler_config.prefill_only:
            self.runner.graph_status = GraphStatus(reason="prefill role: no decode steps to capture")
        else:
            start = time.perf_counter()
            rows = self.scheduler_config.max_num_seqs
            if self.proposer is not None:  # a verify step is a decode batch of 1 + k rows per request
                rows = max(rows, min(rows * (1 + self.model_config.num_speculative_tokens), MAX_VERIFY_GRAPH_ROWS))
            self.runner.capture_cuda_graphs(rows, self.scheduler_config.max_model_len,
                                            verify_depth=1 + self.model_config.num_speculative_tokens)
            self.startup_timings["cuda_graphs_s"] = time.perf_counter() - start
            if self.runner.graphs is not None:
                self.startup_timings.update(self.runner.graphs.timings)
            self._capture_draft_graphs()
        announce_graph_status(self.runner.graph_status, self.device, decodes=not self.scheduler_config.prefill_only)

    def _capture_draft_graphs(self, emulate: bool = False) -> None:
        """The draft head's proposal as CUDA graphs, for as many requests as a verify step's graph
        holds; said loudly when a GPU drafts without them."""
        drafter = self.runner.drafter
        if drafter is None:
            return
        k = self.model_config.num_speculative_tokens
        max_batch = max(1, min(self.scheduler_config.max_num_seqs, MAX_VERIFY_GRAPH_ROWS // (1 + k)))
        model_len = self.scheduler_config.max_model_len
        start = time.perf_counter()
        status = drafter.capture_graphs(k, max_batch, self.kv_specs[0].blocks_needed(model_len), model_len,
                                        emulate=emulate)
        self.startup_timings["draft_graphs_s"] = time.perf_counter() - start
        if drafter.graphs is not None:
            self.startup_timings.update(drafter.graphs.timings)
            start = time.perf_counter()
            verify = self.runner.capture_verify_graphs(emulate=emulate)
            self.startup_timings["verify_graphs_s"] = time.perf_counter() - start
            if self.runner.verify_graphs is not None:
                self.startup_timings.update(self.runner.verify_graphs.timings)
            if not verify.captured and self.device.type == "cuda":
                logger.warning("verify-step CUDA graphs are OFF (%s): each pipelined verify step launches about a "
                               "hundred kernels from Python", verify.reason)
            else:
                logger.info("verify-step CUDA graphs %s", verify.describe())
        if status.captured or self.device.type != "cuda":
            logger.info("draft CUDA graphs %s", status.describe())
        else:
            logger.warning("draft CUDA graphs are OFF (%s): every proposal launches its kernels from Python, "
                           "slower than the verify step it feeds", status.reason)

    def _init_spec_pipelining(self) -> None:
        """Verify steps run pipelined (spec_pipeline.py) with the draft head, ``async_scheduling``
        and both its proposal and the verify steps in CUDA graphs; said loudly where a GPU
        speculates without it."""
        #: Why verify steps run synchronously ("" where they are pipelined).
        self.spec_pipeline_status = self._spec_pipeline_blocker() if self.proposer is not None else "no speculation"
        self._spec_pipelined = not self.spec_pipeline_status
        if self.proposer is None:
            return
        if self._spec_pipelined:
            logger.info("speculative decoding: verify steps pipelined (acceptance and the next proposal on the device)")
        elif self.device.type == "cuda":
            logger.warning("speculative decoding: verify steps run synchronously (%s): the GPU waits for the host "
                           "between steps", self.spec_pipeline_status)

    def _spec_pipeline_blocker(self) -> str:
        """Why verify steps cannot run pipelined ("" where they can)."""
        if self.model_config.speculative_method not in ("draft_head", "mtp"):
            if self.model_config.speculative_method == "dspark":
                return "speculative_method='dspark' has no pipelined verify steps yet: each waits for its block's drafts"
            return f"speculative_method={self.model_config.speculative_method!r} proposes on the host"
        if self.kv_specs[0].kind not in ("full", "sliding_window"):
            return f"the model's first KV group ({self.kv_specs[0].name}) is not per-token: the drafter's KV lives there"
        if len(self.kv_specs) > 1 and not self.model_config.pipelined_verify_kv_groups:
            return (f"the model's KV is {len(self.kv_specs)} groups ({', '.join(s.name for s in self.kv_specs)}) and "
                    "pipelined_verify_kv_groups is off")
        if any(s.kind == "state" for s in self.kv_specs) and self.runner.verify_states is None:
            return "the model's state KV groups keep no verified positions' states"
        if not self.scheduler_config.async_scheduling:
            return "async_scheduling is off"
        drafter = self.runner.drafter
        if self.runner.graphs is None:
            return f"decode CUDA graphs {self.runner.graph_status.describe()}"
        if drafter is None or drafter.graphs is None:
            return f"draft-head CUDA graphs {drafter.graph_status.describe() if drafter else 'missing'}"
        return ""

    def _init_speculation(self) -> None:
        """The draft proposer (None: no speculation; prefill-only engines never draft). A model
        with ``state`` KV groups (updated in place: DeepSeek-V4's compressors) keeps its verified
        positions' states in rows of their own until their acceptance (``enable_verify_states``)."""
        self.proposer: Proposer | None = None
        self.spec_stats: SpecDecodeStats | None = None
        method = self.model_config.speculative_method
        if method == "draft_head":  # prefill engines too: they fill the head's KV and hand it over
            self._init_draft_head()
        elif method == "mtp":
            self._init_mtp()
        elif method == "dspark":
            self._init_dspark()
        if method == "none" or self.scheduler_config.prefill_only:
            return
        if any(spec.kind == "state" for spec in self.kv_specs):
            sched = self.scheduler_config
            self.runner.enable_verify_states(min(sched.max_num_batched_tokens,
                                                 sched.max_num_seqs * (1 + self.model_config.num_speculative_tokens)))
        self.proposer = make_proposer(self.model_config)
        self.spec_stats = SpecDecodeStats(self.model_config.num_speculative_tokens)
        logger.info("speculative decoding: %s, %d draft tokens per step, each verified position a decode row",
                    method, self.model_config.num_speculative_tokens)

    def _init_mtp(self) -> None:
        """Draft with the model's MTP layer (its window KV: layers after the model's in its
        ``swa`` group, added by the model built with ``mtp=True``)."""
        from cluster.models.deepseek_v4_mtp import MTPDrafter
        drafter = MTPDrafter(self.model)
        self.runner.drafter = DraftHeadRunner(drafter, self.runner.kv_caches, self.cache_config.block_size,
                                              self.device)
        self.scheduler.cache_limit = self.runner.drafter.written_upto  # as for the draft head
        logger.info("MTP layer drafts (%d parameters, window KV as layer %d of group %s)",
                    sum(p.numel() for p in drafter.module.parameters()), self.kv_specs[0].num_layers - 1,
                    self.kv_specs[0].name)

    def _init_dspark(self) -> None:
        """Draft with the model's DSpark stages (their context entries: layers after the model's
        in its ``swa`` group, written by the target's forward)."""
        from cluster.engine.dspark_runner import DSparkRunner
        runner = DSparkRunner(self.model, self.runner.kv_caches, self.cache_config.block_size, self.device,
                              self.model_config.num_speculative_tokens,
                              self.model_config.dspark_confidence_threshold, self.model_config.dspark_cuda_graphs)
        self.runner.drafter = runner  # type: ignore[assignment]
        spec = runner.drafter.spec
        logger.info("DSpark drafts blocks of %d (%d stages, %d parameters, features of layers %s, entries as layers "
                    "%d.. of group %s, confidence threshold %s)", spec.block_size, spec.num_stages,
                    sum(p.numel() for p in self.model.mtp.parameters()), list(spec.target_layer_ids),
                    runner.drafter.layers[0][1], self.kv_specs[0].name, runner.threshold or "off")

    def _init_draft_head(self) -> None:
        """Load the draft head (its KV: the last layer of the full-attention group, added by
        ``draft_head_kv_specs``) and give the runner its DraftHeadRunner."""
        path = self.model_config.speculative_model or default_draft_head_path(self.model_config.model)
        if path is None:
            raise UnsupportedSettingError(
                f"speculative_method='draft_head' needs speculative_model (a head's weights) for model "
                f"{self.model_config.model!r}: only {', '.join(sorted(DEFAULT_DRAFT_HEADS))} ships one",
                param="speculative_model")
        layers = self.kv_specs[0].num_layers - 1
        head = load_draft_head(path, self.model, layers, self.dtype, self.device, getattr(self.model, "ops", REFERENCE_OPS))
        quantized = 0
        if self.device.type == "cpu" and getattr(self.model, "cpu_decode", None) is not None:
            quantized = quantize_float_linears(head)  # the head's projections as the target's: 4-bit
        vocab_setting = self.model_config.speculative_draft_vocab
        vocab_path = draft_vocab_path(path) if vocab_setting is None else vocab_setting
        vocab_ids = None
        if vocab_setting != "full" and (vocab_setting is not None or os.path.isfile(vocab_path)):
            vocab_ids = load_draft_vocab(vocab_path, int(self.model.vocab_size))
        drafter = HeadDrafter(head, self.model, vocab_ids)
        self.runner.drafter = DraftHeadRunner(drafter, self.runner.kv_caches, self.cache_config.block_size, self.device)
        # a block enters the prefix cache once the head's layer of it is written too
        self.scheduler.cache_limit = self.runner.drafter.written_upto
        vocab = (f"a draft vocabulary of {drafter.vocab_ids.numel()} of {drafter.vocab_size} tokens ({vocab_path})"
                 if drafter.vocab_ids is not None else f"the whole vocabulary ({drafter.vocab_size} tokens)")
        logger.info("draft head %s loaded (%d parameters, KV as layer %d of group %s%s), drafting over %s", path,
                    sum(p.numel() for p in head.parameters()), layers, self.kv_specs[0].name,
                    f", {quantized} projections in the CPU int4 kernel's format" if quantized else "", vocab)
        if vocab_ids is not None and drafter.vocab_ids is None:
            logger.warning("draft vocabulary %s not applied: the model's LM head is 4-bit (no row subset of it); "
                           "drafting over the whole vocabulary", vocab_path)
        if self.device.type == "cpu" and not self.scheduler_config.prefill_only and drafter.vocab_ids is None:
            logger.warning("speculative_method='draft_head' on a CPU over the whole vocabulary: each chained draft "
                           "reads the whole LM head, which on a small model costs more than the accepted tokens save "
                           "(SmolLM2 on 2 cores: 0.67x no speculation, ngram 1.13x; "
                           "bench/results/spec-decode-cpu-2026-12-04.json)")

    def _init_scheduler_config(self, config: SchedulerConfig) -> SchedulerConfig:
        model_len = int(self.model.max_position_embeddings)
        wanted = self.model_config.max_model_len
        if wanted is not None and wanted > model_len:
            raise UnsupportedSettingError(
                f"max_model_len={wanted} exceeds the model's max_position_embeddings={model_len}",
                param="max_model_len")
        if wanted is None:
            wanted = min(model_len, CPU_MAX_MODEL_LEN) if self.device.type == "cpu" else model_len
        return dataclasses.replace(config, max_model_len=wanted)

    def _init_kv_cache(self) -> None:
        cache, sched = self.cache_config, self.scheduler_config
        kv_dtype = str(self.dtype).removeprefix("torch.")
        self.kv_specs = self.model.kv_cache_specs(cache.block_size, kv_dtype)
        if self.model_config.speculative_method == "draft_head":
            self.kv_specs = draft_head_kv_specs(self.kv_specs)
        memory = cache.kv_cache_memory_bytes or self._default_kv_bytes()
        planned = plan_num_blocks(self.kv_specs, memory, sched.max_num_seqs,
                                  sched.max_num_batched_tokens, sched.max_model_len)
        if cache.num_kv_blocks is not None:
            planned = [cache.num_kv_blocks if s.kind in ("full", "compressed") else n
                       for s, n in zip(self.kv_specs, planned)]
        short = [(s, n) for s, n in zip(self.kv_specs, planned) if n < 2]
        if short:  # one block is the null block: a pool needs another to hold anything
            param = "num_kv_blocks" if cache.num_kv_blocks is not None else "kv_cache_memory_bytes"
            groups = ", ".join(f"{s.name} ({s.bytes_per_block} bytes a block)" for s, _ in short)
            raise UnsupportedSettingError(
                f"the KV cache ({memory} bytes, {param}) leaves no block for {groups} once the window "
                f"and state groups of max_num_seqs={sched.max_num_seqs} sequences are set aside; give it "
                f"more memory or lower max_num_seqs / max_num_batched_tokens", param=param)
        self.num_blocks = planned
        self.kv = KVCacheManager(self.kv_specs, planned, cache.block_size, cache.enable_prefix_caching)
        logger.info("KV cache: %s", ", ".join(f"{s.name}: {n} blocks of {s.tokens_per_block} tokens"
                                              for s, n in zip(self.kv_specs, planned)))

    def _default_kv_bytes(self) -> int:
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1.0 - self.cache_config.gpu_memory_utilization) + (2 << 30)
        return max(1 << 26, int(free - reserve))

    # --- introspection -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    def backends(self) -> list[dict[str, str]]:
        """The implementation chosen for each component (logged at start-up, served at
        /v1/backends), and whether decode runs as CUDA graphs (component ``cuda_graphs``: impl
        ``captured`` or ``off``, with the sizes or the reason)."""
        rows = list(self.model.kernel_choices())
        status = self.runner.graph_status
        device = rows[0]["device"] if rows else self.device.type
        rows.append({"component": "cuda_graphs", "op": "decode_step", "impl": "captured" if status.captured else "off",
                     "device": device, "role": "main", "format": "-", "reason": status.describe()})
        rows.append({"component": "prefill_warmup", "op": "prefill_step",
                     "impl": "warmed" if self.prefill_warmup_lengths else "off", "device": device, "role": "main",
                     "format": "-", "reason": self.prefill_warmup_status})
        if self.proposer is not None:
            reason = (f"{self.model_config.num_speculative_tokens} draft tokens per verify step, each verified "
                      "position a decode row (in the decode graphs where they fit)")
            if self._spec_pipelined:
                reason += ("; verify steps pipelined (acceptance and the next proposal on the device), greedy "
                           f"batches as one CUDA graph each: {self.runner.verify_graph_status.describe()}")
                graphs = self.runner.verify_graphs
                if graphs is not None:
                    reason += ("; batches with sampled requests (no top-k, top-p or min-p) too"
                               if graphs.sampled_graphs else "") + (f"; {graphs.sampled_reason}"
                                                                    if graphs.sampled_reason else "")
            else:
                reason += f"; verify steps synchronous ({self.spec_pipeline_status})"
            rows.append({"component": "speculative_decoding", "op": "verify_step", "impl": self.proposer.name,
                         "device": device, "role": "draft", "format": "-", "reason": reason})
        if self.runner.drafter is not None:
            graphs = self.runner.drafter.graph_status
            if self.model_config.speculative_method == "dspark":
                where = (f"each block (its stages, LM and Markov heads) replays a CUDA graph, {graphs.describe()}"
                         if graphs.captured else f"each block's kernels launch from Python (CUDA graphs "
                                                 f"{graphs.describe()})")
            else:
                where = (f"the proposal (its k passes and argmaxes) replays CUDA graphs, {graphs.describe()}"
                         if graphs.captured else f"the head's passes run eagerly (CUDA graphs {graphs.describe()})")
            rows.append({"component": self.model_config.speculative_method, "op": "draft_pass",
                         "impl": "graph" if graphs.captured else "eager",
                         "device": device, "role": "draft", "format": str(self.dtype).removeprefix("torch."),
                         "reason": f"{where}, through the model's attention kernel; {self._draft_sampling()}"})
        return rows

    def _draft_sampling(self) -> str:
        """How the draft head drafts for greedy and sampled requests (``/v1/backends``)."""
        if self.model_config.speculative_method == "dspark":
            return "every request's drafts are the block's argmax over the Markov-corrected logits"
        if self.model_config.speculative_draft_sampling == "greedy":
            return "drafts are the head's argmax (speculative_draft_sampling='greedy')"
        out = ("greedy requests draft the head's argmax, sampled ones draw from the head's distribution with the "
               "target's draw noise (coupled)")
        graphs = self.runner.drafter.graphs if self.runner.drafter is not None else None
        if graphs is not None and not graphs.draws:
            out += f"; {graphs.draws_reason}"
        if self._spec_pipelined:
            out += ("; a pipelined verify step draws the next step's noise (unseeded; seeded requests' is handed "
                    "over for the positions the step may start from) and the head's next drafts with it on the device")
        return out

    def metrics(self) -> dict[str, float]:
        out = {
            "num_requests_running": float(len(self.scheduler.running)),
            "num_requests_waiting": float(len(self.scheduler.waiting) + len(self.scheduler.receiving)),
            "kv_cache_usage_perc": self.kv.usage,
            "num_free_blocks": float(min(self.kv.num_free_blocks())),
            "prefix_cache_hit_rate": self.scheduler.prefix_cache_hit_rate,
            "cuda_graphs_captured": float(self.runner.graph_status.captured),
            "slowest_step_seconds": self.slowest_step_s,
        }
        sizer = self.scheduler.chunk_sizer
        if sizer is not None:  # the prompt chunk cap the sizer learned (prefill_step_target_s)
            out["prefill_chunk_cap"] = float(sizer.cap)
        if self.runner.drafter is not None:
            out["draft_head_graphs_captured"] = float(self.runner.drafter.graph_status.captured)
        if self.proposer is not None:
            out["spec_decode_pipelined"] = float(self._spec_pipelined)
            out["spec_verify_graphs_captured"] = float(self.runner.verify_graph_status.captured)
            graphs = self.runner.verify_graphs
            out["spec_verify_sampled_graphs_captured"] = float(graphs is not None and bool(graphs.sampled_graphs))
        return out

    def counters(self) -> dict[str, float]:
        """Totals since start-up (Prometheus counters: each key ends in ``_total``)."""
        out = {"num_preemptions_total": float(self.scheduler.num_preemptions),
               "forked_samples_total": float(self.num_forked_samples),
               "graph_steps_total": float(self.runner.num_graph_steps),
               "eager_steps_total": float(self.runner.num_eager_steps),
               "slow_steps_total": float(self.num_slow_steps),
               "step_kernel_compiles_total": float(self.num_step_compiles),
               "step_kernel_compile_seconds_total": self.step_compile_s,
               "step_gc_seconds_total": self.step_gc_s}
        if self.spec_stats is not None:
            out.update(self.spec_stats.counters())
            out["spec_decode_pipelined_steps_total"] = float(self.num_pipelined_verify_steps)
            out["spec_decode_verify_graph_steps_total"] = float(self.runner.num_verify_graph_steps)
            out["spec_decode_sampled_verify_graph_steps_total"] = float(self.runner.num_sampled_verify_graph_steps)
        if self.runner.drafter is not None:
            out.update(self.runner.drafter.counters())
        return out
