"""What the context fit measures on the device: capacity, weights, state sizes, the chunk's workspace,
and the verification of an answer with every slot allocated. `fit.py` turns these into a plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .memory import PeakMeter, is_out_of_memory, release_cached_blocks, run_with_oom_retry
from .model.causal_lm import Qwen4ExpForCausalLM


@dataclass(frozen=True)
class Verification:
    """One check of a context for real: every slot allocated, a chunk run at the last position."""
    context: int
    rows: int
    needed: int            # weights + allocated states + the chunk's peak (CUDA: the allocator's peak)
    available: int
    out_of_memory: bool = False

    @property
    def fits(self) -> bool:
        return not self.out_of_memory and self.needed <= self.available


def weight_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of every parameter and buffer on `device` (a PLE table kept in host memory is not on a GPU's)."""
    def on_device(t: torch.Tensor) -> bool:
        return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))

    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()) if on_device(t))


def usable_capacity(device: torch.device, held: int) -> tuple[int, str]:
    """What this process could hold on `device`, and where the figure came from. CUDA: free + what the
    allocator already reserved (the total less what other processes and the driver hold). CPU:
    MemAvailable (or a cgroup's room, if smaller) + `held`, the weights already resident."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device), "free device memory + what this process holds"
    available, source = _meminfo_available(), "MemAvailable + weights"
    cgroup = _cgroup_room()
    if cgroup is not None and cgroup < available:
        available, source = cgroup, "cgroup memory.max - memory.current + weights"
    return available + held, source


def _meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable: give a memory limit to fit on this system")


def _cgroup_room(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None without a limit."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        current = (cgroup / "memory.current").read_text().strip()
    except OSError:
        return None
    return int(limit) - int(current) if limit.isdigit() and current.isdigit() else None


def _allocated(device: torch.device, make):
    """`make()` and its bytes: the allocator's rise on CUDA, the tensors' sizes on the CPU (torch's CPU
    tensors are plain allocations of that size; the resident set would only add noise)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        obj = make()
        torch.cuda.synchronize(device)
        return obj, torch.cuda.memory_allocated(device) - before
    obj = make()
    return obj, obj.nbytes()


def measure_state(model: Qwen4ExpForCausalLM, device: torch.device, capacity: int) -> tuple[int, int]:
    """One slot's (bytes per position, fixed bytes), from states of `capacity` and twice that."""
    small, small_bytes = _allocated(device, lambda: model.new_state(capacity, device))
    del small
    large, large_bytes = _allocated(device, lambda: model.new_state(2 * capacity, device))
    del large
    release_cached_blocks(device)
    per_position = -(-(large_bytes - small_bytes) // capacity)
    return per_position, max(small_bytes - per_position * capacity, 0)


def run_chunk(model: Qwen4ExpForCausalLM, state, rows: int, device: torch.device) -> PeakMeter:
    """Run one `rows`-token chunk at the state's last positions under a `PeakMeter`. Every row is the same
    token, so the MoE sends them all to the same experts: the per-expert loop's largest batch."""
    ids = torch.full((rows,), 1, dtype=torch.long, device=device)
    state.length = state.capacity - rows
    # The RoPE table grows with the position and stays; drop it so this peak pays for the one it needs.
    model.release_rope_table()
    with PeakMeter(device) as meter:
        model(ids, state)
    return meter


def run_decode(model: Qwen4ExpForCausalLM, states, device: torch.device) -> PeakMeter:
    """One decode step over every slot at its last position (what the engine's decode graph holds)."""
    rows = len(states.rows)
    tokens = torch.ones(rows, dtype=torch.long, device=device)
    positions = torch.full((rows,), states.capacity - 1, dtype=torch.long, device=device)
    active = torch.ones(rows, dtype=torch.bool, device=device)
    with PeakMeter(device) as meter:
        model.decode_rows(tokens, positions, active, states, model.rope_table(states.capacity, device))
    return meter


def warm_up(model: Qwen4ExpForCausalLM, device: torch.device, rows: int) -> None:
    """One chunk before any measurement: a process's first forward also pays for lazy set-up (thread
    pools, kernels' scratch), ~18 MiB more than later ones on the tiny model on the CPU. It ends past
    QSA's dense limit, so the indexer's scoring path runs too."""
    capacity = rows + model.config.dense_limit + 1
    run_with_oom_retry(lambda: run_chunk(model, model.new_state(capacity, device), rows, device), device,
                       f"a {rows}-row warm-up chunk")
    release_cached_blocks(device)


def measure_workspace(model: Qwen4ExpForCausalLM, device: torch.device, position: int, rows: int) -> int:
    """The chunk's workspace at `position`: its peak above a one-slot state of capacity `position`."""
    def sample() -> int:
        release_cached_blocks(device)
        return run_chunk(model, model.new_state(position, device), rows, device).peak
    try:
        return run_with_oom_retry(sample, device, f"a {rows}-row chunk at position {position}")
    finally:
        release_cached_blocks(device)


def verify_context(model: Qwen4ExpForCausalLM, device: torch.device, context: int, rows: list[int], slots: int,
                   snapshots: bool, weights: int, available: int) -> list[Verification]:
    """Allocate every slot as the engine does (and one full snapshot per slot when they live here) at
    `context`, run one decode step over all slots and each chunk of `rows` at the last position of the
    first slot, and compare what each chunk (or the decode step, if larger) took with `available`.
    Out of memory (under a CUDA cap) is a miss whose size is unknown, and ends the checks."""
    release_cached_blocks(device)
    held: list = []
    checks: list[Verification] = []
    try:
        batch, states = _allocated(device, lambda: model.new_state_batch(slots, context, device))
        held.append(batch)
        for _ in range(slots if snapshots else 0):
            state, size = _allocated(device, lambda: model.new_state(context, device))
            held.append(state)
            states += size
        decode = run_decode(model, batch, device)
        for n in rows:
            meter = run_chunk(model, batch.rows[0], n, device)
            # CUDA: the allocator's whole reserved peak is what its cap compares against.
            needed = max(meter.peak_total, decode.peak_total) if device.type == "cuda" else \
                weights + states + max(meter.peak, decode.peak)
            checks.append(Verification(context, n, needed, available))
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        checks.append(Verification(context, rows[len(checks)], available + 1, available, out_of_memory=True))
    finally:
        held.clear()
        release_cached_blocks(device)
    return checks
