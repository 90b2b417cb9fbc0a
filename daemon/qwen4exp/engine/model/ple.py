"""Per-Layer Embedding (PLE): hashed token n-grams injected into every hyper-connection stream.

Each token's 2..ngram_size-grams (reset at EOS: an n-gram never reaches back across an end of text) are
hashed into prime-sized tables; the embeddings are projected to one value and one key per stream, the
stream activations gate the value, and a dilated depthwise conv adds local context.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..state import PLEState
from . import ngram_hash
from .config import ModelConfig
from .norms import RMSNorm


class NGramEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ple_layer_index: int):
        super().__init__()
        self.ngram_size = cfg.ngram_size
        self.heads_per_ngram = cfg.heads_per_ngram
        self.eos = cfg.eos_token_id
        given = cfg.ple_hash
        if given is not None:   # the checkpoint's own constants (a GGUF stores them, not their seed)
            sizes, multipliers, offsets, rows = (list(given.head_vocab_sizes), list(given.layer_multipliers),
                                                 list(given.head_offsets), given.table_rows)
        else:
            sizes = ngram_hash.head_vocab_sizes(cfg.ngram_vocab_size_base, cfg.ngram_heads, ple_layer_index)
            multipliers = ngram_hash.layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_layer_index, cfg.seed)
            offsets = ngram_hash.head_offsets(sizes)
            rows = ngram_hash.padded_table_rows(sizes, cfg.make_ngram_vocab_size_divisible_by)
        self._constants = {
            "layer_multipliers": multipliers,
            "ngram_heads_vocab_sizes": sizes,
            "ngram_heads_offsets": offsets,
        }
        for name, values in self._constants.items():
            self.register_buffer(name, torch.tensor(values, dtype=torch.long))
        self.ngram_embedding = nn.Embedding(rows, cfg.ple_embed_dim // cfg.ngram_heads)

    def reset_constants(self) -> None:
        """Write the derived hash constants into the buffers (after allocating without initialising)."""
        for name, values in self._constants.items():
            getattr(self, name).copy_(torch.tensor(values, dtype=torch.long))

    def _shifted(self, history: torch.Tensor, shift: int) -> torch.Tensor:
        """history[p - shift] where that token is in p's EOS-delimited segment, else EOS."""
        if shift == 0:
            return history
        positions = torch.arange(history.numel(), device=history.device)
        eos_at = torch.where(history == self.eos, positions, torch.full_like(positions, -1))
        last_eos_through = torch.cummax(eos_at, dim=0).values
        last_eos_before = torch.cat((last_eos_through.new_full((1,), -1), last_eos_through[:-1]))
        source = positions - shift
        valid = (source >= 0) & (positions - (last_eos_before + 1) >= shift)
        return torch.where(valid, history[source.clamp_min(0)], torch.full_like(history, self.eos))

    def hash_ids(self, history: torch.Tensor, count: int) -> torch.Tensor:
        """Table rows [count, heads] for the last `count` tokens of `history`."""
        return self._hash([self._shifted(history, s) for s in range(self.ngram_size)])[-count:]

    def _hash(self, shifted: list[torch.Tensor]) -> torch.Tensor:
        """Table rows [..., heads] from each token and its 1..ngram_size-1 predecessors (shifted[s])."""
        groups = []
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.layer_multipliers[0]
            for s in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[s] * self.layer_multipliers[s])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            rows = torch.remainder(mixed[..., None], self.ngram_heads_vocab_sizes[heads])
            groups.append(rows + self.ngram_heads_offsets[heads])
        return torch.cat(groups, dim=-1)

    def chunk_rows(self, token_ids: torch.Tensor, context_ids: torch.Tensor, lookup,
                   hash_rows=None) -> torch.Tensor:
        """A chunk of one sequence (token_ids [n] after its context ids) -> concatenated head embeddings
        [n, ple_embed_dim], the table's rows read by lookup(table, rows); advances the id context. `hash_rows`:
        kernels/ngram_rows.py's form of the rows (the same rows), bound to this table's constants, else torch's."""
        n = token_ids.numel()
        history = torch.cat((context_ids, token_ids.long()))
        rows = self.hash_ids(history, n) if hash_rows is None else hash_rows(history[None], n)[0]
        context_ids.copy_(history[-context_ids.numel():])
        return lookup(self.ngram_embedding, rows).flatten(-2)

    def step_rows(self, token_ids: torch.Tensor, context_ids: torch.Tensor, active: torch.Tensor,
                  lookup, hash_rows=None) -> torch.Tensor:
        """One token per row (token_ids [N], context ids [N, ngram_size - 1]): embeddings [N, ple_embed_dim]; the
        id context of active rows advances. A predecessor counts only if no EOS lies between it and the token
        (the same rule as `_shifted`). `hash_rows` as chunk_rows'."""
        history = torch.cat((context_ids, token_ids.long()[:, None]), dim=1)   # [N, ngram_size]
        if hash_rows is None:
            eos = torch.full_like(token_ids, self.eos)
            shifted = [history[:, -1]]
            for s in range(1, self.ngram_size):
                crossed = (history[:, -1 - s:-1] == self.eos).any(dim=1)
                shifted.append(torch.where(crossed, eos, history[:, -1 - s]))
            rows = self._hash(shifted)
        else:
            rows = hash_rows(history, 1)[:, 0]
        context_ids.copy_(torch.where(active[:, None], history[:, 1:], context_ids))
        return lookup(self.ngram_embedding, rows).flatten(-2)


class PLELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ple_layer_index: int):
        super().__init__()
        hidden, hc = cfg.hidden_size, cfg.hc_count
        self.hidden, self.hc_count = hidden, hc
        self.ple_embedding = NGramEmbedding(cfg, ple_layer_index)
        self.key_proj = nn.Linear(cfg.ple_embed_dim, hc * hidden, bias=False)
        self.value_proj = nn.Linear(cfg.ple_embed_dim, hidden, bias=False)
        self.norm_key = RMSNorm(hc * hidden, cfg.rms_norm_eps, group_size=hidden)
        self.norm_query = RMSNorm(hc * hidden, cfg.rms_norm_eps, group_size=hidden)
        self.norm_conv = RMSNorm(hc * hidden, cfg.rms_norm_eps, group_size=hidden)
        self.conv1d = nn.Conv1d(hc * hidden, hc * hidden, kernel_size=cfg.ple_conv_kernel_size,
                                groups=hc * hidden, dilation=cfg.ngram_size, bias=False)
        self.ple_dilation = cfg.ngram_size

    def forward(self, streams: torch.Tensor, step, state: PLEState) -> torch.Tensor:
        """streams [T, hc*H] -> the PLE term [T, hc*H] to add to them; advances the id context and the conv."""
        ops = step.ops
        embeddings = ops.ngram_embedding(self.ple_embedding, step, state.context_ids)
        keys = ops.rms_norm(ops.linear(embeddings, self.key_proj.weight, step), self.norm_key)
        value = ops.linear(embeddings, self.value_proj.weight, step)
        queries = ops.rms_norm(streams, self.norm_query).unflatten(-1, (self.hc_count, self.hidden))
        gate = (keys.unflatten(-1, (self.hc_count, self.hidden)) * queries).sum(dim=-1, keepdim=True) \
            / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        return gated + ops.causal_conv(ops.rms_norm(gated, self.norm_conv), self.conv1d.weight, self.ple_dilation,
                                       state.conv, step)
