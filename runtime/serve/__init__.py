"""``python -m runtime serve ARTIFACT``: an OpenAI-compatible HTTP server on the runtime's engine.

Needs the ``serve`` extra (``pip install -e ".[serve]"``: Starlette, uvicorn, httpx); ``import
runtime`` never imports this package, so the embedded library stays light. protocol (request
checks, responses, stop sequences; no web framework), app (the Starlette app), cli (uvicorn,
signals)."""

from .protocol import CompletionRequest, RequestError, parse_completion

__all__ = ["CompletionRequest", "RequestError", "parse_completion", "create_app", "ServeConfig", "main"]


def __getattr__(name):
    # The app pulls in Starlette and anyio: only when asked for, so the protocol stays importable
    # (and the CLI can explain a missing extra) without them.
    if name in ("create_app", "ServeConfig"):
        from . import app

        return getattr(app, name)
    if name == "main":
        from .cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
