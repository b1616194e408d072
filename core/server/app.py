"""The FastAPI application: routes, API-key check, OpenAI-style error handlers, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculum.errors import ConfigError
from speculum.server import protocol as P
from speculum.server.async_engine import AsyncEngine
from speculum.server.errors import APIError, error_body, validation_error
from speculum.server.metrics import ServerMetrics, StatsLogger
from speculum.server.serving import OpenAIServing
from speculum.server.spec_report import LEVELS
from speculum.tokenizer import Tokenizer

log = logging.getLogger("speculum.server")

OPEN_PATHS = ("/health",)


class APIKeyMiddleware:
    """Every route but /health needs ``Authorization: Bearer <key>`` (a plain ASGI middleware,
    so streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(got, self._expected):
            return await self.app(scope, receive, send)
        msg = ("Missing API key: send the header 'Authorization: Bearer <key>'." if not got else
               "Incorrect API key provided; send the key the server was started with (--api-key).")
        body = json.dumps(error_body(msg, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def server_tokenizer(llm: Any) -> Tokenizer:
    """A copy of the engine's tokenizer for the HTTP side (fast tokenizers are not safe to
    share between threads: encode on one while another decodes raises 'Already borrowed')."""
    tok = llm.tokenizer
    if tok.hf is None:
        return tok
    return Tokenizer(copy.deepcopy(tok.hf), tok.eos_token_ids)


def build_app(engine: AsyncEngine, *, model_names: list[str], api_key: str | None = None,
              spec_metrics_level: str = "none", metrics: ServerMetrics | None = None,
              log_interval_s: float = 10.0) -> FastAPI:
    """The OpenAI-compatible app for ``engine``; the lifespan starts and stops its thread.

    ``metrics`` must be the object the engine records into (``engine.metrics`` by default).
    """
    llm = engine.llm
    if spec_metrics_level not in LEVELS:
        raise ConfigError(f"per-request spec-decode metrics must be one of {', '.join(LEVELS)}, "
                          f"got {spec_metrics_level!r}")
    if spec_metrics_level != "none" and llm.speculative_config is None:
        raise ConfigError(f"--per-request-spec-decode-metrics {spec_metrics_level} reports speculation, but "
                          "speculation is off; add --speculative-config (e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}') or use none")
    engine.record_steps = spec_metrics_level == "detailed"
    metrics = metrics if metrics is not None else engine.metrics
    if metrics is None:
        metrics = engine.metrics = ServerMetrics(model_names[0], _k(llm))
    serving = OpenAIServing(engine, model_names, server_tokenizer(llm), llm.max_model_len, spec_metrics_level)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        stats = StatsLogger(metrics, log_interval_s, speculative=llm.speculative_config is not None)
        task = asyncio.ensure_future(stats.run()) if log_interval_s > 0 else None
        log.info("serving %s (speculation: %s, per-request spec-decode metrics: %s)", model_names[0],
                 json.dumps(llm.speculative_config.to_dict()) if llm.speculative_config else "off",
                 spec_metrics_level)
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="speculum", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        model = P.REQUEST_MODELS.get(request.url.path)
        fields = list(model.model_fields) if model else None
        return validation_error(list(exc.errors()), fields).response()

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = str(exc.detail)
        if exc.status_code == 404:
            msg = (f"No route {request.method} {request.url.path}; routes: POST /v1/completions, "
                   "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.")
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}."
        return JSONResponse(error_body(msg, "invalid_request_error", None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error", None, "internal_error"), 500)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse(error_body("the engine thread is not running", "server_error"), 503)
        if getattr(engine.llm, "dead", None):
            return JSONResponse(error_body(engine.llm.dead, "server_error"), 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": created, "owned_by": "speculum",
                 "root": str(getattr(llm, "model_path", name)), "parent": None,
                 "max_model_len": llm.max_model_len} for name in model_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    return app


def create_app(llm: Any, *, model_names: list[str] | None = None, api_key: str | None = None,
               spec_metrics_level: str = "none", log_interval_s: float = 10.0) -> FastAPI:
    """An app (and its :class:`AsyncEngine` and metrics) for an already built ``LLM``."""
    names = list(model_names or [getattr(getattr(llm, "model_path", None), "name", None) or "model"])
    engine = AsyncEngine(llm, metrics=ServerMetrics(names[0], _k(llm)))
    return build_app(engine, model_names=names, api_key=api_key, spec_metrics_level=spec_metrics_level,
                     log_interval_s=log_interval_s)


def _k(llm: Any) -> int:
    cfg = getattr(llm, "speculative_config", None)
    return cfg.num_speculative_tokens if cfg is not None else 0


def _version() -> str:
    from speculum import __version__
    return __version__
