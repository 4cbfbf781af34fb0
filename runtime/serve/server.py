"""uvicorn, exiting 0 after a graceful shutdown."""

from __future__ import annotations

import contextlib

import uvicorn


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting, waits for the requests in flight (up to
    ``timeout_graceful_shutdown``, then cancels them), runs the lifespan shutdown, and then raises
    the signal again, so the process would die of it (exit -15). A shutdown that finished its
    requests is a success: this server returns normally instead, and the CLI exits 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # uvicorn's record of the signals it will raise again
