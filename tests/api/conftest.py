"""Fixtures for the OpenAI front end: a real uvicorn server (in a background thread, on a free
loopback port) serving ``build_openai_app`` over a FakeEngineClient, and clients for it."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from cluster.api.server import build_openai_app
from cluster.models.tokenizer import Tokenizer
from tests.api.fakes import FakeEngineClient
from tests.factories import save_tokenizer

try:
    import httpx
except ImportError:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx  # type: ignore[no-redef]

SERVED_NAME = "test-model"
#: What the server's ``model`` setting said (e.g. ``smollm2`` or a path): accepted as well.
MODEL_ALIAS = "models/fake-model"
MAX_BODY_BYTES = 64 * 1024


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 from a daemon thread."""

    def __init__(self, app: object) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(str(path))
    return Tokenizer.from_dir(str(path))


@pytest.fixture(scope="session")
def fake_session(tokenizer: Tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer)


@pytest.fixture(scope="session")
def server(fake_session: FakeEngineClient) -> Iterator[ServerThread]:
    app = build_openai_app(fake_session, max_body_bytes=MAX_BODY_BYTES, served_model_name=SERVED_NAME,
                           model_aliases=(MODEL_ALIAS,))
    with ServerThread(app) as running:
        yield running


@pytest.fixture
def fake(fake_session: FakeEngineClient, server: ServerThread) -> Iterator[FakeEngineClient]:
    fake_session.reset()
    yield fake_session
    fake_session.reset()


@pytest.fixture
def base_url(server: ServerThread) -> str:
    return server.base_url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def wait_for(condition: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return bool(condition())  # type: ignore[operator]
