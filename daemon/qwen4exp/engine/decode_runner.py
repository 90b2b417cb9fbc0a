"""The engine's decode step: every slot's row at one fixed shape, replayed from a CUDA graph on GPUs.

A graph replays the whole step (hundreds of kernels) with one launch and no host work in between; its
inputs are three small device tensors (tokens, positions, active rows) refreshed from pinned host memory
before each replay. It is captured once, while every slot is empty, so the warm-up runs touch no live
sequence (inactive rows keep their state; their position-indexed writes land where nothing is read: at the
position the engine gives them, their length or, for a prompt whose chunk is in flight, the chunk's end).
"""

from __future__ import annotations

import logging
import time

import torch

from .model.causal_lm import Qwen4ExpForCausalLM
from .cuda_graph import capture_graph
from .segmented_decode import SegmentedDecode
from .staged_inputs import StagedInputs
from .state import StateBatch

log = logging.getLogger("qwen4exp.engine")


class LaunchedStep:
    """A decode step queued on the device: its logits [rows, V] (the runner's output, valid until the next step),
    every row's argmax (on the device, or on its way to pinned host memory) and host copies of the rows asked for;
    with an event (`DecodeRunner.launch` with host rows, on a GPU), the host can go on queueing other work and take
    the tokens once `done()`."""

    def __init__(self, logits: torch.Tensor, argmax: torch.Tensor | None, host_rows: dict[int, torch.Tensor],
                 event: torch.cuda.Event | None):
        self.logits, self._argmax, self._host_rows, self._event = logits, argmax, host_rows, event

    def done(self) -> bool:
        """Whether the device has finished the step (always, off a GPU: the step ran as it was launched)."""
        return self._event is None or self._event.query()

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def argmax(self) -> list[int]:
        self._wait()
        return self._argmax.tolist()

    def row(self, index: int) -> torch.Tensor:
        """Row `index` of the logits: its host copy when one was asked for (the same bits), else the device's."""
        if index not in self._host_rows:
            return self.logits[index]
        self._wait()
        return self._host_rows[index]


class DecodeRunner:
    def __init__(self, model: Qwen4ExpForCausalLM, states: StateBatch, device: torch.device, graph: bool,
                 compile: bool = False):
        rows = len(states.rows)
        self.model, self.states, self.device = model, states, device
        pinned = device.type == "cuda"
        self._staged = StagedInputs({name: torch.zeros(rows, dtype=dtype, device=device) for name, dtype in
                                     (("tokens", torch.long), ("positions", torch.long), ("active", torch.bool))})
        self._inputs = self._staged.inputs
        self.rope = model.rope_table(states.capacity, device)
        self._argmax_host = torch.zeros(rows, dtype=torch.long, pin_memory=pinned)
        self._logits_host: torch.Tensor | None = None     # [rows, V] pinned, made at the first launch that needs it
        self.graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self.capture_seconds = 0.0
        # torch.compile fuses the step's many small element-wise kernels (GPU only; traced once per engine).
        self._step = torch.compile(model.decode_rows_impl, dynamic=False) if compile and pinned and \
            not model.spans_devices else model.decode_rows_impl
        # One graph captures one device's stream: a split model's step hands its streams across devices, so it runs
        # as segments, one graph per run of layers on a GPU (segmented_decode.py).
        self.segmented = None
        if graph and device.type == "cuda" and model.spans_devices:
            started = time.perf_counter()
            with torch.cuda.device(device):
                self.segmented = SegmentedDecode(model, states, self._inputs, self.rope, graphs=True)
            self.capture_seconds = time.perf_counter() - started
            log.info("decode step of a model over %s: %d segments, %d replayed from CUDA graphs (%.2f s)",
                     model.placement.describe(), len(self.segmented.segments), self.segmented.graphs,
                     self.capture_seconds)
        elif graph and device.type == "cuda":
            self._capture()

    def _run(self) -> torch.Tensor:
        if self.segmented is not None:
            return self.segmented.run()
        i = self._inputs
        with torch.inference_mode():
            return self._step(i["tokens"], i["positions"], i["active"], self.states, self.rope)

    def _capture(self) -> None:
        with torch.cuda.device(self.device):        # the capture's streams and pool are the engine's device's
            self._capture_here()

    def _capture_here(self) -> None:
        started = time.perf_counter()
        self.graph, self._logits = capture_graph(self._run, self.device)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        log.info("decode step captured as a CUDA graph for %d rows in %.2f s", len(self.states.rows),
                 self.capture_seconds)

    def launch(self, tokens: list[int], positions: list[int], active: list[bool], argmax: bool,
               host_rows: tuple[int, ...] | None = None) -> LaunchedStep:
        """`step`, with every row's argmax when `argmax`. `host_rows` None: the tokens are read from the device
        when taken, which waits for the step. A tuple, on a GPU: the argmax and the logits of those rows travel to
        pinned host memory behind the step, then an event, so the host need not wait for the step until `done()`.
        One launched step at a time: the next one reuses the logits and the host buffers."""
        logits = self.step(tokens, positions, active)
        best = torch.argmax(logits, dim=-1) if argmax else None
        if host_rows is None or self.device.type != "cuda":
            return LaunchedStep(logits, best, {i: logits[i] for i in host_rows or ()}, None)
        if best is not None:
            self._argmax_host.copy_(best, non_blocking=True)
        if host_rows and (self._logits_host is None or self._logits_host.shape != logits.shape
                          or self._logits_host.dtype != logits.dtype):
            self._logits_host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
        for i in host_rows:
            self._logits_host[i].copy_(logits[i], non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return LaunchedStep(logits, self._argmax_host if argmax else None,
                            {i: self._logits_host[i] for i in host_rows}, event)

    def step(self, tokens: list[int], positions: list[int], active: list[bool]) -> torch.Tensor:
        """Logits [rows, V] for one token per row; advances the state of the active rows only (their
        lengths are the caller's to advance)."""
        self._staged.write(tokens=tokens, positions=positions, active=active)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self._logits
