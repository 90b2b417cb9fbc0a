"""The aiohttp application: native API, OpenAI-compatible API, admin (park/unpark), health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from aiohttp import web

from ..tokenizer import Tokenizer
from .errors import ApiError, error_middleware, read_json
from .metrics import render_metrics
from .options import EngineOptions
from .supervisor import Supervisor


@dataclass(frozen=True)
class ServerOptions:
    model_name: str = "qwen4exp"
    api_key: str | None = None
    admin_key: str | None = None
    max_body_bytes: int = 8 << 20
    wake_on_request: bool = False
    park_after_idle: float | None = None      # seconds without requests before an automatic park
    default_max_tokens: int = 256


SUPERVISOR = web.AppKey("supervisor", Supervisor)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
OPTIONS = web.AppKey("options", ServerOptions)
ENGINE_OPTIONS = web.AppKey("engine_options", EngineOptions)
STARTED = web.AppKey("started", float)

INFERENCE_PATHS = ("/generate", "/v1/")
ADMIN_PATHS = ("/park", "/unpark")


def _authorised(request: web.Request, key: str | None) -> bool:
    if not key:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


@web.middleware
async def auth_middleware(request: web.Request, handler):
    options = request.app[OPTIONS]
    # Without an admin key, the API key guards the admin endpoints too (never leave them open by accident).
    if request.path.startswith(ADMIN_PATHS) and not _authorised(request, options.admin_key or options.api_key):
        raise ApiError(401, "this admin endpoint needs 'Authorization: Bearer <admin key>'", "authentication_error")
    if request.path.startswith(INFERENCE_PATHS) and not _authorised(request, options.api_key):
        raise ApiError(401, "this endpoint needs 'Authorization: Bearer <api key>'", "authentication_error")
    return await handler(request)


def model_vocab(app: web.Application) -> int:
    """The model's vocabulary size (ids past the tokenizer's own vocabulary are still valid ids)."""
    return app[SUPERVISOR].info.get("vocab_size") or app[TOKENIZER].vocab_size


async def ensure_serving(app: web.Application) -> Supervisor:
    """The supervisor, ready; wakes a parked engine when the profile says so."""
    supervisor = app[SUPERVISOR]
    if supervisor.state == "parked" and app[OPTIONS].wake_on_request:
        await supervisor.unpark()
    if supervisor.state != "ready":
        raise ApiError(503, f"the engine is {supervisor.state}" + (f": {supervisor.error}" if supervisor.error else ""),
                       "server_error", headers={"Retry-After": "5"})
    return supervisor


async def health(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    body = {"status": supervisor.state, "restarts": supervisor.restarts}
    if supervisor.error:
        body["error"] = supervisor.error
    return web.json_response(body, status=200 if supervisor.state == "ready" else 503)


async def props(request: web.Request) -> web.Response:
    app = request.app
    supervisor, engine_options = app[SUPERVISOR], app[ENGINE_OPTIONS]
    stats = await supervisor.stats()
    context = supervisor.fitted_context
    return web.json_response({
        "model": app[OPTIONS].model_name,
        "model_path": engine_options.model,
        "state": supervisor.state,
        "context": context,
        "context_source": "profile" if engine_options.max_ctx != "auto" else "fitted (max_ctx = \"auto\")",
        "plan": supervisor.info.get("plan"),
        "slots": engine_options.slots,
        "chunk": engine_options.chunk,
        "device": supervisor.info.get("device"),
        "dtype": engine_options.dtype,
        "prefix_cache": stats.get("prefix_cache"),
        "busy_slots": stats.get("busy_slots"),
        "queued": stats.get("queued"),
        "uptime_s": round(time.time() - app[STARTED], 1),
        # llama-server compatible fields, for tools written against it and the seed's engine.
        "total_slots": engine_options.slots,
        "default_generation_settings": {"n_ctx": context, "model": app[OPTIONS].model_name},
    })


async def metrics(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    stats = await supervisor.stats()
    return web.Response(text=render_metrics(supervisor, stats), content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def park(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    body = await read_json(request) if request.can_read_body else {}
    mode = body.get("mode", "wait")
    if mode not in ("wait", "abort"):
        raise ApiError(400, f"'mode' must be \"wait\" or \"abort\", got {mode!r}", param="mode")
    if supervisor.state == "parked":
        return web.json_response({"parked": True, "already": True, "context": supervisor.fitted_context})
    if supervisor.state != "ready":
        raise ApiError(503, f"the engine is {supervisor.state}; it cannot be parked now", "server_error")
    started = time.perf_counter()
    supervisor.state = "parking"          # new requests get 503 from here on
    try:
        if mode == "wait":
            while supervisor.in_flight:
                await asyncio.sleep(0.02)
        info = await supervisor.park()
    except BaseException:
        if supervisor.state == "parking":      # the park did not happen: serve again
            supervisor.state = "ready"
        raise
    return web.json_response({"parked": True, "mode": mode, "seconds": round(time.perf_counter() - started, 3),
                              "bytes_freed": info["bytes_freed"], "context": info["context"]})


async def unpark(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    if supervisor.state == "ready":
        return web.json_response({"parked": False, "already": True, "context": supervisor.fitted_context})
    if supervisor.state != "parked":
        raise ApiError(503, f"the engine is {supervisor.state}; nothing to unpark", "server_error")
    started = time.perf_counter()
    info = await supervisor.unpark()
    return web.json_response({"parked": False, "seconds": round(time.perf_counter() - started, 3),
                              "context": info["context"]})


def create_app(engine_options: EngineOptions, options: ServerOptions) -> web.Application:
    from .generate_api import routes as generate_routes
    from .openai_api import routes as openai_routes
    from .openapi import openapi

    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=options.max_body_bytes)
    app[OPTIONS], app[ENGINE_OPTIONS], app[STARTED] = options, engine_options, time.time()
    app[TOKENIZER] = Tokenizer.from_dir(engine_options.model)
    app[SUPERVISOR] = Supervisor(engine_options)
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/park", park)
    app.router.add_post("/unpark", unpark)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_routes(generate_routes)
    app.router.add_routes(openai_routes)
    app.cleanup_ctx.append(_engine_lifecycle)
    return app


async def _engine_lifecycle(app: web.Application):
    supervisor = app[SUPERVISOR]
    await supervisor.start()
    idle = app[OPTIONS].park_after_idle
    watcher = asyncio.ensure_future(_park_when_idle(supervisor, idle)) if idle else None
    yield
    if watcher is not None:
        watcher.cancel()
    await supervisor.stop()


async def _park_when_idle(supervisor: Supervisor, seconds: float) -> None:
    """Park after `seconds` with no request in flight (the profile's park_after_idle)."""
    while True:
        await asyncio.sleep(min(seconds, 5.0))
        if supervisor.state == "ready" and not supervisor.in_flight and \
                time.monotonic() - supervisor.last_activity >= seconds:
            await supervisor.park()
