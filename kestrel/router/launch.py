"""Start and stop local replica / router processes on loopback (used by the fleet tests and bench/routing.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, args: list[str], port: int, log_path: str | None = None, env: dict | None = None):
        self.port, self.url, self.args = port, f"http://127.0.0.1:{port}", args
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.p = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_healthy(self, timeout: float = 120.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.p.returncode}; log: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.args} not healthy after {timeout}s; log: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        if not self.log_path:
            return "(no log)"
        try:
            return open(self.log_path, errors="replace").read()[-n:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: the way a crashed replica disappears (no graceful shutdown)."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def fake_replica(port: int, token_delay: float = 0.01, max_running: int = 4, name: str = "fake",
                 log_path: str | None = None) -> Proc:
    return Proc([sys.executable, "-m", "kestrel.router.fake_replica", "--port", str(port), "--name", name,
                 "--token-delay", str(token_delay), "--max-running", str(max_running)], port, log_path)


def router(port: int, replicas: list[str], *extra: str, log_path: str | None = None) -> Proc:
    args = [sys.executable, "-m", "kestrel.router.cli", "router", "--port", str(port), "--log-level", "warning"]
    for r in replicas:
        args += ["--replica", r]
    return Proc(args + list(extra), port, log_path)


def kestrel_serve(port: int, *extra: str, log_path: str | None = None, env: dict | None = None) -> Proc:
    return Proc([sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), *extra], port, log_path, env)
