"""Speculative decoding (n-gram, and the draft head) through the real Ray Serve application with
the openai client: disaggregated (one prefill, one decode replica) and colocated, completions
with prompt lists and ``n > 1``, streamed and not, greedy and seeded, equal token for token to
offline generation without speculation; drafts are proposed and accepted on the decode replica
only (the metrics say so, with their role labels); with the draft head every decode request
starts from the state the prefill replica handed over (none cold); streams cut mid-way leave
every KV block free."""
from __future__ import annotations

import asyncio
import random

import openai
import pytest

from cluster import LLM, SamplingParams
from tests.e2e.conftest import httpx
from tests.e2e.test_disaggregation import model_name
from tests.e2e.test_robustness import one_stream

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24
SEEDED = dict(temperature=0.8, top_p=0.95, seed=41)


def looping_prompts() -> list[list[int]]:
    rng = random.Random(8)
    loop = [rng.randrange(10, 300) for _ in range(5)]
    return [loop * 6, [rng.randrange(10, 300) for _ in range(20)] + loop * 3, loop * 2 + [9, 10]]


PROMPTS = looping_prompts()


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, block_size=16)

    def run(n, **sampling):
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    return run


def _ids(choice) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]


async def _completions(cluster, model, n, stream, **sampling):
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    try:
        if not stream:
            resp = await client.completions.create(model=model, prompt=PROMPTS, n=n, max_tokens=MAX_TOKENS,
                                                   logprobs=0, extra_body=extra, **sampling)
            flat = [_ids(c) for c in sorted(resp.choices, key=lambda c: c.index)]
        else:
            got: dict[int, list[int]] = {}
            async for chunk in await client.completions.create(model=model, prompt=PROMPTS, n=n,
                                                               max_tokens=MAX_TOKENS, logprobs=0, stream=True,
                                                               extra_body=extra, **sampling):
                for c in chunk.choices:
                    got.setdefault(c.index, []).extend(_ids(c) if c.logprobs else [])
            flat = [got[i] for i in range(len(PROMPTS) * n)]
        return [flat[p * n:(p + 1) * n] for p in range(len(PROMPTS))]
    finally:
        await client.close()


@pytest.fixture(scope="module")
def head_file(model_dir, tmp_path_factory):
    """A draft head trained on the served model's own greedy continuations (tests/engine)."""
    from tests.engine.test_draft_head import save_head, train_head
    llm = LLM(model_dir, block_size=16)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    head = train_head(llm, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], steps=100)
    return save_head(head, str(tmp_path_factory.mktemp("head") / "head.safetensors"))


@pytest.mark.parametrize("layout,method", [("disaggregated", "ngram"), ("colocated", "ngram"),
                                           ("disaggregated", "draft_head")])
