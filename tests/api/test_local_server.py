"""The single-process server (no Ray) over a real engine answers like the cluster does."""
from __future__ import annotations

import threading
import time

import openai
import pytest
import uvicorn

from cluster.local_server import LocalEngineClient
from cluster.api.server import build_openai_app
from cluster.config import parse_cluster_args
from tests.e2e.conftest import free_port, httpx
from tests.factories import make_checkpoint


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    client = LocalEngineClient(parse_cluster_args({"model": path, "block_size": 4}, use_env=False))
    app = build_openai_app(client, max_body_bytes=1 << 20, served_model_name=client.model_name)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url, client.model_name
    server.should_exit = True
    thread.join(timeout=10)
    client.engine.shutdown()


def test_local_server_generates(base_url):
    url, name = base_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.completions.create(model=name, prompt="hello world", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    assert "colocated" in httpx.get(f"{url}/metrics", timeout=5).text
    graphs = [b for b in httpx.get(f"{url}/v1/backends", timeout=5).json() if b["component"] == "cuda_graphs"]
    assert len(graphs) == 1 and graphs[0]["impl"] == "off" and graphs[0]["reason"].startswith("off: ")
    assert "cluster:cuda_graphs_captured" in httpx.get(f"{url}/metrics", timeout=5).text


def test_local_server_n_samples_equal_offline_and_report_queue_time(base_url, tmp_path):
    """n=3 through the single-process server: one request to the engine, samples equal to the
    engine's own n=3 (sample 0 computes the prompt, the others share its blocks), and the queue
    time and preemption counter reach /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    url, name = base_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    prompt = list(range(5, 60))
    out = client.completions.create(model=name, prompt=prompt, n=3, max_tokens=5, temperature=0.8, seed=3,
                                    logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    got = [[int(t.split(":", 1)[1]) for t in c.logprobs.tokens] for c in sorted(out.choices, key=lambda c: c.index)]
    from cluster import LLM, SamplingParams
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama")
    want = LLM(path, block_size=4).generate([prompt], SamplingParams(n=3, max_tokens=5, temperature=0.8, seed=3,
                                                                     ignore_eos=True))[0]
    assert got == [c.token_ids for c in want.outputs]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text)}
    queue = [s for s in families["cluster:request_queue_time_seconds"].samples if s.name.endswith("_count")]
    assert queue and queue[0].value >= 1
    assert "cluster:num_preemptions" in families
