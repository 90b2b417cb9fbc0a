"""What decides whether a Triton kernel may run: Triton present, the model's dtype, the GPU it compiles for.

Every kernel module imports `triton` and `tl` from here (None on a CPU-only install, where nothing here is
launched), and the model's ops backend asks `serves` and `unbuilt_ops` once, when the model is built or moved.
The kernels have no backward and are written for 16-bit floats: float32 models and training run the torch forms.

Targets: CI compiles every kernel, at the shapes the engine launches, for each of CHECKED_TARGETS
(tests/test_kernel_builds.py), with no GPU. The kernels serve NVIDIA GPUs from sm_80 on (bfloat16 MMA) and the
AMD GPUs on that list; any other AMD GPU runs the torch forms rather than kernels nobody compiled for it. An op
whose kernels do not build for a checked target is listed in NOT_BUILT with the reason, and the engine runs
that op's torch form there; the compile test keeps the list true in both directions.

Pipeline depth: each stage of a kernel's load pipeline keeps one copy of a loop step's tiles in shared memory
(LDS on AMD GPUs), and a kernel that asks for more than a block may hold cannot be launched (Triton compiles it
and refuses it at the first launch). The stage counts of row_products.py and moe.py were tuned on an H200 (227
KiB per block); AMD's GPUs give a workgroup 64 KiB, where those kernels get the stages that fit instead. The
depth changes only how far loads run ahead, never what is summed or in which order, so results are the same at
any depth.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import torch

# Triton 3.9 warns that its default for fusing a multiply and an add into one FMA flips in 3.10. The kernels'
# rounding was checked against torch with fusion on (Triton's default so far): keep it unless the operator says.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:  # Optional: CPU-only installs never launch a kernel.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = tl = None

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU as Triton compiles for it, with the limits our kernel choices read."""
    name: str                 # "sm_90", "gfx1201"
    backend: str              # "cuda" or "hip"
    arch: int | str           # 90 for CUDA, "gfx1201" for HIP, as triton's GPUTarget takes them
    warp_size: int
    shared_memory: int | None  # bytes of shared memory (LDS) a block may use; None: not known, no limit applied
    fp8_mma: bool = False     # tensor cores (WMMA on AMD) that multiply FP8: where FP8 weights may feed tl.dot

    def buffers(self, stages: int) -> int:
        """Shared-memory copies of a loop step's tiles that a pipeline of `stages` keeps: AMD's stream pipeliner
        holds one stage in registers (compiled LDS: 1, 2 and 3 copies at 2, 3 and 4 stages); on NVIDIA GPUs all of
        them count (the grouped GEMMs' pipeline keeps them all)."""
        return max(1, stages - 1) if self.backend == "hip" else stages


# The GPUs every kernel is compiled for in CI: the H200 we measure on, the A100 generation, and the seed's box
# (the R9700 is RDNA4, the Strix Halo's iGPU RDNA3.5: wave32, 64 KiB of LDS, WMMA; FP8 WMMA on RDNA4 only).
CHECKED_TARGETS = {target.name: target for target in (
    Target("sm_90", "cuda", 90, 32, 232448, fp8_mma=True),
    Target("sm_80", "cuda", 80, 32, 166912),
    Target("gfx1201", "hip", "gfx1201", 32, 65536, fp8_mma=True),
    Target("gfx1151", "hip", "gfx1151", 32, 65536),
)}

# Ops (TritonOps method names) whose kernels do not build for a checked target: {target name: {op: why}}.
NOT_BUILT: dict[str, dict[str, str]] = {}

_compiling_for: contextvars.ContextVar[Target | None] = contextvars.ContextVar("compiling_for", default=None)


@contextlib.contextmanager
def compiling_for(target: Target):
    """Within this, tensors on the meta device stand for `target`'s device: a model built there picks the
    Triton ops and every kernel choice reads `target`'s limits, so its launches are the ones `target` would run
    (what the compile check records, with no GPU present)."""
    token = _compiling_for.set(target)
    try:
        yield target
    finally:
        _compiling_for.reset(token)


@functools.cache
def _device_target(index: int) -> Target:
    # torch's properties name each device's architecture (the seed's box mixes two AMD generations)
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        backend, arch = "hip", props.gcnArchName.split(":")[0]
        name = arch
    else:
        backend, arch = "cuda", props.major * 10 + props.minor
        name = f"sm_{arch}"
    try:
        shared = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver that does not say: keep the tuned depth
        shared = None
    checked = CHECKED_TARGETS.get(name)
    fp8 = checked.fp8_mma if checked else backend == "cuda" and arch >= 89
    return Target(name, backend, arch, getattr(props, "warp_size", 32), shared, fp8)


def target_of(device: torch.device) -> Target | None:
    """The target a device's kernels compile for: the GPU the driver reports for CUDA/ROCm devices (both are
    torch's "cuda"), the compile check's target for the meta device, None elsewhere."""
    if device.type == "meta":
        return _compiling_for.get()
    if triton is None or device.type != "cuda":
        return None
    return _device_target(device.index if device.index is not None else torch.cuda.current_device())


def why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels do not serve a model on `device` in `dtype`, or None where they do."""
    if triton is None:
        return "Triton is not installed"
    if dtype not in SUPPORTED_DTYPES:
        return f"the kernels are written for bfloat16/float16, the model is {dtype}"
    target = target_of(device)
    if target is None:
        return f"{device} is not a CUDA or ROCm GPU"
    if target.name in CHECKED_TARGETS:
        return None
    if target.backend == "cuda" and int(target.arch) >= 80:
        return None
    if target.backend == "cuda":
        return f"{target.name} has no bfloat16 tensor cores (the kernels need sm_80 or newer)"
    return (f"the kernels are compile-checked for {', '.join(CHECKED_TARGETS)}, not for {target.name}: "
            f"it runs the torch forms")


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels serve a model on `device` in `dtype` (why_not says why not)."""
    return why_not(device, dtype) is None


def unbuilt_ops(device: torch.device) -> dict[str, str]:
    """{op: why} of the ops whose kernels do not build for `device`'s target (their torch forms run there)."""
    target = target_of(device)
    return NOT_BUILT.get(target.name, {}) if target is not None else {}


def interpreted(x: torch.Tensor) -> bool:
    """Only Triton's CPU interpreter sees CPU tensors; its bfloat16 tl.dot and rounding need help there."""
    return x.device.type == "cpu"


def stages_within(target: Target | None, stage_bytes: int, wanted: int) -> int:
    """The most stages up to `wanted` (at least 1) whose buffered tiles fit in `target`'s shared memory;
    `wanted` when the limit is unknown (the CPU interpreter has none)."""
    if target is None or target.shared_memory is None:
        return wanted
    stages = wanted
    while stages > 1 and target.buffers(stages) * stage_bytes > target.shared_memory:
        stages -= 1
    return stages


def stages_for(device: torch.device, stage_bytes: int, wanted: int) -> int:
    """`wanted` pipeline stages of `stage_bytes` each, or as many as fit on `device`."""
    return stages_within(target_of(device), stage_bytes, wanted)
