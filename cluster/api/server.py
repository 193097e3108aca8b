"""The OpenAI-compatible FastAPI app over an EngineClient: ``build_openai_app``.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text), GET /v1/backends. Request bodies are read here, not by FastAPI,
so that the size limit (413) is enforced on the Content-Length header and on the bytes actually
read, and malformed JSON and wrong types are 400s with an OpenAI error body (FastAPI would say
422). Every error leaves as ``{"error": {"message", "type", "param", "code"}}``.

A client that disconnects cancels its request: while a handler runs (non-streaming, or waiting
for a stream's first output) a watcher on the ASGI receive channel cancels it; once a stream has
started, Starlette cancels the stream itself. Either way the sample iterators are cancelled, so
the engine aborts them.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from cluster.api.client import EngineClient
from cluster.api.errors import RequestTooLargeError, error_response, internal_error, validation_error
from cluster.api.metrics import ServerMetrics
from cluster.api.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                 CompletionResponse, ErrorResponse, ModelCard, ModelList)
from cluster.api.serving import OpenAIServing, new_request_id
from cluster.common.errors import ClusterError, InvalidRequestError

logger = logging.getLogger(__name__)

RequestModel = TypeVar("RequestModel", bound=BaseModel)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body, refusing (413) one over ``max_body_bytes`` by its header or its bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequestError("invalid Content-Length header") from None
        if size > max_body_bytes:
            raise RequestTooLargeError(f"request body of {size} bytes exceeds the limit of "
                                       f"{max_body_bytes} bytes", code="request_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_body_bytes:
            raise RequestTooLargeError(f"request body exceeds the limit of {max_body_bytes} bytes",
                                       code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[RequestModel], body: bytes) -> RequestModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run ``handler``; if the client disconnects first, cancel it (and answer nothing useful:
    nobody is listening)."""
    work = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            logger.info("client disconnected; request %s cancelled", request.url.path)
    if work.cancelled():
        return Response(status_code=499)
    return work.result()


async def _respond(route: str, metrics: ServerMetrics, call: Callable[[], Awaitable[Response]]) -> Response:
    """Run a route's body, mapping failures to OpenAI error responses and counting statuses."""
    try:
        response = await call()
    except ClusterError as exc:
        response = error_response(exc)
    except Exception:
        logger.exception("internal error on %s", route)
        response = error_response(internal_error())
    metrics.http_request(route, response.status_code)
    return response


#: Route -> (method, request body model or None, 200 response model): the bodies are read by hand
#: (size limit, 400s), so FastAPI cannot see these models; ``/openapi.json`` is told of them.
_DOCUMENTED: dict[str, tuple[str, type[BaseModel] | None, type[BaseModel]]] = {
    "/v1/completions": ("post", CompletionRequest, CompletionResponse),
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletionResponse),
    "/v1/models": ("get", None, ModelList),
    "/v1/models/{model_id}": ("get", None, ModelCard),
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document with the request and response schemas of the OpenAI routes (streamed
    answers are ``text/event-stream`` of the matching ``*Chunk`` objects) and the error body."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel]) -> dict[str, str]:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"description": "an OpenAI error body", "content": {"application/json": {"schema": ref(ErrorResponse)}}}
    for path, (method, request, response) in _DOCUMENTED.items():
        operation = schema["paths"].get(path, {}).get(method)
        if operation is None:
            continue
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(request)}}}
        operation["responses"] = {"200": {"description": "OK", "content": {"application/json": {"schema": ref(response)}}},
                                  "4XX": error, "5XX": error}
    app.openapi_schema = schema
    return schema


def build_openai_app(client: EngineClient, *, max_body_bytes: int, served_model_name: str | None = None,
                     request_timeout_s: float | None = None, block_size: int = 16,
                     model_aliases: tuple[str, ...] = (), api_keys: str | None = None,
                     cors_allow_origins: str | None = None) -> FastAPI:
    """The OpenAI HTTP app serving ``client``. ``request_timeout_s`` caps every request's
    deadline (a request's own ``timeout`` may only shorten it); ``block_size`` is the KV block
    size of the prompt block hashes sent for prefix-cache routing; ``model_aliases``: other
    names requests may give for the model (answers carry the served name); ``api_keys``
    (comma-separated): required as ``Authorization: Bearer <key>`` on ``/v1/*``;
    ``cors_allow_origins`` (comma-separated): origins CORS allows."""
    metrics = ServerMetrics(served_model_name or client.model_name)
    serving = OpenAIServing(client, metrics, model_name=served_model_name or client.model_name,
                            block_size=block_size, request_timeout_s=request_timeout_s, aliases=model_aliases)
    app = FastAPI(title="pd-cluster OpenAI API", docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.state.serving = serving
    app.state.metrics = metrics
    _install_error_handlers(app)
    keys = _split(api_keys)
    if keys:
        app.add_middleware(RequireAPIKey, keys=keys)
    origins = _split(cors_allow_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def call() -> Response:
            body = parse_body(CompletionRequest, await read_body(request, max_body_bytes))
            return await cancel_on_disconnect(request, serving.completions(body, new_request_id("cmpl")))
        return await _respond("/v1/completions", metrics, call)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def call() -> Response:
            body = parse_body(ChatCompletionRequest, await read_body(request, max_body_bytes))
            return await cancel_on_disconnect(request, serving.chat(body, new_request_id("chatcmpl")))
        return await _respond("/v1/chat/completions", metrics, call)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=serving.model_name, root=client.model_name, max_model_len=client.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        async def call() -> Response:
            serving.check_model(model_id)
            card = ModelCard(id=serving.model_name, root=client.model_name, max_model_len=client.max_model_len)
            return Response(card.model_dump_json(), media_type="application/json")
        return await _respond("/v1/models/{id}", metrics, call)

    @app.get("/health")
    async def health() -> Response:
        try:
            await client.health()
        except Exception as exc:
            logger.warning("health check failed: %r", exc)
            message = exc.message if isinstance(exc, ClusterError) else "service unavailable"
            return JSONResponse({"error": {"message": message, "type": "service_unavailable",
                                           "param": None, "code": None}}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            stats = await client.replica_stats()
        except Exception:
            logger.exception("replica_stats failed; serving front-end metrics only")
            stats = []
        return Response(metrics.render(stats), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/backends")
    async def backends() -> Response:
        async def call() -> Response:
            return JSONResponse(await client.backends())
        return await _respond("/v1/backends", metrics, call)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for what FastAPI itself answers (unknown routes, wrong methods...)."""

    async def http_error(request: Request, exc: Any) -> Response:
        status = getattr(exc, "status_code", 500)
        error_type = "not_found_error" if status == 404 else "invalid_request_error"
        body = {"error": {"message": str(getattr(exc, "detail", "")) or "error", "type": error_type,
                          "param": None, "code": None}}
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

    async def request_validation(request: Request, exc: Any) -> Response:
        return error_response(InvalidRequestError(str(exc)))

    async def cluster_error(request: Request, exc: Any) -> Response:
        return error_response(exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(ClusterError, cluster_error)


def _split(values: str | None) -> list[str]:
    return [v.strip() for v in (values or "").split(",") if v.strip()]


class RequireAPIKey:
    """ASGI middleware: ``/v1/*`` requests need ``Authorization: Bearer <key>`` with one of
    ``keys`` (compared in constant time), else 401 with an OpenAI error body. CORS preflights
    (OPTIONS) and the other routes (``/health``, ``/metrics``) pass."""

    def __init__(self, app: Any, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and any(hmac.compare_digest(token.strip(), k) for k in self.keys):
            await self.app(scope, receive, send)
            return
        body = {"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
