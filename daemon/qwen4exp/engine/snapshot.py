"""Prefix snapshots: a sequence's state at a restore point, copied out of its slot and back into any slot.

Prefix-sized, not context-sized: for a P-token prefix, the K/V, raw indexer-key and block-key strips of the
first P positions, plus the whole recurrent, conv, PLE-conv and n-gram state, and the logits of the prefix's
last token (so a prompt resent whole needs no forward at all). One flat buffer per snapshot
(pinned host memory beside a discrete GPU, device memory on a unified-memory GPU, plain memory on CPU),
carved into views, so a capture or a restore is one copy per tensor and one allocation; a capture's allocation
and copies happen off the prompt's path (SnapshotCopier).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .state import AttentionState, DeltaNetState, SequenceState

log = logging.getLogger("qwen4exp.snapshot")

_ALIGN = 64
_ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _pieces(state: SequenceState, length: int, ratio: int) -> list[tuple[torch.Tensor, bool]]:
    """The state tensors (or their prefix strips) a snapshot of `length` positions holds, in a fixed order, each
    with whether a later forward of the sequence overwrites it: the conv, recurrent and PLE states are updated
    whole; the K/V, indexer-key and block-key strips below `length` are only ever appended past."""
    pieces = []
    for layer in state.layers:
        if isinstance(layer, AttentionState):
            # A head's strip is contiguous, where [:, :length] of several heads is not: a copy of a strided source
            # would first make a contiguous one on the device, out of memory the context fit does not count.
            for cache in (layer.keys, layer.values):
                pieces += [(cache[head, :length], False) for head in range(cache.shape[0])]
            pieces += [(layer.index_keys[:length], False), (layer.block_keys[:length // ratio], False)]
        elif isinstance(layer, DeltaNetState):
            pieces += [(layer.conv, True), (layer.recurrent, True)]
    for index in sorted(state.ple):
        pieces += [(state.ple[index].conv, True), (state.ple[index].context_ids, True)]
    return pieces


def _layout(state: SequenceState, ratio: int, logits: torch.Tensor | None
            ) -> tuple[list[tuple[torch.Tensor, bool]], list[int], int]:
    """A snapshot of `state` at its length: its pieces, each one's offset in the buffer, and the buffer's bytes."""
    if state.length % ratio:
        raise ValueError(f"a snapshot needs a length that is a multiple of {ratio}, got {state.length}")
    pieces = _pieces(state, state.length, ratio) + ([(logits, True)] if logits is not None else [])
    offsets, total = [], 0
    for piece, _ in pieces:
        offsets.append(total)
        total += -(-piece.numel() * piece.element_size() // _ALIGN) * _ALIGN
    return pieces, offsets, total


def pin_in_threads() -> None:
    """Have torch pin host buffers by touching their pages in 8 threads and then registering them with the
    driver, not in one cudaHostAlloc call: a capture allocates its buffer while the prompt waits, and on the
    H200 host a 96 MiB buffer took 44-66 ms the default way and 15-27 ms this way (torch's allocator options
    pinned_use_{cuda,hip}_host_register and pinned_num_register_threads). An operator's own pinned options in
    the environment are left as they are."""
    configured = " ".join(os.environ.get(name, "") for name in _ALLOC_CONF_VARIABLES)
    if "pinned_" in configured:
        return
    runtime = "hip" if torch.version.hip else "cuda"
    settings = f"pinned_use_{runtime}_host_register:True,pinned_num_register_threads:8"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(settings)
    else:
        torch.cuda.memory._set_allocator_settings(settings)


def _unified_memory(device: torch.device) -> bool:
    """A GPU whose memory is the system's (an integrated GPU, e.g. Strix Halo)."""
    return device.type == "cuda" and torch.cuda.get_device_properties(device).is_integrated


def snapshots_share_device_memory(device: torch.device) -> bool:
    """Whether prefix snapshots take memory the slots could have used, so the fit reserves them: on the CPU and
    on a unified-memory GPU they do; beside a discrete GPU they live in pinned host memory."""
    return device.type == "cpu" or _unified_memory(device)


@dataclass
class SnapshotBackend:
    """Where snapshots live: `tier` is "host" (pinned or plain system memory) or "device"."""
    device: torch.device          # where the buffers are allocated
    pinned: bool
    tier: str

    @classmethod
    def for_device(cls, device: torch.device) -> "SnapshotBackend":
        if _unified_memory(device):
            return cls(device, pinned=False, tier="device")       # the device's memory is the system's
        if device.type == "cuda":
            pin_in_threads()
            return cls(torch.device("cpu"), pinned=True, tier="host")
        return cls(torch.device("cpu"), pinned=False, tier="host")

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)


