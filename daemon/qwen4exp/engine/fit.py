"""`max_ctx = "auto"`: the largest context at which every slot fits on the device, measured there.

The engine measures, the Rust planner decides (estimate mode, fed with measurements), the engine checks:
1. weights (every parameter and buffer) and one slot's state at two capacities: bytes per position and
   fixed bytes (a snapshot of a P-token prefix has the bytes of a state of capacity P);
2. the floor chunk's workspace, run for real at the last positions of a one-slot state, its peak read
   above that state: at the floor and twice the floor, then at each answer, until the answer is a
   measured position (the planner's line is then exact there and extrapolates only past it);
3. verification: every slot (and every on-device snapshot) allocated at the answer, the floor chunk and
   then the planned chunk run at the last position. What the model did not explain becomes a workspace
   sample at that position, which moves the answer down, until a verified context fits.
Not real mode (ContextFit driven by tries): a try at 262144 would allocate every slot at full size, and
under a capped allocator a miss is an out-of-memory error with no shortfall to steer by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import _core
from .fit_measure import (Verification, device_names, layer_homes, measure_states, measure_workspace,
                          placed_weight_bytes, usable_capacity, verify_context, warm_up)
from .memory import DeviceMemoryError, as_device, device_memory_limit, human_size, run_with_oom_retry
from .model.causal_lm import Qwen4ExpForCausalLM
from .model.config import ModelConfig
from .snapshot import snapshots_share_device_memory
from .state import SequenceState

_ROUNDS = 4     # estimates refined by a sample at the answer; a line settles in one or two
_CHECKS = 4     # verifications before giving up; each miss moves the answer down
_STATE_PROBE = 4096     # states of this capacity and twice it give the per-position bytes


class FitError(ValueError):
    """No context can be fitted: an unsupported model, bad settings, or not even the floor fits."""


@dataclass(frozen=True)
class Measured:
    """What was measured on the device; per slot where it says so (the planner multiplies by slots)."""
    device: str
    capacity: int
    capacity_source: str
    weights: int
    slot_bytes_per_position: int
    slot_fixed: int
    workspace: tuple[tuple[int, int], ...]     # (position, bytes) of the floor chunk
    snapshots_on_device: bool


@dataclass
class FitResult:
    context: int
    chunk: int
    plan: _core.Plan
    seconds: float
    measured: Measured | None = None
    planner: _core.Planner | None = None        # the final budget model: evaluate(context + step) misses
    verifications: list[Verification] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    split: tuple[Measured, ...] = ()             # what was measured on each split device (placement.py)


def floor_chunk(chunk: int) -> int:
    """The chunk the fit must hold at the last position: the serving chunk rounded up to the planner's chunk
    granule (CHUNK_ROWS), the same for `serve` and `plan`."""
    return -(-chunk // _core.CHUNK_ROWS) * _core.CHUNK_ROWS


@dataclass(frozen=True)
class ContextChoice:
    """The context to serve: a number that was given (`fit` is None), or the fitted one."""
    context: int
    fit: FitResult | None = None


def model_config(model: torch.nn.Module) -> ModelConfig:
    """The qwen4_exp config, or a refusal: only qwen4_exp's memory is modelled here."""
    if not isinstance(model, Qwen4ExpForCausalLM):
        raise FitError(f"max_ctx = 'auto' is fitted only for qwen4_exp models, not {type(model).__name__}; "
                       f"set max_ctx to a number")
    return model.config


def carried_bytes(model: Qwen4ExpForCausalLM) -> int:
    """One slot's carried state (conv, recurrent and PLE states: StateBatch.allocate_history keeps one per draft
    position), sized without allocating."""
    return sum(SequenceState(model.config, 1, "meta", model.lm_head.weight.dtype).carried_by_layer())


def carried_on(model: Qwen4ExpForCausalLM, name: str, target: str) -> int:
    """`carried_bytes` of the layers on device `name` (the history sits with each carried tensor)."""
    sizes = SequenceState(model.config, 1, "meta", model.lm_head.weight.dtype).carried_by_layer()
    return sum(size for size, home in zip(sizes, layer_homes(model, target)) if home == name)


