"""The causal depthwise convolution (with SiLU) of Gated DeltaNet and PLE over each sequence's kept inputs:
one decode step for N rows, or a prompt chunk of one sequence.

On GPUs (bfloat16/float16) each is one Triton kernel. The step reads each row's kept inputs and newest input
once, writes the silu'd output and shifts the kept inputs in place for active rows only (the torch form needs
eight kernels). The chunk reads the projection in its [n, C] layout, where the torch form transposes it to
[C, n] and back around a depthwise conv1d that is slow on that shape (0.44 ms per 4096 x 10240 chunk)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Optional: CPU-only installs use the torch form below.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = tl = None

from .triton_round import interpreted

BLOCK_C = 128


def _fused(x: torch.Tensor) -> bool:
    """A GPU half-precision tensor outside autograd (the kernels have no backward; training runs torch's)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) \
        and not torch.is_grad_enabled()


def causal_conv_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                     active: torch.Tensor) -> torch.Tensor:
    """silu(conv) of each row's newest input x [N, C] over its kept inputs state [N, C, L] (kernel
    weight [C, 1, K], L = (K - 1) * dilation), summed in float32 and rounded to x's dtype. Active rows keep
    their newest L inputs; the others' state stays as it was."""
    if _fused(x):
        return conv_step_kernel(state, x, weight, dilation, active)
    window = torch.cat((state, x[:, :, None]), dim=-1)
    taps = window[:, :, ::dilation]
    out = (taps.float() * weight[:, 0].float()).sum(-1).to(x.dtype)
    state.copy_(torch.where(active.bool()[:, None, None], window[:, :, 1:], state))
    return F.silu(out)


def causal_conv_chunk(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """silu(conv) over the chunk x [n, C] of one sequence that continues its kept inputs state [C, L], summed
    in float32 and rounded to x's dtype ([n, C]); state becomes the last L inputs."""
    kept = state.shape[-1]
    if _fused(x):
        out = conv_chunk_kernel(state, x, weight, dilation)
        state.copy_(torch.cat((state, x[-kept:].t()), dim=-1)[:, -kept:])
        return out
    window = torch.cat((state, x.t()), dim=-1)
    state.copy_(window[:, -kept:])
    return F.silu(F.conv1d(window.unsqueeze(0).to(weight.dtype), weight, groups=weight.shape[0],
                           dilation=dilation)).squeeze(0).t()


if triton is not None:
    from .triton_round import round_to, rounded

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


def conv_step_kernel(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                     active: torch.Tensor) -> torch.Tensor:
    """The Triton form of `causal_conv_step` (x may be a row-strided view)."""
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


def conv_chunk_kernel(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """The Triton form of `causal_conv_chunk`'s output (the caller moves the kept inputs on)."""
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
