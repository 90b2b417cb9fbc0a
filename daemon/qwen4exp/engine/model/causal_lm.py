"""The qwen4_exp text model with its LM head: packed multi-sequence forward over explicit state.

Tensor names match transformers' Qwen4ExpForCausalLM (plus `mtp.*`), so a checkpoint loads by name.
A forward takes several sequences at once; rows that do not depend on other positions (projections,
norms, MoE, hyper-connections) run packed, and each sequence's token mixing runs over its own state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..state import SequenceState, StateBatch
from . import row_products
from .config import ModelConfig
from .decoder import DecodeRows, DecoderLayer, SegmentView, hyper_connection
from .mtp import MTPHead
from .rope import Rotary


@dataclass
class Segment:
    """New tokens [n] for one sequence; they go at positions state.length .. state.length + n - 1."""
    token_ids: torch.Tensor
    state: SequenceState


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        ple_index = {layer_id - 1: i for i, layer_id in enumerate(cfg.ple_layer_ids)}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, cfg.is_qsa(i), ple_index.get(i)) for i in range(cfg.num_hidden_layers))
        self.hyper_connection_mixer = hyper_connection(cfg, inject=False)


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if cfg.mtp_num_hidden_layers else None
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def new_state(self, capacity: int, device: torch.device | str | None = None) -> SequenceState:
        param = self.lm_head.weight
        return SequenceState(self.config, capacity, device or param.device, param.dtype,
                             extra_attention_layers=1 if self.mtp is not None else 0)

    def rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..length-1, from a table grown in powers of two (values do not depend on
        the table's size)."""
        dtype = self.lm_head.weight.dtype
        table = self._rope_table
        if table is None or table[0].shape[0] < length or table[0].device != device or table[0].dtype != dtype:
            size = 1 << max(12, (length - 1).bit_length())
            table = self.rotary.cos_sin(torch.arange(size, device=device), dtype)
            self._rope_table = table
        return table[0][:length], table[1][:length]

    @torch.inference_mode()
    def forward(self, segments: list[Segment], all_logits: bool = False) -> list[torch.Tensor]:
        """Run new tokens of several sequences; returns per segment the logits of its last token [V]
        (or of every new token [n, V] with all_logits) and advances each state."""
        views, row = [], 0
        for seg in segments:
            n = seg.token_ids.numel()
            if n == 0:
                raise ValueError("a segment needs at least one token")
            seg.state.check_room(n)
            start = seg.state.length
            cos, sin = self.rope(start + n, seg.token_ids.device)
            views.append(SegmentView(slice(row, row + n), seg.token_ids, start, seg.state, cos, sin))
            row += n
        hidden = self._run(torch.cat([s.token_ids for s in segments]), views)
        if all_logits:
            return [self.lm_head(hidden[v.rows]) for v in views]
        last = torch.stack([hidden[v.rows.stop - 1] for v in views])
        return list(self.lm_head(last))

    def new_state_batch(self, count: int, capacity: int, device: torch.device | str | None = None) -> StateBatch:
        param = self.lm_head.weight
        return StateBatch(self.config, count, capacity, device or param.device, param.dtype,
                          extra_attention_layers=1 if self.mtp is not None else 0)

    def rope_table(self, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..capacity-1 as a table of its own (a captured decode graph keeps it)."""
        return self.rotary.cos_sin(torch.arange(capacity, device=device), self.lm_head.weight.dtype)

    @torch.inference_mode()
    def decode_rows(self, token_ids: torch.Tensor, positions: torch.Tensor, active: torch.Tensor,
                    states: StateBatch, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One decode step over every row of `states` at fixed shapes, with no host synchronisation: row i
        takes token_ids[i] at positions[i]; rows not `active` leave their state as it was (their K/V and
        indexer writes land at their own length, which is never read before it is written again).
        Returns logits [N, V]; a row's logits depend only on its own sequence. Lengths are the caller's
        to advance. Captured once per engine as a CUDA graph on GPUs."""
        return self.decode_rows_impl(token_ids, positions, active, states, rope)

    def decode_rows_impl(self, token_ids, positions, active, states: StateBatch, rope) -> torch.Tensor:
        """decode_rows without its inference-mode wrapper (what torch.compile traces)."""
        positions = positions.clamp(0, states.capacity - 1)
        step = DecodeRows(token_ids, positions, active, active.to(torch.uint8), rope[0], rope[1], states)
        streams = self.model.embed_tokens(token_ids).repeat(1, self.config.hc_count)
        pending = None
        for layer in self.model.layers:
            streams, pending = layer.decode_rows(streams, step, pending)
        _, hidden, _ = self.model.hyper_connection_mixer.update_and_mix(streams, inject=pending, decode=True)
        return row_products.linear(hidden, self.lm_head.weight)

    def _run(self, ids: torch.Tensor, views: list[SegmentView]) -> torch.Tensor:
        streams = self.model.embed_tokens(ids).repeat(1, self.config.hc_count)
        for layer in self.model.layers:
            streams = layer(streams, views)
        hidden, _ = self.model.hyper_connection_mixer.mix(streams)
        for view in views:
            view.state.length += view.token_ids.numel()
        return hidden