def resolve_max_ctx(value: str | int, model: torch.nn.Module, **fit_kwargs) -> ContextChoice:
    """The context to serve. A number wins: a positive multiple of the QSA compress ratio, at most the
    trained context ("8192" as text too). "auto" runs `fit_context(model, **fit_kwargs)`."""
    if value == "auto":
        result = fit_context(model, **fit_kwargs)
        return ContextChoice(result.context, result)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FitError(f"max_ctx must be 'auto' or a number of positions, got {value!r}")
    if not isinstance(model, Qwen4ExpForCausalLM):
        raise FitError(f"max_ctx {value}: only qwen4_exp models are served, not {type(model).__name__}")
    ratio, trained = model.config.indexer_compress_ratio, model.config.max_position_embeddings
    if value <= 0 or value % ratio:
        raise FitError(f"max_ctx {value} must be a positive multiple of the QSA compress ratio {ratio} "
                       f"(e.g. {max(ratio, value // ratio * ratio)})")
    if value > trained:
        raise FitError(f"max_ctx {value} is past the model's trained context of {trained} positions")
    return ContextChoice(value)


def budget_planner(device: str, capacity: int, *, weights: int, per_position: int, fixed: int,
                   samples: list[tuple[int, int]], slots: int, snapshots_on_device: bool, headroom: float,
                   trained: int, step: int, floor: int, chunk_floor: int, max_chunk: int,
                   others: tuple = (), snapshot: tuple[int, int] | None = None) -> _core.Planner:
    """The planner's budget model of one slot's measured (or estimated) bytes: `per_position` and `fixed` are one
    slot's, `samples` the floor chunk's workspace at positions; `others` are more devices' DeviceBudgets (a split
    model's); `snapshot`: one snapshot's (per position, fixed) bytes when the slot's state is split over devices
    (a snapshot holds all of it), else the slot's own. The one place both `fit_context` and `plan --estimate`
    build it."""
    snapshot_per_position, snapshot_fixed = snapshot or (per_position, fixed)
    try:
        budget = _core.DeviceBudget(
            device, capacity, bytes_per_position=per_position * slots, weights=weights, graphs=0,
            slot_state=fixed * slots, workspace=samples, snapshot_base=snapshot_fixed if snapshots_on_device else 0,
            snapshot_per_position=snapshot_per_position if snapshots_on_device else 0, slots=slots,
            headroom=headroom)
        return _core.Planner([budget, *others], trained=trained, step=step, floor=floor, floor_chunk=chunk_floor,
                             max_chunk=max_chunk)
    except _core.PlannerError as err:
        raise FitError(f"bad fit settings: {err}") from None


def split_budget(name: str, capacity: int, *, weights: int, per_position: int, fixed: int,
                 samples: list[tuple[int, int]], slots: int, headroom: float) -> _core.DeviceBudget:
    """A split device's budget: its layers' weights and every slot's state of them, and the chunk's workspace
    (it runs the chunk through its layers); snapshots never live there."""
    return _core.DeviceBudget(name, capacity, bytes_per_position=per_position * slots, weights=weights,
                              slot_state=fixed * slots, workspace=samples, slots=slots, headroom=headroom)


def settle_workspace(sample, estimate, samples: list[tuple[int, int]], floor: int, trained: int) -> _core.Plan:
    """Sample the workspace (`sample(position)` appends to `samples`) at the floor and twice the floor, then at
    each answer of `estimate()` until the answer is a sampled position (at most _ROUNDS): the planner's line is
    then exact at the answer and extrapolates only past it."""
    for position in sorted({floor, min(2 * floor, trained)}):
        sample(position)
    plan = estimate()
    for _ in range(_ROUNDS):
        if plan.context in {p for p, _ in samples}:
            break
        sample(plan.context)
        plan = estimate()
    return plan


@dataclass
class _Part:
    """One device's inputs to the fit, as measured: a split model has one per device, the target's first."""
    name: str
    capacity: int
    source: str
    weights: int
    available: int
    per_position: int = 0
    fixed: int = 0
    samples: list[tuple[int, int]] = field(default_factory=list)

    def measured(self, snapshots_on_device: bool) -> Measured:
        return Measured(self.name, self.capacity, self.source, self.weights, self.per_position, self.fixed,
                        tuple(self.samples), snapshots_on_device)


