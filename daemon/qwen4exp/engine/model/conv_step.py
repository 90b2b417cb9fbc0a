"""One decode step of a causal depthwise convolution for N rows, shared by Gated DeltaNet and PLE."""

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
    state.copy_(torch.where(active[:, None, None], window[:, :, 1:], state))
    return F.silu(out)
