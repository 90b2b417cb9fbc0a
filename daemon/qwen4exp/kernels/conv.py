"""The causal depthwise convolution (with SiLU) of Gated DeltaNet and PLE as Triton kernels, for bfloat16/float16.

The step (N rows, one new input each) reads each row's kept inputs and newest input once, writes the silu'd
output and shifts the kept inputs in place for active rows only (the torch form needs eight kernels). The
chunk reads the projection in its [n, C] layout, where the torch form transposes it to [C, n] and back around
a depthwise conv1d that is slow on that shape. Both sum in float32 and round to x's dtype where the torch forms
(engine/model/conv.py) do."""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton

BLOCK_C = 128


if triton is not None:
    from .rounding import round_to, rounded

    @triton.jit
    def _conv_chunk_kernel(state_ptr, x_ptr, weight_ptr, out_ptr, n, channels, L: tl.constexpr, K: tl.constexpr,
                           DILATION: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_C: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t_ok, c_ok = t < n, c < channels
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(K):
            source = t + (k * DILATION - L)       # < 0: one of the kept inputs, at L + source
            from_x = tl.load(x_ptr + source[:, None].to(tl.int64) * channels + c[None, :],
                             mask=(t_ok & (source >= 0))[:, None] & c_ok[None, :], other=0.0)
            from_state = tl.load(state_ptr + c[None, :] * L + (L + source)[:, None],
                                 mask=(t_ok & (source < 0))[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(weight_ptr + c * K + k, mask=c_ok, other=0.0).to(tl.float32)
            acc += tl.where((source >= 0)[:, None], from_x, from_state).to(tl.float32) * w[None, :]
        dtype = out_ptr.dtype.element_ty
        conv = rounded(acc, dtype, INTERPRETED)
        tl.store(out_ptr + t[:, None].to(tl.int64) * channels + c[None, :],
                 round_to(conv / (1.0 + tl.exp(-conv)), dtype, INTERPRETED), mask=t_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _conv_step_kernel(state_ptr, x_ptr, x_row_stride, weight_ptr, active_ptr, out_ptr, channels,
                          L: tl.constexpr, K: tl.constexpr, DILATION: tl.constexpr, INTERPRETED: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < channels
        taps = tl.arange(0, BLOCK_L)                  # window position: 0..L-1 kept inputs, L the new one
        state_row = state_ptr + row * channels * L + c[:, None] * L
        newest = tl.load(x_ptr + row * x_row_stride + c, mask=c_ok, other=0.0)
        kept = tl.load(state_row + taps[None, :], mask=c_ok[:, None] & (taps[None, :] < L), other=0.0)
        # What kept input p becomes: window position p + 1. Read before any thread stores.
        ahead = tl.load(state_row + taps[None, :] + 1, mask=c_ok[:, None] & (taps[None, :] + 1 < L), other=0.0)
        window = tl.where(taps[None, :] < L, kept, newest[:, None]).to(tl.float32)
        on_tap = (taps % DILATION == 0) & (taps <= L)
        w = tl.load(weight_ptr + c[:, None] * K + taps[None, :] // DILATION,
                    mask=c_ok[:, None] & on_tap[None, :], other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        conv = rounded(tl.sum(window * w, axis=1), dtype, INTERPRETED)
        tl.store(out_ptr + row * channels + c, round_to(conv / (1.0 + tl.exp(-conv)), dtype, INTERPRETED),
                 mask=c_ok)
        shifted = tl.where(taps[None, :] + 1 < L, ahead, newest[:, None])
        tl.debug_barrier()   # every thread's reads of the kept inputs are done before they are overwritten
        if tl.load(active_ptr + row) != 0:
            tl.store(state_row + taps[None, :], shifted, mask=c_ok[:, None] & (taps[None, :] < L))

    @triton.jit(do_not_specialize=["rows", "substeps"])     # one binary for every verify step's shape
    def _conv_substeps_kernel(state_ptr, history_ptr, x_ptr, x_row_stride, weight_ptr, active_ptr, out_ptr, channels,
                              rows, substeps, L: tl.constexpr, K: tl.constexpr, DILATION: tl.constexpr,
                              INTERPRETED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr):
        """A verify step's `substeps` inputs of one state row (sub-step j's at row j * rows + row), each sub-step
        _conv_step_kernel's work on the kept inputs the one before left in place; the kept inputs after every
        sub-step but the last go to history[j]."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < channels
        taps = tl.arange(0, BLOCK_L)
        in_state = c_ok[:, None] & (taps[None, :] < L)
        state_at = row * channels * L + c[:, None] * L + taps[None, :]
        plane = rows.to(tl.int64) * channels * L
        on_tap = (taps % DILATION == 0) & (taps <= L)
        w = tl.load(weight_ptr + c[:, None] * K + taps[None, :] // DILATION,
                    mask=c_ok[:, None] & on_tap[None, :], other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        for j in range(substeps):
            r = j * rows + row
            newest = tl.load(x_ptr + r * x_row_stride + c, mask=c_ok, other=0.0)
            kept = tl.load(state_ptr + state_at, mask=in_state, other=0.0)
            ahead = tl.load(state_ptr + state_at + 1, mask=c_ok[:, None] & (taps[None, :] + 1 < L), other=0.0)
            window = tl.where(taps[None, :] < L, kept, newest[:, None]).to(tl.float32)
            conv = rounded(tl.sum(window * w, axis=1), dtype, INTERPRETED)
            tl.store(out_ptr + r * channels + c, round_to(conv / (1.0 + tl.exp(-conv)), dtype, INTERPRETED),
                     mask=c_ok)
            active = tl.load(active_ptr + r) != 0
            if active:
                kept = tl.where(taps[None, :] + 1 < L, ahead, newest[:, None])
            tl.debug_barrier()     # every thread's reads of the kept inputs are done before they are overwritten
            if active:             # an idle row is not written, as _conv_step_kernel leaves it
                tl.store(state_ptr + state_at, kept, mask=in_state)
            if j < substeps - 1:
                tl.store(history_ptr + j * plane + state_at, kept, mask=in_state)
            tl.debug_barrier()     # and the next sub-step reads what this one stored


def conv_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                     active: torch.Tensor) -> torch.Tensor:
    """The kernel form of conv.causal_conv_step (x may be a row-strided view)."""
    rows, channels, kept = state.shape
    taps = weight.shape[-1]
    if kept != (taps - 1) * dilation or not state.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"conv state {tuple(state.shape)} does not fit a {taps}-tap kernel at dilation {dilation}")
    out = torch.empty(rows, channels, device=x.device, dtype=x.dtype)
    grid = (rows, triton.cdiv(channels, BLOCK_C))
    _conv_step_kernel[grid](state, x, x.stride(0), weight, active.to(torch.uint8), out, channels, L=kept, K=taps,
                            DILATION=dilation, INTERPRETED=interpreted(x), BLOCK_C=BLOCK_C,
                            BLOCK_L=triton.next_power_of_2(kept + 1), num_warps=4)
    return out


def conv_substeps(state: torch.Tensor, history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                  active: torch.Tensor, substeps: int) -> torch.Tensor:
    """A verify step's `substeps` conv steps in one launch: x [substeps * N, C] position-major (sub-step j's rows
    [j*N, (j+1)*N)), active [substeps * N]; each row's output is what `conv_step` gives it, sub-step after sub-step,
    and history [>= substeps - 1, N, C, kept] gets the kept inputs after each sub-step but the last."""
    rows, channels, kept = state.shape
    taps = weight.shape[-1]
    if kept != (taps - 1) * dilation or not state.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"conv state {tuple(state.shape)} does not fit a {taps}-tap kernel at dilation {dilation}")
    if x.shape[0] != rows * substeps or history.shape[0] < substeps - 1 or history.shape[1:] != state.shape \
            or not history.is_contiguous():
        raise ValueError(f"a verify step of {substeps} sub-steps over {x.shape[0]} rows does not fit a conv state "
                         f"of {tuple(state.shape)} and a history of {tuple(history.shape)}")
    out = torch.empty(x.shape[0], channels, device=x.device, dtype=x.dtype)
    grid = (rows, triton.cdiv(channels, BLOCK_C))
    _conv_substeps_kernel[grid](state, history, x, x.stride(0), weight, active.to(torch.uint8), out, channels, rows,
                                substeps, L=kept, K=taps, DILATION=dilation, INTERPRETED=interpreted(x),
                                BLOCK_C=BLOCK_C, BLOCK_L=triton.next_power_of_2(kept + 1), num_warps=4)
    return out


def conv_chunk(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """The kernel form of conv.causal_conv_chunk's output (the caller moves the kept inputs on)."""
    channels, kept = state.shape
    n, taps = x.shape[0], weight.shape[-1]
    if kept != (taps - 1) * dilation or x.shape[1] != channels:
        raise ValueError(f"conv state {tuple(state.shape)} does not fit x {tuple(x.shape)} and a {taps}-tap "
                         f"kernel at dilation {dilation}")
    x, state = x.contiguous(), state.contiguous()
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, 32), triton.cdiv(channels, BLOCK_C))
    _conv_chunk_kernel[grid](state, x, weight, out, n, channels, L=kept, K=taps, DILATION=dilation,
                             INTERPRETED=interpreted(x), BLOCK_T=32, BLOCK_C=BLOCK_C, num_warps=4)
    return out
