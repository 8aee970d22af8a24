"""OpenAI-style error bodies, and handlers that turn every bad request into one (HTTP 400, never 422/500)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(message: str, status: int = 400, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _describe(err: dict) -> tuple[str, str | None]:
    """One readable line and the offending parameter for a pydantic error."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('msg')}", None
    return (f"{param}: {err.get('msg')}" if param else str(err.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        msgs = [_describe(e) for e in errors] or [("invalid request", None)]
        return error_response("; ".join(m for m, _ in msgs), param=msgs[0][1], code="invalid_value")

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.type, exc.param, exc.code)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        return error_response(str(exc), code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(str(exc.detail), exc.status_code, kind)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500, "internal_error")
