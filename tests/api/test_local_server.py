"""The single-process server (no Ray) over a real engine answers like the cluster does."""
from __future__ import annotations

import threading
import time

import openai
import pytest
import uvicorn

from cluster.api.local_server import LocalEngineClient
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
