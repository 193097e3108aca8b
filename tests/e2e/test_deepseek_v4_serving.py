"""DeepSeek-V4 through the real Ray Serve application: every KV group (sliding window,
compressed CSA/HCA entries, indexer keys, compressor state checkpoints) crosses the prefill ->
decode transfer, so disaggregated greedy output equals colocated output."""
from __future__ import annotations

import asyncio

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.deepseek_factories import make_v4_checkpoint
from tests.e2e.test_disaggregation import run_concurrently_prompts
from tests.factories import mixed_prompts, save_tokenizer

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v4"))
    make_v4_checkpoint(path, "csa_hca", seed=3)
    save_tokenizer(path, vocab_size=256)
    return path


@pytest.mark.parametrize("backend", ["ipc", "nixl"])
def test_v4_disaggregated_equals_colocated(cluster, v4_dir, backend):
    prompts = mixed_prompts(500, (3, 7, 9, 15, 23, 33, 41, 57, 64, 70), seed=31)
    prompts += [prompts[-1] + p[:5] for p in prompts[:4]]  # shared prefixes (prefix-cache hits)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(v4_dir, block_size=4)
        expected = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    finally:
        torch.set_num_threads(threads)
    cluster.deploy({"model": v4_dir, "kv_transfer": backend, "block_size": 4})
    got = asyncio.run(run_concurrently_prompts(cluster.base_url, v4_dir.rstrip("/").rsplit("/", 1)[-1],
                                               prompts, {"temperature": 0.0}, max_tokens=MAX_TOKENS))
    assert got == expected
    assert sum(cluster.metric("cluster:kv_transfer_bytes_total", role="prefill")) > 0
