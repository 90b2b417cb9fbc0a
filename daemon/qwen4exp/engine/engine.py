"""The serving engine: N exact slots, chunked prefill interleaved with batched decode.

One step reads in three lines: schedule (cancellations, admissions), run (one prompt chunk in its own
forward, then one decode forward over all N rows), postprocess (sample, stream, finish).
Exactness: every prompt is cut at multiples of `chunk` from position 0 and each chunk runs alone, and
decode always runs all N rows at one shape (idle rows masked; a CUDA graph on GPUs), so a request's
numbers never depend on its neighbours.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from array import array
from dataclasses import dataclass

import numpy
import torch

from .decode_runner import DecodeRunner, LaunchedStep
from .draft_length import StepCosts
from .engine_config import MAX_SLOTS, EngineConfig, resolve_mtp
from .memory import is_out_of_memory, release_cached_blocks, run_with_oom_retry
from .model.causal_lm import Qwen4ExpForCausalLM
from .prefix_cache import PrefixCache
from .request import MAX_TOP_LOGPROBS, FinishReason, PositionLogprobs, QueueFull, Request, RequestRejected
from .sampling import Sampler
from .slots import Slot, SlotPool
from .stops import StopMatcher
from .speculative import Drafter
from .warm_up import warm_up

log = logging.getLogger("qwen4exp.engine")

# A prompt chunk of up to this many rows is bound, or nearly, by the host's launches: on the H200 a 128-token one
# keeps the device busy 13 of its 18.5 ms (docs/PERFORMANCE.md, short prompts). Such chunks get decode steps
# between their layers (decode_beside_prompts), and a prompt this short leaves its few temporaries cached for the
# next one.
SHORT_CHUNK_ROWS = 512


@dataclass
class EngineCounters:
    """What the loop ran since the engine was made; /metrics shows them (prompt_chunks / prompt_forwards is how
    many slots' chunks a prompt forward ran together, with batch_prompts)."""
    prompt_forwards: int = 0           # forwards of prompt chunks that completed (one chunk, or a batch of them)
    prompt_chunks: int = 0             # prompt chunks those forwards ran
    decode_steps: int = 0              # decode steps launched
    decode_steps_beside_prompts: int = 0   # ... of them between a prompt forward's layers


@dataclass
class _PromptChunk:
    """One slot's next prompt chunk in a prefill forward, and its carried state from before (for a retry)."""
    slot: Slot
    request: Request
    begin: int
    end: int
    ids: torch.Tensor
    saved: list[torch.Tensor]


def _ids_in_range(ids, vocab: int) -> bool:
    """Whether every id is an integer in [0, vocab), through a typed array: a check per element took 0.6 ms for
    a 16K-token prompt on a CPU here (0.4 ms this way), out of the 3.8 ms a resent prompt waits for its first
    token on the H200."""
    try:
        values = numpy.frombuffer(array("q", ids), dtype=numpy.int64)
    except (TypeError, OverflowError):
        return False
    return bool(values.min() >= 0 and values.max() < vocab)


def _position_logprobs(logits: torch.Tensor, token: int, top: int) -> PositionLogprobs:
    """The chosen token's log-probability and the `top` most likely tokens', from a position's raw logits."""
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)
    values, ids = torch.topk(logprobs, top)
    chosen = float(logprobs[token])
    ranked = sorted(zip(ids.tolist(), values.tolist()), key=lambda pair: (-pair[1], pair[0]))
    return PositionLogprobs(token, chosen, tuple(ranked))


