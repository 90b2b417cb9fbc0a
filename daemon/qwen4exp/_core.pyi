"""qwen4exp's native core (Rust, `rust_core/`): the memory planner and the prefix snapshot store.

Memory questions flow one way: the engine measures, the planner decides, the engine allocates.

Planner, in two modes:

* Real: ``Planner.context_fit()`` returns a `ContextFit` state machine. The engine tries each
  ``candidate`` for real (allocates every slot's caches at that context, runs the floor chunk at the
  last position, reads the allocator's peak) and reports one `DeviceProbe` per device, until
  ``candidate`` is None. Then it does the same with ``Planner.chunk_fit()``, and
  ``Planner.report(context_fit, chunk_fit)`` writes the `Plan`.
* Estimate: ``Planner.estimate()`` drives both searches with the budget model (fits iff
  ``fixed + bytes_per_position * ctx + workspace(ctx) + snapshots(ctx) <= capacity * (1 - headroom)``),
  so ``qwen4exp plan`` can print ``Plan.table()`` with no device.

Every object is safe to share between threads: each holds its state behind a mutex, and long calls
release the GIL. Byte counts are ints in bytes; contexts are in positions, chunks in rows.
"""

from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias

from typing_extensions import Buffer

TRAINED_CONTEXT: Final[int]
"""The model's trained context (262144): where every context search starts."""
CONTEXT_STEP: Final[int]
"""Contexts are multiples of this many positions (4096)."""
FLOOR_CONTEXT: Final[int]
"""The smallest context the planner answers with (4096)."""
CHUNK_ROWS: Final[int]
"""Prompt chunks are whole multiples of this many rows (256)."""
DEFAULT_HEADROOM: Final[float]
"""Fraction of each device's capacity kept free unless told otherwise (0.1)."""
__version__: Final[str]
"""Version of the native crate."""

_Tier: TypeAlias = Literal["device", "host"]
"""A snapshot's tier (stub-only alias)."""
_Tokens: TypeAlias = Sequence[int] | Buffer
"""Token ids (stub-only alias): a sequence of ints in [0, 2**32), or a buffer of uint32, int32 or int64 (array('I'),
a numpy array); buffers are copied in one go and are the fast path for long prompts."""

class PlannerError(ValueError):
    """The planner refused an input, a report out of turn, or found that even the floor context
    does not fit. The message names the device and the numbers (what is needed, what is available,
    and at the floor the whole breakdown: weights, graphs, caches, chunk workspace, snapshots)."""

class PrefixStoreError(ValueError):
    """The prefix store refused an operation; the store is unchanged. Raised for a length that is
    not a restore point, a handle already in use or unknown, tokens already stored, unpinning an
    entry that is not pinned, removing a pinned entry, a bad tier name, a failed integrity check."""

class PrefixStoreFull(PrefixStoreError):
    """An insert could fit only by evicting pinned entries, or is larger than its tier's limit:
    it was not stored, nothing was evicted, and the caller should free the snapshot it made."""

