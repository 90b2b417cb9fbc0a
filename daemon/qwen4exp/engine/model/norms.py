"""RMSNorm variants of qwen4_exp. Both normalise in float32 and round once at the end, like the reference. A module's
own forward is the torch form; layers call them through their ops backend (kernels/hyper.py's norm_rows and
kernels/gated_norm.py on GPUs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x / rms(x) * (1 + w). With `group_size`, each group is normalised alone
    (the hyper-connection streams are normalised one stream at a time)."""

    def __init__(self, dim: int, eps: float, group_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.group_size is not None:
            xf = xf.unflatten(-1, (-1, self.group_size))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group_size is not None:
            xf = xf.flatten(-2)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: rms-normalise, scale by w (plain, not zero-centred), gate by act(z)."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.silu = activation == "silu"
        self.activation = F.silu if self.silu else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # The scale is applied in the model dtype before the float32 gate, as the reference rounds there.
        return (self.weight * xf.to(dtype) * self.activation(gate.float())).to(dtype)
