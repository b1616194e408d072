"""Running the app: in the foreground (``speculum serve``) or in a background thread (tests, scripts)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs an ASGI app with uvicorn in a daemon thread; a context manager.

    >>> with ServerThread(app) as server:
    ...     httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=5, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="speculum-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.url} failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server on {self.url} did not start within {timeout:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(app, host: str, port: int, log_level: str = "info", access_log: bool = True) -> None:
    """Run ``app`` in the foreground until SIGINT/SIGTERM (graceful: the engine stops last)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log,
                timeout_graceful_shutdown=5)
