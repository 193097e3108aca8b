"""A local Ray instance shared by the end-to-end tests, and helpers to deploy the application
with given settings and talk to it over HTTP."""
from __future__ import annotations

import os
import random
import socket
import time
from typing import Any

import pytest

try:
    import httpx
except ImportError:  # openai >= 3 ships httpx2
    import httpx2 as httpx  # type: ignore[no-redef]

from tests.factories import make_checkpoint


def free_port() -> int:
    """A free port outside the OS's ephemeral range and Ray's worker ports (10002-19999): Ray's
    processes take ephemeral ports as they start, so one the OS handed out a moment ago (port 0)
    could be taken again before Serve's proxy binds it (seen: "Failed to bind to address")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


class Cluster:
    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.settings: dict[str, Any] | None = None

    def deploy(self, settings: dict[str, Any]) -> None:
        from ray import serve

        from cluster.application import build_app
        if settings == self.settings:
            return
        serve.run(build_app(settings), name="cluster", route_prefix="/")
        self.settings = dict(settings)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the application did not become healthy")

    @staticmethod
    def _poll(read: Any, done: Any, timeout: float) -> Any:
        """``read()`` every 0.25 s until ``done(value)`` holds or ``timeout`` passes; the last value
        (replicas report every 0.5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            value = read()
            if done(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.25)

    def wait_for_metric(self, name: str, predicate: Any, timeout: float = 10.0, **labels: str) -> list[float]:
        """The metric's values once ``predicate(values)`` holds."""
        return self._poll(lambda: self.metric(name, **labels), predicate, timeout)

    def _samples(self, name: str, **labels: str) -> list[Any]:
        """The scraped samples of ``name`` whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())]

    def metric(self, name: str, **labels: str) -> list[float]:
        """Values of a metric's samples whose labels include ``labels``."""
        return [sample.value for sample in self._samples(name, **labels)]

    def metric_by_replica(self, name: str, **labels: str) -> dict[str, float]:
        """A counter's value per replica (label ``replica``), to take increases from: a redeploy's
        replaced replicas stay in ClusterState's snapshot until their reports go stale, so a sum
        taken just after a deploy may count a replica that then drops out (a CI run saw the old
        decode replica's 516 drafts vanish as the new one reached 516)."""
        by_replica: dict[str, float] = {}
        for sample in self._samples(name, **labels):
            key = sample.labels.get("replica", "")
            by_replica[key] = by_replica.get(key, 0.0) + sample.value
        return by_replica

    def increase(self, name: str, before: dict[str, float], **labels: str) -> float:
        """How much a counter grew since ``before`` (metric_by_replica), summed over the replicas
        reporting now; a replica new since then counts from zero."""
        now = self.metric_by_replica(name, **labels)
        return sum(value - before.get(replica, 0.0) for replica, value in now.items())

    def wait_for_increase(self, name: str, before: dict[str, float], more_than: float, timeout: float = 10.0,
                          **labels: str) -> float:
        """The counter's increase since ``before`` once it exceeds ``more_than`` (or at the timeout)."""
        return self._poll(lambda: self.increase(name, before, **labels), lambda grown: grown > more_than, timeout)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("e2e-llama"))
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="package")
def cluster():
    """One Ray instance for the end-to-end tests, shut down after the last of them: left running
    (it was session-scoped), its last deployment's replicas held memory and CPU through every test
    file after this package (a CI run was killed there)."""
    import ray
    from ray import serve
    port = free_port()
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield Cluster(port)
    serve.shutdown()
    ray.shutdown()
