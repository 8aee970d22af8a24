"""`kestrel serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse

from kestrel.commands.engine_args import add_engine_args, build_engine


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve MODEL (default: the embedded SmolLM2) over an OpenAI-compatible API: "
                                   "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all interfaces (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer API_KEY' on /v1/* requests (401 otherwise)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: the engine's model name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default: %(default)s)")
    add_engine_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    if not (0 < args.port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    from kestrel.engine.async_engine import AsyncLLMEngine
    from kestrel.server.app import serve

    engine = AsyncLLMEngine(build_engine(args))
    serve(engine, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, log_level=args.log_level)
    return 0
