"""The gated delta rule in Triton: our decode step for N sequences at once, updating the state in place, and
flash-linear-attention's kernels (when installed) for a prompt chunk.

flash-linear-attention's recurrent kernel returns a new final state, so a decode step that must leave idle
rows untouched would read and write every row's float32 state (3 MB per row and layer on the shipped model)
three more times to blend old and new. This kernel reads and writes each active row's state once, in place,
and skips idle rows altogether. Same arithmetic as fla's recurrent kernel: q and k L2-normalised in float32,
q scaled by 1/sqrt(d_k), then per value column S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = q^T S.
It also computes the gates from the raw projections (g = -exp(A_log) softplus(a + dt_bias) in float32,
beta = sigmoid(b) rounded to the model dtype, as `delta_rule.gates` does) and reads q, k and v in place from
the conv output, saving a decode step some ten small kernels per layer.
"""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton

try:  # flash-linear-attention: optional, GPU only.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _fla_chunk = _fla_recurrent = None

BLOCK_V = 32


if triton is not None:

    from .rounding import rounded

    @triton.jit
    def _step_kernel(q_ptr, k_ptr, v_ptr, qkv_row_stride, a_ptr, b_ptr, gate_row_stride, a_log_ptr, dt_bias_ptr,
                     active_ptr, state_ptr, out_ptr, scale: tl.constexpr, K_HEADS: tl.constexpr,
                     V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, INTERPRETED: tl.constexpr,
                     BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        block = tl.program_id(2)
        cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
        dk = tl.arange(0, DK)
        if tl.load(active_ptr + row) == 0:             # an idle row: its state stays, its output is zeros
            tl.store(out_ptr + (row * V_HEADS + head) * DV + cols, tl.zeros([BLOCK_V], out_ptr.dtype.element_ty))
            return
        k_head = head // (V_HEADS // K_HEADS)
        q = tl.load(q_ptr + row * qkv_row_stride + k_head * DK + dk).to(tl.float32)
        k = tl.load(k_ptr + row * qkv_row_stride + k_head * DK + dk).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(v_ptr + row * qkv_row_stride + head * DV + cols).to(tl.float32)
        decay = tl.load(a_ptr + row * gate_row_stride + head).to(tl.float32) \
            + tl.load(dt_bias_ptr + head).to(tl.float32)
        decay = tl.where(decay > 20.0, decay, tl.log(1.0 + tl.exp(decay)))      # softplus, as torch's threshold
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * decay
        beta = tl.sigmoid(tl.load(b_ptr + row * gate_row_stride + head).to(tl.float32))
        beta = rounded(beta, out_ptr.dtype.element_ty, INTERPRETED)
        s_ptrs = state_ptr + ((row * V_HEADS + head) * DK + dk[:, None]).to(tl.int64) * DV + cols[None, :]
        s = tl.load(s_ptrs) * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        tl.store(s_ptrs, s)
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (row * V_HEADS + head) * DV + cols, out.to(out_ptr.dtype.element_ty))


def _laid_out(x: torch.Tensor, row_stride: int, head_dim: int) -> bool:
    """Whether x [N, H, d] has strides (row_stride, d, 1); a dimension of size 1 may have any stride (a lone row's
    view often does), since only index 0 is read there."""
    wanted = (row_stride, head_dim, 1)
    return all(size == 1 or stride == want for size, stride, want in zip(x.shape, x.stride(), wanted))


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, active: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """q,k [N, Hk, dk], v [N, Hv, dv] (views of one [N, C] conv output row are fine), the raw gate projections
    a/b [N, Hv] (views of one projection's rows are fine too), the per-head A_log and dt_bias [Hv], active [N]
    bool or uint8, state [N, Hv, dk, dv] float32
    (advanced in place for active rows). Returns o [N, Hv, dv] in v's dtype (zeros for idle rows)."""
    rows, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    block_v = min(BLOCK_V, dv)
    row_stride = q.stride(0)
    if dv % block_v or block_v & (block_v - 1) or dk & (dk - 1) or not state.is_contiguous():
        raise ValueError(f"unsupported shapes for the decode kernel: dk {dk}, dv {dv}")
    if not (_laid_out(q, row_stride, dk) and _laid_out(k, row_stride, dk) and _laid_out(v, row_stride, dv)):
        raise ValueError("q, k and v must share one row stride, with heads contiguous inside a row")
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _step_kernel[(rows, v_heads, dv // block_v)](
        q, k, v, row_stride, a, b, a.stride(0), a_log, dt_bias, active.to(torch.uint8), state, out,
        dk ** -0.5, K_HEADS=k_heads, V_HEADS=v_heads, DK=dk, DV=dv, INTERPRETED=interpreted(v), BLOCK_V=block_v,
        num_warps=4)
    return out


def fla_available() -> bool:
    return _fla_chunk is not None


def fla_chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence's new tokens through fla (same contract as engine/model/delta_rule.gated_delta_rule; fla maps
    value head h to key head h // (Hv / Hk) itself)."""
    kernel = _fla_recurrent if q.shape[0] == 1 else _fla_chunk
    out, final = kernel(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    return out[0]