def test_speculative_serving_equals_offline_without_speculation(cluster, model_dir, offline, layout, method,
                                                                request):
    settings = {"model": model_dir, "kv_transfer": "ipc", "speculative_method": method,
                "num_speculative_tokens": 4 if method == "ngram" else 3, "remote_kv_grace_s": 0.5}
    if method == "draft_head":
        settings["speculative_model"] = request.getfixturevalue("head_file")
    if layout == "colocated":
        settings["prefill_replicas"] = 0
    cluster.deploy(settings)
    model = model_name(model_dir)
    before = cluster.metric_by_replica("cluster:spec_decode_num_accepted_tokens_total", role="decode")
    for stream in (False, True):
        assert asyncio.run(_completions(cluster, model, 2, stream, temperature=0.0)) == offline(2, temperature=0.0)
        assert asyncio.run(_completions(cluster, model, 3, stream, **SEEDED)) == offline(3, **SEEDED)
    grown = cluster.wait_for_increase("cluster:spec_decode_num_accepted_tokens_total", before, 20, role="decode")
    assert grown > 20  # the loops are found and their drafts accepted
    accepted = cluster.metric_by_replica("cluster:spec_decode_num_accepted_tokens_total", role="decode")
    drafts = cluster.metric_by_replica("cluster:spec_decode_num_draft_tokens_total", role="decode")
    assert all(drafts.get(replica, 0.0) >= value for replica, value in accepted.items()), (drafts, accepted)
    if layout == "disaggregated":  # prefill replicas never draft
        assert cluster.metric("cluster:spec_decode_num_draft_tokens_total", role="prefill") == []
    # the decode replica says speculation is on
    rows = httpx.get(f"{cluster.base_url}/v1/backends", timeout=10).json()
    text = str(rows)
    assert "speculative_decoding" in text and method in text
    if method == "draft_head":  # every decode request drafted from the prefill replica's hand-over
        handed = cluster.metric("cluster:draft_head_states_handed_over_total", role="decode")
        assert handed and sum(handed) >= len(PROMPTS) * 4, handed  # one prefill per request, whatever n
        assert sum(cluster.metric("cluster:draft_head_cold_starts_total", role="decode")) == 0
        assert cluster.metric("cluster:spec_decode_num_draft_tokens_total", role="prefill") == []

    # streams cut before and after their first chunk, mid-speculation: nothing leaks
    url = f"{cluster.base_url}/v1/completions"

    async def cut() -> list[str]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(
                one_stream(client, url, {"model": model, "prompt": PROMPTS[i % 3], "max_tokens": 60,
                                         "temperature": 0.0, "ignore_eos": True, "stream": True, "n": 2},
                           ["after-first", "complete", "before-first"][i % 3]) for i in range(12)))
    results = asyncio.run(cut())
    assert results.count("disconnected") == 8 and results.count("done-200") == 4
    # every block back on the roles this layout runs (colocated has no prefill replica, whose
    # last report may linger or be gone)
    roles = ("prefill", "decode") if layout == "disaggregated" else ("decode",)
    for role in roles:
        usage = cluster.wait_for_metric("cluster:kv_cache_usage_perc", lambda v: bool(v) and max(v) == 0.0,
                                        timeout=30.0, role=role)
        assert usage and max(usage) == 0.0, (role, usage)
    running = cluster.wait_for_metric("cluster:num_requests_running", lambda v: bool(v) and not any(v), timeout=30.0,
                                      role="decode")
    assert running and not any(running)


@pytest.fixture(scope="module")
def v4_mtp_dir(tmp_path_factory):
    """A small random DeepSeek-V4 (CSA and HCA layers) with an MTP layer."""
    from tests.deepseek_factories import make_v4_checkpoint
    from tests.factories import save_tokenizer
    from tests.models.test_deepseek_v4_mtp import add_mtp
    path = str(tmp_path_factory.mktemp("e2e-v4-mtp"))
    hf = make_v4_checkpoint(path, "csa_hca")
    add_mtp(path, hf.config.to_dict())
    save_tokenizer(path, vocab_size=256)  # the HTTP API needs one; prompts are token ids below 256
    return path


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_deepseek_v4_mtp_serving_equals_offline_without_speculation(cluster, v4_mtp_dir, layout):
    """DeepSeek-V4 drafting with its MTP layer (its compressors' state rolled back past rejected
    drafts): completions with prompt lists, n = 2 greedy and n = 3 seeded, streamed and not, equal
    to offline generation without speculation; disaggregated, every decode request drafts from the
    prefill replica's hand-over (the layer's window KV and the target's last streams)."""
    llm = LLM(v4_mtp_dir, block_size=16)

    def offline(n, **sampling):
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    settings = {"model": v4_mtp_dir, "kv_transfer": "ipc", "speculative_method": "mtp", "num_speculative_tokens": 2,
                "remote_kv_grace_s": 0.5}
    if layout == "colocated":
        settings["prefill_replicas"] = 0
    cluster.deploy(settings)
    model = model_name(v4_mtp_dir)
    before = cluster.metric_by_replica("cluster:spec_decode_num_drafts_total", role="decode")
    for stream in (False, True):
        assert asyncio.run(_completions(cluster, model, 2, stream, temperature=0.0)) == offline(2, temperature=0.0)
        assert asyncio.run(_completions(cluster, model, 3, stream, **SEEDED)) == offline(3, **SEEDED)
    assert cluster.wait_for_increase("cluster:spec_decode_num_drafts_total", before, 20, role="decode") > 20
    rows = str(httpx.get(f"{cluster.base_url}/v1/backends", timeout=10).json())
    assert "speculative_decoding" in rows and "'mtp'" in rows and "mtp.moe" in rows
    if layout == "disaggregated":
        assert cluster.metric("cluster:spec_decode_num_draft_tokens_total", role="prefill") == []
        handed = cluster.metric("cluster:draft_head_states_handed_over_total", role="decode")
        assert handed and sum(handed) >= len(PROMPTS) * 4, handed
        assert sum(cluster.metric("cluster:draft_head_cold_starts_total", role="decode")) == 0
    for role in (("prefill", "decode") if layout == "disaggregated" else ("decode",)):
        usage = cluster.wait_for_metric("cluster:kv_cache_usage_perc", lambda v: bool(v) and max(v) == 0.0,
                                        timeout=30.0, role=role)
        assert usage and max(usage) == 0.0, (role, usage)


