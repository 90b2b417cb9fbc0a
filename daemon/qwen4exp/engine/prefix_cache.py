"""The prefix cache: snapshots at restore points, indexed by their token prefix in the Rust PrefixStore.

The store decides (longest match, LRU eviction under the resident limit, pins while restoring); this side
owns the snapshot buffers and frees the ones the store evicts. It outlives an engine, so a park that drops
the engine and its GPU memory keeps the cache.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from array import array

import torch
from dataclasses import dataclass

from .._core import PrefixStore, PrefixStoreError, PrefixStoreFull
from .snapshot import Snapshot, SnapshotBackend, SnapshotCopier
from .state import SequenceState

log = logging.getLogger("qwen4exp.prefix_cache")


def _wait_for_copies(state: SequenceState) -> None:
    """Finish the restore's copies before the snapshot is unpinned (and may be evicted), and so that the
    restore time is measured, not just queued: on every GPU the state is on (a split model's, placement.py)."""
    for device in {t.device for t in state.tensors() if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


@dataclass
class CacheCounters:
    captures: int = 0          # snapshots taken
    saved: int = 0             # ... and kept by the store
    refused: int = 0           # ... that could not fit even after eviction
    evictions: int = 0         # entries the resident limit pushed out
    restores: int = 0
    restored_tokens: int = 0
    restore_seconds: float = 0.0


def auto_resident_limit(backend: SnapshotBackend) -> int:
    """resident_limit = "auto": a quarter of the system memory free now for host snapshots; a tenth of the
    device for snapshots kept on a unified-memory GPU."""
    if backend.tier == "device":
        return torch.cuda.get_device_properties(backend.device).total_memory // 10
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 // 4


class PrefixCache:
    def __init__(self, spacing: int, resident_limit: int, backend: SnapshotBackend, ratio: int):
        if spacing % ratio:
            raise ValueError(f"the restore spacing ({spacing}) must be a multiple of the QSA compress ratio ({ratio})")
        host_limit = resident_limit if backend.tier == "host" else 0
        device_limit = resident_limit if backend.tier == "device" else 0
        self.store = PrefixStore(spacing, host_limit, device_limit)
        self.spacing, self.ratio, self.backend = spacing, ratio, backend
        self.chunk: int | None = None          # the chunk grid its snapshots were cut on (set by the engine)
        self.resident_limit = resident_limit
        self.counters = CacheCounters()
        self._snapshots: dict[int, Snapshot] = {}
        self._copier = SnapshotCopier(backend)
        self._reading: list[tuple[SequenceState, Snapshot]] = []    # captures whose copies may still read a state
        self._keys: dict[int, int] = {}                # handle -> hash of its prefix tokens
        self._handles = itertools.count(1)
        self._lock = threading.Lock()

    def restore_longest(self, prompt_ids: list[int], state: SequenceState) -> tuple[int, torch.Tensor | None]:
        """Restore the longest cached prefix of the prompt. Returns (restored length, 0 on a miss; the last
        prompt token's logits on the state's device when the whole prompt was restored, else None)."""
        started = time.perf_counter()
        logits = None
        with self._lock:
            entry = self.store.match(array("I", prompt_ids), pin=True)
            # A point off the chunk grid (restore spacing below the chunk) serves only the prompt it ends: a longer
            # one's cold run cuts no chunk there, so its rest would be computed on another grid than cold. Look
            # again below it, on the grid (a second lookup in the store's counts).
            grid = self.chunk or self.spacing
            while entry is not None and entry.length % grid and entry.length != len(prompt_ids):
                self.store.unpin(entry.handle)
                on_grid = entry.length // grid * grid
                entry = self.store.match(array("I", prompt_ids[:on_grid]), pin=True) if on_grid else None
            if entry is None:
                return 0, None
            snapshot = self._snapshots[entry.handle]
        if not snapshot.wait_until_filled():
            with self._lock:
                self.store.unpin(entry.handle)
            self._forget(snapshot)
            return self.restore_longest(prompt_ids, state)
        try:
            snapshot.restore(state, self.ratio)
            if snapshot.length == len(prompt_ids):
                logits = snapshot.logits.to(state.device, non_blocking=True)
            _wait_for_copies(state)
        finally:
            with self._lock:
                self.store.unpin(entry.handle)
        c = self.counters
        c.restores += 1
        c.restored_tokens += snapshot.length
        c.restore_seconds += time.perf_counter() - started
        return snapshot.length, logits

    def capture(self, prefix_ids: list[int], state: SequenceState, logits: torch.Tensor) -> int | None:
        """Snapshot `state` (at a restore point, holding exactly `prefix_ids`) with its last token's logits.
        Returns its handle, or None when the store refused it or already holds that prefix."""
        if state.length != len(prefix_ids) or state.length % self.spacing or state.length == 0:
            return None
        tokens = array("I", prefix_ids)
        key = hash(tokens.tobytes())
        with self._lock:
            if key in self._keys.values():      # already stored (or a hash twin: skipping is harmless)
                return None
        # The store decides first, so that a refused snapshot is never copied.
        nbytes = Snapshot.nbytes_for(state, self.ratio, logits)
        handle = next(self._handles)
        self.counters.captures += 1
        with self._lock:
            try:
                result = self.store.insert(tokens, handle, nbytes, tier=self.backend.tier)
            except PrefixStoreFull as err:
                self.counters.refused += 1
                log.info("prefix snapshot of %d tokens not kept: %s", state.length, err)
                return None
            for evicted in result.evicted:
                self._drop(evicted)
            self.counters.evictions += len(result.evicted)
        try:
            snapshot = Snapshot.capture(state, self.ratio, self.backend, logits, self._copier)
        except Exception:
            with self._lock:
                self.store.remove(handle)
            raise
        with self._lock:
            self._snapshots[handle] = snapshot
            self._keys[handle] = key
        self._prune_reading()
        self._reading.append((state, snapshot))
        self.counters.saved += 1
        return handle

    def _prune_reading(self) -> None:
        """Drop the captures whose copies are done; one that failed leaves the store."""
        reading = []
        for source, snapshot in self._reading:
            if not snapshot.filled:
                reading.append((source, snapshot))
            elif not snapshot.wait_until_filled():
                self._forget(snapshot)
        self._reading = reading

    def wait_for_captures(self, state: SequenceState) -> None:
        """Before `state` is emptied or overwritten below its length (a slot's next request): its snapshots' copies
        are queued ahead of that work (on a GPU, the host does not wait for them to finish)."""
        for source, snapshot in self._reading:
            if source is state and not snapshot.wait_until_filled():
                self._forget(snapshot)
        self._reading = [(s, snap) for s, snap in self._reading if s is not state]

    def finish_captures(self) -> None:
        """Wait until every capture's copies are done: before the states they read are freed (an engine's stop)."""
        for _, snapshot in self._reading:
            if not snapshot.finish():
                self._forget(snapshot)
        self._reading = []

    def _forget(self, snapshot: Snapshot) -> None:
        """A snapshot whose copy failed leaves the store (its bytes would push good ones out)."""
        with self._lock:
            for handle, kept in list(self._snapshots.items()):
                if kept is snapshot:
                    try:
                        self.store.remove(handle)
                    except PrefixStoreError:        # pinned by a restore, which drops it itself
                        return
                    self._drop(handle)

    def _drop(self, handle: int) -> None:
        self._snapshots.pop(handle, None)
        self._keys.pop(handle, None)

    def stats(self) -> dict:
        with self._lock:
            store = self.store.stats().to_dict()
        return {"tier": self.backend.tier, "resident_limit": self.resident_limit, "store": store,
                **vars(self.counters)}
