"""What decides whether a Triton kernel may run: Triton present, the model's dtype, the device and its limits.

Every kernel module imports `triton` and `tl` from here (None on a CPU-only install, where nothing here is
launched), and the model's ops backend asks `serves` once, when the model is built or moved. The kernels have
no backward and are written for 16-bit floats: float32 models and training run the torch forms.

Pipeline depth: each stage of a kernel's load pipeline keeps one copy of a loop step's tiles in shared memory
(LDS on AMD GPUs), and a kernel that asks for more than a block may hold does not compile. The stage counts
of row_products.py and moe.py were tuned on an H200 (227 KiB per block); AMD's GPUs give a workgroup 64 KiB,
where those kernels get the stages that fit instead. The depth changes only how far loads run ahead, never
what is summed or in which order, so results are the same at any depth.
"""

from __future__ import annotations

import functools

import torch

try:  # Optional: CPU-only installs never launch a kernel.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = tl = None

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels serve a model on `device` in `dtype`: Triton imported, a CUDA or ROCm device, a
    16-bit float dtype."""
    return triton is not None and device.type == "cuda" and dtype in SUPPORTED_DTYPES


def interpreted(x: torch.Tensor) -> bool:
    """Only Triton's CPU interpreter sees CPU tensors; its bfloat16 tl.dot and rounding need help there."""
    return x.device.type == "cpu"


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