class DeviceBudget:
    """One device's measurements. Byte counts cover all slots unless they say "per slot"."""

    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        bytes_per_position: int,
        weights: int = 0,
        graphs: int = 0,
        slot_state: int = 0,
        workspace: Sequence[tuple[int, int]] = (),
        snapshot_base: int = 0,
        snapshot_per_position: int = 0,
        slots: int = 1,
        headroom: float = 0.1,
    ) -> None:
        """Describe a device.

        Args:
            name: How the engine names the device (``"cuda:0"``); unique within a planner.
            capacity: Measured capacity in bytes.
            bytes_per_position: Bytes per context position for all slots together: K/V, indexer
                keys, compressed keys.
            weights: Fixed bytes of weights on this device.
            graphs: Fixed bytes of resident CUDA graphs and their pool.
            slot_state: Fixed bytes of every slot's state that does not grow with context
                (recurrent, conv, n-gram state), all slots together.
            workspace: The floor chunk's workspace measured at ``(position, bytes)`` pairs. The
                planner fits a straight line in position (least squares, never sloping down,
                raised to cover every sample) and says so in `workspace_fit`. Empty: none.
            snapshot_base: Per slot, when snapshots live on this device: the bytes of one
                snapshot that do not grow with position (the full recurrent state). 0 with
                `snapshot_per_position` 0 means snapshots live elsewhere.
            snapshot_per_position: Per slot: snapshot bytes per position (the prefix's strips).
            slots: Number of slots; one full snapshot per slot is reserved.
            headroom: Fraction of capacity kept free, in [0, 1).

        Raises:
            PlannerError: An empty name, a capacity of 0, 0 slots, or a headroom outside [0, 1).
            OverflowError: A negative byte count.
        """
    @property
    def name(self) -> str:
        """The device's name."""
    @property
    def capacity(self) -> int:
        """Measured capacity in bytes."""
    @property
    def headroom(self) -> float:
        """Fraction of capacity kept free."""
    @property
    def weights(self) -> int:
        """Fixed bytes of weights."""
    @property
    def graphs(self) -> int:
        """Fixed bytes of resident graphs."""
    @property
    def slot_state(self) -> int:
        """Fixed bytes of slot state (all slots)."""
    @property
    def bytes_per_position(self) -> int:
        """Cache bytes per context position (all slots)."""
    @property
    def workspace(self) -> list[tuple[int, int]]:
        """The workspace samples as given, ``(position, bytes)``."""
    @property
    def snapshot_base(self) -> int:
        """Per-slot snapshot bytes that do not grow with position."""
    @property
    def snapshot_per_position(self) -> int:
        """Per-slot snapshot bytes per position."""
    @property
    def slots(self) -> int:
        """Number of slots."""
    @property
    def headroom_bytes(self) -> int:
        """``ceil(capacity * headroom)``."""
    @property
    def available(self) -> int:
        """What a plan may use: ``capacity - headroom_bytes``."""
    @property
    def fixed(self) -> int:
        """``weights + graphs + slot_state``."""
    @property
    def snapshots_on_device(self) -> bool:
        """True when snapshots live on this device (either snapshot size is non-zero)."""
    @property
    def workspace_fit(self) -> str:
        """How the workspace line was fitted, in words (also in the plan's notes)."""
    def workspace_at(self, position: int) -> int:
        """The floor chunk's workspace in bytes at `position`, from the fitted line (rounded up).

        Args:
            position: A context position.
        """

class DeviceProbe:
    """One device's outcome for one candidate (a context or a chunk size)."""

    def __init__(self, device: str, needed: int, available: int) -> None:
        """A measured outcome: fits iff ``needed <= available``.

        Args:
            device: The device's name, as given to the planner or search.
            needed: Bytes the candidate needs there (measured peak plus what stays resident).
            available: Bytes it may use (capacity less headroom).
        """
    @staticmethod
    def fit(device: str, spare: int) -> DeviceProbe:
        """A fit known only by its margin.

        Args:
            device: The device's name.
            spare: Bytes left over.
        """
    @staticmethod
    def miss(device: str, shortfall: int) -> DeviceProbe:
        """A miss known only by its margin.

        Args:
            device: The device's name.
            shortfall: Bytes missing; must be positive.

        Raises:
            PlannerError: `shortfall` is 0.
        """
    @property
    def device(self) -> str:
        """The device's name."""
    @property
    def needed(self) -> int | None:
        """Bytes needed, when measured or estimated; None for a bare fit or miss."""
    @property
    def available(self) -> int | None:
        """Bytes available, when known."""
    @property
    def fits(self) -> bool:
        """Whether the candidate fits on this device."""
    @property
    def spare(self) -> int:
        """Bytes left over on a fit, else 0."""
    @property
    def shortfall(self) -> int:
        """Bytes missing on a miss, else 0."""

