"""The daemon's handle on the engine worker: start it, talk to it, park it, and bring it back if it dies.

Runs inside the aiohttp event loop. A reader thread turns the worker's messages into calls on the loop, and one
sender thread writes to the worker's pipe in the order the loop asked (a large prompt's message would block the
loop while the pipe drains; one thread keeps a cancel behind the submit it cancels).
If the worker dies while serving, every request in flight fails with a clear error, /health says so, and a new
worker starts at the same fitted context (no new fit). If it dies while parked, the daemon stays parked (the
operator gave the GPU away) and the next unpark starts a worker at the same context.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..engine.engine_config import EngineConfig
from ..engine.placement import Placement
from .errors import EngineUnavailable
from .messages import (Cancel, EngineState, Failed, Finished, Park, Parked, ParkLevel, Ready, Rejected, Stats,
                       StatsQuery, Stop, Submit, Token, Unpark, Unparked)
from .metrics import RequestMetrics
from .worker import worker_main

log = logging.getLogger("qwen4exp.supervisor")


@dataclass(frozen=True)
class Lost:
    """The worker died with the request in flight."""
    message: str


@dataclass
class Stream:
    """One request's events as they arrive: Token ... then Finished, or Rejected, or Lost."""
    id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # For /metrics (server/metrics.py): when the supervisor sent it and got its latest token (perf_counter).
    submitted_at: float = 0.0
    last_token_at: float | None = None
    prompt_tokens: int = 0
    max_tokens: int | None = None