def _parts(model: Qwen4ExpForCausalLM, device: torch.device, memory_limit: int | None, headroom: float,
           host_reserve: int, notes: list[str]) -> list[_Part]:
    """Each device's capacity and weights, the target's first; refused where the weights alone do not fit. A split
    device whose memory is the host's gives `host_reserve` bytes of it to the prefix cache."""
    held = placed_weight_bytes(model, device)
    parts = []
    for name in device_names(model, device):
        here = as_device(name)
        target = name == str(device)
        limit = (memory_limit if memory_limit is not None else device_memory_limit(device)) if target else \
            device_memory_limit(here)
        capacity, source = usable_capacity(here, held[name])
        if limit is not None:
            if limit > capacity:
                notes.append(f"the limit {human_size(limit)} is more than {name} can give ({human_size(capacity)}, "
                             f"{source}): planning with the latter")
            else:
                capacity, source = limit, "memory limit"
        if not target and host_reserve and snapshots_share_device_memory(here):
            capacity, source = max(capacity - host_reserve, 1), f"{source}, less {human_size(host_reserve)} for the " \
                                                                 f"prefix cache in host memory"
        try:        # the planner's own arithmetic (and its check of the headroom)
            available = _core.DeviceBudget(name, capacity, bytes_per_position=0, headroom=headroom).available
        except _core.PlannerError as err:
            raise FitError(f"bad fit settings: {err}") from None
        if held[name] >= available:
            raise FitError(f"the weights alone, {human_size(held[name])}, do not fit in the "
                           f"{human_size(available)} available on {name} ({human_size(capacity)}, {source}, less "
                           f"{headroom:.0%} headroom)")
        parts.append(_Part(name, capacity, source, held[name], available))
    return parts


