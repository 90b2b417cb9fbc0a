"""One decoder layer: optional PLE, then a token mixer (Gated DeltaNet or QSA) and the MoE, each behind
its own hyper-connection. One forward for every phase: the step says what runs (ops.py, step.py)."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet
from .hyper import GatedResidual, inject
from .moe import SparseMoeBlock
from .ple import PLELayer
from .qsa import QSAAttention

Injection = tuple[torch.Tensor, torch.Tensor]   # a sublayer's output [T, H] and its per-stream gates [T, hc]


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

    @property
    def mixer(self) -> QSAAttention | GatedDeltaNet:
        return self.self_attn if hasattr(self, "self_attn") else self.linear_attn

    def forward(self, streams: torch.Tensor, step, pending: Injection | None = None
                ) -> tuple[torch.Tensor, Injection]:
        """streams [T, hc*H] -> (streams, this layer's MoE output and gates, not yet injected). `pending` is the
        layer before's: this layer's first norm injects it (one kernel, not two). Every row's numbers depend on
        that row (and, in a chunk, its sequence's earlier tokens) alone."""
        streams, mixed, gates = self.up_to_experts(streams, step, pending)
        return streams, (self.mlp(mixed, step), gates)

    def up_to_experts(self, streams: torch.Tensor, step, pending: Injection | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` up to the MoE: (streams, the MoE's input [T, H], the gates its output is injected with)."""
        term = None
        if self.ple is not None:
            if pending is not None:   # PLE reads the streams: inject first
                streams, pending = inject(streams, *pending), None
            term = self.ple(streams, step, step.state.ple[self.index])
        streams, mixed, gates = self.attn_hyper_connection(streams, step, add=term, inject=pending)
        out = self.mixer(mixed, step, step.state.layers[self.index])
        return self.mlp_hyper_connection(streams, step, inject=(out, gates))
