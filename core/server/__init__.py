"""speculum.server: an OpenAI-compatible HTTP server over the speculum engine.

``speculum serve`` builds an :class:`~speculum.engine.LLM`, hands it to an
:class:`AsyncEngine` (one background thread owns the engine) and serves
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and
``/metrics`` with FastAPI and uvicorn. See docs/serving.md.
"""

from speculum.server.async_engine import AsyncEngine, EngineUpdate

__all__ = ["AsyncEngine", "EngineUpdate", "build_app"]


def __getattr__(name):  # FastAPI is imported only when an app is built
    if name == "build_app":
        from speculum.server.app import build_app
        return build_app
    raise AttributeError(name)
