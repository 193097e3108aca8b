"""Scheduler: token budget, chunked prefill, running first, max_num_seqs, preemption by recompute,
and the decode role's reserve-then-receive path."""
from __future__ import annotations

from cluster.common.kv_spec import KVGroupSpec
from cluster.common.sampling_params import SamplingParams
from cluster.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks: int = 64, budget: int = 16, max_num_seqs: int = 8) -> Scheduler:
    spec = KVGroupSpec("attn", "full", 1, (2, BS, 1, 4), "float32", BS)
    kv = KVCacheManager([spec], [num_blocks], BS, enable_caching=True)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256)
    return Scheduler(config, kv, BS)


def req(rid: str, n: int, first: int = 10) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=100))


def run_step(s: Scheduler, sampled_token: int = 7):
    """Schedule and pretend the model ran: mark computed, append a token where one is sampled."""
    out = s.schedule()
    for item in out.scheduled:
        s.mark_computed(item)
        if item.samples:
            item.request.append_output(sampled_token, None, BS)
    return out


def test_chunked_prefill_under_token_budget():
    s = make_scheduler(budget=8)
    r = req("a", 20)
    s.add_request(r)
    sizes = [run_step(s).scheduled[0].num_new_tokens for _ in range(3)]
    assert sizes == [8, 8, 4]
    assert r.num_output_tokens == 1  # sampled only once the prompt was complete


def test_running_requests_first_then_waiting_fill_the_budget():
    s = make_scheduler(budget=10)
    a, b = req("a", 4), req("b", 30, first=50)
    s.add_request(a)
    run_step(s)
    s.add_request(b)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, first=10 * i + 10))
    out = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_frees_the_latest_request_and_recomputes_it():
    s = make_scheduler(num_blocks=7, budget=64)  # 6 usable blocks = 24 tokens
    a, b = req("a", 11), req("b", 11, first=40)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled: 3 blocks each, all 6 used
    for _ in range(2):
        run_step(s)  # a grows into a 4th block -> b is preempted
    assert b.status is RequestStatus.PREEMPTED
    assert s.num_preemptions >= 1
    assert b.num_computed_tokens == 0 and s.waiting[0] is b
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    out = run_step(s)
    assert out.scheduled[0].request is b
    # b recomputes prompt + its generated token; the prefix cache returns its full blocks
    assert out.scheduled[0].num_computed_tokens == 8
    assert s.kv.usage > 0
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert s.kv.usage == 0.0


def test_decode_role_reserve_then_receive():
    s = make_scheduler(num_blocks=16)
    r = req("d", 10)
    assert s.reserve_for_remote_kv(r)
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert run_step(s).is_empty  # nothing to compute until the KV arrives
    r.append_output(5, None, BS)  # the first token, sampled by the prefill worker
    s.remote_kv_arrived("d")
    out = run_step(s)
    assert out.scheduled[0].num_computed_tokens == 10 and out.scheduled[0].num_new_tokens == 1


def test_abort_in_any_state_frees_blocks():
    s = make_scheduler()
    a, b, c = req("a", 8), req("b", 8, first=30), req("c", 8, first=60)
    s.add_request(a)
    run_step(s)
    s.add_request(b)
    assert s.reserve_for_remote_kv(c)
    for r in (a, b, c):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert s.kv.usage == 0.0 and not s.has_work() and not s.receiving