class Probe:
    """One candidate tried on every device, kept for the report."""

    @property
    def candidate(self) -> int:
        """The context (positions) or chunk (rows) tried."""
    @property
    def devices(self) -> list[DeviceProbe]:
        """One outcome per device, in the planner's device order."""
    @property
    def fits(self) -> bool:
        """True iff it fits on every device."""
    @property
    def binding(self) -> str | None:
        """On a miss, the device furthest over (in positions for contexts); on a fit, the device
        closest to its limit."""

class ContextFit:
    """The context search as a state machine.

    Starts at the trained context rounded down to the step. A miss shrinks by its shortfall over
    the device's bytes per position (rounded down to the step, at least one step, never below the
    floor). Once a context fits, the next candidate is where the need line between the largest fit
    and the smallest miss crosses the budget, ``lo + (hi - lo) * spare / (spare + shortfall)``
    (for several devices, the first such crossing), rounded down to the step and clamped strictly
    inside; the search stops when the two are one step apart, answering the largest fit.
    """

    def __init__(
        self,
        devices: Sequence[tuple[str, int]],
        *,
        trained: int = 262144,
        step: int = 4096,
        floor: int = 4096,
    ) -> None:
        """A search on its own (``Planner.context_fit()`` builds one from the planner's devices).

        Args:
            devices: ``(name, bytes_per_position)`` per device; names unique.
            trained: The model's trained context; rounded down to the step to start.
            step: The context grid, in positions.
            floor: The smallest answer; a positive multiple of `step`.

        Raises:
            PlannerError: No devices, a repeated or empty name, step 0, a floor that is not a
                multiple of the step, or a trained context below the floor.
        """
    @property
    def candidate(self) -> int | None:
        """The context to try next; None once answered or failed."""
    @property
    def done(self) -> bool:
        """True once the search has answered or failed."""
    @property
    def answer(self) -> int | None:
        """The largest context that fits on every device, once found."""
    @property
    def binding(self) -> str | None:
        """The device that refused ``answer + step``; None while searching and when the trained
        context itself fits."""
    @property
    def failure(self) -> str | None:
        """The error that ended the search when even the floor missed, else None."""
    @property
    def probes(self) -> list[Probe]:
        """Every probe so far, in the order tried."""
    @property
    def devices(self) -> list[str]:
        """Device names in the order probes list them."""
    def report(self, probes: Sequence[DeviceProbe]) -> int | None:
        """Record the current candidate's outcome, one `DeviceProbe` per device (any order).

        Args:
            probes: Exactly one outcome for every device of the search.

        Returns:
            The next candidate, or None when the search has answered (read `answer`).

        Raises:
            PlannerError: A device missing, repeated or unknown (nothing is recorded); a report
                after the search answered; or the floor context missed (the message says which
                device and how many bytes it needs; the search stays failed).
        """

class ChunkFit:
    """The chunk search: the largest prompt chunk, a multiple of 256 rows between the floor chunk
    and the maximum, whose workspace fits at the fixed context. The floor chunk is part of the
    context's contract (reserved before any snapshots on the same device), so the search tries the
    maximum first and then bisects above the floor."""

    def __init__(self, devices: Sequence[str], *, floor_chunk: int = 256, max_chunk: int = 8192) -> None:
        """A search on its own (``Planner.chunk_fit()`` builds one from the planner).

        Args:
            devices: Device names; unique.
            floor_chunk: The chunk the context search reserved, in rows (multiple of 256).
            max_chunk: The largest chunk worth having, in rows (multiple of 256).

        Raises:
            PlannerError: No devices, a repeated name, or sizes that are not positive multiples
                of 256 with ``floor_chunk <= max_chunk``.
        """
    @property
    def candidate(self) -> int | None:
        """The chunk (rows) to try next; None once answered."""
    @property
    def done(self) -> bool:
        """True once answered."""
    @property
    def answer(self) -> int | None:
        """The largest chunk that fits, once found."""
    @property
    def binding(self) -> str | None:
        """The device that refused one chunk step more; None when the maximum fits."""
    @property
    def probes(self) -> list[Probe]:
        """Every probe so far."""
    @property
    def devices(self) -> list[str]:
        """Device names in probe order."""
    def report(self, probes: Sequence[DeviceProbe]) -> int | None:
        """Record the current chunk's outcome on every device.

        Args:
            probes: Exactly one outcome for every device.

        Returns:
            The next chunk to try, or None when answered.

        Raises:
            PlannerError: A device missing, repeated or unknown, or a report after the answer.
        """

