"""The causal depthwise convolution (with SiLU) of Gated DeltaNet and PLE over each sequence's kept inputs, in
torch: one decode step for N rows, or a prompt chunk of one sequence. The reference for kernels/conv.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                     active: torch.Tensor) -> torch.Tensor:
    """silu(conv) of each row's newest input x [N, C] over its kept inputs state [N, C, L] (kernel
    weight [C, 1, K], L = (K - 1) * dilation), summed in float32 and rounded to x's dtype. Active rows keep
    their newest L inputs; the others' state stays as it was."""
    window = torch.cat((state, x[:, :, None]), dim=-1)
    taps = window[:, :, ::dilation]
    out = (taps.float() * weight[:, 0].float()).sum(-1).to(x.dtype)
    state.copy_(torch.where(active.bool()[:, None, None], window[:, :, 1:], state))
    return F.silu(out)


def causal_conv_chunk(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """silu(conv) over the chunk x [n, C] of one sequence that continues its kept inputs state [C, L], summed
    in float32 and rounded to x's dtype ([n, C]); state becomes the last L inputs."""
    kept = state.shape[-1]
    window = torch.cat((state, x.t()), dim=-1)
    state.copy_(window[:, -kept:])
    return F.silu(F.conv1d(window.unsqueeze(0).to(weight.dtype), weight, groups=weight.shape[0],
                           dilation=dilation)).squeeze(0).t()


def keep_last_inputs(state: torch.Tensor, x: torch.Tensor) -> None:
    """state [C, L] becomes the last L inputs of its own and the chunk x [n, C] (what a kernel leaves to us): the
    chunk's alone when it has L inputs (one copy, where a concatenation would be a launch more)."""
    kept = state.shape[-1]
    if x.shape[0] >= kept:
        state.copy_(x[x.shape[0] - kept:].t())
    else:
        state.copy_(torch.cat((state, x.t()), dim=-1)[:, -kept:])
