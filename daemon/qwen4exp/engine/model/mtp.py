"""The multi-token-prediction head shipped under `mtp.*`.

It fuses the embedding of the next token with the main model's final streams (each normalised, then projected by
fc_embedding / fc_hidden), runs one QSA + MoE decoder layer with hyper-connections and collapses the streams with
its own mixer for the shared LM head: at a position it predicts the token after next. The serving engine drafts
with it (engine/speculative.py, through Qwen4ExpForCausalLM.draft_rows / draft_chunk); the training forward trains
it (training.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .decoder import DecoderLayer, hyper_connection
from .norms import RMSNorm


class HeadState:
    """A state as the MTP layer sees it: the layer is built as layer 0 of a stack of its own, so its attention
    cache (a SequenceState's or StateBatch's `extra`) is its `layers`; it has no PLE and carries nothing."""

    def __init__(self, extra: list, capacity: int, length: int = 0):
        self.layers, self.ple, self.capacity, self.length = extra, {}, capacity, length

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise ValueError(f"{self.length} + {new_tokens} positions exceed the capacity of {self.capacity}")


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.hidden_size
        # Registered in the order checkpoints list them (checkpoint/layout.py reads the order from here).
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden * cfg.hc_count, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, 0, qsa=True, ple_index=None) for _ in range(cfg.mtp_num_hidden_layers)])
        self.hyper_connection_mixer = hyper_connection(cfg, inject=False)

    def fuse(self, streams: torch.Tensor, embedded: torch.Tensor, step) -> torch.Tensor:
        """The layer's input streams [T, hc*H]: the main streams [T, hc*H], normalised over their whole width and
        projected stream by stream, plus the next tokens' embeddings [T, H], normalised and projected."""
        ops, hc = step.ops, self.pre_fc_norm_hidden.weight.numel() // self.fc_hidden.weight.shape[1]
        normed = ops.rms_norm(streams, self.pre_fc_norm_hidden).unflatten(-1, (hc, -1))
        fused = ops.linear(normed.flatten(0, 1), self.fc_hidden.weight, step).unflatten(0, (-1, hc))
        embedded = ops.linear(ops.rms_norm(embedded, self.pre_fc_norm_embedding), self.fc_embedding.weight, step)
        return (fused + embedded.unsqueeze(-2)).flatten(-2)

    def forward(self, x: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        """Input streams [T, hc*H] -> (the hidden rows [T, H] for the LM head, the layer's output streams, which a
        further draft reads in place of the main model's)."""
        pending = None
        for layer in self.layers:
            x, pending = layer(x, step, pending)
        x, hidden, _ = self.hyper_connection_mixer(x, step, inject=pending)
        return hidden, x
