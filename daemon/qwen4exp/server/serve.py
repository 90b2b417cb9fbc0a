"""Run the daemon: the aiohttp app on host:port until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from ..engine.engine_config import EngineConfig
from .app import GUARD, SUPERVISOR, ServerOptions, create_app
from .connections import GuardedSite
from .errors import http_logger
from .sd_notify import Notifier

log = logging.getLogger("qwen4exp.server")


class ListenError(OSError):
    """The server's address could not be listened on (taken, or not this machine's)."""


async def start_app(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start the engine worker (the app's cleanup_ctx) and wait for it, then listen on host:port."""
    # handler_cancellation: a client that goes away cancels its handler, and with it its request in the engine,
    # whether it was streaming, waiting for a JSON answer or still queued.
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           logger=http_logger())
    await runner.setup()
    try:
        await GuardedSite(runner, app[GUARD], host, port).start()
    except OSError as err:
        await runner.cleanup()             # the worker it started goes with it
        raise ListenError(f"cannot listen on {host}:{port} (server.host, server.port): {err.strerror or err}") \
            from None
    return runner


async def serve(engine: EngineConfig, options: ServerOptions, host: str, port: int, on_ready=None) -> None:
    notifier = Notifier()
    notifier.notify(STATUS=f"loading {engine.model}")
    app = create_app(engine, options)
    runner = await start_app(app, host, port)
    supervisor = app[SUPERVISOR]
    log.info("serving %s on http://%s:%d (engine %s, context %s)", engine.model, host, port,
             supervisor.state, supervisor.fitted_context)
    notifier.notify(READY=1, STATUS=f"serving on {host}:{port}, context {supervisor.fitted_context}")
    if on_ready is not None:
        on_ready(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.ensure_future(_watchdog(notifier, supervisor)) if notifier.watchdog_interval() else None
    try:
        await stop.wait()
    finally:
        notifier.notify(STOPPING=1)
        if watchdog is not None:
            watchdog.cancel()
        await runner.cleanup()


async def _watchdog(notifier: Notifier, supervisor) -> None:
    """Ping while the event loop runs; report the engine's state in STATUS= as it changes."""
    last = None
    while True:
        notifier.notify(WATCHDOG=1)
        if supervisor.state != last:
            last = supervisor.state
            notifier.notify(STATUS=f"engine {last}, context {supervisor.fitted_context}")
        await asyncio.sleep(notifier.watchdog_interval())
