"""Rounding helpers shared by our Triton kernels, so fused kernels round where torch's low-precision ops do, and
the second kernel of a sum split over programs (`add_parts`)."""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton


if triton is not None:

    @triton.jit
    def _bf16_bits(v):
        """float32 -> the float32 whose low 16 bits are cleared after rounding to nearest even: integer ops,
        so no compiler can fold a float round trip away or fuse it into an FMA."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def round_to(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """float32 -> dtype, to nearest even. Triton's CPU interpreter truncates to bfloat16 (3.9), so there
        the rounding is done on the bits; compiled kernels convert directly."""
        if INTERPRETED and dtype == tl.bfloat16:
            v = _bf16_bits(v)
        return v.to(dtype)

    @triton.jit
    def rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """v rounded to dtype and back to float32: the value a torch op in dtype would hand on. For bfloat16
        on the bits: with a cast round trip (fp32 -> bf16 -> fp32), a compiled kernel's x + rounded(a * b)
        differed from torch's bf16 ops on an H200 by what a skipped product rounding gives."""
        if dtype == tl.bfloat16:
            return _bf16_bits(v)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def silu_mul(gate, up, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """gate, up float32 -> silu(gate) * up in `dtype`, rounded where torch's low-precision ops round."""
        gate = rounded(gate, dtype, INTERPRETED)
        up = rounded(up, dtype, INTERPRETED)
        act = rounded(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETED)
        return round_to(act * up, dtype, INTERPRETED)

    @triton.jit
    def _add_parts_kernel(parts_ptr, out_ptr, size, PARTS: tl.constexpr, DIVISOR: tl.constexpr,
                          INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < size
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for part in tl.static_range(PARTS):
            total += tl.load(parts_ptr + part * size + offsets, mask=ok, other=0.0).to(tl.float32)
        if DIVISOR != 1:
            total = total / DIVISOR
        tl.store(out_ptr + offsets, round_to(total, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)


def add_parts(parts: torch.Tensor, out: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """out = (parts[0] + parts[1] + ...) / divisor for contiguous parts [P, *out.shape]: added in float32 from
    zero in part order and rounded once to out's dtype, so a sum split over programs ends as one fixed sum."""
    size = out.numel()
    _add_parts_kernel[(triton.cdiv(size, 1024),)](parts, out, size, PARTS=parts.shape[0], DIVISOR=divisor,
                                                  INTERPRETED=interpreted(out), BLOCK=1024)
    return out
