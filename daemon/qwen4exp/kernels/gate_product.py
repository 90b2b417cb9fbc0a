"""act(gate) * x in one launch, act silu or sigmoid: the shared expert's SwiGLU input to its down projection
(silu) and QSA's gated attention output (sigmoid). Their torch forms are two element-wise kernels each (three
for QSA, whose gate is a strided view that reshape copies); in a decode step of the full model (48 MoE and 12
QSA layers) that is 132 launches of a few rows each. Same rounding points as the torch forms: act computed in
float32 from the stored gate and rounded to the dtype, its product with x rounded once."""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton

BLOCK = 1024        # values a program: a row's gate of the full model's shared expert (640) in one program


if triton is not None:
    from .rounding import round_to, rounded, silu_mul

    @triton.jit
    def _gate_product_kernel(x_ptr, gate_ptr, out_ptr, width, x_row, x_group, gate_row, gate_group,
                             SILU: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        row, group = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * x_row + group * x_group + cols, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + row * gate_row + group * gate_group + cols, mask=ok, other=0.0).to(tl.float32)
        if SILU:
            out = silu_mul(gate, x, dtype, INTERPRETED)
        else:
            out = round_to(rounded(1.0 / (1.0 + tl.exp(-gate)), dtype, INTERPRETED) * x, dtype, INTERPRETED)
        tl.store(out_ptr + (row * tl.num_programs(1) + group) * width + cols, out, mask=ok)


def fits(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernel takes x and gate [rows, width] or [rows, groups, width]: the same shape and dtype, the
    last axis contiguous (other strides are the kernel's arguments)."""
    return (x.shape == gate.shape and x.dtype == gate.dtype and x.dim() in (2, 3) and x.stride(-1) == 1
            and gate.stride(-1) == 1)


def gate_product(x: torch.Tensor, gate: torch.Tensor, silu: bool) -> torch.Tensor:
    """x, gate [rows, width] or [rows, groups, width] -> act(gate) * x [rows, groups * width] (contiguous), act
    silu or sigmoid, in x's dtype."""
    if not fits(x, gate):
        raise ValueError(f"gate product: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, gate {tuple(gate.shape)} "
                         f"{gate.dtype} stride {gate.stride()}")
    if x.dim() == 2:
        x, gate = x.unsqueeze(1), gate.unsqueeze(1)
    rows, groups, width = x.shape
    out = torch.empty(rows, groups * width, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(BLOCK, triton.next_power_of_2(width))
        grid = (rows, groups, triton.cdiv(width, block))
        _gate_product_kernel[grid](x, gate, out, width, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
                                   SILU=silu, INTERPRETED=interpreted(x), BLOCK=block,
                                   num_warps=max(1, min(4, block // 256)))
    return out