class SnapshotCopier:
    """Fills snapshots' buffers off the prompt's path, one snapshot after another on a background thread: the
    allocation (a pinned one takes tens of milliseconds, and a first long prompt's several hundred) happens on the
    thread, and beside a GPU the copies run on their own stream, after the chunk that made the state and beside
    the chunks after it. The prefix strips are read in place, since the sequence only appends past them; the
    tensors a forward updates whole are copied on the prompt's stream first (a few MB)."""

    def __init__(self, backend: "SnapshotBackend"):
        self.backend = backend
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen4exp-snapshots")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        _COPIERS.add(self)

    def quiesce(self) -> None:
        """Wait until every copy queued so far has made its calls to the driver (allocations, copies queued)."""
        self._thread.submit(lambda: None).result()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def copy(self, sources: list[torch.Tensor], total: int, offsets: list[int],
             device: torch.device | None = None) -> "Future[_Filled]":
        """Queue the copy of `sources` (which nothing may overwrite until the copy is waited for) into one new
        buffer of `total` bytes, each at its offset; on `device`'s copy stream beside a GPU (the state's target:
        default the first source's device)."""
        device = device or sources[0].device
        if device.type != "cuda":
            return self._thread.submit(self._fill, sources, total, offsets, None, None)
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(device))
        return self._thread.submit(self._fill, sources, total, offsets, self._stream(device), made)

    def _fill(self, sources: list[torch.Tensor], total: int, offsets: list[int], stream: torch.cuda.Stream | None,
              made: torch.cuda.Event | None) -> "_Filled":
        with contextlib.ExitStack() as context:
            if stream is not None:
                context.enter_context(torch.cuda.stream(stream))
                stream.wait_event(made)
            buffer = self.backend.allocate(total)
            views = []
            for source, offset in zip(sources, offsets):
                view = buffer[offset:offset + source.numel() * source.element_size()]
                view = view.view(source.dtype).view(source.shape)
                # A split model's layers on another device (the host, another GPU) copy outside this stream, which
                # `done` does not follow: those copies finish before the buffer is handed out.
                here = stream is not None and source.device == stream.device
                view.copy_(source, non_blocking=stream is None or here)
                if here:
                    # The prompt's stream may free or reuse a source's memory once this stream has read it.
                    source.record_stream(stream)
                views.append(view)
            done = None
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
        return _Filled(buffer, views, done)


_COPIERS: "weakref.WeakSet[SnapshotCopier]" = weakref.WeakSet()


def quiesce_snapshot_copies() -> None:
    """Before a CUDA graph capture: a copier's thread allocating pinned memory during one (another engine's, or
    an engine's with no prefix cache) would invalidate the capture and leave the process unable to capture."""
    for copier in list(_COPIERS):
        copier.quiesce()


@dataclass
class _Filled:
    buffer: torch.Tensor
    views: list[torch.Tensor]
    done: torch.cuda.Event | None      # recorded after the copies on a GPU; None where they ran on the thread


class Snapshot:
    def __init__(self, filled: "Future[_Filled]", nbytes: int, length: int, tier: str, device: torch.device,
                 has_logits: bool):
        self._filled, self.nbytes, self.length, self.tier = filled, nbytes, length, tier
        self._device, self._has_logits = device, has_logits
        self._failure_logged = False

    @classmethod
    def capture(cls, state: SequenceState, ratio: int, backend: SnapshotBackend,
                logits: torch.Tensor | None = None, copier: SnapshotCopier | None = None) -> "Snapshot":
        """Copy the state at its current length (and the last token's logits [V], when given). The copy is
        queued on `copier` (a new one when None): until `wait_until_filled` is called, nothing may overwrite
        the state's strips below this length (a slot's reuse waits for it: PrefixCache.wait_for_captures)."""
        pieces, offsets, total = _layout(state, ratio, logits)
        sources = [piece.clone() if overwritten else piece for piece, overwritten in pieces]
        copier = copier or SnapshotCopier(backend)
        return cls(copier.copy(sources, total, offsets, state.device), total, state.length, backend.tier,
                   state.device, logits is not None)

    @staticmethod
    def nbytes_for(state: SequenceState, ratio: int, logits: torch.Tensor | None = None) -> int:
        """The bytes a capture of `state` now would take (to ask the store before copying anything)."""
        return _layout(state, ratio, logits)[2]

    def wait_until_filled(self) -> bool:
        """Wait until the copies are queued, and order the device's current stream after them (the host does not
        wait for the copies themselves). False when the fill failed (logged once): the snapshot holds nothing."""
        try:
            filled = self._filled.result()
        except Exception:  # noqa: BLE001 - a snapshot is an optimisation; its failure only loses it
            if not self._failure_logged:
                self._failure_logged = True
                log.exception("a prefix snapshot of %d tokens could not be filled", self.length)
            return False
        if filled.done is not None:
            torch.cuda.current_stream(self._device).wait_event(filled.done)
        return True

    def finish(self) -> bool:
        """Wait on the host until the copies are done (before the state they read is freed). False when the fill
        failed."""
        if not self.wait_until_filled():
            return False
        done = self._filled.result().done
        if done is not None:
            done.synchronize()
        return True

    @property
    def filled(self) -> bool:
        """Whether the copies are done (never waits)."""
        if not self._filled.done():
            return False
        if self._filled.exception() is not None:
            return True
        done = self._filled.result().done
        return done is None or done.query()

    def _views(self) -> list[torch.Tensor]:
        """The buffer's views, the current stream ordered after their copies."""
        if not self.wait_until_filled():
            raise RuntimeError(f"the prefix snapshot of {self.length} tokens holds nothing: its copy failed")
        return self._filled.result().views

    @property
    def logits(self) -> torch.Tensor | None:
        """The prefix's last token's logits."""
        return self._views()[-1] if self._has_logits else None

    def restore(self, state: SequenceState, ratio: int) -> None:
        """Make `state` (any slot's) exactly the captured sequence at this snapshot's length."""
        if self.length > state.capacity:
            raise ValueError(f"a {self.length}-token snapshot does not fit a slot of {state.capacity} positions")
        views = self._views()[:-1 if self._has_logits else None]
        state.reset()
        targets = [piece for piece, _ in _pieces(state, self.length, ratio)]
        if [t.shape for t in targets] != [v.shape for v in views]:
            raise ValueError("this snapshot was taken from a differently shaped model state")
        for target, view in zip(targets, views):
            target.copy_(view, non_blocking=True)
        state.length = self.length
