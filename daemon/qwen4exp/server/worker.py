"""The engine worker: a child process that owns the model, the engine and the prefix cache.

The daemon talks to it over one duplex pipe with small messages (token ids, not tensors), the dataclasses of
server/messages.py. A CUDA error is sticky in a CUDA context, so the daemon restarts the whole process when it dies.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

from ..engine.engine_config import EngineConfig
from .messages import (Cancel, Failed, Finished, Park, Parked, ParkLevel, Ready, RejectReason, Rejected, Result,
                       Stats, StatsQuery, Stop, Submit, Token, TokenLogprobs, Unpark, Unparked)

log = logging.getLogger("qwen4exp.worker")


class Worker:
    def __init__(self, config: EngineConfig, conn, fitted_context: int | None = None, plan: dict | None = None):
        self.config, self.conn = config, conn
        self.send_lock = threading.Lock()
        self.engine = None
        self.cache = None
        self.fitted_context = fitted_context
        self.requests: dict[str, object] = {}
        self.plan = plan                 # the context fit's plan, when max_ctx is "auto"
        self.parked_model = None         # the model, its weights in pinned host memory, while parked to "offload"
        self.hot_counts = None           # split layers' routing counts so far (engine/hot_experts.py), kept over parks
        self.step_costs = None           # what the speculative steps cost (engine/draft_length.py), kept over parks

    def send(self, message) -> None:
        with self.send_lock:
            self.conn.send(message)

    # ---- lifecycle --------------------------------------------------------------------------------
    def load(self) -> dict:
        import torch

        from ..engine import hot_experts
        from ..engine.engine import Engine
        from ..engine.offload import restore
        from ..tokenizer import Tokenizer

        started = time.perf_counter()
        config = self.config
        if self.parked_model is not None:
            device, model, self.parked_model = config.torch_device(), self.parked_model, None
            restore(model, device)
            # Before the fit, which counts their copies as the target's weights (load_model keeps them too).
            config.keep_hot_experts(model, self.hot_counts)
            weights_from = "host memory"
        else:
            device, model = config.load_model(hot_counts=self.hot_counts)
            weights_from = "checkpoint"
        # A context fitted before (by this worker before a park, or by the one before a restart) is kept: a new
        # fit could land elsewhere, and the snapshots and the clients count on the context.
        fitted_now = self.fitted_context is None and config.max_ctx == "auto"
        context = self.fitted_context or self._context(model, device)
        self.fitted_context = context
        self.config = config = config.as_loaded(model)
        if self.cache is None:
            self.cache = config.new_prefix_cache(model, device)
        self.engine = Engine.from_config(model, config, context=context, tokenizer=Tokenizer.from_path(config.model),
                                         prefix_cache=self.cache, step_costs=self.step_costs)
        # On a GPU, the kernels a prompt can launch are compiled now, not on the first requests' path.
        warm_up_seconds = self.engine.warm_up() if device.type == "cuda" else 0.0
        if config.hot_experts:
            hot_experts.count_while_serving(model)
        self.engine.start()
        return {"context": context, "plan": self.plan, "context_fitted_now": fitted_now, "ple": config.ple,
                "placement": None if config.placement is None else config.placement.to_json(),
                "hot_experts": hot_experts.describe(model),
                "load_seconds": round(time.perf_counter() - started, 3), "weights_from": weights_from,
                "warm_up_seconds": round(warm_up_seconds, 3),
                "device": str(device), "vocab_size": model.config.vocab_size,
                "gpu_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0}

    def _context(self, model, device) -> int:
        """The profile's number (checked), or the fit measured on this device for "auto"."""
        choice = self.config.resolve_context(model, device)
        if choice.fit is not None:
            log.info("fitted context %d tokens:\n%s", choice.context, choice.fit.plan.table())
            self.plan = choice.fit.plan.to_dict()
        return choice.context

    def park(self, level: ParkLevel) -> Parked:
        import gc

        import torch

        from ..engine import hot_experts
        from ..engine.offload import offload
        started = time.perf_counter()
        cuda = torch.cuda.is_available()
        before = torch.cuda.memory_allocated() if cuda else 0
        model = None
        if self.engine is not None:
            self.engine.stop()
            self.engine.abort_all()
            self.step_costs = self.engine.step_costs
            model, self.engine = self.engine.model, None
        if model is not None:
            self.hot_counts = hot_experts.add_counts(self.hot_counts, hot_experts.read_counts(model, stop=True))
            hot_experts.drop_hot(model)          # rebuilt on the target at the next load
        kept = 0
        if level is ParkLevel.OFFLOAD and model is not None:
            kept, self.parked_model = offload(model), model
        del model
        gc.collect()
        freed, in_use = 0, None
        if cuda:
            torch.cuda.empty_cache()
            freed = before - torch.cuda.memory_allocated()
            free, total = torch.cuda.mem_get_info()
            in_use = total - free
        return Parked(seconds=round(time.perf_counter() - started, 3), bytes_freed=freed, context=self.fitted_context,
                      level=level, host_bytes_kept=kept, device_bytes_in_use=in_use)

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, request_id: str, fields: dict) -> None:
        from ..engine.request import QueueFull, Request, RequestRejected
        from ..engine.sampling import SamplingParams

        if self.engine is None:
            self.send(Rejected(request_id, RejectReason.PARKED, "the engine is parked"))
            return
        try:
            request = Request(
                prompt_ids=list(fields["prompt_ids"]), max_tokens=fields["max_tokens"],
                sampling=SamplingParams.from_dict(fields.get("sampling", {})),
                stop_token_ids=tuple(fields.get("stop_token_ids", ())), stop=tuple(fields.get("stop", ())),
                logprobs=fields.get("logprobs"),
                on_token=lambda r, token, text: self.send(Token(r.id, token, text, self._last_logprobs(r))),
                on_finish=self._finished, id=request_id)
            self.requests[request_id] = request
            self.engine.submit(request)
        except (RequestRejected, ValueError) as err:
            self.requests.pop(request_id, None)
            reason = RejectReason.QUEUE_FULL if isinstance(err, QueueFull) else RejectReason.INVALID
            self.send(Rejected(request_id, reason, str(err)))

    def _token_logprobs(self, position) -> TokenLogprobs:
        as_bytes = self.engine.tokenizer.token_bytes
        return TokenLogprobs(as_bytes(position.token), position.logprob,
                             tuple((as_bytes(token), logprob) for token, logprob in position.top))

    def _last_logprobs(self, request) -> TokenLogprobs | None:
        return None if request.logprobs is None else self._token_logprobs(request.output_logprobs[-1])

    def _finished(self, request) -> None:
        self.requests.pop(request.id, None)
        logprobs = None if request.logprobs is None else [self._token_logprobs(p) for p in request.output_logprobs]
        self.send(Finished(request.id, Result(
            finish_reason=request.finish_reason.value, error=request.error, text=request.text,
            output_ids=request.output_ids, prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.cached_tokens, timings=request.timings(), logprobs=logprobs,
            mtp={"drafted": request.mtp_drafted, "accepted": request.mtp_accepted})))

    def stats(self) -> dict:
        engine = self.engine
        info = {"parked": engine is None, "context": self.fitted_context, "in_flight": len(self.requests)}
        if engine is not None:
            busy = engine.pool.busy()
            info.update(busy_slots=len(busy), slots=len(engine.pool.slots), queued=engine.queued, chunk=engine.chunk,
                        used_positions=sum(slot.state.length for slot in busy), loop=dict(vars(engine.counters)))
            drafter = engine.drafter
            info["mtp"] = {"drafts": drafter.most if drafter else 0, **(vars(drafter.counters) if drafter else {})}
        if self.cache is not None:
            info["prefix_cache"] = self.cache.stats()
        info["memory"] = _memory_in_use()
        return info

    # ---- the command loop -------------------------------------------------------------------------
    def serve(self) -> None:
        try:
            self.send(Ready(self.load()))
        except Exception as err:  # noqa: BLE001 - report why the engine could not start, then exit
            self.send(Failed(f"{type(err).__name__}: {err}", traceback.format_exc()))
            return
        while True:
            try:
                message = self.conn.recv()
            except EOFError:
                break
            if isinstance(message, Submit):
                self.submit(message.id, message.fields)
            elif isinstance(message, Cancel):
                if self.engine is not None:
                    self.engine.cancel(message.id)
            elif isinstance(message, Park):
                self.send(self.park(message.level))
            elif isinstance(message, Unpark):
                self.send(Unparked(self.load() if self.engine is None else {"context": self.fitted_context}))
            elif isinstance(message, StatsQuery):
                self.send(Stats(self.stats()))
            elif isinstance(message, Stop):
                break
            else:
                raise TypeError(f"the engine worker got an unknown message {message!r}")
        if self.engine is not None:
            self.engine.stop()


def _memory_in_use() -> dict:
    """Bytes the engine holds: on each visible GPU (allocated by torch) and the process's resident memory."""
    import torch
    out = {}
    if torch.cuda.is_available():
        out["gpu_bytes"] = {str(i): torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_bytes"] = int(line.split()[1]) * 1024
    return out


def worker_main(config: EngineConfig, conn, fitted_context: int | None, plan: dict | None) -> None:
    """Entry point of the child process: the engine `config` describes, at `fitted_context` when an earlier worker
    fitted one (with its `plan`)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[worker]: %(message)s")
    Worker(config, conn, fitted_context, plan).serve()
