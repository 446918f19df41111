"""An ASGI app served by uvicorn in a thread on 127.0.0.1 (a free port), for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from typing import Self


class ThreadedServer:
    """``with ThreadedServer(app) as s: httpx.get(s.url + ...)``; stopped (and joined) on exit."""

    def __init__(self, app, *, lifespan: str = "off", log_level: str = "critical", graceful_s: float = 1):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level=log_level, lifespan=lifespan, timeout_graceful_shutdown=graceful_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"
