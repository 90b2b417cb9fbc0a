"""A helper the engine-config tests share: the config the daemon starts a crashed worker's successor with."""

from __future__ import annotations

import asyncio

from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.server.messages import Ready
from qwen4exp.server.supervisor import Supervisor


def next_worker_config(config: EngineConfig, info: dict) -> EngineConfig:
    """The supervisor's config after a worker reported Ready(info) (what it starts the next worker with)."""
    supervisor = Supervisor(config)
    loop = asyncio.new_event_loop()
    supervisor._ready = loop.create_future()
    supervisor._dispatch(Ready(info))
    loop.close()
    return supervisor.config
