"""Prefix snapshots: a sequence's state at a restore point, copied out of its slot and back into any slot.

Prefix-sized, not context-sized: for a P-token prefix, the K/V, raw indexer-key and block-key strips of the
first P positions, plus the whole recurrent, conv, PLE-conv and n-gram state, and the logits of the prefix's
last token (so a prompt resent whole needs no forward at all). One flat buffer per snapshot
(pinned host memory beside a discrete GPU, device memory on a unified-memory GPU, plain memory on CPU),
carved into views, so a capture or a restore is one copy per tensor and one allocation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .state import AttentionState, DeltaNetState, SequenceState

_ALIGN = 64
_ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _pieces(state: SequenceState, length: int, ratio: int) -> list[torch.Tensor]:
    """The state tensors (or their prefix strips) a snapshot of `length` positions holds, in a fixed order."""
    pieces = []
    for layer in state.layers:
        if isinstance(layer, AttentionState):
            pieces += [layer.keys[:, :length], layer.values[:, :length], layer.index_keys[:length],
                       layer.block_keys[:length // ratio]]
        elif isinstance(layer, DeltaNetState):
            pieces += [layer.conv, layer.recurrent]
    for index in sorted(state.ple):
        pieces += [state.ple[index].conv, state.ple[index].context_ids]
    return pieces


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


class Snapshot:
    def __init__(self, buffer: torch.Tensor, views: list[torch.Tensor], length: int, tier: str,
                 logits: torch.Tensor | None = None):
        self.buffer, self.views, self.length, self.tier, self.logits = buffer, views, length, tier, logits

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @classmethod
    def capture(cls, state: SequenceState, ratio: int, backend: SnapshotBackend,
                logits: torch.Tensor | None = None) -> "Snapshot":
        """Copy the state at its current length (and the last token's logits [V], when given). The copies
        are queued on the current stream, so later work on the slot cannot overtake them."""
        length = state.length
        if length % ratio:
            raise ValueError(f"a snapshot needs a length that is a multiple of {ratio}, got {length}")
        pieces = _pieces(state, length, ratio) + ([logits] if logits is not None else [])
        offsets, total = [], 0
        for piece in pieces:
            offsets.append(total)
            total += -(-piece.numel() * piece.element_size() // _ALIGN) * _ALIGN
        buffer = backend.allocate(total)
        views = []
        for piece, offset in zip(pieces, offsets):
            nbytes = piece.numel() * piece.element_size()
            view = buffer[offset:offset + nbytes].view(piece.dtype).view(piece.shape)
            view.copy_(piece, non_blocking=True)
            views.append(view)
        if logits is not None:
            return cls(buffer, views[:-1], length, backend.tier, logits=views[-1])
        return cls(buffer, views, length, backend.tier)

    def restore(self, state: SequenceState, ratio: int) -> None:
        """Make `state` (any slot's) exactly the captured sequence at this snapshot's length."""
        if self.length > state.capacity:
            raise ValueError(f"a {self.length}-token snapshot does not fit a slot of {state.capacity} positions")
        state.reset()
        targets = _pieces(state, self.length, ratio)
        if [t.shape for t in targets] != [v.shape for v in self.views]:
            raise ValueError("this snapshot was taken from a differently shaped model state")
        for target, view in zip(targets, self.views):
            target.copy_(view, non_blocking=True)
        state.length = self.length
