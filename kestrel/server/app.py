"""FastAPI app factory for the OpenAI-compatible server, and `serve()` which runs it under uvicorn."""
from __future__ import annotations

import json
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from kestrel.engine.async_engine import AsyncLLMEngine
from kestrel.server.chat import create_chat_completion
from kestrel.server.completions import create_completion
from kestrel.server.errors import APIError, error_response, install_error_handlers
from kestrel.server.kv_transfer import install_kv_transfer
from kestrel.server.metrics import Metrics
from kestrel.server.protocol import ChatCompletionRequest, CompletionRequest
from kestrel.server.serving import ServerState, now


async def parse_body(request: Request, model: type[BaseModel]):
    """Parse the JSON body whatever the Content-Type says (curl -d sends form encoding), with 400s for bad input."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise APIError("request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


class _APIKeyGuard:
    """Bearer-key check on /v1/ as a plain ASGI middleware. Not @app.middleware("http"): that BaseHTTPMiddleware
    re-streams every response body through an anyio memory stream, ~80 us of event-loop CPU per SSE chunk.
    Probes and scrapers (/health, /metrics, /stats) stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and Request(scope).url.path.startswith("/v1/"):
            auth = Request(scope).headers.get("authorization", "")
            if not secrets.compare_digest(auth.encode(), self.expected):
                response = error_response("Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                                          401, "invalid_request_error", code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(engine: AsyncLLMEngine, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    name = served_model_name or engine.model_name
    state = ServerState(engine=engine, metrics=Metrics(engine.stats, name), served_model_name=name, api_key=api_key)
    app = FastAPI(title="kestrel", version="0.1.0")
    app.state.kestrel = state
    install_error_handlers(app)
    install_kv_transfer(app, state)  # /kv/prefill, /kv/import: prefill/decode disaggregation

    if api_key:
        app.add_middleware(_APIKeyGuard, api_key=api_key)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return error_response("engine thread is not running", 503, "internal_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        """Raw engine stats as JSON (for routers and tests)."""
        return {**engine.stats(), "num_active_requests": engine.num_active}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now(), "owned_by": "kestrel",
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(state, await parse_body(request, ChatCompletionRequest), request)

    return app


def serve(engine: AsyncLLMEngine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, log_level: str = "info") -> None:
    import uvicorn

    app = create_app(engine, served_model_name, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()

