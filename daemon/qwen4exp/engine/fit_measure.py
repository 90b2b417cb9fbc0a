"""What the context fit measures on the device: capacity, weights, state sizes, the chunk's workspace,
and the verification of an answer with every slot allocated. `fit.py` turns these into a plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .hot_experts import hot_bytes
from .memory import PeakMeter, as_device, is_out_of_memory, release_cached_blocks, run_with_oom_retry
from .model.causal_lm import Qwen4ExpForCausalLM
from .state import SequenceState


@dataclass(frozen=True)
class Verification:
    """One check of a context for real: every slot allocated, a chunk run at the last position."""
    context: int
    rows: int
    needed: int            # weights + allocated states + the chunk's peak (CUDA: the allocator's peak)
    available: int
    out_of_memory: bool = False
    device: str = ""

    @property
    def fits(self) -> bool:
        return not self.out_of_memory and self.needed <= self.available


def weight_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of every parameter and buffer on `device` (a PLE table kept in host memory is not on a GPU's)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
               if _on(t, device))


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index in (None, device.index))


def device_names(model: Qwen4ExpForCausalLM, device: torch.device) -> list[str]:
    """The devices the model's parts live on, the target (`device`) first: a split model's placement, else one."""
    return model.placement.devices if model.placement is not None else [str(device)]


def layer_homes(model: Qwen4ExpForCausalLM, device: torch.device) -> list[str]:
    """Each decoder layer's device name: its placement's, or `device` (the target) for a model on one device."""
    return list(model.placement.layers) if model.placement is not None else [str(device)] * len(model.model.layers)


def placed_weight_bytes(model: Qwen4ExpForCausalLM, device: torch.device) -> dict[str, int]:
    """`weight_bytes` on each of the model's devices, a decoder layer's tensors counted on its placement's device
    (two names may share one physical device)."""
    if model.placement is None:
        return {str(device): weight_bytes(model, device)}
    homes, held = layer_homes(model, device), dict.fromkeys(model.placement.devices, 0)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts = name.split(".")
        where = homes[int(parts[2])] if parts[:2] == ["model", "layers"] else model.placement.target
        if _on(tensor, torch.device(where)):
            held[where] += tensor.numel() * tensor.element_size()
    held[model.placement.target] += hot_bytes(model)       # split layers' experts copied there (not parameters)
    return held


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


def _counted(model: Qwen4ExpForCausalLM, state, names: list[str]) -> dict[str, int]:
    """A state's (or state batch's) bytes on each device by the model's placement."""
    layers, extra = state.nbytes_by_layer()
    held = dict.fromkeys(names, 0)
    held[names[0]] += extra
    for home, size in zip(layer_homes(model, names[0]), layers):
        held[home] += size
    return held


def _allocated(model: Qwen4ExpForCausalLM, device: torch.device, make):
    """`make()` and its bytes on each of the model's devices: the allocator's rise on a GPU, the tensors' sizes on
    the CPU (what torch allocates for them there, as `PeakMeter` counts a CPU's peak)."""
    names = device_names(model, device)
    gpus = {name: as_device(name) for name in names if torch.device(name).type == "cuda"}
    before = {}
    for name, gpu in gpus.items():
        torch.cuda.synchronize(gpu)
        before[name] = torch.cuda.memory_allocated(gpu)
    obj = make()
    counted = _counted(model, obj, names)
    for name, gpu in gpus.items():
        torch.cuda.synchronize(gpu)
        counted[name] = torch.cuda.memory_allocated(gpu) - before[name]
    return obj, counted