def fit_context(model: torch.nn.Module, *, slots: int, chunk_floor: int = 256, max_chunk: int = 8192,
                device: torch.device | str, memory_limit: int | None = None, snapshots_on_device: bool,
                headroom: float = 0.1, trained: int = 262144, step: int = 4096, floor: int = 4096,
                verify: bool = True, draft_positions: int = 0, host_reserve: int = 0) -> FitResult:
    """The largest context (a multiple of `step` in [floor, trained]) at which `slots` slots, the floor
    chunk at the last position and (with `snapshots_on_device`) one full snapshot per slot fit in the
    device's capacity less `headroom`; and the largest prompt chunk at that context. A split model (placement.py)
    is fitted on every device at once: each holds its layers' weights and state and runs the chunk through them.

    Capacity: `memory_limit` (the target's), else the limit `set_device_memory_limit` recorded for the device,
    else what the device has (CUDA: free + reserved by us; CPU: MemAvailable + the weights); a split device whose
    memory is the host's less `host_reserve` (the prefix cache's). For a given context, pass trained = step =
    floor = that context: it is checked, not searched.

    Raises:
        FitError: not a qwen4_exp model, bad settings, or even the floor context does not fit (the
            message names the device, what is missing and the whole breakdown).
    """
    started = time.perf_counter()
    cfg = model_config(model)
    device = as_device(device)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise FitError(f"slots must be a positive integer, got {slots!r}")
    if model.lm_head.weight.device != device:
        raise FitError(f"the model's weights are on {model.lm_head.weight.device}, fitting was asked for {device}")
    trained = min(trained, cfg.max_position_embeddings)
    if floor < chunk_floor:
        raise FitError(f"the smallest context, {floor}, is shorter than the floor chunk of {chunk_floor} rows")
    notes = [f"the probes are the planner's budget model over inputs measured on {device}"
             + (f" and {', '.join(device_names(model, device)[1:])}" if model.placement is not None else "") + "; "
             + ("the answer was then verified there" if verify else "the answer was not verified")]
    parts = _parts(model, device, memory_limit, headroom, host_reserve, notes)
    target = parts[0]
    states = run_with_oom_retry(lambda: measure_states(model, device, _STATE_PROBE), device,
                                "one slot's state at two capacities", also=[p.name for p in parts[1:]])
    for part in parts:
        part.per_position, part.fixed = states[part.name]
    # A snapshot holds the whole state, wherever its layers are.
    snapshot = (sum(p.per_position for p in parts), sum(p.fixed for p in parts))
    # Speculative decoding keeps each slot's carried state after every draft position of a verify step, beside
    # each carried tensor.
    for part in parts:
        part.fixed += draft_positions * carried_on(model, part.name, target.name)

    def planner() -> _core.Planner:
        others = tuple(split_budget(p.name, p.capacity, weights=p.weights, per_position=p.per_position,
                                    fixed=p.fixed, samples=p.samples, slots=slots, headroom=headroom)
                       for p in parts[1:])
        return budget_planner(target.name, target.capacity, weights=target.weights,
                              per_position=target.per_position, fixed=target.fixed, samples=target.samples,
                              slots=slots, snapshots_on_device=snapshots_on_device, headroom=headroom,
                              trained=trained, step=step, floor=floor, chunk_floor=chunk_floor, max_chunk=max_chunk,
                              others=others, snapshot=snapshot)

    def estimate(when: str = "") -> _core.Plan:
        budget = planner()
        try:
            return budget.estimate()
        except _core.PlannerError as err:
            where = " and ".join(f"{p.name} with {human_size(p.capacity)} ({p.source})" for p in parts)
            raise FitError(f"cannot fit {slots} slot(s) on {where} and {headroom:.0%} headroom{when}: "
                           f"{err}") from None

    def sample(position: int) -> None:
        try:
            peaks = measure_workspace(model, device, position, chunk_floor)
            for part in parts:
                part.samples.append((position, peaks[part.name]))
        except DeviceMemoryError:
            # Under a cap: the chunk needed more than was left beside one slot, a lower bound that
            # makes the model miss here.
            for part in parts:
                room = part.capacity - part.weights - part.fixed - part.per_position * position
                part.samples.append((position, max(room, 0) + 1))
                notes.append(f"out of memory measuring the chunk at {position}: counted as at least "
                             f"{human_size(room)}" + (f" on {part.name}" if len(parts) > 1 else ""))

    estimate(", before measuring the chunk's workspace")    # the fixed parts alone may not fit
    warm_up(model, device, chunk_floor, slots)
    plan = settle_workspace(sample, estimate, target.samples, floor, trained)
    verifications: list[Verification] = []
    chunk = min(plan.chunk, plan.context)
    if verify:
        for _ in range(_CHECKS):
            rows = [chunk_floor] + ([chunk] if chunk > chunk_floor else [])
            checks = verify_context(model, device, plan.context, rows, slots, snapshots_on_device,
                                    {p.name: p.weights for p in parts}, {p.name: p.available for p in parts})
            verifications += checks
            if all(check.fits for check in checks[:len(parts)]):
                break
            # What the model does not explain is workspace there; the raised line moves the answer down.
            for part, check in zip(parts, checks[:len(parts)]):
                explained = part.weights + slots * (part.fixed + part.per_position * plan.context)
                if snapshots_on_device and part is target:
                    explained += slots * (snapshot[1] + snapshot[0] * plan.context)
                if not check.fits:
                    part.samples.append((plan.context, max(check.needed - explained, 0)))
            plan = estimate()
            chunk = min(plan.chunk, plan.context)
        else:
            short = next(check for check in checks[:len(parts)] if not check.fits)
            raise FitError(f"no context verified on {short.device} after {_CHECKS} checks: the last, "
                           f"{short.context}, needed {human_size(short.needed)} of {human_size(short.available)}")
        if not all(check.fits for check in checks[-len(parts):]):
            worst = next(check for check in checks[-len(parts):] if not check.fits)
            notes.append(f"the planned chunk of {chunk} rows needed {human_size(worst.needed)} of "
                         f"{human_size(worst.available)}" + (f" on {worst.device}" if len(parts) > 1 else "")
                         + f" when run: serving the floor chunk of {chunk_floor}")
            chunk = chunk_floor
    measured = [part.measured(snapshots_on_device and part is target) for part in parts]
    return FitResult(plan.context, chunk, plan, time.perf_counter() - started, measured[0], planner(),
                     verifications, notes, tuple(measured[1:]))
