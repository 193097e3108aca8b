"""LLMEngine: one device's engine. ``step()`` is three calls: schedule, run the model, process
the outputs. Requests come in through ``add_request`` (validated, tokenized, split into n samples)
and leave as RequestOutput deltas (what each step added); ``abort_request`` ends them in any state. No threads, no network:
the async and serving layers drive ``step()`` from outside.

Pipelined decode (``async_scheduling``, CUDA graphs): while every running request decodes one
token with device-side sampling (no penalties, no logprobs) and nothing waits for admission,
``step()`` schedules and launches step N+1 (its input tokens taken on the device from step N's
samples) before it reads step N's tokens and runs their stop checks, detokenization and outputs;
the GPU never waits for the host. A request that stops at step N has step N+1 computed for
nothing (its blocks are freed; stream order keeps later writes after it). Any other step first
completes the one in flight, then runs synchronously. Tokens are identical either way."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.common.errors import ClusterError, ErrorKind, InvalidRequestError, UnsupportedSettingError, kind_of
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.common.sampling_params import SamplingParams
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.cuda_graphs import GraphStatus
from cluster.engine.model_runner import KVAllocator, ModelRunner, RunnerOutput, plan_num_blocks
from cluster.engine.output_processor import OutputProcessor, RequestGroup
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from cluster.models.registry import LoadedModel, load_model

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_MAX_MODEL_LEN = 8192


@dataclass
class InFlightStep:
    """A launched pipelined step whose sampled tokens are not yet read."""

    scheduled: list[ScheduledRequest]
    tokens: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # [B] int64 pinned, filled by an asynchronous copy
    done: torch.cuda.Event | None  # None on CPU (nothing runs asynchronously)
    rows: dict[str, int]  # request id -> row in tokens


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


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, loaded: LoadedModel | None = None,
                 kv_allocator: KVAllocator | None = None) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        torch.manual_seed(model_config.seed)
        #: Seconds spent starting up, by phase (bench/startup_gpu.py and bench/gpucheck.py report them).
        self.startup_timings: dict[str, float] = {}
        start = time.perf_counter()
        self.loaded = loaded or load_model(model_config.model, self.device, self.dtype, {
            "attention_backend": model_config.attention_backend, "moe_backend": model_config.moe_backend,
            "draft_moe_backend": model_config.draft_moe_backend}, load_format=model_config.load_format,
            seed=model_config.seed, keep_quantized=model_config.dtype is None)
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
        self._init_cuda_graphs()
        self.groups: dict[str, RequestGroup] = {}
        self._sample_group: dict[str, RequestGroup] = {}
        self._pending: list[RequestOutput] = []
        self._changed: dict[str, RequestGroup] = {}
        #: Blocks of abandoned remote prefills, freed once their grace period ends.
        self._quarantine: list[tuple[float, list[list[int]]]] = []
        #: (request id, tokens computed before, tokens computed) of every request in the last step.
        self.last_step: list[tuple[str, int, int]] = []
        self._in_flight: InFlightStep | None = None
        #: Held samples' first tokens (and logprobs), drawn from sample 0's prompt logits here or
        #: by the prefill worker, until they fork (``_settle_held``).
        self._first_tokens: dict[str, tuple[int, PositionLogprobs | None]] = {}
        #: Samples that took another sample's prompt KV instead of computing it (metrics, tests).
        self.num_forked_samples = 0
        self._pipelined = (self.scheduler_config.async_scheduling and self.runner.graphs is not None
                           and not self.scheduler_config.prefill_only)
        #: Steps launched pipelined / run synchronously (metrics, tests).
        self.num_pipelined_steps = 0
        self.num_sync_steps = 0

    # --- start-up --------------------------------------------------------------------------------

    def _init_cuda_graphs(self) -> None:
        """Capture decode graphs (not for prefill-only engines, which never decode), and say
        loudly when decode runs without them."""
        if self.model_config.enforce_eager:
            self.runner.graph_status = GraphStatus(reason="enforce_eager is set")
        elif self.scheduler_config.prefill_only:
            self.runner.graph_status = GraphStatus(reason="prefill role: no decode steps to capture")
        else:
            start = time.perf_counter()
            self.runner.capture_cuda_graphs(self.scheduler_config.max_num_seqs, self.scheduler_config.max_model_len)
            self.startup_timings["cuda_graphs_s"] = time.perf_counter() - start
            if self.runner.graphs is not None:
                self.startup_timings.update(self.runner.graphs.timings)
        announce_graph_status(self.runner.graph_status, self.device, decodes=not self.scheduler_config.prefill_only)

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

    # --- requests ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text, token ids)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; give token ids", param="prompt")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            ids = list(prompt)
            text = None
            if not ids:
                raise InvalidRequestError("prompt is empty", param="prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt tokenizes to nothing", param="prompt")
        return text, ids

    def make_group(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                   arrival_time: float | None = None, sample_index: int = 0) -> RequestGroup:
        """Validate and build a request without adding it (raises InvalidRequestError)."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
        text, ids = self.tokenize(prompt)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        now = arrival_time if arrival_time is not None else time.monotonic()
        samples = [Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, eos,
                           sample_index=sample_index + i, arrival_time=now) for i in range(params.n)]
        self.scheduler.check_fits(samples[0])
        group = RequestGroup(request_id, text, ids, samples)
        group.texts = [self.output_processor.make_text(s) for s in samples]
        return group

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None) -> RequestGroup:
        group = self.make_group(request_id, prompt, params, arrival_time)
        self.add_group(group)
        return group

    def add_group(self, group: RequestGroup) -> None:
        """Queue a request. Its samples 1..n-1 wait for sample 0 to compute the prompt
        (``RequestGroup.held``); the step that samples sample 0's first token draws theirs from the
        same logits (each with its own seed), and they fork its KV: full blocks shared, the last
        partial block copied. One prefill for n samples, nothing computed again."""
        self.scheduler.add_request(group.samples[0])
        self._register(group, hold=True)

    def _register(self, group: RequestGroup, hold: bool) -> None:
        for s in group.samples:
            self._sample_group[s.request_id] = group
        group.held = group.samples[1:] if hold else []
        self.groups[group.request_id] = group

    def _settle_held(self, group: RequestGroup) -> None:
        """Sample 0 changed: once it has its first token (the prompt is computed) the held samples
        fork its KV with the first tokens drawn for them (``_first_tokens``); if it ended without
        one, they end as it did. A sample that cannot fork now (no sequence slot or block free, or
        no token drawn for it) joins the queue and computes what the prefix cache lacks."""
        first = group.samples[0]
        if first.num_output_tokens == 0 and not first.status.finished:
            return
        held, group.held = group.held, []
        for s in held:
            drawn = self._first_tokens.pop(s.request_id, None)
            if s.status.finished:
                continue
            if first.num_output_tokens == 0:
                self.scheduler.finish(s, first.status, error=first.error, kind=first.error_kind)
                continue
            if drawn is not None and self._fork(first, s, *drawn):
                continue
            try:
                self.scheduler.add_request(s)
            except ClusterError as exc:  # the waiting queue is full: this sample fails, visibly
                self.scheduler.finish(s, RequestStatus.FINISHED_ERROR, error=exc.message, kind=kind_of(exc))

    def _fork(self, first: Request, sample: Request, token: int, logprobs: PositionLogprobs | None) -> bool:
        """``sample`` takes ``first``'s prompt KV and its own first token. A prefill role forks no
        blocks: the sample ends at its first token, and the decode worker forks there."""
        if not self.scheduler_config.prefill_only:
            copies = self.scheduler.fork(first, sample)
            if copies is None:
                return False
            self.runner.copy_blocks(copies)
            self.num_forked_samples += 1
        self._take_token(sample, token, logprobs)
        return True

    def _forks(self, sched: SchedulerOutput) -> dict[str, list[Request]]:
        """Held samples whose first token this step draws: those of each sample 0 that samples
        its first token now."""
        forks: dict[str, list[Request]] = {}
        for s in sched.scheduled:
            r = s.request
            if r.num_output_tokens == 0 and s.samples:
                group = self._sample_group.get(r.request_id)
                if group is not None and group.held and r is group.samples[0]:
                    forks[r.request_id] = [c for c in group.held if not c.status.finished]
        return forks

    def abort_request(self, request_id: str, *, error: str | None = None,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED, kind: ErrorKind | None = None) -> None:
        group = self.groups.get(request_id)
        if group is None:
            return
        for s in group.samples:
            if s.request_id in self.scheduler.receiving:
                self._quarantine_blocks(s.request_id)
            self.scheduler.finish(s, status, error=error, kind=kind)
        self._finish_group_if_done(group, emit=True)

    def _quarantine_blocks(self, request_id: str) -> None:
        """A remote prefill may still be writing into these blocks: keep them unused for a while."""
        tables = self.kv.detach(request_id)
        self._quarantine.append((time.monotonic() + self.scheduler_config.remote_kv_grace_s, tables))

    def _release_quarantine(self) -> None:
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            self.kv.free_blocks(self._quarantine.pop(0)[1])

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def has_work(self) -> bool:
        """Anything to step for: unfinished requests, outputs not yet returned, quarantined blocks,
        a pipelined step in flight."""
        return (bool(self.groups) or bool(self._pending) or bool(self._quarantine)
                or self._in_flight is not None)

    # --- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._release_quarantine()
        self._expire_deadlines()
        if self._pipelined and self._pipeline_ready():
            sched = self.scheduler.schedule()  # nothing waits here, so none fails admission
            if self.runner.can_launch(sched):
                self._launch(sched)
                return self._collect()
            self._complete_in_flight()  # not expected (the checks above hold), but always safe
            sched.scheduled = [s for s in sched.scheduled if s.request.status is RequestStatus.RUNNING]
        else:
            self._complete_in_flight()
            sched = self.scheduler.schedule()
        self._begin(sched)
        for request in sched.failed:
            self._mark_changed(request)
        if not sched.is_empty:
            self.num_sync_steps += 1
            sched.forks = forks = self._forks(sched)
            try:
                result = self.runner.execute(sched)
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the loop
                logger.exception("model step failed")
                self._fail(sched.scheduled, exc)
            else:
                for children in forks.values():
                    for c in children:
                        self._first_tokens[c.request_id] = (result.sampled[c.request_id],
                                                            result.logprobs.get(c.request_id))
                self._process(sched.scheduled, result)
        return self._collect()

    def _begin(self, sched: SchedulerOutput) -> None:
        """Record the step in ``last_step``."""
        self.last_step = [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled]

    def _fail(self, scheduled: list[ScheduledRequest], exc: Exception) -> None:
        for s in scheduled:
            self.scheduler.finish(s.request, RequestStatus.FINISHED_ERROR, error=f"model step failed: {exc}")
            self._mark_changed(s.request)

    def _pipeline_ready(self) -> bool:
        """The next step can be launched before the one in flight is read: every running request
        decodes exactly one token (counting the one in flight), samples on the device, fits the
        graphs, and the pool has a block for each (so nothing is preempted); nothing waits."""
        sch = self.scheduler
        graphs = self.runner.graphs
        if sch.waiting or not sch.running or (graphs is not None and len(sch.running) > graphs.max_batch):
            return False
        if min(self.kv.num_free_blocks()) < len(sch.running):
            return False
        for r in sch.running:
            if r.num_tokens + r.num_pending - r.num_computed_tokens != 1:
                return False
            if r.num_output_tokens + r.num_pending == 0:  # a first token: its held samples fork
                group = self._sample_group.get(r.request_id)
                if group is not None and group.held:
                    return False
            p = r.sampling_params
            if p.logprobs is not None or p.has_penalties:
                return False
        return True

    def _launch(self, sched: SchedulerOutput) -> None:
        """Launch a pipelined step, then read the previous one (the GPU runs this one meanwhile)."""
        previous = self._in_flight
        self._begin(sched)
        try:
            tokens = self.runner.launch(sched, previous.rows if previous else {},
                                        previous.tokens if previous else None)
            host, done = tokens, None
            if tokens.is_cuda:
                host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                host.copy_(tokens, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        except Exception as exc:  # noqa: BLE001 - as in step(): fail the batch, keep the loop
            logger.exception("model step failed")
            self._complete_in_flight()
            self._fail([s for s in sched.scheduled if s.request.status is RequestStatus.RUNNING], exc)
            return
        self.num_pipelined_steps += 1
        for s in sched.scheduled:
            self.scheduler.mark_computed(s)
            s.request.num_pending += 1
        self._in_flight = InFlightStep(sched.scheduled, tokens, host, done,
                                       {s.request.request_id: i for i, s in enumerate(sched.scheduled)})
        if previous is not None:
            self._complete(previous)

    def _complete_in_flight(self) -> None:
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._complete(step)

    def _complete(self, step: InFlightStep) -> None:
        """Read a pipelined step's tokens (waiting for it) and process them as a step would."""
        if step.done is not None:
            step.done.synchronize()
        for s, token in zip(step.scheduled, step.host.tolist()):
            request = s.request
            request.num_pending = max(0, request.num_pending - 1)
            if request.status is not RequestStatus.RUNNING:
                continue  # finished, aborted or preempted meanwhile: this token is dropped
            self._take_token(request, token, None)
        if self._in_flight is not None:  # the running step's blocks include the new full ones
            for s in self._in_flight.scheduled:
                request = s.request
                if request.status is RequestStatus.RUNNING:
                    self.kv.cache_full_blocks(request.request_id, request.block_hashes, request.num_computed_tokens)

    def _collect(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        changed, self._changed = self._changed, {}
        for group in changed.values():
            if group.request_id in self.groups:
                outputs.append(group.delta())
                self._finish_group_if_done(group, emit=False)
        return outputs

    def _mark_changed(self, request: Request) -> None:
        group = self._sample_group.get(request.request_id)
        if group is not None:
            self._changed[group.request_id] = group
            if group.held and request is group.samples[0]:
                self._settle_held(group)

    def _process(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        for s in scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            self.scheduler.mark_computed(s)
            token = result.sampled.get(request.request_id)
            if token is not None:
                self._take_token(request, token, result.logprobs.get(request.request_id))

    def _take_token(self, request: Request, token: int, logprobs: PositionLogprobs | None) -> None:
        """Append a sampled token to ``request``, then its stop checks and output bookkeeping."""
        request.append_output(token, logprobs, self.cache_config.block_size)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        group = self._sample_group[request.request_id]
        status = self.output_processor.on_token(request, group.texts[group.samples.index(request)])
        if status is None and self.scheduler_config.prefill_only:
            status = RequestStatus.FINISHED_LENGTH  # the decode worker generates the rest
        if group.held and request is group.samples[0]:
            self._settle_held(group)  # its other samples fork the prompt's KV before it can be freed
        if status is not None:
            self.scheduler.finish(request, status)
        self._mark_changed(request)

    # --- decode role: prompts prefilled elsewhere -----------------------------------------------------

    def reserve_remote(self, group: RequestGroup) -> bool:
        """Reserve KV blocks for sample 0 of a request whose prompt another worker prefills; the
        other samples wait for that KV as in ``add_group`` (without prefix caching they then
        compute the prompt here). False: no room now (nothing reserved)."""
        if group.request_id in self.groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use", param="request_id")
        if not self.scheduler.reserve_for_remote_kv(group.samples[0]):
            return False
        self._register(group, hold=True)
        return True

    def finish_remote_prefill(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                              others: Sequence[tuple[int, PositionLogprobs | None]] = ()) -> bool:
        """The prompt's KV is in the reserved blocks and the prefill worker sampled ``first_token``
        (and ``others``: the first tokens of samples 1..n-1, drawn from the same logits): the
        request joins the running batch and its other samples fork its KV. False if the request
        is gone (aborted, expired)."""
        request = self.scheduler.remote_kv_arrived(request_id)
        if request is None:
            return False
        group = self._sample_group[request_id]
        for sample, drawn in zip(group.samples[1:], others):
            self._first_tokens[sample.request_id] = drawn
        self._take_token(request, first_token, logprobs)
        group = self._changed.pop(self._sample_group[request_id].request_id, None)
        if group is not None:  # deliver the first token now, not after the next step
            self._pending.append(group.delta())
            self._finish_group_if_done(group, emit=False)
        return True

    def take_pending(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts, remotely prefilled first tokens)."""
        pending, self._pending = self._pending, []
        return pending

    def fail_remote_prefill(self, request_id: str, reason: str, fallback: bool) -> None:
        """The remote prefill or its transfer failed: prefill here instead (``fallback``) or fail."""
        request = self.scheduler.receiving.get(request_id)
        if request is None:
            return
        if not fallback:
            self._quarantine_blocks(request_id)
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, error=reason, kind=ErrorKind.KV_TRANSFER)
            self._mark_changed(request)
            self._finish_group_if_done(self._sample_group[request_id], emit=True)
            return
        del self.scheduler.receiving[request_id]
        self._quarantine_blocks(request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_cached_tokens = -1
        self.scheduler.add_request(request)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for group in list(self.groups.values()):
            deadline = group.samples[0].deadline
            if deadline is not None and now > deadline:
                self.abort_request(group.request_id, error="deadline exceeded", kind=ErrorKind.DEADLINE)

    def _finish_group_if_done(self, group: RequestGroup, emit: bool) -> None:
        if not group.finished or group.request_id not in self.groups:
            return
        del self.groups[group.request_id]
        for s in group.samples:
            self._sample_group.pop(s.request_id, None)
        if emit:
            self._pending.append(group.delta())

    # --- introspection -----------------------------------------------------------------------------------

    def backends(self) -> list[dict[str, str]]:
        """The implementation chosen for each component (logged at start-up, served at
        /v1/backends), and whether decode runs as CUDA graphs (component ``cuda_graphs``: impl
        ``captured`` or ``off``, with the sizes or the reason)."""
        rows = list(self.model.kernel_choices())
        status = self.runner.graph_status
        device = rows[0]["device"] if rows else self.device.type
        rows.append({"component": "cuda_graphs", "op": "decode_step", "impl": "captured" if status.captured else "off",
                     "device": device, "role": "main", "format": "-", "reason": status.describe()})
        return rows

    def metrics(self) -> dict[str, float]:
        return {
            "num_requests_running": float(len(self.scheduler.running)),
            "num_requests_waiting": float(len(self.scheduler.waiting) + len(self.scheduler.receiving)),
            "kv_cache_usage_perc": self.kv.usage,
            "num_free_blocks": float(min(self.kv.num_free_blocks())),
            "prefix_cache_hit_rate": self.scheduler.prefix_cache_hit_rate,
            "cuda_graphs_captured": float(self.runner.graph_status.captured),
        }

    def counters(self) -> dict[str, float]:
        """Totals since start-up (Prometheus counters: each key ends in ``_total``)."""
        return {"num_preemptions_total": float(self.scheduler.num_preemptions),
                "forked_samples_total": float(self.num_forked_samples)}
