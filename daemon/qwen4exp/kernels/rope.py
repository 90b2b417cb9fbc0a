"""Rotary position embedding as one Triton kernel (CUDA and ROCm) for bfloat16/float16 tensors.

The torch form (engine/model/rope.py) is six kernels per call (a negation, two concatenations, two products and a
sum); a decode step calls it eight times on the bench preset, for a few rows each, so it was 48 launches of a few
microseconds. The kernel does each row in one pass and rounds where torch's ops round (each product, then
the sum), so its output equals the torch form's bit for bit.
"""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton


def fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes x with these tables: of x's dtype (16-bit: in float32 the compiler could fuse
    the rotation into an FMA, which torch does not)."""
    return cos.dtype == x.dtype


if triton is not None:
    from .rounding import round_to, rounded

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, D: tl.constexpr, RD: tl.constexpr,
                     INTERPRETED: tl.constexpr, BLOCK_D: tl.constexpr):
        """One head of one token: out = x * cos + rotate_half(x) * sin over the first RD channels, the rest
        copied."""
        row = tl.program_id(0).to(tl.int64)
        token = row // heads
        dtype = out_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
        turning = cols < RD
        first_half = cols < RD // 2
        partner = tl.where(first_half, cols + RD // 2, cols - RD // 2)
        other = tl.load(x_ptr + row * D + partner, mask=turning, other=0.0).to(tl.float32)
        other = tl.where(first_half, -other, other)
        cos = tl.load(cos_ptr + token * RD + cols, mask=turning, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * RD + cols, mask=turning, other=0.0).to(tl.float32)
        turned = rounded(rounded(x * cos, dtype, INTERPRETED) + rounded(other * sin, dtype, INTERPRETED), dtype,
                         INTERPRETED)
        tl.store(out_ptr + row * D + cols, round_to(tl.where(turning, turned, x), dtype, INTERPRETED), mask=ok)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's result for x [n, heads, d] or [n, d] and cos/sin [n, rotary_dim]."""
    n, d = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rotary = cos.shape[-1]
    if x.dim() not in (2, 3) or cos.shape != (n, rotary) or sin.shape != cos.shape or rotary > d or rotary % 2:
        raise ValueError(f"rotary tables {tuple(cos.shape)}/{tuple(sin.shape)} do not fit x {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _rope_kernel[(n * heads,)](x, cos.contiguous(), sin.contiguous(), out, heads, D=d, RD=rotary,
                                   INTERPRETED=interpreted(x), BLOCK_D=triton.next_power_of_2(d),
                                   num_warps=1 if d <= 256 else 4)
    return out