class DeviceReport:
    """One device's budget at the plan's context and chunk, from the budget model."""

    @property
    def name(self) -> str:
        """The device's name."""
    @property
    def capacity(self) -> int:
        """Measured capacity."""
    @property
    def headroom(self) -> int:
        """Bytes kept free."""
    @property
    def weights(self) -> int:
        """Weights."""
    @property
    def graphs(self) -> int:
        """Resident graphs."""
    @property
    def caches(self) -> int:
        """Slot state plus every slot's context-sized caches."""
    @property
    def workspace(self) -> int:
        """The chosen chunk's workspace at the last position."""
    @property
    def snapshots(self) -> int:
        """One full snapshot per slot, when snapshots live here; else 0."""
    @property
    def free(self) -> int:
        """What is left; negative if the model is over where the measured probes fit."""
    @property
    def snapshots_on_device(self) -> bool:
        """Whether snapshots live on this device."""
    @property
    def workspace_fit(self) -> str:
        """How the workspace line was fitted."""

class Plan:
    """The planner's answer, the budget per device at that answer, and every probe."""

    @property
    def context(self) -> int:
        """The fitted context in positions."""
    @property
    def chunk(self) -> int:
        """The prompt chunk in rows."""
    @property
    def binding(self) -> str | None:
        """The device that refused one step more; None when the trained context fits."""
    @property
    def chunk_binding(self) -> str | None:
        """The device that refused one chunk step more; None when the maximum chunk fits."""
    @property
    def probes(self) -> list[Probe]:
        """The context search's probes, in order."""
    @property
    def chunk_probes(self) -> list[Probe]:
        """The chunk search's probes, in order."""
    @property
    def devices(self) -> list[DeviceReport]:
        """One budget per device."""
    @property
    def notes(self) -> list[str]:
        """Plain sentences: the mode, how each workspace was fitted, who binds, disagreements."""
    def table(self) -> str:
        """The whole plan as text tables (budget per device, probes, notes); ``str(plan)`` too."""
    def to_dict(self) -> dict[str, Any]:
        """The plan as plain dicts and lists (for JSON)."""

class Planner:
    """Every device's budget plus the search settings; immutable, shareable between threads."""

    def __init__(
        self,
        devices: Sequence[DeviceBudget],
        *,
        trained: int = 262144,
        step: int = 4096,
        floor: int = 4096,
        floor_chunk: int = 256,
        max_chunk: int = 8192,
    ) -> None:
        """Build a planner; for split serving pass every device (the context must fit on all).

        Args:
            devices: One `DeviceBudget` per device; names unique.
            trained: The model's trained context, where the search starts.
            step: The context grid in positions.
            floor: The smallest context; a positive multiple of `step`.
            floor_chunk: The chunk whose workspace was measured, in rows (multiple of 256).
            max_chunk: The largest chunk, in rows (multiple of 256).

        Raises:
            PlannerError: No devices, a repeated name, or a bad search setting.
        """
    @property
    def devices(self) -> list[DeviceBudget]:
        """The devices, in order."""
    @property
    def trained(self) -> int:
        """The trained context."""
    @property
    def step(self) -> int:
        """The context step."""
    @property
    def floor(self) -> int:
        """The floor context."""
    @property
    def floor_chunk(self) -> int:
        """The floor chunk in rows."""
    @property
    def max_chunk(self) -> int:
        """The maximum chunk in rows."""
    def evaluate(self, context: int, chunk: int | None = None) -> list[DeviceProbe]:
        """The budget model's outcome per device (with needed and available filled in).

        Args:
            context: Context in positions.
            chunk: Chunk in rows; default the floor chunk. A larger chunk's workspace is the floor
                chunk's scaled by rows.
        """
    def context_fit(self) -> ContextFit:
        """A fresh context search over this planner's devices, for the engine to drive."""
    def chunk_fit(self) -> ChunkFit:
        """A fresh chunk search over this planner's devices, for the engine to drive."""
    def estimate(self) -> Plan:
        """Both searches driven by the budget model; nothing is tried on a device. Releases the GIL.

        Raises:
            PlannerError: Even the floor context does not fit; the message lists the device's
                needs (weights, graphs, caches, chunk workspace, snapshots) and what is available.
        """
    def report(self, context_fit: ContextFit, chunk_fit: ChunkFit) -> Plan:
        """The plan after real searches: their probes, and the model's budget at their answers.

        Args:
            context_fit: A finished context search from this planner.
            chunk_fit: A finished chunk search from this planner.

        Raises:
            PlannerError: A search not finished, failed (the floor missed: the message keeps the
                measurement and adds the model's breakdown), or over other devices.
        """

