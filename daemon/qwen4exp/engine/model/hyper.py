"""Hyper-connections: the residual is hc_count streams wide; each sublayer reads a learned mix of the
streams and writes its output back into every stream with its own gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import hyper_kernels
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

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, hc*H] -> (sublayer input [T, H], per-stream injection gates [T, hc] or None)."""
        return self.update_and_mix(streams)[1:]

    def update_and_mix(self, streams: torch.Tensor, add: torch.Tensor | None = None,
                       inject: tuple[torch.Tensor, torch.Tensor] | None = None, decode: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`mix` after first adding `add` [T, hc*H] or injecting (output, gates) into the streams; returns
        (the new streams, sublayer input, gates). On GPUs the update, the norm and the mixing's element-wise
        work run as fused kernels (norm_rows, mix_streams) around the two low-rank projections. `decode`: the
        rows are a decode step's (project_input's)."""
        if self._fused(streams):
            streams, normed = hyper_kernels.norm_rows(streams, self.hc_norm.weight, self.hc_norm.eps, self.hidden,
                                                      add, inject)
            down, *gate_logits = self.project_input(normed, decode)
            mixed, gates = hyper_kernels.mix_streams(down, self.input_mix_weight_up.weight, normed, self.hc_count,
                                                     gate_logits[0] if gate_logits else None)
            return streams, mixed, gates
        if add is not None:
            streams = streams + add
        elif inject is not None:
            streams = self.inject(streams, *inject)
        normed = self.hc_norm(streams)
        down, *gate_logits = self.project_input(normed)
        weights = F.silu(down / self.hc_count)
        weights = torch.sigmoid(self.input_mix_weight_up(weights)).unflatten(-1, (self.hc_count, self.hidden))
        mixed = (weights * normed.unflatten(-1, (self.hc_count, self.hidden))).mean(dim=-2)
        if not gate_logits:
            return streams, mixed, None
        return streams, mixed, 2 * torch.sigmoid(gate_logits[0] / self.hc_count)

    def _fused(self, streams: torch.Tensor) -> bool:
        hc = self.hc_count
        return hyper_kernels.usable(streams) and hc & (hc - 1) == 0 and self.input_mix_weight_down.out_features >= 16

    @staticmethod
    def inject(streams: torch.Tensor, output: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Add the sublayer output [T, H] to every stream, scaled by that stream's gate."""
        return streams + (output.unsqueeze(-2) * gates.unsqueeze(-1)).flatten(-2)
