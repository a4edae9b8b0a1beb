"""Every failure of `pipe serve` as OpenAI's `{"error": {...}}` body: 400 for a malformed body with
the field at fault as `param`, the status an `APIError` or an HTTP error carries (404, 405),
503 with Retry-After over capacity, 500 for anything else (logged)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from pipeline.serve.engine.scheduler import QueueFull
from pipeline.serve.http.openai_api import APIError
from pipeline.serve.http.responses import error_response

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


def add_error_handlers(app: FastAPI) -> None:
    """Answer `app`'s exceptions with OpenAI's error body (module docstring)."""

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request, error: RequestValidationError):
        errors = error.errors()
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors
        )
        loc = errors[0]["loc"] if errors else ()
        param = loc[1] if len(loc) > 1 and isinstance(loc[1], str) else None
        return error_response(problems, 400, param)

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return error_response(str(error), error.status, error.param)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        headers = getattr(error, "headers", None)
        return error_response(str(error.detail), error.status_code, headers=headers)

    @app.exception_handler(QueueFull)
    async def overloaded(_request, error: QueueFull):
        return error_response(str(error), 503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def failed(_request, error: Exception):
        log.error("request failed", exc_info=error)
        return error_response(f"internal error: {error}", 500)
