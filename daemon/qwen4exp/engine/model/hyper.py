"""Hyper-connections: the residual is hc_count streams wide; each sublayer reads a learned mix of the
streams and writes its output back into every stream with its own gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import RMSNorm
from .shared_input import SharedInputProjections


class GatedResidual(SharedInputProjections):
    def __init__(self, hidden: int, hc_count: int, lowrank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hidden, self.hc_count = hidden, hc_count
        width = hidden * hc_count
        self.hc_norm = RMSNorm(width, eps, group_size=hidden)
        self.input_mix_weight_down = nn.Linear(width, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, hc_count, bias=False) if inject else None
        self.stack_input_weights()

    def input_weights(self) -> list[nn.Parameter]:
        """The mixing's down projection and the injection gates' read the normed streams: one product."""
        inject = [self.block_inject_weight.weight] if self.block_inject_weight is not None else []
        return [self.input_mix_weight_down.weight, *inject]

    def forward(self, streams: torch.Tensor, step, add: torch.Tensor | None = None,
                inject: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """streams [T, hc*H], after first adding `add` [T, hc*H] or injecting (output, gates) into them ->
        (the new streams, the sublayer input [T, H], per-stream injection gates [T, hc] or None). On GPUs the
        update, the norm and the mixing's element-wise work run as fused kernels around the two low-rank
        projections."""
        ops = step.ops
        streams, normed = ops.update_and_norm(streams, self.hc_norm, add, inject)
        down, *gate_logits = self.project_input(normed, step)
        mixed, gates = ops.mix_streams(down, self.input_mix_weight_up.weight, normed, self.hc_count,
                                       gate_logits[0] if gate_logits else None, step)
        return streams, mixed, gates


def mix_streams(down: torch.Tensor, up_weight: torch.Tensor, normed: torch.Tensor, hc: int,
                gate_logits: torch.Tensor | None, product=F.linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch form of the mixing: weights sigmoid(up(silu(down / hc))) per stream channel, the mean of the
    weighted normed streams [T, H], and the injection gates 2 sigmoid(logits / hc) [T, hc] (or None). `product`
    multiplies by the up projection (ops.decode_product in a decode step)."""
    hidden = normed.shape[-1] // hc
    weights = torch.sigmoid(product(F.silu(down / hc), up_weight)).unflatten(-1, (hc, hidden))
    mixed = (weights * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    return mixed, None if gate_logits is None else 2 * torch.sigmoid(gate_logits / hc)


def inject(streams: torch.Tensor, output: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Add the sublayer output [T, H] to every stream, scaled by that stream's gate."""
    return streams + (output.unsqueeze(-2) * gates.unsqueeze(-1)).flatten(-2)
