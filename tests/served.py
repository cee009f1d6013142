"""A `llama-jax serve` child process for the tests, on a free loopback port: started, waited for, stopped."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT = 120  # seconds for the server to load the model and answer /health
NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `llama-jax serve` child process: its base URL, and stop() (SIGTERM, then its exit status). name: the
    model's id in the API (None: the server's default, its file's name)."""

    def __init__(self, folder: Path, *args: str, name: str | None = NAME):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"serve-{self.port}.txt"
        command = [sys.executable, "-m", "llama_jax.cli", "serve", "--port", str(self.port)]
        command += ["--model-name", name] if name else []
        with self.log.open("w") as log:
            self.process = subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.process.kill()
        raise AssertionError(f"the server did not start in {START_TIMEOUT} s: {self.log.read_text()[-3000:]}")

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, timeout=300, **kwargs)

    def get(self, path: str) -> dict:
        return httpx.get(f"{self.url}{path}", timeout=60).json()

    def rss_mb(self) -> float:
        """The server process's resident memory now."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024

    def stop(self) -> bool:
        """SIGTERM, then whether it shut down cleanly: its log says so, and it exits by the signal uvicorn raises
        again once it has shut down (or with 0)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout=120)
        return status in (0, -signal.SIGTERM) and "Application shutdown complete" in self.log.read_text()
