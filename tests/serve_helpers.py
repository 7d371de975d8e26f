"""Shared by the server tests: a server in this process on a free port, and reading its state."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from dataclasses import dataclass
from typing import Any

from nanovllm_core.entrypoints.api_server import APIServer, build_app

API_KEY = "test-key"


@dataclass
class RunningServer:
    """A server started by :func:`start_server`: ``url`` (no trailing slash), its controller and key."""

    url: str
    controller: Any
    api_key: str | None
    http: APIServer

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout: float = 10.0) -> bool:
        return self.http.stop(timeout)

    def stats(self, timeout: float = 30.0) -> dict:
        """``LLMEngine.stats()`` read on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.controller.call(lambda engine: future.set_result(engine.stats()))
        return future.result(timeout)

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Stats once no request is running or waiting (fails after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy after {timeout} s: {stats}")
            time.sleep(0.05)


def free_socket() -> socket.socket:
    """A listening socket on 127.0.0.1 and a port the system chose."""
    return socket.create_server(("127.0.0.1", 0))


def start_server(controller: Any, api_key: str | None = API_KEY) -> RunningServer:
    sock = free_socket()
    port = sock.getsockname()[1]
    http = APIServer(build_app(controller, api_key=api_key), log_level="warning", access_log=False)
    http.start_in_thread(sock)
    return RunningServer(f"http://127.0.0.1:{port}", controller, api_key, http)
