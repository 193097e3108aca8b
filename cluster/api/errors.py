"""Failures at the HTTP edge as OpenAI error bodies: the ClusterError an error output stands for,
pydantic validation errors as 400s naming the field, the 413 for oversize bodies, and the
opaque 500 for everything unexpected (logged with its traceback here, never sent)."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from cluster.common.errors import ClusterError, ErrorKind, InvalidRequestError, error_for
from cluster.common.messages import StepOutput


class RequestTooLargeError(InvalidRequestError):
    status_code = 413


def internal_error() -> ClusterError:
    return ClusterError("Internal server error", code="internal_error")


def error_response(exc: ClusterError) -> JSONResponse:
    return JSONResponse(exc.to_openai(), status_code=exc.status_code)


def output_error(out: StepOutput) -> ClusterError | None:
    """The error a finished sample output stands for: finish_reason "error" or "abort", typed by
    its ``error_kind`` (a deadline, a failed KV transfer, an abort by the engine...)."""
    if out.finish_reason not in ("abort", "error"):
        return None
    message = out.error or ("request aborted" if out.finish_reason == "abort" else "generation failed")
    kind = out.error_kind or (ErrorKind.ABORTED if out.finish_reason == "abort" else ErrorKind.INTERNAL)
    return error_for(kind, message)


def raise_for_output(out: StepOutput) -> None:
    error = output_error(out)
    if error is not None:
        raise error


def validation_error(exc: ValidationError) -> InvalidRequestError:
    """A pydantic error as a 400 naming the first offending top-level field."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequestError(f"malformed JSON body: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return InvalidRequestError("the request body must be a JSON object")
    messages = []
    for e in errors[:5]:
        where = _loc(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        messages.append(f"{where}: {msg}" if where else msg)
    param = str(first["loc"][0]) if first["loc"] else None
    return InvalidRequestError("; ".join(messages), param=param)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[ContentPart]", "none") or "[" in str(part):
            continue  # the union member pydantic tried, not a field
        else:
            out += f".{part}" if out else str(part)
    return out
