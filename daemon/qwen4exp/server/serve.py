"""Run the daemon: the aiohttp app on host:port until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from .app import SUPERVISOR, ServerOptions, create_app
from .options import EngineOptions

log = logging.getLogger("qwen4exp.server")


async def serve(engine_options: EngineOptions, options: ServerOptions, host: str, port: int,
                on_ready=None) -> None:
    app = create_app(engine_options, options)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()                     # starts the engine worker (cleanup_ctx) and waits for it
    site = web.TCPSite(runner, host, port)
    await site.start()
    supervisor = app[SUPERVISOR]
    log.info("serving %s on http://%s:%d (engine %s, context %s)", engine_options.model, host, port,
             supervisor.state, supervisor.fitted_context)
    if on_ready is not None:
        on_ready(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
