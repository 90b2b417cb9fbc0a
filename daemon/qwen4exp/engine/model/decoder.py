"""One decoder layer: optional PLE, then a token mixer (Gated DeltaNet or QSA) and the MoE, each behind
its own hyper-connection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..state import SequenceState, StateBatch
from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet
from .hyper import GatedResidual
from .moe import SparseMoeBlock
from .ple import PLELayer
from .qsa import QSAAttention

Injection = tuple[torch.Tensor, torch.Tensor]   # a sublayer's output [T, H] and its per-stream gates [T, hc]


@dataclass
class SegmentView:
    """One sequence's rows inside a packed forward."""
    rows: slice
    token_ids: torch.Tensor
    start: int
    state: SequenceState
    cos: torch.Tensor   # positions 0..start+n-1
    sin: torch.Tensor


@dataclass
class DecodeRows:
    """One decode step over all N rows of a StateBatch at fixed shapes (a CUDA graph replays it)."""
    token_ids: torch.Tensor   # [N]
    positions: torch.Tensor   # [N], where each row's token goes (its length)
    active: torch.Tensor      # [N] bool; inactive rows compute but keep their state
    flags: torch.Tensor       # active as uint8, converted once per step for the kernels that read it
    cos: torch.Tensor         # rope tables over the whole capacity
    sin: torch.Tensor
    states: StateBatch


def moe_block(cfg: ModelConfig) -> SparseMoeBlock:
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)


def hyper_connection(cfg: ModelConfig, inject: bool = True) -> GatedResidual:
    return GatedResidual(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, inject)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, qsa: bool, ple_index: int | None):
        super().__init__()
        self.index = index
        if qsa:
            self.self_attn = QSAAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = moe_block(cfg)
        self.ple = PLELayer(cfg, ple_index) if ple_index is not None else None
        self.attn_hyper_connection = hyper_connection(cfg)
        self.mlp_hyper_connection = hyper_connection(cfg)

    def forward(self, streams: torch.Tensor, segments: list[SegmentView]) -> torch.Tensor:
        """Packed rows of several sequences; token mixing and PLE run per sequence over its own state."""
        term = None
        if self.ple is not None:
            term = torch.zeros_like(streams)
            for s in segments:
                term[s.rows] = self.ple(streams[s.rows], s.token_ids, s.state.ple[self.index])
        streams, mixed, gates = self.attn_hyper_connection.update_and_mix(streams, add=term)
        mixer_out = torch.zeros_like(mixed)
        for s in segments:
            state = s.state.layers[self.index]
            if hasattr(self, "self_attn"):
                mixer_out[s.rows] = self.self_attn(mixed[s.rows], s.start, s.cos, s.sin, state)
            else:
                mixer_out[s.rows] = self.linear_attn(mixed[s.rows], state)
        streams, mixed, gates = self.mlp_hyper_connection.update_and_mix(streams, inject=(mixer_out, gates))
        return GatedResidual.inject(streams, self.mlp(mixed), gates)

    def decode_rows(self, streams: torch.Tensor, step: DecodeRows, pending: Injection | None = None
                    ) -> tuple[torch.Tensor, Injection]:
        """The same layer for one token per row; every row's numbers depend on that row alone. `pending` is the
        layer before's MoE output and gates, not yet injected into the streams: this layer's first norm kernel
        does it (one kernel, not two). Returns (streams, this layer's own pending injection)."""
        term = None
        if self.ple is not None:
            if pending is not None:   # PLE reads the streams: inject first
                streams, pending = GatedResidual.inject(streams, *pending), None
            term = self.ple.decode_rows(streams, step.token_ids, step.states.ple[self.index], step.active)
        streams, mixed, gates = self.attn_hyper_connection.update_and_mix(streams, add=term, inject=pending,
                                                                          decode=True)
        state = step.states.layers[self.index]
        if hasattr(self, "self_attn"):
            out = self.self_attn.decode_rows(mixed, step.positions, step.cos, step.sin, state, step.active)
        else:
            out = self.linear_attn.decode_rows(mixed, state, step.flags)
        streams, mixed, gates = self.mlp_hyper_connection.update_and_mix(streams, inject=(out, gates), decode=True)
        return streams, (self.mlp(mixed, fixed_rows=True, active=step.flags), gates)