class PrefixEntry:
    """A copy of one stored entry's state."""

    @property
    def handle(self) -> int:
        """The caller's snapshot handle."""
    @property
    def length(self) -> int:
        """Prefix length in tokens (a restore point)."""
    @property
    def tier(self) -> _Tier:
        """Where the snapshot lives: ``"device"`` or ``"host"``."""
    @property
    def bytes(self) -> int:
        """Snapshot size counted against its tier's limit."""
    @property
    def last_use(self) -> int:
        """The store's clock at the last insert, match or pin (larger is more recent)."""
    @property
    def pins(self) -> int:
        """Outstanding pins; a pinned entry is never evicted or removed."""

class InsertResult:
    """Handles the caller must now free."""

    @property
    def evicted(self) -> list[int]:
        """Least recently used entries dropped to make room, oldest first."""
    @property
    def replaced(self) -> int | None:
        """The strict ancestor dropped because the insert asked to replace it."""
    @property
    def freed(self) -> list[int]:
        """`replaced` (if any) then `evicted`: every snapshot to free."""

class PrefixStoreStats:
    """Counters at one moment."""

    @property
    def entries(self) -> int:
        """Stored entries."""
    @property
    def bytes(self) -> int:
        """Bytes over both tiers."""
    @property
    def device_bytes(self) -> int:
        """Bytes in the device tier."""
    @property
    def host_bytes(self) -> int:
        """Bytes in the host tier."""
    @property
    def pinned_entries(self) -> int:
        """Entries with at least one pin."""
    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned entries."""
    @property
    def hits(self) -> int:
        """Matches that found an entry."""
    @property
    def misses(self) -> int:
        """Matches that found none."""
    @property
    def evictions(self) -> int:
        """Entries evicted for room (inserts and lowered limits), not counting replacements."""
    @property
    def nodes(self) -> int:
        """Tree nodes, root included (entries plus branch points)."""
    def to_dict(self) -> dict[str, int]:
        """The counters as a dict."""

class PrefixStore:
    """Prefix snapshots indexed by token ids, at restore points only.

    A radix tree over whole blocks of `spacing` tokens: ``match`` finds the longest stored prefix
    of a prompt, LRU eviction keeps each tier under its byte limit and never evicts a pinned entry.
    The caller owns the snapshots; the store returns every handle it drops so they can be freed.
    """

    def __init__(self, spacing: int, host_limit: int, device_limit: int = 0) -> None:
        """An empty store.

        Args:
            spacing: Tokens between restore points; entries live only at its positive multiples.
            host_limit: Byte limit of the host tier (pinned system memory).
            device_limit: Byte limit of the device tier (snapshots on a unified-memory GPU).

        Raises:
            PrefixStoreError: `spacing` is 0.
        """
    @property
    def spacing(self) -> int:
        """Tokens between restore points."""
    @property
    def host_limit(self) -> int:
        """Byte limit of the host tier."""
    @property
    def device_limit(self) -> int:
        """Byte limit of the device tier."""
    def insert(
        self,
        tokens: _Tokens,
        handle: int,
        bytes: int,
        tier: _Tier = "host",
        replace_ancestor: bool = False,
    ) -> InsertResult:
        """Store `handle` as the snapshot after `tokens`. Releases the GIL.

        Evicts least recently used unpinned entries of the same tier until it fits; decides first,
        so a refused insert changes nothing.

        Args:
            tokens: The prefix; its length must be a positive multiple of `spacing`.
            handle: The caller's snapshot id; unique among stored entries.
            bytes: The snapshot's size, counted against `tier`'s limit.
            tier: ``"host"`` or ``"device"``.
            replace_ancestor: Also drop the longest stored strict prefix of `tokens` (unless it is
                pinned, then it stays); its handle comes back in `InsertResult.replaced`.

        Returns:
            The handles dropped, for the caller to free.

        Raises:
            PrefixStoreError: A length that is not a restore point (the message gives the length
                and the spacing), a handle in use, tokens already stored, a bad tier.
            PrefixStoreFull: The entry exceeds the tier's limit, or fits only by evicting pinned
                entries: not stored.
            TypeError: `tokens` is not a sequence or buffer of ints.
            ValueError: A token outside [0, 2**32) in a buffer.
        """
    def match(self, tokens: _Tokens, pin: bool = False) -> PrefixEntry | None:
        """The longest stored entry that is a prefix of `tokens`, or None. Releases the GIL.

        A hit counts as a use (moves it to the back of the eviction order) and as a hit in
        `stats`; a miss counts as a miss.

        Args:
            tokens: The prompt.
            pin: Pin the entry in the same step, so it cannot be evicted before the restore
                starts; call `unpin` when the restore is done.

        Raises:
            TypeError: `tokens` is not a sequence or buffer of ints.
        """
    def pin(self, handle: int) -> PrefixEntry:
        """Pin an entry (pins are counted; each needs an `unpin`). Counts as a use.

        Args:
            handle: A stored entry's handle.

        Raises:
            PrefixStoreError: No entry has `handle`.
        """
    def unpin(self, handle: int) -> PrefixEntry:
        """Release one pin.

        Args:
            handle: A stored entry's handle.

        Raises:
            PrefixStoreError: No entry has `handle`, or it is not pinned.
        """
    def remove(self, handle: int) -> PrefixEntry:
        """Drop an entry; the caller frees its snapshot. Returns the entry as it was.

        Args:
            handle: A stored entry's handle.

        Raises:
            PrefixStoreError: No entry has `handle`, or it is pinned.
        """
    def get(self, handle: int) -> PrefixEntry | None:
        """The entry with `handle`, or None; not a use.

        Args:
            handle: Any handle.
        """
    def set_limit(self, tier: _Tier, limit: int) -> list[int]:
        """Change a tier's byte limit, evicting least recently used unpinned entries down to it.

        Args:
            tier: ``"host"`` or ``"device"``.
            limit: The new limit in bytes.

        Returns:
            The evicted handles, for the caller to free.

        Raises:
            PrefixStoreFull: Pinned entries alone exceed `limit`; nothing changes.
            PrefixStoreError: A bad tier.
        """
    def check_integrity(self) -> None:
        """Check every invariant from scratch (tree links, restore points, byte counts, limits,
        eviction order); run it when idle. Releases the GIL.

        Raises:
            PrefixStoreError: The first broken invariant (a bug in the store, never the caller's).
        """
    def stats(self) -> PrefixStoreStats:
        """Counters: entries, bytes per tier, pins, hits, misses, evictions, nodes."""
    def __len__(self) -> int:
        """Number of stored entries."""
    def __contains__(self, handle: int) -> bool:
        """Whether an entry has `handle`."""
