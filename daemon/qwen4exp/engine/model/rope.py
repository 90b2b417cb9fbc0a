"""Partial rotary position embedding on text positions.

qwen4_exp uses M-RoPE, but for text the temporal, height and width positions are all equal, so the
sectioned frequencies collapse to plain RoPE over the first `rotary_dim` channels of each head.
"""

from __future__ import annotations

import torch


class Rotary:
    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for integer positions [n] -> two [n, rotary_dim] tensors, rounded to `dtype`."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [n, heads, d] (or [n, d]) by cos/sin [n, rotary_dim] (the
    torch form of kernels/rope.py)."""
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)
