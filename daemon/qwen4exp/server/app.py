"""The aiohttp application: native API, OpenAI-compatible API, admin (park/unpark), health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from ..engine.engine_config import EngineConfig
from . import generate_api, openai_api
from .connections import ConnectionGuard
from .errors import ApiError, EngineUnavailable, error_middleware, parse_json, read_body
from .messages import EngineState, ParkLevel
from .metrics import CONTENT_TYPE, render_metrics
from .openapi import openapi
from .prepare import Preparer
from .request_fields import check_known, optional
from .shared import ENGINE_CONFIG, GUARD, OPTIONS, PREPARER, STARTED, SUPERVISOR, ServerOptions
from .supervisor import Supervisor

__all__ = ["GUARD", "SUPERVISOR", "ServerOptions", "create_app"]


log = logging.getLogger("qwen4exp.server")
INFERENCE_PATHS = ("/generate", "/v1/")
ADMIN_PATHS = ("/park", "/unpark")


def _authorised(request: web.Request, key: str | None) -> bool:
    """Whether the request carries `Authorization: Bearer <key>` (the scheme in any case, as HTTP says)."""
    if not key:
        return True
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    # Header bytes that are not UTF-8 reach us as surrogate escapes: compare them as the bytes they were.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                              key.encode())


def _admin(request: web.Request) -> bool:
    # Without an admin key, the API key guards the admin endpoints too (never leave them open by accident).
    options = request.app[OPTIONS]
    return _authorised(request, options.admin_key or options.api_key)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if request.path.startswith(ADMIN_PATHS) and not _admin(request):
        raise ApiError(401, "this admin endpoint needs 'Authorization: Bearer <admin key>'", "authentication_error")
    if request.path.startswith(INFERENCE_PATHS) and not _authorised(request, request.app[OPTIONS].api_key):
        raise ApiError(401, "this endpoint needs 'Authorization: Bearer <api key>'", "authentication_error")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    body = {"status": supervisor.state, "restarts": supervisor.restarts}
    if supervisor.error:
        body["error"] = supervisor.error
    return web.json_response(body, status=200 if supervisor.state is EngineState.READY else 503)


async def props(request: web.Request) -> web.Response:
    app = request.app
    supervisor, engine = app[SUPERVISOR], app[ENGINE_CONFIG]
    stats = await supervisor.stats()
    context = supervisor.fitted_context
    options = app[OPTIONS]
    # Where the model lives on disk is the operator's business: shown only to the admin key when keys are set.
    shown = {"model_path": engine.model} if not (options.api_key or options.admin_key) or _admin(request) \
        else {}
    return web.json_response({
        "model": app[OPTIONS].model_name,
        **shown,
        "state": supervisor.state,
        "context": context,
        "context_source": "profile" if engine.max_ctx != "auto" else "fitted (max_ctx = \"auto\")",
        "context_fitted_now": supervisor.info.get("context_fitted_now"),
        "plan": supervisor.info.get("plan"),
        "slots": engine.slots,
        "chunk": engine.chunk,
        # How prompt chunks share the engine with the rest (docs/CONFIG.md): what the profile asked for.
        "decode_beside_prompts": engine.decode_beside_prompts,
        "batch_prompts": engine.batch_prompts,
        # Speculative decoding: the profile's setting, and the drafts per step it resolved to in the engine.
        "mtp": {"profile": engine.mtp, "drafts": (stats.get("mtp") or {}).get("drafts")},
        "device": supervisor.info.get("device"),
        # With split devices: each run of layers and its device (engine/placement.py), as the fit placed them.
        "placement": supervisor.info.get("placement"),
        # Split layers' experts also kept on the target (engine/hot_experts.py), or None.
        "hot_experts": supervisor.info.get("hot_experts"),
        "warm_up_s": supervisor.info.get("warm_up_seconds"),
        "dtype": engine.dtype,
        "prefix_cache": stats.get("prefix_cache"),
        "busy_slots": stats.get("busy_slots"),
        "queued": stats.get("queued"),
        "uptime_s": round(time.time() - app[STARTED], 1),
        # llama-server compatible fields, for tools written against it and the seed's engine.
        "total_slots": engine.slots,
        "default_generation_settings": {"n_ctx": context, "model": app[OPTIONS].model_name},
    })


async def metrics(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    stats = await supervisor.stats()
    return web.Response(text=render_metrics(supervisor, stats, request.app[GUARD]),
                        headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"})


async def park(request: web.Request) -> web.Response:
    body = parse_json(await read_body(request, request.app[OPTIONS].body_timeout)) if request.can_read_body else {}
    check_known(body, {"mode", "level"}, "/park")
    mode = optional(body, "mode", "wait")
    if not isinstance(mode, str) or mode not in ("wait", "abort"):
        raise ApiError(400, f"'mode' must be \"wait\" or \"abort\", got {mode!r}", param="mode")
    level = optional(body, "level", request.app[OPTIONS].park_level)
    if not isinstance(level, str) or level not in {str(choice) for choice in ParkLevel}:
        raise ApiError(400, f"'level' must be \"release\" or \"offload\", got {level!r}", param="level")
    started = time.perf_counter()
    info = await request.app[SUPERVISOR].park(mode, ParkLevel(level))
    if info.get("already"):
        return web.json_response({"parked": True, "already": True, "context": info["context"]})
    return web.json_response({"parked": True, "mode": mode, "seconds": round(time.perf_counter() - started, 3),
                              **{key: info[key] for key in ("bytes_freed", "context", "level", "host_bytes_kept",
                                                           "device_bytes_in_use")}})


async def unpark(request: web.Request) -> web.Response:
    started = time.perf_counter()
    info = await request.app[SUPERVISOR].unpark()
    if info.get("already"):
        return web.json_response({"parked": False, "already": True, "context": info["context"]})
    return web.json_response({"parked": False, "seconds": round(time.perf_counter() - started, 3),
                              "context": info["context"], "weights_from": info.get("weights_from", "checkpoint")})


def create_app(engine: EngineConfig, options: ServerOptions) -> web.Application:
    if engine.model is None:
        raise ValueError("engine setting model is not set: the daemon serves a checkpoint directory")
    guard = ConnectionGuard(options.header_timeout, options.max_connections)
    app = web.Application(middlewares=[guard.middleware, error_middleware, auth_middleware],
                          client_max_size=options.max_body_bytes)
    app[OPTIONS], app[ENGINE_CONFIG], app[STARTED], app[GUARD] = options, engine, time.time(), guard
    app[PREPARER] = Preparer(engine.model, options.default_max_tokens)
    app[SUPERVISOR] = Supervisor(engine, model_name=options.model_name)
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/park", park)
    app.router.add_post("/unpark", unpark)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_routes(generate_api.routes)
    app.router.add_routes(openai_api.routes)
    app.cleanup_ctx.append(_engine_lifecycle)
    return app


async def _engine_lifecycle(app: web.Application):
    supervisor = app[SUPERVISOR]
    await asyncio.gather(supervisor.start(), app[PREPARER].start())
    idle = app[OPTIONS].park_after_idle
    watcher = asyncio.ensure_future(_park_when_idle(supervisor, idle, ParkLevel(app[OPTIONS].park_level))) \
        if idle else None
    yield
    if watcher is not None:
        watcher.cancel()
    app[PREPARER].close()
    await supervisor.stop()


async def _park_when_idle(supervisor: Supervisor, seconds: float, level: ParkLevel) -> None:
    """Park after `seconds` with no request in flight (the profile's park_after_idle), at the profile's level."""
    while True:
        await asyncio.sleep(min(seconds, 5.0))
        if supervisor.state is EngineState.READY and not supervisor.in_flight and \
                time.monotonic() - supervisor.last_activity >= seconds:
            try:
                await supervisor.park(level=level)
            except EngineUnavailable as err:       # e.g. the worker is restarting: try again later
                log.warning("the idle park did not happen: %s", err)