def measure_states(model: Qwen4ExpForCausalLM, device: torch.device, capacity: int) -> dict[str, tuple[int, int]]:
    """One slot's (bytes per position, fixed bytes) on each of the model's devices, from states of `capacity` and
    twice that."""
    small, small_bytes = _allocated(model, device, lambda: model.new_state(capacity, device))
    del small
    large, large_bytes = _allocated(model, device, lambda: model.new_state(2 * capacity, device))
    del large
    for name in small_bytes:
        release_cached_blocks(name)
    measured = {}
    for name in small_bytes:
        per_position = -(-(large_bytes[name] - small_bytes[name]) // capacity)
        measured[name] = per_position, max(small_bytes[name] - per_position * capacity, 0)
    return measured


def measure_state(model: Qwen4ExpForCausalLM, device: torch.device, capacity: int) -> tuple[int, int]:
    """One slot's (bytes per position, fixed bytes) on `device`, from states of `capacity` and twice that."""
    return measure_states(model, device, capacity)[str(device)]


class Meters:
    """A PeakMeter on each physical device the model's parts live on, read per device name (names sharing one
    physical device read its one meter)."""

    def __init__(self, model: Qwen4ExpForCausalLM, device: torch.device):
        self.names = device_names(model, device)
        self._physical = {name: _physical(name) for name in self.names}
        self._meters = {key: PeakMeter(key) for key in set(self._physical.values())}

    def __enter__(self) -> "Meters":
        for meter in self._meters.values():
            meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for meter in self._meters.values():
            meter.__exit__(*exc)

    def __getitem__(self, name: str) -> PeakMeter:
        return self._meters[self._physical[name]]


def _physical(name: str) -> torch.device:
    device = as_device(name)
    return device if device.type == "cuda" else torch.device(device.type)


def run_chunk(model: Qwen4ExpForCausalLM, state, rows: int, device: torch.device) -> Meters:
    """Run one `rows`-token chunk at the state's last positions under a meter on each device. Every row is the
    same token, so the MoE sends them all to the same experts: the per-expert loop's largest batch."""
    ids = torch.full((rows,), 1, dtype=torch.long, device=device)
    state.length = state.capacity - rows
    # The RoPE table grows with the position and stays; drop it so this peak pays for the one it needs.
    model.release_rope_table()
    with Meters(model, device) as meters:
        model(ids, state)
    return meters


def run_decode(model: Qwen4ExpForCausalLM, states, device: torch.device) -> Meters:
    """One decode step over every slot at its last position (what the engine's decode graph holds)."""
    rows = len(states.rows)
    tokens = torch.ones(rows, dtype=torch.long, device=device)
    positions = torch.full((rows,), states.capacity - 1, dtype=torch.long, device=device)
    active = torch.ones(rows, dtype=torch.bool, device=device)
    with Meters(model, device) as meters:
        model.decode_rows(tokens, positions, active, states, model.rope_table(states.capacity, device))
    return meters


def _release(model: Qwen4ExpForCausalLM, device: torch.device) -> None:
    for name in device_names(model, device):
        release_cached_blocks(name)


def warm_up(model: Qwen4ExpForCausalLM, device: torch.device, rows: int, slots: int = 1) -> None:
    """One chunk and one decode step over `slots` rows before any measurement: a process's first forward on a GPU
    also pays for lazy set-up (kernels compiled in this process, the BLAS library's workspace), which its peak
    would count. (On the CPU the first forward reads as later ones: lazy set-up is not torch's allocations.) The
    chunk ends past QSA's dense limit, so the indexer's scoring path runs too."""
    capacity = rows + model.config.dense_limit + 1

    def run() -> None:
        run_chunk(model, model.new_state(capacity, device), rows, device)
        run_decode(model, model.new_state_batch(slots, capacity, device), device)

    run_with_oom_retry(run, device, f"a {rows}-row warm-up chunk and decode step",
                       also=device_names(model, device)[1:])
    _release(model, device)


def measure_workspace(model: Qwen4ExpForCausalLM, device: torch.device, position: int, rows: int
                      ) -> dict[str, int]:
    """The chunk's workspace at `position` on each of the model's devices: its peak above a one-slot state of
    capacity `position`."""
    def sample() -> dict[str, int]:
        _release(model, device)
        meters = run_chunk(model, model.new_state(position, device), rows, device)
        return {name: meters[name].peak for name in meters.names}
    try:
        return run_with_oom_retry(sample, device, f"a {rows}-row chunk at position {position}",
                                  also=device_names(model, device)[1:])
    finally:
        _release(model, device)


def verify_context(model: Qwen4ExpForCausalLM, device: torch.device, context: int, rows: list[int], slots: int,
                   snapshots: bool, weights: dict[str, int] | int, available: dict[str, int] | int
                   ) -> list[Verification]:
    """Allocate every slot as the engine does (and one full snapshot per slot on the target when they live there)
    at `context`, run one decode step over all slots and each chunk of `rows` at the last position of the first
    slot, and compare what each chunk (or the decode step, if larger) took on each device with what is
    `available` there: a Verification per chunk and device, the target's first. `weights` and `available` are
    per device name (a number: the target's, for a model on one device).
    Out of memory (under a CUDA cap) is a miss whose size is unknown, and ends the checks."""
    names = device_names(model, device)
    if isinstance(weights, int):
        weights, available = {names[0]: weights}, {names[0]: available}
    _release(model, device)
    held: list = []
    checks: list[Verification] = []
    try:
        batch, states = _allocated(model, device, lambda: model.new_state_batch(slots, context, device))
        held.append(batch)
        for _ in range(slots if snapshots else 0):
            # A snapshot is one buffer where the snapshot backend is: the target's memory, all of it.
            snapshot = SequenceState(model.config, context, device, model.lm_head.weight.dtype,
                                     extra_attention_layers=1 if model.mtp is not None else 0)
            held.append(snapshot)
            states[names[0]] += snapshot.nbytes() if device.type != "cuda" else 0
        decode = run_decode(model, batch, device)
        for n in rows:
            meters = run_chunk(model, batch.rows[0], n, device)
            for name in names:
                meter, step = meters[name], decode[name]
                # CUDA: the allocator's whole reserved peak is what its cap compares against.
                needed = max(meter.peak_total, step.peak_total) if meter.device.type == "cuda" else \
                    weights[name] + states[name] + max(meter.peak, step.peak)
                checks.append(Verification(context, n, needed, available[name], device=name))
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        n = rows[len(checks) // len(names)]
        checks += [Verification(context, n, available[name] + 1, available[name], out_of_memory=True, device=name)
                   for name in names]
    finally:
        held.clear()
        _release(model, device)
    return checks
