"""A real qwen4exp server on loopback for tests: the aiohttp app in a background loop, a real worker process."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.server.app import SUPERVISOR, ServerOptions, create_app
from qwen4exp.server.serve import start_app

API_KEY, ADMIN_KEY = "test-api-key", "test-admin-key"


class Server:
    def __init__(self, checkpoint, context: int = 512, engine: dict | None = None, config: EngineConfig | None = None,
                 **server_options):
        """A server for `checkpoint` with small test settings (`engine` changes some), or for a whole `config`."""
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        if config is None:
            config = EngineConfig(**({"model": str(checkpoint), "device": "cpu", "dtype": "float32", "slots": 2,
                                      "max_ctx": context, "chunk": 32, "prefix_cache": True,
                                      "prefix_cache_limit": 64 << 20, "queue_limit": 4} | (engine or {})))
        options = ServerOptions(**({"model_name": "tiny", "api_key": API_KEY, "admin_key": ADMIN_KEY,
                                    "max_body_bytes": 1 << 20} | server_options))
        self.app = create_app(config, options)
        self.run(self._start())

    async def _start(self):
        # Port 0: the system picks a free one as the site binds (none can take it in between), read back here.
        self.runner = await start_app(self.app, "127.0.0.1", 0)
        self.port = self.runner.addresses[0][1]

    def run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def supervisor(self):
        return self.app[SUPERVISOR]

    def request(self, method, path, body=None, key=API_KEY, raw: bytes | None = None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json", **(headers or {})}
        if key:
            h["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=h)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        try:
            return response.status, json.loads(payload), response
        except json.JSONDecodeError:
            return response.status, payload.decode(), response

    def wait_state(self, state, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.supervisor.state == state:
                return
            time.sleep(0.05)
        raise AssertionError(f"state is {self.supervisor.state}, expected {state}")

    def close(self):
        self.run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)