class Supervisor:
    def __init__(self, config: EngineConfig, restart_delay: float = 1.0, model_name: str = "qwen4exp"):
        self.config = config
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.info: dict = {}
        self.fitted_context: int | None = None
        self.restarts = 0
        self.last_activity = time.monotonic()
        self.counters = {"generated_tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "requests": 0}
        # vLLM's metrics, labelled with the served model name (`model_name`), in this app's own registry.
        self.metrics = RequestMetrics(model_name, prefix_cache=bool(config.prefix_cache))
        self._ctx = multiprocessing.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, Stream] = {}
        # The worker answers each kind of question in the order it was asked: one FIFO of waiters per reply type.
        self._replies: dict[type, collections.deque[asyncio.Future]] = collections.defaultdict(collections.deque)
        self._ready: asyncio.Future | None = None
        self._ids = itertools.count(1)
        self._process = self._conn = None
        self._stopping = False
        self._restart_delay = restart_delay
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen4exp-send")
        self._transition = asyncio.Lock()      # one park or unpark at a time

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        self.state = EngineState.LOADING
        self._ready = self._loop.create_future()
        parent, child = self._ctx.Pipe()
        self._process = self._ctx.Process(target=worker_main, name="qwen4exp-engine", daemon=True,
                                          args=(self.config, child, self.fitted_context, self.info.get("plan")))
        self._process.start()
        child.close()
        self._conn = parent
        threading.Thread(target=self._read, args=(parent, self._process), daemon=True).start()
        await self._ready

    async def stop(self) -> None:
        self._stopping = True
        if self._process is not None and self._process.is_alive():
            try:
                self._send(Stop())
            except EngineUnavailable:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        self._conn = None                  # nothing is sent after this: a late cancel is a no-op
        self._sender.shutdown(wait=False)

    def _send(self, message) -> None:
        """Queue a message for the worker; the sender thread writes it after every message queued before."""
        conn = self._conn
        if conn is None:
            raise EngineUnavailable("the engine worker is not running")
        self._sender.submit(self._write, conn, message)

    @staticmethod
    def _write(conn, message) -> None:
        try:
            conn.send(message)
        except OSError:
            pass          # the worker is gone: the reader thread reports its death and fails what was in flight

    # ---- the reader thread ------------------------------------------------------------------------
    def _read(self, conn, process) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._dispatch, message)
        process.join()
        self._loop.call_soon_threadsafe(self._worker_died, process.exitcode)

    def _dispatch(self, message) -> None:
        if isinstance(message, Token):
            self.counters["generated_tokens"] += 1
            stream = self._streams.get(message.id)
            if stream is not None:
                self.metrics.token(stream, time.perf_counter())
                stream.queue.put_nowait(message)
        elif isinstance(message, (Finished, Rejected)):
            stream = self._streams.pop(message.id, None)
            if isinstance(message, Finished):
                self.counters["requests"] += 1
                self.counters["prompt_tokens"] += message.result.prompt_tokens
                self.counters["cached_prompt_tokens"] += message.result.cached_tokens
                if stream is not None:
                    self.metrics.finished(stream, message.result, time.perf_counter())
            if stream is not None:
                stream.queue.put_nowait(message)
        elif isinstance(message, Ready):
            self.info = message.info
            self.fitted_context = self.info["context"]
            if self.config.ple == "auto" and self.info.get("ple") in ("host", "device"):
                # Where the fit put the PLE table: a restarted worker keeps the context, so the table too.
                self.config = dataclasses.replace(self.config, ple=self.info["ple"])
            if self.config.placement is None and self.info.get("placement") is not None:
                # Where the layers went, for the same reason.
                self.config = dataclasses.replace(self.config,
                                                  placement=Placement.from_json(self.info["placement"]))
            self.metrics.set_context(self.fitted_context)
            self.state, self.error = EngineState.READY, None
            if not self._ready.done():
                self._ready.set_result(self.info)
        elif isinstance(message, Failed):
            self.state, self.error = EngineState.ERROR, message.error
            log.error("the engine failed to start: %s\n%s", message.error, message.trace)
            if not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(message, (Parked, Unparked, Stats)):
            waiters = self._replies.get(type(message))
            future = waiters.popleft() if waiters else None
            if future is not None and not future.done():
                future.set_result(message)
        else:
            log.error("the engine worker sent an unknown message %r", message)

    def _worker_died(self, exitcode: int | None) -> None:
        if self._stopping:
            return
        self._conn = None
        reason = f"the engine worker exited unexpectedly (exit code {exitcode})"
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)      # it died while loading: whoever waits for it gets an answer
        for stream in self._streams.values():
            stream.queue.put_nowait(Lost(f"{reason}; the request was lost and can be sent again"))
        self._streams.clear()
        for future in (f for waiters in self._replies.values() for f in waiters):
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        self._replies.clear()
        if self.state is EngineState.ERROR and self.fitted_context is None:
            return                       # it never came up: do not loop on a broken configuration
        if self.state in (EngineState.PARKED, EngineState.PARKING):
            # The GPU was given away: a new worker would take it back. The next unpark starts one.
            log.warning("%s while parked; it starts again at the next unpark (context %s)", reason,
                        self.fitted_context)
            self.state = EngineState.PARKED
            return
        log.error("%s; restarting it at context %s", reason, self.fitted_context)
        self.state, self.error = EngineState.ERROR, reason
        self.restarts += 1
        self._loop.call_later(self._restart_delay, lambda: asyncio.ensure_future(self._spawn()))

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, fields: dict) -> Stream:
        if self.state is not EngineState.READY:
            raise EngineUnavailable(f"the engine is {self.state}" + (f": {self.error}" if self.error else ""))
        self.last_activity = time.monotonic()
        stream = Stream(f"r{next(self._ids)}", prompt_tokens=len(fields.get("prompt_ids", ())),
                        max_tokens=fields.get("max_tokens"))
        self._streams[stream.id] = stream
        stream.submitted_at = time.perf_counter()
        self._send(Submit(stream.id, fields))
        return stream

    def cancel(self, stream: Stream) -> None:
        if stream.id in self._streams and self._conn is not None:
            self._send(Cancel(stream.id))

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def _call(self, question, reply: type, timeout: float = 600.0):
        future = self._loop.create_future()
        self._replies[reply].append(future)
        self._send(question)
        return await asyncio.wait_for(future, timeout)

    async def stats(self) -> dict:
        if self.state not in (EngineState.READY, EngineState.PARKED):
            return {}
        return (await self._call(StatsQuery(), Stats, timeout=10)).info

    async def park(self, mode: str = "wait", level: ParkLevel = ParkLevel.RELEASE) -> dict:
        """Free the GPU: "wait" lets the requests in flight finish (new ones get 503 meanwhile), "abort" cancels
        them; `level` says whether the weights are kept in host memory for a fast unpark. Runs to its end even if
        the caller goes away, so the state always says what the worker did."""
        return await asyncio.shield(asyncio.ensure_future(self._park(mode, level)))

    async def _park(self, mode: str, level: ParkLevel) -> dict:
        async with self._transition:
            if self.state is EngineState.PARKED:
                return {"already": True, "bytes_freed": 0, "context": self.fitted_context}
            if self.state is not EngineState.READY:
                raise EngineUnavailable(f"the engine is {self.state}; it cannot be parked now")
            self.state = EngineState.PARKING
            try:
                while mode == "wait" and self._streams and self._conn is not None:
                    await asyncio.sleep(0.02)
                parked = await self._call(Park(level), Parked)
                info = {"bytes_freed": parked.bytes_freed, "context": parked.context, "level": str(parked.level),
                        "host_bytes_kept": parked.host_bytes_kept, "device_bytes_in_use": parked.device_bytes_in_use}
            except EngineUnavailable:
                if self._conn is not None:
                    self.state = EngineState.READY
                    raise
                # The worker died on the way: nothing holds the GPU, which is what a park is for.
                info = {"bytes_freed": None, "context": self.fitted_context, "level": str(ParkLevel.RELEASE),
                        "host_bytes_kept": 0, "device_bytes_in_use": None}
            except BaseException:
                if self.state is EngineState.PARKING:
                    self.state = EngineState.READY
                raise
            self.state = EngineState.PARKED
            return info

    async def unpark(self) -> dict:
        """Serve again at the fitted context; a worker that died while parked is started anew."""
        return await asyncio.shield(asyncio.ensure_future(self._unpark()))

    async def _unpark(self) -> dict:
        async with self._transition:
            if self.state is EngineState.READY:
                return {"already": True, "context": self.fitted_context}
            if self.state is not EngineState.PARKED:
                raise EngineUnavailable(f"the engine is {self.state}; nothing to unpark")
            if self._conn is None:
                await self._spawn()
                if self.state is not EngineState.READY:
                    raise EngineUnavailable(f"the engine worker did not start: {self.error}")
                return {"context": self.fitted_context, "restarted": True}
            info = (await self._call(Unpark(), Unparked)).info
            self.state = EngineState.READY
            return info

    def kill_worker(self) -> None:
        """For tests and operators: end the worker abruptly (as a crash would)."""
        if self._process is not None:
            self._process.kill()