@pytest.fixture(scope="module")
def v4_dspark_dir(tmp_path_factory):
    """A small random DeepSeek-V4 (CSA and HCA layers) with a DSpark drafter (3 stages, blocks of 5)."""
    from tests.deepseek_factories import add_dspark, make_v4_checkpoint
    from tests.factories import save_tokenizer
    path = str(tmp_path_factory.mktemp("e2e-v4-dspark"))
    hf = make_v4_checkpoint(path, "csa_hca")
    add_dspark(path, hf.config.to_dict(), [1, 2, 3])
    save_tokenizer(path, vocab_size=256)
    return path


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_deepseek_v4_dspark_serving_equals_offline_without_speculation(cluster, v4_dspark_dir, layout):
    """DeepSeek-V4 drafting blocks with its DSpark drafter: completions with prompt lists, n = 2
    greedy and n = 3 seeded, streamed and not, equal to offline generation without speculation;
    disaggregated, every decode request drafts from the entries the prefill replica wrote, after
    checking the hand-over, and decode computes none of the prompt."""
    llm = LLM(v4_dspark_dir, block_size=16)

    def offline(n, **sampling):
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    settings = {"model": v4_dspark_dir, "kv_transfer": "ipc", "speculative_method": "dspark",
                "num_speculative_tokens": 5, "remote_kv_grace_s": 0.5}
    if layout == "colocated":
        settings["prefill_replicas"] = 0
    cluster.deploy(settings)
    model = model_name(v4_dspark_dir)
    for stream in (False, True):
        assert asyncio.run(_completions(cluster, model, 2, stream, temperature=0.0)) == offline(2, temperature=0.0)
        assert asyncio.run(_completions(cluster, model, 3, stream, **SEEDED)) == offline(3, **SEEDED)
    blocks = cluster.wait_for_metric("cluster:dspark_blocks_total", lambda v: sum(v) > 10, role="decode")
    assert sum(blocks) > 10
    rows = str(httpx.get(f"{cluster.base_url}/v1/backends", timeout=10).json())
    assert "speculative_decoding" in rows and "'dspark'" in rows and "mtp.moe" in rows
    if layout == "disaggregated":
        assert cluster.metric("cluster:spec_decode_num_draft_tokens_total", role="prefill") == []
        checked = cluster.metric("cluster:dspark_handovers_checked_total", role="decode")
        assert checked and sum(checked) >= len(PROMPTS) * 4, checked
        assert sum(cluster.metric("cluster:dspark_handover_rejected_total", role="decode")) == 0
    for role in (("prefill", "decode") if layout == "disaggregated" else ("decode",)):
        usage = cluster.wait_for_metric("cluster:kv_cache_usage_perc", lambda v: bool(v) and max(v) == 0.0,
                                        timeout=30.0, role=role)
        assert usage and max(usage) == 0.0, (role, usage)
