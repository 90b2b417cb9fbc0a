"""The Gated DeltaNet output norm (norms.GatedRMSNorm) as one Triton kernel for bfloat16/float16 on GPUs,
in place of the dozen element-wise kernels of its torch form. Same rounding points: the normalised row is
rounded to the model dtype, scaled by the weight and rounded again, then multiplied by act(gate) computed in
float32, and the product rounded once."""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton


if triton is not None:
    from .rounding import round_to, rounded

    @triton.jit
    def _gated_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, eps: tl.constexpr, DIM: tl.constexpr,
                           SILU: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < DIM
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * DIM + cols, mask=ok, other=0.0).to(tl.float32)
        normed = rounded(x / tl.sqrt(tl.sum(x * x, axis=0) / DIM + eps), dtype, INTERPRETED)
        scaled = rounded(tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed, dtype, INTERPRETED)
        gate = tl.load(gate_ptr + row * DIM + cols, mask=ok, other=0.0).to(tl.float32)
        if SILU:
            gate = gate * tl.sigmoid(gate)
        else:
            gate = tl.sigmoid(gate)
        tl.store(out_ptr + row * DIM + cols, round_to(scaled * gate, dtype, INTERPRETED), mask=ok)


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, silu: bool) -> torch.Tensor:
    """x, gate [..., D] -> weight * rmsnorm(x) * act(gate), act silu or sigmoid, in x's dtype."""
    dim = x.shape[-1]
    if gate.shape != x.shape or weight.numel() != dim:
        raise ValueError(f"gated norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    flat, gates = x.reshape(-1, dim).contiguous(), gate.reshape(-1, dim).contiguous()
    out = torch.empty_like(flat)
    if flat.shape[0]:
        block = triton.next_power_of_2(dim)
        _gated_norm_kernel[(flat.shape[0],)](flat, gates, weight, out, eps, DIM=dim, SILU=silu,
                                             INTERPRETED=interpreted(x), BLOCK=block,
                                             num_warps=max(1, min(8, block // 256)))
    return out.view(x.shape)
