"""Device memory: the per-process cap, releasing cached blocks, one retry after out-of-memory, peak meters.

CUDA and ROCm are both "cuda" to torch, and everything here uses only the caching allocator's public API
(memory stats, set_per_process_memory_fraction, empty_cache), which HIP builds implement too.

On the CPU there is no allocator to cap: a limit is recorded here and enforced by our own accounting (the
context fit takes it as the capacity and checks its verification against it). Peaks on the CPU are torch's own
allocations, recorded by its profiler; see `PeakMeter`.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch.autograd import DeviceType

T = TypeVar("T")
# torch.OutOfMemoryError is the public name since torch 2.5; the CUDA one is the same class there.
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# Process-wide like torch's own memory fraction, which is per process and per device too.
_limits: dict[str, int] = {}


class DeviceMemoryError(RuntimeError):
    """A device ran out of memory even after its cached blocks were released and the work retried once."""


def human_size(n: int | None) -> str:
    """`n` bytes for people, in binary units ("24.50 GiB"); None when unknown."""
    if n is None:
        return "unknown"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"


def as_device(device: torch.device | str) -> torch.device:
    """A device with its index filled in for CUDA (the allocator's stats are per index)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _key(device: torch.device) -> str:
    return str(device)


def set_device_memory_limit(device: torch.device | str, limit_bytes: int | None) -> None:
    """Cap what this process may hold on `device` (None lifts the cap). CUDA: the caching allocator refuses
    to reserve past limit/total of the device (torch.cuda.set_per_process_memory_fraction). CPU: recorded
    only; the context fit plans and verifies against it."""
    device = as_device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"memory limits are supported on cpu and cuda devices, not {device.type!r}")
    if limit_bytes is None:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        _limits.pop(_key(device), None)
        return
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise ValueError(f"the memory limit for {device} must be a positive number of bytes, got {limit_bytes!r}")
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        if limit_bytes > total:
            raise ValueError(f"the memory limit {human_size(limit_bytes)} for {device} exceeds its total memory "
                             f"of {human_size(total)}")
        torch.cuda.set_per_process_memory_fraction(limit_bytes / total, device)
    _limits[_key(device)] = limit_bytes


def device_memory_limit(device: torch.device | str) -> int | None:
    """The limit set by `set_device_memory_limit` for `device`, or None."""
    return _limits.get(_key(as_device(device)))


def release_cached_blocks(device: torch.device | str) -> None:
    """Give the allocator's cached, unused blocks back to the device (no-op on the CPU)."""
    device = as_device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


def bytes_in_use(device: torch.device | str) -> int | None:
    """Bytes this process holds: the allocator's reserved bytes on CUDA, the resident set on the CPU."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return _proc_status_kib("VmRSS") * 1024 if device.type == "cpu" else None


def is_out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory error, or a RuntimeError that says so (older builds, HIP, the CPU allocator)."""
    if isinstance(err, _OOM):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def run_with_oom_retry(fn: Callable[[], T], device: torch.device | str, what: str | None = None,
                       also: Sequence[torch.device | str] = ()) -> T:
    """Run `fn`; after an out-of-memory error release the cached blocks (of `device` and of the devices `also`
    names: a split model's) and run it once more. A second out-of-memory error becomes a `DeviceMemoryError`
    naming `what`, the bytes in use and the limit."""
    device = as_device(device)
    try:
        return fn()
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    # Out of the except block: the traceback's frames (and the tensors they hold) are gone, so the
    # release below can give their blocks back.
    gc.collect()
    for each in (device, *also):
        release_cached_blocks(each)
    try:
        return fn()
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        limit = device_memory_limit(device)
        if limit is None and device.type == "cuda":
            limit = torch.cuda.mem_get_info(device)[1]
        name = what or getattr(fn, "__name__", "the work")
        where = f"{device}" + (f" or {', '.join(map(str, also))}" if also else "")
        raise DeviceMemoryError(
            f"out of memory on {where} while running {name}, again after releasing cached blocks: "
            f"{human_size(bytes_in_use(device))} in use, limit {human_size(limit)} "
            f"(first error: {first})") from err


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: CPU peak measurement needs Linux")


class PeakMeter:
    """The peak bytes above the starting point while the block runs: `with PeakMeter(dev) as m: ...; m.peak`.

    CUDA: the allocator's peak (reset_peak_memory_stats, then max_memory_allocated and
    max_memory_reserved; the larger rise counts, as the cap applies to reserved blocks). `peak_total` is
    the absolute reserved peak, what the per-process cap compares against.

    CPU: the peak of torch's own CPU allocations, what `max_memory_allocated` is on a GPU: torch's profiler
    records every allocation and free through its CPU allocator (any thread's) in order, and the peak of their
    running sum is the reading. The same work reads the same bytes, whatever else the process or the machine
    does meanwhile; the resident set did not (library pages faulted back in after the kernel reclaimed them
    under load, heap pages kept from earlier work). What torch does not allocate (Python objects, malloc's
    slack) is not counted: the fit's headroom is for that. A process's first forward reads as later ones (its lazy
    set-up is not torch's allocations; on a GPU it is: run one first). `peak_total` is `peak`: the profiler sees
    changes, not what was live before.
    """

    def __init__(self, device: torch.device | str):
        self.device = as_device(device)
        self.start = 0
        self.peak = 0
        self.peak_total = 0
        self._start_reserved = 0
        self._profile = None

    def __enter__(self) -> "PeakMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            self._start_reserved = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            # Kineto logs each profiler start and stop to stderr; a meter is not a profiling session.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            self._profile = torch.autograd.profiler.profile(profile_memory=True)
            self._profile.__enter__()
        else:
            raise ValueError(f"no peak meter for {self.device.type!r} devices")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            self.peak = max(torch.cuda.max_memory_allocated(self.device) - self.start,
                            reserved - self._start_reserved, 0)
            self.peak_total = reserved
            return
        self._profile.__exit__(*exc)
        changes = sorted((event.start_ns(), event.nbytes()) for event in self._profile.kineto_results.events()
                         if event.name() == "[memory]" and event.device_type() == DeviceType.CPU)
        self._profile = None
        live = peak = 0
        for _, change in changes:
            live += change
            peak = max(peak, live)
        self.peak = self.peak_total = peak


def current_device(name: str | torch.device | None) -> contextlib.AbstractContextManager:
    """A GPU named by a split model's placement as the current device while a run of layers is there (nothing for
    the CPU, or for a model on one device: None)."""
    device = None if name is None else torch.device(name)
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
