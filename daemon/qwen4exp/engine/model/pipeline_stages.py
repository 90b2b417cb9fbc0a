"""How deep a Triton kernel's load pipeline may go on a device.

Each pipeline stage keeps one copy of the tiles a loop step loads in shared memory (LDS on AMD GPUs), and a
kernel that asks for more than a block may hold does not compile. The stage counts of row_products.py and
moe_kernels.py's grouped GEMMs were tuned on an H200 (227 KiB per block: 4 stages of 24 KiB tiles); AMD's
GPUs give a workgroup 64 KiB, where those kernels get the stages that fit instead. The stage count changes
only how far loads run ahead, never what is summed or in which order, so results are the same at any depth.
"""

from __future__ import annotations

import functools

import torch

try:  # Optional: CPU-only installs never launch a kernel.
    import triton
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None


def stages_within(limit_bytes: int | None, stage_bytes: int, wanted: int) -> int:
    """The most stages up to `wanted` (at least 1) whose tiles fit in `limit_bytes`; `wanted` when the limit
    is unknown."""
    if limit_bytes is None:
        return wanted
    return max(1, min(wanted, limit_bytes // stage_bytes))


@functools.cache
def _shared_memory(index: int) -> int | None:
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver that does not say: keep the tuned depth
        return None


def shared_memory_bytes(device: torch.device) -> int | None:
    """Shared memory a block may use on a CUDA/ROCm device, as Triton reads it; None elsewhere (the CPU
    interpreter has no limit) or when the driver does not say."""
    if triton is None or device.type != "cuda":
        return None
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def stages_for(device: torch.device, stage_bytes: int, wanted: int) -> int:
    """`wanted` pipeline stages of `stage_bytes` each, or as many as fit on `device`."""
    return stages_within(shared_memory_bytes(device), stage_bytes, wanted)
