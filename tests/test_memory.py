"""Device memory helpers on the CPU: the --device-memory-limit flag, the recorded limit, the OOM retry, peaks."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from qwen4exp.engine import memory
from qwen4exp.engine.memory import (DeviceMemoryError, PeakMeter, device_memory_limit, human_size,
                                    run_with_oom_retry, set_device_memory_limit)
from qwen4exp.plan_cli import parse_limit

MiB = 1 << 20


@pytest.mark.parametrize("text, expected", [
    ("32GiB", 32 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("268435456", 256 << 20),
    (" 2 kib ", 2048), ("1.5KiB", 1536), ("32G", 32 << 30), (None, None),
])
def test_device_memory_limit_flag(text, expected):
    assert parse_limit(text) == expected


@pytest.mark.parametrize("text, words", [
    ("", "cannot read"), ("lots", "cannot read"), ("-5GiB", "cannot read"), ("1.2.3GB", "cannot read"),
    ("12XB", "unknown size unit 'xb'"), ("0", "more than 0 bytes"), ("0.1B", "more than 0 bytes"),
])
def test_device_memory_limit_flag_errors_say_what_was_wrong(text, words):
    with pytest.raises(ValueError, match=words) as caught:
        parse_limit(text)
    assert str(caught.value).startswith("--device-memory-limit")


def test_human_size():
    assert human_size(512) == "512 B"
    assert human_size(3 * MiB // 2) == "1.50 MiB"
    assert human_size(32 << 30) == "32.00 GiB"
    assert human_size(None) == "unknown"


def test_cpu_limit_is_recorded_and_lifted():
    try:
        set_device_memory_limit("cpu", 256 * MiB)
        assert device_memory_limit("cpu") == 256 * MiB
        assert device_memory_limit(torch.device("cpu")) == 256 * MiB
    finally:
        set_device_memory_limit("cpu", None)
    assert device_memory_limit("cpu") is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive number of bytes"):
            set_device_memory_limit("cpu", bad)
    with pytest.raises(ValueError, match="cpu and cuda"):
        set_device_memory_limit("meta", 1)


class Flaky:
    """Raises `error` for the first `failures` calls, then returns "done"."""

    def __init__(self, error: BaseException, failures: int):
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


@pytest.fixture
def releases(monkeypatch):
    seen = []
    monkeypatch.setattr(memory, "release_cached_blocks", lambda device: seen.append(str(device)))
    return seen


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 999 bytes"),
])
def test_retries_once_after_releasing_cached_blocks(error, releases):
    fn = Flaky(error, failures=1)
    assert run_with_oom_retry(fn, "cpu") == "done"
    assert fn.calls == 2
    assert releases == ["cpu"]


def test_second_out_of_memory_is_a_clear_error(releases):
    fn = Flaky(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), failures=2)
    try:
        set_device_memory_limit("cpu", 256 * MiB)
        with pytest.raises(DeviceMemoryError) as caught:
            run_with_oom_retry(fn, "cpu", what="a 256-row chunk at position 12288")
    finally:
        set_device_memory_limit("cpu", None)
    assert fn.calls == 2 and releases == ["cpu"]
    text = str(caught.value)
    for words in ("out of memory on cpu", "a 256-row chunk at position 12288", "after releasing cached blocks",
                  "in use", "limit 256.00 MiB", "Tried to allocate 2.00 GiB"):
        assert words in text
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_other_errors_are_not_retried(releases):
    fn = Flaky(RuntimeError("shape mismatch"), failures=1)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_with_oom_retry(fn, "cpu")
    assert fn.calls == 1 and releases == []


def test_cpu_peak_meter_counts_what_torch_allocated():
    with PeakMeter("cpu") as idle:
        pass
    with PeakMeter("cpu") as busy:
        block = torch.ones(64 * MiB // 4)
        quarter = block[:16 * MiB // 4].clone()
        del block, quarter
    assert idle.peak == 0
    assert busy.peak == busy.peak_total == 80 * MiB


def _page_out_mapped_files() -> int:
    """Ask the kernel to take back this process's pages of mapped files (torch's libraries among them), as it does
    under memory pressure; the bytes of the mappings it accepted that for."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madv_pageout, accepted = 21, 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if libc.madvise(start, end - start, madv_pageout) == 0:
                accepted += end - start
    return accepted


def test_a_cpu_peak_reads_the_same_after_the_kernel_took_back_torchs_pages():
    """Under memory pressure the kernel takes back a process's pages of torch's library code, and the next forward
    faults them in again; the resident set counted those as the work's memory (28 MiB over a tiny model's chunk),
    which a context fit would take for workspace and serve less context."""
    x = torch.randn(256, 512)

    def work():
        return torch.softmax(x @ x.T, dim=-1).sum()

    with PeakMeter("cpu") as before:
        work()
    assert _page_out_mapped_files() > 0
    with PeakMeter("cpu") as after:
        work()
    assert before.peak == after.peak >= 256 * 256 * 4