class Engine:
    def __init__(self, model: Qwen4ExpForCausalLM, slots: int = 4, context: int = 4096, chunk: int = 512,
                 restore_spacing: int | None = None, queue_limit: int = 64, tokenizer=None,
                 prefix_cache: PrefixCache | None = None, cuda_graphs: bool = True, compile_decode: bool = False,
                 decode_beside_prompts: bool = False, batch_prompts: bool = False, mtp: int | str = 0,
                 mtp_adaptive: bool = True, step_costs: StepCosts | None = None):
        cfg = model.config
        spacing = restore_spacing or (prefix_cache.spacing if prefix_cache is not None else chunk)
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be between 1 and {MAX_SLOTS}, got {slots}")
        if spacing % cfg.indexer_compress_ratio or chunk % spacing:
            raise ValueError(f"chunk ({chunk}) must be a multiple of the restore spacing ({spacing}), itself a "
                             f"multiple of the QSA compress ratio ({cfg.indexer_compress_ratio})")
        if prefix_cache is not None:
            if prefix_cache.spacing != spacing:
                raise ValueError(f"the prefix cache's restore spacing ({prefix_cache.spacing}) differs from the "
                                 f"engine's ({spacing})")
            # Snapshots sit at chunk ends; a warm run replays the cold grid only with the same chunk size.
            if prefix_cache.chunk not in (None, chunk):
                raise ValueError(f"the prefix cache holds snapshots cut at chunk {prefix_cache.chunk}; "
                                 f"this engine cuts at {chunk}")
            prefix_cache.chunk = chunk
        self.prefix_cache = prefix_cache
        self.model, self.context, self.chunk, self.restore_spacing = model, context, chunk, spacing
        self.tokenizer = tokenizer
        self.device = model.lm_head.weight.device
        # A split model's other devices (placement.py): their cached blocks go back with the target's.
        self._split_devices = [] if model.placement is None else model.placement.devices[1:]
        self.pool = SlotPool.allocate(model, slots, context)
        # Speculative decoding with the MTP head (speculative.py): mtp drafts at most per slot and step; "auto": as
        # many as pay where the backend verifies positions together, none where it runs them one by one. With
        # drafting every decode step is a speculative one (its own graphs), so the plain step is not captured.
        drafts = resolve_mtp(mtp, model)
        self.decoder = DecodeRunner(model, self.pool.states, self.device, graph=cuda_graphs and not drafts,
                                    compile=compile_decode)
        self.drafter = Drafter(model, self.pool, self.decoder.rope, drafts, mtp_adaptive, graphs=cuda_graphs,
                               costs=step_costs) if drafts else None
        # Decode steps between a short prompt chunk's layers (`_decode_beside`): for a GPU, where such a chunk keeps
        # the host busy and the device mostly idle; on a CPU they would only take turns with the chunk's work.
        # An eager step on a GPU allocates its temporaries; beside a chunk's it could run the device out of memory.
        # With drafting, each step needs its tokens before the next is drafted: no steps beside prompts.
        self.decode_beside_prompts = decode_beside_prompts and self.drafter is None and (
            self.decoder.graph is not None or self.device.type != "cuda")
        # Several slots' prompt chunks in one forward (`_prefill`), each computed as alone; on a GPU they share the
        # routed experts' weight reads, which a short prompt's chunk spends most of its device time on.
        self.batch_prompts = batch_prompts
        self._launched: tuple[LaunchedStep, list[Slot]] | None = None
        self.counters = EngineCounters()
        self.queue_limit = queue_limit
        self._queue: collections.deque[Request] = collections.deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._prefill_turn = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def from_config(cls, model: Qwen4ExpForCausalLM, config: EngineConfig, *, context: int | None = None,
                    tokenizer=None, prefix_cache: PrefixCache | None = None,
                    step_costs: StepCosts | None = None) -> "Engine":
        """The engine `config` describes, over `model` (loaded by the caller, e.g. with `config.load_model`).
        `context`: the resolved context (`config.resolve_context`), needed when max_ctx is "auto"; a number
        in the config is taken as it is. `prefix_cache`: the caller's, since it outlives the engine.
        `step_costs`: the speculative step's costs an engine of this config measured before (`step_costs`)."""
        if context is None:
            if config.max_ctx == "auto":
                raise ValueError("max_ctx is 'auto': resolve the context first (EngineConfig.resolve_context) and "
                                 "pass it as context=")
            context = config.max_ctx
        return cls(model, slots=config.slots, context=context, chunk=config.chunk,
                   restore_spacing=config.restore_spacing, queue_limit=config.queue_limit, tokenizer=tokenizer,
                   prefix_cache=prefix_cache, cuda_graphs=config.cuda_graphs, compile_decode=config.compile_decode,
                   decode_beside_prompts=config.decode_beside_prompts, batch_prompts=config.batch_prompts,
                   mtp=config.mtp, step_costs=step_costs)

    @property
    def step_costs(self) -> StepCosts | None:
        """What the drafter prices its speculative steps by (measured from its graphs, or given; None without
        drafting or off graphs): for an engine built again over the same model and device (an unpark), which then
        need not measure them."""
        return None if self.drafter is None else self.drafter.length.costs

    def warm_up(self) -> float:
        """Compile every kernel a prompt can launch, on the first slot, before serving (warm_up.py); the
        seconds it took."""
        if self.pool.busy() or self._thread is not None:
            raise RuntimeError("warm the engine up before it serves")
        started = time.perf_counter()
        if self.prefix_cache is not None:       # requests run before (tests, benches) may still be copying it
            self.prefix_cache.wait_for_captures(self.pool.slots[0].state)
        warm_up(self.model, self.pool.slots[0].state, self.chunk, self.device, drafting=self.drafter is not None)
        return time.perf_counter() - started

    # ---- submission (any thread) -------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        self._validate(request)
        with self._lock:
            if len(self._queue) >= self.queue_limit:
                raise QueueFull(f"the queue is full ({self.queue_limit} requests waiting)")
            self._queue.append(request)
        self._wake.set()
        return request

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; its slot is free after the step in progress."""
        with self._lock:
            self._cancelled.add(request_id)
        self._wake.set()

    def _validate(self, request: Request) -> None:
        vocab = self.model.config.vocab_size
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestRejected("the prompt has no tokens")
        if request.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestRejected(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.logprobs}")
        if not _ids_in_range(request.prompt_ids, vocab):
            bad = [t for t in request.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if n + request.max_tokens > self.context:
            raise RequestRejected(f"prompt of {n} tokens + max_tokens {request.max_tokens} = "
                                  f"{n + request.max_tokens} exceeds the context of {self.context} tokens")
        if request.stop:
            if self.tokenizer is None:
                raise RequestRejected("stop strings need a tokenizer; this engine has none")
            try:
                StopMatcher(list(request.stop))
            except ValueError as err:
                raise RequestRejected(f"stop: {err}") from None

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def abort_all(self) -> None:
        """Cancel every queued and running request now (call with the loop stopped)."""
        with self._lock:
            waiting, self._queue = list(self._queue), collections.deque()
        for request in waiting:
            self._finish(None, request, FinishReason.CANCELLED)
        for slot in self.pool.busy():
            self._finish(slot, slot.request, FinishReason.CANCELLED)

    # ---- the loop ---------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._queue and not self.pool.busy()

    def step(self) -> None:
        self._schedule()
        self._prefill()
        self._decode()

    def run_until_idle(self) -> None:
        while not self.idle:
            self.step()

    def start(self) -> None:
        """Run steps on a background thread until stop()."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="qwen4exp-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self.prefix_cache is not None:       # the snapshots' copies read the slots, which may be freed next
            self.prefix_cache.finish_captures()

    def _loop(self) -> None:
        if self.device.type == "cuda":      # a thread's current device is its own: Triton launches there
            torch.cuda.set_device(self.device)
        while not self._stopping:
            if self.idle:
                self._wake.wait(0.05)
                self._wake.clear()
                with self._lock:
                    pending_cancel = bool(self._cancelled)
                if pending_cancel:
                    self._schedule()
                continue
            self.step()

    # ---- schedule ---------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """Cancellations first (so their slots are free at once), then admissions in FIFO order."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [r for r in self._queue if r.id in cancelled]
            self._queue = collections.deque(r for r in self._queue if r.id not in cancelled)
        for request in dropped:
            self._finish(None, request, FinishReason.CANCELLED)
        for slot in self.pool.busy():
            if slot.request.id in cancelled:
                self._finish(slot, slot.request, FinishReason.CANCELLED)
        for slot in self.pool.free():
            with self._lock:
                if not self._queue:
                    break
                request = self._queue.popleft()
            try:
                self._start(slot, request)
            except Exception as err:  # noqa: BLE001 - a request that cannot start fails alone
                log.exception("could not start %s", request.id)
                self._finish(slot, request, FinishReason.ERROR, f"{type(err).__name__}: {err}")

    def _start(self, slot: Slot, request: Request) -> None:
        if self.prefix_cache is not None:       # the last request's snapshots may still be copying the slot's prefix
            self.prefix_cache.wait_for_captures(slot.state)
        slot.state.reset()
        slot.request = request
        request.slot = slot.index
        restored_logits = None
        if self.prefix_cache is not None:
            slot.prefilled, restored_logits = self.prefix_cache.restore_longest(request.prompt_ids, slot.state)
            request.cached_tokens = slot.prefilled
        slot.sampler = Sampler(request.sampling, request.prompt_ids)
        if self.drafter is not None:
            self.drafter.start(slot)
        if self.tokenizer is not None:
            slot.detokenizer = self.tokenizer.detokenizer()
            if request.stop:
                slot.stops = StopMatcher(list(request.stop))
        request.started_at = time.perf_counter()
        if restored_logits is not None:       # the whole prompt was cached: its first token needs no forward
            self._accept(slot, slot.sampler(restored_logits), restored_logits)

    # ---- run --------------------------------------------------------------------------------------
    def _prefill(self) -> None:
        """The next chunk of one prefilling slot (round-robin), in its own forward; with `batch_prompts`, also the
        next chunks of the slots after it in turn, while all their rows fit one chunk, in the same forward (each
        chunk's numbers are the ones it gets alone: model.forward_chunks)."""
        count = len(self.pool.slots)
        waiting = sorted((s for s in self.pool.slots if s.busy and s.next_token is None),
                         key=lambda s: (s.index - self._prefill_turn) % count)
        chunks: list[_PromptChunk] = []
        rows = 0
        for slot in waiting if self.batch_prompts else waiting[:1]:
            end = min(len(slot.request.prompt_ids), (slot.prefilled // self.chunk + 1) * self.chunk)
            if chunks and rows + end - slot.prefilled > self.chunk:
                break
            try:
                chunks.append(self._prompt_chunk(slot, end))
            except Exception as err:  # noqa: BLE001 - this request fails, or (out of memory) waits its turn
                if chunks and is_out_of_memory(err):
                    break
                log.exception("prefill failed for %s", slot.request.id)
                self._finish(slot, slot.request, FinishReason.ERROR, f"{type(err).__name__}: {err}")
                continue
            rows += end - slot.prefilled
            self._prefill_turn = slot.index + 1
        if not chunks:
            return
        release = False
        for chunk, outcome in zip(chunks, self._run_chunks(chunks)):
            release |= self._after_chunk(chunk, outcome)
        if release:
            # A long prompt's chunk temporaries go back to the device once the prompt is done; between its
            # chunks the allocator keeps them for the next chunk, which needs the same blocks (emptying after
            # every chunk cost a device synchronisation and the blocks' allocation again). A short prompt's are
            # kept for the next prompt, for the same reason.
            for device in (self.device, *self._split_devices):
                release_cached_blocks(device)

    def _prompt_chunk(self, slot: Slot, end: int) -> "_PromptChunk":
        ids = torch.tensor(slot.request.prompt_ids[slot.prefilled:end], dtype=torch.long)
        if self.device.type == "cuda":   # from pinned memory, so the host need not wait for the device
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        # The carried state before the chunk: a retry (after running out of memory, or alone after its batch
        # failed) starts from it.
        return _PromptChunk(slot, slot.request, slot.prefilled, end, ids, [t.clone() for t in slot.state.carried()])

    def _run_chunks(self, chunks: list["_PromptChunk"]) -> list[torch.Tensor | tuple | str]:
        """Each chunk's last logits (with a drafter: and its streams), or the error it failed with (logged here; a
        message, so that nothing of the failed forward outlives this call). A batch that fails runs again chunk by
        chunk, so that a failure costs only its own request."""
        beside = None
        # Several short chunks keep the host busier still than one: the steps go beside any batch of them.
        if self.decode_beside_prompts and max(c.end - c.begin for c in chunks) <= SHORT_CHUNK_ROWS:
            beside = functools.partial(self._decode_beside, {c.slot.index: c.end for c in chunks})

        def run(group: list[_PromptChunk]) -> list[torch.Tensor]:
            def attempt() -> list[torch.Tensor]:
                for chunk in group:
                    for target, copy in zip(chunk.slot.state.carried(), chunk.saved):
                        target.copy_(copy)
                    chunk.slot.state.length = chunk.begin
                if self.drafter is not None:        # the MTP head reads the chunks' streams
                    return self.model.forward_chunks_with_streams([(c.ids, c.slot.state) for c in group])
                if len(group) == 1:      # through the module's call, as hooks and benches expect it
                    return [self.model(group[0].ids, group[0].slot.state, between_layers=beside)]
                return self.model.forward_chunks([(c.ids, c.slot.state) for c in group], between_layers=beside)
            what = "; ".join(f"the prompt chunk {c.begin}..{c.end} of {c.request.id}" for c in group)
            logits = run_with_oom_retry(attempt, self.device, what, also=self._split_devices)
            self.counters.prompt_forwards += 1
            self.counters.prompt_chunks += len(group)
            return logits

        def alone(chunk: _PromptChunk) -> torch.Tensor | str:
            try:
                return run([chunk])[0]
            except Exception as err:  # noqa: BLE001 - _after_chunk fails this request only
                log.exception("prefill failed for %s", chunk.request.id)
                return f"{type(err).__name__}: {err}"

        try:
            if len(chunks) == 1:
                return [alone(chunks[0])]
            try:
                return run(chunks)
            except Exception:  # noqa: BLE001 - one chunk's fault must not fail the others
                log.exception("%d prompt chunks failed together; running each alone", len(chunks))
            return [alone(chunk) for chunk in chunks]
        finally:
            self._finish_decode()
            for chunk in chunks:
                chunk.saved.clear()        # the copies for a retry are done with

    def _after_chunk(self, chunk: "_PromptChunk", outcome: torch.Tensor | str) -> bool:
        """Snapshot, and the first token if the prompt is done. Returns whether a long prompt ended here."""
        slot, request, end = chunk.slot, chunk.request, chunk.end
        if isinstance(outcome, str):
            self._finish(slot, request, FinishReason.ERROR, outcome)
            return False
        try:
            logits = outcome
            if self.drafter is not None:
                logits, streams = outcome
                self.drafter.after_prompt_chunk(slot, chunk.ids, streams, chunk.begin)
            slot.prefilled = end
            snapshot = self.prefix_cache is not None and self._keeps_snapshot_at(end, len(request.prompt_ids))
            if end < len(request.prompt_ids):
                if snapshot:
                    self.prefix_cache.capture(request.prompt_ids[:end], slot.state, logits)
                return False
            # The first token goes out before the prompt's last snapshot is taken (its whole-state tensors are
            # copied on the prompt's stream); nothing runs on the slot in between, so the snapshot is the same.
            self._accept(slot, slot.sampler(logits), logits)
            if snapshot:
                self._capture_after_first_token(request, end, slot, logits)
            return end > SHORT_CHUNK_ROWS
        except Exception as err:  # noqa: BLE001 - an engine error fails this request only
            log.exception("prefill failed for %s", request.id)
            self._finish(slot, request, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            return False

    def _keeps_snapshot_at(self, end: int, prompt_length: int) -> bool:
        """Whether a prompt prefilled up to `end` is snapshotted there: at 1, 2, 4, 8... chunks (shareable
        prefixes at every scale, so a long prompt costs O(log n) snapshots), at its last point on the chunk grid
        (the one a continued prompt restores) and at its end when that is a restore point off the grid (restore
        spacing below the chunk: the one a prompt resent whole restores; a longer prompt cannot continue from it,
        since its cold run cuts no chunk there: PrefixCache.restore_longest). Not at the points between: each
        capture copies the whole prefix's K/V, and capturing them all cost 2.5 s of a 262144-token prompt's first
        token."""
        if end % self.restore_spacing:
            return False
        chunks, rest = divmod(end, self.chunk)
        if rest:                            # off the grid: only a prompt's last chunk ends there
            return end == prompt_length
        return chunks & (chunks - 1) == 0 or prompt_length - end < self.chunk

    def _capture_after_first_token(self, request: Request, end: int, slot: Slot, logits: torch.Tensor) -> None:
        """The prompt's last snapshot. Its request has its first token (it may even be finished), so a failure
        here is logged and costs only the snapshot."""
        try:
            self.prefix_cache.capture(request.prompt_ids[:end], slot.state, logits)
        except Exception:  # noqa: BLE001 - a snapshot is an optimisation; the request stands
            log.exception("the last prefix snapshot of %s was not taken", request.id)

    def _decode(self) -> None:
        if self.drafter is not None:
            self._decode_speculative()
            return
        self._launch_decode()
        self._finish_decode()

    def _decode_speculative(self) -> None:
        """One step with drafts (speculative.py): draft, verify, then each slot's positions sampled in order, as
        plain decoding samples them, until one differs from the draft after it."""
        decoding = [s for s in self.pool.slots if s.decoding]
        if not decoding:
            return
        try:
            queued = self.drafter.draft(decoding)
            logits, streams = self.drafter.verify(decoding, queued)
            # The host's one wait of the step: the verify step's argmax, the drafts behind it.
            best = logits.argmax(-1).tolist() if any(s.sampler.takes_argmax for s in decoding) else None
            drafts = queued.lists()
        except Exception as err:  # noqa: BLE001 - the batch failed: fail its requests, keep serving
            log.exception("decode step failed")
            for slot in decoding:
                self._finish(slot, slot.request, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            return
        self.counters.decode_steps += 1
        kept: dict[int, int] = {}
        for slot in decoding:
            request, proposed, taken = slot.request, drafts[slot.index], 0
            try:
                while True:
                    row = logits[taken, slot.index]
                    sampler = slot.sampler
                    token = sampler.take(best[taken][slot.index]) if sampler.takes_argmax else sampler(row)
                    taken += 1
                    slot.state.length += 1
                    self._accept(slot, token, row)
                    if not slot.busy or taken > len(proposed) or token != proposed[taken - 1]:
                        break
            except Exception as err:  # noqa: BLE001
                log.exception("sampling failed for %s", request.id)
                self._finish(slot, request, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            accepted = max(taken - 1, 0)
            request.mtp_drafted += len(proposed)
            request.mtp_accepted += accepted
            self.drafter.count(len(proposed), accepted)
            if slot.busy:
                kept[slot.index] = taken
        self.drafter.commit(kept, streams, drafts)

    def _decode_beside(self, chunk_ends: dict[int, int]) -> None:
        """Between two layers of a prompt forward (the chunk of each slot index in `chunk_ends` ends there): take
        the launched decode step's tokens if the device is done with it, then launch the next one. The device runs
        each step while the host queues the chunks' next layers; every row's computation is the one a step between
        chunks makes, so no token changes. A prompt's slot is an idle row of these steps: its scratch writes go to
        its chunk's end, past the chunk."""
        if self._launched is not None and not self._launched[0].done():
            return
        # Each row's token must come from the batch argmax or from a host copy of its logits (the same bits; sampling
        # moves them to the host anyway). A penalised greedy row or one with log-probabilities computes on the
        # device's logits, which would make the host wait for the chunk's queued layers at every boundary: with
        # one of those decoding, the steps wait for the chunk's end.
        if any(s.request.logprobs is not None or (s.sampler.params.greedy and s.sampler.params.penalized)
               for s in self.pool.slots if s.decoding):
            return
        with torch.inference_mode(False):       # what the steps make outlives the chunk's inference mode
            self._finish_decode()
            self._launch_decode(chunk_ends, host_sampling=True)

    def _launch_decode(self, idle_positions: dict[int, int] | None = None, host_sampling: bool = False) -> None:
        """Queue one decode step over every decoding slot (advancing their lengths); its tokens are taken by
        `_finish_decode`. An idle row's position-indexed writes land at its length, or at `idle_positions`.
        `host_sampling`: the logits of the rows drawn by sampling travel to host memory behind the step."""
        active = [s for s in self.pool.slots if s.decoding]
        if not active:
            return
        idle_positions = idle_positions or {}
        tokens = [s.next_token if s.decoding else 0 for s in self.pool.slots]
        positions = [s.state.length if s.decoding else idle_positions.get(s.index, s.state.length)
                     for s in self.pool.slots]
        try:
            for slot in active:
                slot.state.check_room(1)
            host_rows = tuple(s.index for s in active if not s.sampler.takes_argmax) if host_sampling else None
            launched = self.decoder.launch(tokens, positions, [s.decoding for s in self.pool.slots],
                                           argmax=any(s.sampler.takes_argmax for s in active), host_rows=host_rows)
        except Exception as err:  # noqa: BLE001 - the batch failed: fail its requests, keep serving
            log.exception("decode step failed")
            for slot in active:
                self._finish(slot, slot.request, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            return
        for slot in active:
            slot.state.length += 1
        self._launched = (launched, active)
        self.counters.decode_steps += 1
        self.counters.decode_steps_beside_prompts += bool(idle_positions)

    def _finish_decode(self) -> None:
        """Choose each decoding slot's token from the launched step (every greedy row's from one argmax)."""
        if self._launched is None:
            return
        (launched, active), self._launched = self._launched, None
        argmax = None
        for slot in active:
            try:
                sampler = slot.sampler
                if sampler.takes_argmax:
                    if argmax is None:
                        argmax = launched.argmax()
                    token = sampler.take(argmax[slot.index])
                else:
                    token = sampler(launched.row(slot.index))
                self._accept(slot, token, launched.row(slot.index))
            except Exception as err:  # noqa: BLE001
                log.exception("sampling failed for %s", slot.request.id)
                self._finish(slot, slot.request, FinishReason.ERROR, f"{type(err).__name__}: {err}")

    # ---- postprocess ------------------------------------------------------------------------------
    def _accept(self, slot: Slot, token: int, logits: torch.Tensor) -> None:
        """Take `token`, chosen from `logits` (the position's row), for the slot's request."""
        request = slot.request
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.output_ids.append(token)
        if request.logprobs is not None:
            request.output_logprobs.append(_position_logprobs(logits, token, request.logprobs))
        delta, stopped = "", token in request.stop_id_set
        if slot.detokenizer is not None and not stopped:
            delta = slot.detokenizer.push(token)
            if slot.stops is not None:
                delta, stopped = slot.stops.push(delta)
        request.text += delta
        if request.on_token is not None:
            request.on_token(request, token, delta)
        if stopped:
            self._finish(slot, request, FinishReason.STOP)
        elif len(request.output_ids) >= request.max_tokens:
            self._finish(slot, request, FinishReason.LENGTH)
        else:
            slot.next_token = token

    def _finish(self, slot: Slot | None, request: Request, reason: FinishReason, error: str | None = None) -> None:
        if slot is not None and reason is FinishReason.LENGTH:
            tail = ""
            if slot.detokenizer is not None:
                tail = slot.detokenizer.flush()
                if slot.stops is not None:
                    tail, _ = slot.stops.push(tail)
                    tail += slot.stops.flush()
            request.text += tail
        request.finish_reason, request.error = reason, error
        request.finished_at = time.perf_counter()
        if slot is not None:
            slot.release()
        if request.on_finish is not None:
            request.on_finish(request)

