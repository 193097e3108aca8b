"""Typed errors. Every failure a user can cause or meet has a class here, so that the offline API
raises something precise and the HTTP edge can map it to an OpenAI error body and status code.
A request that ends in error or abort inside an engine carries an ``ErrorKind`` across the hops
(engine output, decode stream, HTTP edge), never a class name or a message to match:
``error_for(kind, message)`` is the exception it stands for."""
from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    """Why a request ended without its output (``RequestOutput.error_kind``, ``StepOutput.error_kind``)."""

    INTERNAL = "internal"
    DEADLINE = "deadline"
    ABORTED = "aborted"
    KV_TRANSFER = "kv_transfer"
    OVERLOADED = "overloaded"
    INVALID_REQUEST = "invalid_request"
    REPLICA_DIED = "replica_died"
    ENGINE_DEAD = "engine_dead"


class ClusterError(Exception):
    """Base of every error this project raises on purpose."""

    #: HTTP status the API edge answers with.
    status_code: int = 500
    #: OpenAI error ``type`` field.
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(ClusterError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long, unknown model...)."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (404, as OpenAI answers)."""

    status_code = 404


class ModelLoadError(ClusterError):
    """A model could not be loaded: missing path, missing or mis-shaped tensor, bad file."""

    error_type = "model_load_error"


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture (or one of its settings) is not implemented."""


class UnsupportedSettingError(ClusterError, ValueError):
    """A configuration setting is unknown, invalid, or not implemented; raised at start-up."""

    error_type = "configuration_error"


class OverloadedError(ClusterError):
    """Every queue that could take the request is full; try again later."""

    status_code = 503
    error_type = "overloaded_error"


class RateLimitedError(OverloadedError):
    status_code = 429
    error_type = "rate_limit_error"


class RequestTimeoutError(ClusterError):
    """The request's deadline passed before it finished."""

    status_code = 504
    error_type = "timeout_error"


class RequestAbortedError(ClusterError):
    """The request was aborted (client disconnect, cancellation)."""

    status_code = 499
    error_type = "aborted"


class KVTransferError(ClusterError):
    """Moving KV blocks between a prefill and a decode worker failed."""

    status_code = 500
    error_type = "kv_transfer_error"


class ReplicaDiedError(ClusterError):
    """The replica serving a request died mid-way (its process was killed or crashed); the other
    replicas go on, and a retry is routed to a live one."""

    status_code = 503
    error_type = "replica_unavailable"


class EngineDeadError(ClusterError):
    """The engine loop stopped after an internal error; the replica must be restarted."""

    status_code = 503
    error_type = "engine_dead_error"


#: The exception each kind stands for at the edge.
_KIND_CLASSES: dict[ErrorKind, type[ClusterError]] = {
    ErrorKind.INTERNAL: ClusterError, ErrorKind.DEADLINE: RequestTimeoutError,
    ErrorKind.ABORTED: RequestAbortedError, ErrorKind.KV_TRANSFER: KVTransferError,
    ErrorKind.OVERLOADED: OverloadedError, ErrorKind.INVALID_REQUEST: InvalidRequestError,
    ErrorKind.REPLICA_DIED: ReplicaDiedError, ErrorKind.ENGINE_DEAD: EngineDeadError,
}


def error_for(kind: ErrorKind, message: str) -> ClusterError:
    """The exception a request that ended with ``kind`` stands for."""
    cls = _KIND_CLASSES[kind]
    return cls(message, code="deadline_exceeded" if kind is ErrorKind.DEADLINE else None)


def kind_of(exc: BaseException) -> ErrorKind:
    """The kind of an exception (INTERNAL for anything not ours)."""
    for cls in type(exc).__mro__:
        for kind, known in _KIND_CLASSES.items():
            if cls is known:
                return kind
    return ErrorKind.INTERNAL
